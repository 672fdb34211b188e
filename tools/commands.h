// Subcommands of the `switchyard` program. Each area registers its own; main.cpp builds the app.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

/// Exit codes of the `switchyard` program.
constexpr int kExitBad = 1;    ///< the data is not intact / a data problem / a failed check
constexpr int kExitUsage = 2;  ///< bad arguments or unreadable input

/// Runs a subcommand body: DataError -> "error: ..." on `err` and exit code kExitBad;
/// std::invalid_argument, std::out_of_range, BackendError, std::bad_alloc and filesystem errors ->
/// kExitUsage; any other exception -> kExitBad. CLI11's own errors pass. Nothing escapes as an
/// uncaught exception (which would abort with 134).
void run_guarded(std::ostream& err, const std::function<void()>& body);

/// `switchyard routes import|inspect|validate|stats|diff|align`. Output goes to `out` (results)
/// and `err` (progress, diagnostics). Failures end the program through CLI::RuntimeError with
/// exit code 1 (a file that is not intact, a data problem) or 2 (bad arguments or input).
void register_routes_commands(CLI::App& app, std::ostream& out = std::cout,
                              std::ostream& err = std::cerr);

/// `switchyard quickcheck`: the engine's quick check on its embedded default (see
/// tools/quickcheck_cmd.cpp). Exit code 0 when every check of the run passed, 1 otherwise, 2 for
/// bad arguments. Also registers the old name `demo`, which only says where it went (exit code 2).
void register_quickcheck_command(CLI::App& app, std::ostream& out = std::cout,
                                 std::ostream& err = std::cerr);

/// The whole `switchyard` program on `args` (without the program name): builds the app with every
/// subcommand, parses, runs, and returns the exit code; usage errors print CLI11's message on `err`.
/// main() is this on argv; tests and the CLI fuzz target call it in-process.
int run_cli(const std::vector<std::string>& args, std::ostream& out = std::cout,
            std::ostream& err = std::cerr);
