// Argument checks shared by the front-ends. Every failure is std::invalid_argument with a message
// "[op] argument: expected ..., got ..." so callers can tell what to fix.
#pragma once

#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>

#include "switchyard/tensor.h"

namespace switchyard::detail {

/// Build a message from stream-able parts.
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

/// Throw std::invalid_argument("[op] " + message parts).
template <class... Args>
[[noreturn]] void fail_arg(const char* op, const Args&... args) {
  throw std::invalid_argument(cat("[", op, "] ", args...));
}

/// Requires `t` to be defined.
void check_defined(const Tensor& t, const char* op, const char* name);
/// Requires t.dtype() to be one of `allowed`.
void check_dtype(const Tensor& t, const char* op, const char* name,
                 std::initializer_list<DType> allowed);
/// Requires t.shape() == expected, where an expected entry of -1 matches any size.
void check_shape(const Tensor& t, const char* op, const char* name, const Shape& expected);
/// Requires t.dim() == ndim.
void check_dim(const Tensor& t, const char* op, const char* name, int64_t ndim);

}  // namespace switchyard::detail
