// The FP32 (or FP64) router gate: logits = x·Wᵀ + b, accumulated and returned in the router dtype
// even when x and W are bf16, with a fixed reduction order so that the result is batch invariant
// by construction.
#pragma once

#include "switchyard/tensor.h"

namespace switchyard {

/// Options of the router gate (Megatron-Core's name: `router_dtype`).
struct GateOptions {
  /// Accumulation and output dtype of the gate: DType::fp32 (default) or DType::fp64.
  DType router_dtype = DType::fp32;
};

/// The router gate, forward: `logits[t,e] = Σ_h x[t,h]·weight[e,h] + bias[e]`.
///
/// - `x`      [T, H] (num_tokens, hidden), bf16, fp32 or fp64 (fp64 only with router_dtype fp64:
///            inputs are upcast exactly, never rounded down).
/// - `weight` [E, H] (num_experts, hidden), bf16 or fp32.
/// - `bias`   [E], bf16, fp32 or fp64 (not finer than router_dtype), or an undefined Tensor for
///            no bias. The bias is added in the forward, after the sum over h.
/// - returns  [T, E] in `options.router_dtype`.
///
/// Every value is converted exactly to router_dtype and each logit is ONE accumulation chain in
/// router_dtype: `acc = 0; for h = 0..H-1: acc = fma(x[t,h], weight[e,h], acc); logit = acc + b`.
/// Hence deterministic and batch invariant: a token's logits are bitwise identical whatever T, its
/// position, the other tokens and the thread count. Not collective.
///
/// Throws std::invalid_argument (before any work) on a dtype or shape mismatch, naming the
/// argument, or on a NaN/Inf in x, weight or bias, naming the token / expert, the hidden index and
/// the value, e.g. `[router_gating_linear] x has a non-finite value nan at token 17, hidden 5`.
Tensor router_gating_linear(const Tensor& x, const Tensor& weight, const Tensor& bias,
                            const GateOptions& options = {});

/// Gradients of router_gating_linear.
struct GateGrads {
  Tensor grad_x;       ///< [T, H] in x's dtype.
  Tensor grad_weight;  ///< [E, H] in weight's dtype.
  Tensor grad_bias;    ///< [E] in router_dtype; undefined when the forward had no bias.
};

/// The router gate, backward. `grad_logits` [T, E] in router_dtype; x, weight, bias and options
/// as given to the forward (bias is only used to decide whether grad_bias is returned).
///
/// - `grad_x[t,h]      = Σ_e grad_logits[t,e]·weight[e,h]`: one chain over e ascending in
///   router_dtype, rounded once (nearest even) to x's dtype. Batch invariant like the forward.
/// - `grad_weight[e,h] = Σ_t grad_logits[t,e]·x[t,h]`: one chain over t ascending in
///   router_dtype, rounded once to weight's dtype.
/// - `grad_bias[e]     = Σ_t grad_logits[t,e]`: one sum over t ascending in router_dtype.
///
/// Deterministic and independent of the thread count (fixed reduction orders). Not collective.
/// Throws std::invalid_argument like the forward, and on a NaN/Inf in grad_logits (naming token
/// and expert).
GateGrads router_gating_linear_backward(const Tensor& grad_logits, const Tensor& x,
                                        const Tensor& weight, const Tensor& bias,
                                        const GateOptions& options = {});

}  // namespace switchyard
