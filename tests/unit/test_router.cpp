// Router forward against the double reference (tests/ref/router_ref.h): every score function,
// pre/post softmax, groups, expert bias, capacity (both policies, pad), padding mask, losses, and
// the shapes that break kernels; ties, invariances and every argument error.
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "model_shapes.h"
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
using sy::TokenDropPolicy;
using sy::testing::all_close;
using sy::testing::bitwise_equal;

namespace {

using sy::testing::kDeepSeekV3;
using sy::testing::kQwen3_30B_A3B;
using sy::testing::RouterTester;

// The shapes that break kernels (STYLE.md) for one score function, E and K: T in {0, 1, 7, 1031},
// fp32 and fp64, with the aux and z losses on.
void token_counts(ScoreFunction f, bool pre_softmax, bool bias, int64_t E, int64_t K) {
  for (int64_t T : {0, 1, 7, 1031}) {
    if (T * E > 1031 * 64 && K > 8) continue;  // keeps the K = E = 256 reference quick
    RouterTester()
        .tokens(T)
        .experts(E)
        .top_k(K)
        .score(f)
        .pre_softmax(pre_softmax)
        .expert_bias(bias)
        .aux_loss(AuxLossType::aux_loss, 1e-2)
        .z_loss(1e-3)
        .Test();
  }
}

// Group-limited top-8 with groups 8/4 and scaling 2.5 (DeepSeek-V3's router) at E 256 and 64.
void group_limited(ScoreFunction f, bool pre_softmax, int64_t E, bool bias) {
  RouterTester()
      .tokens(257)
      .model(kDeepSeekV3)
      .experts(E)
      .score(f)
      .pre_softmax(pre_softmax)
      .expert_bias(bias)
      .Test();
}

// Logits on a 0.5 grid (many exact ties, as bf16-rounded logits have): every selection path
// (8-wide block threshold, generic insertion, group masks) breaks ties by the lower id, and the aux
// loss's own top-k on P too.
void coarse_ties(ScoreFunction f, bool pre_softmax, bool grouped) {
  for (int64_t E : {8, 16, 24, 64, 128, 256}) {
    for (int64_t K : {1, 2, 3, 5, 8, 9}) {
      if (K > E) continue;
      RouterTester t;
      t.tokens(33).experts(E).top_k(K).score(f).pre_softmax(pre_softmax);
      if (grouped) {
        if (E % 8 != 0 || K < 2 || K > 2 * (E / 8)) continue;
        t.groups(8, 2);
      }
      t.aux_loss(AuxLossType::aux_loss, 0.1).coarse_logits().dtype(DType::fp32).Test();
    }
  }
}

// Capacity C = ceil(T*K/E * factor) with E 8, K 2, T 1031: with and without pad_to_capacity and a
// padding mask, sigmoid in fp64 and softmax in fp32.
void capacity(TokenDropPolicy policy, double factor) {
  for (bool pad : {false, true}) {
    for (bool mask : {false, true}) {
      RouterTester t;
      t.tokens(1031).experts(8).top_k(2).capacity(factor, policy).pad_to_capacity(pad);
      t.padding_mask(mask);
      t.score(ScoreFunction::sigmoid).dtype(DType::fp64).Test();
      t.score(ScoreFunction::softmax).dtype(DType::fp32).Test();
    }
  }
}

// seq_aux_loss (4 sequences of 24 tokens) or global_aux_loss at E 16, K 4, with and without a
// padding mask.
void sequence_losses(ScoreFunction f, AuxLossType type) {
  for (bool mask : {false, true}) {
    RouterTester()
        .tokens(96)
        .seq_length(24)
        .experts(16)
        .top_k(4)
        .score(f)
        .aux_loss(type, 0.1)
        .padding_mask(mask)
        .Test();
  }
}

// More sequences than tokens per loss chunk, and counts just above and below the chunk size: the
// partial sums stay O(T x E) and exact.
void many_sequences(int64_t seq_length) {
  for (bool mask : {false, true}) {
    RouterTester()
        .tokens(301 - 301 % seq_length)
        .seq_length(seq_length)
        .experts(8)
        .top_k(2)
        .aux_loss(AuxLossType::seq_aux_loss, 0.1)
        .padding_mask(mask)
        .Test();
  }
}

}  // namespace

