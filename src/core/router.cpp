// Router front-end: validates every argument, shapes the outputs, runs the CPU kernels and turns
// their partial sums into Megatron-Core's loss values and gradient coefficients.
#include "switchyard/router.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "check.h"
#include "cpu/router_kernels.h"

namespace switchyard {

namespace {

constexpr const char* kOp = "route";

std::string row_str(const int32_t* row, int64_t K) {
  std::ostringstream os;
  os << "[";
  for (int64_t k = 0; k < K; ++k) os << (k ? ", " : "") << row[k];
  os << "]";
  return os.str();
}

std::string layer_prefix(int64_t layer) {
  return layer >= 0 ? detail::cat("layer ", layer, ", ") : std::string();
}

cpu::RouteKernelParams kernel_params(const RouterConfig& c, int64_t T) {
  cpu::RouteKernelParams p;
  p.num_tokens = T;
  p.num_experts = c.num_experts;
  p.top_k = c.top_k;
  p.score_function = static_cast<int>(c.score_function);
  p.pre_softmax = c.pre_softmax;
  if (c.aux_loss_type == AuxLossType::sinkhorn) {
    // Megatron's _sinkhorn_activation: sigmoid for K = 1, softmax over all E for K > 1, the
    // weights taken at the selected ids without renormalisation.
    p.score_function = c.top_k == 1 ? cpu::kScoreSigmoid : cpu::kScoreSoftmax;
    p.pre_softmax = c.top_k > 1;
  }
  p.num_groups = c.num_groups;
  p.group_topk = c.group_topk;
  p.scaling = c.topk_scaling_factor;
  return p;
}

// Coefficient of each load-balancing loss (Megatron's get_aux_loss_coeff): from the lists when
// given, else from aux_loss_type / aux_loss_coeff.
struct LbCoeffs {
  double aux = 0.0, seq = 0.0, global = 0.0;
};

LbCoeffs lb_coeffs(const RouterConfig& c) {
  LbCoeffs r;
  auto put = [&](AuxLossType t, double coeff) {
    if (t == AuxLossType::aux_loss) r.aux = coeff;
    if (t == AuxLossType::seq_aux_loss) r.seq = coeff;
    if (t == AuxLossType::global_aux_loss) r.global = coeff;
  };
  if (!c.aux_loss_types.empty()) {
    for (size_t i = 0; i < c.aux_loss_types.size(); ++i)
      put(c.aux_loss_types[i], c.aux_loss_coeffs[i]);
  } else {
    put(c.aux_loss_type, c.aux_loss_coeff);
  }
  return r;
}

template <class S>
void run_forward(const Tensor& logits, const Tensor& bias, const Tensor& replay_idx,
                 const Tensor& row_kind, const cpu::RouteKernelParams& p, int64_t capacity,
                 bool by_position, bool round_weights_to_bf16, RouteResult& r,
                 std::vector<double>& aux_psum, std::vector<int64_t>& aux_cnt, double& z_sum) {
  const int64_t T = p.num_tokens, K = p.top_k, E = p.num_experts;
  Tensor sel_w = Tensor::empty({T, K}, dtype_of<S>());
  std::vector<S> bias_s;
  if (bias.defined()) {
    bias_s.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) bias_s[e] = static_cast<S>(bias.item_as_double(e));
  }
  cpu::route_forward<S>(
      logits.data<S>(), bias_s.empty() ? nullptr : bias_s.data(), row_kind.data<uint8_t>(),
      replay_idx.defined() ? replay_idx.data<int32_t>() : nullptr, p,
      r.selected_idx.data<int32_t>(), sel_w.data<S>(), aux_psum.data(), aux_cnt.data(), &z_sum);
  if constexpr (std::is_same_v<S, float>) {
    // bf16 logits (Megatron's moe_router_dtype=None): the weights are computed in fp32 and
    // rounded to bf16 once, before capacity, so the probs drop policy sorts the bf16 values.
    if (round_weights_to_bf16) {
      float* w = sel_w.data<float>();
      for (int64_t i = 0; i < T * K; ++i) w[i] = bf16_to_float(float_to_bf16(w[i]));
    }
  }
  r.num_dropped =
      cpu::apply_capacity<S>(r.selected_idx.data<int32_t>(), sel_w.data<S>(), T, K, E, capacity,
                             by_position, r.topk_idx.data<int32_t>(), r.topk_weights.data<S>(),
                             r.num_tokens_per_expert.data<int64_t>());
}

// A uniform in (0, 1) for counter i of a seed: splitmix64 of (seed, i), top 24 bits.
inline double unit_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (static_cast<double>(z >> 40) + 0.5) * (1.0 / 16777216.0);
}

