// Route tables: the experts chosen for every token of a sequence in every MoE layer, as recorded by
// a rollout engine (R3) or by the trainer's own pass (R2), and the map from a model's hidden layers
// to its MoE layers. See route_file.h (storage), route_import.h (vLLM / SGLang), route_align.h
// (trainer layout) and route_stats.h (load and drift).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "switchyard/tensor.h"

namespace switchyard {

/// The routes of one sequence (or of one packed / split piece of a batch).
/// `topk_idx` is int32 `[num_tokens, num_moe_layers, top_k]`; an entry is an expert id in
/// `[0, num_experts)` or `-1` for "no route" (padding, the last sampled token, a dropped slot) —
/// never 0 as a placeholder. Integer data: never differentiable.
struct RouteTable {
  Tensor topk_idx;
  int64_t num_experts = 0;

  int64_t num_tokens() const { return topk_idx.defined() ? topk_idx.size(0) : 0; }
  int64_t num_moe_layers() const { return topk_idx.defined() ? topk_idx.size(1) : 0; }
  int64_t top_k() const { return topk_idx.defined() ? topk_idx.size(2) : 0; }

  /// A table of `num_tokens` rows, all `-1`.
  static RouteTable none(int64_t num_tokens, int64_t num_moe_layers, int64_t top_k,
                         int64_t num_experts);
};

/// Throws std::invalid_argument ("[op] ...") unless `t.topk_idx` is a defined int32 3-D tensor,
/// `num_experts >= 1` and every entry is `-1` or in `[0, num_experts)`. Does not check rows for
/// repeated ids (replay does that).
void check_route_table(const RouteTable& t, const char* op, const char* name);

/// Tables are equal: same shape, same num_experts, same ids.
bool route_tables_equal(const RouteTable& a, const RouteTable& b);

/// Which of a checkpoint's hidden layers are MoE layers (Megatron-Core's vocabulary).
/// The layers of an imported array are `num_hidden_layers` decoder layers followed by
/// `num_mtp_layers` multi-token-prediction layers; MTP layers are always left out.
/// A hidden layer is MoE when `moe_layer_freq` is non-empty and says 1 for it (one 0/1 entry per
/// hidden layer), otherwise when its index is `>= first_k_dense` (DeepSeek's
/// `first_k_dense_replace`; 0 = every layer is MoE).
struct LayerMap {
  int64_t first_k_dense = 0;
  std::vector<int64_t> moe_layer_freq;
  int64_t num_mtp_layers = 0;
};

/// Hidden-layer indices of the MoE layers, ascending, for an array with `num_input_layers` layers
/// (hidden + MTP). Throws std::invalid_argument (op "layer_map") when the map does not fit: a
/// frequency list whose length is not `num_input_layers - num_mtp_layers`, entries other than 0/1,
/// `first_k_dense` beyond the hidden layers, or no MoE layer at all.
std::vector<int64_t> moe_layer_indices(const LayerMap& map, int64_t num_input_layers);

/// Parses a frequency list as the command line takes it: comma-separated 0/1 entries, each
/// optionally repeated as `NxV` ("3x0,45x1" = three dense then 45 MoE layers).
/// Throws std::invalid_argument (op "layer_map") on anything else.
std::vector<int64_t> parse_moe_layer_freq(const std::string& text);

}  // namespace switchyard
