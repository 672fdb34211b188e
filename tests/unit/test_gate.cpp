// Router gate (router_gating_linear): values against double references, the promised reduction
// order bit for bit, batch invariance, thread independence, gradients (reference, finite
// differences, adjoint) and every argument error.
#include <cmath>
#include <limits>
#include <numeric>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "ref/gate_ref.h"
#include "switchyard/cpu.h"
#include "switchyard/gate.h"
#include "testing.h"

namespace sy = switchyard;
using sy::DType;
using sy::GateOptions;
using sy::Tensor;
using sy::testing::bitwise_equal;
using sy::testing::randn;
using sy::testing::repro;
using sy::testing::test_seed;

namespace {

constexpr double kU32 = 0x1p-24;  // unit roundoff of fp32
constexpr double kU64 = 0x1p-53;
constexpr double kUbf = 0x1p-8;

double unit_roundoff(DType d) { return d == DType::fp64 ? kU64 : d == DType::fp32 ? kU32 : kUbf; }

// Rigorous bound for an n-term chain in unit roundoff u, then one rounding (u_out) to the
// output dtype: |got - ref| <= gamma_n·Σ|terms| + u_out·(|ref| + gamma_n·Σ|terms|).
::testing::AssertionResult within_bound(const Tensor& got, const sy::ref::GateRefOut& want,
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
             << "at " << sy::testing::coord(got.shape(), i) << ": got " << g << ", want " << w
             << " (|diff| " << std::fabs(g - w) << " > bound " << bound << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

struct Case {
  int64_t T, H, E;
  DType x, w, router;
  bool has_bias;
  DType b = DType::fp32;
  int64_t k = 0;  // > 0: grad_logits has k nonzeros per row (top-k routing), else dense
};

std::string name(const Case& c) {
  return "T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " E=" + std::to_string(c.E) +
         " x=" + sy::dtype_name(c.x) + " w=" + sy::dtype_name(c.w) +
         " router=" + sy::dtype_name(c.router) +
         (c.has_bias ? std::string(" bias=") + sy::dtype_name(c.b) : std::string(" no bias")) +
         (c.k > 0 ? " grad_logits " + std::to_string(c.k) + "-hot" : std::string());
}

// Keeps k random entries of each row of g [T,E] (distinct columns), zeroes the others: the
// grad_logits of top-k routing without aux or z loss.
void keep_k_per_row(Tensor& g, int64_t k, std::mt19937_64& rng) {
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

struct Inputs {
  Tensor x, w, b;
};

Inputs make_inputs(const Case& c, std::mt19937_64& rng) {
  Inputs in;
  in.x = randn({c.T, c.H}, c.x, rng);
  in.w =
      randn({c.E, c.H}, c.w, rng, 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(c.H, 1))));
  if (c.has_bias) in.b = randn({c.E}, c.b, rng, 0.5);
  return in;
}

Tensor chain_forward(const Inputs& in, DType router) {
  return router == DType::fp64 ? sy::ref::gate_forward_chain<double>(in.x, in.w, in.b)
                               : sy::ref::gate_forward_chain<float>(in.x, in.w, in.b);
}

void check_forward(const Case& c, uint64_t seed) {
  SCOPED_TRACE(name(c) + " " + repro(seed));
  std::mt19937_64 rng(seed);
  const Inputs in = make_inputs(c, rng);
  const Tensor out = sy::router_gating_linear(in.x, in.w, in.b, GateOptions{c.router});
  ASSERT_EQ(out.dtype(), c.router);
  ASSERT_EQ(out.shape(), (sy::Shape{c.T, c.E}));
  EXPECT_TRUE(bitwise_equal(out, chain_forward(in, c.router)));
  const auto ref = sy::ref::gate_forward_ref(in.x, in.w, in.b);
  EXPECT_TRUE(within_bound(out, ref, c.H + 1, unit_roundoff(c.router), 0));
}

void check_backward(const Case& c, uint64_t seed) {
  SCOPED_TRACE(name(c) + " " + repro(seed));
  std::mt19937_64 rng(seed);
  const Inputs in = make_inputs(c, rng);
  Tensor g = randn({c.T, c.E}, c.router, rng);
  if (c.k > 0) keep_k_per_row(g, c.k, rng);
  const sy::GateGrads gr =
      sy::router_gating_linear_backward(g, in.x, in.w, in.b, GateOptions{c.router});
  ASSERT_EQ(gr.grad_x.dtype(), c.x);
  ASSERT_EQ(gr.grad_x.shape(), in.x.shape());
  ASSERT_EQ(gr.grad_weight.dtype(), c.w);
  ASSERT_EQ(gr.grad_weight.shape(), in.w.shape());
  ASSERT_EQ(gr.grad_bias.defined(), c.has_bias);
  Tensor cx, cw, cb;
  if (c.router == DType::fp64) {
    sy::ref::gate_backward_chain<double>(g, in.x, in.w, &cx, &cw, &cb);
  } else {
    sy::ref::gate_backward_chain<float>(g, in.x, in.w, &cx, &cw, &cb);
  }
  EXPECT_TRUE(bitwise_equal(gr.grad_x, cx)) << "grad_x";
  EXPECT_TRUE(bitwise_equal(gr.grad_weight, cw)) << "grad_weight";
  const auto ref = sy::ref::gate_backward_ref(g, in.x, in.w);
  const double u = unit_roundoff(c.router);
  EXPECT_TRUE(within_bound(gr.grad_x, ref.grad_x, c.E, u, c.x == c.router ? 0 : unit_roundoff(c.x)))
      << "grad_x";
  EXPECT_TRUE(
      within_bound(gr.grad_weight, ref.grad_w, c.T, u, c.w == c.router ? 0 : unit_roundoff(c.w)))
      << "grad_weight";
  if (c.has_bias) {
    ASSERT_EQ(gr.grad_bias.dtype(), c.router);
    ASSERT_EQ(gr.grad_bias.shape(), (sy::Shape{c.E}));
    EXPECT_TRUE(bitwise_equal(gr.grad_bias, cb)) << "grad_bias";
    EXPECT_TRUE(within_bound(gr.grad_bias, ref.grad_b, c.T, u, 0)) << "grad_bias";
  }
}

const DType kXTypes[] = {DType::bf16, DType::fp32, DType::fp64};
const DType kWTypes[] = {DType::bf16, DType::fp32};
const DType kRouterTypes[] = {DType::fp32, DType::fp64};

// Restores the thread count on scope exit.
struct ThreadGuard {
  int saved = sy::num_threads();
  ~ThreadGuard() { sy::set_num_threads(saved); }
};

}  // namespace

