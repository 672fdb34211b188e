// Router numerics at the edges of fp32 (issue 14): selection must follow the exact logit order
// when fp32 exp underflows or the sigmoid saturates, the sqrtsoftplus derivative must match
// float64 far below -88, and the global aux-loss state must advance only when asked.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "ref/router_ref.h"
#include "router_tester.h"
#include "router_testing.h"
#include "switchyard/router.h"
#include "testing.h"

namespace sy = switchyard;
using switchyard::testing::router_config;
using sy::AuxLossType;
using sy::DType;
using sy::RouterConfig;
using sy::ScoreFunction;
using sy::Tensor;
using sy::testing::all_close;
using sy::testing::bitwise_equal;

namespace {

// Ids of the K largest logits of each row (ties: lower id), the exact order every score function
// selects in without expert bias (all of them are increasing in the logit).
std::vector<double> ids_by_logit(const std::vector<double>& z, int64_t T, int64_t E, int64_t K) {
  std::vector<double> out;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> row(z.begin() + t * E, z.begin() + (t + 1) * E);
    for (int32_t e : sy::ref::topk_ids(row, K)) out.push_back(e);
  }
  return out;
}

struct Extreme {
  const char* name;
  ScoreFunction f;
  bool pre;
  double lo, hi;  // logits drawn uniformly from [lo, hi] except one anchor per row
  double anchor;  // logit of expert t % E (sets the softmax max)
};

// Ranges where fp32 scores go flat: softmax probabilities under 1e-38 (span > 87 nats), the
// sigmoid below -88 (its exp(-z) overflows) and above +17 (rounds to 1), sqrt(softplus) far below
// -88 (softplus underflows).
const Extreme kExtremes[] = {
    {"softmax-pre span 150", ScoreFunction::softmax, true, -150.0, -90.0, 0.0},
    {"softmax-post span 150", ScoreFunction::softmax, false, -150.0, -90.0, 0.0},
    {"sigmoid below -88", ScoreFunction::sigmoid, false, -140.0, -89.0, -95.0},
    {"sigmoid saturated", ScoreFunction::sigmoid, false, 18.0, 60.0, 20.0},
    {"sqrtsoftplus below -88", ScoreFunction::sqrtsoftplus, false, -300.0, -89.0, -95.0},
};

Tensor extreme_logits(const Extreme& x, int64_t T, int64_t E, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(x.lo, x.hi);
  Tensor z = Tensor::empty({T, E}, DType::fp64);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) z.data<double>()[t * E + e] = u(rng);
    z.data<double>()[t * E + t % E] = x.anchor;
  }
  return z.to(DType::fp32);
}

std::mt19937_64 rng_for(const char* property, const Extreme& x) {
  const uint64_t seed =
      sy::testing::test_seed(sy::testing::seed_of(std::string(property) + " " + x.name));
  return std::mt19937_64(seed);
}

// Before the fix the last slots of these rows went to the lowest ids (tied zero probabilities,
// a flat sigmoid) instead of following the logits. E in {8, 16, 64}, K in {2, 4, 8}.
void selection_follows_logits(const Extreme& x) {
  std::mt19937_64 rng = rng_for("selection", x);
  const int64_t T = 37;
  for (int64_t E : {8, 16, 64}) {
    for (int64_t K : {2, 4, 8}) {
      SCOPED_TRACE(std::string(x.name) + " E=" + std::to_string(E) + " K=" + std::to_string(K));
      RouterConfig c = router_config(E, K, x.f, x.pre);
      const Tensor z = extreme_logits(x, T, E, rng);
      const auto r = sy::topk_route(z, {}, c);
      EXPECT_TRUE(all_close(r.topk_idx, ids_by_logit(z.to_double_vector(), T, E, K), 0, 0));
      // The aux-loss counts use the same exact order (their scores are increasing in z too).
      c.aux_loss_type = AuxLossType::aux_loss;
      c.aux_loss_coeff = 0.1;
      const auto ra = sy::topk_route(z, {}, c);
      const auto want = sy::ref::route(z.to_double_vector(), T, c, {});
      EXPECT_TRUE(all_close(ra.num_tokens_per_expert,
                            std::vector<double>(want.counts.begin(), want.counts.end()), 0, 0));
      EXPECT_NEAR(ra.aux_loss, want.aux_loss, 1e-6 * std::fabs(want.aux_loss) + 1e-12);
    }
  }
}

// Groups: the experts within each group and the final K follow the logits; the group scores tie
// (all flat) and the tie goes to the group whose best logits are larger.
void group_limited_selection_follows_logits(const Extreme& x) {
  std::mt19937_64 rng = rng_for("groups", x);
  const int64_t T = 29, E = 32, K = 4;
  SCOPED_TRACE(x.name);
  RouterConfig c = router_config(E, K, x.f, x.pre);
  c.num_groups = 8;
  c.group_topk = 2;
  const Tensor z = extreme_logits(x, T, E, rng);
  const auto r = sy::topk_route(z, {}, c);
  const auto want = sy::ref::route(z.to_double_vector(), T, c, {});
  EXPECT_TRUE(all_close(r.topk_idx, std::vector<double>(want.idx.begin(), want.idx.end()), 0, 0));
}

