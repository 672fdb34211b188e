// RoutingPlanTester and PermuteTester: the routing plan and permute / unpermute for one routing
// shape, built fluently, on random routes with the rows that break kernels
// (tests/ref/dispatch_ref.h is the reference):
//
//   RoutingPlanTester().tokens(1031).experts(64).top_k(8).Test();
//   PermuteTester().tokens(1031).hidden(37).experts(64).top_k(8).dtype(DType::bf16).Test();
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ref/dispatch_ref.h"
#include "router_tester.h"
#include "switchyard/permute.h"
#include "switchyard/routing_plan.h"
#include "testing.h"

namespace switchyard::testing {

/// Random routes [T, K] over E experts with, per token at random: a zero-filled row (replay
/// padding: K slots naming expert 0), an all -1 row, some -1 slots, repeated ids, or K random ids.
inline std::vector<int32_t> random_routes(int64_t T, int64_t K, int64_t E, std::mt19937_64& rng) {
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  std::uniform_int_distribution<int> kind(0, 9), kk(0, 4);
  std::uniform_int_distribution<int64_t> ex(0, E - 1);
  for (int64_t t = 0; t < T; ++t) {
    const int c = kind(rng);
    for (int64_t k = 0; k < K; ++k) {
      int32_t v = static_cast<int32_t>(ex(rng));
      if (c == 0) v = 0;                   // zero-filled padding row
      if (c == 1) v = -1;                  // no route
      if (c == 2 && kk(rng) == 0) v = -1;  // some dropped slots
      if (c == 3 && k > 0 && kk(rng) < 2) v = idx[static_cast<size_t>(t * K + k - 1)];  // repeats
      idx[static_cast<size_t>(t * K + k)] = v;
    }
  }
  return idx;
}

/// Uniform weights in [lo, 1).
inline std::vector<float> random_weights(int64_t n, std::mt19937_64& rng, float lo = 0.01f) {
  std::uniform_real_distribution<float> u(lo, 1.0f);
  std::vector<float> w(static_cast<size_t>(n));
  for (auto& v : w) v = u(rng);
  return w;
}

/// build_routing_plan (no capacity, no padding) against the reference: rows in expert-major
/// order, counts and their exclusive prefix sum, merged weights within one fp32 rounding per merged
/// slot, every slot's row, -1 slots without a row.
class RoutingPlanTester {
 public:
  RoutingPlanTester& tokens(int64_t T) { return T_ = T, *this; }
  RoutingPlanTester& experts(int64_t E) { return E_ = E, *this; }
  RoutingPlanTester& top_k(int64_t K) { return K_ = K, *this; }
  RoutingPlanTester& seed(uint64_t s) { return seed_ = s, *this; }

  std::string describe() const {
    return "T=" + std::to_string(T_) + " E=" + std::to_string(E_) + " K=" + std::to_string(K_);
  }

  void Test() const {
    const uint64_t seed = test_seed(seed_ ? *seed_ : seed_of("plan " + describe()));
    SCOPED_TRACE(describe() + " " + repro(seed));
    const int64_t T = T_, E = E_, K = K_;
    std::mt19937_64 rng(seed);
    const auto idx = random_routes(T, K, E, rng);
    const auto w = random_weights(T * K, rng);
    const RoutingPlan p =
        build_routing_plan(Tensor::from_vector(idx, {T, K}), Tensor::from_vector(w, {T, K}), E);
    const auto pairs = ref::token_pairs(idx, w, T, K);
    const auto rows = ref::expert_major_rows(pairs, E);
    ASSERT_EQ(p.num_pairs, static_cast<int64_t>(rows.size()));
    ASSERT_EQ(p.num_rows, p.num_pairs);
    EXPECT_EQ(p.num_dropped, 0);
    const int64_t* rt = p.row_token.data<int64_t>();
    const int32_t* re = p.row_expert.data<int32_t>();
    std::map<std::pair<int64_t, int64_t>, int64_t> row_of;
    for (size_t r = 0; r < rows.size(); ++r) {
      ASSERT_EQ(rt[r], rows[r].first) << "row " << r;
      ASSERT_EQ(re[r], rows[r].second) << "row " << r;
      row_of[rows[r]] = static_cast<int64_t>(r);
    }
    // Counts sum to the pairs; offsets are their exclusive prefix sum.
    const int64_t* c = p.num_tokens_per_expert.data<int64_t>();
    const int64_t* o = p.expert_offsets.data<int64_t>();
    int64_t sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      ASSERT_EQ(o[e], sum) << "expert " << e;
      sum += c[e];
    }
    ASSERT_EQ(o[E], p.num_pairs);
    const float* rw = p.row_weight.data<float>();
    const int64_t* sr = p.slot_row.data<int64_t>();
    for (const auto& ps : pairs) {
      for (const auto& q : ps) {
        const int64_t r = row_of.at({q.token, q.expert});
        ASSERT_NEAR(rw[r], q.weight, 1e-6 * static_cast<double>(q.slots.size()))
            << "token " << q.token << " expert " << q.expert;
        for (int64_t k : q.slots) ASSERT_EQ(sr[q.token * K + k], r) << "slot " << k;
      }
    }
    for (int64_t s = 0; s < T * K; ++s) {
      if (idx[static_cast<size_t>(s)] < 0) {
        ASSERT_EQ(sr[s], -1) << "slot " << coord({T, K}, s);
      }
    }
  }

