// Router test helpers shared by the router, replay and bad-input tests.
#pragma once

#include <cstdint>

#include "switchyard/router.h"

namespace switchyard::testing {

/// A RouterConfig with E experts, top-K, a score function and pre_softmax; every other field at
/// its (Megatron-Core) default.
inline RouterConfig router_config(int64_t num_experts, int64_t top_k,
                                  ScoreFunction score_function = ScoreFunction::softmax,
                                  bool pre_softmax = false) {
  RouterConfig c;
  c.num_experts = num_experts;
  c.top_k = top_k;
  c.score_function = score_function;
  c.pre_softmax = pre_softmax;
  return c;
}

}  // namespace switchyard::testing