#define SY_ROUTER_TOKEN_COUNTS(Suite, f, pre, bias)                   \
  TEST(Suite, ShapesE1Top1) { token_counts(f, pre, bias, 1, 1); }     \
  TEST(Suite, ShapesE2Top1) { token_counts(f, pre, bias, 2, 1); }     \
  TEST(Suite, ShapesE2Top2) { token_counts(f, pre, bias, 2, 2); }     \
  TEST(Suite, ShapesE8Top1) { token_counts(f, pre, bias, 8, 1); }     \
  TEST(Suite, ShapesE8Top2) { token_counts(f, pre, bias, 8, 2); }     \
  TEST(Suite, ShapesE8Top8) { token_counts(f, pre, bias, 8, 8); }     \
  TEST(Suite, ShapesE64Top1) { token_counts(f, pre, bias, 64, 1); }   \
  TEST(Suite, ShapesE64Top2) { token_counts(f, pre, bias, 64, 2); }   \
  TEST(Suite, ShapesE64Top8) { token_counts(f, pre, bias, 64, 8); }   \
  TEST(Suite, ShapesE64Top64) { token_counts(f, pre, bias, 64, 64); } \
  TEST(Suite, ShapesE256Top1) { token_counts(f, pre, bias, 256, 1); } \
  TEST(Suite, ShapesE256Top2) { token_counts(f, pre, bias, 256, 2); } \
  TEST(Suite, ShapesE256Top8) { token_counts(f, pre, bias, 256, 8); } \
  TEST(Suite, ShapesE256Top256) { token_counts(f, pre, bias, 256, 256); }

// One suite per score function; sigmoid's runs with an expert bias.
SY_ROUTER_TOKEN_COUNTS(RouterSoftmax, ScoreFunction::softmax, false, false)
SY_ROUTER_TOKEN_COUNTS(RouterSigmoid, ScoreFunction::sigmoid, false, true)
SY_ROUTER_TOKEN_COUNTS(RouterSqrtSoftplus, ScoreFunction::sqrtsoftplus, false, false)
SY_ROUTER_TOKEN_COUNTS(RouterPreSoftmax, ScoreFunction::softmax, true, false)

#define SY_ROUTER_GROUP_LIMITED(Suite, f, pre)                                                     \
  TEST(Suite, GroupLimitedTop8OfDeepSeekV3Shape) { group_limited(f, pre, 256, true); }             \
  TEST(Suite, GroupLimitedTop8OfDeepSeekV3ShapeWithoutBias) { group_limited(f, pre, 256, false); } \
  TEST(Suite, GroupLimitedTop8Of64Experts) { group_limited(f, pre, 64, true); }                    \
  TEST(Suite, GroupLimitedTop8Of64ExpertsWithoutBias) { group_limited(f, pre, 64, false); }

SY_ROUTER_GROUP_LIMITED(RouterSoftmax, ScoreFunction::softmax, false)
SY_ROUTER_GROUP_LIMITED(RouterSigmoid, ScoreFunction::sigmoid, false)
SY_ROUTER_GROUP_LIMITED(RouterSqrtSoftplus, ScoreFunction::sqrtsoftplus, false)
SY_ROUTER_GROUP_LIMITED(RouterPreSoftmax, ScoreFunction::softmax, true)

TEST(RouterSoftmax, TiesOnCoarseGridGoToLowerId) {
  coarse_ties(ScoreFunction::softmax, false, false);
}
TEST(RouterSoftmax, GroupedTiesOnCoarseGridGoToLowerId) {
  coarse_ties(ScoreFunction::softmax, false, true);
}
TEST(RouterSigmoid, TiesOnCoarseGridGoToLowerId) {
  coarse_ties(ScoreFunction::sigmoid, false, false);
}
TEST(RouterSigmoid, GroupedTiesOnCoarseGridGoToLowerId) {
  coarse_ties(ScoreFunction::sigmoid, false, true);
}
TEST(RouterSqrtSoftplus, TiesOnCoarseGridGoToLowerId) {
  coarse_ties(ScoreFunction::sqrtsoftplus, false, false);
}
TEST(RouterSqrtSoftplus, GroupedTiesOnCoarseGridGoToLowerId) {
  coarse_ties(ScoreFunction::sqrtsoftplus, false, true);
}
TEST(RouterPreSoftmax, TiesOnCoarseGridGoToLowerId) {
  coarse_ties(ScoreFunction::softmax, true, false);
}
TEST(RouterPreSoftmax, GroupedTiesOnCoarseGridGoToLowerId) {
  coarse_ties(ScoreFunction::softmax, true, true);
}

