// permute / unpermute bandwidth against a memcpy of the same bytes, measured interleaved in the
// same iterations (the machine is shared and noisy: only the ratio is meaningful).
// Shapes: Qwen3-30B-A3B (H 2048, E 128, K 8) and DeepSeek-V3 (H 7168, E 256, K 8), scaled in T.
//   build/bench/bench_permute --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "model_shapes.h"
#include "switchyard/permute.h"
#include "switchyard/routing_plan.h"
#include "testing.h"
#include "bench_machine.h"

namespace switchyard {
namespace {

using Clock = std::chrono::steady_clock;

// Top-k of distinct uniformly random experts per token (what a trained router looks like to the
// memory system: scattered rows).
RoutingPlan random_plan(int64_t T, int64_t E, int64_t K, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  std::vector<float> w(static_cast<size_t>(T * K), 1.0f / static_cast<float>(K));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    for (int64_t k = 0; k < K; ++k) {
      std::uniform_int_distribution<int64_t> d(k, E - 1);
      std::swap(perm[static_cast<size_t>(k)], perm[static_cast<size_t>(d(rng))]);
      idx[static_cast<size_t>(t * K + k)] = perm[static_cast<size_t>(k)];
    }
  }
  return build_routing_plan(Tensor::from_vector(idx, {T, K}), Tensor::from_vector(w, {T, K}), E);
}

// The ceiling: memcpy split over the same OpenMP threads the kernels use.
void parallel_memcpy(void* dst, const void* src, size_t n) {
  const int nt = num_threads();
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int i = 0; i < nt; ++i) {
    const size_t b = n * static_cast<size_t>(i) / static_cast<size_t>(nt);
    const size_t e = n * static_cast<size_t>(i + 1) / static_cast<size_t>(nt);
    std::memcpy(static_cast<char*>(dst) + b, static_cast<const char*>(src) + b, e - b);
  }
}

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// which: 0 = permute, 1 = unpermute (weighted), 2 = permute + unpermute
void BM_Permute(benchmark::State& state) {
  const int64_t T = state.range(0), H = state.range(1), E = state.range(2), K = state.range(3);
  const int which = static_cast<int>(state.range(4));
  const DType dt = state.range(5) ? DType::bf16 : DType::fp32;
  RoutingPlan plan = random_plan(T, E, K, 42);
  std::mt19937_64 rng(7);
  Tensor x = testing::randn({T, H}, dt, rng);
  Tensor Y = permute(x, plan);
  Tensor y = unpermute(Y, plan);  // outputs allocated once, reused (as a training step would)
  const size_t row = static_cast<size_t>(H) * dtype_size(dt);
  // Bytes each op moves (read + write), and a memcpy moving the same: permute reads and writes R
  // rows; unpermute reads R rows and writes T rows.
  const size_t perm_bytes = 2 * static_cast<size_t>(plan.num_rows) * row;
  const size_t unperm_bytes = (static_cast<size_t>(plan.num_rows) + static_cast<size_t>(T)) * row;
  const size_t bytes = which == 0   ? perm_bytes
                       : which == 1 ? unperm_bytes
                                    : perm_bytes + unperm_bytes;
  std::vector<unsigned char> src(bytes / 2 + 64), dst(bytes / 2 + 64);
  std::memset(src.data(), 1, src.size());
  std::memset(dst.data(), 2, dst.size());
  double t_ours = 0, t_copy = 0;
  for (auto _ : state) {
    auto a = Clock::now();
    if (which == 0 || which == 2) permute_into(x, Y, plan);
    if (which == 1 || which == 2) unpermute_into(Y, y, plan);
    benchmark::ClobberMemory();
    auto b = Clock::now();
    parallel_memcpy(dst.data(), src.data(), bytes / 2);  // bytes/2 read + bytes/2 written
    benchmark::ClobberMemory();
    auto c = Clock::now();
    t_ours += seconds(a, b);
    t_copy += seconds(b, c);
    state.SetIterationTime(seconds(a, b));
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["GB/s"] = static_cast<double>(bytes) * n / t_ours / 1e9;
  state.counters["memcpy_GB/s"] = static_cast<double>(bytes) * n / t_copy / 1e9;
  state.counters["share_of_memcpy"] = t_copy / t_ours;
  state.counters["tokens/s"] = static_cast<double>(T) * n / t_ours;
  state.SetLabel(std::string(which == 0   ? "permute"
                             : which == 1 ? "unpermute"
                                          : "permute+unpermute") +
                 " " + dtype_name(dt));
}

void args(benchmark::internal::Benchmark* b) {
  constexpr const testing::MoeModel& q = testing::kQwen3_30B_A3B;
  constexpr const testing::MoeModel& d = testing::kDeepSeekV3;
  for (int dt : {1, 0})
    for (int which : {0, 1, 2}) b->Args({4096, q.hidden, q.num_experts, q.top_k, which, dt});
  b->Args({1024, d.hidden, d.num_experts, d.top_k, 2, 1});  // fewer tokens to fit the machine
  b->ArgNames({"T", "H", "E", "K", "op", "bf16"});
}

BENCHMARK(BM_Permute)->Apply(args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.5);

}  // namespace
}  // namespace switchyard

SY_BENCHMARK_MAIN();
