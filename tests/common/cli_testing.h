// Running the `switchyard` program in-process for tests (tools/commands.h run_cli), with its
// output captured.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "commands.h"

namespace switchyard::testing {

/// Exit code and captured streams of one run.
struct CliRun {
  int code = 0;
  std::string out, err;
};

/// The real program on `args` (without the program name).
inline CliRun run(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  CliRun r;
  r.code = run_cli(args, out, err);
  r.out = out.str();
  r.err = err.str();
  return r;
}

}  // namespace switchyard::testing