// With expert bias the key is s + bias in the router dtype (Megatron's); where those keys tie
// (a flat score plus an equal bias) the logit decides. Equal biases make every flat row a tie.
// (Not for post-softmax, which selects on z + bias.)
void biased_selection_breaks_flat_ties_by_logit(const Extreme& x, bool groups) {
  std::mt19937_64 rng = rng_for(groups ? "equal bias groups" : "equal bias", x);
  const int64_t T = 31, E = 16, K = 4;
  SCOPED_TRACE(std::string(x.name) + (groups ? " groups" : ""));
  RouterConfig c = router_config(E, K, x.f, x.pre);
  if (groups) {
    c.num_groups = 4;
    c.group_topk = 2;
  }
  const Tensor z = extreme_logits(x, T, E, rng);
  sy::RouteInputs in;
  in.expert_bias = Tensor::full({E}, DType::fp32, 0.25);
  const auto r = sy::topk_route(z, in, c);
  sy::ref::RefRouteInputs rin;
  rin.bias.assign(static_cast<size_t>(E), 0.25);
  const auto want = sy::ref::route(z.to_double_vector(), T, c, rin);
  EXPECT_TRUE(all_close(r.topk_idx, std::vector<double>(want.idx.begin(), want.idx.end()), 0, 0));
  if (!groups) {
    // Equal biases do not change the order at all here: still the logit order.
    EXPECT_TRUE(all_close(r.topk_idx, ids_by_logit(z.to_double_vector(), T, E, K), 0, 0));
  }
}

// Random biases on flat scores: the bias decides where it differs, the logit where it ties.
void biased_selection_on_flat_scores(const Extreme& x) {
  std::mt19937_64 rng = rng_for("bias", x);
  const int64_t T = 41, E = 16, K = 3;
  SCOPED_TRACE(x.name);
  RouterConfig c = router_config(E, K, x.f, x.pre);
  const Tensor z = extreme_logits(x, T, E, rng);
  sy::RouteInputs in;
  in.expert_bias = Tensor::empty({E}, DType::fp32);
  for (int64_t e = 0; e < E; ++e) {
    in.expert_bias.data<float>()[e] = 0.125f * static_cast<float>(e % 3);
  }
  const auto r = sy::topk_route(z, in, c);
  sy::ref::RefRouteInputs rin;
  rin.bias = in.expert_bias.to_double_vector();
  const auto want = sy::ref::route(z.to_double_vector(), T, c, rin);
  EXPECT_TRUE(all_close(r.topk_idx, std::vector<double>(want.idx.begin(), want.idx.end()), 0, 0));
}

}  // namespace

// One suite per regime where fp32 scores go flat (kExtremes).
#define SY_FLAT_SCORE_CASES(Suite, i)                                             \
  TEST(Suite, SelectionFollowsLogits) { selection_follows_logits(kExtremes[i]); } \
  TEST(Suite, GroupLimitedSelectionFollowsLogits) {                               \
    group_limited_selection_follows_logits(kExtremes[i]);                         \
  }
#define SY_FLAT_SCORE_BIAS_CASES(Suite, i)                           \
  TEST(Suite, EqualBiasTiesGoByLogit) {                              \
    biased_selection_breaks_flat_ties_by_logit(kExtremes[i], false); \
  }                                                                  \
  TEST(Suite, EqualBiasTiesGoByLogitWithGroups) {                    \
    biased_selection_breaks_flat_ties_by_logit(kExtremes[i], true);  \
  }                                                                  \
  TEST(Suite, RandomBiasMatchesReference) { biased_selection_on_flat_scores(kExtremes[i]); }

SY_FLAT_SCORE_CASES(RouterFlatPreSoftmaxSpan150, 0)
SY_FLAT_SCORE_BIAS_CASES(RouterFlatPreSoftmaxSpan150, 0)
SY_FLAT_SCORE_CASES(RouterFlatSoftmaxSpan150, 1)
SY_FLAT_SCORE_CASES(RouterFlatSigmoidBelowMinus88, 2)
SY_FLAT_SCORE_BIAS_CASES(RouterFlatSigmoidBelowMinus88, 2)
SY_FLAT_SCORE_CASES(RouterFlatSigmoidSaturated, 3)
SY_FLAT_SCORE_BIAS_CASES(RouterFlatSigmoidSaturated, 3)
SY_FLAT_SCORE_CASES(RouterFlatSqrtSoftplusBelowMinus88, 4)
SY_FLAT_SCORE_BIAS_CASES(RouterFlatSqrtSoftplusBelowMinus88, 4)