TEST(RouterCapacity, ProbsPolicyAtQuarterCapacity) { capacity(TokenDropPolicy::probs, 0.25); }
TEST(RouterCapacity, ProbsPolicyAtHalfCapacity) { capacity(TokenDropPolicy::probs, 0.5); }
TEST(RouterCapacity, ProbsPolicyAtFullCapacity) { capacity(TokenDropPolicy::probs, 1.0); }
TEST(RouterCapacity, ProbsPolicyAtOneAndAHalfCapacity) { capacity(TokenDropPolicy::probs, 1.5); }
TEST(RouterCapacity, PositionPolicyAtQuarterCapacity) { capacity(TokenDropPolicy::position, 0.25); }
TEST(RouterCapacity, PositionPolicyAtHalfCapacity) { capacity(TokenDropPolicy::position, 0.5); }
TEST(RouterCapacity, PositionPolicyAtFullCapacity) { capacity(TokenDropPolicy::position, 1.0); }
TEST(RouterCapacity, PositionPolicyAtOneAndAHalfCapacity) {
  capacity(TokenDropPolicy::position, 1.5);
}

TEST(RouterSeqAuxLoss, SoftmaxFourSequences) {
  sequence_losses(ScoreFunction::softmax, AuxLossType::seq_aux_loss);
}
TEST(RouterSeqAuxLoss, SigmoidFourSequences) {
  sequence_losses(ScoreFunction::sigmoid, AuxLossType::seq_aux_loss);
}
TEST(RouterSeqAuxLoss, SqrtSoftplusFourSequences) {
  sequence_losses(ScoreFunction::sqrtsoftplus, AuxLossType::seq_aux_loss);
}
TEST(RouterSeqAuxLoss, OneTokenPerSequence) { many_sequences(1); }
TEST(RouterSeqAuxLoss, TwoTokensPerSequence) { many_sequences(2); }
TEST(RouterSeqAuxLoss, ThreeTokensPerSequence) { many_sequences(3); }
TEST(RouterSeqAuxLoss, SevenTokensPerSequence) { many_sequences(7); }
TEST(RouterGlobalAuxLoss, SoftmaxFromEmptyState) {
  sequence_losses(ScoreFunction::softmax, AuxLossType::global_aux_loss);
}
TEST(RouterGlobalAuxLoss, SigmoidFromEmptyState) {
  sequence_losses(ScoreFunction::sigmoid, AuxLossType::global_aux_loss);
}
TEST(RouterGlobalAuxLoss, SqrtSoftplusFromEmptyState) {
  sequence_losses(ScoreFunction::sqrtsoftplus, AuxLossType::global_aux_loss);
}

TEST(RouterSoftmax, ThreadAndBatchInvariantAtQwen3Shape) {
  RouterTester()
      .tokens(1032)
      .model(kQwen3_30B_A3B)
      .expert_bias(true, 0.1)
      .aux_loss(AuxLossType::aux_loss, 1e-2)
      .z_loss(1e-3)
      .TestInvariance();
}

TEST(RouterSigmoid, ThreadAndBatchInvariantAtDeepSeekV3ShapeWithCapacityAndSeqAuxLoss) {
  RouterTester()
      .tokens(1032)
      .model(kDeepSeekV3)
      .expert_bias(true, 0.1)
      .capacity(1.0)
      .aux_loss(AuxLossType::seq_aux_loss, 1e-2)
      .seq_length(258)
      .TestInvariance();
}

