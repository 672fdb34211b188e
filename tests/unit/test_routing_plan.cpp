// Routing plan: pairs, merges, order, counts, offsets, capacity and padding, against the reference.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "model_shapes.h"
#include "permute_tester.h"
#include "ref/dispatch_ref.h"
#include "switchyard/router.h"
#include "switchyard/routing_plan.h"
#include "testing.h"

namespace switchyard {
namespace {

using testing::repro;
using testing::test_seed;

std::vector<int64_t> i64(const Tensor& t) {
  const int64_t* p = t.data<int64_t>();
  return std::vector<int64_t>(p, p + t.numel());
}

TEST(RoutingPlan, ReplayPaddingRowsCollapseToOnePair) {
  // The crash of real runs: zero-filled rows [0,0,0,0] are ONE pair, not K.
  const std::vector<int32_t> idx = {0, 0, 0, 0, 3, 1, -1, 1, -1, -1, -1, -1, 2, 0, 3, 1};
  const std::vector<float> w = {0.25f, 0.25f, 0.25f, 0.25f, 0.5f, 0.2f, 0.1f, 0.2f,
                                1,     1,     1,     1,     0.1f, 0.2f, 0.3f, 0.4f};
  RoutingPlan p =
      build_routing_plan(Tensor::from_vector(idx, {4, 4}), Tensor::from_vector(w, {4, 4}), 4);
  EXPECT_EQ(p.num_pairs, 1 + 2 + 0 + 4);
  EXPECT_EQ(p.num_rows, 7);
  EXPECT_EQ(i64(p.num_tokens_per_expert), (std::vector<int64_t>{2, 2, 1, 2}));
  EXPECT_EQ(i64(p.expert_offsets), (std::vector<int64_t>{0, 2, 4, 5, 7}));
  EXPECT_EQ(i64(p.row_token), (std::vector<int64_t>{0, 3, 1, 3, 3, 1, 3}));
  EXPECT_EQ(i64(p.slot_row),
            (std::vector<int64_t>{0, 0, 0, 0, 5, 2, -1, 2, -1, -1, -1, -1, 4, 1, 6, 3}));
  const float* rw = p.row_weight.data<float>();
  EXPECT_EQ(rw[0], 1.0f);
  EXPECT_EQ(rw[2], 0.2f + 0.2f);
  EXPECT_EQ(rw[5], 0.5f);
  EXPECT_EQ(i64(p.token_offsets), (std::vector<int64_t>{0, 1, 3, 3, 7}));
  EXPECT_EQ(i64(p.token_rows), (std::vector<int64_t>{0, 5, 2, 4, 1, 6, 3}));
}

// Random routes (with -1 slots, -1 rows, zero-filled rows and repeated ids) against the reference
// for E experts: T in {0, 1, 7, 1031} and K in {1, 2, 8, E} (K > E repeats ids).
void random_routes_against_reference(int64_t E) {
  std::vector<int64_t> top_ks = {1, 2, 8};
  if (E != 1 && E != 2 && E != 8) top_ks.push_back(E);
  for (int64_t T : {0, 1, 7, 1031}) {
    for (int64_t K : top_ks) {
      if (T * K > 300000) continue;
      testing::RoutingPlanTester().tokens(T).experts(E).top_k(K).Test();
    }
  }
}

TEST(RoutingPlan, MatchesReferenceWithOneExpert) { random_routes_against_reference(1); }
TEST(RoutingPlan, MatchesReferenceWithTwoExperts) { random_routes_against_reference(2); }
TEST(RoutingPlan, MatchesReferenceWithEightExperts) { random_routes_against_reference(8); }
TEST(RoutingPlan, MatchesReferenceWith64Experts) { random_routes_against_reference(64); }
TEST(RoutingPlan, MatchesReferenceWithDeepSeekV3Experts) {
  random_routes_against_reference(testing::kDeepSeekV3.num_experts);
}
// E > 4*T*K: the sparse path (pairs sorted instead of counting sorts over E).
TEST(RoutingPlan, MatchesReferenceWithAMillionExperts) { random_routes_against_reference(1 << 20); }

TEST(RoutingPlan, CapacityPositionKeepsFirstTokens) {
  // Every token to expert 1 (skew), capacity 2.
  std::vector<int32_t> idx = {1, 0, 1, 2, 1, -1, 1, 0, 1, 2};
  std::vector<float> w = {0.1f, 0.9f, 0.2f, 0.8f, 0.9f, 0.f, 0.3f, 0.7f, 0.8f, 0.2f};
  RoutingPlanOptions o;
  o.expert_capacity = 2;
  o.token_drop_policy = TokenDropPolicy::position;
  RoutingPlan p =
      build_routing_plan(Tensor::from_vector(idx, {5, 2}), Tensor::from_vector(w, {5, 2}), 3, o);
  EXPECT_EQ(i64(p.num_tokens_per_expert), (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(p.num_dropped, 3);
  EXPECT_EQ(i64(p.row_token), (std::vector<int64_t>{0, 3, 0, 1, 1, 4}));
  EXPECT_EQ(p.slot_row.data<int64_t>()[4], -1);  // token 2's expert 1 dropped
}

TEST(RoutingPlan, CapacityProbsKeepsHighestWeightsTiesToLowerToken) {
  std::vector<int32_t> idx = {1, 1, 1, 1, 1};
  std::vector<float> w = {0.5f, 0.9f, 0.5f, 0.1f, 0.9f};
  RoutingPlanOptions o;
  o.expert_capacity = 3;
  RoutingPlan p =
      build_routing_plan(Tensor::from_vector(idx, {5, 1}), Tensor::from_vector(w, {5, 1}), 2, o);
  EXPECT_EQ(i64(p.row_token),
            (std::vector<int64_t>{0, 1, 4}));  // 0.9, 0.9, then the tie 0.5 -> token 0
  EXPECT_EQ(p.num_dropped, 2);
}

TEST(RoutingPlan, CapacityFactorPadToCapacityAndAlignment) {
  // T=6, K=2, E=4, capacity_factor 1 -> C = ceil(12/4) = 3; aligned to 4 -> 4 rows per expert.
  std::vector<int32_t> idx = {0, 1, 0, 1, 0, 2, 0, 1, 0, -1, -1, -1};
  RoutingPlanOptions o;
  o.capacity_factor = 1.0;
  o.pad_to_capacity = true;
  o.expert_alignment = 4;
  o.token_drop_policy = TokenDropPolicy::position;
  RoutingPlan p = build_routing_plan(Tensor::from_vector(idx, {6, 2}), Tensor(), 4, o);
  EXPECT_EQ(i64(p.num_tokens_per_expert), (std::vector<int64_t>{3, 3, 1, 0}));
  EXPECT_EQ(i64(p.expert_offsets), (std::vector<int64_t>{0, 4, 8, 12, 16}));
  EXPECT_EQ(p.num_dropped, 2);
  EXPECT_EQ(i64(p.row_token),
            (std::vector<int64_t>{0, 1, 2, -1, 0, 1, 3, -1, 2, -1, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(p.row_weight.data<float>()[0], 1.0f);
  EXPECT_EQ(p.row_weight.data<float>()[3], 0.0f);
}

// The sparse path (E > 4*T*K: pairs sorted instead of counting sorts over E) with capacity, drops,
// alignment and padding: the same plan as the dense path gives on the same ids, widened to E.
TEST(RoutingPlan, SparsePathMatchesDensePathWithCapacityAndPadding) {
  std::vector<int32_t> idx = {0, 1, 0, 1, 0, 2, 0, 1, 0, -1, -1, -1, 3, 3};
  std::vector<float> w = {0.1f, 0.9f, 0.4f, 0.6f, 0.7f, 0.3f, 0.2f,
                          0.8f, 1.0f, 0.0f, 0.0f, 0.0f, 0.5f, 0.25f};
  for (bool pad : {false, true}) {
    for (auto policy : {TokenDropPolicy::position, TokenDropPolicy::probs}) {
      RoutingPlanOptions o;
      o.expert_capacity = 2;
      o.pad_to_capacity = pad;
      o.expert_alignment = pad ? 4 : 1;
      o.token_drop_policy = policy;
      const Tensor ti = Tensor::from_vector(idx, {7, 2}), tw = Tensor::from_vector(w, {7, 2});
      const RoutingPlan dense = build_routing_plan(ti, tw, 4, o);    // 4 <= 4*T*K
      const RoutingPlan sparse = build_routing_plan(ti, tw, 64, o);  // 64 > 4*7*2
      SCOPED_TRACE(std::string("pad ") + (pad ? "on" : "off"));
      EXPECT_EQ(sparse.num_dropped, dense.num_dropped);
      EXPECT_EQ(sparse.num_pairs, dense.num_pairs);
      const auto n4 = i64(dense.num_tokens_per_expert), n64 = i64(sparse.num_tokens_per_expert);
      EXPECT_EQ(std::vector<int64_t>(n64.begin(), n64.begin() + 4), n4);
      for (size_t e = 4; e < 64; ++e) EXPECT_EQ(n64[e], 0) << "expert " << e;
      EXPECT_EQ(i64(sparse.slot_row), i64(dense.slot_row));
      EXPECT_EQ(i64(sparse.token_rows), i64(dense.token_rows));
      const auto rt4 = i64(dense.row_token), rt64 = i64(sparse.row_token);
      ASSERT_GE(rt64.size(), rt4.size());
      EXPECT_EQ(std::vector<int64_t>(rt64.begin(), rt64.begin() + rt4.size()), rt4);
      for (size_t r = rt4.size(); r < rt64.size(); ++r) EXPECT_EQ(rt64[r], -1) << "row " << r;
      for (int64_t r = 0; r < dense.num_rows; ++r) {
        EXPECT_EQ(sparse.row_weight.data<float>()[r], dense.row_weight.data<float>()[r]);
      }
    }
  }
}

// One capacity formula (capacity.h): Megatron's get_capacity(T*K, E, cf) = ceil(T*K/E*cf), at
// most T. Above T nothing is dropped and pad_to_capacity pads every expert to T rows (Megatron's
// routing map is then all ones), not to ceil(...) and not to T*K.
TEST(RoutingPlan, CapacityIsMegatronsGetCapacityAtMostTokens) {
  for (int64_t T : {1, 2, 7, 64}) {
    for (int64_t K : {1, 2, 3}) {
      for (int64_t E : {1, 4, 8}) {
        for (double cf : {0.25, 1.0, 1.5, 3.0, 100.0}) {
          const double want = std::ceil(static_cast<double>(T) * static_cast<double>(K) /
                                        static_cast<double>(E) * cf);
          EXPECT_EQ(expert_capacity(T, K, E, cf), std::min<int64_t>(static_cast<int64_t>(want), T))
              << "T=" << T << " K=" << K << " E=" << E << " cf=" << cf;
        }
      }
    }
  }
  EXPECT_EQ(expert_capacity(5, 2, 4, 1e300), 5);  // no overflow
  // T=2, K=2, E=2, cf=4: ceil(8) = 8 > T, so C = 2 and every expert is padded to 2 rows.
  RoutingPlanOptions o;
  o.capacity_factor = 4.0;
  o.pad_to_capacity = true;
  const RoutingPlan p = build_routing_plan(
      Tensor::from_vector(std::vector<int32_t>{0, 1, 0, -1}, {2, 2}), Tensor(), 2, o);
  EXPECT_EQ(i64(p.expert_offsets), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(i64(p.row_token), (std::vector<int64_t>{0, 1, 0, -1}));
  EXPECT_EQ(p.num_dropped, 0);
}

// The router and the plan share one drop rule: routing without capacity and then planning with
// capacity keeps exactly the pairs that routing with capacity keeps, for both policies.
TEST(RoutingPlan, DropsTheSamePairsAsTheRouter) {
  const uint64_t seed = test_seed(14);
  std::mt19937_64 rng(seed);
  for (auto policy : {TokenDropPolicy::probs, TokenDropPolicy::position}) {
    for (double cf : {0.5, 1.0, 1.25}) {
      const int64_t T = 300, E = 16, K = 4;
      std::normal_distribution<float> nd(0.f, 1.f);
      std::vector<float> z(static_cast<size_t>(T * E));
      for (int64_t i = 0; i < T * E; ++i) z[i] = nd(rng) + (i % E < 3 ? 1.5f : 0.f);  // skew
      const Tensor logits = Tensor::from_vector(z, {T, E});
      RouterConfig c;
      c.num_experts = E;
      c.top_k = K;
      c.token_drop_policy = policy;
      const RouteResult free = topk_route(logits, {}, c);
      c.capacity_factor = cf;
      const RouteResult capped = topk_route(logits, {}, c);
      RoutingPlanOptions o;
      o.capacity_factor = cf;
      o.token_drop_policy = policy;
      const RoutingPlan p = build_routing_plan(free.topk_idx, free.topk_weights, E, o);
      SCOPED_TRACE(std::string(token_drop_policy_name(policy)) + " cf=" + std::to_string(cf) + " " + repro(seed));
      EXPECT_GT(capped.num_dropped, 0);
      EXPECT_EQ(p.num_dropped, capped.num_dropped);
      EXPECT_EQ(i64(p.num_tokens_per_expert), i64(capped.num_tokens_per_expert));
      const int32_t* ci = capped.topk_idx.data<int32_t>();
      for (int64_t s = 0; s < T * K; ++s) {
        EXPECT_EQ(p.slot_row.data<int64_t>()[s] >= 0, ci[s] >= 0) << "slot " << s;
      }
    }
  }
}

TEST(RoutingPlan, AlignmentWithoutCapacity) {
  std::vector<int32_t> idx = {0, 2, 2, 0, 0, 1};
  RoutingPlanOptions o;
  o.expert_alignment = 8;
  RoutingPlan p = build_routing_plan(Tensor::from_vector(idx, {3, 2}), Tensor(), 3, o);
  EXPECT_EQ(i64(p.expert_offsets), (std::vector<int64_t>{0, 8, 16, 24}));
  EXPECT_EQ(p.num_pairs, 6);
  EXPECT_EQ(i64(p.num_tokens_per_expert), (std::vector<int64_t>{3, 1, 2}));
}

TEST(RoutingPlan, RejectsBadArguments) {
  auto idx = Tensor::from_vector(std::vector<int32_t>{0, 5, 1, 2}, {2, 2});
  SY_EXPECT_THROW_MSG(build_routing_plan(idx, Tensor(), 4), std::invalid_argument,
                      "[routing_plan] topk_idx must hold ids in [0, num_experts=4) or -1, got "
                      "topk_idx[0, 1]=5");
  auto neg = Tensor::from_vector(std::vector<int32_t>{0, -2}, {1, 2});
  SY_EXPECT_THROW_MSG(build_routing_plan(neg, Tensor(), 4), std::invalid_argument,
                      "topk_idx[0, 1]=-2");
  auto i64t = Tensor::zeros({2, 2}, DType::int64);
  SY_EXPECT_THROW_MSG(build_routing_plan(i64t, Tensor(), 4), std::invalid_argument, "topk_idx");
  auto ok = Tensor::zeros({2, 2}, DType::int32);
  SY_EXPECT_THROW_MSG(build_routing_plan(ok, Tensor::zeros({2, 3}, DType::fp32), 4),
                      std::invalid_argument, "topk_weights");
  SY_EXPECT_THROW_MSG(build_routing_plan(ok, Tensor(), 0), std::invalid_argument,
                      "num_experts must be >= 1");
  RoutingPlanOptions o;
  o.expert_alignment = 0;
  SY_EXPECT_THROW_MSG(build_routing_plan(ok, Tensor(), 4, o), std::invalid_argument,
                      "expert_alignment must be >= 1, got expert_alignment=0");
  RoutingPlanOptions q;
  q.pad_to_capacity = true;
  SY_EXPECT_THROW_MSG(build_routing_plan(ok, Tensor(), 4, q), std::invalid_argument,
                      "pad_to_capacity needs a capacity");
}

}  // namespace
}  // namespace switchyard
