// Route file size and speed on skewed, realistic routes: E=128, K=8, 48 MoE layers (Qwen3-30B-A3B's
// router shape), expert popularity Zipf-like with exponent s per layer (a different hot set per
// layer), 32768 tokens cut into sequences of seq_len tokens (1024 unless said). Rates are MB/s of
// raw int32 routes ([tokens, layers, K] int32). Peers measured in the same run: memcpy of the raw
// int32 (ceiling), and plain zstd over the ids narrowed to uint8 without the rank transform (what
// "narrowest width + zstd" gives alone). The encoder also reports bits per routed id beside the
// bound (each layer's order-0 entropy less log2(K!)/K bits: a top-k set carries no order).
#include <benchmark/benchmark.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>

#include "model_shapes.h"
#include "switchyard/route_file.h"
#include "bench_machine.h"

namespace {

using namespace switchyard;

constexpr int64_t kE = testing::kQwen3_30B_A3B.num_experts, kK = testing::kQwen3_30B_A3B.top_k,
                  kL = testing::kQwen3_30B_A3B.num_moe_layers, kTotalTokens = 32768;

// Zipf-like routes: per layer a random permutation of experts gets weights 1/(rank+1)^s; each
// token draws K distinct experts by weight (hot experts first, as a top-k would order them).
// One stream of kTotalTokens per s, cut into sequences of seq_len whose last token has no route.
const std::vector<int32_t>& zipf_stream(int64_t s100) {
  static std::map<int64_t, std::vector<int32_t>> cache;
  auto it = cache.find(s100);
  if (it != cache.end()) return it->second;
  std::mt19937_64 rng(1234 + uint64_t(s100));
  const double s = double(s100) / 100.0;
  std::vector<std::vector<double>> cdf(kL, std::vector<double>(kE));
  std::vector<std::vector<int32_t>> perm(kL, std::vector<int32_t>(kE));
  for (int64_t l = 0; l < kL; ++l) {
    std::iota(perm[l].begin(), perm[l].end(), 0);
    std::shuffle(perm[l].begin(), perm[l].end(), rng);
    double acc = 0;
    for (int64_t r = 0; r < kE; ++r) cdf[l][r] = (acc += 1.0 / std::pow(double(r + 1), s));
    for (auto& c : cdf[l]) c /= acc;
  }
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<int32_t> v(size_t(kTotalTokens * kL * kK));
  int64_t ranks[kK];
  for (int64_t tok = 0; tok < kTotalTokens; ++tok) {
    for (int64_t l = 0; l < kL; ++l) {
      int64_t n = 0;
      while (n < kK) {
        const int64_t r = std::min<int64_t>(
            std::lower_bound(cdf[l].begin(), cdf[l].end(), u(rng)) - cdf[l].begin(), kE - 1);
        if (std::find(ranks, ranks + n, r) == ranks + n) ranks[n++] = r;
      }
      std::sort(ranks, ranks + kK);  // top-k order: most popular first
      for (int64_t k = 0; k < kK; ++k)
        v[size_t((tok * kL + l) * kK + k)] = perm[l][size_t(ranks[k])];
    }
  }
  return cache.emplace(s100, std::move(v)).first->second;
}

const std::vector<RouteTable>& routes(int64_t s100, int64_t seq_len) {
  static std::map<std::pair<int64_t, int64_t>, std::vector<RouteTable>> cache;
  auto it = cache.find({s100, seq_len});
  if (it != cache.end()) return it->second;
  const auto& v = zipf_stream(s100);
  std::vector<RouteTable> seqs;
  const int64_t row = kL * kK;
  for (int64_t start = 0; start + seq_len <= kTotalTokens; start += seq_len) {
    RouteTable t = RouteTable::none(seq_len, kL, kK, kE);
    std::memcpy(t.topk_idx.raw(), v.data() + start * row,
                size_t((seq_len - 1) * row) * sizeof(int32_t));
    seqs.push_back(std::move(t));
  }
  return cache.emplace(std::make_pair(s100, seq_len), std::move(seqs)).first->second;
}

double raw_bytes(const std::vector<RouteTable>& seqs) {
  double n = 0;
  for (const auto& t : seqs) n += double(t.topk_idx.nbytes());
  return n;
}

std::string temp_file() {
  return (std::filesystem::temp_directory_path() /
          ("sy_bench_routes_" + std::to_string(::getpid()) + ".syr"))
      .string();
}

RouteFileInfo info() {
  RouteFileInfo i;
  i.num_experts = kE;
  i.top_k = kK;
  i.num_moe_layers = kL;
  return i;
}

// The information limit of a batch: each layer's order-0 entropy of its routed ids, less the
// log2(K!)/K bits per id that an unordered top-k set does not spend on order; and the routed ids.
std::pair<double, double> set_bound_bits(const std::vector<RouteTable>& seqs) {
  std::vector<double> count(size_t(kL * kE), 0.0);
  double routed = 0;
  for (const auto& t : seqs) {
    const int32_t* p = t.topk_idx.data<int32_t>();
    for (int64_t i = 0; i < t.topk_idx.numel(); ++i) {
      if (p[i] < 0) continue;
      count[size_t((i / kK) % kL * kE + p[i])] += 1;
      routed += 1;
    }
  }
  double bits = 0;
  for (int64_t l = 0; l < kL; ++l) {
    double n = 0;
    for (int64_t e = 0; e < kE; ++e) n += count[size_t(l * kE + e)];
    for (int64_t e = 0; e < kE; ++e) {
      const double c = count[size_t(l * kE + e)];
      if (c > 0) bits -= c * std::log2(c / n);
    }
  }
  double log2_kfact = 0;
  for (int64_t k = 2; k <= kK; ++k) log2_kfact += std::log2(double(k));
  return {bits / routed - log2_kfact / double(kK), routed};
}

void BM_RouteFileEncode(benchmark::State& state) {
  const auto& seqs = routes(state.range(0), state.range(2));
  const std::string path = temp_file();
  int64_t bytes = 0;
  for (auto _ : state) {
    RouteFileWriter w(path, info(), {int(state.range(1))});
    for (const auto& t : seqs) w.append(t);
    w.close();
    bytes = w.bytes_written();
  }
  std::remove(path.c_str());
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(raw_bytes(seqs)));
  state.counters["ratio_vs_int32"] = raw_bytes(seqs) / double(bytes);
  state.counters["bits_per_id"] = 8.0 * double(bytes) / (raw_bytes(seqs) / 4);
  const auto [bound, routed] = set_bound_bits(seqs);
  state.counters["bits_per_routed_id"] = 8.0 * double(bytes) / routed;
  state.counters["bound_bits"] = bound;
  state.counters["x_bound"] = 8.0 * double(bytes) / routed / bound;
}

