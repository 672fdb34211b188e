// Token permutation along a RoutingPlan: permute (token rows -> expert-major rows) and unpermute
// (weighted combine back to tokens), with their backwards. fp32 or bf16 rows; unpermute accumulates
// in fp32 in a fixed order, so results are deterministic and independent of the thread count.
#pragma once

#include <cstdint>

#include "switchyard/routing_plan.h"
#include "switchyard/tensor.h"

namespace switchyard {

/// Whether unpermute/combine multiplies each row by its routing weight.
enum class WeightMode : uint8_t {
  apply,  ///< y_t = sum_k p_{t,k} * Y[row(t,k)]
  skip,   ///< y_t = sum_k Y[row(t,k)] (experts already applied the weights)
};

/// Options of unpermute / unpermute_backward (and of combine).
struct UnpermuteOptions {
  WeightMode weights = WeightMode::apply;
};

/// permuted[r] = x[plan.row_token[r]], zero for padding rows.
/// `x` [T,H] fp32 or bf16 -> [plan.num_rows, H] same dtype. Bit-exact copy; deterministic.
Tensor permute(const Tensor& x, const RoutingPlan& plan);

/// As permute, writing into caller-allocated `out` [plan.num_rows, H] of x's dtype (reuse it across
/// steps: a fresh multi-MiB allocation costs more page faults than the copy itself).
void permute_into(const Tensor& x, Tensor& out, const RoutingPlan& plan);

/// Backward of permute, which is unpermute without weights: grad_x[t] = sum of grad_permuted over
/// t's rows, fp32 accumulation in the plan's fixed order. `grad_permuted` [num_rows,H] fp32|bf16
/// -> [T,H] same dtype (tokens without rows get zeros).
Tensor permute_backward(const Tensor& grad_permuted, const RoutingPlan& plan);

/// y[t] = sum over t's distinct rows (order of first slot, k ascending) of w_row * permuted[row],
/// accumulated in fp32 (fma), written in permuted's dtype. `permuted` [num_rows,H] fp32|bf16 ->
/// [T,H]. Tokens with no rows get zeros. Deterministic.
Tensor unpermute(const Tensor& permuted, const RoutingPlan& plan,
                 const UnpermuteOptions& options = {});

/// As unpermute, writing into caller-allocated `out` [plan.num_tokens, H] of permuted's dtype.
void unpermute_into(const Tensor& permuted, Tensor& out, const RoutingPlan& plan,
                    const UnpermuteOptions& options = {});

/// Gradients of unpermute.
struct UnpermuteGrads {
  /// [num_rows,H], grad_y's dtype: w_row * grad_y[token(row)] (or grad_y[token(row)] with skip);
  /// zero for padding rows.
  Tensor grad_permuted;
  /// [T,K] fp32: <permuted[slot_row(t,k)], grad_y[t]> for every slot with a row (a repeated id gets
  /// the same value in each of its slots, since y depends on their sum); 0 for `-1`/dropped slots
  /// and when weights are skipped.
  Tensor grad_topk_weights;
};

/// The [T,K] view of a per-row value: out[t,k] = row_values[plan.slot_row[t,k]], 0 for `-1` and
/// dropped slots (a repeated id gives its row's value to each of its slots). `row_values`
/// [plan.num_rows] fp32 -> [T,K] fp32. This is how every routing-weight gradient reaches the
/// slots (a row's weight is the sum of its slots' weights). Not differentiable; deterministic.
Tensor rows_to_slots(const Tensor& row_values, const RoutingPlan& plan);

/// Backward of unpermute. `grad_y` [T,H] fp32|bf16; `permuted` the forward input [num_rows,H].
UnpermuteGrads unpermute_backward(const Tensor& grad_y, const Tensor& permuted,
                                  const RoutingPlan& plan, const UnpermuteOptions& options = {});

}  // namespace switchyard
