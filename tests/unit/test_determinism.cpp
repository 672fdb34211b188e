// Determinism suite, one process: a whole MoE routing layer
//   gate (router_gating_linear) -> topk_route -> routing plan -> permute -> toy experts ->
//   unpermute
// and its backward
//   unpermute_backward -> toy experts -> permute_backward  +  topk_route_backward -> gate backward
// must be bitwise identical across repeated runs, thread counts 1 and 2, and batch compositions
// (the same tokens in other batches / orders give the same per-token outputs and gradient rows;
// grad_weight and grad_bias are reductions over the batch, so they are compared only for the same
// batch), and between the portable and the AVX2 kernel variants (switchyard/cpu.h). The EP-size
// part (1, 2, 4 ranks) is tests/mpi/test_determinism_mpi.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>

#include "switchyard/cpu.h"
#include "switchyard/gate.h"
#include "switchyard/permute.h"
#include "switchyard/router.h"
#include "switchyard/routing_plan.h"
#include "testing.h"

namespace switchyard {
namespace {

using testing::bitwise_equal;
using testing::repro;
using testing::test_seed;

// A pool of tokens: token j's hidden row and its output gradient row are functions of (seed, j), so
// a batch is just a list of token ids.
struct Pool {
  int64_t H, E;
  Tensor x;       // [N, H] fp32
  Tensor grad_y;  // [N, H] fp32
  Tensor weight;  // [E, H] fp32
  Tensor bias;    // [E] fp32
};

Pool make_pool(uint64_t seed, int64_t N, int64_t H, int64_t E) {
  std::mt19937_64 rng(seed);
  Pool p{H,
         E,
         testing::randn({N, H}, DType::fp32, rng),
         testing::randn({N, H}, DType::fp32, rng),
         testing::randn({E, H}, DType::fp32, rng, 0.2),
         testing::randn({E}, DType::fp32, rng, 0.1)};
  return p;
}

Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& ids) {
  const int64_t H = src.size(1);
  Tensor out = Tensor::empty({static_cast<int64_t>(ids.size()), H}, src.dtype());
  const float* s = src.data<float>();
  float* d = out.data<float>();
  for (size_t i = 0; i < ids.size(); ++i)
    std::copy(s + ids[i] * H, s + (ids[i] + 1) * H, d + static_cast<int64_t>(i) * H);
  return out;
}

Tensor row(const Tensor& t, int64_t i) {
  const int64_t H = t.size(1);
  std::vector<float> v(t.data<float>() + i * H, t.data<float>() + (i + 1) * H);
  return Tensor::from_vector(v, {1, H});
}

// Toy expert e: y = x * (1 + e/8) + e/16 (elementwise, fp32), and its input gradient.
void toy_experts(const Tensor& in, const RoutingPlan& plan, Tensor& out, bool backward) {
  const int64_t H = in.size(1);
  const float* a = in.data<float>();
  float* y = out.data<float>();
  const int32_t* re = plan.row_expert.data<int32_t>();
  for (int64_t r = 0; r < plan.num_rows; ++r) {
    const float s = 1.0f + static_cast<float>(re[r]) / 8.0f, c = static_cast<float>(re[r]) / 16.0f;
    for (int64_t h = 0; h < H; ++h)
      y[r * H + h] = backward ? a[r * H + h] * s : a[r * H + h] * s + c;
  }
}

struct LayerOut {
  Tensor logits, topk_idx, topk_weights, y;
  Tensor grad_x_dispatch, grad_logits, grad_x_gate, grad_weight, grad_bias;
  double aux_loss = 0, z_loss = 0;
};

LayerOut run_layer(const Pool& pool, const std::vector<int64_t>& ids, const RouterConfig& cfg,
                   const RoutingPlanOptions& popt) {
  LayerOut o;
  const Tensor x = gather_rows(pool.x, ids), gy = gather_rows(pool.grad_y, ids);
  o.logits = router_gating_linear(x, pool.weight, pool.bias);
  RouteInputs in;
  RouteResult rr = topk_route(o.logits, in, cfg);
  o.topk_idx = rr.topk_idx;
  o.topk_weights = rr.topk_weights;
  o.aux_loss = rr.aux_loss;
  o.z_loss = rr.z_loss;
  const RoutingPlan plan = build_routing_plan(rr.topk_idx, rr.topk_weights, cfg.num_experts, popt);
  const Tensor xp = permute(x, plan);
  Tensor yp = Tensor::empty(xp.shape(), DType::fp32);
  toy_experts(xp, plan, yp, false);
  o.y = unpermute(yp, plan);
  // Backward.
  UnpermuteGrads ug = unpermute_backward(gy, yp, plan);
  Tensor gxp = Tensor::empty(xp.shape(), DType::fp32);
  toy_experts(ug.grad_permuted, plan, gxp, true);
  o.grad_x_dispatch = permute_backward(gxp, plan);
  o.grad_logits = topk_route_backward(ug.grad_topk_weights, rr).grad_logits;
  GateGrads gg = router_gating_linear_backward(o.grad_logits, x, pool.weight, pool.bias);
  o.grad_x_gate = gg.grad_x;
  o.grad_weight = gg.grad_weight;
  o.grad_bias = gg.grad_bias;
  return o;
}

::testing::AssertionResult same_layer(const LayerOut& a, const LayerOut& b) {
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> all[] = {
      {"logits", {&a.logits, &b.logits}},
      {"topk_idx", {&a.topk_idx, &b.topk_idx}},
      {"topk_weights", {&a.topk_weights, &b.topk_weights}},
      {"y", {&a.y, &b.y}},
      {"grad_x_dispatch", {&a.grad_x_dispatch, &b.grad_x_dispatch}},
      {"grad_logits", {&a.grad_logits, &b.grad_logits}},
      {"grad_x_gate", {&a.grad_x_gate, &b.grad_x_gate}},
      {"grad_weight", {&a.grad_weight, &b.grad_weight}},
      {"grad_bias", {&a.grad_bias, &b.grad_bias}}};
  for (const auto& [name, t] : all) {
    auto r = bitwise_equal(*t.first, *t.second);
    if (!r) return ::testing::AssertionFailure() << name << ": " << r.message();
  }
  if (std::memcmp(&a.aux_loss, &b.aux_loss, sizeof(double)) != 0 ||
      std::memcmp(&a.z_loss, &b.z_loss, sizeof(double)) != 0) {
    return ::testing::AssertionFailure() << "losses differ: " << a.aux_loss << " vs " << b.aux_loss
                                         << ", " << a.z_loss << " vs " << b.z_loss;
  }
  return ::testing::AssertionSuccess();
}

// Configurations: every score function, groups, scaling, capacity with both drop policies and the
// batch-coupled losses (only for same-batch comparisons).
struct Case {
  const char* name;
  RouterConfig cfg;
  RoutingPlanOptions popt;
  bool batch_invariant;  // no capacity, no batch-level losses
};

std::vector<Case> cases(int64_t E) {
  std::vector<Case> cs;
  RouterConfig base;
  base.num_experts = E;
  base.top_k = 4;
  cs.push_back({"softmax", base, {}, true});
  RouterConfig c = base;
  c.score_function = ScoreFunction::sigmoid;
  c.num_groups = 4;
  c.group_topk = 2;
  c.topk_scaling_factor = 2.5;
  cs.push_back({"sigmoid_groups", c, {}, true});
  c = base;
  c.score_function = ScoreFunction::sqrtsoftplus;
  c.pre_softmax = false;
  cs.push_back({"sqrtsoftplus", c, {}, true});
  c = base;
  c.pre_softmax = true;
  c.capacity_factor = 0.8;
  c.aux_loss_type = AuxLossType::aux_loss;
  c.aux_loss_coeff = 1e-2;
  c.z_loss_coeff = 1e-3;
  RoutingPlanOptions po;
  po.capacity_factor = 0.9;
  po.token_drop_policy = TokenDropPolicy::position;
  cs.push_back({"capacity_losses", c, po, false});
  return cs;
}

Case case_named(const std::vector<Case>& cs, const char* name) {
  for (const Case& c : cs) {
    if (std::string(c.name) == name) return c;
  }
  throw std::out_of_range(std::string("no determinism case ") + name);
}

// The whole layer, 300 tokens: repeated at 1 thread, then at 2 threads, twice, bit for bit.
void repeated_runs_and_thread_counts_agree(const char* name) {
  const uint64_t seed = test_seed(7001);
  const int64_t N = 300, H = 72, E = 16;
  const Case c = case_named(cases(E), name);
  const Pool pool = make_pool(seed, N, H, E);
  std::vector<int64_t> ids(N);
  std::iota(ids.begin(), ids.end(), 0);
  const int saved = num_threads();
  SCOPED_TRACE(std::string(c.name) + " " + repro(seed));
  set_num_threads(1);
  const LayerOut ref = run_layer(pool, ids, c.cfg, c.popt);
  // The suite compares something real: outputs and gradients are not all zero.
  EXPECT_GT(std::abs(ref.y.item_as_double(5)) + std::abs(ref.grad_logits.item_as_double(3)), 0.0);
  EXPECT_TRUE(same_layer(ref, run_layer(pool, ids, c.cfg, c.popt))) << "repeat, 1 thread";
  set_num_threads(2);
  EXPECT_TRUE(same_layer(ref, run_layer(pool, ids, c.cfg, c.popt))) << "2 threads";
  EXPECT_TRUE(same_layer(ref, run_layer(pool, ids, c.cfg, c.popt))) << "repeat, 2 threads";
  set_num_threads(saved);
}

// A token's outputs and gradient rows are the same bits in any sub-batch (1 token too), in any
// order, with repeats, at 1 or 2 threads (cases without capacity or batch-level losses).
void same_token_same_rows_in_any_batch(const char* name) {
  const uint64_t seed = test_seed(7002);
  const int64_t N = 240, H = 40, E = 16;
  const Case c = case_named(cases(E), name);
  ASSERT_TRUE(c.batch_invariant) << name;
  const Pool pool = make_pool(seed, N, H, E);
  std::mt19937_64 rng(seed);
  std::vector<int64_t> all(N);
  std::iota(all.begin(), all.end(), 0);
  const int saved = num_threads();
  SCOPED_TRACE(std::string(c.name) + " " + repro(seed));
  set_num_threads(1);
  const LayerOut ref = run_layer(pool, all, c.cfg, c.popt);
  for (int trial = 0; trial < 4; ++trial) {
    set_num_threads(1 + trial % 2);
    // A random sub-batch of random size (1 token too) in random order, some tokens repeated.
    const int64_t n = trial == 0 ? 1 : std::uniform_int_distribution<int64_t>(2, N)(rng);
    std::vector<int64_t> ids(all);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(size_t(n));
    if (n > 3) ids[1] = ids[0];
    const LayerOut o = run_layer(pool, ids, c.cfg, c.popt);
    for (size_t i = 0; i < ids.size(); ++i) {
      const int64_t j = ids[i];
      const std::string at = "token " + std::to_string(j) + " at batch row " + std::to_string(i) +
                             " of " + std::to_string(n) + " (trial " + std::to_string(trial) + ")";
      ASSERT_TRUE(bitwise_equal(row(o.logits, int64_t(i)), row(ref.logits, j))) << "logits, " << at;
      ASSERT_TRUE(bitwise_equal(row(o.y, int64_t(i)), row(ref.y, j))) << "y, " << at;
      ASSERT_TRUE(bitwise_equal(row(o.grad_x_dispatch, int64_t(i)), row(ref.grad_x_dispatch, j)))
          << "grad_x (dispatch path), " << at;
      ASSERT_TRUE(bitwise_equal(row(o.grad_logits, int64_t(i)), row(ref.grad_logits, j)))
          << "grad_logits, " << at;
      ASSERT_TRUE(bitwise_equal(row(o.grad_x_gate, int64_t(i)), row(ref.grad_x_gate, j)))
          << "grad_x (gate path), " << at;
      for (int64_t k = 0; k < c.cfg.top_k; ++k) {
        ASSERT_EQ(o.topk_idx.data<int32_t>()[int64_t(i) * c.cfg.top_k + k],
                  ref.topk_idx.data<int32_t>()[j * c.cfg.top_k + k])
            << at;
      }
    }
  }
  set_num_threads(saved);
}

TEST(DeterminismSoftmax, RepeatedRunsAndThreadCountsAreBitwiseIdentical) {
  repeated_runs_and_thread_counts_agree("softmax");
}
TEST(DeterminismSigmoidGroups, RepeatedRunsAndThreadCountsAreBitwiseIdentical) {
  repeated_runs_and_thread_counts_agree("sigmoid_groups");
}
TEST(DeterminismSqrtSoftplus, RepeatedRunsAndThreadCountsAreBitwiseIdentical) {
  repeated_runs_and_thread_counts_agree("sqrtsoftplus");
}
TEST(DeterminismCapacityAndLosses, RepeatedRunsAndThreadCountsAreBitwiseIdentical) {
  repeated_runs_and_thread_counts_agree("capacity_losses");
}
TEST(DeterminismSoftmax, SameTokenSameRowsInAnyBatchOrOrder) {
  same_token_same_rows_in_any_batch("softmax");
}
TEST(DeterminismSigmoidGroups, SameTokenSameRowsInAnyBatchOrOrder) {
  same_token_same_rows_in_any_batch("sigmoid_groups");
}
TEST(DeterminismSqrtSoftplus, SameTokenSameRowsInAnyBatchOrOrder) {
  same_token_same_rows_in_any_batch("sqrtsoftplus");
}

TEST(Determinism, GradWeightIsAFixedOrderSumOverTheBatch) {
  // grad_weight / grad_bias are reductions over tokens in ascending order: the same batch gives the
  // same bits at 1 and 2 threads, and (the suite can fail) a reordered batch is allowed to differ
  // only by rounding — checked against the double sum so a wrong reduction cannot pass.
  const uint64_t seed = test_seed(7003);
  const int64_t N = 257, H = 33, E = 8;
  const Pool pool = make_pool(seed, N, H, E);
  std::vector<int64_t> ids(N);
  std::iota(ids.begin(), ids.end(), 0);
  const Case c = cases(E)[0];
  set_num_threads(1);
  const LayerOut a = run_layer(pool, ids, c.cfg, c.popt);
  set_num_threads(2);
  const LayerOut b = run_layer(pool, ids, c.cfg, c.popt);
  EXPECT_TRUE(bitwise_equal(a.grad_weight, b.grad_weight)) << repro(seed);
  EXPECT_TRUE(bitwise_equal(a.grad_bias, b.grad_bias)) << repro(seed);
  std::vector<double> want(static_cast<size_t>(E * H), 0.0);
  const auto gl = a.grad_logits.to_double_vector(), xv = pool.x.to_double_vector();
  for (int64_t t = 0; t < N; ++t)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t h = 0; h < H; ++h)
        want[size_t(e * H + h)] += gl[size_t(t * E + e)] * xv[size_t(t * H + h)];
  EXPECT_TRUE(testing::all_close(a.grad_weight, want, 1e-5, 1e-5)) << repro(seed);
  set_num_threads(1);
}

