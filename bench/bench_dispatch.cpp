// dispatch + combine over MPI against the floor: raw MPI_Alltoallv of the same payload plus one
// local copy, in each direction (the row gather into expert order and the combine's read of every
// returned row are copies any implementation must do), timed in the same iterations
// (interleaved) on the same ranks, with preallocated buffers.
// Run under MPI (2 or 4 ranks, Qwen3-30B-A3B shape: T per rank, H 2048, E 128, K 8):
//   OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -np 2 build/bench/bench_dispatch
// Every rank runs the same fixed number of iterations (collectives must match); rank 0 reports
// the slowest rank's time. The routes change every step (4 seeded route sets in turn, as in
// training, where R differs from step to step), and one Dispatcher is kept across steps, as a
// training loop keeps it. Counters: `ratio` (ours / floor, wall time of the slowest rank),
// `cpu_ratio` (CPU time summed over ranks; MPI's waiting polls count on both sides),
// `faults/step` (minor page faults per step on rank 0: fresh memory touched in the step; the floor
// has none) and the CPU model and kernel ISA in the context lines.
// Skewed rows (`skew:1` Zipf-like expert popularity, `skew:2` one hot rank; always on route sets
// the warm-up never saw, a new skew every step, after 16 warm-up sets) add `recv_max/mean` and
// `recv_min/mean` (rows received by the busiest / idlest rank over the mean, averaged over the
// timed steps),
// `recv_swing` (for the rank whose received rows vary most: its most over its fewest over the
// steps) and `max_faults/step` (faults of the rank that faulted most, per step). The floor
// moves the same rows (its counts come from the same route sets). With SWITCHYARD_BENCH_STEPS set
// in the environment every rank prints each timed step (its own times, faults, received rows) to
// stderr.
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
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_machine.h"
#include "model_shapes.h"
#include "switchyard/cpu.h"
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

int64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// CPU seconds of this process (all its threads): under a loaded machine the wall time of a step is
// mostly time descheduled, so the CPU ratio is printed beside the wall ratio.
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double sum_over_ranks(double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return v;
}

double since(Clock::time_point a) {
  return std::chrono::duration<double>(Clock::now() - a).count();
}

constexpr int kRouteSets = 4;  // warm-up route sets (the fresh:0 rows cycle them)
// Warm-up route sets of the skewed rows. Under skew a rank's received rows vary by up to 4x (Zipf,
// EP 4) or 9x (hot rank) between steps, and the first time a rank receives more rows than ever
// it touches memory it never had: no allocator avoids that, and on this VM fresh memory costs
// 10-20 ms per 2 MiB page (a 352 MiB recv_x: a 3.8 s step against 0.8 s). With 4 warm-up sets,
// one rank of four never received more than 0.5x the mean before the timed steps (Zipf, fp32
// T 4096). A training run is past that after its first steps; 16 sets stand for them.
constexpr int kSkewedWarmSets = 16;
constexpr int kSteps = 12;  // timed iterations

// K distinct uniformly random experts per token.
Tensor random_routes(int64_t T, int64_t E, int64_t K, std::mt19937_64& rng) {
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    for (int64_t k = 0; k < K; ++k) {
      std::uniform_int_distribution<int64_t> d(k, E - 1);
      std::swap(perm[static_cast<size_t>(k)], perm[static_cast<size_t>(d(rng))]);
      idx[static_cast<size_t>(t * K + k)] = perm[static_cast<size_t>(k)];
    }
  }
  return Tensor::from_vector(idx, {T, K});
}

// Skewed route sets. Real MoE routing is not uniform: a few experts are hot, and in RL some ranks
// receive 2-4x the mean, with the hot experts moving from step to step. The per-set parameters
// (which experts are hot, how hot) come from a generator seeded by the set index, the same on
// every rank (one model routes all ranks' tokens); the tokens' draws are each rank's own.
enum class Skew : int { uniform = 0, zipf = 1, hot_rank = 2 };

const char* skew_name(Skew s) {
  switch (s) {
    case Skew::uniform:
      return "uniform";
    case Skew::zipf:
      return "zipf";
    case Skew::hot_rank:
      return "hot_rank";
  }
  return "?";
}