TEST(Gate, ForwardAllDtypeCombosMatchReferenceAndChain) {
  const uint64_t seed = test_seed(101);
  uint64_t s = seed;
  for (DType r : kRouterTypes)
    for (DType xd : kXTypes)
      for (DType wd : kWTypes) {
        if (xd == DType::fp64 && r == DType::fp32) continue;  // rejected (see Errors)
        check_forward({37, 300, 19, xd, wd, r, false}, s++);
        for (DType bd : kXTypes) {
          if (bd == DType::fp64 && r == DType::fp32) continue;
          check_forward({37, 300, 19, xd, wd, r, true, bd}, s++);
        }
      }
}

TEST(Gate, ForwardShapesThatBreakKernels) {
  uint64_t s = test_seed(202);
  for (int64_t T : {0, 1, 7, 1031})
    for (int64_t H : {1, 13, 2048})
      for (int64_t E : {1, 2, 8, 64, 256}) {
        if (T * H * E > 20'000'000) continue;  // keeps the plain-loop references quick
        check_forward({T, H, E, DType::bf16, DType::bf16, DType::fp32, true}, s++);
      }
  // The big shapes once each, and fp64.
  check_forward({1031, 2048, 16, DType::bf16, DType::bf16, DType::fp32, false}, s++);
  check_forward({4096, 13, 256, DType::bf16, DType::bf16, DType::fp32, true}, s++);
  check_forward({4096, 70, 64, DType::fp32, DType::fp32, DType::fp32, true}, s++);
  check_forward({1031, 257, 65, DType::bf16, DType::fp32, DType::fp64, true}, s++);
  check_forward({5, 0, 3, DType::bf16, DType::bf16, DType::fp32, true}, s++);  // H = 0: bias
  check_forward({5, 0, 3, DType::bf16, DType::bf16, DType::fp64, false}, s++);
  check_forward({5, 7, 0, DType::bf16, DType::bf16, DType::fp32, true}, s++);
}

