// What every subcommand shares: library errors become a message and an exit code.
#include <functional>
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
  }
}

