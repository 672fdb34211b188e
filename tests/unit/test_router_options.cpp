// Megatron-Core TopKRouter options beyond the basic ones (issue 14): routing on bf16 logits and the
// options that follow, each against the double reference or its definition, with invariances.
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

// Rounds every element of an fp32 tensor to bf16 (nearest even) and back.
Tensor bf16_round(const Tensor& t) { return t.to(DType::bf16).to(DType::fp32); }

// bf16 logits (Megatron's moe_router_dtype=None): the same routing as fp32 on the (exact) upcast
// logits, weights rounded to bf16 once, gradient computed in fp32 and rounded to bf16 once.
// E 16, K 4, capacity 1, aux and z losses, an expert bias; groups 4/2 when given.
void bf16_logits_route_like_fp32(ScoreFunction f, bool pre, int64_t groups) {
  RouterConfig rc = router_config(16, 4, f, pre);
  if (groups) {
    rc.num_groups = groups;
    rc.group_topk = 2;
  }
  rc.aux_loss_type = AuxLossType::aux_loss;
  rc.aux_loss_coeff = 0.01;
  rc.z_loss_coeff = 0.001;
  rc.capacity_factor = 1.0;
  const std::string name =
      sy::score_function_name(f) + std::string(pre ? " pre" : "") + (groups ? " groups" : "");
  const uint64_t seed = sy::testing::test_seed(sy::testing::seed_of("bf16 " + name));
  SCOPED_TRACE(name + " " + sy::testing::repro(seed));
  std::mt19937_64 rng(seed);
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
  // The same selection before capacity: without capacity both keep every slot.
  EXPECT_TRUE(bitwise_equal(sy::topk_route(z16, in, nocap).topk_idx, r32.topk_idx));
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
  const Tensor g16 = sy::topk_route_backward(gw, r16n).grad_logits;
  ASSERT_EQ(g16.dtype(), DType::bf16);
  const Tensor g32 = sy::topk_route_backward(gw.to(DType::fp32), r32).grad_logits;
  EXPECT_TRUE(bitwise_equal(g16, g32.to(DType::bf16)));
}

}  // namespace

