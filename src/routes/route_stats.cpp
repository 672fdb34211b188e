// Expert load and route drift: integer counting over route tables.
#include "switchyard/route_stats.h"

#include <algorithm>
#include <string>

#include "check.h"

namespace switchyard {

using detail::fail_arg;

void accumulate_expert_load(const RouteTable& table, ExpertLoad& load) {
  const char* op = "expert_load";
  check_route_table(table, op, "table");
  const int64_t T = table.num_tokens(), L = table.num_moe_layers(), K = table.top_k(),
                E = table.num_experts;
  if (load.num_experts == 0 && load.num_moe_layers == 0) {
    load.num_experts = E;
    load.num_moe_layers = L;
    load.num_tokens_per_expert.assign(size_t(L * E), 0);
    load.num_assignments.assign(size_t(L), 0);
    load.num_none_rows.assign(size_t(L), 0);
  }
  if (load.num_experts != E || load.num_moe_layers != L) {
    fail_arg(op, "table must have num_experts=", load.num_experts,
             " and num_moe_layers=", load.num_moe_layers, " like the load, got ", E, " and ", L);
  }
  const int32_t* p = table.topk_idx.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t l = 0; l < L; ++l) {
      const int32_t* row = p + (t * L + l) * K;
      int64_t valid = 0;
      for (int64_t k = 0; k < K; ++k) {
        if (row[k] >= 0) {
          ++load.num_tokens_per_expert[size_t(l * E + row[k])];
          ++valid;
        }
      }
      load.num_assignments[size_t(l)] += valid;
      if (valid == 0) ++load.num_none_rows[size_t(l)];
    }
  }
}

ExpertLoad expert_load(const RouteTable& table) {
  ExpertLoad load;
  accumulate_expert_load(table, load);
  return load;
}

std::vector<HotExpert> hot_experts(const ExpertLoad& load, int64_t layer, int64_t n) {
  if (layer < 0 || layer >= load.num_moe_layers) {
    fail_arg("hot_experts", "layer must be in [0, ", load.num_moe_layers, "), got ", layer);
  }
  if (n < 0) fail_arg("hot_experts", "n must be >= 0, got ", n);
  std::vector<HotExpert> all(static_cast<size_t>(load.num_experts));
  const int64_t total = load.num_assignments[size_t(layer)];
  for (int64_t e = 0; e < load.num_experts; ++e) {
    const int64_t c = load.count(layer, e);
    all[size_t(e)] = {e, c, total > 0 ? double(c) / double(total) : 0.0};
  }
  std::stable_sort(all.begin(), all.end(),
                   [](const HotExpert& a, const HotExpert& b) { return a.count > b.count; });
  all.resize(static_cast<size_t>(std::min<int64_t>(n, load.num_experts)));
  return all;
}

double load_imbalance(const ExpertLoad& load, int64_t layer) {
  if (layer < 0 || layer >= load.num_moe_layers) {
    fail_arg("load_imbalance", "layer must be in [0, ", load.num_moe_layers, "), got ", layer);
  }
  const int64_t total = load.num_assignments[size_t(layer)];
  if (total == 0) return 0.0;
  int64_t mx = 0;
  for (int64_t e = 0; e < load.num_experts; ++e) mx = std::max(mx, load.count(layer, e));
  return double(mx) * double(load.num_experts) / double(total);
}

double RouteDrift::decision_mismatch() const {
  return num_decisions ? double(num_differing_decisions) / double(num_decisions) : 0.0;
}
double RouteDrift::token_mismatch() const {
  return num_tokens ? double(num_differing_tokens) / double(num_tokens) : 0.0;
}
double RouteDrift::mean_differing_layers() const {
  return num_tokens ? double(num_differing_rows) / double(num_tokens) : 0.0;
}
double RouteDrift::layer_mismatch(int64_t layer) const {
  if (layer < 0 || layer >= static_cast<int64_t>(layer_decisions.size())) {
    fail_arg("route_drift", "layer must be in [0, ", layer_decisions.size(), "), got ", layer);
  }
  const int64_t d = layer_decisions[size_t(layer)];
  return d ? double(layer_differing_decisions[size_t(layer)]) / double(d) : 0.0;
}