void BM_RouteFileDecode(benchmark::State& state) {
  const auto& seqs = routes(state.range(0), state.range(2));
  const std::string path = temp_file();
  {
    RouteFileWriter w(path, info(), {int(state.range(1))});
    for (const auto& t : seqs) w.append(t);
  }
  for (auto _ : state) {
    RouteFileReader r = RouteFileReader::open(path);
    for (int64_t i = 0; i < r.num_sequences(); ++i)
      benchmark::DoNotOptimize(r.read(i).topk_idx.raw());
  }
  // Correctness guard outside the timed loop: the bench must decode what it encoded.
  RouteFileReader r = RouteFileReader::open(path);
  for (int64_t i = 0; i < r.num_sequences(); ++i) {
    if (!route_tables_equal(r.read(i), seqs[size_t(i)]))
      state.SkipWithError("decoded table differs");
  }
  std::remove(path.c_str());
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(raw_bytes(seqs)));
}

// Peer: memcpy of the raw int32 routes (ceiling for any encoder that reads them once).
void BM_Memcpy(benchmark::State& state) {
  const auto& seqs = routes(state.range(0), state.range(2));
  std::vector<char> dst(seqs[0].topk_idx.nbytes());
  for (auto _ : state) {
    for (const auto& t : seqs) {
      std::memcpy(dst.data(), t.topk_idx.raw(), t.topk_idx.nbytes());
      benchmark::ClobberMemory();
    }
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(raw_bytes(seqs)));
}

// Peer: ids narrowed to uint8 in their natural [tokens, layers, K] order, then zstd.
void BM_PlainUint8Zstd(benchmark::State& state) {
  const auto& seqs = routes(state.range(0), state.range(2));
  std::vector<uint8_t> narrow(size_t(state.range(2) * kL * kK));
  std::vector<char> comp(ZSTD_compressBound(narrow.size()));
  int64_t total = 0;
  for (auto _ : state) {
    total = 0;
    for (const auto& t : seqs) {
      const int32_t* p = t.topk_idx.data<int32_t>();
      for (size_t i = 0; i < narrow.size(); ++i) narrow[i] = static_cast<uint8_t>(p[i] + 1);
      total += int64_t(ZSTD_compress(comp.data(), comp.size(), narrow.data(), narrow.size(),
                                     int(state.range(1))));
    }
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(raw_bytes(seqs)));
  state.counters["ratio_vs_int32"] = raw_bytes(seqs) / double(total);
}

void args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"zipf_s_x100", "zstd_level", "seq_len"});
  for (int64_t s : {0, 80, 100, 120}) b->Args({s, 1, 1024});
  b->Args({100, 3, 1024});
  b->Args({100, 9, 1024});
  for (int64_t len : {64, 128, 256, 4096}) b->Args({100, 1, len});
  // Rates from CPU time (the default): single-threaded work on a shared 2-core machine, where
  // wall time mostly measures the other jobs. The file writes' kernel time is in the CPU time.
  b->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_RouteFileEncode)->Apply(args);
BENCHMARK(BM_RouteFileDecode)->Apply(args);
BENCHMARK(BM_PlainUint8Zstd)->Apply(args);
BENCHMARK(BM_Memcpy)
    ->ArgNames({"zipf_s_x100", "zstd_level", "seq_len"})
    ->Args({100, 0, 1024})
    ->Unit(benchmark::kMillisecond);

}  // namespace

SY_BENCHMARK_MAIN();