TEST(RouterBf16Logits, SoftmaxRoutesLikeItsFp32Upcast) {
  bf16_logits_route_like_fp32(ScoreFunction::softmax, false, 0);
}
TEST(RouterBf16Logits, PreSoftmaxRoutesLikeItsFp32Upcast) {
  bf16_logits_route_like_fp32(ScoreFunction::softmax, true, 0);
}
TEST(RouterBf16Logits, GroupLimitedSigmoidRoutesLikeItsFp32Upcast) {
  bf16_logits_route_like_fp32(ScoreFunction::sigmoid, false, 4);
}
TEST(RouterBf16Logits, SqrtSoftplusRoutesLikeItsFp32Upcast) {
  bf16_logits_route_like_fp32(ScoreFunction::sqrtsoftplus, false, 0);
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

namespace {

// Routes z with cfg (fresh global state with 2 accumulated steps of 3 tokens per expert), returns
// the result and grad_logits of <gw, weights> + losses.
struct Routed {
  sy::RouteResult r;
  Tensor grad;
};

Routed route_with_grad(const Tensor& z, const Tensor& gw, const RouterConfig& c, const Tensor& mask,
                       int64_t seq_length) {
  sy::GlobalAuxLossState g;
  g.num_tokens_per_expert = Tensor::full({c.num_experts}, DType::fp64, 3.0);
  g.steps = 2;
  sy::RouteInputs in;
  in.global_aux_loss_state = &g;
  in.padding_mask = mask;
  sy::RouteOptions opt;
  opt.seq_length = seq_length;
  Routed out{sy::topk_route(z, in, c, opt), Tensor()};
  out.grad = sy::topk_route_backward(gw, out.r).grad_logits;
  return out;
}

}  // namespace

// Several load-balancing types at once (Megatron's list form): the sum of each type alone, in
// value and gradient, and central finite differences of the whole objective.
TEST(RouterOptions, SeveralLoadBalancingLossesAddUp) {
  std::mt19937_64 rng(sy::testing::test_seed(1423));
  const int64_t T = 12, E = 8, K = 2;
  for (ScoreFunction f : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    SCOPED_TRACE(sy::score_function_name(f));
    RouterConfig all = router_config(E, K, f);
    all.aux_loss_types = {AuxLossType::seq_aux_loss, AuxLossType::aux_loss,
                          AuxLossType::global_aux_loss};
    all.aux_loss_coeffs = {0.3, 0.5, 0.7};
    all.z_loss_coeff = 0.1;
    const Tensor z = sy::testing::randn({T, E}, DType::fp64, rng, 1.5);
    const Tensor gw = sy::testing::randn({T, K}, DType::fp64, rng);
    Tensor mask = Tensor::zeros({T}, DType::boolean);
    mask.data<bool>()[5] = true;
    const Routed a = route_with_grad(z, gw, all, mask, 4);
    double sum = 0;
    std::vector<double> gsum(static_cast<size_t>(T * E), 0.0);
    const double coeffs[] = {0.5, 0.3, 0.7};
    const AuxLossType types[] = {AuxLossType::aux_loss, AuxLossType::seq_aux_loss,
                                 AuxLossType::global_aux_loss};
    const double* parts[] = {&a.r.aux_loss_parts.aux_loss, &a.r.aux_loss_parts.seq_aux_loss,
                             &a.r.aux_loss_parts.global_aux_loss};
    const Tensor zero_gw = Tensor::zeros({T, K}, DType::fp64);
    for (int i = 0; i < 3; ++i) {
      RouterConfig one = router_config(E, K, f);
      one.aux_loss_type = types[i];
      one.aux_loss_coeff = coeffs[i];
      const Routed o = route_with_grad(z, zero_gw, one, mask, 4);
      EXPECT_NEAR(*parts[i], o.r.aux_loss, 1e-14 * std::fabs(o.r.aux_loss)) << i;
      EXPECT_GT(o.r.aux_loss, 0.0);
      sum += o.r.aux_loss;
      for (int64_t j = 0; j < T * E; ++j) gsum[j] += o.grad.data<double>()[j];
    }
    RouterConfig rest = router_config(E, K, f);
    rest.z_loss_coeff = 0.1;
    const Routed w = route_with_grad(z, gw, rest, mask, 4);
    for (int64_t j = 0; j < T * E; ++j) gsum[j] += w.grad.data<double>()[j];
    EXPECT_NEAR(a.r.aux_loss, sum, 1e-14 * sum);
    EXPECT_TRUE(all_close(a.grad, gsum, 1e-14, 1e-12));
    // Finite differences of <gw, w> + aux + z.
    const double h = 1e-6;
    std::vector<double> fd(static_cast<size_t>(T * E));
    auto obj = [&](const sy::RouteResult& r) {
      double L = r.aux_loss + r.z_loss;
      for (int64_t j = 0; j < T * K; ++j)
        L += gw.data<double>()[j] * r.topk_weights.data<double>()[j];
      return L;
    };
    for (int64_t j = 0; j < T * E; ++j) {
      Tensor zp = z.clone(), zm = z.clone();
      zp.data<double>()[j] += h;
      zm.data<double>()[j] -= h;
      const Routed p = route_with_grad(zp, gw, all, mask, 4),
                   m = route_with_grad(zm, gw, all, mask, 4);
      ASSERT_TRUE(bitwise_equal(p.r.topk_idx, a.r.topk_idx));
      ASSERT_TRUE(bitwise_equal(m.r.topk_idx, a.r.topk_idx));
      fd[j] = (obj(p.r) - obj(m.r)) / (2 * h);
    }
    EXPECT_TRUE(all_close(a.grad, fd, 1e-7, 1e-6));
  }
  RouterConfig bad = router_config(E, K, ScoreFunction::softmax);
  bad.aux_loss_types = {AuxLossType::aux_loss, AuxLossType::aux_loss};
  bad.aux_loss_coeffs = {0.1, 0.2};
  SY_EXPECT_THROW_MSG(sy::validate_router_config(bad), std::invalid_argument,
                      "[route] aux_loss_types lists aux_loss twice");
  bad.aux_loss_types = {AuxLossType::aux_loss};
  SY_EXPECT_THROW_MSG(sy::validate_router_config(bad), std::invalid_argument,
                      "[route] aux_loss_coeffs must have one coefficient per aux_loss_types "
                      "entry (1), got 2");
}

// calculate_per_token_loss multiplies the loss gradients by the valid-token count (values stay);
// an MTP layer run mtp_num_layers times divides its load-balancing losses (value and gradient) and
// its z-loss value (Megatron's logged value), not the z-loss gradient.
TEST(RouterOptions, PerTokenLossAndMtpScaling) {
  std::mt19937_64 rng(sy::testing::test_seed(1424));
  const int64_t T = 16, E = 8, K = 2;
  RouterConfig base = router_config(E, K, ScoreFunction::sigmoid);
  base.aux_loss_types = {AuxLossType::aux_loss, AuxLossType::global_aux_loss};
  base.aux_loss_coeffs = {0.3, 0.2};
  const Tensor z = sy::testing::randn({T, E}, DType::fp64, rng);
  Tensor mask = Tensor::zeros({T}, DType::boolean);
  mask.data<bool>()[3] = mask.data<bool>()[9] = true;  // 14 valid tokens
  const Tensor none;
  RouterConfig zonly = router_config(E, K, ScoreFunction::sigmoid);
  zonly.z_loss_coeff = 0.05;
  for (const RouterConfig* c0 : {&base, &zonly}) {
    RouterConfig pt = *c0;
    pt.calculate_per_token_loss = true;
    const Routed a = route_with_grad(z, none, *c0, mask, 0);
    const Routed b = route_with_grad(z, none, pt, mask, 0);
    EXPECT_EQ(a.r.aux_loss, b.r.aux_loss);
    EXPECT_EQ(a.r.z_loss, b.r.z_loss);
    std::vector<double> want = a.grad.to_double_vector();
    for (double& v : want) v *= 14.0;
    EXPECT_TRUE(all_close(b.grad, want, 1e-15, 1e-13));
    RouterConfig mtp = *c0;
    mtp.is_mtp_layer = true;
    mtp.mtp_use_repeated_layer = true;
    mtp.mtp_num_layers = 4;
    const Routed m = route_with_grad(z, none, mtp, mask, 0);
    EXPECT_NEAR(m.r.aux_loss, a.r.aux_loss / 4, 1e-15);
    EXPECT_EQ(m.r.z_loss, a.r.z_loss / 4);
    if (c0 == &base) {
      want = a.grad.to_double_vector();
      for (double& v : want) v /= 4.0;
      EXPECT_TRUE(all_close(m.grad, want, 1e-16, 1e-13));
    } else {
      EXPECT_TRUE(bitwise_equal(m.grad, a.grad));
    }
    mtp.mtp_use_repeated_layer = false;  // Megatron scales only the repeated layer
    EXPECT_EQ(route_with_grad(z, none, mtp, mask, 0).r.aux_loss, a.r.aux_loss);
  }
}

// Eval (training=false, Megatron's `self.training` False) computes no loss: values 0, the
// gradient of the weights alone (as a route without losses), the global aux-loss state untouched;
// ids and weights are the training route's.
TEST(RouterOptions, EvalComputesNoLoss) {
  std::mt19937_64 rng(sy::testing::test_seed(1426));
  const int64_t T = 12, E = 8, K = 2;
  RouterConfig c = router_config(E, K, ScoreFunction::softmax);
  c.aux_loss_types = {AuxLossType::aux_loss, AuxLossType::seq_aux_loss,
                      AuxLossType::global_aux_loss};
  c.aux_loss_coeffs = {0.1, 0.2, 0.3};
  c.z_loss_coeff = 0.05;
  const Tensor z = sy::testing::randn({T, E}, DType::fp64, rng);
  const Tensor gw = sy::testing::randn({T, K}, DType::fp64, rng);
  sy::GlobalAuxLossState g;
  sy::RouteInputs in;
  in.global_aux_loss_state = &g;
  sy::RouteOptions opt;
  opt.seq_length = 4;
  const auto tr = sy::topk_route(z, in, c, opt);
  ASSERT_EQ(g.steps, 1);
  EXPECT_GT(tr.aux_loss, 0.0);
  EXPECT_GT(tr.z_loss, 0.0);
  const std::vector<double> counts = g.num_tokens_per_expert.to_double_vector();
  opt.training = false;
  const auto ev = sy::topk_route(z, in, c, opt);
  EXPECT_EQ(g.steps, 1);
  EXPECT_EQ(g.num_tokens_per_expert.to_double_vector(), counts);
  EXPECT_EQ(ev.aux_loss, 0.0);
  EXPECT_EQ(ev.aux_loss_parts.aux_loss + ev.aux_loss_parts.seq_aux_loss +
                ev.aux_loss_parts.global_aux_loss,
            0.0);
  EXPECT_EQ(ev.z_loss, 0.0);
  EXPECT_TRUE(bitwise_equal(ev.topk_idx, tr.topk_idx));
  EXPECT_TRUE(bitwise_equal(ev.topk_weights, tr.topk_weights));
  const auto plain = sy::topk_route(z, {}, router_config(E, K, ScoreFunction::softmax));
  EXPECT_TRUE(bitwise_equal(sy::topk_route_backward(gw, ev).grad_logits,
                            sy::topk_route_backward(gw, plain).grad_logits));
  EXPECT_FALSE(bitwise_equal(sy::topk_route_backward(gw, tr).grad_logits,
                             sy::topk_route_backward(gw, plain).grad_logits));
}

// force_load_balancing / force_biased (benchmarking): routing ignores the given logits' values
// (N(0,1) logits from the seed, plus a per-expert N(0,|std|) bias), the gradient passes straight
// through, loads come out balanced (or biased), replay keeps its ids.
TEST(RouterOptions, ForceLoadBalancingAndForcedBias) {
  std::mt19937_64 rng(sy::testing::test_seed(1425));
  const int64_t T = 4096, E = 16, K = 2;
  RouterConfig c = router_config(E, K, ScoreFunction::softmax);
  c.force_load_balancing = true;
  sy::RouteOptions opt;
  opt.force_seed = 11;
  const Tensor za = sy::testing::randn({T, E}, DType::fp32, rng, 5.0);
  Tensor zb = Tensor::zeros({T, E}, DType::fp32);
  for (int64_t t = 0; t < T; ++t) zb.data<float>()[t * E] = 100.0f;  // all to expert 0 if used
  const auto a = sy::topk_route(za, {}, c, opt), b = sy::topk_route(zb, {}, c, opt);
  EXPECT_TRUE(bitwise_equal(a.topk_idx, b.topk_idx));
  EXPECT_TRUE(bitwise_equal(a.topk_weights, b.topk_weights));
  const Tensor a_logits = sy::forced_router_logits(za, c, opt);
  double mean = 0, sq = 0;
  for (int64_t i = 0; i < T * E; ++i) {
    const double v = a_logits.item_as_double(i);
    mean += v / (T * E);
    sq += v * v / (T * E);
  }
  EXPECT_NEAR(mean, 0.0, 0.02);
  EXPECT_NEAR(std::sqrt(sq - mean * mean), 1.0, 0.02);
  for (int64_t e = 0; e < E; ++e) {  // T*K/E = 512 per expert; 5 sigma of a multinomial
    EXPECT_NEAR(a.num_tokens_per_expert.data<int64_t>()[e], 512, 5 * std::sqrt(512.0)) << e;
  }
  sy::RouteOptions opt2 = opt;
  opt2.force_seed = 12;
  EXPECT_FALSE(bitwise_equal(a.topk_idx, sy::topk_route(za, {}, c, opt2).topk_idx));
  // Straight-through: the gradient is the routing's gradient at the random logits.
  const Tensor gw = sy::testing::randn({T, K}, DType::fp32, rng);
  RouterConfig plain = router_config(E, K, ScoreFunction::softmax);
  const auto at = sy::topk_route(a_logits, {}, plain);
  EXPECT_TRUE(bitwise_equal(at.topk_idx, a.topk_idx));
  EXPECT_TRUE(bitwise_equal(sy::topk_route_backward(gw, a).grad_logits,
                            sy::topk_route_backward(gw, at).grad_logits));
  // Forced bias: per-expert shift with std |force_biased|, the same for the same bias seed.
  RouterConfig fb = c;
  fb.force_load_balancing = false;
  fb.force_biased = -3.0;
  opt.force_bias_seed = 99;
  const Tensor f1_logits = sy::forced_router_logits(za, fb, opt);
  opt.force_seed = 13;
  const Tensor f2_logits = sy::forced_router_logits(za, fb, opt);
  std::vector<double> m1(E, 0.0), m2(E, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      m1[e] += f1_logits.item_as_double(t * E + e) / T;
      m2[e] += f2_logits.item_as_double(t * E + e) / T;
    }
  }
  double spread = 0;
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_NEAR(m1[e], m2[e], 0.1) << e;  // same bias, fresh noise
    spread += m1[e] * m1[e] / E;
  }
  EXPECT_GT(std::sqrt(spread), 1.0);  // |std| = 3: clearly biased
  // Replay keeps its ids under forced routing.
  sy::RouteInputs in;
  in.replay_idx = Tensor::full({T, K}, DType::int32, -1);
  in.replay_idx.data<int32_t>()[0] = 5;
  in.replay_idx.data<int32_t>()[1] = 3;
  const auto rr = sy::topk_route(za, in, c, opt);
  EXPECT_EQ(rr.topk_idx.data<int32_t>()[0], 5);
  EXPECT_EQ(rr.topk_idx.data<int32_t>()[1], 3);
  EXPECT_EQ(rr.num_replayed_rows, 1);
}

