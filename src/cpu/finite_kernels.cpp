#include "cpu/finite_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

// SY_ISA_NS: this file is compiled once per kernel variant (src/cpu/isa.h).
namespace switchyard::cpu::SY_ISA_NS {

namespace {

// Exponent all ones <=> NaN or Inf. Integer tests on the bits vectorise (no FP compare, so no
// FP exception or -ffast-math assumption is involved).
template <class U>
constexpr U exponent_mask() {
  if constexpr (sizeof(U) == 2) {
    return 0x7f80u;
  } else if constexpr (sizeof(U) == 4) {
    return 0x7f800000u;
  } else {
    return 0x7ff0000000000000ull;
  }
}

// Whether any element of u[0, n) is non-finite (branch-free over the whole range).
template <class U>
bool any_non_finite(const U* u, int64_t n) {
  constexpr U kExp = exponent_mask<U>();
  U bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<U>((u[i] & kExp) == kExp);
  return bad != 0;
}

template <class U>
int64_t first_in(const U* u, int64_t i0, int64_t i1) {
  constexpr U kExp = exponent_mask<U>();
  for (int64_t i = i0; i < i1; ++i)
    if ((u[i] & kExp) == kExp) return i;
  return i1;
}

template <class U>
int64_t first_non_finite_bits(const U* u, int64_t n) {
  constexpr int64_t kChunk = 16384;
  const int64_t nchunk = (n + kChunk - 1) / kChunk;
  int64_t first = n;
  const bool parallel = n * static_cast<int64_t>(sizeof(U)) >= kFiniteParallelBytes;
#pragma omp parallel for schedule(static) reduction(min : first) if (parallel)
  for (int64_t c = 0; c < nchunk; ++c) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    if (any_non_finite(u + i0, i1 - i0)) first = std::min(first, first_in(u, i0, i1));
  }
  return first;
}

}  // namespace

int64_t first_non_finite(const void* p, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::bf16:
      return first_non_finite_bits(static_cast<const uint16_t*>(p), n);
    case DType::fp32:
      return first_non_finite_bits(static_cast<const uint32_t*>(p), n);
    default:
      return first_non_finite_bits(static_cast<const uint64_t*>(p), n);
  }
}

}  // namespace switchyard::cpu::SY_ISA_NS