// N(0, 1) for counter i (Box-Muller on two independent uniforms of the same seed).
inline double unit_normal(uint64_t seed, uint64_t i) {
  const double u1 = unit_uniform(seed, 2 * i), u2 = unit_uniform(seed, 2 * i + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// force_load_balancing / force_biased: the logits routed instead of the given ones.
Tensor forced_logits(const Tensor& logits, const RouterConfig& c, const RouteOptions& o) {
  const int64_t T = logits.size(0), E = c.num_experts;
  std::vector<double> bias(static_cast<size_t>(E), 0.0);
  if (c.force_biased != 0.0) {
    for (int64_t e = 0; e < E; ++e)
      bias[e] = std::fabs(c.force_biased) * unit_normal(o.force_bias_seed, e);
  }
  Tensor out = Tensor::empty({T, E}, logits.dtype());
  for (int64_t i = 0; i < T * E; ++i) {
    const double v = unit_normal(o.force_seed, static_cast<uint64_t>(i)) + bias[i % E];
    if (logits.dtype() == DType::fp64) {
      out.data<double>()[i] = v;
    } else {
      out.data<float>()[i] = static_cast<float>(v);
    }
  }
  return out;
}

}  // namespace

const char* score_function_name(ScoreFunction f) {
  switch (f) {
    case ScoreFunction::softmax:
      return "softmax";
    case ScoreFunction::sigmoid:
      return "sigmoid";
    case ScoreFunction::sqrtsoftplus:
      return "sqrtsoftplus";
  }
  return "?";
}

ScoreFunction parse_score_function(const std::string& name) {
  if (name == "softmax") return ScoreFunction::softmax;
  if (name == "sigmoid") return ScoreFunction::sigmoid;
  if (name == "sqrtsoftplus") return ScoreFunction::sqrtsoftplus;
  detail::fail_arg(kOp, "score_function must be softmax, sigmoid or sqrtsoftplus, got \"", name,
                   "\"");
}

const char* aux_loss_type_name(AuxLossType t) {
  switch (t) {
    case AuxLossType::none:
      return "none";
    case AuxLossType::aux_loss:
      return "aux_loss";
    case AuxLossType::seq_aux_loss:
      return "seq_aux_loss";
    case AuxLossType::global_aux_loss:
      return "global_aux_loss";
    case AuxLossType::sinkhorn:
      return "sinkhorn";
    case AuxLossType::quantile_balancing:
      return "quantile_balancing";
  }
  return "?";
}

AuxLossType parse_aux_loss_type(const std::string& name) {
  if (name == "none") return AuxLossType::none;
  if (name == "aux_loss") return AuxLossType::aux_loss;
  if (name == "seq_aux_loss") return AuxLossType::seq_aux_loss;
  if (name == "global_aux_loss") return AuxLossType::global_aux_loss;
  if (name == "sinkhorn") return AuxLossType::sinkhorn;
  if (name == "quantile_balancing") return AuxLossType::quantile_balancing;
  detail::fail_arg(kOp,
                   "aux_loss_type must be none, aux_loss, seq_aux_loss, global_aux_loss, "
                   "sinkhorn or quantile_balancing, got \"",
                   name, "\"");
}

const char* token_drop_policy_name(TokenDropPolicy p) {
  return p == TokenDropPolicy::probs ? "probs" : "position";
}

TokenDropPolicy parse_token_drop_policy(const std::string& name) {
  if (name == "probs") return TokenDropPolicy::probs;
  if (name == "position") return TokenDropPolicy::position;
  detail::fail_arg(kOp, "token_drop_policy must be probs or position, got \"", name, "\"");
}

void validate_router_config(const RouterConfig& c) {
  const int64_t E = c.num_experts, K = c.top_k;
  if (E < 1) detail::fail_arg(kOp, "num_experts must be >= 1, got num_experts=", E);
  if (K < 1 || K > E) {
    detail::fail_arg(kOp, "top_k must be in [1, num_experts=", E, "], got top_k=", K);
  }
  if (static_cast<int>(c.score_function) > 2) {
    detail::fail_arg(kOp, "score_function must be softmax, sigmoid or sqrtsoftplus, got value ",
                     static_cast<int>(c.score_function));
  }
  if (c.pre_softmax && c.score_function != ScoreFunction::softmax) {
    detail::fail_arg(kOp, "pre_softmax needs score_function=softmax, got score_function=",
                     score_function_name(c.score_function));
  }
  if (c.num_groups != 0 || c.group_topk != 0) {
    const int64_t G = c.num_groups;
    if (G < 1 || G > E || E % G != 0) {
      detail::fail_arg(kOp, "num_groups must divide num_experts=", E, ", got num_groups=", G);
    }
    if (c.group_topk < 1 || c.group_topk > G || c.group_topk > K) {
      detail::fail_arg(kOp, "group_topk must be in [1, min(num_groups=", G, ", top_k=", K,
                       ")], got group_topk=", c.group_topk);
    }
    if (K > c.group_topk * (E / G)) {
      detail::fail_arg(kOp, "top_k must be <= group_topk * num_experts / num_groups = ",
                       c.group_topk * (E / G), ", got top_k=", K);
    }
  }
  if (!std::isfinite(c.topk_scaling_factor) || c.topk_scaling_factor <= 0.0) {
    detail::fail_arg(kOp, "topk_scaling_factor must be finite and > 0, got ",
                     c.topk_scaling_factor);
  }
  if (c.capacity_factor && (!std::isfinite(*c.capacity_factor) || *c.capacity_factor <= 0.0)) {
    detail::fail_arg(kOp, "capacity_factor must be finite and > 0 (or unset), got ",
                     *c.capacity_factor);
  }
  if (static_cast<int>(c.token_drop_policy) > 1) {
    detail::fail_arg(kOp, "token_drop_policy must be probs or position, got value ",
                     static_cast<int>(c.token_drop_policy));
  }
  if (c.pad_to_capacity && !c.capacity_factor) {
    detail::fail_arg(kOp, "pad_to_capacity needs capacity_factor, got no capacity_factor");
  }
  if (static_cast<int>(c.aux_loss_type) > 5) {
    detail::fail_arg(kOp,
                     "aux_loss_type must be none, aux_loss, seq_aux_loss, global_aux_loss, "
                     "sinkhorn or quantile_balancing, got value ",
                     static_cast<int>(c.aux_loss_type));
  }
  if (c.aux_loss_type == AuxLossType::quantile_balancing) {
    if (c.num_groups != 0 || c.aux_loss_coeff != 0.0 || K >= E) {
      detail::fail_arg(kOp,
                       "quantile_balancing takes no groups, aux_loss_coeff 0 and top_k < "
                       "num_experts, got num_groups=",
                       c.num_groups, ", aux_loss_coeff=", c.aux_loss_coeff, ", top_k=", K,
                       ", num_experts=", E);
    }
  }
  if (c.aux_loss_type == AuxLossType::sinkhorn) {
    // Megatron's sinkhorn path ignores these; rejecting them keeps a config from meaning
    // something it does not do.
    if (c.score_function != ScoreFunction::softmax || c.pre_softmax) {
      detail::fail_arg(kOp,
                       "sinkhorn routing needs score_function=softmax without pre_softmax "
                       "(its weights are sigmoid for top_k 1, softmax over all experts else), "
                       "got score_function=",
                       score_function_name(c.score_function), ", pre_softmax=", c.pre_softmax);
    }
    if (c.num_groups != 0 || c.topk_scaling_factor != 1.0 || c.aux_loss_coeff != 0.0) {
      detail::fail_arg(kOp,
                       "sinkhorn routing takes no groups, topk_scaling_factor 1 and "
                       "aux_loss_coeff 0, got num_groups=",
                       c.num_groups, ", topk_scaling_factor=", c.topk_scaling_factor,
                       ", aux_loss_coeff=", c.aux_loss_coeff);
    }
  }
  if (!std::isfinite(c.aux_loss_coeff) || c.aux_loss_coeff < 0.0) {
    detail::fail_arg(kOp, "aux_loss_coeff must be finite and >= 0, got ", c.aux_loss_coeff);
  }
  if (!c.aux_loss_types.empty() || !c.aux_loss_coeffs.empty()) {
    if (c.aux_loss_type != AuxLossType::none) {
      detail::fail_arg(kOp,
                       "aux_loss_types (several losses) needs aux_loss_type none, got "
                       "aux_loss_type=",
                       aux_loss_type_name(c.aux_loss_type));
    }
    if (c.aux_loss_types.size() != c.aux_loss_coeffs.size()) {
      detail::fail_arg(kOp, "aux_loss_coeffs must have one coefficient per aux_loss_types entry (",
                       c.aux_loss_types.size(), "), got ", c.aux_loss_coeffs.size());
    }
    bool seen[4] = {false, false, false, false};
    for (size_t i = 0; i < c.aux_loss_types.size(); ++i) {
      const int t = static_cast<int>(c.aux_loss_types[i]);
      if (t < 1 || t > 3) {
        detail::fail_arg(kOp,
                         "aux_loss_types entries must be aux_loss, seq_aux_loss or "
                         "global_aux_loss, got value ",
                         t, " at index ", i);
      }
      if (seen[t]) {
        detail::fail_arg(kOp, "aux_loss_types lists ", aux_loss_type_name(c.aux_loss_types[i]),
                         " twice");
      }
      seen[t] = true;
      const double v = c.aux_loss_coeffs[i];
      if (!std::isfinite(v) || v < 0.0) {
        detail::fail_arg(kOp, "aux_loss_coeffs must be finite and >= 0, got ", v, " at index ", i);
      }
    }
  }
  if (!std::isfinite(c.force_biased)) {
    detail::fail_arg(kOp, "force_biased must be finite, got ", c.force_biased);
  }
  if (c.mtp_num_layers < 0) {
    detail::fail_arg(kOp, "mtp_num_layers must be >= 0, got ", c.mtp_num_layers);
  }
  if (!std::isfinite(c.z_loss_coeff) || c.z_loss_coeff < 0.0) {
    detail::fail_arg(kOp, "z_loss_coeff must be finite and >= 0, got ", c.z_loss_coeff);
  }
}

namespace {

// Element-wise sum over the ranks of c, in rank order (deterministic whatever MPI would do).
template <class T>
void sum_over_ranks(dist::Communicator& c, T* v, int64_t n) {
  if (c.size() == 1 || n == 0) return;
  std::vector<T> all(static_cast<size_t>(n * c.size()));
  c.allgather(v, all.data(), n, sizeof(T));
  for (int64_t i = 0; i < n; ++i) {
    T s = 0;
    for (int r = 0; r < c.size(); ++r) s += all[static_cast<size_t>(r * n + i)];
    v[i] = s;
  }
}

// Error agreement: every rank says whether it failed (rank + 1) before the first reduction.
// Returns the highest failing rank, or -1.
int agree_on_failure(const RouteComms& comms, bool failed) {
  int worst = -1;
  for (dist::Communicator* c : {comms.loss, comms.global_aux_loss}) {
    if (!c) continue;
    int64_t v = failed ? c->rank() + 1 : 0;
    c->allreduce_max(&v, 1);
    worst = std::max(worst, static_cast<int>(v) - 1);
  }
  return worst;
}

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
  } catch (...) {
    // A local failure before the agreement: take part in it (so no rank waits forever), then
    // throw this rank's own error.
    if (!agreed) agree_on_failure(comms, true);
    throw;
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
    const int64_t bad = detail::first_non_finite(logits);  // numel() when all are finite
    if (bad < logits.numel()) {
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
    for (int64_t e = 0; e < E; ++e) {
      if (!std::isfinite(bias.item_as_double(e))) {
        detail::fail_arg(kOp, "expert_bias must be finite, got ", bias.item_as_double(e),
                         " at expert ", e);
      }
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
    detail::check_shape(mask, kOp, "padding_mask", {T});
  }
  const Tensor& replay = inputs.replay_idx;
  if (replay.defined()) {
    detail::check_dtype(replay, "replay", "replay_idx", {DType::int32});
    detail::check_shape(replay, "replay", "replay_idx", {T, K});
  }
  if (options.invalid_replay_rows != InvalidReplayRows::error &&
      options.invalid_replay_rows != InvalidReplayRows::native) {
    detail::fail_arg(kOp, "invalid_replay_rows must be error or native, got value ",
                     static_cast<int>(options.invalid_replay_rows));
  }
  if (options.global_aux_loss_update != GlobalAuxLossUpdate::accumulate &&
      options.global_aux_loss_update != GlobalAuxLossUpdate::read_only) {
    detail::fail_arg(kOp, "global_aux_loss_update must be accumulate or read_only, got value ",
                     static_cast<int>(options.global_aux_loss_update));
  }
  const LbCoeffs lb = lb_coeffs(config);
  const bool need_aux = lb.aux > 0.0 || lb.seq > 0.0 || lb.global > 0.0;
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
  r.config = config;
  r.logits = logits;
  r.row_kind = Tensor::empty({T}, DType::uint8);
  uint8_t* kind = r.row_kind.data<uint8_t>();
  const bool* pad = mask.defined() ? mask.data<bool>() : nullptr;
  // Row kinds; replay rows are checked here so that a bad row throws before any routing.
  {
    const int32_t* rp = replay.defined() ? replay.data<int32_t>() : nullptr;
    std::vector<int64_t> seen(rp ? static_cast<size_t>(E) : 0, -1);
    for (int64_t t = 0; t < T; ++t) {
      if (pad && pad[t]) {
        kind[t] = cpu::kRowPadded;
        ++r.num_padded_rows;
        continue;
      }
      kind[t] = cpu::kRowNative;
      if (!rp) {
        ++r.num_native_rows;
        continue;
      }
      const int32_t* row = rp + t * K;
      int64_t num_none = 0;
      for (int64_t k = 0; k < K; ++k) num_none += row[k] == -1;
      if (num_none == K) {
        ++r.num_native_rows;
        continue;
      }
      std::string why;
      if (num_none > 0) {
        why = "mixes -1 and expert ids";
      } else {
        for (int64_t k = 0; k < K && why.empty(); ++k) {
          if (row[k] < 0 || row[k] >= E) {
            why = detail::cat("names expert ", row[k], " outside [0, ", E, ")");
          } else if (seen[row[k]] == t) {
            why = detail::cat("repeats expert ", row[k]);
          } else {
            seen[row[k]] = t;
          }
        }
      }
      if (why.empty()) {
        kind[t] = cpu::kRowReplayed;
        ++r.num_replayed_rows;
      } else if (options.invalid_replay_rows == InvalidReplayRows::native) {
        ++r.num_native_rows;
        ++r.num_invalid_replay_rows;
      } else {
        detail::fail_arg("replay", layer_prefix(options.layer), "token ", t, ": topk_idx row ",
                         row_str(row, K), " ", why);
      }
    }
  }

  // ---- outputs and kernels ----
  const DType wdt = logits.dtype();
  r.topk_idx = Tensor::empty({T, K}, DType::int32);
  r.topk_weights = Tensor::empty({T, K}, wdt);
  r.selected_idx = Tensor::empty({T, K}, DType::int32);
  r.num_tokens_per_expert = Tensor::empty({E}, DType::int64);
  r.pad_to_capacity = config.pad_to_capacity;
  int64_t capacity = -1;
  if (config.capacity_factor) {
    // No expert can receive more than T pairs, so larger capacities mean "no drops"; clamping
    // also keeps a huge capacity_factor from overflowing the conversion.
    const double c =
        std::ceil(static_cast<double>(T * K) / static_cast<double>(E) * *config.capacity_factor);
    capacity = c >= static_cast<double>(T) ? T : static_cast<int64_t>(c);
  }
  r.expert_capacity = capacity;

  cpu::RouteKernelParams p = kernel_params(config, T);
  p.need_aux = need_aux;
  p.aux_groups = G;
  p.need_z = config.z_loss_coeff > 0.0;
  std::vector<double> aux_psum(need_aux ? static_cast<size_t>(G * E) : 0);
  std::vector<int64_t> aux_cnt(need_aux ? static_cast<size_t>(G * E) : 0);
  double z_sum = 0.0;
  const bool by_position = config.token_drop_policy == TokenDropPolicy::position;
  // Sinkhorn (training): the native rows take ids from the Sinkhorn-normalised batch of every
  // unpadded row, then route like replayed rows (weights from the live logits at those ids);
  // rows replayed by the caller keep their ids. row_kind keeps saying native for them.
  Tensor kernel_replay = replay;
  Tensor kernel_kind = r.row_kind;
  if (config.aux_loss_type == AuxLossType::sinkhorn && options.training) {
    std::vector<uint8_t> use(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) use[t] = kind[t] != cpu::kRowPadded;
    Tensor sink = Tensor::full({T, K}, DType::int32, -1);
    if (is64) {
      cpu::sinkhorn_select(logits.data<double>(), use.data(), T, E, K, 1e-4, sink.data<int32_t>());
    } else {
      cpu::sinkhorn_select(logits.data<float>(), use.data(), T, E, K, 1e-4, sink.data<int32_t>());
    }
    kernel_kind = r.row_kind.clone();
    uint8_t* kk = kernel_kind.data<uint8_t>();
    int32_t* sp = sink.data<int32_t>();
    for (int64_t t = 0; t < T; ++t) {
      if (kind[t] == cpu::kRowReplayed) {
        std::copy_n(replay.data<int32_t>() + t * K, K, sp + t * K);
      } else if (kind[t] == cpu::kRowNative) {
        kk[t] = cpu::kRowReplayed;
      }
    }
    kernel_replay = sink;
  }
  if (qb) {
    // Megatron's qb_dual_update on the fp32 logits: the native rows take the top-k of z - beta
    // (ties: the larger logit, then the lower id) and route like replayed rows.
    std::vector<float> beta(static_cast<size_t>(E), 0.0f);
    if (inputs.qb_beta.defined()) std::copy_n(inputs.qb_beta.data<float>(), E, beta.data());
    const Tensor z32 = is64 ? logits.to(DType::fp32) : logits;
    const float* zp = z32.data<float>();
    Tensor sel = Tensor::full({T, K}, DType::int32, -1);
    std::vector<float> key(static_cast<size_t>(E)), alpha(static_cast<size_t>(T));
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) key[e] = zp[t * E + e] - beta[e];
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + K + 1, order.end(),
                        [&](int32_t a, int32_t b) {
                          if (key[a] != key[b]) return key[a] > key[b];
                          if (zp[t * E + a] != zp[t * E + b]) return zp[t * E + a] > zp[t * E + b];
                          return a < b;
                        });
      alpha[t] = key[order[K]];
      if (kind[t] == cpu::kRowReplayed) {
        std::copy_n(replay.data<int32_t>() + t * K, K, sel.data<int32_t>() + t * K);
      } else {
        std::copy_n(order.data(), K, sel.data<int32_t>() + t * K);
      }
    }
    if (options.training && T > 0) {
      const int64_t m = T * K / E;  // column target; its (m+1)-th largest is the quantile
      r.qb_beta_local = Tensor::empty({E}, DType::fp32);
      std::vector<float> col(static_cast<size_t>(T));
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t t = 0; t < T; ++t) col[t] = zp[t * E + e] - alpha[t];
        std::nth_element(col.begin(), col.begin() + m, col.end(), std::greater<float>());
        r.qb_beta_local.data<float>()[e] = col[m];
      }
    }
    kernel_kind = r.row_kind.clone();
    uint8_t* kk = kernel_kind.data<uint8_t>();
    for (int64_t t = 0; t < T; ++t) {
      if (kind[t] == cpu::kRowNative) kk[t] = cpu::kRowReplayed;
    }
    kernel_replay = sel;
  }
  if (is64) {
    run_forward<double>(logits, bias, kernel_replay, kernel_kind, p, capacity, by_position, false,
                        r, aux_psum, aux_cnt, z_sum);
  } else {
    run_forward<float>(logits, bias, kernel_replay, kernel_kind, p, capacity, by_position, is_bf16,
                       r, aux_psum, aux_cnt, z_sum);
  }
  if (is_bf16) r.topk_weights = r.topk_weights.to(DType::bf16);  // exact: already bf16 values
  r.logits_dtype = logits_in.dtype();

  // ---- cross-rank agreement, then the losses ----
  dist::Communicator* lc = comms ? comms->loss : nullptr;
  dist::Communicator* gc = comms ? comms->global_aux_loss : nullptr;
  if (comms) {
    const int bad = agree_on_failure(*comms, false);
    *agreed = true;
    if (bad >= 0) detail::fail_arg(kOp, "rank ", bad, " failed (see its error)");
  }
  // ---- losses (Megatron-Core moe_utils / router.py), sums in fixed order ----
  const int64_t num_valid_local = T - r.num_padded_rows;
  // Megatron sums the per-expert counts and the token counts over tp_cp (aux, seq) and tp_dp_cp
  // (global); the score sums stay local.
  int64_t num_valid = num_valid_local, num_valid_global = num_valid_local;
  std::vector<int64_t> cnt_global_local;  // this rank's counts over all groups, for gc
  if (need_aux && lb.global > 0.0) {
    cnt_global_local.assign(static_cast<size_t>(E), 0);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t e = 0; e < E; ++e) cnt_global_local[e] += aux_cnt[g * E + e];
    }
  }
  if (lc) {
    sum_over_ranks(*lc, &num_valid, 1);
    if (need_aux) sum_over_ranks(*lc, aux_cnt.data(), G * E);
  }
  if (gc) {
    sum_over_ranks(*gc, &num_valid_global, 1);
    if (need_aux && lb.global > 0.0) sum_over_ranks(*gc, cnt_global_local.data(), E);
  } else if (lc) {
    num_valid_global = num_valid;  // no separate group: the loss group's totals
    if (need_aux && lb.global > 0.0) sum_over_ranks(*lc, cnt_global_local.data(), E);
  }
  const double lc_size = lc ? static_cast<double>(lc->size()) : 1.0;
  // Megatron's calculate_per_token_loss attaches loss * num_local_tokens (valid tokens) to the
  // gradient and logs the loss itself; an MTP layer run mtp_num_layers times divides its
  // load-balancing losses by that count (value and gradient; the z-loss only in Megatron's log).
  const double per_token =
      config.calculate_per_token_loss ? static_cast<double>(num_valid_local) * lc_size : 1.0;
  const double mtp =
      (config.is_mtp_layer && config.mtp_use_repeated_layer && config.mtp_num_layers > 0)
          ? 1.0 / static_cast<double>(config.mtp_num_layers)
          : 1.0;
  if (need_aux) {
    r.aux_groups = G;
    r.aux_grad = Tensor::zeros({G, E}, DType::fp64);
    double* ag = r.aux_grad.data<double>();
    // Batch counts and score sums over all sequence groups (aux_loss, global_aux_loss), added in
    // group order (a single group when there is no seq_aux_loss: the values themselves).
    std::vector<double> cnt1(static_cast<size_t>(E), 0.0), psum1(static_cast<size_t>(E), 0.0);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t e = 0; e < E; ++e) {
        cnt1[e] += static_cast<double>(aux_cnt[g * E + e]);
        psum1[e] += aux_psum[g * E + e];
      }
    }
    const double n = static_cast<double>(num_valid);
    auto coeff_f = [&](double coeff, double n_tokens, double div) {
      return coeff * static_cast<double>(E) / (static_cast<double>(K) * n_tokens * n_tokens) / div *
             mtp;
    };
    // aux_loss: switch_load_balancing_loss_func on this batch's counts.
    if (lb.aux > 0.0 && n > 0.0) {
      const double f = coeff_f(lb.aux, n, 1.0);
      double loss = 0.0;
      for (int64_t e = 0; e < E; ++e) loss += f * cnt1[e] * psum1[e];
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t e = 0; e < E; ++e) ag[g * E + e] += f * cnt1[e];
      }
      r.aux_loss_parts.aux_loss = loss;
    }
    // seq_aux_loss: per sequence group, N = tokens per sequence, divided by the sequence count.
    if (lb.seq > 0.0 && n > 0.0) {
      const double f = coeff_f(lb.seq, n / static_cast<double>(G), static_cast<double>(G));
      double loss = 0.0;
      for (int64_t i = 0; i < G * E; ++i) {
        loss += f * static_cast<double>(aux_cnt[i]) * aux_psum[i];
        ag[i] += f * static_cast<double>(aux_cnt[i]);
      }
      r.aux_loss_parts.seq_aux_loss = loss;
    }
    // global_aux_loss: the running mean of the counts. The loss always sees the state plus this
    // batch; only an accumulating call keeps it.
    if (lb.global > 0.0) {
      std::vector<double> acc(static_cast<size_t>(E), 0.0);
      if (gstate->num_tokens_per_expert.defined())
        acc = gstate->num_tokens_per_expert.to_double_vector();
      for (int64_t e = 0; e < E; ++e) acc[e] += static_cast<double>(cnt_global_local[e]);
      const int64_t steps = gstate->steps + 1;
      if (options.global_aux_loss_update == GlobalAuxLossUpdate::accumulate) {
        if (!gstate->num_tokens_per_expert.defined()) {
          gstate->num_tokens_per_expert = Tensor::zeros({E}, DType::fp64);
        }
        std::copy(acc.begin(), acc.end(), gstate->num_tokens_per_expert.data<double>());
        gstate->steps = steps;
      }
      const double ng = static_cast<double>(num_valid_global);
      if (ng > 0.0) {
        const double f = coeff_f(lb.global, ng, 1.0);
        double loss = 0.0;
        for (int64_t e = 0; e < E; ++e) {
          const double c = acc[e] / static_cast<double>(steps);
          loss += f * c * psum1[e];
          for (int64_t g = 0; g < G; ++g) ag[g * E + e] += f * c;
        }
        r.aux_loss_parts.global_aux_loss = loss;
      }
    }
    r.aux_loss = r.aux_loss_parts.aux_loss + r.aux_loss_parts.seq_aux_loss +
                 r.aux_loss_parts.global_aux_loss;
    if (per_token != 1.0) {
      for (int64_t i = 0; i < G * E; ++i) ag[i] *= per_token;
    }
  }
  if (p.need_z) {
    // Megatron: the mean over this rank's tokens with coefficient / tp_cp size.
    const double nz = static_cast<double>(std::max<int64_t>(num_valid_local, 1));
    const double zc = config.z_loss_coeff / lc_size;
    r.z_loss = zc * z_sum / nz;
    r.z_grad_coeff = 2.0 * zc / nz * per_token;
  }
  return r;
}

}  // namespace

