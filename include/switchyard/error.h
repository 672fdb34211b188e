// Error types of the switchyard engine.
#pragma once

#include <stdexcept>
#include <string>

namespace switchyard {

/// Failure of the environment (MPI, CUDA, file I/O), not of the caller's arguments.
/// The message names the call, its error string, the rank (when known) and file:line.
class BackendError : public std::runtime_error {
 public:
  explicit BackendError(const std::string& what) : std::runtime_error(what) {}
};

/// Stored data (a route file, an imported array) is corrupt or truncated. The message says what is
/// wrong and where (byte offset, block, sequence).
class DataError : public std::runtime_error {
 public:
  explicit DataError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace switchyard
