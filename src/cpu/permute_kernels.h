// Row-movement kernels of permute / unpermute / combine. Raw pointers, int64 sizes; they trust
// their input (the front-ends validate). Every row is computed by one thread in a fixed order, so
// results never depend on the thread count, and the same kernel serves permute at EP=1 and the
// dispatchers at any EP (which is what makes them bitwise EP-invariant).
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "switchyard/dtype.h"

namespace switchyard::cpu {

/// Calls f(float{}) for fp32 rows and f(bf16{}) otherwise (the two row dtypes the movers take).
template <class F>
void by_row_dtype(DType d, F&& f) {
  if (d == DType::fp32) {
    f(float{});
  } else {
    f(bf16{});
  }
}

// gather_rows: dst[r] = src[index[r]] (row_bytes bytes each), zero when index[r] < 0.
// combine_rows: out[t] = sum_{j in [offsets[t], offsets[t+1])} weight[rows[j]] * y[rows[j]], in j
//   order, fp32 fma accumulation starting from 0 (weight == nullptr: weight 1, plain adds). T rows
//   of H.
// gather_scale_rows: out[r] = weight[r] * g[index[r]] (weight == nullptr: a copy), zero when
//   index[r] < 0. index == nullptr means g[r].
// row_dots: out[r] = <a[r], b[index[r]]> accumulated in fp32 in a fixed lane order; 0 when
//   index[r] < 0. index == nullptr means b[r].
#define SY_PERMUTE_KERNELS                                                                     \
  void gather_rows(const void* src, const int64_t* index, int64_t num_rows, int64_t row_bytes, \
                   void* dst);                                                                 \
  template <class X>                                                                           \
  void combine_rows(const X* y, const float* weight, const int64_t* offsets, const int64_t* rows, \
                    int64_t T, int64_t H, X* out);                                             \
  template <class X>                                                                           \
  void gather_scale_rows(const X* g, const float* weight, const int64_t* index,                \
                         int64_t num_rows, int64_t H, X* out);                                 \
  template <class X>                                                                           \
  void row_dots(const X* a, const X* b, const int64_t* index, int64_t num_rows, int64_t H,     \
                float* out);
SY_CPU_DECLARE_VARIANTS(SY_PERMUTE_KERNELS)
#undef SY_PERMUTE_KERNELS

#ifndef SY_ISA_NS
inline void gather_rows(const void* src, const int64_t* index, int64_t num_rows,
                        int64_t row_bytes, void* dst) {
  SY_CPU_SELECT(gather_rows)(src, index, num_rows, row_bytes, dst);
}
template <class X>
inline void combine_rows(const X* y, const float* weight, const int64_t* offsets,
                         const int64_t* rows, int64_t T, int64_t H, X* out) {
  SY_CPU_SELECT(combine_rows<X>)(y, weight, offsets, rows, T, H, out);
}
template <class X>
inline void gather_scale_rows(const X* g, const float* weight, const int64_t* index,
                              int64_t num_rows, int64_t H, X* out) {
  SY_CPU_SELECT(gather_scale_rows<X>)(g, weight, index, num_rows, H, out);
}
template <class X>
inline void row_dots(const X* a, const X* b, const int64_t* index, int64_t num_rows, int64_t H,
                     float* out) {
  SY_CPU_SELECT(row_dots<X>)(a, b, index, num_rows, H, out);
}
#endif

}  // namespace switchyard::cpu
