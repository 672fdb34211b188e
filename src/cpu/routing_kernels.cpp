// CPU kernels of the routing steps (routing_kernels.h). Moved from the front-ends (capacity.cpp,
// router_balancing.cpp, router_select.cpp, permute.cpp) unchanged, so results are bit for bit the
// same.
#include "cpu/routing_kernels.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <vector>

#include "cpu/router_kernels.h"
#include "switchyard/routing_plan.h"

namespace switchyard::cpu {

template <class W>
int64_t drop_over_capacity(const int64_t* items, int64_t n, const W* weights, int64_t capacity,
                           TokenDropPolicy policy, uint8_t* kept) {
  if (n <= capacity) return 0;
  if (policy == TokenDropPolicy::position) {
    for (int64_t i = capacity; i < n; ++i) kept[items[i]] = 0;
  } else {
    // Highest weight first; a stable sort keeps ties in token order (the lower token wins).
    std::vector<int64_t> order(items, items + n);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return weights[a] > weights[b]; });
    for (int64_t i = capacity; i < n; ++i) kept[order[static_cast<size_t>(i)]] = 0;
  }
  return n - capacity;
}

template <class S>
int64_t apply_capacity(const int32_t* selected_idx, const S* weights, int64_t T, int64_t K,
                       int64_t E, int64_t capacity, TokenDropPolicy policy, int32_t* topk_idx,
                       S* out_weights, int64_t* counts) {
  const int64_t n = T * K;
  std::copy_n(selected_idx, n, topk_idx);
  std::copy_n(weights, n, out_weights);
  std::fill_n(counts, E, int64_t{0});
  for (int64_t i = 0; i < n; ++i) {
    if (selected_idx[i] >= 0) ++counts[selected_idx[i]];
  }
  if (capacity < 0) return 0;
  bool any_over = false;
  for (int64_t e = 0; e < E; ++e) any_over = any_over || counts[e] > capacity;
  if (!any_over) return 0;
  // Slots grouped by expert in token order (a counting sort; a row names an expert at most once).
  std::vector<int64_t> offs(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) offs[e + 1] = offs[e] + counts[e];
  std::vector<int64_t> slots(static_cast<size_t>(offs[E]));
  {
    std::vector<int64_t> fill(offs.begin(), offs.end() - 1);
    for (int64_t i = 0; i < n; ++i) {
      if (selected_idx[i] >= 0) slots[fill[selected_idx[i]]++] = i;
    }
  }
  std::vector<uint8_t> kept(static_cast<size_t>(n), 1);
  int64_t dropped = 0;
  constexpr int64_t kParallelMinWork = 16384;
#pragma omp parallel for schedule(dynamic, 4) reduction(+ : dropped) if (n > kParallelMinWork)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t d = drop_over_capacity(slots.data() + offs[e], counts[e], weights, capacity,
                                         policy, kept.data());
    dropped += d;
    counts[e] -= d;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!kept[i]) {
      topk_idx[i] = -1;
      out_weights[i] = S(0);
    }
  }
  return dropped;
}

template <class S>
void cast_values(const void* src, DType src_dtype, int64_t n, S* dst) {
  if (src_dtype == DType::fp64) {
    const double* s = static_cast<const double*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<S>(s[i]);
  } else {
    const float* s = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<S>(static_cast<double>(s[i]));
  }
}

template <class S>
void sinkhorn_rows(const S* logits, const int32_t* replay_idx, const uint8_t* row_kind, int64_t T,
                   int64_t E, int64_t K, double tol, int32_t* ids, uint8_t* kernel_kind) {
  std::vector<uint8_t> use(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) use[t] = row_kind[t] != kRowPadded;
  std::fill_n(ids, T * K, int32_t{-1});
  sinkhorn_select<S>(logits, use.data(), T, E, K, tol, ids);
  for (int64_t t = 0; t < T; ++t) {
    if (row_kind[t] == kRowReplayed) {
      std::copy_n(replay_idx + t * K, K, ids + t * K);
    } else if (row_kind[t] == kRowNative) {
      kernel_kind[t] = kRowReplayed;
    }
  }
}

