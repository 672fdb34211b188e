// Router gate (router_gating_linear): values against double references, the promised reduction
// order bit for bit, batch invariance, thread independence, gradients (reference, finite
// differences, adjoint) and every argument error.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gate_tester.h"
#include "model_shapes.h"
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
using sy::testing::ThreadGuard;

namespace {

using sy::testing::GateTester;
using sy::testing::kDeepSeekV3;
using sy::testing::keep_k_per_row;
using sy::testing::kQwen3_30B_A3B;

// One x / weight / router dtype combination at T 37, H 300, E 19: without a bias and with a bias
// of each dtype the router dtype allows (fp64 x or bias need the fp64 router).
void forward_dtypes(DType xd, DType wd, DType r) {
  GateTester().x(xd).weight(wd).router(r).no_bias().TestForward();
  for (DType bd : {DType::bf16, DType::fp32, DType::fp64}) {
    if (bd == DType::fp64 && r == DType::fp32) continue;
    GateTester().x(xd).weight(wd).router(r).bias(bd).TestForward();
  }
}

// The same combination backward, at T 37 without bias and at T 300 (more than one block of
// tokens) with an fp32 bias, H 45, E 19.
void backward_dtypes(DType xd, DType wd, DType r) {
  GateTester().hidden(45).x(xd).weight(wd).router(r).no_bias().TestBackward();
  GateTester().tokens(300).hidden(45).x(xd).weight(wd).router(r).TestBackward();
}

// The shapes that break kernels at T tokens: H in {1, 13, 2048}, E in {1, 2, 8, 64, 256}, bf16
// x and W, fp32 router and bias (products above `max_work` left out to keep the references quick).
void shapes(int64_t T, bool backward, int64_t max_work) {
  for (int64_t H : {int64_t{1}, int64_t{13}, kQwen3_30B_A3B.hidden}) {
    for (int64_t E : {1, 2, 8, 64, 256}) {
      if (T * H * E > max_work) continue;
      GateTester t;
      t.tokens(T).hidden(H).experts(E);
      if (backward) {
        t.TestBackward();
      } else {
        t.TestForward();
      }
    }
  }
}

constexpr int64_t kForwardWork = 20'000'000, kBackwardWork = 4'000'000;

}  // namespace

#define SY_GATE_DTYPES(Name, xd, wd, r)                  \
  TEST(GateForward, Name) { forward_dtypes(xd, wd, r); } \
  TEST(GateBackward, Name) { backward_dtypes(xd, wd, r); }

SY_GATE_DTYPES(Bf16XBf16WeightFp32Router, DType::bf16, DType::bf16, DType::fp32)
SY_GATE_DTYPES(Bf16XFp32WeightFp32Router, DType::bf16, DType::fp32, DType::fp32)
SY_GATE_DTYPES(Fp32XBf16WeightFp32Router, DType::fp32, DType::bf16, DType::fp32)
SY_GATE_DTYPES(Fp32XFp32WeightFp32Router, DType::fp32, DType::fp32, DType::fp32)
SY_GATE_DTYPES(Bf16XBf16WeightFp64Router, DType::bf16, DType::bf16, DType::fp64)
SY_GATE_DTYPES(Bf16XFp32WeightFp64Router, DType::bf16, DType::fp32, DType::fp64)
SY_GATE_DTYPES(Fp32XBf16WeightFp64Router, DType::fp32, DType::bf16, DType::fp64)
SY_GATE_DTYPES(Fp32XFp32WeightFp64Router, DType::fp32, DType::fp32, DType::fp64)
SY_GATE_DTYPES(Fp64XBf16WeightFp64Router, DType::fp64, DType::bf16, DType::fp64)
SY_GATE_DTYPES(Fp64XFp32WeightFp64Router, DType::fp64, DType::fp32, DType::fp64)

TEST(GateForward, ShapesThatBreakKernelsAtZeroTokens) { shapes(0, false, kForwardWork); }
TEST(GateForward, ShapesThatBreakKernelsAtOneToken) { shapes(1, false, kForwardWork); }
TEST(GateForward, ShapesThatBreakKernelsAtSevenTokens) { shapes(7, false, kForwardWork); }
TEST(GateForward, ShapesThatBreakKernelsAt1031Tokens) { shapes(1031, false, kForwardWork); }
TEST(GateBackward, ShapesThatBreakKernelsAtZeroTokens) { shapes(0, true, kBackwardWork); }
TEST(GateBackward, ShapesThatBreakKernelsAtOneToken) { shapes(1, true, kBackwardWork); }
TEST(GateBackward, ShapesThatBreakKernelsAtSevenTokens) { shapes(7, true, kBackwardWork); }
TEST(GateBackward, ShapesThatBreakKernelsAt1031Tokens) { shapes(1031, true, kBackwardWork); }