 private:
  int64_t T_ = 7, E_ = 8, K_ = 2;
  std::optional<uint64_t> seed_;
};

/// permute, unpermute and unpermute_backward on one routing shape and row dtype:
/// - permute moves rows bit for bit and zero-fills the padding rows (expert_alignment 4);
/// - unpermute (weights applied and skipped) matches the double combine;
/// - <permute(x), P> = <x, permute_backward(P)> and <unpermute(P), g> = <P, grad_permuted> (fp32);
/// - grad_topk_weights and grad_permuted match the reference; without weights grad_permuted is
///   bitwise permute(g).
class PermuteTester {
 public:
  PermuteTester& tokens(int64_t T) { return T_ = T, *this; }
  PermuteTester& hidden(int64_t H) { return H_ = H, *this; }
  PermuteTester& experts(int64_t E) { return E_ = E, *this; }
  PermuteTester& top_k(int64_t K) { return K_ = K, *this; }
  PermuteTester& dtype(DType d) { return dtype_ = d, *this; }
  PermuteTester& seed(uint64_t s) { return seed_ = s, *this; }

  std::string describe() const {
    return "T=" + std::to_string(T_) + " H=" + std::to_string(H_) + " E=" + std::to_string(E_) +
           " K=" + std::to_string(K_) + " " + dtype_name(dtype_);
  }

  void Test() const {
    TestPermute();
    TestUnpermute(WeightMode::apply);
    TestUnpermute(WeightMode::skip);
    if (dtype_ == DType::fp32) TestAdjoint();
    TestBackward();
  }

 private:
  struct Routed {
    std::vector<int32_t> idx;
    std::vector<float> w;
    RoutingPlan plan;
    std::vector<std::vector<ref::RefPair>> pairs;
    std::map<std::pair<int64_t, int64_t>, int64_t> row_of;
    int64_t row(int64_t t, int64_t e) const { return row_of.at({t, e}); }
  };

  uint64_t seed_for(const char* what) const {
    return test_seed(seed_ ? *seed_ : seed_of(std::string(what) + " " + describe()));
  }

  Routed routed(std::mt19937_64& rng, const RoutingPlanOptions& opt = {}) const {
    Routed s;
    s.idx = random_routes(T_, K_, E_, rng);
    s.w = random_weights(T_ * K_, rng, 0.05f);
    s.plan = build_routing_plan(Tensor::from_vector(s.idx, {T_, K_}),
                                Tensor::from_vector(s.w, {T_, K_}), E_, opt);
    s.pairs = ref::token_pairs(s.idx, s.w, T_, K_);
    const int64_t* rt = s.plan.row_token.data<int64_t>();
    const int32_t* re = s.plan.row_expert.data<int32_t>();
    for (int64_t r = 0; r < s.plan.num_rows; ++r) {
      if (rt[r] >= 0) s.row_of[{rt[r], re[r]}] = r;
    }
    return s;
  }

  // fp32: one rounding per accumulated row (K rows at most) plus the merged weight's; bf16: the
  // output rounding dominates.
  double tol() const { return dtype_ == DType::bf16 ? 8e-3 : 1e-6 * static_cast<double>(2 + K_); }

  static double dot(const Tensor& a, const Tensor& b) {
    const auto va = a.to_double_vector(), vb = b.to_double_vector();
    double s = 0;
    for (size_t i = 0; i < va.size(); ++i) s += va[i] * vb[i];
    return s;
  }

