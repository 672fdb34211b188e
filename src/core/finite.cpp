// The non-finite check shared by every front-end that rejects NaN/Inf (gate, router, dispatch,
// combine): one message, so every op reports the first bad value the same way. The scan itself is a
// value check behind the backend seam (backend::first_non_finite; on the CPU the one scan of
// src/cpu/finite_kernels.cpp, one threading policy, run-time ISA).
#include <cmath>
#include <string>

#include "backend/backend.h"
#include "check.h"

namespace switchyard::detail {

namespace {

std::string value_str(double v) {
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}

}  // namespace

int64_t first_non_finite(const Tensor& t) {
  return backend::first_non_finite(backend::context_of(t), t.raw(), t.dtype(), t.numel());
}

// Throws "[op] name has a non-finite value nan at row_name r, col_name c" for the first NaN/Inf of
// a 2-D (or 1-D, col_name null) tensor.
void check_finite(const Tensor& t, const char* op, const char* name, const char* row_name,
                  const char* col_name) {
  const int64_t i =
      backend::first_non_finite(backend::context_of(t, op), t.raw(), t.dtype(), t.numel());
  if (i == t.numel()) return;
  const std::string v = value_str(t.item_as_double(i));
  if (col_name == nullptr)
    detail::fail_arg(op, name, " has a non-finite value ", v, " at ", row_name, " ", i);
  const int64_t cols = t.size(1);
  detail::fail_arg(op, name, " has a non-finite value ", v, " at ", row_name, " ", i / cols, ", ",
                   col_name, " ", i % cols);
}

}  // namespace switchyard::detail