// A token's logits are the same bits wherever it sits, among whichever tokens, for any T and for
// 1 or 2 threads.
TEST(Gate, ForwardBatchInvariantByConstruction) {
  ThreadGuard guard;
  const uint64_t seed = test_seed(303);
  SCOPED_TRACE(repro(seed));
  std::mt19937_64 rng(seed);
  struct Cfg {
    int64_t H, E;
    DType xw, router;
  };
  for (const Cfg cfg :
       {Cfg{300, 40, DType::bf16, DType::fp32}, Cfg{2048, 128, DType::bf16, DType::fp32},
        Cfg{300, 20, DType::fp32, DType::fp64}}) {
    SCOPED_TRACE("H=" + std::to_string(cfg.H) + " E=" + std::to_string(cfg.E) +
                 " router=" + sy::dtype_name(cfg.router));
    const GateOptions opt{cfg.router};
    const Tensor w = randn({cfg.E, cfg.H}, cfg.xw, rng, 0.05);
    const Tensor b = randn({cfg.E}, DType::fp32, rng);
    const Tensor probe = randn({1, cfg.H}, cfg.xw, rng);
    sy::set_num_threads(1);
    const Tensor alone = sy::router_gating_linear(probe, w, b, opt);
    const size_t xs = sy::dtype_size(cfg.xw), ls = sy::dtype_size(cfg.router);
    for (int64_t T : {1, 7, 1031, 4096}) {
      if (cfg.H == 2048 && T == 1031) continue;
      Tensor x = randn({T, cfg.H}, cfg.xw, rng);
      for (int64_t pos : {int64_t{0}, T / 2, T - 1, T > 6 ? int64_t{6} : T - 1}) {
        std::memcpy(static_cast<char*>(x.raw()) + pos * cfg.H * xs, probe.raw(), cfg.H * xs);
        for (int threads : {1, 2}) {
          sy::set_num_threads(threads);
          const Tensor out = sy::router_gating_linear(x, w, b, opt);
          const Tensor row =
              Tensor::borrow(static_cast<char*>(const_cast<void*>(out.raw())) + pos * cfg.E * ls,
                             {1, cfg.E}, cfg.router);
          EXPECT_TRUE(bitwise_equal(row, alone))
              << "T=" << T << " pos=" << pos << " threads=" << threads;
        }
        // Put different neighbours around the probe for the next position.
        x = randn({T, cfg.H}, cfg.xw, rng);
      }
    }
  }
}

TEST(Gate, BackwardAllDtypeCombosMatchReferenceAndChain) {
  uint64_t s = test_seed(404);
  for (DType r : kRouterTypes)
    for (DType xd : kXTypes)
      for (DType wd : kWTypes) {
        if (xd == DType::fp64 && r == DType::fp32) continue;
        check_backward({37, 45, 19, xd, wd, r, false}, s++);
        check_backward({300, 45, 19, xd, wd, r, true}, s++);  // T > one block of tokens
      }
}

TEST(Gate, BackwardShapesThatBreakKernels) {
  uint64_t s = test_seed(505);
  for (int64_t T : {0, 1, 7, 1031})
    for (int64_t H : {1, 13, 2048})
      for (int64_t E : {1, 2, 8, 64, 256}) {
        if (T * H * E > 4'000'000) continue;
        check_backward({T, H, E, DType::bf16, DType::bf16, DType::fp32, true}, s++);
      }
  check_backward({1031, 2048, 2, DType::bf16, DType::bf16, DType::fp32, true}, s++);
  // Several groups of H panels with a partial last panel, and more than one block of tokens.
  check_backward({600, 300, 19, DType::bf16, DType::bf16, DType::fp32, true}, s++);
  check_backward({600, 300, 19, DType::fp32, DType::bf16, DType::fp64, true}, s++);
  check_backward({4096, 13, 64, DType::bf16, DType::fp32, DType::fp32, true}, s++);
  check_backward({5, 0, 3, DType::bf16, DType::bf16, DType::fp32, true}, s++);
  check_backward({5, 7, 0, DType::fp32, DType::bf16, DType::fp64, true}, s++);
}

// Every kernel variant the CPU supports (scalar, avx2, avx512) runs the same chains: the avx2
// variant runs the 32-column panels (forward: experts, backward: hidden) as two 256-bit halves,
// avx512 as one zmm tile, scalar with std::fma. Each is checked here against the chain reference
// and bitwise against the others (Determinism.KernelVariantsGiveTheSameBits checks the whole
// layer).
TEST(Gate, EveryCpuVariantMatchesChain) {
  struct IsaGuard {
    sy::CpuIsa saved = sy::cpu_isa();
    ~IsaGuard() { sy::set_cpu_isa(saved); }
  } guard;
  const Case cases[] = {{1031, 45, 19, DType::bf16, DType::bf16, DType::fp32, true},
                        {600, 300, 19, DType::fp32, DType::fp32, DType::fp32, true},
                        {300, 2048, 64, DType::bf16, DType::bf16, DType::fp32, false},
                        {37, 45, 19, DType::bf16, DType::fp32, DType::fp64, true}};
  const Case fwd_cases[] = {{1031, 45, 19, DType::bf16, DType::bf16, DType::fp32, true},
                            {300, 2048, 128, DType::bf16, DType::bf16, DType::fp32, false},
                            {97, 300, 65, DType::fp32, DType::fp32, DType::fp32, true},
                            {37, 45, 19, DType::bf16, DType::fp32, DType::fp64, true}};
  std::mt19937_64 rng(test_seed(516));
  const Tensor x = randn({777, 2050}, DType::bf16, rng), w = randn({70, 2050}, DType::bf16, rng);
  const Tensor g = randn({777, 70}, DType::fp32, rng);
  const Tensor b = randn({70}, DType::fp32, rng);
  bool have_first = false;
  sy::GateGrads first;
  Tensor first_logits;
  for (sy::CpuIsa isa : {sy::CpuIsa::scalar, sy::CpuIsa::avx2, sy::CpuIsa::avx512}) {
    if (!sy::cpu_supports(isa)) continue;
    SCOPED_TRACE(std::string("isa ") + sy::cpu_isa_name(isa));
    sy::set_cpu_isa(isa);
    uint64_t s = test_seed(515);
    for (const Case& c : cases) check_backward(c, s++);
    for (const Case& c : fwd_cases) check_forward(c, s++);
    const sy::GateGrads grads = sy::router_gating_linear_backward(g, x, w, Tensor());
    const Tensor logits = sy::router_gating_linear(x, w, b);
    if (have_first) {
      EXPECT_TRUE(bitwise_equal(first_logits, logits)) << "logits vs scalar";
      EXPECT_TRUE(bitwise_equal(first.grad_x, grads.grad_x)) << "grad_x vs scalar";
      EXPECT_TRUE(bitwise_equal(first.grad_weight, grads.grad_weight)) << "grad_weight vs scalar";
    } else {
      first = grads;
      first_logits = logits;
      have_first = true;
    }
  }
}

