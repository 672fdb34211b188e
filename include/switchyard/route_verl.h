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

#include "switchyard/route_import.h"
#include "switchyard/routes.h"

namespace switchyard {

enum class PaddingSide : uint8_t { left, right };

/// How to lay a batch out.
struct VerlOptions {
  int64_t num_hidden_layers = 0;  ///< decoder layers of the model (the layer axis of the output)
  PaddingSide padding_side = PaddingSide::left;  ///< verl pads prompts on the left
  int64_t seq_len = 0;  ///< columns; 0 = the longest table. Must be >= every table's length.
};

/// A batch in verl's layout.
struct VerlBatch {
  Tensor routed_experts;  ///< int16 [batch, seq, num_hidden_layers, K], as verl holds it
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

/// verl's batch -> one route table per batch row (the inverse of to_verl; what
/// switchyard.routes.from_verl calls). `routed_experts` `[batch, seq, num_input_layers, K]`
/// (int16 as verl stores it; uint8, uint16, int32 or int64 too), `attention_mask` `[batch, seq]`
/// (bool, uint8, int32 or int64; nonzero = real token, any padding pattern). Table b holds the
/// real tokens of row b, in order, on the MoE layers of `options.layer_map`; every row is checked
/// and handled exactly as the vLLM importer does (options.zero_rows, options.invalid_rows: verl's
/// zero-filled last token is an all-zero row), but no row is appended: a table has one row per
/// real token. options.num_input_layers / top_k are checked against the tensor when nonzero;
/// options.prompt_start must be 0. The report counts every table row in num_tokens; sources
/// are "routed_experts[b]". Rows run on the engine's OpenMP threads; the result and the error
/// (the first failing row in batch order) do not depend on the thread count. Throws
/// std::invalid_argument (op "from_verl") naming the batch row, token and position.
ImportResult from_verl(const Tensor& routed_experts, const Tensor& attention_mask,
                       const ImportOptions& options);

}  // namespace switchyard