TEST(GateForward, Qwen3HiddenAt1031TokensWithoutBias) {
  GateTester().tokens(1031).hidden(kQwen3_30B_A3B.hidden).experts(16).no_bias().TestForward();
}
TEST(GateForward, DeepSeekV3ExpertsAt4096Tokens) {
  GateTester().tokens(4096).hidden(13).experts(kDeepSeekV3.num_experts).TestForward();
}
TEST(GateForward, Fp32At4096Tokens) {
  GateTester().tokens(4096).hidden(70).experts(64).x(DType::fp32).weight(DType::fp32).TestForward();
}
TEST(GateForward, Fp64RouterAtOddShape) {
  GateTester()
      .tokens(1031)
      .hidden(257)
      .experts(65)
      .weight(DType::fp32)
      .router(DType::fp64)
      .TestForward();
}
TEST(GateForward, ZeroHiddenGivesTheBias) {
  GateTester().tokens(5).hidden(0).experts(3).TestForward();
  GateTester().tokens(5).hidden(0).experts(3).router(DType::fp64).no_bias().TestForward();
}
TEST(GateForward, ZeroExperts) { GateTester().tokens(5).hidden(7).experts(0).TestForward(); }

TEST(GateBackward, Qwen3HiddenAt1031TokensTwoExperts) {
  GateTester().tokens(1031).hidden(kQwen3_30B_A3B.hidden).experts(2).TestBackward();
}
// Several groups of H panels with a partial last panel, and more than one block of tokens.
TEST(GateBackward, PartialHiddenPanelsOverTokenBlocks) {
  GateTester().tokens(600).hidden(300).experts(19).TestBackward();
  GateTester()
      .tokens(600)
      .hidden(300)
      .experts(19)
      .x(DType::fp32)
      .router(DType::fp64)
      .TestBackward();
  // The kernel's grad_w groups are 512 fp32 (256 fp64) columns: three groups, the last one a
  // partial group ending in a partial panel, over three token blocks.
  GateTester().tokens(600).hidden(1100).experts(19).TestBackward();
  GateTester().tokens(600).hidden(1100).experts(19).router(DType::fp64).TestBackward();
}
TEST(GateBackward, At4096Tokens) {
  GateTester().tokens(4096).hidden(13).experts(64).weight(DType::fp32).TestBackward();
}
TEST(GateBackward, ZeroHidden) { GateTester().tokens(5).hidden(0).experts(3).TestBackward(); }
TEST(GateBackward, ZeroExperts) {
  GateTester().tokens(5).hidden(7).experts(0).x(DType::fp32).router(DType::fp64).TestBackward();
}

// A token's logits are the same bits wherever it sits, among whichever tokens, for any T and for
// 1 or 2 threads.
TEST(GateForward, BatchInvariantBf16InputsFp32Router) {
  GateTester().hidden(300).experts(40).TestBatchInvariance();
}
TEST(GateForward, BatchInvariantAtQwen3Shape) {
  GateTester()
      .hidden(kQwen3_30B_A3B.hidden)
      .experts(kQwen3_30B_A3B.num_experts)
      .TestBatchInvariance();
}
TEST(GateForward, BatchInvariantFp32InputsFp64Router) {
  GateTester()
      .hidden(300)
      .experts(20)
      .x(DType::fp32)
      .weight(DType::fp32)
      .router(DType::fp64)
      .TestBatchInvariance();
}

// ⟨x·Wᵀ, G⟩ = ⟨x, G·W⟩ = ⟨W, Gᵀ·x⟩.
TEST(GateBackward, AdjointIdentityFp32Router) {
  GateTester().tokens(50).hidden(70).experts(24).x(DType::fp32).weight(DType::fp32).TestAdjoint();
}
TEST(GateBackward, AdjointIdentityFp64Router) {
  GateTester()
      .tokens(50)
      .hidden(70)
      .experts(24)
      .x(DType::fp64)
      .weight(DType::fp32)
      .router(DType::fp64)
      .TestAdjoint();
}