// Before the fix the fp32 derivative used a clamped exp: at z = -89 the weight gradient was about
// e times the float64 one (0.473 against 0.174 in the case).
TEST(RouterNumerics, SqrtSoftplusGradientFarBelowMinus88MatchesFloat64) {
  std::mt19937_64 rng(sy::testing::test_seed(1405));
  for (int64_t K : {1, 2, 4}) {
    for (double lo : {-92.0, -120.0, -170.0}) {
      SCOPED_TRACE("K=" + std::to_string(K) + " lo=" + std::to_string(lo));
      const int64_t T = 13, E = 8;
      RouterConfig c = router_config(E, K, ScoreFunction::sqrtsoftplus);
      std::uniform_real_distribution<double> u(lo, -88.5);
      Tensor z64 = Tensor::empty({T, E}, DType::fp64);
      for (int64_t i = 0; i < T * E; ++i) z64.data<double>()[i] = u(rng);
      const Tensor z32 = z64.to(DType::fp32);
      z64 = z32.to(DType::fp64);  // the same values in both dtypes
      Tensor gw = sy::testing::randn({T, K}, DType::fp64, rng);
      const auto r32 = sy::topk_route(z32, {}, c);
      const auto r64 = sy::topk_route(z64, {}, c);
      ASSERT_TRUE(bitwise_equal(r32.topk_idx, r64.topk_idx));
      EXPECT_TRUE(all_close(r32.topk_weights, r64.topk_weights.to_double_vector(), 0, 1e-5));
      const Tensor g32 = sy::topk_route_backward(gw.to(DType::fp32), r32).grad_logits;
      const Tensor g64 = sy::topk_route_backward(gw, r64).grad_logits;
      // float64 against its own central differences (the reference of the reference).
      const std::vector<double> g = g64.to_double_vector();
      for (int64_t i = 0; i < T * E; i += 5) {
        const double h = 1e-4;
        Tensor zp = z64.clone(), zm = z64.clone();
        zp.data<double>()[i] += h;
        zm.data<double>()[i] -= h;
        const auto rp = sy::topk_route(zp, {}, c), rm = sy::topk_route(zm, {}, c);
        double lp = 0, lm = 0;  // only row i / E moves: the others would add round-off
        for (int64_t j = i / E * K; j < (i / E + 1) * K; ++j) {
          lp += gw.data<double>()[j] * rp.topk_weights.data<double>()[j];
          lm += gw.data<double>()[j] * rm.topk_weights.data<double>()[j];
        }
        const double fd = (lp - lm) / (2 * h);
        // Round-off of the O(1) objective over 2h limits this check to about 1e-4 relative.
        EXPECT_NEAR(g[i], fd, 1e-3 * std::fabs(fd) + 1e-12 * (std::fabs(lp) + std::fabs(lm)) / h)
            << "at " << i;
      }
      // Relative to each element (the values are down to 1e-37): no absolute slack.
      EXPECT_TRUE(all_close(g32, g, 1e-44, 1e-4));
    }
  }
}

// read_only: the state is left as it was and the loss equals what an accumulating call on the
// same state returns (so a no_grad, eval or recompute forward reports the training value).
TEST(RouterNumerics, ReadOnlyGlobalAuxLossLeavesTheState) {
  std::mt19937_64 rng(sy::testing::test_seed(1406));
  RouterConfig c = router_config(8, 2, ScoreFunction::sigmoid);
  c.aux_loss_type = AuxLossType::global_aux_loss;
  c.aux_loss_coeff = 0.3;
  sy::GlobalAuxLossState acc, ro;
  const Tensor z0 = sy::testing::randn({21, 8}, DType::fp32, rng);
  sy::RouteInputs in;
  in.global_aux_loss_state = &acc;
  sy::topk_route(z0, in, c);
  in.global_aux_loss_state = &ro;
  sy::topk_route(z0, in, c);
  const Tensor z = sy::testing::randn({21, 8}, DType::fp32, rng);
  sy::RouteOptions opt;
  opt.global_aux_loss_update = sy::GlobalAuxLossUpdate::read_only;
  const Tensor before = ro.num_tokens_per_expert.clone();
  const auto r_ro = sy::topk_route(z, in, c, opt);
  EXPECT_EQ(ro.steps, 1);
  EXPECT_TRUE(bitwise_equal(ro.num_tokens_per_expert, before));
  in.global_aux_loss_state = &acc;
  const auto r_acc = sy::topk_route(z, in, c);
  EXPECT_EQ(acc.steps, 2);
  EXPECT_EQ(r_ro.aux_loss, r_acc.aux_loss);
  EXPECT_TRUE(bitwise_equal(sy::topk_route_backward(Tensor(), r_ro).grad_logits,
                            sy::topk_route_backward(Tensor(), r_acc).grad_logits));
  // A read-only call on an empty state is the first step's loss, and the state stays empty.
  sy::GlobalAuxLossState empty;
  in.global_aux_loss_state = &empty;
  const auto r_e = sy::topk_route(z, in, c, opt);
  EXPECT_EQ(empty.steps, 0);
  EXPECT_FALSE(empty.num_tokens_per_expert.defined());
  EXPECT_GT(r_e.aux_loss, 0.0);
}
