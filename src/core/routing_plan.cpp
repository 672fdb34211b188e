// Front-end and builder of the routing plan. Building is a counting sort over distinct pairs,
// O(T*K + E), or for E > 4*T*K a sort of the pairs, O(T*K log(T*K)) plus writing the [E] counts;
// single-threaded (it is tiny next to the row movement it sizes).
#include "switchyard/routing_plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/backend.h"
#include "check.h"
#include "switchyard/capacity.h"

namespace switchyard {

namespace {

constexpr const char* kOp = "routing_plan";

struct Pair {
  int64_t token;
  int32_t expert;
  float weight;
};

}  // namespace

RoutingPlan build_routing_plan(const Tensor& topk_idx, const Tensor& topk_weights,
                               int64_t num_experts, const RoutingPlanOptions& options) {
  detail::check_defined(topk_idx, kOp, "topk_idx");
  detail::check_dim(topk_idx, kOp, "topk_idx", 2);
  detail::check_dtype(topk_idx, kOp, "topk_idx", {DType::int32});
  const int64_t T = topk_idx.size(0), K = topk_idx.size(1), E = num_experts;
  if (E < 1) detail::fail_arg(kOp, "num_experts must be >= 1, got num_experts=", E);
  const bool has_w = topk_weights.defined();
  if (has_w) {
    detail::check_dtype(topk_weights, kOp, "topk_weights", {DType::fp32});
    detail::check_shape(topk_weights, kOp, "topk_weights", {T, K});
  }
  if (options.expert_alignment < 1) {
    detail::fail_arg(
        kOp, "expert_alignment must be >= 1, got expert_alignment=", options.expert_alignment);
  }
  if (options.expert_capacity < -1) {
    detail::fail_arg(kOp, "expert_capacity must be >= 0 or -1 (none), got expert_capacity=",
                     options.expert_capacity);
  }
  if (!std::isfinite(options.capacity_factor) || options.capacity_factor < 0.0) {
    detail::fail_arg(kOp, "capacity_factor must be finite and >= 0 (0 = no capacity), got ",
                     "capacity_factor=", options.capacity_factor);
  }
  if (options.token_drop_policy != TokenDropPolicy::probs &&
      options.token_drop_policy != TokenDropPolicy::position) {
    detail::fail_arg(kOp, "token_drop_policy must be probs or position, got value ",
                     static_cast<int>(options.token_drop_policy));
  }
  const int32_t* idx = topk_idx.data<int32_t>();
  const float* w = has_w ? topk_weights.data<float>() : nullptr;
  const backend::Context ctx = backend::context_of(topk_idx, kOp);
  {
    const int64_t i = backend::first_id_out_of_range(ctx, idx, T * K, -1, E);
    if (i < T * K) {
      detail::fail_arg(kOp, "topk_idx must hold ids in [0, num_experts=", E,
                       ") or -1, got topk_idx[", i / K, ", ", i % K, "]=", idx[i]);
    }
  }

  int64_t capacity = -1;
  if (options.expert_capacity >= 0) {
    capacity = options.expert_capacity;
  } else if (options.capacity_factor > 0.0) {
    capacity = expert_capacity(T, K, E, options.capacity_factor);
  }
  if (options.pad_to_capacity && capacity < 0) {
    detail::fail_arg(kOp, "pad_to_capacity needs a capacity (capacity_factor > 0 or ",
                     "expert_capacity >= 0), got neither");
  }

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
      const int64_t d = backend::drop_over_capacity(
          ctx, by_expert.data() + run.begin, run.end - run.begin, pair_weight.data(), capacity,
          options.token_drop_policy, kept.data());
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
  const int64_t align = options.expert_alignment;
  const bool padded = align > 1 || options.pad_to_capacity;
  {
    size_t r = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t kc = r < runs.size() && runs[r].expert == e ? runs[r++].kept : 0;
      nte[e] = kc;
      int64_t rows = options.pad_to_capacity ? capacity : kc;
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

}  // namespace switchyard