namespace {

// Sinkhorn in double from its definition (Megatron's loop), top-k of each row (ties: lower id).
std::vector<double> ref_sinkhorn_ids(const std::vector<double>& z, int64_t T, int64_t E,
                                     int64_t K) {
  std::vector<double> c(z.size());
  for (size_t i = 0; i < z.size(); ++i) c[i] = std::exp(z[i]);
  std::vector<double> d0(T, 1.0), d1(E, 1.0), d1o(E, 1.0);
  double err = 1e9;
  while (err > 1e-4) {
    for (int64_t t = 0; t < T; ++t) {
      double s = 0;
      for (int64_t e = 0; e < E; ++e) s += d1[e] * c[t * E + e];
      d0[t] = 1.0 / T / (s + 1e-8);
    }
    err = 0;
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t t = 0; t < T; ++t) s += d0[t] * c[t * E + e];
      d1[e] = 1.0 / E / (s + 1e-8);
      err += std::fabs(d1o[e] - d1[e]) / E;
    }
    d1o = d1;
  }
  std::vector<double> ids;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> row(E);
    for (int64_t e = 0; e < E; ++e) row[e] = d1[e] * c[t * E + e] * d0[t];
    for (int32_t e : sy::ref::topk_ids(row, K)) ids.push_back(e);
  }
  return ids;
}

}  // namespace