  void TestPermute() const {
    const uint64_t seed = seed_for("permute");
    SCOPED_TRACE("permute " + describe() + " " + repro(seed));
    std::mt19937_64 rng(seed);
    RoutingPlanOptions opt;
    opt.expert_alignment = 4;
    const Routed s = routed(rng, opt);
    const Tensor x = randn({T_, H_}, dtype_, rng);
    const Tensor p = permute(x, s.plan);
    ASSERT_EQ(p.shape(), (Shape{s.plan.num_rows, H_}));
    const int64_t* rt = s.plan.row_token.data<int64_t>();
    const size_t rb = static_cast<size_t>(H_) * dtype_size(dtype_);
    const std::vector<unsigned char> zero(rb, 0);
    for (int64_t r = 0; r < s.plan.num_rows; ++r) {
      const auto* got = static_cast<const unsigned char*>(p.raw()) + r * rb;
      const void* want = rt[r] >= 0 ? static_cast<const unsigned char*>(x.raw()) + rt[r] * rb
                                    : static_cast<const void*>(zero.data());
      ASSERT_EQ(std::memcmp(got, want, rb), 0) << "row " << r << " (token " << rt[r] << ")";
    }
  }

  void TestUnpermute(WeightMode mode) const {
    const uint64_t seed = seed_for(mode == WeightMode::apply ? "unpermute" : "unpermute skip");
    SCOPED_TRACE(std::string("unpermute weights=") +
                 (mode == WeightMode::apply ? "apply " : "skip ") + describe() + " " + repro(seed));
    std::mt19937_64 rng(seed);
    const Routed s = routed(rng);
    const Tensor Y = randn({s.plan.num_rows, H_}, dtype_, rng);
    const Tensor y = unpermute(Y, s.plan, {mode});
    const auto want = ref::combine(s.pairs, Y.to_double_vector(), H_, mode == WeightMode::apply,
                                   [&](int64_t t, int64_t e) { return s.row(t, e); });
    EXPECT_TRUE(all_close(y, want, tol(), tol()));
  }

  void TestAdjoint() const {
    const uint64_t seed = seed_for("adjoint");
    SCOPED_TRACE("adjoint " + describe() + " " + repro(seed));
    std::mt19937_64 rng(seed);
    const Routed s = routed(rng);
    const Tensor x = randn({T_, H_}, dtype_, rng);
    const Tensor P = randn({s.plan.num_rows, H_}, dtype_, rng);
    const Tensor g = randn({T_, H_}, dtype_, rng);
    const double l1 = dot(permute(x, s.plan), P), r1 = dot(x, permute_backward(P, s.plan));
    EXPECT_NEAR(l1, r1, 1e-4 * (1 + std::fabs(l1))) << "<permute(x), P> = <x, permute_backward(P)>";
    const double l2 = dot(unpermute(P, s.plan), g);
    const double r2 = dot(P, unpermute_backward(g, P, s.plan).grad_permuted);
    EXPECT_NEAR(l2, r2, 1e-4 * (1 + std::fabs(l2))) << "<unpermute(P), g> = <P, grad_permuted>";
  }

  void TestBackward() const {
    const uint64_t seed = seed_for("backward");
    SCOPED_TRACE("unpermute_backward " + describe() + " " + repro(seed));
    std::mt19937_64 rng(seed);
    const Routed s = routed(rng);
    const Tensor Y = randn({s.plan.num_rows, H_}, dtype_, rng);
    const Tensor g = randn({T_, H_}, dtype_, rng);
    const UnpermuteGrads gr = unpermute_backward(g, Y, s.plan);
    const auto want_w = ref::grad_weights(s.pairs, Y.to_double_vector(), g.to_double_vector(), K_,
                                          H_, [&](int64_t t, int64_t e) { return s.row(t, e); });
    EXPECT_TRUE(all_close(gr.grad_topk_weights, want_w, 1e-5 * static_cast<double>(H_), 1e-5))
        << "grad_topk_weights";
    // grad_permuted[r] = w_r * g[token(r)]
    std::vector<double> want_p(static_cast<size_t>(s.plan.num_rows * H_));
    const auto gv = g.to_double_vector();
    const int64_t* rt = s.plan.row_token.data<int64_t>();
    const float* rw = s.plan.row_weight.data<float>();
    for (int64_t r = 0; r < s.plan.num_rows; ++r) {
      for (int64_t h = 0; h < H_; ++h) want_p[r * H_ + h] = rw[r] * gv[rt[r] * H_ + h];
    }
    EXPECT_TRUE(all_close(gr.grad_permuted, want_p, tol(), tol())) << "grad_permuted";
    const UnpermuteGrads gs = unpermute_backward(g, Tensor(), s.plan, {WeightMode::skip});
    EXPECT_TRUE(bitwise_equal(gs.grad_permuted, permute(g, s.plan))) << "skip: permute(g)";
  }

  int64_t T_ = 7, H_ = 19, E_ = 8, K_ = 2;
  DType dtype_ = DType::fp32;
  std::optional<uint64_t> seed_;
};

}  // namespace switchyard::testing
