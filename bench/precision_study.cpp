// Precision study: how often does the router pick a different expert set than exact (fp64) logits,
// when the gate logits are (a) rounded to bf16 before top-k (the HF default: a bf16 nn.Linear), or
// (b) kept in fp32 (this engine)? And between two kernels that accumulate in different orders
// (rollout engine vs trainer), which is the train/inference mismatch R3 addresses.
//
// Qwen3-30B-A3B-like gate: H 2048, E 128, K 8, softmax top-k. Hidden states are RMS-normalised
// and stored in bf16, x = bf16(g * v / rms(v)) with g ~ 1 + N(0, 0.05) per channel and v ~ N(0, 1)
// (a few channels with 20x outliers, as real residual streams have); W ~ bf16(N(0, 0.02)).
// The fp32 logits come from a plain fp32-accumulate dot loop written here (the engine's gate GEMM
// lives in another worktree); the fp64 reference accumulates the same bf16 inputs in double.
// Selection uses switchyard::topk_route (ties to the lower expert id).
//
//   ./build/bench/precision_study [num_tokens=4096] [seed=1] [num_layers=48] [w_std=0.02]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <set>
#include <vector>

#include "model_shapes.h"
#include "switchyard/dtype.h"
#include "switchyard/router.h"
#include "switchyard/tensor.h"

namespace sy = switchyard;