// K distinct experts per token, expert e drawn with probability proportional to
// 1 / (rank of e in a random popularity order + 1)^s, s in [1.0, 1.2] (drawn per set): draws
// from the distribution, repeated experts redrawn (sampling without replacement).
Tensor zipf_routes(int64_t T, int64_t E, int64_t K, uint64_t set_seed, std::mt19937_64& rng) {
  std::mt19937_64 common(set_seed);
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = static_cast<int32_t>(e);
  std::shuffle(order.begin(), order.end(), common);
  const double s = std::uniform_real_distribution<double>(1.0, 1.2)(common);
  std::vector<double> w(static_cast<size_t>(E));
  for (int64_t i = 0; i < E; ++i) {
    w[static_cast<size_t>(order[static_cast<size_t>(i)])] =
        std::pow(static_cast<double>(i + 1), -s);
  }
  std::discrete_distribution<int32_t> pick(w.begin(), w.end());
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  std::vector<char> taken(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < T; ++t) {
    int32_t* row = idx.data() + t * K;
    for (int64_t k = 0; k < K; ++k) {
      int32_t e = pick(rng);
      while (taken[static_cast<size_t>(e)]) e = pick(rng);
      taken[static_cast<size_t>(e)] = 1;
      row[k] = e;
    }
    for (int64_t k = 0; k < K; ++k) taken[static_cast<size_t>(row[k])] = 0;
  }
  return Tensor::from_vector(idx, {T, K});
}

// One rank receives f times the mean rows, f drawn per set in
// [1.5, min(4, 0.9 P)]: each of a token's K picks lands on the hot rank's E/P experts with
// probability f/P (binomial, at most E/P of them), the others on the other ranks' experts,
// uniformly and distinct. At P = 1 the routes are uniform. The hot rank is drawn per set, except
// in the warm-up, whose sets make ranks 0, 1, ... hot in turn (a training run past its first
// steps has seen every rank hot; see kSkewedWarmSets).
Tensor hot_rank_routes(int64_t T, int64_t E, int64_t K, int P, int set, bool warm_up,
                       uint64_t set_seed, std::mt19937_64& rng) {
  if (P == 1) return random_routes(T, E, K, rng);
  std::mt19937_64 common(set_seed);
  const int drawn = std::uniform_int_distribution<int>(0, P - 1)(common);
  const int hot = warm_up ? set % P : drawn;
  const double hi = std::min(4.0, 0.9 * P);
  const double f = std::uniform_real_distribution<double>(std::min(1.5, hi), hi)(common);
  const int64_t L = E / P;
  std::binomial_distribution<int64_t> on_hot(K, f / P);
  std::vector<int32_t> hot_e, cold_e;
  for (int64_t e = 0; e < E; ++e) {
    (e / L == hot ? hot_e : cold_e).push_back(static_cast<int32_t>(e));
  }
  // The first n of `v` become n distinct uniform picks (partial Fisher-Yates).
  auto draw = [&rng](std::vector<int32_t>& v, int64_t n, int32_t* out) {
    for (int64_t k = 0; k < n; ++k) {
      std::uniform_int_distribution<size_t> d(static_cast<size_t>(k), v.size() - 1);
      std::swap(v[static_cast<size_t>(k)], v[d(rng)]);
      out[k] = v[static_cast<size_t>(k)];
    }
  };
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  for (int64_t t = 0; t < T; ++t) {
    // As many on the hot rank as fit there, and at least what the other ranks cannot take.
    const int64_t n_hot =
        std::clamp(on_hot(rng), K - static_cast<int64_t>(cold_e.size()), std::min(L, K));
    draw(hot_e, n_hot, idx.data() + t * K);
    draw(cold_e, K - n_hot, idx.data() + t * K + n_hot);
  }
  return Tensor::from_vector(idx, {T, K});
}

Tensor make_routes(Skew skew, int64_t T, int64_t E, int64_t K, int P, int set, bool warm_up,
                   std::mt19937_64& rng) {
  const uint64_t set_seed = 777 + static_cast<uint64_t>(set);
  switch (skew) {
    case Skew::uniform:
      break;
    case Skew::zipf:
      return zipf_routes(T, E, K, set_seed, rng);
    case Skew::hot_rank:
      return hot_rank_routes(T, E, K, P, set, warm_up, set_seed, rng);
  }
  return random_routes(T, E, K, rng);
}