// Every kernel variant the CPU supports (scalar, avx2, avx512) runs the same chains: the avx2
// variant runs the 32-column panels (forward: experts, backward: hidden) as two 256-bit halves,
// avx512 as one zmm tile, scalar with std::fma. Each is checked against the chain reference and
// bitwise against scalar on a shape with edge panels (Determinism.KernelVariantsGiveTheSameBits
// checks the whole layer).
namespace {

struct IsaGuard {
  sy::CpuIsa saved = sy::cpu_isa();
  ~IsaGuard() { sy::set_cpu_isa(saved); }
};

void variant_matches_chain(sy::CpuIsa isa) {
  if (!sy::cpu_supports(isa)) GTEST_SKIP() << "this CPU cannot run " << sy::cpu_isa_name(isa);
  IsaGuard guard;
  sy::set_cpu_isa(isa);
  GateTester().tokens(1031).hidden(45).TestBackward();
  GateTester().tokens(600).x(DType::fp32).weight(DType::fp32).TestBackward();
  GateTester().tokens(300).hidden(kQwen3_30B_A3B.hidden).experts(64).no_bias().TestBackward();
  GateTester().hidden(45).weight(DType::fp32).router(DType::fp64).TestBackward();
  GateTester().tokens(1031).hidden(45).TestForward();
  GateTester()
      .tokens(300)
      .hidden(kQwen3_30B_A3B.hidden)
      .experts(kQwen3_30B_A3B.num_experts)
      .no_bias()
      .TestForward();
  GateTester().tokens(97).experts(65).x(DType::fp32).weight(DType::fp32).TestForward();
  GateTester().hidden(45).weight(DType::fp32).router(DType::fp64).TestForward();
  if (isa == sy::CpuIsa::scalar) return;
  std::mt19937_64 rng(test_seed(516));
  const Tensor x = randn({777, 2050}, DType::bf16, rng), w = randn({70, 2050}, DType::bf16, rng);
  const Tensor g = randn({777, 70}, DType::fp32, rng);
  const Tensor b = randn({70}, DType::fp32, rng);
  const sy::GateGrads grads = sy::router_gating_linear_backward(g, x, w, Tensor());
  const Tensor logits = sy::router_gating_linear(x, w, b);
  sy::set_cpu_isa(sy::CpuIsa::scalar);
  const sy::GateGrads scalar = sy::router_gating_linear_backward(g, x, w, Tensor());
  EXPECT_TRUE(bitwise_equal(sy::router_gating_linear(x, w, b), logits)) << "logits vs scalar";
  EXPECT_TRUE(bitwise_equal(scalar.grad_x, grads.grad_x)) << "grad_x vs scalar";
  EXPECT_TRUE(bitwise_equal(scalar.grad_weight, grads.grad_weight)) << "grad_weight vs scalar";
}

// After top-k routing without aux or z loss, grad_logits has k nonzeros per row; the backward
// then runs the chains over the nonzero terms only (src/cpu/gate_kernels.cpp), which must give
// bitwise the dense chain: shapes with edge columns, every dtype pair, k in {1, 2, 8}.
void topk_grad_logits_match_chain(sy::CpuIsa isa) {
  if (!sy::cpu_supports(isa)) GTEST_SKIP() << "this CPU cannot run " << sy::cpu_isa_name(isa);
  IsaGuard guard;
  sy::set_cpu_isa(isa);
  GateTester()
      .tokens(200)
      .hidden(kQwen3_30B_A3B.hidden)
      .experts(kQwen3_30B_A3B.num_experts)
      .grad_logits_topk(kQwen3_30B_A3B.top_k)
      .TestBackward();
  GateTester()
      .tokens(300)
      .hidden(kDeepSeekV3.hidden / 16 + 5)
      .experts(kDeepSeekV3.num_experts)
      .no_bias()
      .grad_logits_topk(kDeepSeekV3.top_k)
      .TestBackward();
  GateTester()
      .tokens(97)
      .experts(65)
      .x(DType::fp32)
      .weight(DType::fp32)
      .grad_logits_topk(2)
      .TestBackward();
  GateTester()
      .tokens(7)
      .hidden(45)
      .experts(64)
      .x(DType::fp32)
      .router(DType::fp64)
      .grad_logits_topk(1)
      .TestBackward();
  GateTester()
      .tokens(1)
      .hidden(70)
      .experts(8)
      .weight(DType::fp32)
      .no_bias()
      .grad_logits_topk(1)
      .TestBackward();
  GateTester()
      .tokens(300)
      .hidden(130)
      .experts(64)
      .x(DType::fp64)
      .router(DType::fp64)
      .no_bias()
      .grad_logits_topk(8)
      .TestBackward();
}

}  // namespace

