// permute / unpermute and their backwards: values against the double reference, bit-exact
// movement, adjoint identities, finite differences for the weight gradient, thread invariance.
#include <gtest/gtest.h>

#include <map>
#include <random>

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

struct Case {
  int64_t T, H, E, K;
  DType dtype;
};

std::vector<int32_t> random_routes(int64_t T, int64_t K, int64_t E, std::mt19937_64& rng) {
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  std::uniform_int_distribution<int> kind(0, 7), ex(0, static_cast<int>(E - 1)), kk(0, 3);
  for (int64_t t = 0; t < T; ++t) {
    const int c = kind(rng);
    for (int64_t k = 0; k < K; ++k) {
      int32_t v = ex(rng);
      if (c == 0) v = 0;
      if (c == 1) v = -1;
      if (c == 2 && kk(rng) == 0) v = -1;
      if (c == 3 && k > 0 && kk(rng) < 2) v = idx[static_cast<size_t>(t * K + k - 1)];
      idx[static_cast<size_t>(t * K + k)] = v;
    }
  }
  return idx;
}

struct Routed {
  std::vector<int32_t> idx;
  std::vector<float> w;
  RoutingPlan plan;
  std::vector<std::vector<ref::RefPair>> pairs;
  std::map<std::pair<int64_t, int64_t>, int64_t> row_of;
};

Routed make_routed(const Case& c, std::mt19937_64& rng, const RoutingPlanOptions& opt = {}) {
  Routed s;
  s.idx = random_routes(c.T, c.K, c.E, rng);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  s.w.resize(s.idx.size());
  for (auto& v : s.w) v = u(rng);
  s.plan = build_routing_plan(Tensor::from_vector(s.idx, {c.T, c.K}),
                              Tensor::from_vector(s.w, {c.T, c.K}), c.E, opt);
  s.pairs = ref::token_pairs(s.idx, s.w, c.T, c.K);
  const int64_t* rt = s.plan.row_token.data<int64_t>();
  const int32_t* re = s.plan.row_expert.data<int32_t>();
  for (int64_t r = 0; r < s.plan.num_rows; ++r) {
    if (rt[r] >= 0) s.row_of[{rt[r], re[r]}] = r;
  }
  return s;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (DType d : {DType::fp32, DType::bf16}) {
    out.push_back({0, 5, 4, 2, d});
    out.push_back({1, 3, 1, 1, d});
    out.push_back({7, 19, 8, 8, d});
    out.push_back({7, 4, 2, 2, d});
    out.push_back({1031, 37, 64, 8, d});
    out.push_back({61, 5, 256, 256, d});
    out.push_back({300, 128, 128, 8, d});
  }
  return out;
}

std::string name(const Case& c) {
  return "T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " E=" + std::to_string(c.E) +
         " K=" + std::to_string(c.K) + " " + dtype_name(c.dtype);
}

// fp32: one rounding per accumulated row (K rows at most) plus the merged weight's; bf16: the
// output rounding dominates.
double tol(const Case& c) {
  return c.dtype == DType::bf16 ? 8e-3 : 1e-6 * static_cast<double>(2 + c.K);
}

TEST(Permute, MovesRowsBitExactlyAndZeroesPadding) {
  for (const Case& c : cases()) {
    const uint64_t seed = test_seed(11 + c.T + c.E);
    std::mt19937_64 rng(seed);
    RoutingPlanOptions opt;
    opt.expert_alignment = 4;
    Routed s = make_routed(c, rng, opt);
    Tensor x = randn({c.T, c.H}, c.dtype, rng);
    Tensor p = permute(x, s.plan);
    ASSERT_EQ(p.shape(), (Shape{s.plan.num_rows, c.H})) << name(c);
    const int64_t* rt = s.plan.row_token.data<int64_t>();
    const size_t rb = static_cast<size_t>(c.H) * dtype_size(c.dtype);
    std::vector<unsigned char> zero(rb, 0);
    for (int64_t r = 0; r < s.plan.num_rows; ++r) {
      const auto* got = static_cast<const unsigned char*>(p.raw()) + r * rb;
      const void* want = rt[r] >= 0 ? static_cast<const unsigned char*>(x.raw()) + rt[r] * rb
                                    : static_cast<const void*>(zero.data());
      ASSERT_EQ(std::memcmp(got, want, rb), 0)
          << "row " << r << " " << name(c) << " " << repro(seed);
    }
  }
}