RouteGrads topk_route_backward(const Tensor& grad_topk_weights, const RouteResult& handle,
                               const RouterConfig& config, const RouteBackwardOptions& options) {
  constexpr const char* op = "route_backward";
  if (!handle.logits.defined() || !handle.selected_idx.defined() || !handle.row_kind.defined()) {
    detail::fail_arg(op, "handle must come from topk_route, got an empty RouteResult");
  }
  const RouterConfig& h = handle.config;
  if (config.num_experts != h.num_experts || config.top_k != h.top_k ||
      config.score_function != h.score_function || config.pre_softmax != h.pre_softmax ||
      config.topk_scaling_factor != h.topk_scaling_factor) {
    detail::fail_arg(
        op, "config must match the forward's (num_experts=", h.num_experts, ", top_k=", h.top_k,
        ", score_function=", score_function_name(h.score_function), ", pre_softmax=", h.pre_softmax,
        ", topk_scaling_factor=", h.topk_scaling_factor, "), got num_experts=", config.num_experts,
        ", top_k=", config.top_k, ", score_function=", score_function_name(config.score_function),
        ", pre_softmax=", config.pre_softmax, ", topk_scaling_factor=", config.topk_scaling_factor);
  }
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

  cpu::RouteKernelParams p = kernel_params(h, T);
  p.aux_groups = handle.aux_groups;
  RouteGrads g;
  g.grad_logits = Tensor::empty({T, E}, logits.dtype());
  const double* aux_ptr = aux.empty() ? nullptr : aux.data();
  if (logits.dtype() == DType::fp64) {
    cpu::route_backward<double>(logits.data<double>(), handle.selected_idx.data<int32_t>(),
                                handle.topk_idx.data<int32_t>(), handle.row_kind.data<uint8_t>(),
                                gw.defined() ? gw.data<double>() : nullptr, p, aux_ptr, zc,
                                g.grad_logits.data<double>());
  } else {
    cpu::route_backward<float>(logits.data<float>(), handle.selected_idx.data<int32_t>(),
                               handle.topk_idx.data<int32_t>(), handle.row_kind.data<uint8_t>(),
                               gw.defined() ? gw.data<float>() : nullptr, p, aux_ptr, zc,
                               g.grad_logits.data<float>());
  }
  // bf16 logits get their gradient in bf16 (computed in fp32, rounded once).
  if (handle.logits_dtype == DType::bf16) g.grad_logits = g.grad_logits.to(DType::bf16);
  return g;
}

