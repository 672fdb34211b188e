// The `switchyard` command-line program: one CLI11 app, each area registers its subcommands
// (see commands.h).
#include <csignal>
#include <string>
#include <vector>

#include "commands.h"

int main(int argc, char** argv) {
  // Past a file size limit (ulimit -f) a write then fails with EFBIG, which the command reports
  // (exit 2) after removing its partial output, instead of the process dying mid-write.
  std::signal(SIGXFSZ, SIG_IGN);
  return run_cli(std::vector<std::string>(argv + 1, argv + argc));
}