namespace {

constexpr int64_t kH = sy::testing::kQwen3_30B_A3B.hidden,
                  kE = sy::testing::kQwen3_30B_A3B.num_experts,
                  kK = sy::testing::kQwen3_30B_A3B.top_k;

float bf(float v) { return sy::bf16_to_float(sy::float_to_bf16(v)); }

// Top-k ids per token through the engine (softmax post top-k, no extras).
std::vector<int32_t> route_ids(const std::vector<float>& logits, int64_t T) {
  sy::RouterConfig c;
  c.num_experts = kE;
  c.top_k = kK;
  sy::Tensor z = sy::Tensor::from_vector(logits, {T, kE});
  const sy::RouteResult r = sy::topk_route(z, {}, c);
  return std::vector<int32_t>(r.topk_idx.data<int32_t>(), r.topk_idx.data<int32_t>() + T * kK);
}

std::vector<int32_t> route_ids(const std::vector<double>& logits, int64_t T) {
  sy::RouterConfig c;
  c.num_experts = kE;
  c.top_k = kK;
  sy::Tensor z = sy::Tensor::from_vector(logits, {T, kE});
  const sy::RouteResult r = sy::topk_route(z, {}, c);
  return std::vector<int32_t>(r.topk_idx.data<int32_t>(), r.topk_idx.data<int32_t>() + T * kK);
}

struct Mismatch {
  double token_share = 0;  // tokens whose top-k set differs
  double slot_share = 0;   // router decisions (token, slot) not in the other set
};

Mismatch compare(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int64_t T) {
  int64_t tok = 0, slots = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::set<int32_t> sa(a.begin() + t * kK, a.begin() + (t + 1) * kK);
    int64_t diff = 0;
    for (int64_t k = 0; k < kK; ++k) diff += sa.count(b[t * kK + k]) == 0;
    tok += diff > 0;
    slots += diff;
  }
  return {static_cast<double>(tok) / T, static_cast<double>(slots) / (T * kK)};
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 4096;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  const int num_layers =
      argc > 3 ? std::atoi(argv[3]) : static_cast<int>(sy::testing::kQwen3_30B_A3B.num_moe_layers);
  const double w_std = argc > 4 ? std::atof(argv[4]) : 0.02;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);

  // Gate weights and the RMSNorm gain, bf16.
  std::vector<float> W(static_cast<size_t>(kE * kH)), g(static_cast<size_t>(kH));
  for (auto& w : W) w = bf(static_cast<float>(w_std * nd(rng)));
  for (auto& v : g) v = bf(static_cast<float>(1.0 + 0.05 * nd(rng)));
  std::vector<int64_t> outlier_channels = {7, 300, 1111, 1900};
  // Hidden states.
  std::vector<float> X(static_cast<size_t>(T * kH));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> v(static_cast<size_t>(kH));
    for (auto& x : v) x = nd(rng);
    for (int64_t c : outlier_channels) v[c] *= 20.0;
    double ms = 0;
    for (double x : v) ms += x * x;
    const double inv_rms = 1.0 / std::sqrt(ms / kH + 1e-6);
    for (int64_t h = 0; h < kH; ++h) X[t * kH + h] = bf(static_cast<float>(g[h] * v[h] * inv_rms));
  }

  // Logits: fp64 reference, fp32 sequential accumulation, fp32 8-lane blocked accumulation (a
  // second "kernel"), and both rounded to bf16.
  std::vector<double> z64(static_cast<size_t>(T * kE));
  std::vector<float> z32(z64.size()), z32b(z64.size()), zb16(z64.size()), zb16b(z64.size());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* x = X.data() + t * kH;
    for (int64_t e = 0; e < kE; ++e) {
      const float* w = W.data() + e * kH;
      double acc64 = 0;
      float acc32 = 0;
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t h = 0; h < kH; ++h) {
        acc64 += static_cast<double>(x[h]) * static_cast<double>(w[h]);
        acc32 = std::fma(x[h], w[h], acc32);
        lanes[h & 7] = std::fma(x[h], w[h], lanes[h & 7]);
      }
      const float blocked = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
                            ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
      z64[t * kE + e] = acc64;
      z32[t * kE + e] = acc32;
      z32b[t * kE + e] = blocked;
      zb16[t * kE + e] = bf(acc32);
      zb16b[t * kE + e] = bf(blocked);
    }
  }
  double zs = 0;
  for (double v : z64) zs += v * v;
  const auto id64 = route_ids(z64, T), id32 = route_ids(z32, T), id32b = route_ids(z32b, T),
             idb16 = route_ids(zb16, T), idb16b = route_ids(zb16b, T);

  // The mechanism: bf16 has 8 significant bits, so near the top-k boundary two logits often round
  // to the same value and the tie is broken by expert id, not by the true order.
  int64_t boundary_ties = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> row(zb16.begin() + t * kE, zb16.begin() + (t + 1) * kE);
    std::nth_element(row.begin(), row.begin() + kK, row.end(), std::greater<float>());
    const float kth_plus_1 = row[kK];
    const float kth = *std::min_element(row.begin(), row.begin() + kK);
    boundary_ties += kth == kth_plus_1;
  }
  struct Row {
    const char* what;
    Mismatch m;
  };
  const Row rows[] = {
      {"(a) bf16 logits (fp32 acc, rounded) vs fp64", compare(id64, idb16, T)},
      {"(b) fp32 logits (this engine)      vs fp64", compare(id64, id32, T)},
      {"(c) bf16 logits vs fp32 logits (bf16 rollout, fp32 trainer)", compare(idb16, id32, T)},
      {"(d) fp32 sequential vs fp32 8-lane accumulation (two fp32 kernels)",
       compare(id32, id32b, T)},
      {"(e) fp64 vs bf16 of the 8-lane kernel", compare(id64, idb16b, T)},
  };
  std::printf("precision study: T=%lld H=%lld E=%lld K=%lld seed=%llu w_std=%g, logits rms %.3f\n",
              static_cast<long long>(T), static_cast<long long>(kH), static_cast<long long>(kE),
              static_cast<long long>(kK), static_cast<unsigned long long>(seed), w_std,
              std::sqrt(zs / static_cast<double>(z64.size())));
  std::printf(
      "| comparison | tokens with a different top-k set | differing router decisions | tokens "
      "differing in >=1 of %d layers (1-(1-p)^L) |\n",
      num_layers);
  std::printf("|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %.3f%% | %.4f%% | %.1f%% |\n", r.what, 100 * r.m.token_share,
                100 * r.m.slot_share, 100 * (1 - std::pow(1 - r.m.token_share, num_layers)));
  }
  std::printf("\nbf16 logits tied at the top-k boundary (K-th == (K+1)-th): %.3f%% of tokens\n",
              100.0 * static_cast<double>(boundary_ties) / static_cast<double>(T));
  return 0;
}
