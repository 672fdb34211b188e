// The `switchyard` command-line program: one CLI11 app, each area registers its subcommands
// (see commands.h).
#include <string>
#include <vector>

#include "commands.h"

int main(int argc, char** argv) {
  return run_cli(std::vector<std::string>(argv + 1, argv + argc));
}
