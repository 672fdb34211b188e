// Subcommands of the `switchyard` program. Each area registers its own; main.cpp builds the app.
#pragma once

#include <CLI/CLI.hpp>
#include <iostream>

/// `switchyard routes import|inspect|validate|stats|diff|align`. Output goes to `out` (results)
/// and `err` (progress, diagnostics). Failures end the program through CLI::RuntimeError with
/// exit code 1 (a file that is not intact, a data problem) or 2 (bad arguments or input).
void register_routes_commands(CLI::App& app, std::ostream& out = std::cout,
                              std::ostream& err = std::cerr);

// Other areas add theirs here, e.g. `void register_demo_command(CLI::App& app);`.
