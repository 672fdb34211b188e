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

/// The backward of a topk_route result, for the testers: the one place a change of
/// topk_route_backward's signature needs fixing. The config is the forward's; the result carries
/// it (topk_route_backward no longer takes it), so it is only documentation at the call sites.
inline RouteGrads route_backward(const Tensor& grad_topk_weights, const RouteResult& forward,
                                 [[maybe_unused]] const RouterConfig& config,
                                 const RouteBackwardOptions& options = {}) {
  return topk_route_backward(grad_topk_weights, forward, options);
}

}  // namespace switchyard::testing