// Sinkhorn routing: training selects on the normalised batch, eval on the logits; weights are
// sigmoid (K = 1) or softmax over all E (K > 1) at the ids; gradients by finite differences;
// replayed rows keep their ids.
TEST(RouterOptions, SinkhornRouting) {
  std::mt19937_64 rng(sy::testing::test_seed(1426));
  for (int64_t K : {1, 2}) {
    SCOPED_TRACE("K=" + std::to_string(K));
    const int64_t T = 24, E = 8;
    RouterConfig c = router_config(E, K, ScoreFunction::softmax);
    c.aux_loss_type = AuxLossType::sinkhorn;
    // Skewed logits, so balancing changes choices: expert 0 is everyone's favourite.
    Tensor z = sy::testing::randn({T, E}, DType::fp64, rng);
    for (int64_t t = 0; t < T; ++t) z.data<double>()[t * E] += 2.0;
    const auto r = sy::topk_route(z, {}, c);
    const std::vector<double> want = ref_sinkhorn_ids(z.to_double_vector(), T, E, K);
    EXPECT_TRUE(all_close(r.topk_idx, want, 0, 0));
    EXPECT_LT(r.num_tokens_per_expert.data<int64_t>()[0], T);  // balancing took some away
    EXPECT_EQ(r.num_native_rows, T);
    // Weights: the activation at the ids.
    std::vector<double> w;
    const std::vector<double> zd = z.to_double_vector();
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> row(zd.begin() + t * E, zd.begin() + (t + 1) * E);
      const std::vector<double> p = sy::ref::softmax(row);
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = r.topk_idx.data<int32_t>()[t * K + k];
        w.push_back(K == 1 ? sy::ref::sigmoid(row[e]) : p[e]);
      }
    }
    EXPECT_TRUE(all_close(r.topk_weights, w, 1e-14, 1e-12));
    // Eval: the plain top-k of the logits.
    sy::RouteOptions ev;
    ev.training = false;
    const auto re = sy::topk_route(z, {}, c, ev);
    std::vector<double> plain;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> row(zd.begin() + t * E, zd.begin() + (t + 1) * E);
      for (int32_t e : sy::ref::topk_ids(row, K)) plain.push_back(e);
    }
    EXPECT_TRUE(all_close(re.topk_idx, plain, 0, 0));
    // Gradient of <gw, w> against central differences (ids frozen by the step size).
    const Tensor gw = sy::testing::randn({T, K}, DType::fp64, rng);
    const Tensor g = sy::topk_route_backward(gw, r).grad_logits;
    for (int64_t i = 0; i < T * E; i += 7) {
      Tensor zp = z.clone(), zm = z.clone();
      zp.data<double>()[i] += 1e-6;
      zm.data<double>()[i] -= 1e-6;
      const auto rp = sy::topk_route(zp, {}, c), rm = sy::topk_route(zm, {}, c);
      ASSERT_TRUE(bitwise_equal(rp.topk_idx, r.topk_idx));
      double lp = 0, lm = 0;
      for (int64_t j = 0; j < T * K; ++j) {
        lp += gw.data<double>()[j] * rp.topk_weights.data<double>()[j];
        lm += gw.data<double>()[j] * rm.topk_weights.data<double>()[j];
      }
      EXPECT_NEAR(g.data<double>()[i], (lp - lm) / 2e-6, 1e-6) << i;
    }
    // Replay under sinkhorn: replayed rows keep the given ids.
    sy::RouteInputs in;
    in.replay_idx = Tensor::full({T, K}, DType::int32, -1);
    for (int64_t k = 0; k < K; ++k)
      in.replay_idx.data<int32_t>()[3 * K + k] = static_cast<int32_t>(7 - k);
    const auto rr = sy::topk_route(z, in, c);
    for (int64_t k = 0; k < K; ++k) EXPECT_EQ(rr.topk_idx.data<int32_t>()[3 * K + k], 7 - k);
    EXPECT_EQ(rr.num_replayed_rows, 1);
  }
  RouterConfig bad = router_config(8, 2, ScoreFunction::sigmoid);
  bad.aux_loss_type = AuxLossType::sinkhorn;
  SY_EXPECT_THROW_MSG(sy::validate_router_config(bad), std::invalid_argument,
                      "[route] sinkhorn routing needs score_function=softmax");
}