namespace {

// u in [1 - eps, 1 + eps) for element i.
inline double jitter_unit(uint64_t seed, uint64_t i) { return unit_uniform(seed, i); }

Tensor jitter_apply(const Tensor& x, double eps, uint64_t seed, const char* op, const char* name) {
  detail::check_dtype(x, op, name, {DType::bf16, DType::fp32, DType::fp64});
  if (!std::isfinite(eps) || eps < 0.0 || eps >= 1.0) {
    detail::fail_arg(op, "eps must be in [0, 1), got ", eps);
  }
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  const int64_t n = x.numel();
  if (x.dtype() == DType::fp64) {
    const double* a = x.data<double>();
    double* o = out.data<double>();
    for (int64_t i = 0; i < n; ++i) {
      o[i] = a[i] * (1.0 - eps + 2.0 * eps * jitter_unit(seed, static_cast<uint64_t>(i)));
    }
  } else if (x.dtype() == DType::fp32) {
    const float* a = x.data<float>();
    float* o = out.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      const float u = static_cast<float>(1.0 - eps + 2.0 * eps * jitter_unit(seed, i));
      o[i] = a[i] * u;
    }
  } else {
    const bf16* a = x.data<bf16>();
    bf16* o = out.data<bf16>();
    for (int64_t i = 0; i < n; ++i) {
      const float u = static_cast<float>(1.0 - eps + 2.0 * eps * jitter_unit(seed, i));
      o[i] = float_to_bf16(bf16_to_float(a[i]) * u);
    }
  }
  return out;
}

}  // namespace

