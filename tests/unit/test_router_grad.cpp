// topk_route_backward against central finite differences in double: for every score function and
// option (pre-softmax, groups, bias, scaling, capacity policies, padding, replayed rows) and every
// loss (aux, seq, global, z) with a loss-grad scale. Also fp32 backward against fp64 backward.
#include <cmath>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "switchyard/router.h"
#include "router_testing.h"
#include "testing.h"

namespace sy = switchyard;
using switchyard::testing::router_config;
using sy::AuxLossType;
using sy::DType;
using sy::RouterConfig;
using sy::ScoreFunction;
using sy::Tensor;
using sy::TokenDropPolicy;

namespace {

struct GradCase {
  RouterConfig cfg;
  int64_t T = 9;
  bool bias = false;
  bool mask = false;
  bool replay = false;
  int64_t seq_length = 0;
  double loss_scale = 1.0;
  std::string name;
};

// L(z) = <gw, topk_weights(z)> + loss_scale * (aux_loss(z) + z_loss(z)).
void check_grad(const GradCase& c, uint64_t seed) {
  SCOPED_TRACE(c.name + " " + sy::testing::repro(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = c.T, E = c.cfg.num_experts, K = c.cfg.top_k;
  Tensor z = sy::testing::randn({T, E}, DType::fp64, rng, 1.5);
  Tensor gw = sy::testing::randn({T, K}, DType::fp64, rng);
  sy::RouteInputs in;
  if (c.bias) in.expert_bias = sy::testing::randn({E}, DType::fp32, rng, 0.3);
  if (c.mask) {
    in.padding_mask = Tensor::zeros({T}, DType::boolean);
    for (int64_t t = 0; t < T; t += 3) in.padding_mask.data<bool>()[t] = true;
  }
  if (c.replay) {
    // Rows 1 mod 3 replay a reversed-id choice, rows 2 mod 3 are all -1 (native).
    in.replay_idx = Tensor::full({T, K}, DType::int32, -1);
    for (int64_t t = 1; t < T; t += 3) {
      for (int64_t k = 0; k < K; ++k) {
        in.replay_idx.data<int32_t>()[t * K + k] =
            static_cast<int32_t>((E - 1 - k - t) % E + E) % E;
      }
    }
  }
  sy::GlobalAuxLossState g0;
  g0.num_tokens_per_expert = Tensor::full({E}, DType::fp64, 3.0);
  g0.steps = 2;
  sy::RouteOptions opt;
  opt.seq_length = c.seq_length;
  auto forward = [&](const Tensor& zz) {
    sy::GlobalAuxLossState g;  // every evaluation starts from the same accumulated state
    g.num_tokens_per_expert = g0.num_tokens_per_expert.clone();
    g.steps = g0.steps;
    sy::RouteInputs i2 = in;
    i2.global_aux_loss_state = &g;
    return sy::topk_route(zz, i2, c.cfg, opt);
  };
  auto objective = [&](const sy::RouteResult& r) {
    double L = 0;
    for (int64_t i = 0; i < T * K; ++i)
      L += gw.data<double>()[i] * r.topk_weights.data<double>()[i];
    return L + c.loss_scale * (r.aux_loss + r.z_loss);
  };
  const sy::RouteResult r0 = forward(z);
  sy::RouteBackwardOptions bo;
  bo.loss_grad_scale = c.loss_scale;
  const Tensor grad = sy::topk_route_backward(gw, r0, bo).grad_logits;
  ASSERT_EQ(grad.shape(), z.shape());
  const double h = 1e-6;
  std::vector<double> fd(static_cast<size_t>(T * E));
  for (int64_t i = 0; i < T * E; ++i) {
    Tensor zp = z.clone(), zm = z.clone();
    zp.data<double>()[i] += h;
    zm.data<double>()[i] -= h;
    const auto rp = forward(zp), rm = forward(zm);
    // The step must not change any discrete choice, or the difference is not a derivative.
    ASSERT_TRUE(sy::testing::bitwise_equal(rp.topk_idx, r0.topk_idx)) << "at " << i;
    ASSERT_TRUE(sy::testing::bitwise_equal(rm.topk_idx, r0.topk_idx)) << "at " << i;
    fd[i] = (objective(rp) - objective(rm)) / (2 * h);
  }
  EXPECT_TRUE(sy::testing::all_close(grad, fd, 1e-7, 1e-6));
  // Non-trivial: some gradient reaches the logits (post-softmax K=1 weights are constant 1).
  double norm = 0;
  for (double v : fd) norm += std::fabs(v);
  const bool constant_weights = c.cfg.score_function == ScoreFunction::softmax &&
                                !c.cfg.pre_softmax && K == 1 &&
                                c.cfg.aux_loss_type == AuxLossType::none;
  if (!constant_weights) {
    EXPECT_GT(norm, 1e-3);
  }
  // fp32 backward on the same values agrees with the fp64 one.
  {
    Tensor z32 = z.to(DType::fp32);
    Tensor z64 = z32.to(DType::fp64);
    const auto r64 = forward(z64), r32 = forward(z32);
    if (sy::testing::bitwise_equal(r64.topk_idx, r32.topk_idx)) {
      const Tensor g64 = sy::topk_route_backward(gw, r64, bo).grad_logits;
      const Tensor g32 = sy::topk_route_backward(gw.to(DType::fp32), r32, bo).grad_logits;
      EXPECT_TRUE(sy::testing::all_close(g32, g64.to_double_vector(), 1e-5, 1e-4));
    }
  }
}

std::vector<GradCase> all_cases() {
  std::vector<GradCase> v;
  const char* fname[] = {"softmax", "sigmoid", "sqrtsoftplus", "softmax-pre"};
  for (int f = 0; f < 4; ++f) {
    for (int64_t K : {1, 2, 3}) {
      GradCase g;
      g.cfg = router_config(8, K, f == 3 ? ScoreFunction::softmax : static_cast<ScoreFunction>(f));
      g.cfg.pre_softmax = f == 3;
      g.name = std::string(fname[f]) + " K=" + std::to_string(K);
      v.push_back(g);
      GradCase s = g;  // scaling + bias + groups
      s.cfg.topk_scaling_factor = 2.5;
      s.bias = true;
      if (K >= 2) {
        s.cfg.num_groups = 4;
        s.cfg.group_topk = 2;
      }
      s.name += " scaled+bias+groups";
      v.push_back(s);
      for (auto pol : {TokenDropPolicy::probs, TokenDropPolicy::position}) {
        GradCase cp = g;
        cp.cfg.capacity_factor = 0.5;
        cp.cfg.token_drop_policy = pol;
        cp.mask = true;
        cp.name += std::string(" capacity ") + sy::token_drop_policy_name(pol) + " + mask";
        v.push_back(cp);
      }
      GradCase rp = g;
      rp.replay = true;
      rp.name += " replay";
      v.push_back(rp);
      for (auto t :
           {AuxLossType::aux_loss, AuxLossType::seq_aux_loss, AuxLossType::global_aux_loss}) {
        for (bool mask : {false, true}) {
          GradCase a = g;
          a.cfg.aux_loss_type = t;
          a.cfg.aux_loss_coeff = 0.7;
          a.cfg.z_loss_coeff = 0.2;
          a.seq_length = 3;  // 3 sequences
          a.loss_scale = 1.7;
          a.mask = mask;
          a.replay = mask;
          a.name += std::string(" ") + sy::aux_loss_type_name(t) + " + z" +
                    (mask ? " + mask/replay" : "");
          v.push_back(a);
        }
      }
    }
  }
  return v;
}

}  // namespace

TEST(RouterGrad, FiniteDifferencesEveryOptionAndLoss) {
  uint64_t s = sy::testing::test_seed(101);
  for (const GradCase& c : all_cases()) check_grad(c, ++s);
}

TEST(RouterGrad, LossesOnlyWhenNoWeightGradient) {
  std::mt19937_64 rng(sy::testing::test_seed(111));
  RouterConfig c = router_config(8, 2, ScoreFunction::softmax);
  Tensor z = sy::testing::randn({5, 8}, DType::fp64, rng);
  const auto r = sy::topk_route(z, {}, c);
  const Tensor g = sy::topk_route_backward(Tensor(), r).grad_logits;
  EXPECT_TRUE(sy::testing::all_close(g, std::vector<double>(40, 0.0), 0, 0));
  c.z_loss_coeff = 0.1;
  const auto rz = sy::topk_route(z, {}, c);
  const Tensor gz = sy::topk_route_backward(Tensor(), rz).grad_logits;
  // d/dz of coeff * mean(lse^2) = 2 coeff lse softmax(z) / T.
  const std::vector<double> zd = z.to_double_vector();
  std::vector<double> want(40);
  for (int64_t t = 0; t < 5; ++t) {
    double m = -INFINITY, s = 0;
    for (int64_t e = 0; e < 8; ++e) m = std::max(m, zd[t * 8 + e]);
    for (int64_t e = 0; e < 8; ++e) s += std::exp(zd[t * 8 + e] - m);
    const double lse = m + std::log(s);
    for (int64_t e = 0; e < 8; ++e) {
      want[t * 8 + e] = 2 * 0.1 * lse * std::exp(zd[t * 8 + e] - lse) / 5;
    }
  }
  EXPECT_TRUE(sy::testing::all_close(gz, want, 1e-14, 1e-12));
}