namespace {

constexpr int64_t kInvT = 1032, kInvE = 64, kInvK = 4;

// Thread-count invariance (bitwise) of an option: ids, weights, losses and grad_logits for 1 and
// 2 threads, on bf16 and fp32 logits (sequences of 258 tokens, force seeds 3 and 4).
void thread_count_invariant(const std::string& name, const RouterConfig& rc) {
  const int64_t T = kInvT, E = kInvE, K = kInvK;
  for (DType dt : {DType::bf16, DType::fp32}) {
    const uint64_t seed =
        sy::testing::test_seed(sy::testing::seed_of("threads " + name + " " + sy::dtype_name(dt)));
    SCOPED_TRACE(name + " " + sy::dtype_name(dt) + " " + sy::testing::repro(seed));
    std::mt19937_64 rng(seed);
    const Tensor z = sy::testing::randn({T, E}, dt, rng, 3.0);
    sy::RouteOptions opt;
    opt.seq_length = 258;
    opt.force_seed = 3;
    opt.force_bias_seed = 4;
    const Tensor gw = Tensor::full({T, K}, dt, 0.3);
    auto run = [&](int threads) {
      sy::GlobalAuxLossState g;
      sy::RouteInputs in;
      in.global_aux_loss_state = &g;
      const int saved = sy::num_threads();
      sy::set_num_threads(threads);
      auto r = sy::topk_route(z, in, rc, opt);
      auto gr = sy::topk_route_backward(gw, r).grad_logits;
      sy::set_num_threads(saved);
      return std::make_pair(std::move(r), std::move(gr));
    };
    const auto [r1, g1] = run(1);
    const auto [r2, g2] = run(2);
    EXPECT_TRUE(bitwise_equal(r1.topk_idx, r2.topk_idx));
    EXPECT_TRUE(bitwise_equal(r1.topk_weights, r2.topk_weights));
    EXPECT_EQ(r1.aux_loss, r2.aux_loss);
    EXPECT_EQ(r1.z_loss, r2.z_loss);
    EXPECT_TRUE(bitwise_equal(g1, g2));
  }
}

// Batch invariance on bf16 logits or on flat fp32 scores (fp32 exp underflow, sigmoid
// saturation): a token alone gets bitwise the same ids and weights as inside the batch. Groups
// 8/2, an expert bias; softmax is pre-softmax.
void batch_invariant(ScoreFunction f, DType dt) {
  const int64_t T = kInvT, E = kInvE, K = kInvK;
  RouterConfig rc = router_config(E, K, f, f == ScoreFunction::softmax);
  rc.num_groups = 8;
  rc.group_topk = 2;
  const uint64_t seed = sy::testing::test_seed(sy::testing::seed_of(
      std::string("batch ") + sy::score_function_name(f) + " " + sy::dtype_name(dt)));
  SCOPED_TRACE(sy::testing::repro(seed));
  std::mt19937_64 rng(seed);
  Tensor z = sy::testing::randn({T, E}, dt, rng, 3.0);
  if (dt == DType::fp32) {  // flat regions: fp32 exp underflow and sigmoid saturation
    for (int64_t i = 0; i < T * E; i += 3) {
      z.data<float>()[i] =
          f == ScoreFunction::softmax ? -120.0f : 40.0f + static_cast<float>(i % 7);
    }
  }
  sy::RouteInputs in;
  in.expert_bias = sy::testing::randn({E}, DType::fp32, rng, 0.1);
  const auto rb = sy::topk_route(z, in, rc);
  for (int64_t t : {int64_t{0}, int64_t{517}, T - 1}) {
    const Tensor one =
        Tensor::borrow(static_cast<char*>(z.raw()) + t * E * sy::dtype_size(dt), {1, E}, dt);
    const auto r = sy::topk_route(one, in, rc);
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(r.topk_idx.data<int32_t>()[k], rb.topk_idx.data<int32_t>()[t * K + k])
          << "token " << t;
      EXPECT_EQ(r.topk_weights.item_as_double(k), rb.topk_weights.item_as_double(t * K + k))
          << "token " << t;
    }
  }
}

}  // namespace

