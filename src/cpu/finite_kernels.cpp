#include "cpu/finite_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "cpu/simd.h"

// SY_ISA_NS: this file is compiled once per kernel variant (src/cpu/isa.h).
namespace switchyard::cpu::SY_ISA_NS {

namespace {

template <class U>
int64_t first_in(const U* u, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i)
    if (simd::is_non_finite(u[i])) return i;
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
    if (simd::any_non_finite(u + i0, i1 - i0)) first = std::min(first, first_in(u, i0, i1));
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