// The floor's counts for one route set: rows to and from every rank, as MPI wants them.
struct FloorCounts {
  std::vector<int> sc, sd, rc, rd;
  int64_t n_send = 0, n_recv = 0;
};

FloorCounts floor_counts(const std::vector<int64_t>& rank_expert_counts, int P, int me, int64_t E) {
  const int64_t L = E / P;
  const auto& counts = rank_expert_counts;
  FloorCounts f;
  f.sc.resize(P);
  f.sd.resize(P);
  f.rc.resize(P);
  f.rd.resize(P);
  for (int r = 0; r < P; ++r) {
    int64_t s = 0, q = 0;
    for (int64_t el = 0; el < L; ++el) {
      s += counts[static_cast<size_t>(me * E + r * L + el)];
      q += counts[static_cast<size_t>(r * E + me * L + el)];
    }
    f.sc[r] = static_cast<int>(s);
    f.rc[r] = static_cast<int>(q);
    f.sd[r] = static_cast<int>(f.n_send);
    f.rd[r] = static_cast<int>(f.n_recv);
    f.n_send += s;
    f.n_recv += q;
  }
  return f;
}

// The traffic matrix is engine state (not one of the handle's accessors): the bench reads it
// through detail::state, as the dispatch implementation does.
FloorCounts floor_counts(const dist::DispatchHandle& h) {
  const dist::detail::HandleState& s = dist::detail::state(h);
  return floor_counts(s.rank_expert_counts, s.world_size, s.rank, s.num_experts);
}

// The same counts straight from a route set (every rank's per-expert counts, all-gathered), for
// route sets the dispatcher has not seen yet.
FloorCounts floor_counts(const Tensor& idx, int64_t E, int P, int me) {
  std::vector<int64_t> mine(static_cast<size_t>(E), 0), all(static_cast<size_t>(P * E));
  const int32_t* ids = idx.data<int32_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) ++mine[static_cast<size_t>(ids[i])];
  MPI_Allgather(mine.data(), static_cast<int>(E), MPI_INT64_T, all.data(), static_cast<int>(E),
                MPI_INT64_T, MPI_COMM_WORLD);
  return floor_counts(all, P, me, E);
}