void quantile_balancing_rows(const float* zp, const float* beta, const int32_t* replay_idx,
                             const uint8_t* row_kind, int64_t T, int64_t E, int64_t K, int32_t* ids,
                             uint8_t* kernel_kind, float* beta_local) {
  std::vector<float> key(static_cast<size_t>(E)), alpha(static_cast<size_t>(T));
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) key[e] = zp[t * E + e] - beta[e];
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K + 1, order.end(), [&](int32_t a, int32_t b) {
      if (key[a] != key[b]) return key[a] > key[b];
      if (zp[t * E + a] != zp[t * E + b]) return zp[t * E + a] > zp[t * E + b];
      return a < b;
    });
    alpha[t] = key[order[K]];
    if (row_kind[t] == kRowReplayed) {
      std::copy_n(replay_idx + t * K, K, ids + t * K);
    } else {
      std::copy_n(order.data(), K, ids + t * K);
    }
  }
  if (beta_local != nullptr) {
    const int64_t m = T * K / E;  // column target; its (m+1)-th largest is the quantile
    std::vector<float> col(static_cast<size_t>(T));
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t t = 0; t < T; ++t) col[t] = zp[t * E + e] - alpha[t];
      std::nth_element(col.begin(), col.begin() + m, col.end(), std::greater<float>());
      beta_local[e] = col[m];
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    if (row_kind[t] == kRowNative) kernel_kind[t] = kRowReplayed;
  }
}

void rows_to_slots(const float* v, const int64_t* sr, int64_t num_slots, float* o) {
  for (int64_t s = 0; s < num_slots; ++s) o[s] = sr[s] >= 0 ? v[sr[s]] : 0.0f;
}

namespace {

struct Pair {
  int64_t token;
  int32_t expert;
  float weight;
};

}  // namespace

