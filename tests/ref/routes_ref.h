// Straightforward references for the route toolkit: token-by-token index maps written from the
// definitions (Megatron-Core's THD padding and zigzag context-parallel split), and drift counted
// from sets. Slow by design.
#pragma once

#include <algorithm>
#include <cstdint>
#include <set>
#include <vector>

#include "switchyard/routes.h"

namespace switchyard::ref {

/// Element (t, l, k) of a table.
inline int32_t at(const RouteTable& t, int64_t token, int64_t layer, int64_t k) {
  return t.topk_idx.data<int32_t>()[(token * t.num_moe_layers() + layer) * t.top_k() + k];
}

/// Token rows of `src` picked by `rows` (-1 = a row of -1).
inline RouteTable gather_rows(const RouteTable& src, const std::vector<int64_t>& rows, int64_t L,
                              int64_t K, int64_t E) {
  RouteTable out = RouteTable::none(static_cast<int64_t>(rows.size()), L, K, E);
  int32_t* d = out.topk_idx.data<int32_t>();
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0) continue;
    for (int64_t l = 0; l < L; ++l)
      for (int64_t k = 0; k < K; ++k) d[(int64_t(i) * L + l) * K + k] = at(src, rows[i], l, k);
  }
  return out;
}

/// Padded length of a sequence of n tokens for multiple m.
inline int64_t padded_len(int64_t n, int64_t m) {
  int64_t p = 0;
  while (p < n) p += m;
  return p;
}

/// For a packed layout, the global packed row of token j of sequence s: start(s) + j.
/// Zigzag: the position-th token that cp rank r holds, as a packed row index.
inline std::vector<int64_t> zigzag_rows(const std::vector<int64_t>& padded_lens, int64_t cp,
                                        int64_t r) {
  std::vector<int64_t> rows;
  int64_t start = 0;
  if (cp == 1) {  // no split
    for (int64_t len : padded_lens) start += len;
    for (int64_t j = 0; j < start; ++j) rows.push_back(j);
    return rows;
  }
  for (int64_t len : padded_lens) {
    const int64_t chunk = len / (2 * cp);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t c = j / chunk;
      if (c == r) rows.push_back(start + j);
    }
    for (int64_t j = 0; j < len; ++j) {
      const int64_t c = j / chunk;
      if (c == 2 * cp - 1 - r) rows.push_back(start + j);
    }
    start += len;
  }
  return rows;
}

/// Drift counted from sets: differing decisions = |A_row \ B_row| over compared rows.
struct DriftRef {
  int64_t decisions = 0, differing_decisions = 0, tokens = 0, differing_tokens = 0,
          differing_rows = 0;
};
inline DriftRef drift(const RouteTable& a, const RouteTable& b) {
  DriftRef d;
  for (int64_t t = 0; t < a.num_tokens(); ++t) {
    int64_t compared = 0, differing = 0;
    for (int64_t l = 0; l < a.num_moe_layers(); ++l) {
      std::set<int32_t> sa, sb;
      for (int64_t k = 0; k < a.top_k(); ++k) {
        if (at(a, t, l, k) >= 0) sa.insert(at(a, t, l, k));
        if (at(b, t, l, k) >= 0) sb.insert(at(b, t, l, k));
      }
      if (sa.empty() || sb.empty()) continue;
      ++compared;
      for (int64_t k = 0; k < a.top_k(); ++k) {
        const int32_t v = at(a, t, l, k);
        if (v < 0) continue;
        ++d.decisions;
        d.differing_decisions += sb.count(v) == 0;
      }
      differing += sa != sb;
    }
    if (compared) {
      ++d.tokens;
      d.differing_tokens += differing > 0;
      d.differing_rows += differing;
    }
  }
  return d;
}

}  // namespace switchyard::ref