void BM_DispatchCombine(benchmark::State& state) {
  const int64_t T = state.range(0), H = state.range(1), E = state.range(2), K = state.range(3);
  const auto kind =
      state.range(4) ? dist::DispatcherKind::all_gather : dist::DispatcherKind::all_to_all;
  const DType dt = state.range(5) ? DType::bf16 : DType::fp32;
  // fresh:1 times steps on route sets not seen in the warm-up (as in training, where no two steps
  // route alike, so buffer sizes differ from every earlier step's); fresh:0 cycles the warm-up's.
  const bool fresh = state.range(6) != 0;
  const auto skew = static_cast<Skew>(state.range(7));
  // One dispatcher across steps, as a training loop keeps it.
  dist::Dispatcher disp(comm());
  const int P = disp.comm().size(), me = disp.comm().rank();
  std::mt19937_64 rng(1234 + static_cast<uint64_t>(me));
  Tensor x = testing::randn({T, H}, dt, rng);
  std::vector<Tensor> routes;
  const int warm = skew == Skew::uniform ? kRouteSets : kSkewedWarmSets;
  for (int i = 0; i < warm + (fresh ? kSteps : 0); ++i) {
    routes.push_back(make_routes(skew, T, E, K, P, i, i < warm, rng));
  }
  Tensor topk_w = Tensor::full({T, K}, DType::fp32, 1.0 / static_cast<double>(K));
  dist::DispatchOptions opt;
  opt.num_experts = E;
  opt.kind = kind;

  // Warm-up: one full step per route set (the dispatcher's scratch and the tensor cache reach
  // their high-water mark), and the floor's counts of each set.
  std::vector<FloorCounts> floor;
  int64_t max_rows = 0;
  for (int i = 0; i < warm; ++i) {
    const Tensor& idx = routes[static_cast<size_t>(i)];
    dist::DispatchResult d = disp.dispatch(x, idx, topk_w, opt);
    benchmark::DoNotOptimize(disp.combine(d.recv_x, d.handle).raw());
    floor.push_back(floor_counts(d.handle));
    const FloorCounts from_routes = floor_counts(idx, E, P, me);
    if (from_routes.sc != floor.back().sc || from_routes.rc != floor.back().rc) {
      std::fprintf(stderr,
                   "bench_dispatch: floor counts from the routes differ from the handle's\n");
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    max_rows = std::max({max_rows, floor.back().n_send, floor.back().n_recv});
  }
  for (size_t i = static_cast<size_t>(warm); i < routes.size(); ++i) {
    floor.push_back(floor_counts(routes[i], E, P, me));
    max_rows = std::max({max_rows, floor.back().n_send, floor.back().n_recv});
  }
  const int64_t rb = H * static_cast<int64_t>(dtype_size(dt));
  MPI_Datatype row;
  MPI_Type_contiguous(static_cast<int>(rb), MPI_BYTE, &row);
  MPI_Type_commit(&row);
  // a: sent rows and the rows coming back; b: received rows, then the returned rows' copy; out:
  // the received rows' copy, sent back.
  int64_t max_send = 0, max_recv = 0;
  for (const FloorCounts& f : floor) {
    max_send = std::max(max_send, f.n_send);
    max_recv = std::max(max_recv, f.n_recv);
  }
  std::vector<unsigned char> a(static_cast<size_t>(max_send * rb + 64), 1),
      b(static_cast<size_t>(max_rows * rb + 64), 2),
      out(static_cast<size_t>(max_recv * rb + 64), 3);
  // Rows every rank receives in every route set (the floor's counts), for the skew counters.
  std::vector<int64_t> recv_rows(floor.size() * static_cast<size_t>(P));
  {
    std::vector<int64_t> mine(floor.size());
    for (size_t i = 0; i < floor.size(); ++i) mine[i] = floor[i].n_recv;
    MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_INT64_T, recv_rows.data(),
                  static_cast<int>(mine.size()), MPI_INT64_T, MPI_COMM_WORLD);
  }
  // recv_rows[r * sets + i]: rank r, set i.
  const size_t n_sets = floor.size();
  double recv_max_sum = 0, recv_min_sum = 0, max_faults = 0;
  std::vector<int64_t> rank_lo(static_cast<size_t>(P), INT64_MAX),
      rank_hi(static_cast<size_t>(P), 0);

  double t_ours = 0, t_raw = 0, c_ours = 0, c_raw = 0;
  int64_t f_ours = 0, f_raw = 0, payload = 0;
  int step = 0;
  const bool print_steps = std::getenv("SWITCHYARD_BENCH_STEPS") != nullptr;
  for (auto _ : state) {
    const int set = fresh ? warm + step++ % kSteps : step++ % warm;
    const FloorCounts& f = floor[static_cast<size_t>(set)];
    MPI_Barrier(MPI_COMM_WORLD);
    const int64_t f0 = minor_faults();
    const double c0 = cpu_seconds();
    auto t0 = Clock::now();
    {
      dist::DispatchResult d = disp.dispatch(x, routes[static_cast<size_t>(set)], topk_w, opt);
      Tensor y = disp.combine(d.recv_x, d.handle);  // identity experts
      benchmark::DoNotOptimize(y.raw());
    }
    const double ours_local = since(t0);
    c_ours += sum_over_ranks(cpu_seconds() - c0);
    const int64_t faults = minor_faults() - f0;
    f_ours += faults;
    max_faults += max_over_ranks(static_cast<double>(faults));
    const double ours = max_over_ranks(ours_local);
    MPI_Barrier(MPI_COMM_WORLD);
    const int64_t f1 = minor_faults();
    const double c1 = cpu_seconds();
    auto t1 = Clock::now();
    MPI_Alltoallv(a.data(), f.sc.data(), f.sd.data(), row, b.data(), f.rc.data(), f.rd.data(), row,
                  MPI_COMM_WORLD);
    std::memcpy(out.data(), b.data(), static_cast<size_t>(f.n_recv * rb));
    MPI_Alltoallv(out.data(), f.rc.data(), f.rd.data(), row, a.data(), f.sc.data(), f.sd.data(),
                  row, MPI_COMM_WORLD);
    std::memcpy(b.data(), a.data(), static_cast<size_t>(f.n_send * rb));
    benchmark::ClobberMemory();
    const double raw_local = since(t1);
    c_raw += sum_over_ranks(cpu_seconds() - c1);
    f_raw += minor_faults() - f1;
    const double raw = max_over_ranks(raw_local);
    t_ours += ours;
    t_raw += raw;
    if (print_steps) {
      std::fprintf(stderr,
                   "step %d rank %d set %d: ours %.1f ms floor %.1f ms faults %lld recv %lld\n",
                   step - 1, me, set, ours_local * 1e3, raw_local * 1e3,
                   static_cast<long long>(faults), static_cast<long long>(f.n_recv));
    }
    payload += (f.n_send + f.n_recv) * rb;
    int64_t lo = INT64_MAX, hi = 0, total = 0;
    for (size_t r = 0; r < static_cast<size_t>(P); ++r) {
      const int64_t n_r = recv_rows[r * n_sets + static_cast<size_t>(set)];
      lo = std::min(lo, n_r);
      hi = std::max(hi, n_r);
      total += n_r;
      rank_lo[r] = std::min(rank_lo[r], n_r);
      rank_hi[r] = std::max(rank_hi[r], n_r);
    }
    const double mean = static_cast<double>(total) / P;
    recv_max_sum += static_cast<double>(hi) / mean;
    recv_min_sum += static_cast<double>(lo) / mean;
    state.SetIterationTime(ours);
  }
  MPI_Type_free(&row);
  const double n = static_cast<double>(state.iterations());
  state.counters["ours_ms"] = t_ours / n * 1e3;
  state.counters["floor_ms"] = t_raw / n * 1e3;
  state.counters["ratio"] = t_ours / t_raw;
  state.counters["cpu_ratio"] = c_ours / c_raw;
  state.counters["faults/step"] = static_cast<double>(f_ours) / n;
  state.counters["floor_faults/step"] = static_cast<double>(f_raw) / n;
  state.counters["payload_GB/s"] = static_cast<double>(payload) / t_ours / 1e9;
  state.counters["max_faults/step"] = max_faults / n;
  state.counters["recv_max/mean"] = recv_max_sum / n;
  state.counters["recv_min/mean"] = recv_min_sum / n;
  double swing = 1;
  for (size_t r = 0; r < static_cast<size_t>(P); ++r) {
    swing = std::max(swing, static_cast<double>(rank_hi[r]) /
                                static_cast<double>(std::max<int64_t>(rank_lo[r], 1)));
  }
  state.counters["recv_swing"] = swing;
  state.SetLabel(
      std::string(kind == dist::DispatcherKind::all_to_all ? "all_to_all " : "all_gather ") +
      dtype_name(dt) + " EP=" + std::to_string(P) + " " + skew_name(skew));
}