TEST(GateScalar, MatchesChain) { variant_matches_chain(sy::CpuIsa::scalar); }
TEST(GateAvx2, MatchesChainAndScalarBits) { variant_matches_chain(sy::CpuIsa::avx2); }
TEST(GateAvx512, MatchesChainAndScalarBits) { variant_matches_chain(sy::CpuIsa::avx512); }
TEST(GateScalar, BackwardOfTopKGradLogitsMatchesChain) {
  topk_grad_logits_match_chain(sy::CpuIsa::scalar);
}
TEST(GateAvx2, BackwardOfTopKGradLogitsMatchesChain) {
  topk_grad_logits_match_chain(sy::CpuIsa::avx2);
}
TEST(GateAvx512, BackwardOfTopKGradLogitsMatchesChain) {
  topk_grad_logits_match_chain(sy::CpuIsa::avx512);
}

// The sparse backward's work split: W in segments of at most 1 MB (1024 columns at E <= 256 fp32,
// fewer for more experts or fp64), a segment's tokens split across threads when there are fewer
// segments than threads, x in blocks of 512 tokens per grad_w chain. Each output is still its one
// chain, bitwise, at 1 and 2 threads.
namespace {
void sparse_backward_splits_match_chain(int threads) {
  // three W segments of 1024 columns; then one segment, its tokens split across threads, and
  // three grad_w token blocks
  GateTester()
      .tokens(40)
      .hidden(2100)
      .experts(64)
      .grad_logits_topk(4)
      .threads(threads)
      .TestBackward();
  GateTester()
      .tokens(1030)
      .hidden(80)
      .experts(64)
      .grad_logits_topk(4)
      .threads(threads)
      .TestBackward();
  // fp32 grad_x over 8 MB with every row on a cache line: streamed in 128-byte sub-segments, each
  // over all tokens, the last segment's last one half used (2128 = 2·1024 + 2·32 + 16)
  GateTester()
      .tokens(1030)
      .hidden(2128)
      .experts(32)
      .x(DType::fp32)
      .weight(DType::fp32)
      .grad_logits_topk(2)
      .threads(threads)
      .TestBackward();
  GateTester()  // bf16 grad_x over 8 MB on the line grid: rounded and streamed per sub-segment
      .tokens(2020)
      .hidden(2080)
      .experts(32)
      .grad_logits_topk(2)
      .threads(threads)
      .TestBackward();
  GateTester()  // the same size with rows off the line grid: written through the caches, by token
      .tokens(1030)
      .hidden(2111)
      .experts(32)
      .x(DType::fp32)
      .weight(DType::fp32)
      .grad_logits_topk(3)
      .threads(threads)
      .TestBackward();
  // fp32 grad_weight of 4 MB and more with rows of whole lines: streamed chunk row by chunk row,
  // the last chunk 16 columns (2064 = 4·512 + 16)
  GateTester()
      .tokens(300)
      .hidden(2064)
      .experts(512)
      .x(DType::fp32)
      .weight(DType::fp32)
      .grad_logits_topk(8)
      .threads(threads)
      .TestBackward();
  GateTester()  // E 512: segments of 512 columns
      .tokens(100)
      .hidden(700)
      .experts(512)
      .x(DType::fp32)
      .weight(DType::fp32)
      .no_bias()
      .grad_logits_topk(8)
      .threads(threads)
      .TestBackward();
  GateTester()  // fp64, E 160: segments of 768 columns
      .tokens(50)
      .hidden(800)
      .experts(160)
      .x(DType::fp64)
      .router(DType::fp64)
      .no_bias()
      .grad_logits_topk(2)
      .threads(threads)
      .TestBackward();
}
}  // namespace
TEST(GateBackward, SparseWorkSplitMatchesChainOneThread) { sparse_backward_splits_match_chain(1); }
TEST(GateBackward, SparseWorkSplitMatchesChainTwoThreads) { sparse_backward_splits_match_chain(2); }