Tensor input_jitter(const Tensor& x, double eps, uint64_t seed) {
  return jitter_apply(x, eps, seed, "input_jitter", "x");
}

Tensor input_jitter_backward(const Tensor& grad, double eps, uint64_t seed) {
  // d(x * u)/dx = u: the same multiplication.
  return jitter_apply(grad, eps, seed, "input_jitter_backward", "grad");
}

namespace {

// Validates, returns the counts as doubles.
std::vector<double> expert_bias_counts(const Tensor& expert_bias,
                                       const Tensor& num_tokens_per_expert, double rate) {
  constexpr const char* op = "update_expert_bias";
  detail::check_dtype(expert_bias, op, "expert_bias", {DType::fp32});
  detail::check_dim(expert_bias, op, "expert_bias", 1);
  const int64_t E = expert_bias.size(0);
  detail::check_dtype(num_tokens_per_expert, op, "num_tokens_per_expert",
                      {DType::int64, DType::int32, DType::fp32, DType::fp64});
  detail::check_shape(num_tokens_per_expert, op, "num_tokens_per_expert", {E});
  if (!std::isfinite(rate)) detail::fail_arg(op, "rate must be finite, got ", rate);
  return num_tokens_per_expert.to_double_vector();
}

Tensor expert_bias_step(const Tensor& expert_bias, const std::vector<double>& c, double rate) {
  const int64_t E = expert_bias.size(0);
  double sum = 0.0;
  for (double v : c) sum += v;
  Tensor out = Tensor::empty({E}, DType::fp32);
  const float* b = expert_bias.data<float>();
  float* o = out.data<float>();
  const float rate_f = static_cast<float>(rate);
  for (int64_t e = 0; e < E; ++e) {
    // sign(mean - c) compared as sum vs E*c, exact for integer counts below 2^53.
    const double lhs = sum, rhs = static_cast<double>(E) * c[e];
    const float sgn = lhs > rhs ? 1.0f : (lhs < rhs ? -1.0f : 0.0f);
    o[e] = b[e] + sgn * rate_f;
  }
  return out;
}

}  // namespace

Tensor update_expert_bias(const Tensor& expert_bias, const Tensor& num_tokens_per_expert,
                          double rate) {
  return expert_bias_step(expert_bias, expert_bias_counts(expert_bias, num_tokens_per_expert, rate),
                          rate);
}

Tensor update_expert_bias(const Tensor& expert_bias, const Tensor& num_tokens_per_expert,
                          double rate, dist::Communicator& comm) {
  std::vector<double> c;
  bool failed = false;
  try {
    c = expert_bias_counts(expert_bias, num_tokens_per_expert, rate);
  } catch (...) {
    failed = true;
    RouteComms rc;
    rc.loss = &comm;
    agree_on_failure(rc, true);
    throw;
  }
  RouteComms rc;
  rc.loss = &comm;
  const int bad = agree_on_failure(rc, failed);
  if (bad >= 0) detail::fail_arg("update_expert_bias", "rank ", bad, " failed (see its error)");
  // Counts are integers (exact in double below 2^53): the sum does not depend on the order.
  sum_over_ranks(comm, c.data(), static_cast<int64_t>(c.size()));
  return expert_bias_step(expert_bias, c, rate);
}

}  // namespace switchyard
