// CPU kernels of the routing steps (routing_kernels.h). Moved from the front-ends (capacity.cpp,
// router_balancing.cpp, router_select.cpp, permute.cpp) unchanged, so results are bit for bit the
// same.
#include "cpu/routing_kernels.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <vector>

#include "cpu/router_kernels.h"

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