// The one place where skipping g = 0 terms could change a bit: a negative product that underflows
// to -0, followed by zero terms with +0 products. The dense chain turns -0 into +0
// (fma(0, w > 0, -0) = +0); the result must be that +0.
namespace {
void sparse_backward_keeps_the_dense_sign_of_zero(int64_t T, int64_t H, DType xw = DType::fp32) {
  IsaGuard guard;
  const int64_t E = 16;
  std::vector<float> xv(static_cast<size_t>(T * H), 1.0f), wv(static_cast<size_t>(E * H), 1.0f);
  Tensor g = Tensor::empty({T, E}, DType::fp32);
  for (int64_t i = 0; i < T * E; ++i) g.data<float>()[i] = 0.0f;
  for (int64_t h = 0; h < H; ++h) {
    wv[static_cast<size_t>(2 * H + h)] = -1e-30f;  // g[0,2] · w[2,h] = -1e-60: rounds to -0
    xv[static_cast<size_t>(0 * H + h)] = -1e-30f;  // g[0,2] · x[0,h] likewise
  }
  g.data<float>()[0 * E + 2] = 1e-30f;
  const Tensor x = Tensor::from_vector(xv, {T, H}).to(xw);
  const Tensor w = Tensor::from_vector(wv, {E, H}).to(xw);
  for (sy::CpuIsa isa : {sy::CpuIsa::scalar, sy::CpuIsa::avx2, sy::CpuIsa::avx512}) {
    if (!sy::cpu_supports(isa)) continue;
    SCOPED_TRACE(std::string("isa ") + sy::cpu_isa_name(isa) + " T=" + std::to_string(T) +
                 " H=" + std::to_string(H));
    sy::set_cpu_isa(isa);
    const sy::GateGrads gr = sy::router_gating_linear_backward(g, x, w, Tensor());
    Tensor cx, cw, cb;
    sy::ref::gate_backward_chain<float>(g, x, w, &cx, &cw, &cb);
    EXPECT_TRUE(bitwise_equal(gr.grad_x, cx)) << "grad_x";
    EXPECT_TRUE(bitwise_equal(gr.grad_weight, cw)) << "grad_weight";
    // The dense chains end at +0 (the zero terms after the underflow), not at -0.
    EXPECT_FALSE(std::signbit(gr.grad_x.to_double_vector()[0])) << "grad_x[0,0]";
    EXPECT_FALSE(std::signbit(gr.grad_weight.to_double_vector()[static_cast<size_t>(2 * H)]))
        << "grad_weight[2,0]";
  }
}
}  // namespace

