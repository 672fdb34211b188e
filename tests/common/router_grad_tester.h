// RouterGradTester: topk_route_backward against central finite differences in double, for one
// router configuration built fluently:
//
//   RouterGradTester().top_k(2).score(ScoreFunction::sigmoid).groups(4, 2).expert_bias().Test();
//
// The objective is L(z) = <gw, topk_weights(z)> + loss_grad_scale * (aux_loss(z) + z_loss(z)) with
// random fp64 logits z [T, E] and gw [T, K]; each step must leave every discrete choice unchanged.
// The fp32 backward on the same (fp32-representable) values is checked against the fp64 one.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "router_tester.h"
#include "router_testing.h"
#include "switchyard/router.h"
#include "testing.h"

namespace switchyard::testing {

class RouterGradTester : public RouterSetup<RouterGradTester> {
 public:
  RouterGradTester() : RouterSetup(8, 1, 9) {}

  /// A random N(0, 0.3) fp32 expert bias.
  RouterGradTester& expert_bias(bool on = true) { return bias_ = on, *this; }
  RouterGradTester& capacity(double factor, TokenDropPolicy policy) {
    config_.capacity_factor = factor;
    config_.token_drop_policy = policy;
    return *this;
  }
  /// Every third token (0, 3, 6, ...) padded.
  RouterGradTester& padding_mask(bool on = true) { return mask_ = on, *this; }
  /// Tokens 1 mod 3 replay a fixed (reversed-id) choice; tokens 2 mod 3 give all -1 (native).
  RouterGradTester& replay(bool on = true) { return replay_ = on, *this; }
  /// global_aux_loss starts from 2 accumulated steps of 3 tokens per expert.
  RouterGradTester& seq_length(int64_t s) { return seq_length_ = s, *this; }
  RouterGradTester& loss_grad_scale(double s) { return loss_scale_ = s, *this; }

  std::string describe() const {
    const RouterConfig& c = config_;
    std::ostringstream os;
    describe_shape(os);
    if (c.capacity_factor) {
      os << " capacity=" << *c.capacity_factor << " "
         << token_drop_policy_name(c.token_drop_policy);
    }
    if (c.aux_loss_type != AuxLossType::none) {
      os << " " << aux_loss_type_name(c.aux_loss_type) << "=" << c.aux_loss_coeff;
    }
    if (c.z_loss_coeff > 0) os << " z_loss=" << c.z_loss_coeff;
    if (seq_length_) os << " seq_length=" << seq_length_;
    if (loss_scale_ != 1.0) os << " loss_grad_scale=" << loss_scale_;
    if (bias_) os << " bias";
    if (mask_) os << " mask";
    if (replay_) os << " replay";
    return os.str();
  }

  void Test() const {
    const uint64_t seed = test_seed(seed_ ? *seed_ : seed_of(describe()));
    SCOPED_TRACE(describe() + " " + repro(seed));
    std::mt19937_64 rng(seed);
    const int64_t T = T_, E = config_.num_experts, K = config_.top_k;
    Tensor z = randn({T, E}, DType::fp64, rng, 1.5);
    Tensor gw = randn({T, K}, DType::fp64, rng);
    RouteInputs in;
    if (bias_) in.expert_bias = randn({E}, DType::fp32, rng, 0.3);
    if (mask_) {
      in.padding_mask = Tensor::zeros({T}, DType::boolean);
      for (int64_t t = 0; t < T; t += 3) in.padding_mask.data<bool>()[t] = true;
    }
    if (replay_) {
      in.replay_idx = Tensor::full({T, K}, DType::int32, -1);
      for (int64_t t = 1; t < T; t += 3) {
        for (int64_t k = 0; k < K; ++k) {
          in.replay_idx.data<int32_t>()[t * K + k] =
              static_cast<int32_t>((E - 1 - k - t) % E + E) % E;
        }
      }
    }
    RouteOptions opt;
    opt.seq_length = seq_length_;
    auto forward = [&](const Tensor& zz) {
      GlobalAuxLossState g;  // every evaluation starts from the same accumulated state
      g.num_tokens_per_expert = Tensor::full({E}, DType::fp64, 3.0);
      g.steps = 2;
      RouteInputs i2 = in;
      i2.global_aux_loss_state = &g;
      return topk_route(zz, i2, config_, opt);
    };
    auto objective = [&](const RouteResult& r) {
      double L = 0;
      for (int64_t i = 0; i < T * K; ++i) {
        L += gw.data<double>()[i] * r.topk_weights.data<double>()[i];
      }
      return L + loss_scale_ * (r.aux_loss + r.z_loss);
    };
    const RouteResult r0 = forward(z);
    RouteBackwardOptions bo;
    bo.loss_grad_scale = loss_scale_;
    const Tensor grad = topk_route_backward(gw, r0, bo).grad_logits;
    ASSERT_EQ(grad.shape(), z.shape());
    const double h = 1e-6;
    std::vector<double> fd(static_cast<size_t>(T * E));
    for (int64_t i = 0; i < T * E; ++i) {
      Tensor zp = z.clone(), zm = z.clone();
      zp.data<double>()[i] += h;
      zm.data<double>()[i] -= h;
      const RouteResult rp = forward(zp), rm = forward(zm);
      // The step must not change any discrete choice, or the difference is not a derivative.
      ASSERT_TRUE(bitwise_equal(rp.topk_idx, r0.topk_idx)) << "at " << coord(z.shape(), i);
      ASSERT_TRUE(bitwise_equal(rm.topk_idx, r0.topk_idx)) << "at " << coord(z.shape(), i);
      fd[i] = (objective(rp) - objective(rm)) / (2 * h);
    }
    EXPECT_TRUE(all_close(grad, fd, 1e-7, 1e-6));
    // Non-trivial: some gradient reaches the logits (post-softmax K=1 weights are constant 1).
    double norm = 0;
    for (double v : fd) norm += std::fabs(v);
    const bool constant_weights = config_.score_function == ScoreFunction::softmax &&
                                  !config_.pre_softmax && K == 1 &&
                                  config_.aux_loss_type == AuxLossType::none;
    if (!constant_weights) {
      EXPECT_GT(norm, 1e-3);
    }
    // fp32 backward on the same values agrees with the fp64 one.
    Tensor z32 = z.to(DType::fp32);
    Tensor z64 = z32.to(DType::fp64);
    const RouteResult r64 = forward(z64), r32 = forward(z32);
    if (bitwise_equal(r64.topk_idx, r32.topk_idx)) {
      const Tensor g64 = topk_route_backward(gw, r64, bo).grad_logits;
      const Tensor g32 = topk_route_backward(gw.to(DType::fp32), r32, bo).grad_logits;
      EXPECT_TRUE(all_close(g32, g64.to_double_vector(), 1e-5, 1e-4));
    }
  }

 private:
  bool bias_ = false, mask_ = false, replay_ = false;
  int64_t seq_length_ = 0;
  double loss_scale_ = 1.0;
};

}  // namespace switchyard::testing