// Qwen3-30B-A3B's layer: T 4096 (and 512) tokens per rank.
void dispatch_args(benchmark::internal::Benchmark* b) {
  constexpr const testing::MoeModel& q = testing::kQwen3_30B_A3B;
  const int64_t H = q.hidden, E = q.num_experts, K = q.top_k;
  b->ArgNames({"T", "H", "E", "K", "allgather", "bf16", "fresh", "skew"});
  b->Args({4096, H, E, K, 0, 1, 0, 0});
  b->Args({4096, H, E, K, 0, 0, 0, 0});
  b->Args({4096, H, E, K, 1, 1, 0, 0});
  b->Args({512, H, E, K, 0, 1, 0, 0});
  b->Args({512, H, E, K, 0, 0, 0, 0});
  b->Args({512, H, E, K, 1, 1, 0, 0});
  b->Args({4096, H, E, K, 0, 1, 1, 0});
  b->Args({4096, H, E, K, 0, 0, 1, 0});
  b->Args({4096, H, E, K, 1, 1, 1, 0});
  // Skewed routes (all_to_all; a new skew every step, on route sets the warm-up never saw).
  for (int64_t skew : {1, 2}) {
    for (int64_t T : {4096, 512}) {
      for (int64_t bf16 : {1, 0}) b->Args({T, H, E, K, 0, bf16, 1, skew});
    }
  }
}

BENCHMARK(BM_DispatchCombine)
    ->Apply(dispatch_args)
    ->Iterations(kSteps)
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
  switchyard::bench::add_machine_context();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  switchyard::comm() = switchyard::dist::world();
  benchmark::AddCustomContext("ep_size", std::to_string(switchyard::comm()->size()));
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