// After top-k routing without aux or z loss, grad_logits has k nonzeros per row; the backward
// then runs the chains over the nonzero terms only (src/cpu/gate_kernels.cpp), which must give
// bitwise the dense chain: shapes with edge columns, every dtype pair, k in {1, 2, 8}, on every
// kernel variant the CPU runs.
TEST(Gate, BackwardOfTopKGradLogitsMatchesChain) {
  struct IsaGuard {
    sy::CpuIsa saved = sy::cpu_isa();
    ~IsaGuard() { sy::set_cpu_isa(saved); }
  } guard;
  const Case cases[] = {
      {200, 2048, 128, DType::bf16, DType::bf16, DType::fp32, true, DType::fp32, 8},
      {300, 7168 / 16 + 5, 256, DType::bf16, DType::bf16, DType::fp32, false, DType::fp32, 8},
      {97, 300, 65, DType::fp32, DType::fp32, DType::fp32, true, DType::fp32, 2},
      {7, 45, 64, DType::fp32, DType::bf16, DType::fp64, true, DType::fp32, 1},
      {1, 70, 8, DType::bf16, DType::fp32, DType::fp32, false, DType::fp32, 1},
      {300, 130, 64, DType::fp64, DType::bf16, DType::fp64, false, DType::fp32, 8},
      // T above one grad_w token block (1024): the chains resume across blocks
      {2100, 70, 16, DType::bf16, DType::bf16, DType::fp32, false, DType::fp32, 2}};
  for (sy::CpuIsa isa : {sy::CpuIsa::scalar, sy::CpuIsa::avx2, sy::CpuIsa::avx512}) {
    if (!sy::cpu_supports(isa)) continue;
    SCOPED_TRACE(std::string("isa ") + sy::cpu_isa_name(isa));
    sy::set_cpu_isa(isa);
    uint64_t s = test_seed(530);
    for (const Case& c : cases) check_backward(c, s++);
  }
}

// The one place where skipping g = 0 terms could change a bit: a negative product that underflows
// to -0, followed by zero terms with +0 products. The dense chain turns -0 into +0
// (fma(0, w > 0, -0) = +0); the result must be that +0.
TEST(Gate, BackwardOfSparseGradLogitsKeepsTheDenseSignOfZero) {
  struct IsaGuard {
    sy::CpuIsa saved = sy::cpu_isa();
    ~IsaGuard() { sy::set_cpu_isa(saved); }
  } guard;
  const int64_t T = 16, H = 70, E = 16;
  Tensor x = Tensor::empty({T, H}, DType::fp32), w = Tensor::empty({E, H}, DType::fp32);
  Tensor g = Tensor::empty({T, E}, DType::fp32);
  for (int64_t i = 0; i < T * H; ++i) x.data<float>()[i] = 1.0f;
  for (int64_t i = 0; i < E * H; ++i) w.data<float>()[i] = 1.0f;
  for (int64_t i = 0; i < T * E; ++i) g.data<float>()[i] = 0.0f;
  for (int64_t h = 0; h < H; ++h) {
    w.data<float>()[2 * H + h] = -1e-30f;  // g[0,2] · w[2,h] = -1e-60: rounds to -0
    x.data<float>()[0 * H + h] = -1e-30f;  // g[0,2] · x[0,h] likewise
  }
  g.data<float>()[0 * E + 2] = 1e-30f;
  for (sy::CpuIsa isa : {sy::CpuIsa::scalar, sy::CpuIsa::avx2, sy::CpuIsa::avx512}) {
    if (!sy::cpu_supports(isa)) continue;
    SCOPED_TRACE(std::string("isa ") + sy::cpu_isa_name(isa));
    sy::set_cpu_isa(isa);
    const sy::GateGrads gr = sy::router_gating_linear_backward(g, x, w, Tensor());
    Tensor cx, cw, cb;
    sy::ref::gate_backward_chain<float>(g, x, w, &cx, &cw, &cb);
    EXPECT_TRUE(bitwise_equal(gr.grad_x, cx)) << "grad_x";
    EXPECT_TRUE(bitwise_equal(gr.grad_weight, cw)) << "grad_weight";
    // The dense chains end at +0 (the zero terms after the underflow), not at -0.
    EXPECT_FALSE(std::signbit(gr.grad_x.data<float>()[0])) << "grad_x[0,0]";
    EXPECT_FALSE(std::signbit(gr.grad_weight.data<float>()[2 * H])) << "grad_weight[2,0]";
  }
}

