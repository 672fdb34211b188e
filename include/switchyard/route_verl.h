// verl's batch layout of rollout routes, from switchyard route tables: the export that is the
// inverse of reading verl's `routed_experts` (switchyard.routes.from_verl = drop_padding + the vLLM
// importer's layer map).
//
// verl keeps `routed_experts` as int16 `[batch, seq, num_hidden_layers, K]` next to the batch's
// `attention_mask` `[batch, seq]`: every hidden layer (dense layers hold 0), padding positions 0,
// and a token without a route (the last sampled one) 0 as well.
#pragma once

#include <cstdint>
#include <vector>

#include "switchyard/routes.h"

namespace switchyard {

enum class PaddingSide : uint8_t { left, right };

/// How to lay a batch out.
struct VerlOptions {
  int64_t num_hidden_layers = 0;  ///< decoder layers of the model (the layer axis of the output)
  PaddingSide padding_side = PaddingSide::left;  ///< verl pads prompts on the left
  int64_t seq_len = 0;  ///< columns; 0 = the longest table. Must be >= every table's length.
};

/// A batch in verl's layout. `routed_experts` is int32 here (the engine has no int16 tensor):
/// every value is in [0, 32767], so narrowing it to verl's int16 is exact.
struct VerlBatch {
  Tensor routed_experts;  ///< int32 [batch, seq, num_hidden_layers, K]
  Tensor attention_mask;  ///< int64 [batch, seq], 1 = real token
};

/// Lays route tables (int32 `[T_i, moe_layers, K]`, -1 = no route) out as verl's batch: table i
/// fills row i at its padded positions, column m of a table goes to hidden layer moe_layers[m],
/// and -1 rows, dense layers and padding are 0. Throws std::invalid_argument (op "to_verl") when
/// moe_layers is not strictly increasing inside [0, num_hidden_layers) or does not match the
/// tables' layer count, when tables differ in K, when an expert id does not fit int16, when a
/// row mixes -1 with ids (verl cannot hold it) or when seq_len is too short.
VerlBatch to_verl(const std::vector<RouteTable>& tables, const std::vector<int64_t>& moe_layers,
                  const VerlOptions& options);

/// The same, at the real positions of a given `attention_mask` `[batch, seq]` (bool, uint8,
/// int32 or int64; nonzero = real token, any padding pattern): row b must have exactly
/// tables[b].num_tokens() real positions. The returned mask is the given one as int64 0/1.
VerlBatch to_verl(const std::vector<RouteTable>& tables, const std::vector<int64_t>& moe_layers,
                  int64_t num_hidden_layers, const Tensor& attention_mask);

}  // namespace switchyard
