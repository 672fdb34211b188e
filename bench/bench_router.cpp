// Routing after the gate: forward and forward+backward at real MoE shapes, against two ceilings
// measured in the same run: the gate GEMM that produces the logits (OpenBLAS sgemm, T x H x E) and
// a memcpy of the logits. The routing should cost a small fraction of the gate GEMM.
//
//   ./build/bench/bench_router --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "model_shapes.h"
#include "switchyard/router.h"
#include "switchyard/tensor.h"
#include "bench_machine.h"

namespace sy = switchyard;

namespace {

// A model's router at a token count (scaled down where the machine needs it).
struct Shape {
  const sy::testing::MoeModel& model;
  int64_t T;
  const char* name;
  int64_t H, E, K;
};

constexpr Shape shape(const sy::testing::MoeModel& m, int64_t T) {
  return {m, T, m.name, m.hidden, m.num_experts, m.top_k};
}

// Qwen3-30B-A3B (softmax, aux loss, plus a z-loss) at T 4096; DeepSeek-V3 (sigmoid, groups 8/4,
// expert bias, scaling 2.5; without its sequence loss) at T 2048 to fit the machine.
const Shape kShapes[] = {shape(sy::testing::kQwen3_30B_A3B, 4096),
                         shape(sy::testing::kDeepSeekV3, 2048)};

sy::Tensor random_logits(int64_t T, int64_t E, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  sy::Tensor z = sy::Tensor::empty({T, E}, sy::DType::fp32);
  for (int64_t i = 0; i < z.numel(); ++i) z.data<float>()[i] = nd(rng);
  return z;
}

sy::RouterConfig config_of(const Shape& s) {
  sy::RouterConfig c = s.model.router_config();
  if (c.aux_loss_type == sy::AuxLossType::seq_aux_loss) {
    c.aux_loss_type = sy::AuxLossType::none;  // needs sequence boundaries; measured without
    c.aux_loss_coeff = 0;
  } else {
    c.z_loss_coeff = 1e-3;
  }
  return c;
}

sy::RouteInputs inputs_of(const Shape& s) {
  sy::RouteInputs in;
  if (s.model.expert_bias) in.expert_bias = sy::Tensor::zeros({s.E}, sy::DType::fp32);
  return in;
}

void set_rate(benchmark::State& state, int64_t T) {
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_route_forward(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  state.SetLabel(s.name);
  const sy::Tensor z = random_logits(s.T, s.E, 1);
  const sy::RouterConfig c = config_of(s);
  const sy::RouteInputs in = inputs_of(s);
  for (auto _ : state) {
    auto r = sy::topk_route(z, in, c);
    benchmark::DoNotOptimize(r.topk_weights.raw());
  }
  set_rate(state, s.T);
}

void BM_route_forward_backward(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  state.SetLabel(s.name);
  const sy::Tensor z = random_logits(s.T, s.E, 2);
  const sy::Tensor gw = sy::Tensor::full({s.T, s.K}, sy::DType::fp32, 0.25);
  const sy::RouterConfig c = config_of(s);
  const sy::RouteInputs in = inputs_of(s);
  for (auto _ : state) {
    auto r = sy::topk_route(z, in, c);
    auto g = sy::topk_route_backward(gw, r);
    benchmark::DoNotOptimize(g.grad_logits.raw());
  }
  set_rate(state, s.T);
}

void BM_route_replay_forward_backward(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  state.SetLabel(s.name);
  const sy::Tensor z = random_logits(s.T, s.E, 3);
  const sy::Tensor gw = sy::Tensor::full({s.T, s.K}, sy::DType::fp32, 0.25);
  const sy::RouterConfig c = config_of(s);
  sy::RouteInputs in = inputs_of(s);
  in.replay_idx = sy::topk_route(random_logits(s.T, s.E, 4), inputs_of(s), c).topk_idx;
  for (auto _ : state) {
    auto r = sy::topk_route(z, in, c);
    auto g = sy::topk_route_backward(gw, r);
    benchmark::DoNotOptimize(g.grad_logits.raw());
  }
  set_rate(state, s.T);
}

// Ceiling 1: the gate GEMM producing these logits, logits[T,E] = X[T,H] * W[E,H]^T in fp32.
void BM_gate_sgemm_ceiling(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  state.SetLabel(s.name);
  std::vector<float> x(static_cast<size_t>(s.T * s.H), 0.01f),
      w(static_cast<size_t>(s.E * s.H), 0.02f), y(static_cast<size_t>(s.T * s.E));
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(s.T),
                static_cast<int>(s.E), static_cast<int>(s.H), 1.0f, x.data(), static_cast<int>(s.H),
                w.data(), static_cast<int>(s.H), 0.0f, y.data(), static_cast<int>(s.E));
    benchmark::DoNotOptimize(y.data());
  }
  set_rate(state, s.T);
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * s.T * s.H * s.E, benchmark::Counter::kIsIterationInvariantRate);
}

// Ceiling 2: copying the logits once (the least any pass over them costs).
void BM_logits_memcpy_ceiling(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  state.SetLabel(s.name);
  std::vector<float> a(static_cast<size_t>(s.T * s.E), 1.0f), b(a.size());
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), a.size() * sizeof(float));
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  set_rate(state, s.T);
}

// The ratio itself, measured interleaved in one loop: routing forward+backward time over the gate
// GEMM time for the same tokens (both on the same threads, same cache state).
void BM_route_over_gate_ratio(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  state.SetLabel(s.name);
  const sy::Tensor z = random_logits(s.T, s.E, 5);
  const sy::Tensor gw = sy::Tensor::full({s.T, s.K}, sy::DType::fp32, 0.25);
  const sy::RouterConfig c = config_of(s);
  const sy::RouteInputs in = inputs_of(s);
  std::vector<float> x(static_cast<size_t>(s.T * s.H), 0.01f),
      w(static_cast<size_t>(s.E * s.H), 0.02f), y(static_cast<size_t>(s.T * s.E));
  double route_s = 0, gate_s = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(s.T),
                static_cast<int>(s.E), static_cast<int>(s.H), 1.0f, x.data(), static_cast<int>(s.H),
                w.data(), static_cast<int>(s.H), 0.0f, y.data(), static_cast<int>(s.E));
    benchmark::DoNotOptimize(y.data());
    const auto t1 = std::chrono::steady_clock::now();
    auto r = sy::topk_route(z, in, c);
    auto g = sy::topk_route_backward(gw, r);
    benchmark::DoNotOptimize(g.grad_logits.raw());
    const auto t2 = std::chrono::steady_clock::now();
    gate_s += std::chrono::duration<double>(t1 - t0).count();
    route_s += std::chrono::duration<double>(t2 - t1).count();
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["gate_us"] = 1e6 * gate_s / n;
  state.counters["route_fwd_bwd_us"] = 1e6 * route_s / n;
  state.counters["route/gate"] = route_s / gate_s;
}

}  // namespace

BENCHMARK(BM_route_over_gate_ratio)->DenseRange(0, 1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_route_forward)->DenseRange(0, 1)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_route_forward_backward)
    ->DenseRange(0, 1)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_route_replay_forward_backward)
    ->DenseRange(0, 1)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_gate_sgemm_ceiling)->DenseRange(0, 1)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_logits_memcpy_ceiling)->DenseRange(0, 1)->Unit(benchmark::kMicrosecond)->UseRealTime();

SY_BENCHMARK_MAIN();
