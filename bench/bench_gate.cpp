// Router gate benchmark: Qwen3-30B-A3B's gate (T=4096 tokens, H=2048, E=128), bf16 x and W, fp32
// router, forward and backward, against OpenBLAS sgemm of the same shapes and a large square sgemm
// (the machine's sgemm peak) measured in the same run. Arguments: threads (1, 2); the backward
// rows also run a DeepSeek-V3-like gate (H=7168, E=256) at T=1024 tokens, scaled to fit the
// machine. The context lines name the CPU model, the kernel ISA and OpenBLAS's kernel core (its
// sgemm is the ceiling: `OPENBLAS_CORETYPE=Haswell` measures the AVX2 ceiling on an AVX-512 CPU).
// `SWITCHYARD_CPU_ISA=avx2` runs the AVX2 kernels on an AVX-512 CPU (with the Haswell ceiling:
// what a CPU without AVX-512 sees).
//
//   ./build/bench/bench_gate --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <map>
#include <string>
#include <random>
#include <vector>

#include "cpu/gate_kernels.h"
#include "switchyard/cpu.h"
#include "model_shapes.h"
#include "switchyard/gate.h"
#include "bench_machine.h"
#include "testing.h"

namespace sy = switchyard;
using sy::DType;
using sy::Tensor;