// Gradients against central finite differences of L = Σ logits ⊙ R, all in fp64.
TEST(Gate, BackwardMatchesFiniteDifferencesFp64) {
  const uint64_t seed = test_seed(606);
  SCOPED_TRACE(repro(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = 9, H = 21, E = 10;
  const GateOptions opt{DType::fp64};
  Tensor x = randn({T, H}, DType::fp64, rng), w = randn({E, H}, DType::fp32, rng);
  Tensor b = randn({E}, DType::fp64, rng);
  const Tensor r = randn({T, E}, DType::fp64, rng);
  auto loss = [&](const Tensor& xx, const Tensor& bb) {
    const Tensor z = sy::router_gating_linear(xx, w, bb, opt);
    double s = 0;
    for (int64_t i = 0; i < T * E; ++i) s += z.data<double>()[i] * r.data<double>()[i];
    return s;
  };
  const sy::GateGrads g = sy::router_gating_linear_backward(r, x, w, b, opt);
  const double eps = 1e-4;
  for (int64_t i = 0; i < T * H; ++i) {
    double* p = x.data<double>() + i;
    const double v = *p;
    *p = v + eps;
    const double lp = loss(x, b);
    *p = v - eps;
    const double lm = loss(x, b);
    *p = v;
    EXPECT_NEAR((lp - lm) / (2 * eps), g.grad_x.data<double>()[i], 1e-8) << "grad_x at " << i;
  }
  for (int64_t e = 0; e < E; ++e) {
    double* p = b.data<double>() + e;
    const double v = *p;
    *p = v + eps;
    const double lp = loss(x, b);
    *p = v - eps;
    const double lm = loss(x, b);
    *p = v;
    EXPECT_NEAR((lp - lm) / (2 * eps), g.grad_bias.data<double>()[e], 1e-8) << "grad_bias at " << e;
  }
  // grad_weight (fp32 weight, fp64 router): perturb an fp64 copy through the double reference of
  // the loss, since an fp32 weight cannot hold w ± eps exactly.
  const std::vector<double> xd = x.to_double_vector(), wd = w.to_double_vector(),
                            rd = r.to_double_vector();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h) {
      auto lw = [&](double delta) {
        double s = 0;
        for (int64_t t = 0; t < T; ++t) {
          double z = 0;
          for (int64_t k = 0; k < H; ++k)
            z += xd[t * H + k] * (wd[e * H + k] + (k == h ? delta : 0.0));
          s += z * rd[t * E + e];
        }
        return s;
      };
      EXPECT_NEAR((lw(eps) - lw(-eps)) / (2 * eps), g.grad_weight.item_as_double(e * H + h), 1e-6)
          << "grad_weight at [" << e << ", " << h << "]";
    }
}

// ⟨x·Wᵀ, G⟩ = ⟨x, G·W⟩ = ⟨W, Gᵀ·x⟩.
TEST(Gate, AdjointIdentity) {
  const uint64_t seed = test_seed(707);
  SCOPED_TRACE(repro(seed));
  std::mt19937_64 rng(seed);
  for (DType r : kRouterTypes) {
    const int64_t T = 50, H = 70, E = 24;
    const DType xd = r == DType::fp64 ? DType::fp64 : DType::fp32;
    const Tensor x = randn({T, H}, xd, rng), w = randn({E, H}, DType::fp32, rng);
    const Tensor g = randn({T, E}, r, rng);
    const GateOptions opt{r};
    const Tensor z = sy::router_gating_linear(x, w, Tensor(), opt);
    const sy::GateGrads gr = sy::router_gating_linear_backward(g, x, w, Tensor(), opt);
    double lhs = 0, mid = 0, rhs = 0, scale = 0, scale_w = 0;
    for (int64_t i = 0; i < T * E; ++i) {
      lhs += z.item_as_double(i) * g.item_as_double(i);
      scale += std::fabs(z.item_as_double(i) * g.item_as_double(i));
    }
    for (int64_t i = 0; i < T * H; ++i) mid += x.item_as_double(i) * gr.grad_x.item_as_double(i);
    for (int64_t i = 0; i < E * H; ++i) {
      rhs += w.item_as_double(i) * gr.grad_weight.item_as_double(i);
      scale_w += std::fabs(w.item_as_double(i) * gr.grad_weight.item_as_double(i));
    }
    const double tol = (r == DType::fp64 ? 1e-12 : 1e-5) * (scale + 1);
    EXPECT_NEAR(lhs, mid, tol) << sy::dtype_name(r);
    // grad_weight is rounded once to the weight's dtype (fp32 here): allow that rounding too.
    EXPECT_NEAR(lhs, rhs, tol + kU32 * scale_w) << sy::dtype_name(r);
  }
}

// Backward: same bits for 1 and 2 threads; grad_x of a token independent of its batch.
TEST(Gate, BackwardDeterministicAndThreadIndependent) {
  ThreadGuard guard;
  const uint64_t seed = test_seed(808);
  SCOPED_TRACE(repro(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = 1031, H = 300, E = 40;
  const Tensor x = randn({T, H}, DType::bf16, rng), w = randn({E, H}, DType::bf16, rng);
  const Tensor b = randn({E}, DType::fp32, rng), g = randn({T, E}, DType::fp32, rng);
  sy::set_num_threads(1);
  const sy::GateGrads g1 = sy::router_gating_linear_backward(g, x, w, b);
  const sy::GateGrads g1b = sy::router_gating_linear_backward(g, x, w, b);
  sy::set_num_threads(2);
  const sy::GateGrads g2 = sy::router_gating_linear_backward(g, x, w, b);
  EXPECT_TRUE(bitwise_equal(g1.grad_x, g1b.grad_x));
  EXPECT_TRUE(bitwise_equal(g1.grad_weight, g1b.grad_weight));
  EXPECT_TRUE(bitwise_equal(g1.grad_x, g2.grad_x));
  EXPECT_TRUE(bitwise_equal(g1.grad_weight, g2.grad_weight));
  EXPECT_TRUE(bitwise_equal(g1.grad_bias, g2.grad_bias));
  // Token 500's grad_x row alone equals its row in the batch.
  const int64_t t = 500;
  const Tensor x1 = Tensor::borrow(static_cast<char*>(const_cast<void*>(x.raw())) + t * H * 2,
                                   {1, H}, DType::bf16);
  const Tensor gt =
      Tensor::borrow(const_cast<float*>(g.data<float>()) + t * E, {1, E}, DType::fp32);
  const sy::GateGrads one = sy::router_gating_linear_backward(gt, x1, w, b);
  const Tensor row = Tensor::borrow(
      static_cast<char*>(const_cast<void*>(g2.grad_x.raw())) + t * H * 2, {1, H}, DType::bf16);
  EXPECT_TRUE(bitwise_equal(one.grad_x, row));
}

// fp64 -> bf16 rounding of grad_x is a single rounding (no double rounding through fp32).
TEST(Gate, BackwardRoundsOnceToBf16) {
  // grad_x = g·w with g = 1 + 2^-8 + 2^-30 (fp64) and w = 1 (bf16): the exact value is just
  // above the midpoint between two bf16 values, so it rounds up; through fp32 it would first
  // round to the midpoint and then to even (down).
  const double gv = 1.0 + 0x1p-8 + 0x1p-30;
  const Tensor g = Tensor::from_vector(std::vector<double>{gv}, {1, 1});
  const Tensor x = Tensor::full({1, 1}, DType::bf16, 1.0);
  const Tensor w = Tensor::full({1, 1}, DType::bf16, 1.0);
  const sy::GateGrads gr =
      sy::router_gating_linear_backward(g, x, w, Tensor(), GateOptions{DType::fp64});
  EXPECT_EQ(gr.grad_x.item_as_double(0), 1.0 + 0x1p-7);
  EXPECT_EQ(gr.grad_weight.item_as_double(0), 1.0 + 0x1p-7);
}

TEST(Gate, Errors) {
  std::mt19937_64 rng(1);
  const Tensor x = randn({4, 8}, DType::bf16, rng), w = randn({3, 8}, DType::bf16, rng);
  const Tensor b = randn({3}, DType::fp32, rng), g = randn({4, 3}, DType::fp32, rng);
  using E = std::invalid_argument;
  const char* op = "[router_gating_linear] ";
  // dtypes
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x.to(DType::int32), w, b), E,
                      std::string(op) + "x must have dtype bf16 or fp32 or fp64, got int32");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, w.to(DType::fp64), b), E,
                      "weight must have dtype bf16 or fp32, got fp64");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, w, b.to(DType::int64)), E,
                      "bias must have dtype bf16 or fp32 or fp64, got int64");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, w, b, GateOptions{DType::bf16}), E,
                      "options.router_dtype must be fp32 or fp64, got bf16");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x.to(DType::fp64), w, b), E,
                      "x in fp64 needs options.router_dtype fp64");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, w, b.to(DType::fp64)), E,
                      "bias in fp64 needs options.router_dtype fp64");
  // shapes
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(Tensor(), w, b), E, "x must be a defined tensor");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, Tensor(), b), E,
                      "weight must be a defined tensor");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x.reshape({32}), w, b), E,
                      "x must have 2 dimensions, got shape [32]");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, w.reshape({24}), b), E,
                      "weight must have 2 dimensions, got shape [24]");
  SY_EXPECT_THROW_MSG(
      sy::router_gating_linear(x, w.reshape({4, 6}), b), E,
      "weight must have shape [num_experts, hidden=8] (hidden from x [4, 8]), got [4, 6]");
  SY_EXPECT_THROW_MSG(
      sy::router_gating_linear(x, w, randn({4}, DType::fp32, rng)), E,
      "bias must have shape [num_experts=3] (num_experts from weight [3, 8]), got [4]");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, w, b.reshape({1, 3})), E,
                      "bias must have shape [num_experts=3]");
  // non-finite values, naming token / expert, hidden and the value
  for (double bad : {std::nan(""), double{INFINITY}, -double{INFINITY}}) {
    const std::string v = std::isnan(bad) ? "nan" : bad > 0 ? "inf" : "-inf";
    Tensor xb = x.clone();
    xb.data<sy::bf16>()[2 * 8 + 5] = sy::float_to_bf16(static_cast<float>(bad));
    SY_EXPECT_THROW_MSG(
        sy::router_gating_linear(xb, w, b), E,
        std::string(op) + "x has a non-finite value " + v + " at token 2, hidden 5");
    Tensor xf = x.to(DType::fp32);
    xf.data<float>()[3 * 8 + 7] = static_cast<float>(bad);
    SY_EXPECT_THROW_MSG(sy::router_gating_linear(xf, w, b), E,
                        "x has a non-finite value " + v + " at token 3, hidden 7");
    Tensor xd = x.to(DType::fp64);
    xd.data<double>()[1] = bad;
    SY_EXPECT_THROW_MSG(sy::router_gating_linear(xd, w, b, GateOptions{DType::fp64}), E,
                        "x has a non-finite value " + v + " at token 0, hidden 1");
    Tensor wb = w.to(DType::fp32);
    wb.data<float>()[1 * 8 + 2] = static_cast<float>(bad);
    SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, wb, b), E,
                        "weight has a non-finite value " + v + " at expert 1, hidden 2");
    Tensor bb = b.clone();
    bb.data<float>()[2] = static_cast<float>(bad);
    SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, w, bb), E,
                        "bias has a non-finite value " + v + " at expert 2");
    Tensor gb = g.clone();
    gb.data<float>()[3 * 3 + 1] = static_cast<float>(bad);
    SY_EXPECT_THROW_MSG(sy::router_gating_linear_backward(gb, x, w, b), E,
                        "[router_gating_linear_backward] grad_logits has a non-finite value " + v +
                            " at token 3, expert 1");
    SY_EXPECT_THROW_MSG(
        sy::router_gating_linear_backward(g, xb, w, b), E,
        "[router_gating_linear_backward] x has a non-finite value " + v + " at token 2, hidden 5");
    SY_EXPECT_THROW_MSG(sy::router_gating_linear_backward(g, x, wb, b), E,
                        "weight has a non-finite value " + v + " at expert 1, hidden 2");
  }
  // The first non-finite value (in memory order) is the one reported, also in a large tensor.
  Tensor big = randn({5000, 64}, DType::bf16, rng);
  big.data<sy::bf16>()[4321 * 64 + 9] = sy::float_to_bf16(NAN);
  big.data<sy::bf16>()[4900 * 64 + 1] = sy::float_to_bf16(INFINITY);
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(big, randn({3, 64}, DType::bf16, rng), Tensor()), E,
                      "x has a non-finite value nan at token 4321, hidden 9");
  // The forward scans its logits and only then the inputs (a non-finite input always reaches a
  // logit): several bad inputs still name x first, then weight, then bias; a size-0 dimension
  // (no logit to look at) scans the inputs directly; finite inputs that overflow return the
  // infinite logits, as before.
  {
    Tensor xb = x.to(DType::fp32), wb = w.to(DType::fp32), bb = b.clone();
    xb.data<float>()[3 * 8 + 7] = NAN;
    wb.data<float>()[0] = INFINITY;
    bb.data<float>()[1] = -INFINITY;
    SY_EXPECT_THROW_MSG(sy::router_gating_linear(xb, wb, bb), E,
                        "x has a non-finite value nan at token 3, hidden 7");
    SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, wb, bb), E,
                        "weight has a non-finite value inf at expert 0, hidden 0");
    Tensor empty_w = Tensor::empty({0, 8}, DType::bf16);
    SY_EXPECT_THROW_MSG(sy::router_gating_linear(xb, empty_w, Tensor()), E,
                        "x has a non-finite value nan at token 3, hidden 7");
    Tensor no_hidden = Tensor::empty({4, 0}, DType::fp32);
    SY_EXPECT_THROW_MSG(
        sy::router_gating_linear(no_hidden, Tensor::empty({3, 0}, DType::fp32), bb), E,
        "bias has a non-finite value -inf at expert 1");
    Tensor huge = Tensor::empty({2, 4}, DType::fp32);
    for (int64_t i = 0; i < 8; ++i) huge.data<float>()[i] = 3e38f;
    const Tensor over = sy::router_gating_linear(huge, huge, Tensor());
    EXPECT_TRUE(std::isinf(over.data<float>()[0])) << "3e38 * 3e38 overflows to inf";
  }
  // The backward checks x after the product, through grad_weight and the x rows whose grad_logits
  // row is all zero: a bad x is named wherever it sits, on the dense and the sparse path (a
  // one-hot grad_logits, rows 0 and 2 all zero), and before a bad weight.
  {
    const int64_t T = 64, H = 40, Ex = 16;
    std::mt19937_64 r2(test_seed(77));
    const Tensor xs = randn({T, H}, DType::bf16, r2), ws = randn({Ex, H}, DType::bf16, r2);
    Tensor dense = randn({T, Ex}, DType::fp32, r2), sparse = dense.clone();
    keep_k_per_row(sparse, 1, r2);
    for (int64_t e = 0; e < Ex; ++e) {
      sparse.data<float>()[0 * Ex + e] = 0.0f;
      sparse.data<float>()[2 * Ex + e] = 0.0f;
    }
    for (const Tensor& gl : {dense, sparse}) {
      for (int64_t t : {0, 1, 2, 63}) {
        Tensor xb = xs.clone();
        xb.data<sy::bf16>()[t * H + 7] = sy::float_to_bf16(NAN);
        SY_EXPECT_THROW_MSG(sy::router_gating_linear_backward(gl, xb, ws, Tensor()), E,
                            "x has a non-finite value nan at token " + std::to_string(t) +
                                ", hidden 7");
        Tensor wb2 = ws.clone();
        wb2.data<sy::bf16>()[5 * H + 3] = sy::float_to_bf16(-INFINITY);
        SY_EXPECT_THROW_MSG(sy::router_gating_linear_backward(gl, xb, wb2, Tensor()), E,
                            "x has a non-finite value nan at token " + std::to_string(t));
        SY_EXPECT_THROW_MSG(sy::router_gating_linear_backward(gl, xs, wb2, Tensor()), E,
                            "weight has a non-finite value -inf at expert 5, hidden 3");
      }
    }
    Tensor huge = Tensor::empty({2, 4}, DType::fp32), gh = Tensor::empty({2, 2}, DType::fp32);
    for (int64_t i = 0; i < 8; ++i) huge.data<float>()[i] = 3e38f;
    for (int64_t i = 0; i < 4; ++i) gh.data<float>()[i] = 3e38f;  // T 2, H 4, E 2
    const sy::GateGrads over = sy::router_gating_linear_backward(gh, huge, huge, Tensor());
    EXPECT_TRUE(std::isinf(over.grad_weight.data<float>()[0])) << "finite inputs that overflow";
  }
  // backward-only arguments
  const char* bop = "[router_gating_linear_backward] ";
  SY_EXPECT_THROW_MSG(sy::router_gating_linear_backward(g.to(DType::bf16), x, w, b), E,
                      std::string(bop) + "grad_logits must have dtype fp32, got bf16");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear_backward(g, x, w, b, GateOptions{DType::fp64}), E,
                      "grad_logits must have dtype fp64, got fp32");
  SY_EXPECT_THROW_MSG(
      sy::router_gating_linear_backward(g.reshape({3, 4}), x, w, b), E,
      "grad_logits must have shape [num_tokens=4, num_experts=3] (from x [4, 8] and "
      "weight [3, 8]), got [3, 4]");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear_backward(Tensor(), x, w, b), E,
                      "grad_logits must be a defined tensor");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear_backward(g, x, w.reshape({4, 6}), b), E,
                      std::string(bop) + "weight must have shape [num_experts, hidden=8]");
  SY_EXPECT_THROW_MSG(sy::router_gating_linear_backward(g, x.to(DType::fp64), w, b), E,
                      std::string(bop) + "x in fp64 needs options.router_dtype fp64");
}
