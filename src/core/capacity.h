// Token dropping over capacity, the one implementation behind topk_route and build_routing_plan.
// Internal: trusted arguments (the front-ends validate).
#pragma once

#include <cstdint>

#include "switchyard/capacity.h"

namespace switchyard::detail {

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

}  // namespace switchyard::detail
