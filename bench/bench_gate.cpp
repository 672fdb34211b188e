// Router gate benchmark: Qwen3-30B-A3B's gate (T=4096 tokens, H=2048, E=128), bf16 x and W, fp32
// router, forward and backward, against OpenBLAS sgemm of the same shapes and a large square sgemm
// (the machine's sgemm peak) measured in the same run. Arguments: threads (1, 2).
//
//   ./build/bench/bench_gate --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <vector>

#include "switchyard/gate.h"
#include "testing.h"

namespace sy = switchyard;
using sy::DType;
using sy::Tensor;

namespace {

constexpr int64_t kT = 4096, kH = 2048, kE = 128;  // Qwen3-30B-A3B gate

void set_threads(int n) {
  sy::set_num_threads(n);
  openblas_set_num_threads(n);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The machine's sgemm ceiling for `threads`: best of a few large square sgemm calls (N=1536),
// measured once per thread count in this process.
double sgemm_peak_gflops(int threads) {
  static std::map<int, double> cache;
  auto it = cache.find(threads);
  if (it != cache.end()) return it->second;
  set_threads(threads);
  const int n = 1536;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(),
                n, 0.0f, c.data(), n);
    best = std::max(best, 2.0 * n * n * n / seconds_since(t0) / 1e9);
  }
  cache[threads] = best;
  return best;
}

// Sets GFLOP/s (from our own clock, so the ratio can be formed here) and the ratio to the peak.
void report(benchmark::State& state, double flops_per_iter, double seconds, int threads) {
  const double gflops = flops_per_iter * static_cast<double>(state.iterations()) / seconds / 1e9;
  state.counters["GFLOP/s"] = gflops;
  state.counters["sgemm_peak"] = sgemm_peak_gflops(threads);
  state.counters["vs_peak"] = gflops / sgemm_peak_gflops(threads);
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(kT) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}

struct Inputs {
  Tensor x, w, g;
};

Inputs make_inputs(DType xw) {
  std::mt19937_64 rng(7);
  return {sy::testing::randn({kT, kH}, xw, rng), sy::testing::randn({kE, kH}, xw, rng, 0.02),
          sy::testing::randn({kT, kE}, DType::fp32, rng)};
}

void BM_GateForward(benchmark::State& state, DType xw, DType router) {
  const int threads = static_cast<int>(state.range(0));
  const Inputs in = make_inputs(xw);
  sgemm_peak_gflops(threads);
  set_threads(threads);
  const sy::GateOptions opt{router};
  benchmark::DoNotOptimize(sy::router_gating_linear(in.x, in.w, Tensor(), opt));  // warm-up
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    Tensor z = sy::router_gating_linear(in.x, in.w, Tensor(), opt);
    benchmark::DoNotOptimize(z.raw());
  }
  report(state, 2.0 * kT * kH * kE, seconds_since(t0), threads);
}

void BM_GateBackward(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const Inputs in = make_inputs(DType::bf16);
  sgemm_peak_gflops(threads);
  set_threads(threads);
  benchmark::DoNotOptimize(sy::router_gating_linear_backward(in.g, in.x, in.w, Tensor()));
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    sy::GateGrads gr = sy::router_gating_linear_backward(in.g, in.x, in.w, Tensor());
    benchmark::DoNotOptimize(gr.grad_x.raw());
  }
  report(state, 4.0 * kT * kH * kE, seconds_since(t0), threads);  // grad_x and grad_weight
}

// Peer: OpenBLAS sgemm on fp32 copies, logits[T,E] = x[T,H]·W[E,H]ᵀ (what the gate computes,
// without the bf16 conversion or the fixed order).
void BM_SgemmForwardShape(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const Inputs in = make_inputs(DType::fp32);
  std::vector<float> c(kT * kE);
  sgemm_peak_gflops(threads);
  set_threads(threads);
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kT, kE, kH, 1.0f, in.x.data<float>(), kH,
                in.w.data<float>(), kH, 0.0f, c.data(), kE);
    benchmark::DoNotOptimize(c.data());
  }
  report(state, 2.0 * kT * kH * kE, seconds_since(t0), threads);
}

// Peer: the backward's two sgemms, grad_x[T,H] = G[T,E]·W[E,H] and grad_w[E,H] = G[T,E]ᵀ·x[T,H].
void BM_SgemmBackwardShapes(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const Inputs in = make_inputs(DType::fp32);
  std::vector<float> gx(kT * kH), gw(kE * kH);
  sgemm_peak_gflops(threads);
  set_threads(threads);
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, kT, kH, kE, 1.0f, in.g.data<float>(), kE,
                in.w.data<float>(), kH, 0.0f, gx.data(), kH);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, kE, kH, kT, 1.0f, in.g.data<float>(), kE,
                in.x.data<float>(), kH, 0.0f, gw.data(), kH);
    benchmark::DoNotOptimize(gx.data());
    benchmark::DoNotOptimize(gw.data());
  }
  report(state, 4.0 * kT * kH * kE, seconds_since(t0), threads);
}

// The ceiling itself, as a row of the table.
void BM_SgemmPeakSquare(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int n = 1536;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  sgemm_peak_gflops(threads);
  set_threads(threads);
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  report(state, 2.0 * n * n * n, seconds_since(t0), threads);
}

void thread_args(benchmark::internal::Benchmark* b) {
  b->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_SgemmPeakSquare)->Apply(thread_args);
BENCHMARK_CAPTURE(BM_GateForward, bf16_fp32router, DType::bf16, DType::fp32)->Apply(thread_args);
BENCHMARK_CAPTURE(BM_GateForward, fp32_fp32router, DType::fp32, DType::fp32)->Apply(thread_args);
BENCHMARK_CAPTURE(BM_GateForward, bf16_fp64router, DType::bf16, DType::fp64)->Apply(thread_args);
BENCHMARK(BM_SgemmForwardShape)->Apply(thread_args);
BENCHMARK(BM_GateBackward)->Apply(thread_args);
BENCHMARK(BM_SgemmBackwardShapes)->Apply(thread_args);

BENCHMARK_MAIN();
