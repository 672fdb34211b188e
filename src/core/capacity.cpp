// Expert capacity (Megatron-Core get_capacity) and token dropping (apply_router_token_dropping),
// shared by the router and the routing plan.
#include "capacity.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "check.h"

namespace switchyard {

const char* token_drop_policy_name(TokenDropPolicy p) {
  return p == TokenDropPolicy::probs ? "probs" : "position";
}

TokenDropPolicy parse_token_drop_policy(const std::string& name) {
  if (name == "probs") return TokenDropPolicy::probs;
  if (name == "position") return TokenDropPolicy::position;
  detail::fail_arg("route", "token_drop_policy must be probs or position, got \"", name, "\"");
}

int64_t expert_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                        double capacity_factor) {
  // Megatron: math.ceil((num_tokens * topk / num_experts) * capacity_factor), in double.
  const double c = std::ceil(static_cast<double>(num_tokens * top_k) /
                             static_cast<double>(num_experts) * capacity_factor);
  return c >= static_cast<double>(num_tokens) ? num_tokens : static_cast<int64_t>(c);
}

namespace detail {

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

template int64_t drop_over_capacity<float>(const int64_t*, int64_t, const float*, int64_t,
                                           TokenDropPolicy, uint8_t*);
template int64_t drop_over_capacity<double>(const int64_t*, int64_t, const double*, int64_t,
                                            TokenDropPolicy, uint8_t*);
template int64_t apply_capacity<float>(const int32_t*, const float*, int64_t, int64_t, int64_t,
                                       int64_t, TokenDropPolicy, int32_t*, float*, int64_t*);
template int64_t apply_capacity<double>(const int32_t*, const double*, int64_t, int64_t, int64_t,
                                        int64_t, TokenDropPolicy, int32_t*, double*, int64_t*);

}  // namespace detail
}  // namespace switchyard
