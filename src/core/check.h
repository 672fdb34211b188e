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

/// `path` (a __FILE__) from its last "src/" directory on, so a message names
/// "src/routes/route_file.cpp" whatever directory the build ran in (through ccache, whose
/// CCACHE_BASEDIR makes the compiler see "../src/...").
constexpr const char* source_file(const char* path) {
  const char* from = path;
  for (const char* p = path; *p; ++p)
    if ((p == path || p[-1] == '/') && p[0] == 's' && p[1] == 'r' && p[2] == 'c' && p[3] == '/')
      from = p;
  return from;
}
#define SY_SOURCE_FILE (::switchyard::detail::source_file(__FILE__))

/// Throw std::invalid_argument("[op] " + message parts).
template <class... Args>
[[noreturn]] void fail_arg(const char* op, const Args&... args) {
  throw std::invalid_argument(cat("[", op, "] ", args...));
}

/// Requires `path` to name a file the OS can be given: not empty and without a NUL byte (a C path
/// ends at the first NUL, so "dir/model\0.syr" would open "dir/model"). Throws
/// std::invalid_argument "[op] name holds an embedded null byte at offset i (...)".
inline void check_path(const std::string& path, const char* op, const char* name) {
  if (path.empty()) fail_arg(op, name, " must not be empty");
  const size_t nul = path.find('\0');
  if (nul == std::string::npos) return;
  std::string shown;
  for (char c : path) shown += c == '\0' ? std::string("\\0") : std::string(1, c);
  fail_arg(op, name, " holds an embedded null byte at offset ", nul, " (\"", shown,
           "\"): the OS would read it as \"", path.substr(0, nul), "\"");
}

/// Requires `t` to be defined.
void check_defined(const Tensor& t, const char* op, const char* name);
/// Requires t.dtype() to be one of `allowed`.
void check_dtype(const Tensor& t, const char* op, const char* name,
                 std::initializer_list<DType> allowed);
/// Requires t.shape() == expected, where an expected entry of -1 matches any size.
void check_shape(const Tensor& t, const char* op, const char* name, const Shape& expected);
/// Requires a defined `t` to live on `device` (undefined optional tensors pass).
void check_device(const Tensor& t, const char* op, const char* name, const Device& device);
/// Requires t.dim() == ndim.
void check_dim(const Tensor& t, const char* op, const char* name, int64_t ndim);

/// Flat index of the first NaN/Inf of a bf16/fp32/fp64 tensor, or numel() when there is none
/// (lowest index whatever the thread count). Defined in finite.cpp.
int64_t first_non_finite(const Tensor& t);
/// Throws "[op] name has a non-finite value nan at row_name r, col_name c" for the first NaN/Inf
/// of a 2-D (or 1-D, col_name null) tensor.
void check_finite(const Tensor& t, const char* op, const char* name, const char* row_name,
                  const char* col_name);

}  // namespace switchyard::detail