namespace {

// Qwen3-30B-A3B's gate at 4096 tokens; DeepSeek-V3's (backward rows) at 1024 tokens to fit.
constexpr int64_t kT = 4096, kH = sy::testing::kQwen3_30B_A3B.hidden,
                  kE = sy::testing::kQwen3_30B_A3B.num_experts;
constexpr int64_t kDeepSeekT = 1024, kDeepSeekH = sy::testing::kDeepSeekV3.hidden,
                  kDeepSeekE = sy::testing::kDeepSeekV3.num_experts;

extern "C" char* openblas_get_corename(void);

void set_threads(int n) {
  sy::set_num_threads(n);
  openblas_set_num_threads(n);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// CPU seconds of the whole process (all threads).
double process_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Per-iteration clocks: wall time and process CPU time divided by the thread count. On a shared
// 2-core machine another process can take a core for part of a run: the best iteration is then the
// stable wall-clock figure, and CPU time (what our threads actually ran, but including OpenMP /
// OpenBLAS spin-waits) the stable one when the machine is never quiet.
struct IterTimer {
  double best = 1e300, total = 0, best_cpu = 1e300;
  int threads = 1;
  std::chrono::steady_clock::time_point t0;
  double c0 = 0;
  void start() {
    c0 = process_cpu_seconds();
    t0 = std::chrono::steady_clock::now();
  }
  void stop() {
    const double s = seconds_since(t0);
    const double c = (process_cpu_seconds() - c0) / threads;
    best = std::min(best, s);
    best_cpu = std::min(best_cpu, c);
    total += s;
  }
};

struct Peak {
  double wall = 0, cpu = 0;  // GFLOP/s
};

// The machine's sgemm ceiling for `threads`: best of a few large square sgemm calls (N=1536).
// Re-measured after every benchmark and the best value seen in this process is kept, so that a
// moment when another process holds a core can only make a ratio pessimistic, never flattering.
Peak sgemm_peak_gflops(int threads, int reps = 3) {
  static std::map<int, Peak> best_seen;
  set_threads(threads);
  const int n = 1536;
  static std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  Peak& best = best_seen[threads];
  IterTimer it;
  it.threads = threads;
  for (int rep = 0; rep < reps; ++rep) {
    it.start();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    it.stop();
  }
  const double flops = 2.0 * n * n * n;
  best.wall = std::max(best.wall, flops / it.best / 1e9);
  best.cpu = std::max(best.cpu, flops / it.best_cpu / 1e9);
  return best;
}

// Counters: GFLOP/s (mean over iterations), best GFLOP/s (best iteration, wall clock), the sgemm
// peak (best of, wall clock) and vs_peak = best / peak; cpu_vs_peak is the same ratio in CPU time.
void report(benchmark::State& state, double flops_per_iter, const IterTimer& it, int threads,
            int64_t tokens = kT) {
  const double mean = flops_per_iter * static_cast<double>(state.iterations()) / it.total / 1e9;
  const double best = flops_per_iter / it.best / 1e9;
  const Peak peak = sgemm_peak_gflops(threads);
  state.counters["GFLOP/s"] = mean;
  state.counters["best_GFLOP/s"] = best;
  state.counters["sgemm_peak"] = peak.wall;
  state.counters["vs_peak"] = best / peak.wall;
  state.counters["cpu_vs_peak"] = (flops_per_iter / it.best_cpu / 1e9) / peak.cpu;
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(tokens) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}

struct Inputs {
  Tensor x, w, g;
};

Inputs make_inputs(DType xw, int64_t T = kT, int64_t H = kH, int64_t E = kE) {
  std::mt19937_64 rng(7);
  return {sy::testing::randn({T, H}, xw, rng), sy::testing::randn({E, H}, xw, rng, 0.02),
          sy::testing::randn({T, E}, DType::fp32, rng)};
}

// Runs `body` once untimed, then times it per iteration on `threads` threads (the sgemm peak is
// refreshed first) and reports its rate: every benchmark below is this loop around one call.
template <class F>
void timed(benchmark::State& state, int threads, double flops_per_iter, F&& body,
           int64_t tokens = kT) {
  sgemm_peak_gflops(threads, 5);
  set_threads(threads);
  body();  // warm-up
  IterTimer it;
  it.threads = threads;
  for (auto _ : state) {
    it.start();
    body();
    it.stop();
  }
  report(state, flops_per_iter, it, threads, tokens);
}

void BM_GateForward(benchmark::State& state, DType xw, DType router) {
  const Inputs in = make_inputs(xw);
  const sy::GateOptions opt{router};
  timed(state, static_cast<int>(state.range(0)), 2.0 * kT * kH * kE, [&] {
    benchmark::DoNotOptimize(sy::router_gating_linear(in.x, in.w, Tensor(), opt).raw());
  });
}

// Arguments of the backward rows: tokens, hidden, experts, threads.
void BM_GateBackward(benchmark::State& state) {
  const int64_t T = state.range(0), H = state.range(1), E = state.range(2);
  const Inputs in = make_inputs(DType::bf16, T, H, E);
  // grad_x and grad_weight
  timed(
      state, static_cast<int>(state.range(3)), 4.0 * T * H * E,
      [&] {
        benchmark::DoNotOptimize(
            sy::router_gating_linear_backward(in.g, in.x, in.w, Tensor()).grad_x.raw());
      },
      T);
}

// The backward after top-k routing without aux or z loss: grad_logits has K nonzeros per row, and
// the kernels run the chains over those terms only (bitwise the dense result). Rates count the
// dense product's flops (4·T·H·E), so vs_peak above 1 is the sparsity at work; the peer row is
// BM_SgemmBackwardShapes (dense sgemm does not look at zeros). Arguments: T, H, E, K, threads;
// x and W bf16, or fp32 (the ...Fp32 row: grad_x is then large enough to be written around the
// caches).
void topk_backward(benchmark::State& state, DType dtype) {
  const int64_t T = state.range(0), H = state.range(1), E = state.range(2), K = state.range(3);
  Inputs in = make_inputs(dtype, T, H, E);
  std::mt19937_64 rng(11);
  float* g = in.g.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> cols(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) cols[static_cast<size_t>(e)] = e;
    std::shuffle(cols.begin(), cols.end(), rng);
    for (int64_t j = K; j < E; ++j) g[t * E + cols[static_cast<size_t>(j)]] = 0.0f;
  }
  timed(
      state, static_cast<int>(state.range(4)), 4.0 * T * H * E,
      [&] {
        benchmark::DoNotOptimize(
            sy::router_gating_linear_backward(in.g, in.x, in.w, Tensor()).grad_x.raw());
      },
      T);
}

void BM_GateBackwardTopK(benchmark::State& state) { topk_backward(state, DType::bf16); }
void BM_GateBackwardTopKFp32(benchmark::State& state) { topk_backward(state, DType::fp32); }

// The backward kernel alone (src/cpu), into outputs allocated once: without the front-end's
// argument scan and the page faults of fresh output tensors, which the row above includes.
void BM_GateBackwardKernel(benchmark::State& state) {
  const int64_t T = state.range(0), H = state.range(1), E = state.range(2);
  const Inputs in = make_inputs(DType::bf16, T, H, E);
  Tensor gx = Tensor::empty({T, H}, DType::bf16), gw = Tensor::empty({E, H}, DType::bf16);
  timed(
      state, static_cast<int>(state.range(3)), 4.0 * T * H * E,
      [&] {
        sy::cpu::gate_backward(in.g.raw(), in.x.raw(), DType::bf16, in.w.raw(), DType::bf16,
                               gx.raw(), gw.raw(), nullptr, DType::fp32, T, H, E);
        benchmark::DoNotOptimize(gx.raw());
      },
      T);
}

// Peer: OpenBLAS sgemm on fp32 copies, logits[T,E] = x[T,H]·W[E,H]ᵀ (what the gate computes,
// without the bf16 conversion or the fixed order).
void BM_SgemmForwardShape(benchmark::State& state) {
  const Inputs in = make_inputs(DType::fp32);
  std::vector<float> c(kT * kE);
  timed(state, static_cast<int>(state.range(0)), 2.0 * kT * kH * kE, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kT, kE, kH, 1.0f, in.x.data<float>(), kH,
                in.w.data<float>(), kH, 0.0f, c.data(), kE);
    benchmark::DoNotOptimize(c.data());
  });
}