TEST(Unpermute, MatchesDoubleReference) {
  for (const Case& c : cases()) {
    for (WeightMode mode : {WeightMode::apply, WeightMode::skip}) {
      const uint64_t seed = test_seed(23 + c.T * 3 + c.E);
      std::mt19937_64 rng(seed);
      Routed s = make_routed(c, rng);
      Tensor Y = randn({s.plan.num_rows, c.H}, c.dtype, rng);
      Tensor y = unpermute(Y, s.plan, {mode});
      auto want = ref::combine(s.pairs, Y.to_double_vector(), c.H, mode == WeightMode::apply,
                               [&](int64_t t, int64_t e) {
                                 return s.row_of.at({t, e});
                               });
      EXPECT_TRUE(all_close(y, want, tol(c), tol(c))) << name(c) << " " << repro(seed);
    }
  }
}

TEST(Unpermute, RoundTripWithNormalisedWeights) {
  // unpermute(permute(x)) with each token's weights summing to 1 gives x back (every token routed).
  const int64_t T = 97, H = 33, E = 16, K = 4;
  std::mt19937_64 rng(test_seed(5));
  std::vector<int32_t> idx(T * K);
  std::vector<float> w(T * K, 0.25f);
  std::uniform_int_distribution<int> ex(0, E - 1);
  for (auto& v : idx) v = ex(rng);
  RoutingPlan plan =
      build_routing_plan(Tensor::from_vector(idx, {T, K}), Tensor::from_vector(w, {T, K}), E);
  Tensor x = randn({T, H}, DType::fp32, rng);
  EXPECT_TRUE(all_close(unpermute(permute(x, plan), plan), x, 1e-6, 1e-6));
}

// <f(a), b> in double.
double dot(const Tensor& a, const Tensor& b) {
  auto va = a.to_double_vector(), vb = b.to_double_vector();
  double s = 0;
  for (size_t i = 0; i < va.size(); ++i) s += va[i] * vb[i];
  return s;
}

TEST(Permute, AdjointIdentities) {
  for (const Case& c : cases()) {
    if (c.dtype != DType::fp32) continue;
    const uint64_t seed = test_seed(31 + c.T);
    std::mt19937_64 rng(seed);
    Routed s = make_routed(c, rng);
    Tensor x = randn({c.T, c.H}, c.dtype, rng);
    Tensor P = randn({s.plan.num_rows, c.H}, c.dtype, rng);
    Tensor g = randn({c.T, c.H}, c.dtype, rng);
    // <permute(x), P> = <x, permute_backward(P)>
    const double l1 = dot(permute(x, s.plan), P), r1 = dot(x, permute_backward(P, s.plan));
    EXPECT_NEAR(l1, r1, 1e-4 * (1 + std::fabs(l1))) << name(c) << " " << repro(seed);
    // <unpermute(P), g> = <P, unpermute_backward(g).grad_permuted>
    const double l2 = dot(unpermute(P, s.plan), g);
    const double r2 = dot(P, unpermute_backward(g, P, s.plan).grad_permuted);
    EXPECT_NEAR(l2, r2, 1e-4 * (1 + std::fabs(l2))) << name(c) << " " << repro(seed);
  }
}