TEST(Router, GlobalAuxLossAccumulatesAndResets) {
  std::mt19937_64 rng(sy::testing::test_seed(51));
  RouterConfig c = router_config(8, 2);
  c.aux_loss_type = AuxLossType::global_aux_loss;
  c.aux_loss_coeff = 0.5;
  sy::GlobalAuxLossState st;
  sy::RouteInputs in;
  in.global_aux_loss_state = &st;
  std::vector<double> acc(8, 0.0);
  for (int step = 0; step < 3; ++step) {
    Tensor z = sy::testing::randn({33, 8}, DType::fp64, rng);
    sy::ref::RefRouteInputs rin;
    rin.global_acc = acc;
    rin.global_steps = step;
    const auto want = sy::ref::route(z.to_double_vector(), 33, c, rin);
    const auto r = sy::topk_route(z, in, c);
    EXPECT_NEAR(r.aux_loss, want.aux_loss, 1e-12);
    EXPECT_EQ(st.steps, step + 1);
    // The reference's own counts for the accumulation (aux top-k on softmax of all experts).
    const std::vector<double> zd = z.to_double_vector();
    for (int64_t t = 0; t < 33; ++t) {
      std::vector<double> zt(zd.begin() + t * 8, zd.begin() + (t + 1) * 8);
      for (int32_t e : sy::ref::topk_ids(sy::ref::softmax(zt), 2)) acc[e] += 1;
    }
    EXPECT_TRUE(all_close(st.num_tokens_per_expert, acc, 0, 0));
  }
  st.reset();
  EXPECT_EQ(st.steps, 0);
  EXPECT_FALSE(st.num_tokens_per_expert.defined());
}

TEST(Router, TiesGoToLowerExpertId) {
  // All equal: ids 0..K-1 for every score function.
  for (int f = 0; f < 3; ++f) {
    RouterConfig c = router_config(6, 3, static_cast<ScoreFunction>(f));
    const auto r = sy::topk_route(Tensor::full({2, 6}, DType::fp32, 0.5), {}, c);
    EXPECT_TRUE(all_close(r.topk_idx, {0, 1, 2, 0, 1, 2}, 0, 0));
  }
  // Partial ties: [1, 3, 3, 0, 3] top-2 -> [1, 2]; top-4 -> [1, 2, 4, 0].
  Tensor z = Tensor::from_vector<float>({1, 3, 3, 0, 3}, {1, 5});
  EXPECT_TRUE(all_close(sy::topk_route(z, {}, router_config(5, 2)).topk_idx, {1, 2}, 0, 0));
  EXPECT_TRUE(all_close(sy::topk_route(z, {}, router_config(5, 4)).topk_idx, {1, 2, 4, 0}, 0, 0));
  // Group ties: two groups with equal scores -> the lower group.
  RouterConfig g = router_config(4, 1);
  g.num_groups = 2;
  g.group_topk = 1;
  Tensor zg = Tensor::from_vector<double>({0.0, 2.0, 2.0, 0.0}, {1, 4});
  EXPECT_TRUE(all_close(sy::topk_route(zg, {}, g).topk_idx, {1}, 0, 0));
  // Capacity ties under probs: equal weights keep the lower token.
  RouterConfig cc = router_config(2, 1);
  cc.capacity_factor = 0.5;  // C = ceil(4*1/2*0.5) = 1
  Tensor zc = Tensor::from_vector<double>({1, 0, 1, 0, 1, 0, 1, 0}, {4, 2});
  const auto rc = sy::topk_route(zc, {}, cc);
  EXPECT_TRUE(all_close(rc.topk_idx, {0, -1, -1, -1}, 0, 0));
  EXPECT_EQ(rc.num_dropped, 3);
}

TEST(Router, GroupLimitIsApplied) {
  // Group 0 has the single best expert but group 1 has the better sum of top-2.
  RouterConfig c = router_config(8, 2);
  c.num_groups = 2;
  c.group_topk = 1;  // K/group_topk = 2 experts summed per group
  Tensor z = Tensor::from_vector<double>({5, -5, -5, -5, 3, 3, 0, 0}, {1, 8});
  EXPECT_TRUE(all_close(sy::topk_route(z, {}, c).topk_idx, {4, 5}, 0, 0));
  c.num_groups = 0;
  c.group_topk = 0;
  EXPECT_TRUE(all_close(sy::topk_route(z, {}, c).topk_idx, {0, 4}, 0, 0));
}

