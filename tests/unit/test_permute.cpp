// permute / unpermute and their backwards: values against the double reference, bit-exact
// movement, adjoint identities, finite differences for the weight gradient, thread invariance.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "model_shapes.h"
#include "permute_tester.h"
#include "ref/dispatch_ref.h"
#include "switchyard/dispatcher.h"
#include "switchyard/error.h"
#include "switchyard/permute.h"
#include "testing.h"

namespace switchyard {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::randn;
using testing::repro;
using testing::test_seed;

using testing::PermuteTester;

// Random routes (testing::random_routes) and their plan, for the tests of one property.
struct Routed {
  std::vector<int32_t> idx;
  std::vector<float> w;
  RoutingPlan plan;
};

Routed make_routed(int64_t T, int64_t E, int64_t K, std::mt19937_64& rng) {
  Routed s;
  s.idx = testing::random_routes(T, K, E, rng);
  s.w = testing::random_weights(T * K, rng, 0.05f);
  s.plan =
      build_routing_plan(Tensor::from_vector(s.idx, {T, K}), Tensor::from_vector(s.w, {T, K}), E);
  return s;
}

// One routing shape per case, fp32 and bf16 rows: permute bit-exact with zeroed padding, unpermute
// against the double reference (weights applied and skipped), the adjoint identities (fp32) and
// the backward against the reference (PermuteTester).
#define SY_PERMUTE_CASE(Name, T, H, E, K)                                              \
  TEST(PermuteFp32, Name) {                                                            \
    PermuteTester().tokens(T).hidden(H).experts(E).top_k(K).dtype(DType::fp32).Test(); \
  }                                                                                    \
  TEST(PermuteBf16, Name) {                                                            \
    PermuteTester().tokens(T).hidden(H).experts(E).top_k(K).dtype(DType::bf16).Test(); \
  }

SY_PERMUTE_CASE(ZeroTokens, 0, 5, 4, 2)
SY_PERMUTE_CASE(OneTokenOneExpert, 1, 3, 1, 1)
SY_PERMUTE_CASE(SevenTokensTop8Of8, 7, 19, 8, 8)
SY_PERMUTE_CASE(SevenTokensTop2Of2, 7, 4, 2, 2)
SY_PERMUTE_CASE(Top8Of64At1031Tokens, 1031, 37, 64, 8)
SY_PERMUTE_CASE(EveryExpertTop256Of256, 61, 5, 256, 256)
SY_PERMUTE_CASE(Qwen3RoutingTop8Of128, 300, 128, testing::kQwen3_30B_A3B.num_experts,
                testing::kQwen3_30B_A3B.top_k)

TEST(Unpermute, WeightGradientMatchesFiniteDifferencesWithRepeatedIds) {
  // Central finite differences in double of L = <unpermute(Y; w), g> w.r.t. each slot weight,
  // including a repeated id (the gradient reaches every merged slot).
  const int64_t T = 3, H = 6, E = 4, K = 3;
  std::vector<int32_t> idx = {2, 2, 0, -1, 1, 3, 0, 0, 0};
  std::vector<float> w = {0.5f, 0.25f, 0.125f, 0.3f, 0.6f, 0.1f, 0.2f, 0.3f, 0.5f};
  std::mt19937_64 rng(test_seed(77));
  RoutingPlan plan =
      build_routing_plan(Tensor::from_vector(idx, {T, K}), Tensor::from_vector(w, {T, K}), E);
  Tensor Y = randn({plan.num_rows, H}, DType::fp32, rng);
  Tensor g = randn({T, H}, DType::fp32, rng);
  auto gw = unpermute_backward(g, Y, plan).grad_topk_weights.to_double_vector();
  auto loss = [&](const std::vector<double>& wd) {
    std::vector<float> wf;  // reference loss in double: recompute merged weights in double
    auto pairs = ref::token_pairs(idx, {}, T, K);
    for (auto& ps : pairs)
      for (auto& p : ps) {
        p.weight = 0;
        for (int64_t k : p.slots) p.weight += wd[p.token * K + k];
      }
    const int64_t* rt = plan.row_token.data<int64_t>();
    const int32_t* re = plan.row_expert.data<int32_t>();
    auto y = ref::combine(pairs, Y.to_double_vector(), H, true, [&](int64_t t, int64_t e) {
      for (int64_t r = 0; r < plan.num_rows; ++r)
        if (rt[r] == t && re[r] == e) return r;
      return int64_t{-1};
    });
    auto gv = g.to_double_vector();
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += y[i] * gv[i];
    return l;
  };
  for (int64_t s = 0; s < T * K; ++s) {
    std::vector<double> wp(w.begin(), w.end()), wm(w.begin(), w.end());
    wp[s] += 1e-4;
    wm[s] -= 1e-4;
    const double fd = idx[s] < 0 ? 0.0 : (loss(wp) - loss(wm)) / 2e-4;
    EXPECT_NEAR(gw[s], fd, 1e-4) << "slot " << s;
  }
}

TEST(Permute, ResultsIndependentOfThreadCount) {
  const int64_t T = 1031, H = 130, E = 64, K = 8;
  std::mt19937_64 rng(test_seed(9));
  Routed s = make_routed(T, E, K, rng);
  Tensor x = randn({T, H}, DType::bf16, rng);
  Tensor g = randn({T, H}, DType::bf16, rng);
  const int saved = num_threads();
  set_num_threads(1);
  Tensor p1 = permute(x, s.plan), y1 = unpermute(p1, s.plan);
  UnpermuteGrads g1 = unpermute_backward(g, p1, s.plan);
  set_num_threads(3);
  Tensor p3 = permute(x, s.plan), y3 = unpermute(p3, s.plan);
  UnpermuteGrads g3 = unpermute_backward(g, p3, s.plan);
  set_num_threads(saved);
  EXPECT_TRUE(bitwise_equal(p1, p3));
  EXPECT_TRUE(bitwise_equal(y1, y3));
  EXPECT_TRUE(bitwise_equal(g1.grad_permuted, g3.grad_permuted));
  EXPECT_TRUE(bitwise_equal(g1.grad_topk_weights, g3.grad_topk_weights));
}

TEST(Permute, IntoVariantsWriteTheSameBits) {
  const int64_t T = 131, H = 24, E = 16, K = 4;
  const DType dt = DType::bf16;
  std::mt19937_64 rng(test_seed(13));
  Routed s = make_routed(T, E, K, rng);
  Tensor x = randn({T, H}, dt, rng);
  Tensor p = Tensor::full({s.plan.num_rows, H}, dt, 3.0);
  permute_into(x, p, s.plan);
  EXPECT_TRUE(bitwise_equal(p, permute(x, s.plan)));
  Tensor y = Tensor::full({T, H}, dt, 3.0);
  unpermute_into(p, y, s.plan);
  EXPECT_TRUE(bitwise_equal(y, unpermute(p, s.plan)));
  Tensor wrong = Tensor::empty({T, H}, DType::fp32);
  SY_EXPECT_THROW_MSG(unpermute_into(p, wrong, s.plan), std::invalid_argument, "[unpermute] out");
  Tensor short_out = Tensor::empty({s.plan.num_rows - 1, H}, dt);
  SY_EXPECT_THROW_MSG(permute_into(x, short_out, s.plan), std::invalid_argument, "[permute] out");
}

TEST(Permute, LocalCommunicatorDispatchIsPermute) {
  // EP = 1 through the dispatchers on the size-1 communicator (works without MPI): dispatch is
  // permute, combine is unpermute, bit for bit, for both dispatchers.
  struct {
    int64_t T = 211, H = 40, E = 16, K = 4;
    DType dtype = DType::bf16;
  } c;
  for (auto kind : {dist::DispatcherKind::all_to_all, dist::DispatcherKind::all_gather}) {
    std::mt19937_64 rng(test_seed(17));
    Routed s = make_routed(c.T, c.E, c.K, rng);
    Tensor x = randn({c.T, c.H}, c.dtype, rng);
    dist::Dispatcher disp(dist::local());
    dist::DispatchOptions opt;
    opt.num_experts = c.E;
    opt.kind = kind;
    dist::DispatchResult d = disp.dispatch(x, Tensor::from_vector(s.idx, {c.T, c.K}),
                                           Tensor::from_vector(s.w, {c.T, c.K}), opt);
    EXPECT_TRUE(bitwise_equal(d.recv_x, permute(x, s.plan)));
    EXPECT_TRUE(bitwise_equal(d.recv_topk_weights, s.plan.row_weight));
    EXPECT_TRUE(bitwise_equal(d.handle.num_tokens_per_expert(), s.plan.num_tokens_per_expert));
    EXPECT_TRUE(bitwise_equal(disp.combine(d.recv_x, d.handle), unpermute(d.recv_x, s.plan)));
    Tensor g = randn({c.T, c.H}, c.dtype, rng);
    dist::CombineGrads cg = disp.combine_backward(g, d.recv_x, d.handle);
    UnpermuteGrads ug = unpermute_backward(g, d.recv_x, s.plan);
    EXPECT_TRUE(bitwise_equal(cg.grad_expert_y, ug.grad_permuted));
    EXPECT_TRUE(bitwise_equal(cg.grad_topk_weights, ug.grad_topk_weights));
    EXPECT_TRUE(bitwise_equal(disp.dispatch_backward(ug.grad_permuted, d.handle),
                              permute_backward(ug.grad_permuted, s.plan)));
  }
}

TEST(Communicator, WorldNeedsMpi) {
  if (dist::mpi_built()) {
    // MPI is not initialised in a unit test: world() must say so, not crash.
    SY_EXPECT_THROW_MSG(dist::world(), BackendError, "MPI is not initialised");
  } else {
    SY_EXPECT_THROW_MSG(dist::world(), BackendError, "not built with MPI");
  }
  EXPECT_EQ(dist::local()->name(), "local");
}

TEST(Permute, RejectsBadArguments) {
  auto plan = build_routing_plan(Tensor::from_vector(std::vector<int32_t>{0, 1, 1, 1}, {2, 2}),
                                 Tensor(), 2);
  SY_EXPECT_THROW_MSG(permute(Tensor::zeros({3, 4}, DType::fp32), plan), std::invalid_argument,
                      "[permute] x must have 2 rows (from the routing plan), got shape [3, 4]");
  SY_EXPECT_THROW_MSG(permute(Tensor::zeros({2, 4}, DType::int32), plan), std::invalid_argument,
                      "[permute] x");
  SY_EXPECT_THROW_MSG(permute(Tensor::zeros({2, 4}, DType::fp32), RoutingPlan{}),
                      std::invalid_argument, "plan must come from build_routing_plan");
  SY_EXPECT_THROW_MSG(unpermute(Tensor::zeros({4, 4}, DType::fp32), plan), std::invalid_argument,
                      "[unpermute] permuted must have 3 rows");
  SY_EXPECT_THROW_MSG(unpermute_backward(Tensor::zeros({2, 4}, DType::fp32),
                                         Tensor::zeros({3, 4}, DType::bf16), plan),
                      std::invalid_argument,
                      "[unpermute_backward] permuted must have grad_y's dtype fp32");
}

}  // namespace
}  // namespace switchyard