void accumulate_route_drift(const RouteTable& a, const RouteTable& b, RouteDrift& drift) {
  const char* op = "route_drift";
  check_route_table(a, op, "a");
  check_route_table(b, op, "b");
  if (a.topk_idx.shape() != b.topk_idx.shape() || a.num_experts != b.num_experts) {
    fail_arg(op, "a and b must have the same shape and num_experts, got ",
             shape_str(a.topk_idx.shape()), " (E=", a.num_experts, ") and ",
             shape_str(b.topk_idx.shape()), " (E=", b.num_experts, ")");
  }
  const int64_t T = a.num_tokens(), L = a.num_moe_layers(), K = a.top_k();
  if (drift.layer_decisions.empty()) {
    drift.layer_decisions.assign(size_t(L), 0);
    drift.layer_differing_decisions.assign(size_t(L), 0);
  }
  if (static_cast<int64_t>(drift.layer_decisions.size()) != L) {
    fail_arg(op, "tables must have the drift's ", drift.layer_decisions.size(), " layers, got ", L);
  }
  const int32_t* pa = a.topk_idx.data<int32_t>();
  const int32_t* pb = b.topk_idx.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    int64_t compared = 0, differing = 0;
    for (int64_t l = 0; l < L; ++l) {
      const int32_t* ra = pa + (t * L + l) * K;
      const int32_t* rb = pb + (t * L + l) * K;
      const bool va = std::any_of(ra, ra + K, [](int32_t v) { return v >= 0; });
      const bool vb = std::any_of(rb, rb + K, [](int32_t v) { return v >= 0; });
      if (!va || !vb) {
        ++drift.num_skipped_rows;
        continue;
      }
      ++compared;
      int64_t decisions = 0, diff = 0;
      for (int64_t k = 0; k < K; ++k) {
        if (ra[k] < 0) continue;
        ++decisions;
        diff += std::find(rb, rb + K, ra[k]) == rb + K;
      }
      drift.num_decisions += decisions;
      drift.num_differing_decisions += diff;
      drift.layer_decisions[size_t(l)] += decisions;
      drift.layer_differing_decisions[size_t(l)] += diff;
      // A row differs when the sets differ (B may hold an id A lacks even if A's ids are all in B).
      bool row_differs = diff > 0;
      if (!row_differs) {
        for (int64_t k = 0; k < K && !row_differs; ++k) {
          row_differs = rb[k] >= 0 && std::find(ra, ra + K, rb[k]) == ra + K;
        }
      }
      differing += row_differs;
    }
    drift.num_rows += compared;
    drift.num_differing_rows += differing;
    if (compared > 0) {
      ++drift.num_tokens;
      drift.num_differing_tokens += differing > 0;
    }
  }
}

RouteDrift route_drift(const RouteTable& a, const RouteTable& b) {
  RouteDrift d;
  accumulate_route_drift(a, b, d);
  return d;
}

namespace {

// A row's K ids in ascending order (insertion sort: K is a top-k, a handful of ids).
void sorted_row(const int32_t* row, int64_t K, int32_t* out) {
  for (int64_t k = 0; k < K; ++k) {
    const int32_t v = row[k];
    int64_t j = k;
    for (; j > 0 && out[j - 1] > v; --j) out[j] = out[j - 1];
    out[j] = v;
  }
}

}  // namespace

RowMismatch row_mismatch(const Tensor& reference, const Tensor& token_mask,
                         const std::vector<Tensor>& tables, const std::vector<int64_t>& top_ks) {
  const char* op = "row_mismatch";
  detail::check_defined(reference, op, "reference");
  detail::check_dtype(reference, op, "reference", {DType::int32});
  detail::check_dim(reference, op, "reference", 3);
  detail::check_device(reference, op, "reference", kCpu);
  const int64_t T = reference.size(0), L = reference.size(1), K = reference.size(2);
  const uint8_t* mask = nullptr;  // (bool is stored as one byte, 0 or 1)
  if (token_mask.defined()) {
    detail::check_dtype(token_mask, op, "token_mask", {DType::boolean, DType::uint8});
    detail::check_shape(token_mask, op, "token_mask", {T});
    detail::check_device(token_mask, op, "token_mask", kCpu);
    mask = static_cast<const uint8_t*>(token_mask.raw());
  }
  if (!top_ks.empty()) {
    if (static_cast<int64_t>(top_ks.size()) != L) {
      fail_arg(op, "top_ks must hold one K per layer (", L, "), got ", top_ks.size());
    }
    for (size_t l = 0; l < top_ks.size(); ++l) {
      if (top_ks[l] < 1 || top_ks[l] > K) {
        fail_arg(op, "top_ks[", l, "] must be in [1, K=", K, "], got ", top_ks[l]);
      }
    }
  }
  std::vector<const int32_t*> rows;
  for (size_t i = 0; i < tables.size(); ++i) {
    const std::string name = "tables[" + std::to_string(i) + "]";
    detail::check_defined(tables[i], op, name.c_str());
    detail::check_dtype(tables[i], op, name.c_str(), {DType::int32});
    detail::check_shape(tables[i], op, name.c_str(), reference.shape());
    detail::check_device(tables[i], op, name.c_str(), kCpu);
    rows.push_back(tables[i].data<int32_t>());
  }
  RowMismatch out;
  out.num_differing_rows.assign(tables.size(), 0);
  std::vector<int32_t> want(static_cast<size_t>(K)), got(static_cast<size_t>(K));
  const int32_t* ref = reference.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    if (mask != nullptr && mask[t] == 0) continue;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t at = (t * L + l) * K;
      const int64_t k_l = top_ks.empty() ? K : top_ks[static_cast<size_t>(l)];
      const int32_t* r = ref + at;
      if (std::any_of(r, r + k_l, [](int32_t v) { return v < 0; })) continue;
      ++out.num_compared_rows;
      bool sorted = false;  // (the reference row sorted once, when a row first needs it)
      for (size_t i = 0; i < rows.size(); ++i) {
        const int32_t* x = rows[i] + at;
        if (std::equal(r, r + k_l, x)) continue;  // the same ids in the same slots (replayed)
        if (!sorted) {
          sorted_row(r, k_l, want.data());
          sorted = true;
        }
        sorted_row(x, k_l, got.data());
        out.num_differing_rows[i] += !std::equal(want.begin(), want.begin() + k_l, got.begin());
      }
    }
  }
  return out;
}

}  // namespace switchyard
