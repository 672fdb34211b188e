// The routing plan: the one place where every buffer size, split size and per-expert count of a
// token permutation comes from (DESIGN.md "Dispatch invariant"). Built from `topk_idx` (and
// optionally `topk_weights`), never from T*K.
#pragma once

#include <cstdint>

#include "switchyard/capacity.h"
#include "switchyard/tensor.h"

namespace switchyard {

/// Options of build_routing_plan. Defaults: no capacity, no padding.
struct RoutingPlanOptions {
  /// Pad each expert's row block to a multiple of this (GEMM tiles); padding rows carry token -1,
  /// weight 0 and are zero-filled by permute. Must be >= 1.
  int64_t expert_alignment = 1;
  /// Per-expert capacity C = expert_capacity(T, K, E, capacity_factor) (capacity.h: Megatron's
  /// get_capacity, at most T) when > 0, T and K the rows and columns of topk_idx; 0 means no
  /// capacity; negative or non-finite is an error.
  double capacity_factor = 0.0;
  /// Explicit per-expert capacity (>= 0) that overrides capacity_factor; -1 means none.
  int64_t expert_capacity = -1;
  /// Which pairs survive when an expert is over capacity (probs: the highest merged weight).
  TokenDropPolicy token_drop_policy = TokenDropPolicy::probs;
  /// With a capacity: every expert's block gets exactly C rows (then rounded up to the alignment).
  bool pad_to_capacity = false;
};

/// A routing plan. All integer members are indices/counts (never differentiable).
///
/// Pairs are the distinct valid (token, expert) pairs of `topk_idx`: slots holding `-1` are
/// skipped, and an expert repeated within a row is ONE pair whose weight is the sum of the repeated
/// slots' weights (summed in fp32 in k order). Rows of the permuted buffer are expert-major (expert
/// 0's block first), tokens ascending within an expert, then the expert's padding rows.
struct RoutingPlan {
  int64_t num_tokens = 0;   ///< T
  int64_t num_experts = 0;  ///< E
  int64_t top_k = 0;        ///< K
  int64_t num_pairs = 0;    ///< distinct valid pairs kept (after capacity drops)
  int64_t num_dropped = 0;  ///< distinct valid pairs dropped by capacity
  int64_t num_rows = 0;     ///< rows of the permuted buffer, padding included
  /// [E] int64: pairs kept per expert (padding not counted).
  Tensor num_tokens_per_expert;
  /// [E+1] int64: exclusive prefix sum of the padded per-expert row counts; expert e owns rows
  /// [expert_offsets[e], expert_offsets[e+1]); its kept pairs come first.
  Tensor expert_offsets;
  /// [num_rows] int64: source token of each row; -1 for a padding row.
  Tensor row_token;
  /// [num_rows] int32: expert of each row (padding rows too).
  Tensor row_expert;
  /// [num_rows] fp32: the row's (merged) routing weight; 0 for padding, 1 when no weights were
  /// given.
  Tensor row_weight;
  /// [T,K] int64: row of slot (t,k); repeated ids share their row; -1 for a `-1` slot or a dropped
  /// pair.
  Tensor slot_row;
  /// [T+1] int64 and [num_pairs] int64: CSR of each token's distinct rows, in the order of the
  /// slot where the expert first appears (k ascending). Combine sums in exactly this order.
  Tensor token_offsets;
  Tensor token_rows;
};

/// Build the plan. `topk_idx` [T,K] int32 (-1 = no assignment); `topk_weights` [T,K] fp32 or an
/// undefined Tensor (weights then 1). An id outside [-1, E) is an std::invalid_argument naming the
/// token, slot and id. Deterministic; not collective; not differentiable.
RoutingPlan build_routing_plan(const Tensor& topk_idx, const Tensor& topk_weights,
                               int64_t num_experts, const RoutingPlanOptions& options = {});

}  // namespace switchyard