RoutingPlan build_routing_plan(const int32_t* idx, const float* w, int64_t T, int64_t K, int64_t E,
                               int64_t capacity, TokenDropPolicy policy, int64_t align,
                               bool pad_to_capacity) {
  // Sparse when E-sized scratch would dominate (E = 2^24 experts for a handful of tokens): every
  // step below then costs O(T*K log(T*K)) and the only O(E) work left is writing the plan's own
  // [E] counts and [E+1] offsets. Dense (the usual E <= 4*T*K): counting sorts over E, O(T*K + E).
  const bool sparse = E > 4 * std::max<int64_t>(T * K, 1);

  // Distinct pairs per token; a repeated id merges into the slot where it first appears, weights
  // summed in k order.
  std::vector<Pair> pairs;
  pairs.reserve(static_cast<size_t>(T * K));
  std::vector<int64_t> slot_pair(static_cast<size_t>(T * K), -1);
  if (!sparse) {
    // `seen[e]` remembers the last token that used expert e.
    std::vector<int64_t> seen(static_cast<size_t>(E), -1), seen_pair(static_cast<size_t>(E), -1);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx[t * K + k];
        if (e < 0) continue;
        const float wk = w ? w[t * K + k] : 1.0f;
        if (seen[static_cast<size_t>(e)] == t) {
          const int64_t p = seen_pair[static_cast<size_t>(e)];
          pairs[static_cast<size_t>(p)].weight += wk;
          slot_pair[static_cast<size_t>(t * K + k)] = p;
          continue;
        }
        seen[static_cast<size_t>(e)] = t;
        seen_pair[static_cast<size_t>(e)] = static_cast<int64_t>(pairs.size());
        slot_pair[static_cast<size_t>(t * K + k)] = static_cast<int64_t>(pairs.size());
        pairs.push_back({t, e, wk});
      }
    }
  } else {
    // The same rule by scanning the row's earlier slots (E > 4*T*K implies K is small next to E).
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx[t * K + k];
        if (e < 0) continue;
        const float wk = w ? w[t * K + k] : 1.0f;
        int64_t first = -1;
        for (int64_t j = 0; j < k && first < 0; ++j) {
          if (idx[t * K + j] == e) first = slot_pair[static_cast<size_t>(t * K + j)];
        }
        if (first >= 0) {
          pairs[static_cast<size_t>(first)].weight += wk;
          slot_pair[static_cast<size_t>(t * K + k)] = first;
          continue;
        }
        slot_pair[static_cast<size_t>(t * K + k)] = static_cast<int64_t>(pairs.size());
        pairs.push_back({t, e, wk});
      }
    }
  }

  // Bucket pairs by expert (stable: tokens stay ascending), as runs of experts that have pairs.
  struct Run {
    int64_t expert, begin, end, kept;
  };
  std::vector<int64_t> by_expert(pairs.size());
  std::vector<Run> runs;
  if (!sparse) {
    std::vector<int64_t> count(static_cast<size_t>(E), 0);
    for (const Pair& q : pairs) ++count[static_cast<size_t>(q.expert)];
    std::vector<int64_t> fill(static_cast<size_t>(E));
    int64_t at = 0;
    for (int64_t e = 0; e < E; ++e) {
      fill[e] = at;
      if (count[e] > 0) runs.push_back({e, at, at + count[e], count[e]});
      at += count[e];
    }
    for (size_t p = 0; p < pairs.size(); ++p)
      by_expert[fill[pairs[p].expert]++] = static_cast<int64_t>(p);
  } else {
    std::iota(by_expert.begin(), by_expert.end(), int64_t{0});
    std::stable_sort(by_expert.begin(), by_expert.end(), [&](int64_t a, int64_t c) {
      return pairs[static_cast<size_t>(a)].expert < pairs[static_cast<size_t>(c)].expert;
    });
    for (int64_t i = 0; i < static_cast<int64_t>(by_expert.size());) {
      const int64_t e = pairs[static_cast<size_t>(by_expert[i])].expert;
      int64_t j = i;
      while (j < static_cast<int64_t>(by_expert.size()) &&
             pairs[static_cast<size_t>(by_expert[j])].expert == e) {
        ++j;
      }
      runs.push_back({e, i, j, j - i});
      i = j;
    }
  }

  // Capacity: decide which pairs survive, per expert.
  std::vector<uint8_t> kept(pairs.size(), 1);
  int64_t dropped = 0;
  if (capacity >= 0) {
    std::vector<float> pair_weight(pairs.size());
    for (size_t p = 0; p < pairs.size(); ++p) pair_weight[p] = pairs[p].weight;
    for (Run& run : runs) {
      // Bucket order is token-ascending, as the shared drop rule needs.
      const int64_t d = drop_over_capacity(by_expert.data() + run.begin, run.end - run.begin,
                                           pair_weight.data(), capacity, policy, kept.data());
      dropped += d;
      run.kept -= d;
    }
  }

  RoutingPlan plan;
  plan.num_tokens = T;
  plan.num_experts = E;
  plan.top_k = K;
  plan.num_dropped = dropped;
  plan.num_pairs = static_cast<int64_t>(pairs.size()) - dropped;
  plan.num_tokens_per_expert = Tensor::empty({E}, DType::int64);
  plan.expert_offsets = Tensor::empty({E + 1}, DType::int64);
  int64_t* nte = plan.num_tokens_per_expert.data<int64_t>();
  int64_t* off = plan.expert_offsets.data<int64_t>();
  off[0] = 0;
  const bool padded = align > 1 || pad_to_capacity;
  {
    size_t r = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t kc = r < runs.size() && runs[r].expert == e ? runs[r++].kept : 0;
      nte[e] = kc;
      int64_t rows = pad_to_capacity ? capacity : kc;
      rows = (rows + align - 1) / align * align;
      off[e + 1] = off[e] + rows;
    }
  }
  const int64_t R = off[E];
  plan.num_rows = R;
  plan.row_token = Tensor::empty({R}, DType::int64);
  plan.row_expert = Tensor::empty({R}, DType::int32);
  plan.row_weight = Tensor::empty({R}, DType::fp32);
  int64_t* rt = plan.row_token.data<int64_t>();
  int32_t* re = plan.row_expert.data<int32_t>();
  float* rw = plan.row_weight.data<float>();
  std::vector<int64_t> pair_row(pairs.size(), -1);
  std::vector<int64_t> filled_to;  // per run: first row after its kept pairs
  filled_to.reserve(runs.size());
  for (const Run& run : runs) {
    const int64_t e = run.expert;
    int64_t r = off[e];
    for (int64_t i = run.begin; i < run.end; ++i) {
      const int64_t p = by_expert[i];
      if (!kept[p]) continue;
      pair_row[p] = r;
      rt[r] = pairs[p].token;
      re[r] = static_cast<int32_t>(e);
      rw[r] = pairs[p].weight;
      ++r;
    }
    filled_to.push_back(r);
  }
  if (padded) {  // padding rows (token -1, weight 0) after each expert's kept pairs
    size_t ri = 0;
    for (int64_t e = 0; e < E; ++e) {
      int64_t r = off[e];
      if (ri < runs.size() && runs[ri].expert == e) r = filled_to[ri++];
      for (; r < off[e + 1]; ++r) {
        rt[r] = -1;
        re[r] = static_cast<int32_t>(e);
        rw[r] = 0.0f;
      }
    }
  }

  plan.slot_row = Tensor::empty({T, K}, DType::int64);
  int64_t* sr = plan.slot_row.data<int64_t>();
  for (int64_t s = 0; s < T * K; ++s) {
    sr[s] = slot_pair[s] >= 0 ? pair_row[slot_pair[s]] : -1;
  }
  // CSR over tokens: pairs were appended in (token, first slot) order already.
  plan.token_offsets = Tensor::zeros({T + 1}, DType::int64);
  plan.token_rows = Tensor::empty({plan.num_pairs}, DType::int64);
  int64_t* to = plan.token_offsets.data<int64_t>();
  int64_t* tr = plan.token_rows.data<int64_t>();
  int64_t n = 0;
  for (size_t p = 0; p < pairs.size(); ++p) {
    if (!kept[p]) continue;
    ++to[pairs[p].token + 1];
    tr[n++] = pair_row[p];
  }
  for (int64_t t = 0; t < T; ++t) to[t + 1] += to[t];
  return plan;
}

template int64_t drop_over_capacity<float>(const int64_t*, int64_t, const float*, int64_t,
                                           TokenDropPolicy, uint8_t*);
template int64_t drop_over_capacity<double>(const int64_t*, int64_t, const double*, int64_t,
                                            TokenDropPolicy, uint8_t*);
template int64_t apply_capacity<float>(const int32_t*, const float*, int64_t, int64_t, int64_t,
                                       int64_t, TokenDropPolicy, int32_t*, float*, int64_t*);
template int64_t apply_capacity<double>(const int32_t*, const double*, int64_t, int64_t, int64_t,
                                        int64_t, TokenDropPolicy, int32_t*, double*, int64_t*);
template void cast_values<float>(const void*, DType, int64_t, float*);
template void cast_values<double>(const void*, DType, int64_t, double*);
template void sinkhorn_rows<float>(const float*, const int32_t*, const uint8_t*, int64_t, int64_t,
                                   int64_t, double, int32_t*, uint8_t*);
template void sinkhorn_rows<double>(const double*, const int32_t*, const uint8_t*, int64_t, int64_t,
                                    int64_t, double, int32_t*, uint8_t*);

}  // namespace switchyard::cpu
