// Router configuration: enum names and validate_router_config (the checks topk_route runs first),
// and the load-balancing coefficients a config asks for.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "check.h"
#include "router_internal.h"
#include "switchyard/router.h"

namespace switchyard {

namespace {
constexpr const char* kOp = detail::kRouteOp;
}  // namespace

namespace detail {

std::string layer_prefix(int64_t layer) {
  return layer >= 0 ? detail::cat("layer ", layer, ", ") : std::string();
}

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

}  // namespace detail

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
  if (c.padding_for_quantization && c.padding_align_size < 1) {
    detail::fail_arg(kOp, "padding_align_size must be >= 1 with padding_for_quantization, got ",
                     "padding_align_size=", c.padding_align_size);
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

}  // namespace switchyard