TEST(Router, ExpertBiasChangesSelectionNotWeights) {
  RouterConfig c = router_config(4, 2, ScoreFunction::sigmoid);
  Tensor z = Tensor::from_vector<float>({2, 1, 0, -1}, {1, 4});
  sy::RouteInputs in;
  in.expert_bias = Tensor::from_vector<float>({0, 0, 0, 5}, {4});
  const auto r = sy::topk_route(z, in, c);
  EXPECT_TRUE(all_close(r.topk_idx, {3, 0}, 0, 0));
  const double s3 = sy::ref::sigmoid(-1), s0 = sy::ref::sigmoid(2);
  EXPECT_TRUE(all_close(r.topk_weights, {s3 / (s3 + s0), s0 / (s3 + s0)}, 1e-7, 1e-6));
}

TEST(Router, SkewedRoutingWithCapacity) {
  // Every token prefers expert 0 (and then 1): capacity keeps C of them.
  const int64_t T = 100, E = 8;
  std::vector<float> z(static_cast<size_t>(T * E), 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    z[t * E] = 5.0f + 0.01f * static_cast<float>(t);  // later tokens have higher weight
    z[t * E + 1] = 4.0f;
  }
  RouterConfig c = router_config(E, 2);
  c.capacity_factor = 1.0;  // C = 25
  c.token_drop_policy = TokenDropPolicy::position;
  auto r = sy::topk_route(Tensor::from_vector(z, {T, E}), {}, c);
  EXPECT_EQ(r.expert_capacity, 25);
  EXPECT_EQ(r.num_tokens_per_expert.data<int64_t>()[0], 25);
  EXPECT_EQ(r.num_dropped, 150);
  EXPECT_EQ(r.topk_idx.data<int32_t>()[24 * 2], 0);  // first 25 tokens kept
  EXPECT_EQ(r.topk_idx.data<int32_t>()[25 * 2], -1);
  EXPECT_EQ(r.topk_weights.data<float>()[25 * 2], 0.0f);
  c.token_drop_policy = TokenDropPolicy::probs;
  r = sy::topk_route(Tensor::from_vector(z, {T, E}), {}, c);
  EXPECT_EQ(r.topk_idx.data<int32_t>()[74 * 2], -1);  // last 25 tokens (highest weight) kept
  EXPECT_EQ(r.topk_idx.data<int32_t>()[75 * 2], 0);
}

TEST(Router, PaddedRowsAreEmptyAndUncounted) {
  std::mt19937_64 rng(sy::testing::test_seed(61));
  Tensor z = sy::testing::randn({5, 4}, DType::fp32, rng);
  sy::RouteInputs in;
  in.padding_mask = Tensor::from_vector<bool>({false, true, false, true, true}, {5});
  RouterConfig c = router_config(4, 2);
  const auto r = sy::topk_route(z, in, c);
  EXPECT_EQ(r.num_padded_rows, 3);
  EXPECT_EQ(r.num_native_rows, 2);
  for (int64_t t : {1, 3, 4}) {
    for (int64_t k = 0; k < 2; ++k) {
      EXPECT_EQ(r.topk_idx.data<int32_t>()[t * 2 + k], -1);
      EXPECT_EQ(r.topk_weights.data<float>()[t * 2 + k], 0.0f);
    }
  }
  int64_t n = 0;
  for (int64_t e = 0; e < 4; ++e) n += r.num_tokens_per_expert.data<int64_t>()[e];
  EXPECT_EQ(n, 4);
}

TEST(Router, UpdateExpertBias) {
  Tensor b = Tensor::from_vector<float>({0.0f, 0.5f, -0.25f, 1.0f}, {4});
  Tensor c = Tensor::from_vector<int64_t>({10, 2, 4, 4}, {4});  // mean 5
  const Tensor nb = sy::update_expert_bias(b, c, 1e-3);
  const float r = 1e-3f;
  EXPECT_TRUE(all_close(nb, {0.0f - r, 0.5f + r, -0.25f + r, 1.0f + r}, 0, 0));
  Tensor eq = Tensor::from_vector<int64_t>({3, 3, 3, 3}, {4});
  EXPECT_TRUE(bitwise_equal(sy::update_expert_bias(b, eq, 1e-3), b));
  SY_EXPECT_THROW_MSG(sy::update_expert_bias(b, Tensor::zeros({3}, DType::int64), 1e-3),
                      std::invalid_argument,
                      "[update_expert_bias] num_tokens_per_expert must have shape [4], got [3]");
  SY_EXPECT_THROW_MSG(sy::update_expert_bias(b.to(DType::fp64), c, 1e-3), std::invalid_argument,
                      "[update_expert_bias] expert_bias must have dtype fp32, got fp64");
}

