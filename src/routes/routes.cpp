// Route tables and the hidden-layer -> MoE-layer map.
#include "switchyard/routes.h"

#include <algorithm>
#include <cstring>

#include "check.h"

namespace switchyard {

RouteTable RouteTable::none(int64_t num_tokens, int64_t num_moe_layers, int64_t top_k,
                            int64_t num_experts) {
  RouteTable t;
  t.topk_idx = Tensor::full({num_tokens, num_moe_layers, top_k}, DType::int32, -1.0);
  t.num_experts = num_experts;
  return t;
}

void check_route_table(const RouteTable& t, const char* op, const char* name) {
  detail::check_defined(t.topk_idx, op, name);
  detail::check_dtype(t.topk_idx, op, name, {DType::int32});
  detail::check_dim(t.topk_idx, op, name, 3);
  if (t.num_experts < 1) {
    detail::fail_arg(op, name, ".num_experts must be >= 1, got ", t.num_experts);
  }
  const int32_t* p = t.topk_idx.data<int32_t>();
  const int64_t n = t.topk_idx.numel();
  const int64_t L = t.topk_idx.size(1), K = t.topk_idx.size(2);
  // A branch-free min/max pass (vectorised) first; the slow search only runs on bad input.
  int32_t lo = -1, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, p[i]);
    hi = std::max(hi, p[i]);
  }
  if (lo >= -1 && hi < t.num_experts) return;
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] < -1 || p[i] >= t.num_experts) {
      const int64_t token = i / (L * K), layer = (i / K) % L;
      detail::fail_arg(op, name, ": ids must be -1 or in [0, num_experts=", t.num_experts,
                       "), got ", p[i], " at token ", token, ", layer ", layer, ", slot ", i % K);
    }
  }
}

bool route_tables_equal(const RouteTable& a, const RouteTable& b) {
  if (a.num_experts != b.num_experts) return false;
  if (a.topk_idx.defined() != b.topk_idx.defined()) return false;
  if (!a.topk_idx.defined()) return true;
  if (a.topk_idx.shape() != b.topk_idx.shape()) return false;
  if (a.topk_idx.dtype() != b.topk_idx.dtype()) return false;
  return std::memcmp(a.topk_idx.raw(), b.topk_idx.raw(), a.topk_idx.nbytes()) == 0;
}

std::vector<int64_t> moe_layer_indices(const LayerMap& map, int64_t num_input_layers) {
  const char* op = "layer_map";
  if (map.num_mtp_layers < 0)
    detail::fail_arg(op, "num_mtp_layers must be >= 0, got ", map.num_mtp_layers);
  if (map.first_k_dense < 0)
    detail::fail_arg(op, "first_k_dense must be >= 0, got ", map.first_k_dense);
  const int64_t hidden = num_input_layers - map.num_mtp_layers;
  if (hidden < 1) {
    detail::fail_arg(op, "the input has ", num_input_layers,
                     " layers, expected more than num_mtp_layers=", map.num_mtp_layers);
  }
  std::vector<int64_t> out;
  if (!map.moe_layer_freq.empty()) {
    if (static_cast<int64_t>(map.moe_layer_freq.size()) != hidden) {
      detail::fail_arg(op, "moe_layer_freq must have one entry per hidden layer (", hidden, " = ",
                       num_input_layers, " input layers - ", map.num_mtp_layers,
                       " MTP layers), got ", map.moe_layer_freq.size(), " entries");
    }
    for (int64_t l = 0; l < hidden; ++l) {
      const int64_t v = map.moe_layer_freq[static_cast<size_t>(l)];
      if (v != 0 && v != 1)
        detail::fail_arg(op, "moe_layer_freq entries must be 0 or 1, got ", v, " at layer ", l);
      if (v == 1) out.push_back(l);
    }
  } else {
    if (map.first_k_dense >= hidden) {
      detail::fail_arg(op, "first_k_dense must be < the ", hidden, " hidden layers, got ",
                       map.first_k_dense);
    }
    for (int64_t l = map.first_k_dense; l < hidden; ++l) out.push_back(l);
  }
  if (out.empty()) detail::fail_arg(op, "moe_layer_freq marks no MoE layer");
  return out;
}

std::vector<int64_t> parse_moe_layer_freq(const std::string& text) {
  const char* op = "layer_map";
  std::vector<int64_t> out;
  size_t pos = 0;
  if (text.empty()) detail::fail_arg(op, "moe_layer_freq list is empty");
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(pos, comma - pos);
    int64_t reps = 1;
    std::string value = item;
    const size_t x = item.find('x');
    if (x != std::string::npos) {
      const std::string r = item.substr(0, x);
      value = item.substr(x + 1);
      if (r.empty() || r.size() > 6 || r.find_first_not_of("0123456789") != std::string::npos) {
        detail::fail_arg(op, "moe_layer_freq item must be 0, 1 or NxV, got \"", item, "\"");
      }
      reps = std::stoll(r);
    }
    if (value != "0" && value != "1") {
      detail::fail_arg(op, "moe_layer_freq item must be 0, 1 or NxV with V in {0,1}, got \"", item,
                       "\"");
    }
    for (int64_t i = 0; i < reps; ++i) out.push_back(value == "1" ? 1 : 0);
    pos = comma + 1;
  }
  return out;
}

}  // namespace switchyard
