// The router's scores / selection / capacity forward: kernel parameters from the config, the CPU
// kernels, bf16 rounding of the weights, then the shared capacity rule (capacity.h).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "check.h"
#include "router_internal.h"

namespace switchyard::detail {

backend::RouteKernelParams kernel_params(const RouterConfig& c, int64_t T) {
  backend::RouteKernelParams p;
  p.num_tokens = T;
  p.num_experts = c.num_experts;
  p.top_k = c.top_k;
  p.score_function = static_cast<int>(c.score_function);
  p.pre_softmax = c.pre_softmax;
  if (c.aux_loss_type == AuxLossType::sinkhorn) {
    // Megatron's _sinkhorn_activation: sigmoid for K = 1, softmax over all E for K > 1, the
    // weights taken at the selected ids without renormalisation.
    p.score_function = c.top_k == 1 ? backend::kScoreSigmoid : backend::kScoreSoftmax;
    p.pre_softmax = c.top_k > 1;
  }
  p.num_groups = c.num_groups;
  p.group_topk = c.group_topk;
  p.scaling = c.topk_scaling_factor;
  return p;
}

template <class S>
void run_forward(const Tensor& logits, const Tensor& bias, const Tensor& replay_idx,
                 const Tensor& row_kind, const backend::RouteKernelParams& p, int64_t capacity,
                 TokenDropPolicy drop_policy, bool round_weights_to_bf16, RouteResult& r,
                 RouteSaved& saved, std::vector<double>& aux_psum, std::vector<int64_t>& aux_cnt,
                 double& z_sum) {
  const int64_t T = p.num_tokens, K = p.top_k, E = p.num_experts;
  Tensor sel_w = Tensor::empty({T, K}, dtype_of<S>());
  const backend::Context ctx = backend::context_of(logits, kRouteOp);
  std::vector<S> bias_s;
  if (bias.defined()) {
    bias_s.resize(static_cast<size_t>(E));
    backend::cast_values<S>(ctx, bias.raw(), bias.dtype(), E, bias_s.data());
  }
  backend::route_forward<S>(
      ctx, logits.data<S>(), bias_s.empty() ? nullptr : bias_s.data(), row_kind.data<uint8_t>(),
      replay_idx.defined() ? replay_idx.data<int32_t>() : nullptr, p,
      saved.selected_idx.data<int32_t>(), sel_w.data<S>(), aux_psum.data(), aux_cnt.data(), &z_sum);
  if constexpr (std::is_same_v<S, float>) {
    // bf16 logits (Megatron's moe_router_dtype=None): the weights are computed in fp32 and
    // rounded to bf16 once, before capacity, so the probs drop policy sorts the bf16 values.
    if (round_weights_to_bf16) {
      float* w = sel_w.data<float>();
      for (int64_t i = 0; i < T * K; ++i) w[i] = bf16_to_float(float_to_bf16(w[i]));
    }
  }
  r.num_dropped =
      backend::apply_capacity<S>(ctx, saved.selected_idx.data<int32_t>(), sel_w.data<S>(), T, K, E,
                                 capacity, drop_policy, r.topk_idx.data<int32_t>(),
                                 r.topk_weights.data<S>(), r.num_tokens_per_expert.data<int64_t>());
}

template void run_forward<float>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const backend::RouteKernelParams&, int64_t, TokenDropPolicy, bool,
                                 RouteResult&, RouteSaved&, std::vector<double>&,
                                 std::vector<int64_t>&, double&);
template void run_forward<double>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const backend::RouteKernelParams&, int64_t, TokenDropPolicy, bool,
                                  RouteResult&, RouteSaved&, std::vector<double>&,
                                  std::vector<int64_t>&, double&);

}  // namespace switchyard::detail