// Sinkhorn and the forced logits depend on the batch by definition (see notes/router-parity.md):
// thread-count invariance only.
TEST(RouterOptionsInvariance, SeveralLossesPerTokenAndMtpAreThreadCountInvariant) {
  RouterConfig c = router_config(kInvE, kInvK, ScoreFunction::sigmoid);
  c.num_groups = 8;
  c.group_topk = 2;
  c.aux_loss_types = {AuxLossType::aux_loss, AuxLossType::seq_aux_loss,
                      AuxLossType::global_aux_loss};
  c.aux_loss_coeffs = {1e-2, 2e-2, 3e-2};
  c.z_loss_coeff = 1e-3;
  c.calculate_per_token_loss = true;
  c.is_mtp_layer = c.mtp_use_repeated_layer = true;
  c.mtp_num_layers = 2;
  thread_count_invariant("losses", c);
}
TEST(RouterOptionsInvariance, SinkhornIsThreadCountInvariant) {
  RouterConfig c = router_config(kInvE, kInvK, ScoreFunction::softmax);
  c.aux_loss_type = AuxLossType::sinkhorn;
  thread_count_invariant("sinkhorn", c);
}
TEST(RouterOptionsInvariance, ForcedBiasedLogitsAreThreadCountInvariant) {
  RouterConfig c = router_config(kInvE, kInvK, ScoreFunction::softmax);
  c.force_biased = 0.5;
  thread_count_invariant("forced", c);
}
TEST(RouterOptionsInvariance, Bf16PreSoftmaxIsBatchInvariant) {
  batch_invariant(ScoreFunction::softmax, DType::bf16);
}
TEST(RouterOptionsInvariance, FlatFp32PreSoftmaxIsBatchInvariant) {
  batch_invariant(ScoreFunction::softmax, DType::fp32);
}
TEST(RouterOptionsInvariance, Bf16SigmoidIsBatchInvariant) {
  batch_invariant(ScoreFunction::sigmoid, DType::bf16);
}
TEST(RouterOptionsInvariance, SaturatedFp32SigmoidIsBatchInvariant) {
  batch_invariant(ScoreFunction::sigmoid, DType::fp32);
}

