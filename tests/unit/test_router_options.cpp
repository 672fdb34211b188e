// Megatron-Core TopKRouter options beyond the basic ones (issue 14): routing on bf16 logits and the
// options that follow, each against the double reference or its definition, with invariances.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "ref/router_ref.h"
#include "switchyard/router.h"
#include "testing.h"

namespace sy = switchyard;
using sy::AuxLossType;
using sy::DType;
using sy::RouterConfig;
using sy::ScoreFunction;
using sy::Tensor;
using sy::testing::all_close;
using sy::testing::bitwise_equal;

namespace {

RouterConfig cfg(int64_t E, int64_t K, ScoreFunction f, bool pre = false) {
  RouterConfig c;
  c.num_experts = E;
  c.top_k = K;
  c.score_function = f;
  c.pre_softmax = pre;
  return c;
}

// Rounds every element of an fp32 tensor to bf16 (nearest even) and back.
Tensor bf16_round(const Tensor& t) { return t.to(DType::bf16).to(DType::fp32); }

}  // namespace

// bf16 logits (Megatron's moe_router_dtype=None): the same routing as fp32 on the (exact) upcast
// logits, weights rounded to bf16 once, gradient computed in fp32 and rounded to bf16 once.
TEST(RouterOptions, Bf16LogitsRouteLikeTheirFp32Upcast) {
  std::mt19937_64 rng(sy::testing::test_seed(1421));
  struct C {
    ScoreFunction f;
    bool pre;
    int64_t groups;
  };
  for (const C& c : {C{ScoreFunction::softmax, false, 0}, C{ScoreFunction::softmax, true, 0},
                     C{ScoreFunction::sigmoid, false, 4}, C{ScoreFunction::sqrtsoftplus, false, 0}}) {
    RouterConfig rc = cfg(16, 4, c.f, c.pre);
    if (c.groups) {
      rc.num_groups = c.groups;
      rc.group_topk = 2;
    }
    rc.aux_loss_type = AuxLossType::aux_loss;
    rc.aux_loss_coeff = 0.01;
    rc.z_loss_coeff = 0.001;
    rc.capacity_factor = 1.0;
    SCOPED_TRACE(sy::score_function_name(c.f) + std::string(c.pre ? " pre" : ""));
    const int64_t T = 67;
    const Tensor z16 = sy::testing::randn({T, 16}, DType::bf16, rng, 2.0);
    const Tensor z32 = z16.to(DType::fp32);
    sy::RouteInputs in;
    in.expert_bias = sy::testing::randn({16}, DType::fp32, rng, 0.1);
    const auto r16 = sy::topk_route(z16, in, rc);
    RouterConfig nocap = rc;
    nocap.capacity_factor.reset();
    const auto r32 = sy::topk_route(z32, in, nocap);
    ASSERT_EQ(r16.topk_weights.dtype(), DType::bf16);
    EXPECT_TRUE(bitwise_equal(r16.selected_idx, r32.selected_idx));
    // Capacity sorts the bf16 weights: kept slots carry exactly bf16(fp32 weight).
    const Tensor w32r = bf16_round(r32.topk_weights);
    for (int64_t i = 0; i < T * 4; ++i) {
      if (r16.topk_idx.data<int32_t>()[i] < 0) continue;
      ASSERT_EQ(r16.topk_weights.item_as_double(i), w32r.item_as_double(i)) << "at " << i;
    }
    EXPECT_EQ(r16.aux_loss, r32.aux_loss);
    EXPECT_EQ(r16.z_loss, r32.z_loss);
    // Backward (no capacity, so both runs keep every slot): bf16 of the fp32 gradient.
    Tensor gw = sy::testing::randn({T, 4}, DType::bf16, rng);
    const auto r16n = sy::topk_route(z16, in, nocap);
    const Tensor g16 = sy::topk_route_backward(gw, r16n, nocap).grad_logits;
    ASSERT_EQ(g16.dtype(), DType::bf16);
    const Tensor g32 = sy::topk_route_backward(gw.to(DType::fp32), r32, nocap).grad_logits;
    EXPECT_TRUE(bitwise_equal(g16, g32.to(DType::bf16)));
  }
}

// Input jitter: x * u with u in [1-eps, 1+eps), a function of (seed, index) only; backward is the
// same multiplication; eps = 0 is the identity.
TEST(RouterOptions, InputJitterIsSeededAndItsBackwardIsExact) {
  std::mt19937_64 rng(sy::testing::test_seed(1422));
  const Tensor x = sy::testing::randn({33, 40}, DType::fp64, rng);
  const double eps = 0.05;
  const Tensor a = sy::input_jitter(x, eps, 7), b = sy::input_jitter(x, eps, 7);
  const Tensor c = sy::input_jitter(x, eps, 8);
  EXPECT_TRUE(bitwise_equal(a, b));
  EXPECT_FALSE(bitwise_equal(a, c));
  double mean = 0, lo = 2, hi = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double u = a.data<double>()[i] / x.data<double>()[i];
    mean += u / static_cast<double>(x.numel());
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  EXPECT_GE(lo, 1 - eps);
  EXPECT_LT(hi, 1 + eps);
  EXPECT_NEAR(mean, 1.0, 3 * eps / std::sqrt(3.0 * static_cast<double>(x.numel())));
  EXPECT_GT(hi - lo, eps);  // the noise spans most of the interval
  // Backward is grad * u: <jitter(x), g> == <x, jitter_backward(g)> (adjoint, exact in fp64 up
  // to summation order).
  const Tensor g = sy::testing::randn({33, 40}, DType::fp64, rng);
  const Tensor gb = sy::input_jitter_backward(g, eps, 7);
  double l = 0, r = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    l += a.data<double>()[i] * g.data<double>()[i];
    r += x.data<double>()[i] * gb.data<double>()[i];
  }
  EXPECT_NEAR(l, r, 1e-12 * std::fabs(l));
  EXPECT_TRUE(bitwise_equal(sy::input_jitter(x, 0.0, 7), x));
  // fp32 and bf16: the same u, rounded once.
  const Tensor x32 = x.to(DType::fp32);
  const Tensor j32 = sy::input_jitter(x32, eps, 7);
  EXPECT_TRUE(all_close(j32, a.to_double_vector(), 1e-6, 1e-6));
  const Tensor j16 = sy::input_jitter(x32.to(DType::bf16), eps, 7);
  EXPECT_EQ(j16.dtype(), DType::bf16);
  SY_EXPECT_THROW_MSG(sy::input_jitter(x, 1.5, 7), std::invalid_argument,
                      "[input_jitter] eps must be in [0, 1), got 1.5");
}
