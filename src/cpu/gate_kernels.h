// CPU kernels of the router gate (router_gating_linear). Raw pointers, int64_t sizes; the
// front-end (src/core/gate.cpp) has validated everything, so these trust their input.
//
// Reduction orders (the batch-invariance contract, see include/switchyard/gate.h):
//   logits[t,e]  : acc = 0; for h ascending: acc = fma(x[t,h], w[e,h], acc); acc + b[e]
//   grad_x[t,h]  : acc = 0; for e ascending: acc = fma(g[t,e], w[e,h], acc); round to x's dtype
//   grad_w[e,h]  : acc = 0; for t ascending: acc = fma(g[t,e], x[t,h], acc); round to w's dtype
//   grad_b[e]    : acc = 0; for t ascending: acc = acc + g[t,e]
// in the accumulation dtype (fp32 or fp64). Register tiles and edge tiles run the same per-lane
// chain (a vector FMA lane is exactly std::fma), and blocking over the reduced dimension keeps the
// partial sum in the accumulation dtype, so blocking and threading never change a bit.
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "switchyard/dtype.h"

namespace switchyard::cpu {

// logits [T,E] (acc_dtype) = x [T,H] (x_dtype) · weight [E,H]ᵀ (w_dtype) + bias [E] (bias_dtype;
// bias may be null). acc_dtype is fp32 or fp64; every input dtype converts exactly to it.
// gate_backward: grad_x [T,H] (x_dtype), grad_weight [E,H] (w_dtype) and, when grad_bias is not
// null, grad_bias [E] (acc_dtype) from grad_logits [T,E] (acc_dtype). Returns whether every value
// of weight and of grad_weight is finite, tested inside the kernel's own passes over them (the
// front-end's proof that its inputs were finite, without reading 2·E·H values again).
#define SY_GATE_KERNELS                                                                         \
  void gate_forward(const void* x, DType x_dtype, const void* weight, DType w_dtype,            \
                    const void* bias, DType bias_dtype, void* logits, DType acc_dtype,          \
                    int64_t num_tokens, int64_t hidden, int64_t num_experts);                   \
  bool gate_backward(const void* grad_logits, const void* x, DType x_dtype, const void* weight, \
                     DType w_dtype, void* grad_x, void* grad_weight, void* grad_bias,           \
                     DType acc_dtype, int64_t num_tokens, int64_t hidden, int64_t num_experts);
SY_CPU_DECLARE_VARIANTS(SY_GATE_KERNELS)
#undef SY_GATE_KERNELS

#ifndef SY_ISA_NS
inline void gate_forward(const void* x, DType x_dtype, const void* weight, DType w_dtype,
                         const void* bias, DType bias_dtype, void* logits, DType acc_dtype,
                         int64_t num_tokens, int64_t hidden, int64_t num_experts) {
  SY_CPU_SELECT(gate_forward)(x, x_dtype, weight, w_dtype, bias, bias_dtype, logits, acc_dtype,
                              num_tokens, hidden, num_experts);
}
inline bool gate_backward(const void* grad_logits, const void* x, DType x_dtype, const void* weight,
                          DType w_dtype, void* grad_x, void* grad_weight, void* grad_bias,
                          DType acc_dtype, int64_t num_tokens, int64_t hidden,
                          int64_t num_experts) {
  return SY_CPU_SELECT(gate_backward)(grad_logits, x, x_dtype, weight, w_dtype, grad_x, grad_weight,
                                      grad_bias, acc_dtype, num_tokens, hidden, num_experts);
}
#endif

}  // namespace switchyard::cpu