// Peer: the backward's two sgemms, grad_x[T,H] = G[T,E]·W[E,H] and grad_w[E,H] = G[T,E]ᵀ·x[T,H].
void BM_SgemmBackwardShapes(benchmark::State& state) {
  const int T = static_cast<int>(state.range(0)), H = static_cast<int>(state.range(1)),
            E = static_cast<int>(state.range(2));
  const Inputs in = make_inputs(DType::fp32, T, H, E);
  std::vector<float> gx(static_cast<size_t>(T) * H), gw(static_cast<size_t>(E) * H);
  timed(
      state, static_cast<int>(state.range(3)), 4.0 * T * H * E,
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, H, E, 1.0f, in.g.data<float>(),
                    E, in.w.data<float>(), H, 0.0f, gx.data(), H);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, E, H, T, 1.0f, in.g.data<float>(), E,
                    in.x.data<float>(), H, 0.0f, gw.data(), H);
        benchmark::DoNotOptimize(gx.data());
        benchmark::DoNotOptimize(gw.data());
      },
      T);
}

// Fewer tokens (a rollout micro-batch, decode): the per-call W packing (E·H conversions) and the
// argument scan weigh more. bf16 x/W, fp32 router, against sgemm on fp32 copies of the same shape.
// Arguments: tokens, threads.
void BM_GateForwardTokens(benchmark::State& state) {
  const int64_t T = state.range(0);
  std::mt19937_64 rng(9);
  const Tensor x = sy::testing::randn({T, kH}, DType::bf16, rng);
  const Tensor w = sy::testing::randn({kE, kH}, DType::bf16, rng, 0.02);
  timed(
      state, static_cast<int>(state.range(1)), 2.0 * T * kH * kE,
      [&] { benchmark::DoNotOptimize(sy::router_gating_linear(x, w, Tensor()).raw()); }, T);
}

void BM_SgemmForwardTokens(benchmark::State& state) {
  const int64_t T = state.range(0);
  std::mt19937_64 rng(9);
  const Tensor x = sy::testing::randn({T, kH}, DType::fp32, rng);
  const Tensor w = sy::testing::randn({kE, kH}, DType::fp32, rng, 0.02);
  std::vector<float> c(T * kE);
  timed(
      state, static_cast<int>(state.range(1)), 2.0 * T * kH * kE,
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(T), kE, kH, 1.0f,
                    x.data<float>(), kH, w.data<float>(), kH, 0.0f, c.data(), kE);
        benchmark::DoNotOptimize(c.data());
      },
      T);
}

void token_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens", "threads"})->Unit(benchmark::kMicrosecond)->UseRealTime();
  for (int64_t t : {1, 16, 64, 256, 1024}) b->Args({t, 1});
}

// The ceiling itself, as a row of the table.
void BM_SgemmPeakSquare(benchmark::State& state) {
  const int n = 1536;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  timed(state, static_cast<int>(state.range(0)), 2.0 * n * n * n, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  });
}

void thread_args(benchmark::internal::Benchmark* b) {
  b->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
}

// Qwen3-30B-A3B (T 4096, H 2048, E 128) and DeepSeek-V3-like (H 7168, E 256, T 1024 to fit).
void backward_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"T", "H", "E", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
  for (int threads : {1, 2}) {
    b->Args({kT, kH, kE, threads});
    b->Args({kDeepSeekT, kDeepSeekH, kDeepSeekE, threads});
  }
}

void topk_backward_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"T", "H", "E", "K", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
  for (int threads : {1, 2}) {
    b->Args({kT, kH, kE, sy::testing::kQwen3_30B_A3B.top_k, threads});
    b->Args({kDeepSeekT, kDeepSeekH, kDeepSeekE, sy::testing::kDeepSeekV3.top_k, threads});
  }
}

}  // namespace

BENCHMARK(BM_SgemmPeakSquare)->Apply(thread_args);
BENCHMARK_CAPTURE(BM_GateForward, bf16_fp32router, DType::bf16, DType::fp32)->Apply(thread_args);
BENCHMARK_CAPTURE(BM_GateForward, fp32_fp32router, DType::fp32, DType::fp32)->Apply(thread_args);
BENCHMARK_CAPTURE(BM_GateForward, bf16_fp64router, DType::bf16, DType::fp64)->Apply(thread_args);
BENCHMARK(BM_SgemmForwardShape)->Apply(thread_args);
BENCHMARK(BM_GateBackward)->Apply(backward_args);
BENCHMARK(BM_GateBackwardKernel)->Apply(backward_args);
BENCHMARK(BM_GateBackwardTopK)->Apply(topk_backward_args);
BENCHMARK(BM_GateBackwardTopKFp32)->Apply(topk_backward_args);
BENCHMARK(BM_SgemmBackwardShapes)->Apply(backward_args);
BENCHMARK(BM_GateForwardTokens)->Apply(token_args);
BENCHMARK(BM_SgemmForwardTokens)->Apply(token_args);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  sy::bench::add_machine_context();
  benchmark::AddCustomContext("openblas_core", openblas_get_corename());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