// The run-time kernel choice (scalar, AVX2+FMA, AVX-512) never changes a bit: the whole layer and
// its backward, every routing case, plus the gate on bf16 and fp32 inputs with fp32 and fp64
// accumulation at shapes that are not tile multiples, on every variant this CPU can run, each
// against the scalar one. (The test command also runs the whole suite with
// SWITCHYARD_CPU_ISA=scalar.)
TEST(Determinism, KernelVariantsGiveTheSameBits) {
  std::vector<CpuIsa> vector_isas;
  for (CpuIsa isa : {CpuIsa::avx2, CpuIsa::avx512})
    if (cpu_supports(isa)) vector_isas.push_back(isa);
  if (vector_isas.empty()) {
    GTEST_SKIP() << "this CPU has no AVX2/FMA: only the scalar kernels can run here";
  }
  const uint64_t seed = test_seed(7004);
  const CpuIsa saved = cpu_isa();
  const int64_t N = 1031, H = 72, E = 64;
  const Pool pool = make_pool(seed, N, H, E);
  std::vector<int64_t> ids(N);
  std::iota(ids.begin(), ids.end(), 0);
  for (const Case& c : cases(E)) {
    SCOPED_TRACE(std::string(c.name) + " " + repro(seed));
    set_cpu_isa(CpuIsa::scalar);
    const LayerOut a = run_layer(pool, ids, c.cfg, c.popt);
    for (CpuIsa isa : vector_isas) {
      set_cpu_isa(isa);
      const LayerOut b = run_layer(pool, ids, c.cfg, c.popt);
      EXPECT_TRUE(same_layer(a, b)) << "scalar vs " << cpu_isa_name(isa);
    }
  }
  std::mt19937_64 rng(seed);
  for (DType in : {DType::bf16, DType::fp32}) {
    for (DType acc : {DType::fp32, DType::fp64}) {
      const Tensor x = testing::randn({37, 203}, in, rng), w = testing::randn({29, 203}, in, rng);
      const Tensor b = testing::randn({29}, DType::fp32, rng);
      GateOptions opt;
      opt.router_dtype = acc;
      set_cpu_isa(CpuIsa::scalar);
      const Tensor out0 = router_gating_linear(x, w, b, opt);
      const GateGrads grads0 = router_gating_linear_backward(out0, x, w, b, opt);
      for (CpuIsa isa : vector_isas) {
        set_cpu_isa(isa);
        const Tensor out = router_gating_linear(x, w, b, opt);
        const GateGrads grads = router_gating_linear_backward(out, x, w, b, opt);
        SCOPED_TRACE(std::string("gate ") + dtype_name(in) + " -> " + dtype_name(acc) +
                     ", scalar vs " + cpu_isa_name(isa));
        EXPECT_TRUE(bitwise_equal(out0, out)) << "logits";
        EXPECT_TRUE(bitwise_equal(grads0.grad_x, grads.grad_x)) << "grad_x";
        EXPECT_TRUE(bitwise_equal(grads0.grad_weight, grads.grad_weight)) << "grad_weight";
        EXPECT_TRUE(bitwise_equal(grads0.grad_bias, grads.grad_bias)) << "grad_bias";
      }
    }
  }
  set_cpu_isa(saved);
}

TEST(Determinism, SetCpuIsaRejectsWhatTheCpuCannotRun) {
  EXPECT_STREQ(cpu_isa_name(CpuIsa::scalar), "scalar");
  EXPECT_TRUE(cpu_supports(CpuIsa::scalar));
  const CpuIsa saved = cpu_isa();
  EXPECT_NO_THROW(set_cpu_isa(CpuIsa::scalar));
  EXPECT_EQ(cpu_isa(), CpuIsa::scalar);
  try {
    set_cpu_isa(static_cast<CpuIsa>(7));
    FAIL() << "an unknown isa was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "[set_cpu_isa] isa must be scalar, avx2 or avx512, got 7");
  }
  set_cpu_isa(saved);
}

}  // namespace
}  // namespace switchyard
