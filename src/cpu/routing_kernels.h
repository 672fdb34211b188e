// CPU kernels of the routing steps between the router's and the permute's main kernels: capacity
// drops (the one implementation, shared by the router and the routing plan), sinkhorn and
// quantile-balancing row preparation, the expert-bias cast and the row-to-slot scatter. Raw
// pointers, trusted arguments (the front-ends in src/core validate); compiled once (no per-ISA
// variants: they are index work, not arithmetic loops). Reached through src/backend/backend.h.
#pragma once

#include <cstdint>

#include "switchyard/capacity.h"
#include "switchyard/dtype.h"
#include "switchyard/routing_plan.h"

namespace switchyard::cpu {

/// One expert's entries: `items[0..n)` are ids into `weights` and `kept`, in ascending token
/// order. When n > capacity, sets kept[item] = 0 for the n - capacity entries the policy drops
/// (probs: the lowest weights, ties drop the later token; position: the last n - capacity) and
/// returns n - capacity; else returns 0. `items` is not modified. capacity >= 0.
template <class W>
int64_t drop_over_capacity(const int64_t* items, int64_t n, const W* weights, int64_t capacity,
                           TokenDropPolicy policy, uint8_t* kept);

/// Capacity on a [T, K] id table (rows hold distinct ids or -1): copies selected_idx / weights to
/// topk_idx / out_weights with -1 / 0 at the dropped slots, writes the kept pairs per expert to
/// counts [E] and returns the number dropped. capacity < 0: no limit. Deterministic and
/// thread-count invariant (each expert's decision depends only on its own entries).
template <class S>
int64_t apply_capacity(const int32_t* selected_idx, const S* weights, int64_t T, int64_t K,
                       int64_t E, int64_t capacity, TokenDropPolicy policy, int32_t* topk_idx,
                       S* out_weights, int64_t* counts);

/// dst[i] = S(src[i]) for n values of src_dtype (fp32 or fp64), through double.
template <class S>
void cast_values(const void* src, DType src_dtype, int64_t n, S* dst);

/// Sinkhorn routing's ids: sinkhorn_select over the non-padded rows (row_kind != kRowPadded) into
/// ids [T, K] (padded rows stay -1), replayed rows take their replay_idx row, and the native rows
/// become kRowReplayed in kernel_kind (they then route like replayed rows).
template <class S>
void sinkhorn_rows(const S* logits, const int32_t* replay_idx, const uint8_t* row_kind, int64_t T,
                   int64_t E, int64_t K, double tol, int32_t* ids, uint8_t* kernel_kind);

/// Quantile balancing (Megatron's qb_dual_update) on fp32 logits z [T, E] and beta [E]: native
/// rows take the top-k of z - beta (ties: the larger logit, then the lower id), replayed rows
/// their replay_idx row, into ids [T, K]; native rows become kRowReplayed in kernel_kind. When
/// beta_local is not null (training, T > 0, T*K divisible by E) it gets, per expert, the
/// (T*K/E + 1)-th largest of z - alpha over the tokens (alpha: each row's (K+1)-th key).
void quantile_balancing_rows(const float* z, const float* beta, const int32_t* replay_idx,
                             const uint8_t* row_kind, int64_t T, int64_t E, int64_t K, int32_t* ids,
                             uint8_t* kernel_kind, float* beta_local);

/// The routing plan of a validated [T, K] id table (ids in [0, E) or -1) and its weights (null:
/// 1), with the capacity (-1: none), drop policy, expert alignment (>= 1) and pad_to_capacity
/// (needs capacity >= 0) already checked by the front-end (src/core/routing_plan.cpp). Repeated
/// ids in a row merge into one pair (weights summed in k order); pairs are bucketed by expert in
/// token order, dropped over capacity, laid out as rows with padding rows (token -1, weight 0);
/// slot_row and the token CSR complete the plan. Tensors are host tensors.
RoutingPlan build_routing_plan(const int32_t* idx, const float* w, int64_t T, int64_t K, int64_t E,
                               int64_t capacity, TokenDropPolicy policy, int64_t align,
                               bool pad_to_capacity);

/// out[s] = slot_row[s] >= 0 ? row_values[slot_row[s]] : 0 for s in [0, num_slots).
void rows_to_slots(const float* row_values, const int64_t* slot_row, int64_t num_slots, float* out);

}  // namespace switchyard::cpu
