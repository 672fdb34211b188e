// Router forward against the double reference (tests/ref/router_ref.h): every score function,
// pre/post softmax, groups, expert bias, capacity (both policies, pad), padding mask, losses, and
// the shapes that break kernels; ties, invariances and every argument error.
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ref/router_ref.h"
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
using sy::testing::all_close;
using sy::testing::bitwise_equal;

namespace {

struct Case {
  RouterConfig cfg;
  int64_t T = 0;
  bool bias = false;
  bool mask = false;
  int64_t seq_length = 0;
};

std::string describe(const Case& c, DType dt) {
  std::ostringstream os;
  os << "T=" << c.T << " E=" << c.cfg.num_experts << " K=" << c.cfg.top_k << " "
     << sy::score_function_name(c.cfg.score_function) << (c.cfg.pre_softmax ? " pre" : "")
     << " groups=" << c.cfg.num_groups << "/" << c.cfg.group_topk
     << " scale=" << c.cfg.topk_scaling_factor
     << " cap=" << (c.cfg.capacity_factor ? *c.cfg.capacity_factor : -1.0) << " "
     << sy::token_drop_policy_name(c.cfg.token_drop_policy) << (c.cfg.pad_to_capacity ? " pad" : "")
     << " aux=" << sy::aux_loss_type_name(c.cfg.aux_loss_type) << " z=" << c.cfg.z_loss_coeff
     << " bias=" << c.bias << " mask=" << c.mask << " dtype=" << sy::dtype_name(dt);
  return os.str();
}

// Runs the engine and the reference on the same logits and compares everything.
void check_case(const Case& c, DType dt, uint64_t seed) {
  SCOPED_TRACE(describe(c, dt) + " " + sy::testing::repro(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = c.T, E = c.cfg.num_experts, K = c.cfg.top_k;
  Tensor logits = sy::testing::randn({T, E}, dt, rng, 2.0);
  sy::RouteInputs in;
  sy::ref::RefRouteInputs rin;
  if (c.bias) {
    in.expert_bias = sy::testing::randn({E}, DType::fp32, rng, 0.5);
    rin.bias = in.expert_bias.to_double_vector();
  }
  if (c.mask) {
    std::vector<bool> m(static_cast<size_t>(T));
    std::bernoulli_distribution bd(0.25);
    rin.padded.resize(static_cast<size_t>(T));
    Tensor mt = Tensor::empty({T}, DType::boolean);
    for (int64_t t = 0; t < T; ++t) {
      mt.data<bool>()[t] = bd(rng);
      rin.padded[t] = mt.data<bool>()[t];
    }
    in.padding_mask = mt;
  }
  sy::RouteOptions opt;
  opt.seq_length = c.seq_length;
  rin.seq_length = c.seq_length;
  sy::GlobalAuxLossState gstate;
  in.global_aux_loss_state = &gstate;

  const sy::RouteResult r = sy::topk_route(logits, in, c.cfg, opt);
  const sy::ref::RefRoute want = sy::ref::route(logits.to_double_vector(), T, c.cfg, rin);

  ASSERT_EQ(r.topk_idx.shape(), (sy::Shape{T, K}));
  ASSERT_EQ(r.topk_weights.dtype(), dt);
  EXPECT_TRUE(all_close(r.topk_idx, std::vector<double>(want.idx.begin(), want.idx.end()), 0, 0));
  const double tol = dt == DType::fp64 ? 1e-12 : 2e-6;
  EXPECT_TRUE(all_close(r.topk_weights, want.w, tol, tol));
  EXPECT_TRUE(all_close(r.num_tokens_per_expert,
                        std::vector<double>(want.counts.begin(), want.counts.end()), 0, 0));
  EXPECT_EQ(r.num_dropped, want.num_dropped);
  EXPECT_EQ(r.expert_capacity, want.capacity);
  EXPECT_EQ(r.num_replayed_rows, 0);
  EXPECT_EQ(r.num_native_rows, want.native);
  EXPECT_EQ(r.num_padded_rows, want.padded);
  EXPECT_NEAR(r.aux_loss, want.aux_loss, 1e-6 * std::fabs(want.aux_loss) + 1e-12);
  EXPECT_NEAR(r.z_loss, want.z_loss,
              (dt == DType::fp64 ? 1e-11 : 1e-5) * std::fabs(want.z_loss) + 1e-12);
  // Counts sum to the valid pairs.
  int64_t valid = 0, cnt = 0;
  for (int64_t i = 0; i < T * K; ++i) valid += r.topk_idx.data<int32_t>()[i] >= 0;
  for (int64_t e = 0; e < E; ++e) cnt += r.num_tokens_per_expert.data<int64_t>()[e];
  EXPECT_EQ(valid, cnt);
}

}  // namespace

TEST(Router, ShapeSweepAgainstReference) {
  const uint64_t seed = sy::testing::test_seed(11);
  uint64_t s = seed;
  for (int64_t E : {1, 2, 8, 64, 256}) {
    for (int64_t K : {int64_t{1}, int64_t{2}, int64_t{8}, E}) {
      if (K > E) continue;
      for (int64_t T : {0, 1, 7, 1031}) {
        if (T * E > 1031 * 64 && K > 8) continue;  // keep the K=E=256 sweep small
        for (int f = 0; f < 4; ++f) {
          Case c;
          c.T = T;
          c.cfg = router_config(E, K, f == 3 ? ScoreFunction::softmax : static_cast<ScoreFunction>(f));
          c.cfg.pre_softmax = f == 3;
          c.cfg.aux_loss_type = AuxLossType::aux_loss;
          c.cfg.aux_loss_coeff = 1e-2;
          c.cfg.z_loss_coeff = 1e-3;
          c.bias = f == 1;
          for (DType dt : {DType::fp32, DType::fp64}) check_case(c, dt, ++s);
        }
      }
    }
  }
}

TEST(Router, GroupLimitedTopkAgainstReference) {
  uint64_t s = sy::testing::test_seed(21);
  for (int f = 0; f < 4; ++f) {
    for (bool bias : {false, true}) {
      Case c;
      c.T = 257;
      c.cfg = router_config(64, 8, f == 3 ? ScoreFunction::softmax : static_cast<ScoreFunction>(f));
      c.cfg.pre_softmax = f == 3;
      c.cfg.num_groups = 8;
      c.cfg.group_topk = 4;
      c.cfg.topk_scaling_factor = 2.5;
      c.bias = bias;
      for (DType dt : {DType::fp32, DType::fp64}) check_case(c, dt, ++s);
      c.cfg.num_experts = 256;  // DeepSeek-V3 shape
      c.cfg.group_topk = 4;
      for (DType dt : {DType::fp32, DType::fp64}) check_case(c, dt, ++s);
    }
  }
}

TEST(Router, CapacityPoliciesAndPaddingAgainstReference) {
  uint64_t s = sy::testing::test_seed(31);
  for (double factor : {0.25, 0.5, 1.0, 1.5}) {
    for (auto policy : {TokenDropPolicy::probs, TokenDropPolicy::position}) {
      for (bool pad : {false, true}) {
        for (bool mask : {false, true}) {
          Case c;
          c.T = 1031;
          c.cfg = router_config(8, 2, ScoreFunction::sigmoid);
          c.cfg.capacity_factor = factor;
          c.cfg.token_drop_policy = policy;
          c.cfg.pad_to_capacity = pad;
          c.mask = mask;
          check_case(c, DType::fp64, ++s);
          c.cfg.score_function = ScoreFunction::softmax;
          check_case(c, DType::fp32, ++s);
        }
      }
    }
  }
}

TEST(Router, SeqAndGlobalAuxLossAgainstReference) {
  uint64_t s = sy::testing::test_seed(41);
  for (int f = 0; f < 3; ++f) {
    for (bool mask : {false, true}) {
      Case c;
      c.T = 96;
      c.seq_length = 24;  // 4 sequences
      c.cfg = router_config(16, 4, static_cast<ScoreFunction>(f));
      c.cfg.aux_loss_type = AuxLossType::seq_aux_loss;
      c.cfg.aux_loss_coeff = 0.1;
      c.mask = mask;
      for (DType dt : {DType::fp32, DType::fp64}) check_case(c, dt, ++s);
      c.cfg.aux_loss_type = AuxLossType::global_aux_loss;
      for (DType dt : {DType::fp32, DType::fp64}) check_case(c, dt, ++s);
    }
  }
}

TEST(Router, SeqAuxLossWithManySequences) {
  // More sequences than tokens per loss chunk (one token per sequence, 300 sequences) and a count
  // just above and below the chunk size: the partial sums stay O(T x E) and exact.
  uint64_t s = sy::testing::test_seed(45);
  for (int64_t seq_length : {1, 2, 3, 7}) {
    Case c;
    c.T = 301 - 301 % seq_length;
    c.seq_length = seq_length;
    c.cfg = router_config(8, 2);
    c.cfg.aux_loss_type = AuxLossType::seq_aux_loss;
    c.cfg.aux_loss_coeff = 0.1;
    for (bool mask : {false, true}) {
      c.mask = mask;
      for (DType dt : {DType::fp32, DType::fp64}) check_case(c, dt, ++s);
    }
  }
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

TEST(Router, ThreadCountAndBatchInvariance) {
  std::mt19937_64 rng(sy::testing::test_seed(71));
  std::vector<RouterConfig> configs;
  RouterConfig c = router_config(128, 8);
  c.aux_loss_type = AuxLossType::aux_loss;
  c.aux_loss_coeff = 1e-2;
  c.z_loss_coeff = 1e-3;
  configs.push_back(c);
  c = router_config(256, 8, ScoreFunction::sigmoid);  // DeepSeek-V3-like, with capacity and seq aux loss
  c.num_groups = 8;
  c.group_topk = 4;
  c.topk_scaling_factor = 2.5;
  c.capacity_factor = 1.0;
  c.aux_loss_type = AuxLossType::seq_aux_loss;
  c.aux_loss_coeff = 1e-2;
  configs.push_back(c);
  for (const RouterConfig& rc : configs) {
    for (DType dt : {DType::fp32, DType::fp64}) {
      const int64_t T = 1032, E = rc.num_experts, K = rc.top_k;
      SCOPED_TRACE(std::string(sy::score_function_name(rc.score_function)) + " " +
                   sy::dtype_name(dt));
      Tensor z = sy::testing::randn({T, E}, dt, rng);
      sy::RouteInputs in;
      in.expert_bias = sy::testing::randn({E}, DType::fp32, rng, 0.1);
      sy::RouteOptions opt;
      opt.seq_length = 258;
      const Tensor gw = Tensor::full({T, K}, dt, 0.3);
      const int saved = sy::num_threads();
      sy::set_num_threads(1);
      const auto r1 = sy::topk_route(z, in, rc, opt);
      const auto g1 = sy::topk_route_backward(gw, r1);
      sy::set_num_threads(2);
      const auto r2 = sy::topk_route(z, in, rc, opt);
      const auto g2 = sy::topk_route_backward(gw, r2);
      sy::set_num_threads(saved);
      EXPECT_TRUE(bitwise_equal(r1.topk_idx, r2.topk_idx));
      EXPECT_TRUE(bitwise_equal(r1.topk_weights, r2.topk_weights));
      EXPECT_TRUE(bitwise_equal(r1.num_tokens_per_expert, r2.num_tokens_per_expert));
      EXPECT_EQ(r1.aux_loss, r2.aux_loss);
      EXPECT_EQ(r1.z_loss, r2.z_loss);
      EXPECT_TRUE(bitwise_equal(g1.grad_logits, g2.grad_logits));
      // A token routed alone (no capacity) gets bitwise the same ids and weights as in the batch.
      RouterConfig alone = rc;
      alone.capacity_factor.reset();
      alone.aux_loss_type = AuxLossType::none;
      const auto rb = sy::topk_route(z, in, alone);
      for (int64_t t : {int64_t{0}, int64_t{500}, T - 1}) {
        const Tensor one =
            Tensor::borrow(static_cast<char*>(z.raw()) + t * E * sy::dtype_size(dt), {1, E}, dt);
        const auto r = sy::topk_route(one, in, alone);
        for (int64_t k = 0; k < K; ++k) {
          EXPECT_EQ(r.topk_idx.data<int32_t>()[k], rb.topk_idx.data<int32_t>()[t * K + k]);
          EXPECT_EQ(r.topk_weights.item_as_double(k), rb.topk_weights.item_as_double(t * K + k));
        }
      }
    }
  }
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

TEST(Router, ConfigErrors) {
  Tensor z = Tensor::zeros({3, 64}, DType::fp32);
  auto expect = [&](RouterConfig c, const std::string& msg) {
    SY_EXPECT_THROW_MSG(sy::topk_route(z, {}, c), std::invalid_argument, msg);
  };
  expect(router_config(64, 0), "[route] top_k must be in [1, num_experts=64], got top_k=0");
  expect(router_config(64, 65), "[route] top_k must be in [1, num_experts=64], got top_k=65");
  expect(router_config(0, 1), "[route] num_experts must be >= 1, got num_experts=0");
  RouterConfig c = router_config(64, 8);
  c.num_groups = 6;
  c.group_topk = 2;
  expect(c, "[route] num_groups must divide num_experts=64, got num_groups=6");
  c.num_groups = 8;
  c.group_topk = 9;
  expect(c, "[route] group_topk must be in [1, min(num_groups=8, top_k=8)], got group_topk=9");
  c.num_groups = 32;  // 2 experts per group
  c.group_topk = 2;
  expect(c, "[route] top_k must be <= group_topk * num_experts / num_groups = 4, got top_k=8");
  c = router_config(64, 8, ScoreFunction::sigmoid);
  c.pre_softmax = true;
  expect(c, "[route] pre_softmax needs score_function=softmax, got score_function=sigmoid");
  c = router_config(64, 8);
  c.topk_scaling_factor = 0;
  expect(c, "[route] topk_scaling_factor must be finite and > 0, got 0");
  c = router_config(64, 8);
  c.capacity_factor = -1.0;
  expect(c, "[route] capacity_factor must be finite and > 0 (or unset), got -1");
  c = router_config(64, 8);
  c.pad_to_capacity = true;
  expect(c, "[route] pad_to_capacity needs capacity_factor");
  c = router_config(64, 8);
  c.aux_loss_coeff = -1;
  expect(c, "[route] aux_loss_coeff must be finite and >= 0, got -1");
  c = router_config(64, 8);
  c.z_loss_coeff = NAN;
  expect(c, "[route] z_loss_coeff must be finite and >= 0, got nan");
  c = router_config(64, 8);
  c.aux_loss_type = AuxLossType::seq_aux_loss;
  c.aux_loss_coeff = 1e-2;
  expect(c, "[route] seq_aux_loss needs seq_length >= 1 dividing num_tokens=3, got seq_length=0");
  c.aux_loss_type = AuxLossType::global_aux_loss;
  expect(c, "[route] global_aux_loss needs inputs.global_aux_loss_state, got nullptr");
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

TEST(Router, ManyTiesAgainstReference) {
  // Logits on a coarse grid (many exact ties, as bf16-rounded logits have): every selection path
  // (8-wide block-threshold, generic insertion, group masks) must break ties by lower id.
  std::mt19937_64 rng(sy::testing::test_seed(81));
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int64_t E : {8, 16, 24, 64, 128, 256}) {
    for (int64_t K : {1, 2, 3, 5, 8, 9}) {
      if (K > E) continue;
      for (int f = 0; f < 4; ++f) {
        for (int groups = 0; groups < 2; ++groups) {
          RouterConfig c =
              router_config(E, K, f == 3 ? ScoreFunction::softmax : static_cast<ScoreFunction>(f));
          c.pre_softmax = f == 3;
          if (groups) {
            if (E % 8 != 0 || K < 2) continue;
            c.num_groups = 8;
            c.group_topk = 2;
            if (K > c.group_topk * (E / 8)) continue;
          }
          SCOPED_TRACE("E=" + std::to_string(E) + " K=" + std::to_string(K) +
                       " f=" + std::to_string(f) + " groups=" + std::to_string(groups));
          c.aux_loss_type = AuxLossType::aux_loss;  // its own top-k on P, ties included
          c.aux_loss_coeff = 0.1;
          const int64_t T = 33;
          std::vector<float> z(static_cast<size_t>(T * E));
          for (auto& v : z) v = static_cast<float>(std::round(nd(rng) * 2.0) / 2.0);
          Tensor zt = Tensor::from_vector(z, {T, E});
          const auto r = sy::topk_route(zt, {}, c);
          const auto want = sy::ref::route(zt.to_double_vector(), T, c, {});
          ASSERT_TRUE(
              all_close(r.topk_idx, std::vector<double>(want.idx.begin(), want.idx.end()), 0, 0));
          EXPECT_NEAR(r.aux_loss, want.aux_loss, 1e-6 * want.aux_loss);
          EXPECT_TRUE(all_close(r.topk_weights, want.w, 2e-6, 2e-6));
        }
      }
    }
  }
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
  o.invalid_replay_rows = static_cast<sy::InvalidReplayRows>(3);
  SY_EXPECT_THROW_MSG(sy::topk_route(z, {}, router_config(8, 2), o), std::invalid_argument,
                      "[route] invalid_replay_rows must be error or native, got value 3");
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
