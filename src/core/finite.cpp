// The non-finite scan shared by every front-end that rejects NaN/Inf (gate, dispatch, combine):
// one implementation, so every op reports the first bad value the same way.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "check.h"

namespace switchyard::detail {

namespace {

// Exponent all ones <=> NaN or Inf. Integer tests on the bits vectorise.
inline bool non_finite(bf16 v) { return (v.bits & 0x7f80u) == 0x7f80u; }
inline bool non_finite(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7f800000u) == 0x7f800000u;
}
inline bool non_finite(double v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

// Flat index of the first NaN/Inf in p[0, n), or n when there is none.
template <class T>
int64_t first_non_finite(const T* p, int64_t n) {
  constexpr int64_t kChunk = 4096;
  const int64_t nchunk = (n + kChunk - 1) / kChunk;
  int64_t first = n;
#pragma omp parallel for schedule(static) reduction(min : first) if (n > (int64_t{1} << 16))
  for (int64_t c = 0; c < nchunk; ++c) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    int bad = 0;
    for (int64_t i = i0; i < i1; ++i) bad |= static_cast<int>(non_finite(p[i]));
    if (bad) {
      for (int64_t i = i0; i < i1; ++i) {
        if (non_finite(p[i])) {
          first = std::min(first, i);
          break;
        }
      }
    }
  }
  return first;
}

std::string value_str(double v) {
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}

}  // namespace

int64_t first_non_finite(const Tensor& t) {
  switch (t.dtype()) {
    case DType::bf16:
      return first_non_finite(t.data<bf16>(), t.numel());
    case DType::fp32:
      return first_non_finite(t.data<float>(), t.numel());
    default:
      return first_non_finite(t.data<double>(), t.numel());
  }
}

// Throws "[op] name has a non-finite value nan at row_name r, col_name c" for the first NaN/Inf of
// a 2-D (or 1-D, col_name null) tensor.
void check_finite(const Tensor& t, const char* op, const char* name, const char* row_name,
                  const char* col_name) {
  const int64_t i = first_non_finite(t);
  if (i == t.numel()) return;
  const std::string v = value_str(t.item_as_double(i));
  if (col_name == nullptr)
    detail::fail_arg(op, name, " has a non-finite value ", v, " at ", row_name, " ", i);
  const int64_t cols = t.size(1);
  detail::fail_arg(op, name, " has a non-finite value ", v, " at ", row_name, " ", i / cols, ", ",
                   col_name, " ", i % cols);
}

}  // namespace switchyard::detail
