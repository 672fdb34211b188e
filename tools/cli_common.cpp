// What every subcommand shares: library errors become a message and an exit code.
#include <filesystem>
#include <functional>
#include <new>
#include <stdexcept>

#include "commands.h"
#include "switchyard/error.h"

using switchyard::BackendError;
using switchyard::DataError;

// Runs a command body, turning library errors into a message on `err` and an exit code.
void run_guarded(std::ostream& err, const std::function<void()>& body) {
  try {
    body();
  } catch (const CLI::Error&) {
    throw;
  } catch (const DataError& e) {
    err << "error: " << e.what() << "\n";
    throw CLI::RuntimeError(kExitBad);
  } catch (const std::invalid_argument& e) {
    err << "error: " << e.what() << "\n";
    throw CLI::RuntimeError(kExitUsage);
  } catch (const std::out_of_range& e) {
    err << "error: " << e.what() << "\n";
    throw CLI::RuntimeError(kExitUsage);
  } catch (const BackendError& e) {
    err << "error: " << e.what() << "\n";
    throw CLI::RuntimeError(kExitUsage);
  } catch (const std::bad_alloc&) {
    // Sizes the machine cannot hold (quickcheck sizes, a huge table): a message, never an abort.
    err << "error: out of memory: the sizes asked for cannot be allocated on this machine\n";
    throw CLI::RuntimeError(kExitUsage);
  } catch (const std::filesystem::filesystem_error& e) {
    err << "error: " << e.what() << "\n";
    throw CLI::RuntimeError(kExitUsage);
  } catch (const std::exception& e) {
    err << "error: " << e.what() << "\n";
    throw CLI::RuntimeError(kExitBad);
  } catch (...) {
    err << "error: unknown exception\n";
    throw CLI::RuntimeError(kExitBad);
  }
}


int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  CLI::App app{"switchyard: MoE routing engine for RL post-training (route data, replay, quick check)",
               "switchyard"};
  app.require_subcommand(1);
  register_routes_commands(app, out, err);
  register_quickcheck_command(app, out, err);
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 parses from the back
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    return app.exit(e, out, err);
  } catch (const std::exception& e) {  // outside run_guarded (an option check, a callback)
    err << "error: " << e.what() << "\n";
    return kExitBad;
  } catch (...) {
    err << "error: unknown exception\n";
    return kExitBad;
  }
  return 0;
}