// Every config check, one case each: the message names the argument, what was expected and what
// came (64 experts, top-8 unless said).
RouterTester top8_of_64() { return RouterTester().experts(64).top_k(8); }

TEST(RouterConfigErrors, TopKZero) {
  top8_of_64().top_k(0).TestConfigError(
      "[route] top_k must be in [1, num_experts=64], got top_k=0");
}
TEST(RouterConfigErrors, TopKAboveExperts) {
  top8_of_64().top_k(65).TestConfigError(
      "[route] top_k must be in [1, num_experts=64], got top_k=65");
}
TEST(RouterConfigErrors, NoExperts) {
  RouterTester().experts(0).top_k(1).TestConfigError(
      "[route] num_experts must be >= 1, got num_experts=0");
}
TEST(RouterConfigErrors, GroupsNotDividingExperts) {
  top8_of_64().groups(6, 2).TestConfigError(
      "[route] num_groups must divide num_experts=64, got num_groups=6");
}
TEST(RouterConfigErrors, GroupTopKAboveGroups) {
  top8_of_64().groups(8, 9).TestConfigError(
      "[route] group_topk must be in [1, min(num_groups=8, top_k=8)], got group_topk=9");
}
TEST(RouterConfigErrors, TopKAboveTheChosenGroupsExperts) {
  top8_of_64().groups(32, 2).TestConfigError(  // 2 experts per group
      "[route] top_k must be <= group_topk * num_experts / num_groups = 4, got top_k=8");
}
TEST(RouterConfigErrors, PreSoftmaxWithSigmoid) {
  top8_of_64()
      .score(ScoreFunction::sigmoid)
      .pre_softmax()
      .TestConfigError(
          "[route] pre_softmax needs score_function=softmax, got score_function=sigmoid");
}
TEST(RouterConfigErrors, ZeroScalingFactor) {
  top8_of_64().scaling(0).TestConfigError(
      "[route] topk_scaling_factor must be finite and > 0, got 0");
}
TEST(RouterConfigErrors, NegativeCapacityFactor) {
  top8_of_64().capacity(-1.0).TestConfigError(
      "[route] capacity_factor must be finite and > 0 (or unset), got -1");
}
TEST(RouterConfigErrors, PadToCapacityWithoutCapacity) {
  top8_of_64().pad_to_capacity().TestConfigError("[route] pad_to_capacity needs capacity_factor");
}
TEST(RouterConfigErrors, NegativeAuxLossCoeff) {
  top8_of_64()
      .aux_loss(AuxLossType::none, -1)
      .TestConfigError("[route] aux_loss_coeff must be finite and >= 0, got -1");
}
TEST(RouterConfigErrors, NanZLossCoeff) {
  top8_of_64().z_loss(NAN).TestConfigError("[route] z_loss_coeff must be finite and >= 0, got nan");
}
TEST(RouterConfigErrors, SeqAuxLossWithoutSeqLength) {
  top8_of_64()
      .aux_loss(AuxLossType::seq_aux_loss, 1e-2)
      .TestConfigError(
          "[route] seq_aux_loss needs seq_length >= 1 dividing num_tokens=3, got seq_length=0");
}
TEST(RouterConfigErrors, GlobalAuxLossWithoutState) {
  top8_of_64()
      .aux_loss(AuxLossType::global_aux_loss, 1e-2)
      .TestConfigError("[route] global_aux_loss needs inputs.global_aux_loss_state, got nullptr");
}

