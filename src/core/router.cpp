// Router front-end: topk_route validates every argument before any work, classifies the rows,
// runs the balancing selection, the scores / selection / capacity forward and the losses (each in
// its own file, see router_internal.h); topk_route_backward runs the backward kernels. Kernels
// and value checks go through the backend seam (src/backend/backend.h).
#include "switchyard/router.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "router_internal.h"

namespace switchyard {

using namespace detail;  // the router's internal pieces (router_internal.h)

namespace {

constexpr const char* kOp = kRouteOp;

RouteResult topk_route_impl(const Tensor& logits_in, const RouteInputs& inputs,
                            const RouterConfig& config, const RouteOptions& options,
                            const RouteComms* comms, bool* agreed);

}  // namespace

RouteResult topk_route(const Tensor& logits, const RouteInputs& inputs, const RouterConfig& config,
                       const RouteOptions& options) {
  return topk_route_impl(logits, inputs, config, options, nullptr, nullptr);
}

RouteResult topk_route(const Tensor& logits, const RouteInputs& inputs, const RouterConfig& config,
                       const RouteOptions& options, const RouteComms& comms) {
  bool agreed = false;
  try {
    return topk_route_impl(logits, inputs, config, options, &comms, &agreed);
  } catch (const std::exception& e) {
    if (agreed) throw;
    // A local failure before the agreement: take part in it with this rank's message (so no rank
    // waits forever), and every rank throws the same error, the lowest failing rank's. An error
    // other than a bad argument (an allocation, the backend) stays this rank's own here.
    const std::exception_ptr own = std::current_exception();
    const bool bad_arg = dynamic_cast<const std::invalid_argument*>(&e) != nullptr;
    try {
      agree_route(comms, e.what(), {});
    } catch (const std::invalid_argument&) {
      if (bad_arg) throw;
    }
    std::rethrow_exception(own);
  }
}

namespace {

RouteResult topk_route_impl(const Tensor& logits_in, const RouteInputs& inputs,
                            const RouterConfig& config, const RouteOptions& options,
                            const RouteComms* comms, bool* agreed) {
  // ---- validation (before any work) ----
  validate_router_config(config);
  detail::check_dtype(logits_in, kOp, "logits", {DType::bf16, DType::fp32, DType::fp64});
  detail::check_shape(logits_in, kOp, "logits", {-1, config.num_experts});
  // bf16 logits (Megatron's default moe_router_dtype=None): bf16 -> fp32 is exact, and Megatron
  // computes every score in fp32 from them, so the fp32 path runs on the upcast logits and the
  // weights are rounded to bf16 at the end.
  const bool is_bf16 = logits_in.dtype() == DType::bf16;
  Tensor logits = is_bf16 ? logits_in.to(DType::fp32) : logits_in;
  if (config.force_load_balancing || config.force_biased != 0.0) {
    // Benchmarking: route on random logits; the backward differentiates at them and its
    // gradient goes to the given logits unchanged (straight through, Megatron's RandomSTE).
    logits = forced_logits(logits, config, options);
  }
  const int64_t T = logits.size(0), E = config.num_experts, K = config.top_k;
  const bool is64 = logits.dtype() == DType::fp64;
  {
    const int64_t bad = backend::first_non_finite(backend::context_of(logits, kOp), logits.raw(),
                                                  logits.dtype(), T * E);
    if (bad < T * E) {
      detail::fail_arg(kOp, layer_prefix(options.layer), "logits must be finite, got ",
                       logits.item_as_double(bad), " at token ", bad / E, ", expert ", bad % E);
    }
  }
  const Tensor& bias = inputs.expert_bias;
  if (bias.defined() && (config.aux_loss_type == AuxLossType::sinkhorn ||
                         config.aux_loss_type == AuxLossType::quantile_balancing)) {
    detail::fail_arg(kOp, aux_loss_type_name(config.aux_loss_type),
                     " routing takes no expert_bias, got one");
  }
  if (bias.defined()) {
    detail::check_dtype(bias, kOp, "expert_bias", {DType::fp32, DType::fp64});
    detail::check_shape(bias, kOp, "expert_bias", {E});
    detail::check_device(bias, kOp, "expert_bias", logits.device());
    const int64_t e =
        backend::first_non_finite(backend::context_of(bias, kOp), bias.raw(), bias.dtype(), E);
    if (e < E) {
      detail::fail_arg(kOp, "expert_bias must be finite, got ", bias.item_as_double(e),
                       " at expert ", e);
    }
  }
  const bool qb = config.aux_loss_type == AuxLossType::quantile_balancing;
  if (inputs.qb_beta.defined()) {
    detail::check_dtype(inputs.qb_beta, kOp, "qb_beta", {DType::fp32});
    detail::check_shape(inputs.qb_beta, kOp, "qb_beta", {E});
  }
  if (qb && inputs.padding_mask.defined()) {
    detail::fail_arg(kOp, "quantile_balancing takes no padding_mask (as in Megatron), got one");
  }
  if (qb && options.training && (T * K) % E != 0) {
    detail::fail_arg(kOp,
                     "quantile_balancing while training needs num_tokens * top_k divisible "
                     "by num_experts=",
                     E, ", got ", T, " * ", K);
  }
  const Tensor& mask = inputs.padding_mask;
  if (mask.defined()) {
    detail::check_dtype(mask, kOp, "padding_mask", {DType::boolean});
    detail::check_device(mask, kOp, "padding_mask", logits.device());
    detail::check_shape(mask, kOp, "padding_mask", {T});
  }
  const Tensor& replay = inputs.replay_idx;
  if (replay.defined()) {
    detail::check_dtype(replay, "replay", "replay_idx", {DType::int32});
    detail::check_device(replay, "replay", "replay_idx", logits.device());
    detail::check_shape(replay, "replay", "replay_idx", {T, K});
  }
  if (options.invalid_replay_rows != ReplayRowPolicy::error &&
      options.invalid_replay_rows != ReplayRowPolicy::native &&
      options.invalid_replay_rows != ReplayRowPolicy::merge) {
    detail::fail_arg(kOp, "invalid_replay_rows must be error, native or merge, got value ",
                     static_cast<int>(options.invalid_replay_rows));
  }
  if (options.global_aux_loss_update != GlobalAuxLossUpdate::accumulate &&
      options.global_aux_loss_update != GlobalAuxLossUpdate::read_only) {
    detail::fail_arg(kOp, "global_aux_loss_update must be accumulate or read_only, got value ",
                     static_cast<int>(options.global_aux_loss_update));
  }
  const LbCoeffs lb = lb_coeffs(config);
  // Megatron-Core's eval path (training=false) computes no loss at all: no value, no gradient, no
  // global aux-loss state change (it gates every loss on self.training).
  const bool need_aux = options.training && lb.any();
  int64_t G = 1;
  if (lb.seq > 0.0) {
    if (options.seq_length < 1 || T % options.seq_length != 0) {
      detail::fail_arg(kOp, "seq_aux_loss needs seq_length >= 1 dividing num_tokens=", T,
                       ", got seq_length=", options.seq_length);
    }
    G = std::max<int64_t>(T / options.seq_length, 1);
  }
  GlobalAuxLossState* gstate = inputs.global_aux_loss_state;
  if (lb.global > 0.0) {
    if (!gstate) {
      detail::fail_arg(kOp, "global_aux_loss needs inputs.global_aux_loss_state, got nullptr");
    }
    if (gstate->num_tokens_per_expert.defined()) {
      detail::check_dtype(gstate->num_tokens_per_expert, kOp,
                          "global_aux_loss_state.num_tokens_per_expert", {DType::fp64});
      detail::check_shape(gstate->num_tokens_per_expert, kOp,
                          "global_aux_loss_state.num_tokens_per_expert", {E});
    }
    if (gstate->steps < 0) {
      detail::fail_arg(kOp, "global_aux_loss_state.steps must be >= 0, got ", gstate->steps);
    }
  }

  RouteResult r;
  auto saved = std::make_shared<RouteSaved>();
  saved->config = config;
  saved->logits = logits;
  saved->row_kind = Tensor::empty({T}, DType::uint8);
  uint8_t* kind = saved->row_kind.data<uint8_t>();
  classify_rows(replay, mask, T, K, E, options, kind, r);

  // ---- outputs and kernels ----
  const DType wdt = logits.dtype();
  r.topk_idx = Tensor::empty({T, K}, DType::int32);
  r.topk_weights = Tensor::empty({T, K}, wdt);
  saved->selected_idx = Tensor::empty({T, K}, DType::int32);
  r.num_tokens_per_expert = Tensor::empty({E}, DType::int64);
  r.pad_to_capacity = config.pad_to_capacity;
  r.expert_alignment = config.padding_for_quantization ? config.padding_align_size : 1;
  const int64_t capacity =
      config.capacity_factor ? expert_capacity(T, K, E, *config.capacity_factor) : -1;
  r.expert_capacity = capacity;

  backend::RouteKernelParams p = kernel_params(config, T);
  p.need_aux = need_aux;
  p.aux_groups = G;
  p.need_z = options.training && config.z_loss_coeff > 0.0;
  std::vector<double> aux_psum(need_aux ? static_cast<size_t>(G * E) : 0);
  std::vector<int64_t> aux_cnt(need_aux ? static_cast<size_t>(G * E) : 0);
  double z_sum = 0.0;
  // Sinkhorn (training) and quantile balancing: the native rows take ids from a batch-level rule
  // (router_balancing.cpp), then route like replayed rows (weights from the live logits at those
  // ids); rows replayed by the caller keep their ids. r.row_kind keeps saying native for them.
  Tensor kernel_replay = replay;
  Tensor kernel_kind = saved->row_kind;
  if (config.aux_loss_type == AuxLossType::sinkhorn && options.training) {
    kernel_kind = saved->row_kind.clone();
    kernel_replay = sinkhorn_rows(logits, replay, kind, T, E, K, kernel_kind.data<uint8_t>());
  }
  if (qb) {
    kernel_kind = saved->row_kind.clone();
    kernel_replay = quantile_balancing_rows(logits, inputs.qb_beta, replay, kind, T, E, K,
                                            options.training, kernel_kind.data<uint8_t>(), r);
  }
  if (is64) {
    run_forward<double>(logits, bias, kernel_replay, kernel_kind, p, capacity,
                        config.token_drop_policy, false, r, *saved, aux_psum, aux_cnt, z_sum);
  } else {
    run_forward<float>(logits, bias, kernel_replay, kernel_kind, p, capacity,
                       config.token_drop_policy, is_bf16, r, *saved, aux_psum, aux_cnt, z_sum);
  }
  if (is_bf16) r.topk_weights = r.topk_weights.to(DType::bf16);  // exact: already bf16 values
  saved->logits_dtype = logits_in.dtype();
  saved->topk_idx = r.topk_idx;

  // ---- cross-rank agreement, then the losses ----
  dist::Communicator* lc = comms ? comms->loss : nullptr;
  dist::Communicator* gc = comms ? comms->global_aux_loss : nullptr;
  if (comms) {
    // The settings the reductions depend on (sizes, loss types, communicators) must match on
    // every rank: a mismatch would truncate a message on one rank and sum the wrong counts, or
    // wait forever, on another.
    *agreed = true;
    agree_route(*comms, "", route_settings(config, G, options.training, *comms));
  }
  if (options.training) {
    LossSums sums{T, G, std::move(aux_psum), std::move(aux_cnt), z_sum};
    finish_losses(config, sums, lc, gc, gstate, options.global_aux_loss_update, r, *saved);
  }
  r.saved = std::move(saved);
  return r;
}

}  // namespace

RouteGrads topk_route_backward(const Tensor& grad_topk_weights, const RouteResult& result,
                               const RouteBackwardOptions& options) {
  constexpr const char* op = "route_backward";
  if (!result.saved) {
    detail::fail_arg(op, "result must come from topk_route, got an empty RouteResult");
  }
  const RouteSaved& handle = *result.saved;
  const RouterConfig& h = handle.config;
  if (!std::isfinite(options.loss_grad_scale)) {
    detail::fail_arg(op, "loss_grad_scale must be finite, got ", options.loss_grad_scale);
  }
  const Tensor& logits = handle.logits;
  const int64_t T = logits.size(0), E = h.num_experts, K = h.top_k;
  Tensor gw;
  if (grad_topk_weights.defined()) {
    detail::check_dtype(grad_topk_weights, op, "grad_topk_weights",
                        {DType::bf16, DType::fp32, DType::fp64});
    detail::check_shape(grad_topk_weights, op, "grad_topk_weights", {T, K});
    gw = grad_topk_weights.dtype() == logits.dtype() ? grad_topk_weights
                                                     : grad_topk_weights.to(logits.dtype());
  }
  std::vector<double> aux;
  if (handle.aux_grad.defined()) {
    aux = handle.aux_grad.to_double_vector();
    for (double& a : aux) a *= options.loss_grad_scale;
  }
  const double zc = handle.z_grad_coeff * options.loss_grad_scale;

  backend::RouteKernelParams p = kernel_params(h, T);
  p.aux_groups = handle.aux_groups;
  RouteGrads g;
  g.grad_logits = Tensor::empty({T, E}, logits.dtype());
  const double* aux_ptr = aux.empty() ? nullptr : aux.data();
  if (logits.dtype() == DType::fp64) {
    backend::route_backward<double>(
        backend::context_of(logits, op), logits.data<double>(), handle.selected_idx.data<int32_t>(),
        handle.topk_idx.data<int32_t>(), handle.row_kind.data<uint8_t>(),
        gw.defined() ? gw.data<double>() : nullptr, p, aux_ptr, zc, g.grad_logits.data<double>());
  } else {
    backend::route_backward<float>(
        backend::context_of(logits, op), logits.data<float>(), handle.selected_idx.data<int32_t>(),
        handle.topk_idx.data<int32_t>(), handle.row_kind.data<uint8_t>(),
        gw.defined() ? gw.data<float>() : nullptr, p, aux_ptr, zc, g.grad_logits.data<float>());
  }
  // bf16 logits get their gradient in bf16 (computed in fp32, rounded once).
  if (handle.logits_dtype == DType::bf16) g.grad_logits = g.grad_logits.to(DType::bf16);
  return g;
}

RoutingPlanOptions routing_plan_options(const RouteResult& result) {
  RoutingPlanOptions o;
  o.expert_capacity = result.expert_capacity;
  o.pad_to_capacity = result.pad_to_capacity;
  o.expert_alignment = result.expert_alignment;
  return o;
}

}  // namespace switchyard
