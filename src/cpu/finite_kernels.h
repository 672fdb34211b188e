// The non-finite scan, the one implementation behind every NaN/Inf check of the front-ends
// (src/core/finite.cpp: gate, router, dispatch, combine). Compiled once per kernel variant: the
// exponent test vectorises to the variant's width.
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "switchyard/dtype.h"

namespace switchyard::cpu {

// first_non_finite: flat index of the first NaN/Inf of p[0, n) (dtype bf16, fp32 or fp64), or n
//   when there is none. The lowest index whatever the thread count. Threading policy: one thread
//   below kFiniteParallelBytes (a parallel region costs more than it saves on a few MB, much more
//   on a shared machine), OpenMP above.
inline constexpr int64_t kFiniteParallelBytes = int64_t{8} << 20;
#define SY_FINITE_KERNELS int64_t first_non_finite(const void* p, DType dtype, int64_t n);
SY_CPU_DECLARE_VARIANTS(SY_FINITE_KERNELS)
#undef SY_FINITE_KERNELS

#ifndef SY_ISA_NS
inline int64_t first_non_finite(const void* p, DType dtype, int64_t n) {
  return SY_CPU_SELECT(first_non_finite)(p, dtype, n);
}
#endif

}  // namespace switchyard::cpu
