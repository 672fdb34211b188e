// The `switchyard` command-line program: one CLI11 app, each area registers its subcommands.
#include <CLI/CLI.hpp>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"switchyard: MoE routing toolkit for RL post-training"};
  app.require_subcommand(1);
  register_routes_commands(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
