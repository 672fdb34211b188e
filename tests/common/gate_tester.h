// GateTester: the router gate (router_gating_linear and its backward) for one shape and dtype
// combination, built fluently:
//
//   GateTester().tokens(1031).hidden(2048).experts(128).x(DType::bf16).weight(DType::bf16)
//       .router(DType::fp32).bias(DType::fp32).TestForward();
//
// TestForward / TestBackward: bit for bit the promised reduction order (tests/ref/gate_ref.h chain
// references) and within the rigorous rounding bound of the double reference.
// TestBatchInvariance: a probe token's logits are the same bits alone and at any position among
// any other tokens, for T in {1, 7, 1031, 4096} and 1 or 2 threads.
// TestAdjoint: <x·Wᵀ, G> = <x, G·W> = <W, Gᵀ·x>.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ref/gate_ref.h"
#include "router_tester.h"
#include "switchyard/cpu.h"
#include "switchyard/gate.h"
#include "testing.h"

namespace switchyard::testing {

constexpr double kUnitRoundoffFp32 = 0x1p-24;
constexpr double kUnitRoundoffFp64 = 0x1p-53;
constexpr double kUnitRoundoffBf16 = 0x1p-8;

inline double unit_roundoff(DType d) {
  return d == DType::fp64   ? kUnitRoundoffFp64
         : d == DType::fp32 ? kUnitRoundoffFp32
                            : kUnitRoundoffBf16;
}

/// Rigorous bound for an n-term chain in unit roundoff u, then one rounding (u_out) to the output
/// dtype: |got - ref| <= gamma_n·Σ|terms| + u_out·(|ref| + gamma_n·Σ|terms|).
inline ::testing::AssertionResult within_bound(const Tensor& got, const ref::GateRefOut& want,
                                               int64_t n_terms, double u, double u_out) {
  if (got.numel() != static_cast<int64_t>(want.value.size())) {
    return ::testing::AssertionFailure() << "numel " << got.numel() << " != " << want.value.size();
  }
  const double nu = static_cast<double>(n_terms) * u;
  const double gamma = nu / (1 - nu);
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.item_as_double(i), w = want.value[i], a = want.abs_sum[i];
    const double acc_err = gamma * a;
    const double bound = acc_err + u_out * (std::fabs(w) + acc_err) + 1e-300;
    if (!(std::fabs(g - w) <= bound)) {
      return ::testing::AssertionFailure()
             << "at " << coord(got.shape(), i) << ": got " << g << ", want " << w << " (|diff| "
             << std::fabs(g - w) << " > bound " << bound << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

/// Keeps k random entries of each row of g [T, E] (distinct columns) and zeroes the others: the
/// grad_logits of top-k routing without aux or z loss.
inline void keep_k_per_row(Tensor& g, int64_t k, std::mt19937_64& rng) {
  const int64_t T = g.size(0), E = g.size(1);
  std::vector<int64_t> cols(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(cols.begin(), cols.end(), 0);
    std::shuffle(cols.begin(), cols.end(), rng);
    for (int64_t j = std::min(k, E); j < E; ++j) {
      const int64_t i = t * E + cols[static_cast<size_t>(j)];
      if (g.dtype() == DType::fp64) {
        g.data<double>()[i] = 0.0;
      } else {
        g.data<float>()[i] = 0.0f;
      }
    }
  }
}

class GateTester {
 public:
  GateTester& tokens(int64_t T) { return T_ = T, *this; }
  GateTester& hidden(int64_t H) { return H_ = H, *this; }
  GateTester& experts(int64_t E) { return E_ = E, *this; }
  GateTester& x(DType d) { return x_ = d, *this; }
  GateTester& weight(DType d) { return w_ = d, *this; }
  GateTester& router(DType d) { return router_ = d, *this; }
  /// A random N(0, 0.5) bias of this dtype.
  GateTester& bias(DType d) { return bias_ = d, *this; }
  GateTester& no_bias() { return bias_.reset(), *this; }
  /// Backward: grad_logits keeps k random entries per row (distinct experts) and is zero elsewhere,
  /// as after top-k routing without aux or z loss; 0 = dense.
  GateTester& grad_logits_topk(int64_t k) { return grad_topk_ = k, *this; }
  GateTester& seed(uint64_t s) { return seed_ = s, *this; }
  /// TestForward / TestBackward run with this many threads (0: the current setting).
  GateTester& threads(int n) { return threads_ = n, *this; }

  std::string describe() const {
    return "T=" + std::to_string(T_) + " H=" + std::to_string(H_) + " E=" + std::to_string(E_) +
           " x=" + dtype_name(x_) + " w=" + dtype_name(w_) + " router=" + dtype_name(router_) +
           (bias_ ? std::string(" bias=") + dtype_name(*bias_) : std::string(" no bias")) +
           (grad_topk_ > 0 ? " grad_logits " + std::to_string(grad_topk_) + "-hot"
                           : std::string()) +
           (threads_ > 0 ? " threads=" + std::to_string(threads_) : std::string());
  }

  void TestForward() const {
    const uint64_t seed = seed_for("forward");
    SCOPED_TRACE(describe() + " " + repro(seed));
    const ThreadGuard guard;
    if (threads_ > 0) set_num_threads(threads_);
    std::mt19937_64 rng(seed);
    const Inputs in = make_inputs(rng);
    const Tensor out = router_gating_linear(in.x, in.w, in.b, GateOptions{router_});
    ASSERT_EQ(out.dtype(), router_);
    ASSERT_EQ(out.shape(), (Shape{T_, E_}));
    EXPECT_TRUE(bitwise_equal(out, router_ == DType::fp64
                                       ? ref::gate_forward_chain<double>(in.x, in.w, in.b)
                                       : ref::gate_forward_chain<float>(in.x, in.w, in.b)));
    const auto want = ref::gate_forward_ref(in.x, in.w, in.b);
    EXPECT_TRUE(within_bound(out, want, H_ + 1, unit_roundoff(router_), 0));
  }

  void TestBackward() const {
    const uint64_t seed = seed_for("backward");
    SCOPED_TRACE(describe() + " " + repro(seed));
    const ThreadGuard guard;
    if (threads_ > 0) set_num_threads(threads_);
    std::mt19937_64 rng(seed);
    const Inputs in = make_inputs(rng);
    Tensor g = randn({T_, E_}, router_, rng);
    if (grad_topk_ > 0) keep_k_per_row(g, grad_topk_, rng);
    const GateGrads gr = router_gating_linear_backward(g, in.x, in.w, in.b, GateOptions{router_});
    ASSERT_EQ(gr.grad_x.dtype(), x_);
    ASSERT_EQ(gr.grad_x.shape(), in.x.shape());
    ASSERT_EQ(gr.grad_weight.dtype(), w_);
    ASSERT_EQ(gr.grad_weight.shape(), in.w.shape());
    ASSERT_EQ(gr.grad_bias.defined(), bias_.has_value());
    Tensor cx, cw, cb;
    if (router_ == DType::fp64) {
      ref::gate_backward_chain<double>(g, in.x, in.w, &cx, &cw, &cb);
    } else {
      ref::gate_backward_chain<float>(g, in.x, in.w, &cx, &cw, &cb);
    }
    EXPECT_TRUE(bitwise_equal(gr.grad_x, cx)) << "grad_x";
    EXPECT_TRUE(bitwise_equal(gr.grad_weight, cw)) << "grad_weight";
    const auto want = ref::gate_backward_ref(g, in.x, in.w);
    const double u = unit_roundoff(router_);
    EXPECT_TRUE(within_bound(gr.grad_x, want.grad_x, E_, u, x_ == router_ ? 0 : unit_roundoff(x_)))
        << "grad_x";
    EXPECT_TRUE(
        within_bound(gr.grad_weight, want.grad_w, T_, u, w_ == router_ ? 0 : unit_roundoff(w_)))
        << "grad_weight";
    if (bias_) {
      ASSERT_EQ(gr.grad_bias.dtype(), router_);
      ASSERT_EQ(gr.grad_bias.shape(), (Shape{E_}));
      EXPECT_TRUE(bitwise_equal(gr.grad_bias, cb)) << "grad_bias";
      EXPECT_TRUE(within_bound(gr.grad_bias, want.grad_b, T_, u, 0)) << "grad_bias";
    }
  }

  /// Ignores tokens(): the probe sits among T in {1, 7, 1031, 4096} tokens (1031 left out at
  /// H >= 2048 to keep the run short), at positions 0, T/2, T-1 and 6.
  void TestBatchInvariance() const {
    const uint64_t seed = seed_for("batch");
    SCOPED_TRACE(describe() + " " + repro(seed));
    std::mt19937_64 rng(seed);
    const ThreadGuard guard;
    const GateOptions opt{router_};
    const Tensor w = randn({E_, H_}, w_, rng, 0.05);
    const Tensor b = bias_ ? randn({E_}, *bias_, rng) : Tensor();
    const Tensor probe = randn({1, H_}, x_, rng);
    set_num_threads(1);
    const Tensor alone = router_gating_linear(probe, w, b, opt);
    const size_t xs = dtype_size(x_), ls = dtype_size(router_);
    for (int64_t T : {1, 7, 1031, 4096}) {
      if (H_ >= 2048 && T == 1031) continue;
      Tensor x = randn({T, H_}, x_, rng);
      for (int64_t pos : {int64_t{0}, T / 2, T - 1, T > 6 ? int64_t{6} : T - 1}) {
        std::memcpy(static_cast<char*>(x.raw()) + pos * H_ * xs, probe.raw(), H_ * xs);
        for (int threads : {1, 2}) {
          set_num_threads(threads);
          const Tensor out = router_gating_linear(x, w, b, opt);
          const Tensor row = Tensor::borrow(
              static_cast<char*>(const_cast<void*>(out.raw())) + pos * E_ * ls, {1, E_}, router_);
          EXPECT_TRUE(bitwise_equal(row, alone))
              << "T=" << T << " pos=" << pos << " threads=" << threads;
        }
        x = randn({T, H_}, x_, rng);  // different neighbours for the next position
      }
    }
  }

  /// Without bias; x and W as given (not bf16: the identity is checked in the router dtype).
  void TestAdjoint() const {
    const uint64_t seed = seed_for("adjoint");
    SCOPED_TRACE(describe() + " " + repro(seed));
    std::mt19937_64 rng(seed);
    const Tensor x = randn({T_, H_}, x_, rng), w = randn({E_, H_}, w_, rng);
    const Tensor g = randn({T_, E_}, router_, rng);
    const GateOptions opt{router_};
    const Tensor z = router_gating_linear(x, w, Tensor(), opt);
    const GateGrads gr = router_gating_linear_backward(g, x, w, Tensor(), opt);
    double lhs = 0, mid = 0, rhs = 0, scale = 0, scale_w = 0;
    for (int64_t i = 0; i < T_ * E_; ++i) {
      lhs += z.item_as_double(i) * g.item_as_double(i);
      scale += std::fabs(z.item_as_double(i) * g.item_as_double(i));
    }
    for (int64_t i = 0; i < T_ * H_; ++i) mid += x.item_as_double(i) * gr.grad_x.item_as_double(i);
    for (int64_t i = 0; i < E_ * H_; ++i) {
      rhs += w.item_as_double(i) * gr.grad_weight.item_as_double(i);
      scale_w += std::fabs(w.item_as_double(i) * gr.grad_weight.item_as_double(i));
    }
    const double tol = (router_ == DType::fp64 ? 1e-12 : 1e-5) * (scale + 1);
    EXPECT_NEAR(lhs, mid, tol);
    // grad_weight is rounded once to the weight's dtype: allow that rounding too.
    EXPECT_NEAR(lhs, rhs, tol + unit_roundoff(w_) * scale_w);
  }

 private:
  struct Inputs {
    Tensor x, w, b;
  };

  uint64_t seed_for(const char* what) const {
    return test_seed(seed_ ? *seed_ : seed_of(std::string(what) + " " + describe()));
  }

  Inputs make_inputs(std::mt19937_64& rng) const {
    Inputs in;
    in.x = randn({T_, H_}, x_, rng);
    in.w = randn({E_, H_}, w_, rng, 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(H_, 1))));
    if (bias_) in.b = randn({E_}, *bias_, rng, 0.5);
    return in;
  }

  int64_t T_ = 37, H_ = 300, E_ = 19;
  DType x_ = DType::bf16, w_ = DType::bf16, router_ = DType::fp32;
  std::optional<DType> bias_ = DType::fp32;
  int64_t grad_topk_ = 0;
  int threads_ = 0;
  std::optional<uint64_t> seed_;
};

}  // namespace switchyard::testing