TEST(Router, EnumNamesParseAndRejectUnknownNames) {
  SY_EXPECT_THROW_MSG(
      sy::parse_score_function("relu"), std::invalid_argument,
      "[route] score_function must be softmax, sigmoid or sqrtsoftplus, got \"relu\"");
  SY_EXPECT_THROW_MSG(sy::parse_aux_loss_type("x"), std::invalid_argument, "aux_loss_type must be");
  SY_EXPECT_THROW_MSG(sy::parse_token_drop_policy("x"), std::invalid_argument,
                      "token_drop_policy must be probs or position");
  EXPECT_EQ(sy::parse_score_function("sqrtsoftplus"), ScoreFunction::sqrtsoftplus);
  EXPECT_EQ(sy::parse_aux_loss_type("global_aux_loss"), AuxLossType::global_aux_loss);
  EXPECT_EQ(sy::parse_token_drop_policy("position"), TokenDropPolicy::position);
}

TEST(Router, TensorErrors) {
  const RouterConfig c = router_config(4, 2);
  SY_EXPECT_THROW_MSG(sy::topk_route(Tensor::zeros({3, 5}, DType::fp32), {}, c),
                      std::invalid_argument, "[route] logits must have shape [*, 4], got [3, 5]");
  SY_EXPECT_THROW_MSG(sy::topk_route(Tensor::zeros({3, 4}, DType::int32), {}, c),
                      std::invalid_argument,
                      "[route] logits must have dtype bf16 or fp32 or fp64, got int32");
  SY_EXPECT_THROW_MSG(sy::topk_route(Tensor(), {}, c), std::invalid_argument,
                      "[route] logits must be a defined tensor");
  Tensor z = Tensor::zeros({3, 4}, DType::fp32);
  z.data<float>()[2 * 4 + 1] = NAN;
  SY_EXPECT_THROW_MSG(sy::topk_route(z, {}, c), std::invalid_argument,
                      "[route] logits must be finite, got nan at token 2, expert 1");
  z.data<float>()[2 * 4 + 1] = 0;
  z.data<float>()[0 * 4 + 3] = -INFINITY;
  sy::RouteOptions o;
  o.layer = 5;
  SY_EXPECT_THROW_MSG(sy::topk_route(z, {}, c, o), std::invalid_argument,
                      "[route] layer 5, logits must be finite, got -inf at token 0, expert 3");
  z.data<float>()[3] = 0;
  sy::RouteInputs in;
  in.expert_bias = Tensor::zeros({5}, DType::fp32);
  SY_EXPECT_THROW_MSG(sy::topk_route(z, in, c), std::invalid_argument,
                      "[route] expert_bias must have shape [4], got [5]");
  in.expert_bias = Tensor::full({4}, DType::fp32, INFINITY);
  SY_EXPECT_THROW_MSG(sy::topk_route(z, in, c), std::invalid_argument,
                      "[route] expert_bias must be finite, got inf at expert 0");
  in = {};
  in.padding_mask = Tensor::zeros({3}, DType::uint8);
  SY_EXPECT_THROW_MSG(sy::topk_route(z, in, c), std::invalid_argument,
                      "[route] padding_mask must have dtype bool, got uint8");
  in.padding_mask = Tensor::zeros({2}, DType::boolean);
  SY_EXPECT_THROW_MSG(sy::topk_route(z, in, c), std::invalid_argument,
                      "[route] padding_mask must have shape [3], got [2]");
  in = {};
  in.replay_idx = Tensor::zeros({3, 3}, DType::int32);
  SY_EXPECT_THROW_MSG(sy::topk_route(z, in, c), std::invalid_argument,
                      "[replay] replay_idx must have shape [3, 2], got [3, 3]");
  in.replay_idx = Tensor::zeros({3, 2}, DType::int64);
  SY_EXPECT_THROW_MSG(sy::topk_route(z, in, c), std::invalid_argument,
                      "[replay] replay_idx must have dtype int32, got int64");
  // Backward argument errors.
  const auto r = sy::topk_route(z, {}, c);
  SY_EXPECT_THROW_MSG(sy::topk_route_backward(Tensor::zeros({3, 3}, DType::fp32), r),
                      std::invalid_argument,
                      "[route_backward] grad_topk_weights must have shape [3, 2], got [3, 3]");
  SY_EXPECT_THROW_MSG(sy::topk_route_backward(Tensor(), sy::RouteResult{}),
                      std::invalid_argument, "[route_backward] result must come from topk_route, got an empty RouteResult");
  sy::RouteBackwardOptions bo;
  bo.loss_grad_scale = NAN;
  SY_EXPECT_THROW_MSG(sy::topk_route_backward(Tensor(), r, bo), std::invalid_argument,
                      "[route_backward] loss_grad_scale must be finite, got nan");
}

