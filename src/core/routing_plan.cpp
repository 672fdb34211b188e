// Front-end and builder of the routing plan. Building is a counting sort over distinct pairs,
// O(T*K + E), or for E > 4*T*K a sort of the pairs, O(T*K log(T*K)) plus writing the [E] counts;
// single-threaded (it is tiny next to the row movement it sizes).
#include "switchyard/routing_plan.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/backend.h"
#include "check.h"
#include "switchyard/capacity.h"

namespace switchyard {

namespace {

constexpr const char* kOp = "routing_plan";

}  // namespace

RoutingPlan build_routing_plan(const Tensor& topk_idx, const Tensor& topk_weights,
                               int64_t num_experts, const RoutingPlanOptions& options) {
  detail::check_defined(topk_idx, kOp, "topk_idx");
  detail::check_dim(topk_idx, kOp, "topk_idx", 2);
  detail::check_dtype(topk_idx, kOp, "topk_idx", {DType::int32});
  const int64_t T = topk_idx.size(0), K = topk_idx.size(1), E = num_experts;
  if (E < 1) detail::fail_arg(kOp, "num_experts must be >= 1, got num_experts=", E);
  const bool has_w = topk_weights.defined();
  if (has_w) {
    detail::check_dtype(topk_weights, kOp, "topk_weights", {DType::fp32});
    detail::check_shape(topk_weights, kOp, "topk_weights", {T, K});
  }
  if (options.expert_alignment < 1) {
    detail::fail_arg(
        kOp, "expert_alignment must be >= 1, got expert_alignment=", options.expert_alignment);
  }
  if (options.expert_capacity < -1) {
    detail::fail_arg(kOp, "expert_capacity must be >= 0 or -1 (none), got expert_capacity=",
                     options.expert_capacity);
  }
  if (!std::isfinite(options.capacity_factor) || options.capacity_factor < 0.0) {
    detail::fail_arg(kOp, "capacity_factor must be finite and >= 0 (0 = no capacity), got ",
                     "capacity_factor=", options.capacity_factor);
  }
  if (options.token_drop_policy != TokenDropPolicy::probs &&
      options.token_drop_policy != TokenDropPolicy::position) {
    detail::fail_arg(kOp, "token_drop_policy must be probs or position, got value ",
                     static_cast<int>(options.token_drop_policy));
  }
  const int32_t* idx = topk_idx.data<int32_t>();
  const float* w = has_w ? topk_weights.data<float>() : nullptr;
  const backend::Context ctx = backend::context_of(topk_idx, kOp);
  {
    const int64_t i = backend::first_id_out_of_range(ctx, idx, T * K, -1, E);
    if (i < T * K) {
      detail::fail_arg(kOp, "topk_idx must hold ids in [0, num_experts=", E,
                       ") or -1, got topk_idx[", i / K, ", ", i % K, "]=", idx[i]);
    }
  }

  int64_t capacity = -1;
  if (options.expert_capacity >= 0) {
    capacity = options.expert_capacity;
  } else if (options.capacity_factor > 0.0) {
    capacity = expert_capacity(T, K, E, options.capacity_factor);
  }
  if (options.pad_to_capacity && capacity < 0) {
    detail::fail_arg(kOp, "pad_to_capacity needs a capacity (capacity_factor > 0 or ",
                     "expert_capacity >= 0), got neither");
  }

  return backend::build_routing_plan(ctx, idx, w, T, K, E, capacity, options.token_drop_policy,
                                     options.expert_alignment, options.pad_to_capacity);
}

}  // namespace switchyard
