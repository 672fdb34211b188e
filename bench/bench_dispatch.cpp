// dispatch + combine over MPI against the floor: raw MPI_Alltoallv of the same payload plus one
// local copy, in each direction, timed in the same iterations (interleaved) on the same ranks.
// Run under MPI (2 ranks, Qwen3-30B-A3B shape: T 4096 per rank, H 2048, E 128, K 8):
//   OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
//     mpirun -np 2 --oversubscribe build/bench/bench_dispatch --benchmark_counters_tabular=true
// Every rank runs the same fixed number of iterations (collectives must match); rank 0 reports
// the slowest rank's time.
#include <cstdio>

#ifndef SWITCHYARD_WITH_MPI
int main() {
  std::puts("bench_dispatch needs a build with SWITCHYARD_MPI=ON");
  return 0;
}
#else
#include <benchmark/benchmark.h>
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "model_shapes.h"
#include "switchyard/dispatcher.h"
#include "testing.h"

namespace switchyard {
namespace {

using Clock = std::chrono::steady_clock;

std::shared_ptr<dist::Communicator>& comm() {
  static std::shared_ptr<dist::Communicator> c;
  return c;
}

double max_over_ranks(double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return v;
}

double since(Clock::time_point a) {
  return std::chrono::duration<double>(Clock::now() - a).count();
}

void BM_DispatchCombine(benchmark::State& state) {
  dist::Communicator& c = *comm();
  const int64_t T = state.range(0), H = state.range(1), E = state.range(2), K = state.range(3);
  const auto kind =
      state.range(4) ? dist::DispatcherKind::all_gather : dist::DispatcherKind::all_to_all;
  const DType dt = state.range(5) ? DType::bf16 : DType::fp32;
  const int P = c.size(), me = c.rank();
  std::mt19937_64 rng(1234 + static_cast<uint64_t>(me));
  Tensor x = testing::randn({T, H}, dt, rng);
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {  // K distinct uniformly random experts per token
    for (int64_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    for (int64_t k = 0; k < K; ++k) {
      std::uniform_int_distribution<int64_t> d(k, E - 1);
      std::swap(perm[static_cast<size_t>(k)], perm[static_cast<size_t>(d(rng))]);
      idx[static_cast<size_t>(t * K + k)] = perm[static_cast<size_t>(k)];
    }
  }
  Tensor topk_idx = Tensor::from_vector(idx, {T, K});
  Tensor topk_w = Tensor::full({T, K}, DType::fp32, 1.0 / static_cast<double>(K));
  dist::DispatchOptions opt;
  opt.num_experts = E;
  opt.kind = kind;

  // The floor: the same rows per peer, pre-allocated buffers, one MPI_Alltoallv and one local copy
  // per direction.
  dist::DispatchResult warm = dist::dispatch(x, topk_idx, topk_w, opt, c);
  const int64_t rb = H * static_cast<int64_t>(dtype_size(dt));
  std::vector<int> sc(P), sd(P), rc(P), rd(P);
  {
    const int64_t L = E / P;
    int64_t so = 0, ro = 0;
    for (int r = 0; r < P; ++r) {
      int64_t s = 0, q = 0;
      for (int64_t el = 0; el < L; ++el) {
        s += warm.handle.rank_expert_counts[static_cast<size_t>(me * E + r * L + el)];
        q += warm.handle.rank_expert_counts[static_cast<size_t>(r * E + me * L + el)];
      }
      sc[r] = static_cast<int>(s);
      rc[r] = static_cast<int>(q);
      sd[r] = static_cast<int>(so);
      rd[r] = static_cast<int>(ro);
      so += s;
      ro += q;
    }
  }
  const int64_t n_send = sd[P - 1] + sc[P - 1], n_recv = rd[P - 1] + rc[P - 1];
  MPI_Datatype row;
  MPI_Type_contiguous(static_cast<int>(rb), MPI_BYTE, &row);
  MPI_Type_commit(&row);
  std::vector<unsigned char> a(static_cast<size_t>(std::max<int64_t>(n_send, n_recv) * rb + 64), 1),
      b(a.size(), 2), out(a.size(), 3);

  double t_ours = 0, t_raw = 0;
  for (auto _ : state) {
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = Clock::now();
    dist::DispatchResult d = dist::dispatch(x, topk_idx, topk_w, opt, c);
    Tensor y = dist::combine(d.recv_x, d.handle, {}, c);  // identity experts
    benchmark::DoNotOptimize(y.raw());
    const double ours = max_over_ranks(since(t0));
    MPI_Barrier(MPI_COMM_WORLD);
    auto t1 = Clock::now();
    MPI_Alltoallv(a.data(), sc.data(), sd.data(), row, b.data(), rc.data(), rd.data(), row,
                  MPI_COMM_WORLD);
    std::memcpy(out.data(), b.data(), static_cast<size_t>(n_recv * rb));
    MPI_Alltoallv(out.data(), rc.data(), rd.data(), row, a.data(), sc.data(), sd.data(), row,
                  MPI_COMM_WORLD);
    std::memcpy(b.data(), a.data(), static_cast<size_t>(n_send * rb));
    benchmark::ClobberMemory();
    const double raw = max_over_ranks(since(t1));
    t_ours += ours;
    t_raw += raw;
    state.SetIterationTime(ours);
  }
  MPI_Type_free(&row);
  const double n = static_cast<double>(state.iterations());
  state.counters["ours_ms"] = t_ours / n * 1e3;
  state.counters["raw_a2av+copy_ms"] = t_raw / n * 1e3;
  state.counters["ratio"] = t_ours / t_raw;
  state.counters["payload_GB/s"] = static_cast<double>((n_send + n_recv) * rb) * n / t_ours / 1e9;
  state.SetLabel(
      std::string(kind == dist::DispatcherKind::all_to_all ? "all_to_all " : "all_gather ") +
      dtype_name(dt) + " EP=" + std::to_string(P));
}

// Qwen3-30B-A3B's layer: T 4096 (and 512) tokens per rank.
void dispatch_args(benchmark::internal::Benchmark* b) {
  constexpr const testing::MoeModel& q = testing::kQwen3_30B_A3B;
  b->ArgNames({"T", "H", "E", "K", "allgather", "bf16"});
  b->Args({4096, q.hidden, q.num_experts, q.top_k, 0, 1});
  b->Args({4096, q.hidden, q.num_experts, q.top_k, 0, 0});
  b->Args({4096, q.hidden, q.num_experts, q.top_k, 1, 1});
  b->Args({512, q.hidden, q.num_experts, q.top_k, 0, 1});
}

BENCHMARK(BM_DispatchCombine)
    ->Apply(dispatch_args)
    ->Iterations(8)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace
}  // namespace switchyard

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  benchmark::Initialize(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  switchyard::comm() = switchyard::dist::world();
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    switchyard::NullReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  switchyard::comm().reset();
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
#endif  // SWITCHYARD_WITH_MPI