TEST(Unpermute, BackwardMatchesReferenceAndFiniteDifferences) {
  for (const Case& c : cases()) {
    const uint64_t seed = test_seed(41 + c.T + c.K);
    std::mt19937_64 rng(seed);
    Routed s = make_routed(c, rng);
    Tensor Y = randn({s.plan.num_rows, c.H}, c.dtype, rng);
    Tensor g = randn({c.T, c.H}, c.dtype, rng);
    UnpermuteGrads gr = unpermute_backward(g, Y, s.plan);
    auto want_w = ref::grad_weights(s.pairs, Y.to_double_vector(), g.to_double_vector(), c.K, c.H,
                                    [&](int64_t t, int64_t e) {
                                      return s.row_of.at({t, e});
                                    });
    EXPECT_TRUE(all_close(gr.grad_topk_weights, want_w, 1e-5 * c.H, 1e-5))
        << name(c) << " " << repro(seed);
    // grad_permuted[r] = w_r * g[token(r)]
    std::vector<double> want_p(static_cast<size_t>(s.plan.num_rows * c.H));
    auto gv = g.to_double_vector();
    const int64_t* rt = s.plan.row_token.data<int64_t>();
    const float* rw = s.plan.row_weight.data<float>();
    for (int64_t r = 0; r < s.plan.num_rows; ++r)
      for (int64_t h = 0; h < c.H; ++h) want_p[r * c.H + h] = rw[r] * gv[rt[r] * c.H + h];
    EXPECT_TRUE(all_close(gr.grad_permuted, want_p, tol(c), tol(c))) << name(c);
    UnpermuteGrads gs = unpermute_backward(g, Tensor(), s.plan, {WeightMode::skip});
    EXPECT_TRUE(bitwise_equal(gs.grad_permuted, permute(g, s.plan))) << name(c);
  }
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
  const Case c{1031, 130, 64, 8, DType::bf16};
  std::mt19937_64 rng(test_seed(9));
  Routed s = make_routed(c, rng);
  Tensor x = randn({c.T, c.H}, c.dtype, rng);
  Tensor g = randn({c.T, c.H}, c.dtype, rng);
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
  const Case c{131, 24, 16, 4, DType::bf16};
  std::mt19937_64 rng(test_seed(13));
  Routed s = make_routed(c, rng);
  Tensor x = randn({c.T, c.H}, c.dtype, rng);
  Tensor p = Tensor::full({s.plan.num_rows, c.H}, c.dtype, 3.0);
  permute_into(x, p, s.plan);
  EXPECT_TRUE(bitwise_equal(p, permute(x, s.plan)));
  Tensor y = Tensor::full({c.T, c.H}, c.dtype, 3.0);
  unpermute_into(p, y, s.plan);
  EXPECT_TRUE(bitwise_equal(y, unpermute(p, s.plan)));
  Tensor wrong = Tensor::empty({c.T, c.H}, DType::fp32);
  SY_EXPECT_THROW_MSG(unpermute_into(p, wrong, s.plan), std::invalid_argument, "[unpermute] out");
  Tensor short_out = Tensor::empty({s.plan.num_rows - 1, c.H}, c.dtype);
  SY_EXPECT_THROW_MSG(permute_into(x, short_out, s.plan), std::invalid_argument, "[permute] out");
}

TEST(Permute, LocalCommunicatorDispatchIsPermute) {
  // EP = 1 through the dispatchers on the size-1 communicator (works without MPI): dispatch is
  // permute, combine is unpermute, bit for bit, for both dispatchers.
  const Case c{211, 40, 16, 4, DType::bf16};
  for (auto kind : {dist::DispatcherKind::all_to_all, dist::DispatcherKind::all_gather}) {
    std::mt19937_64 rng(test_seed(17));
    Routed s = make_routed(c, rng);
    Tensor x = randn({c.T, c.H}, c.dtype, rng);
    auto comm = dist::local();
    dist::DispatchOptions opt;
    opt.num_experts = c.E;
    opt.kind = kind;
    dist::DispatchResult d = dist::dispatch(x, Tensor::from_vector(s.idx, {c.T, c.K}),
                                            Tensor::from_vector(s.w, {c.T, c.K}), opt, *comm);
    EXPECT_TRUE(bitwise_equal(d.recv_x, permute(x, s.plan)));
    EXPECT_TRUE(bitwise_equal(d.recv_topk_weights, s.plan.row_weight));
    EXPECT_TRUE(bitwise_equal(d.handle.num_tokens_per_expert, s.plan.num_tokens_per_expert));
    EXPECT_TRUE(
        bitwise_equal(dist::combine(d.recv_x, d.handle, {}, *comm), unpermute(d.recv_x, s.plan)));
    Tensor g = randn({c.T, c.H}, c.dtype, rng);
    dist::CombineGrads cg = dist::combine_backward(g, d.recv_x, d.handle, {}, *comm);
    UnpermuteGrads ug = unpermute_backward(g, d.recv_x, s.plan);
    EXPECT_TRUE(bitwise_equal(cg.grad_expert_y, ug.grad_permuted));
    EXPECT_TRUE(bitwise_equal(cg.grad_topk_weights, ug.grad_topk_weights));
    EXPECT_TRUE(bitwise_equal(dist::dispatch_backward(ug.grad_permuted, d.handle, *comm),
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