// Quantile balancing: ids = top-k of z - beta; weights from the score function at the ids (as a
// replay of those ids); the quantile from its definition; replay keeps ids; errors.
TEST(RouterOptions, QuantileBalancing) {
  std::mt19937_64 rng(sy::testing::test_seed(1428));
  const int64_t T = 40, E = 8, K = 2;
  RouterConfig c = router_config(E, K, ScoreFunction::sigmoid);
  c.aux_loss_type = AuxLossType::quantile_balancing;
  const Tensor z = sy::testing::randn({T, E}, DType::fp32, rng);
  sy::RouteInputs in;
  in.qb_beta = sy::testing::randn({E}, DType::fp32, rng, 0.3);
  const auto r = sy::topk_route(z, in, c);
  const std::vector<double> zd = z.to_double_vector(), b = in.qb_beta.to_double_vector();
  std::vector<double> want_ids, alpha(T);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> key(E);
    for (int64_t e = 0; e < E; ++e) key[e] = static_cast<float>(zd[t * E + e] - b[e]);
    const auto top = sy::ref::topk_ids(key, K + 1);
    for (int64_t k = 0; k < K; ++k) want_ids.push_back(top[k]);
    alpha[t] = key[top[K]];
  }
  EXPECT_TRUE(all_close(r.topk_idx, want_ids, 0, 0));
  RouterConfig plain = router_config(E, K, ScoreFunction::sigmoid);
  sy::RouteInputs rep;
  rep.replay_idx = r.topk_idx;
  const auto rr = sy::topk_route(z, rep, plain);
  EXPECT_TRUE(bitwise_equal(r.topk_weights, rr.topk_weights));
  const Tensor gw = sy::testing::randn({T, K}, DType::fp32, rng);
  EXPECT_TRUE(bitwise_equal(sy::topk_route_backward(gw, r).grad_logits,
                            sy::topk_route_backward(gw, rr).grad_logits));
  // qb_beta_local[e]: the (T*K/E + 1)-th largest of z - alpha over tokens.
  ASSERT_TRUE(r.qb_beta_local.defined());
  for (int64_t e = 0; e < E; ++e) {
    std::vector<double> col(T);
    for (int64_t t = 0; t < T; ++t) col[t] = static_cast<float>(zd[t * E + e] - alpha[t]);
    std::sort(col.begin(), col.end(), std::greater<double>());
    EXPECT_EQ(r.qb_beta_local.item_as_double(e), col[T * K / E]) << e;
  }
  sy::RouteOptions ev;
  ev.training = false;
  EXPECT_FALSE(sy::topk_route(z, in, c, ev).qb_beta_local.defined());
  const Tensor z7 = sy::testing::randn({7, E}, DType::fp32, rng);
  SY_EXPECT_THROW_MSG(sy::topk_route(z7, in, c), std::invalid_argument,
                      "[route] quantile_balancing while training needs num_tokens * top_k "
                      "divisible by num_experts=8, got 7 * 2");
  EXPECT_NO_THROW(sy::topk_route(z7, in, c, ev));
}

