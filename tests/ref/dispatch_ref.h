// Double-precision references for the routing plan, permute/unpermute and the dispatchers, written
// from the definitions in DESIGN.md ("Dispatch invariant", "Combine", "Backward"), not from the
// kernels: plain loops, per-token pair lists, double accumulation.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace switchyard::ref {

/// One distinct (token, expert) pair: the weight is the double sum of its slots' weights.
struct RefPair {
  int64_t token;
  int64_t expert;
  double weight;
  std::vector<int64_t> slots;  // k of every slot merged into this pair
};

/// Distinct valid pairs of each token, in order of the first slot naming the expert.
inline std::vector<std::vector<RefPair>> token_pairs(const std::vector<int32_t>& idx,
                                                     const std::vector<float>& w, int64_t T,
                                                     int64_t K) {
  std::vector<std::vector<RefPair>> out(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = idx[static_cast<size_t>(t * K + k)];
      if (e < 0) continue;
      const double wk = w.empty() ? 1.0 : w[static_cast<size_t>(t * K + k)];
      auto& ps = out[static_cast<size_t>(t)];
      auto it = std::find_if(ps.begin(), ps.end(), [&](const RefPair& p) { return p.expert == e; });
      if (it == ps.end()) {
        ps.push_back({t, e, wk, {k}});
      } else {
        it->weight += wk;
        it->slots.push_back(k);
      }
    }
  }
  return out;
}

/// Row order of the permuted buffer without capacity or padding: expert-major, tokens ascending.
/// Returns (token, expert) per row: the pairs sorted by (expert, token) (pairs are distinct).
inline std::vector<std::pair<int64_t, int64_t>> expert_major_rows(
    const std::vector<std::vector<RefPair>>& pairs, int64_t E) {
  std::vector<std::pair<int64_t, int64_t>> rows;
  for (const auto& ps : pairs) {
    for (const auto& p : ps) {
      if (p.expert < E) rows.emplace_back(p.token, p.expert);
    }
  }
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second < b.second : a.first < b.first;
  });
  return rows;
}

/// y[t,h] = sum over t's pairs of w * Y[row(t,e), h] (weights skipped when apply_weights is
/// false); `row_of(t, e)` gives the row. Double accumulation.
template <class RowOf>
std::vector<double> combine(const std::vector<std::vector<RefPair>>& pairs,
                            const std::vector<double>& Y, int64_t H, bool apply_weights,
                            RowOf row_of) {
  std::vector<double> y(pairs.size() * static_cast<size_t>(H), 0.0);
  for (size_t t = 0; t < pairs.size(); ++t) {
    for (const auto& p : pairs[t]) {
      const int64_t r = row_of(p.token, p.expert);
      if (r < 0) continue;
      const double w = apply_weights ? p.weight : 1.0;
      for (int64_t h = 0; h < H; ++h) {
        y[t * H + h] += w * Y[static_cast<size_t>(r * H + h)];
      }
    }
  }
  return y;
}

/// grad_topk_weights[t,k] = <Y[row(t,e_k)], g_t> for every slot merged into a kept pair.
template <class RowOf>
std::vector<double> grad_weights(const std::vector<std::vector<RefPair>>& pairs,
                                 const std::vector<double>& Y, const std::vector<double>& g,
                                 int64_t K, int64_t H, RowOf row_of) {
  std::vector<double> gw(pairs.size() * static_cast<size_t>(K), 0.0);
  for (size_t t = 0; t < pairs.size(); ++t) {
    for (const auto& p : pairs[t]) {
      const int64_t r = row_of(p.token, p.expert);
      if (r < 0) continue;
      double d = 0.0;
      for (int64_t h = 0; h < H; ++h) d += Y[static_cast<size_t>(r * H + h)] * g[t * H + h];
      for (int64_t k : p.slots) gw[t * K + k] = d;
    }
  }
  return gw;
}

/// Rows of one source's block for an expert with `n` pairs after padding, as Megatron-Core pads
/// per source rank: pad_routing_map rounds n up to a multiple of `alignment`; drop-and-pad gives
/// exactly `capacity` rows (then rounded up to the alignment).
inline int64_t padded_block_rows(int64_t n, int64_t alignment, int64_t capacity,
                                 bool pad_to_capacity) {
  const int64_t rows = pad_to_capacity ? capacity : n;
  return (rows + alignment - 1) / alignment * alignment;
}

}  // namespace switchyard::ref
