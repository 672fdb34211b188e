// Router test helpers shared by the router, replay and bad-input tests.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>

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

/// The fluent router-configuration setters the router, gradient and replay testers share (CRTP:
/// each setter returns the derived tester). Holds the config, the token count and the seed.
template <class Derived>
class RouterSetup {
 public:
  Derived& tokens(int64_t T) { return T_ = T, self(); }
  Derived& experts(int64_t E) { return config_.num_experts = E, self(); }
  Derived& top_k(int64_t K) { return config_.top_k = K, self(); }
  Derived& score(ScoreFunction f) { return config_.score_function = f, self(); }
  Derived& pre_softmax(bool on = true) { return config_.pre_softmax = on, self(); }
  Derived& groups(int64_t num_groups, int64_t group_topk) {
    config_.num_groups = num_groups;
    config_.group_topk = group_topk;
    return self();
  }
  Derived& scaling(double factor) { return config_.topk_scaling_factor = factor, self(); }
  Derived& aux_loss(AuxLossType type, double coeff) {
    config_.aux_loss_type = type;
    config_.aux_loss_coeff = coeff;
    return self();
  }
  Derived& z_loss(double coeff) { return config_.z_loss_coeff = coeff, self(); }
  Derived& seed(uint64_t s) { return seed_ = s, self(); }

 protected:
  RouterSetup(int64_t num_experts, int64_t top_k, int64_t tokens) : T_(tokens) {
    config_.num_experts = num_experts;
    config_.top_k = top_k;
  }
  Derived& self() { return static_cast<Derived&>(*this); }
  /// "T=.. E=.. K=.. score[ pre_softmax][ groups=g/m][ scale=s]": the start of every tester's
  /// description (the description seeds the case's randomness).
  void describe_shape(std::ostream& os) const {
    const RouterConfig& c = config_;
    os << "T=" << T_ << " E=" << c.num_experts << " K=" << c.top_k << " "
       << score_function_name(c.score_function) << (c.pre_softmax ? " pre_softmax" : "");
    if (c.num_groups) os << " groups=" << c.num_groups << "/" << c.group_topk;
    if (c.topk_scaling_factor != 1.0) os << " scale=" << c.topk_scaling_factor;
  }

  RouterConfig config_;
  int64_t T_;
  std::optional<uint64_t> seed_;
};

}  // namespace switchyard::testing