// moe_router_padding_for_quantization and moe_pad_expert_input_to_capacity: the route carries
// them (ids, weights and counts unchanged) and the routing plan built with
// routing_plan_options() pads every expert's block, checked against the layout written out in
// double from the route alone.
TEST(RouterOptions, PaddingForQuantizationAndPadToCapacityReachThePlan) {
  std::mt19937_64 rng(sy::testing::test_seed(1422));
  const int64_t T = 200, E = 8, K = 2;
  const Tensor logits = sy::testing::randn({T, E}, DType::fp32, rng, 1.5);
  for (bool quant : {false, true}) {
    for (int cap : {0, 1, 2}) {  // no capacity, capacity, capacity + pad_to_capacity
      RouterConfig c = router_config(E, K);
      if (cap > 0) c.capacity_factor = 0.9;
      c.pad_to_capacity = cap == 2;
      c.padding_for_quantization = quant;
      c.padding_align_size = 16;
      RouterConfig plain = c;
      plain.padding_for_quantization = false;
      plain.pad_to_capacity = false;
      const sy::RouteResult r = sy::topk_route(logits, {}, c);
      const sy::RouteResult p0 = sy::topk_route(logits, {}, plain);
      SCOPED_TRACE("quant=" + std::to_string(quant) + " cap=" + std::to_string(cap));
      EXPECT_TRUE(bitwise_equal(r.topk_idx, p0.topk_idx));
      EXPECT_TRUE(bitwise_equal(r.topk_weights, p0.topk_weights));
      EXPECT_EQ(r.expert_alignment, quant ? 16 : 1);
      EXPECT_EQ(r.pad_to_capacity, cap == 2);
      const sy::RoutingPlan plan =
          sy::build_routing_plan(r.topk_idx, r.topk_weights, E, sy::routing_plan_options(r));
      EXPECT_EQ(plan.num_dropped, 0);  // the route dropped already
      // Reference layout: expert e's kept tokens ascending, then padding rows up to
      // roundup(pad ? C : count, align).
      const int32_t* idx = r.topk_idx.data<int32_t>();
      const float* w = r.topk_weights.data<float>();
      std::vector<int64_t> want_token, want_off{0};
      std::vector<double> want_w;
      for (int64_t e = 0; e < E; ++e) {
        int64_t n = 0;
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t k = 0; k < K; ++k) {
            if (idx[t * K + k] == e) {
              want_token.push_back(t);
              want_w.push_back(static_cast<double>(w[t * K + k]));
              ++n;
            }
          }
        }
        const int64_t align = quant ? 16 : 1;
        int64_t rows = cap == 2 ? r.expert_capacity : n;
        rows = (rows + align - 1) / align * align;
        for (int64_t i = n; i < rows; ++i) {
          want_token.push_back(-1);
          want_w.push_back(0.0);
        }
        want_off.push_back(want_off.back() + rows);
        EXPECT_EQ(plan.num_tokens_per_expert.data<int64_t>()[e], n) << "expert " << e;
      }
      ASSERT_EQ(plan.num_rows, static_cast<int64_t>(want_token.size()));
      for (int64_t e = 0; e <= E; ++e) {
        EXPECT_EQ(plan.expert_offsets.data<int64_t>()[e], want_off[e]) << "offset " << e;
      }
      for (int64_t i = 0; i < plan.num_rows; ++i) {
        EXPECT_EQ(plan.row_token.data<int64_t>()[i], want_token[i]) << "row " << i;
        EXPECT_EQ(static_cast<double>(plan.row_weight.data<float>()[i]), want_w[i]) << "row " << i;
      }
      for (int64_t e = 0; e < E && quant; ++e) {
        EXPECT_EQ((want_off[e + 1] - want_off[e]) % 16, 0);
      }
    }
  }
  RouterConfig bad = router_config(E, K);
  bad.padding_for_quantization = true;
  bad.padding_align_size = 0;
  SY_EXPECT_THROW_MSG(sy::validate_router_config(bad), std::invalid_argument,
                      "[route] padding_align_size must be >= 1 with padding_for_quantization, "
                      "got padding_align_size=0");
}

// Quantile balancing's global-batch update (Megatron's _update_router_qb_beta on one rank) against
// the formula in double, and its argument errors.
TEST(RouterOptions, UpdateQbBetaMatchesTheDoubleFormula) {
  std::mt19937_64 rng(sy::testing::test_seed(1426));
  const int64_t E = 12;
  const Tensor beta = sy::testing::randn({E}, DType::fp32, rng, 0.1);
  const Tensor accum = sy::testing::randn({E}, DType::fp32, rng, 2.0);
  for (int64_t count : {0, 1, 3}) {
    for (double ema : {0.0, 0.25, 1.0}) {
      const Tensor got = sy::update_qb_beta(beta, accum, count, ema);
      std::vector<double> nb(E);
      double mean = 0;
      for (int64_t e = 0; e < E; ++e) {
        const double avg = static_cast<double>(accum.data<float>()[e] /
                                               static_cast<float>(std::max<int64_t>(count, 1)));
        nb[e] = ema * beta.data<float>()[e] + (1 - ema) * avg;
        mean += nb[e];
      }
      mean /= E;
      for (int64_t e = 0; e < E; ++e) {
        EXPECT_EQ(got.data<float>()[e], static_cast<float>(nb[e] - mean))
            << "count=" << count << " ema=" << ema << " expert " << e;
      }
    }
  }
  SY_EXPECT_THROW_MSG(sy::update_qb_beta(beta, accum, 1, 1.5), std::invalid_argument,
                      "[update_qb_beta] ema must be in [0, 1], got ema=1.5");
  SY_EXPECT_THROW_MSG(sy::update_qb_beta(beta, accum, -1, 0.0), std::invalid_argument,
                      "[update_qb_beta] count must be >= 0, got count=-1");
  SY_EXPECT_THROW_MSG(sy::update_qb_beta(beta, Tensor::zeros({E + 1}, DType::fp32), 1, 0.0),
                      std::invalid_argument, "[update_qb_beta] qb_beta_accum must have shape");
  SY_EXPECT_THROW_MSG(sy::update_qb_beta(beta.to(DType::fp64), accum, 1, 0.0),
                      std::invalid_argument, "[update_qb_beta] qb_beta must have dtype fp32");
}