TEST(Router, CapacityIsClampedToTokens) {
  RouterConfig c = router_config(4, 2);
  c.capacity_factor = 1e300;  // would overflow int64; nothing can be dropped anyway
  const auto r = sy::topk_route(Tensor::zeros({6, 4}, DType::fp32), {}, c);
  EXPECT_EQ(r.expert_capacity, 6);
  EXPECT_EQ(r.num_dropped, 0);
  c.capacity_factor = 1.0;  // ceil(6*2/4) = 3
  EXPECT_EQ(sy::topk_route(Tensor::zeros({6, 4}, DType::fp32), {}, c).expert_capacity, 3);
}

TEST(Router, EnumAndStateErrors) {
  Tensor z = Tensor::zeros({4, 8}, DType::fp32);
  RouterConfig c = router_config(8, 2);
  c.score_function = static_cast<ScoreFunction>(7);
  SY_EXPECT_THROW_MSG(
      sy::topk_route(z, {}, c), std::invalid_argument,
      "[route] score_function must be softmax, sigmoid or sqrtsoftplus, got value 7");
  c = router_config(8, 2);
  c.token_drop_policy = static_cast<TokenDropPolicy>(9);
  SY_EXPECT_THROW_MSG(sy::topk_route(z, {}, c), std::invalid_argument,
                      "[route] token_drop_policy must be probs or position, got value 9");
  c = router_config(8, 2);
  c.aux_loss_type = static_cast<AuxLossType>(6);
  SY_EXPECT_THROW_MSG(sy::topk_route(z, {}, c), std::invalid_argument,
                      "[route] aux_loss_type must be none, aux_loss, seq_aux_loss, "
                      "global_aux_loss, sinkhorn or quantile_balancing, got value 6");
  sy::RouteOptions o;
  o.invalid_replay_rows = static_cast<sy::ReplayRowPolicy>(3);
  SY_EXPECT_THROW_MSG(sy::topk_route(z, {}, router_config(8, 2), o), std::invalid_argument,
                      "[route] invalid_replay_rows must be error, native or merge, got value 3");
  c = router_config(8, 2);
  c.aux_loss_type = AuxLossType::global_aux_loss;
  c.aux_loss_coeff = 0.1;
  sy::GlobalAuxLossState st;
  sy::RouteInputs in;
  in.global_aux_loss_state = &st;
  st.num_tokens_per_expert = Tensor::zeros({7}, DType::fp64);
  SY_EXPECT_THROW_MSG(
      sy::topk_route(z, in, c), std::invalid_argument,
      "[route] global_aux_loss_state.num_tokens_per_expert must have shape [8], got [7]");
  st.num_tokens_per_expert = Tensor::zeros({8}, DType::fp32);
  SY_EXPECT_THROW_MSG(
      sy::topk_route(z, in, c), std::invalid_argument,
      "[route] global_aux_loss_state.num_tokens_per_expert must have dtype fp64, got fp32");
  st.num_tokens_per_expert = Tensor();
  st.steps = -1;
  SY_EXPECT_THROW_MSG(sy::topk_route(z, in, c), std::invalid_argument,
                      "[route] global_aux_loss_state.steps must be >= 0, got -1");
  // seq_length not dividing T.
  c.aux_loss_type = AuxLossType::seq_aux_loss;
  o = {};
  o.seq_length = 3;
  SY_EXPECT_THROW_MSG(
      sy::topk_route(z, {}, c, o), std::invalid_argument,
      "[route] seq_aux_loss needs seq_length >= 1 dividing num_tokens=4, got seq_length=3");
  // A bad call leaves the state untouched (validation happens before any work).
  EXPECT_EQ(st.steps, -1);
}