TEST(Gate, BackwardOfSparseGradLogitsKeepsTheDenseSignOfZero) {
  sparse_backward_keeps_the_dense_sign_of_zero(16, 70);
}
// grad_x of 8 MB and more is written with non-temporal stores, and the -0 fix-up reads it back
// (2064 = 2·1024 + 16: the last sub-segment is partial).
TEST(Gate, BackwardOfSparseGradLogitsKeepsTheDenseSignOfZeroInAStreamedGradX) {
  sparse_backward_keeps_the_dense_sign_of_zero(1024, 2064);
}
// bf16 x/W: the fix-up runs on the fp32 sub-segment before it is rounded and streamed.
TEST(Gate, BackwardOfSparseGradLogitsKeepsTheDenseSignOfZeroInAStreamedBf16GradX) {
  sparse_backward_keeps_the_dense_sign_of_zero(2048, 2080, DType::bf16);
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

namespace {

// A NaN or infinity in any input of the forward or backward is named with its token / expert, its
// hidden index and its value (x in each dtype, weight, bias, grad_logits).
void non_finite_is_named(double bad) {
  std::mt19937_64 rng(1);
  const Tensor x = randn({4, 8}, DType::bf16, rng), w = randn({3, 8}, DType::bf16, rng);
  const Tensor b = randn({3}, DType::fp32, rng), g = randn({4, 3}, DType::fp32, rng);
  using E = std::invalid_argument;
  const char* op = "[router_gating_linear] ";
  const std::string v = std::isnan(bad) ? "nan" : bad > 0 ? "inf" : "-inf";
  Tensor xb = x.clone();
  xb.data<sy::bf16>()[2 * 8 + 5] = sy::float_to_bf16(static_cast<float>(bad));
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(xb, w, b), E,
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

}  // namespace

TEST(GateErrors, NanIsNamedWithItsPosition) { non_finite_is_named(std::nan("")); }
TEST(GateErrors, InfIsNamedWithItsPosition) { non_finite_is_named(INFINITY); }
TEST(GateErrors, MinusInfIsNamedWithItsPosition) { non_finite_is_named(-double{INFINITY}); }

// The sparse backward tests W as it packs it and grad_weight as it stores it, instead of a scan
// of each afterwards: a bad W value is named wherever it sits, also in an expert no token's
// grad_logits reaches and in the last W segment (1024 columns per segment here), on every
// variant at 1 and 2 threads; finite inputs whose grad_weight rounds to inf in bf16 still return
// the gradients as computed.
TEST(GateErrors, SparseBackwardNamesABadWeightAnywhere) {
  IsaGuard isa_guard;
  ThreadGuard thread_guard;
  const int64_t T = 24, H = 2100, Ex = 16;
  std::mt19937_64 rng(test_seed(78));
  Tensor g = Tensor::empty({T, Ex}, DType::fp32);
  for (int64_t i = 0; i < T * Ex; ++i) g.data<float>()[i] = 0.0f;
  for (int64_t t = 0; t < T; ++t) g.data<float>()[t * Ex + t % 4] = 0.5f;  // experts 0-3 only
  for (sy::CpuIsa isa : {sy::CpuIsa::scalar, sy::CpuIsa::avx2, sy::CpuIsa::avx512}) {
    if (!sy::cpu_supports(isa)) continue;
    sy::set_cpu_isa(isa);
    for (int threads : {1, 2}) {
      sy::set_num_threads(threads);
      for (DType dt : {DType::bf16, DType::fp32}) {
        SCOPED_TRACE(std::string("isa ") + sy::cpu_isa_name(isa) + " threads " +
                     std::to_string(threads) + " dtype " + sy::dtype_name(dt));
        const Tensor x = randn({T, H}, dt, rng), w = randn({Ex, H}, dt, rng);
        EXPECT_NO_THROW(sy::router_gating_linear_backward(g, x, w, Tensor()));
        for (auto [e, h, v] : {std::tuple{9, 2090, -INFINITY}, std::tuple{15, 0, NAN},
                               std::tuple{2, 1500, INFINITY}}) {
          Tensor wb = w.clone();
          if (dt == DType::bf16) {
            wb.data<sy::bf16>()[e * H + h] = sy::float_to_bf16(v);
          } else {
            wb.data<float>()[e * H + h] = v;
          }
          const std::string name = std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf";
          SY_EXPECT_THROW_MSG(
              sy::router_gating_linear_backward(g, x, wb, Tensor()), std::invalid_argument,
              "[router_gating_linear_backward] weight has a non-finite value " + name +
                  " at expert " + std::to_string(e) + ", hidden " + std::to_string(h));
        }
      }
      // 3.4e38 is finite in fp32 and past bf16's largest value (3.39e38): grad_weight[0, :]
      // rounds to inf from finite inputs, and is returned as computed.
      Tensor x1 = Tensor::empty({T, H}, DType::bf16), gh = g.clone();
      for (int64_t i = 0; i < T * H; ++i) x1.data<sy::bf16>()[i] = sy::float_to_bf16(1.0f);
      for (int64_t t = 0; t < T; ++t) gh.data<float>()[t * Ex + t % 4] = t == 0 ? 3.4e38f : 0.5f;
      const sy::GateGrads over =
          sy::router_gating_linear_backward(gh, x1, randn({Ex, H}, DType::bf16, rng), Tensor());
      EXPECT_TRUE(std::isinf(sy::bf16_to_float(over.grad_weight.data<sy::bf16>()[0])));
    }
  }
}

TEST(GateErrors, DtypesShapesFirstNonFiniteAndBackwardArguments) {
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
    SY_EXPECT_THROW_MSG(sy::router_gating_linear(no_hidden, Tensor::empty({3, 0}, DType::fp32), bb),
                        E, "bias has a non-finite value -inf at expert 1");
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
        SY_EXPECT_THROW_MSG(
            sy::router_gating_linear_backward(gl, xb, ws, Tensor()), E,
            "x has a non-finite value nan at token " + std::to_string(t) + ", hidden 7");
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
