// topk_route_backward against central finite differences in double: for every score function and
// option (pre-softmax, groups, bias, scaling, capacity policies, padding, replayed rows) and every
// loss (aux, seq, global, z) with a loss-grad scale. Also fp32 backward against fp64 backward.
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "router_grad_tester.h"
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
using sy::TokenDropPolicy;

namespace {

using sy::testing::RouterGradTester;

constexpr int64_t kTopKs[] = {1, 2, 3};

RouterGradTester base(ScoreFunction f, bool pre_softmax, int64_t K) {
  return RouterGradTester().experts(8).top_k(K).score(f).pre_softmax(pre_softmax);
}

// Scaling 2.5, an expert bias and (K >= 2) groups 4/2.
void scaled_biased_grouped(ScoreFunction f, bool pre) {
  for (int64_t K : kTopKs) {
    RouterGradTester t = base(f, pre, K).scaling(2.5).expert_bias();
    if (K >= 2) t.groups(4, 2);
    t.Test();
  }
}

void capacity_masked(ScoreFunction f, bool pre, TokenDropPolicy policy) {
  for (int64_t K : kTopKs) base(f, pre, K).capacity(0.5, policy).padding_mask().Test();
}

void replayed(ScoreFunction f, bool pre) {
  for (int64_t K : kTopKs) base(f, pre, K).replay().Test();
}

// A load-balancing loss plus the z-loss, 3 sequences, loss_grad_scale 1.7; optionally with padded
// and replayed rows.
void losses(ScoreFunction f, bool pre, AuxLossType type, bool masked_and_replayed) {
  for (int64_t K : kTopKs) {
    base(f, pre, K)
        .aux_loss(type, 0.7)
        .z_loss(0.2)
        .seq_length(3)
        .loss_grad_scale(1.7)
        .padding_mask(masked_and_replayed)
        .replay(masked_and_replayed)
        .Test();
  }
}

}  // namespace

// One suite per score function; each case runs top_k 1, 2 and 3 of 8 experts on 9 tokens.
#define SY_ROUTER_GRAD_CASES(Suite, f, pre)                                                 \
  TEST(Suite, WeightsMatchFiniteDifferences) {                                              \
    for (int64_t K : kTopKs) base(f, pre, K).Test();                                        \
  }                                                                                         \
  TEST(Suite, ScaledBiasedGroupedMatchFiniteDifferences) { scaled_biased_grouped(f, pre); } \
  TEST(Suite, ProbsCapacityWithPaddingMatchesFiniteDifferences) {                           \
    capacity_masked(f, pre, TokenDropPolicy::probs);                                        \
  }                                                                                         \
  TEST(Suite, PositionCapacityWithPaddingMatchesFiniteDifferences) {                        \
    capacity_masked(f, pre, TokenDropPolicy::position);                                     \
  }                                                                                         \
  TEST(Suite, ReplayedRowsMatchFiniteDifferences) { replayed(f, pre); }                     \
  TEST(Suite, AuxLossAndZLossMatchFiniteDifferences) {                                      \
    losses(f, pre, AuxLossType::aux_loss, false);                                           \
  }                                                                                         \
  TEST(Suite, AuxLossAndZLossWithPaddingAndReplayMatchFiniteDifferences) {                  \
    losses(f, pre, AuxLossType::aux_loss, true);                                            \
  }                                                                                         \
  TEST(Suite, SeqAuxLossAndZLossMatchFiniteDifferences) {                                   \
    losses(f, pre, AuxLossType::seq_aux_loss, false);                                       \
  }                                                                                         \
  TEST(Suite, SeqAuxLossAndZLossWithPaddingAndReplayMatchFiniteDifferences) {               \
    losses(f, pre, AuxLossType::seq_aux_loss, true);                                        \
  }                                                                                         \
  TEST(Suite, GlobalAuxLossAndZLossMatchFiniteDifferences) {                                \
    losses(f, pre, AuxLossType::global_aux_loss, false);                                    \
  }                                                                                         \
  TEST(Suite, GlobalAuxLossAndZLossWithPaddingAndReplayMatchFiniteDifferences) {            \
    losses(f, pre, AuxLossType::global_aux_loss, true);                                     \
  }

SY_ROUTER_GRAD_CASES(RouterGradSoftmax, ScoreFunction::softmax, false)
SY_ROUTER_GRAD_CASES(RouterGradSigmoid, ScoreFunction::sigmoid, false)
SY_ROUTER_GRAD_CASES(RouterGradSqrtSoftplus, ScoreFunction::sqrtsoftplus, false)
SY_ROUTER_GRAD_CASES(RouterGradPreSoftmax, ScoreFunction::softmax, true)

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
