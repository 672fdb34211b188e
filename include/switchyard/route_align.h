// Alignment of route tables to the trainer's layout, and back. Each function is a pure re-indexing
// of rows (deterministic, no arithmetic on ids); padding rows are -1. For a recorded R2 pass, apply
// the inverses in reverse order: sp_gather, cp_zigzag_gather, concat_layers, unpack_thd.
#pragma once

#include <cstdint>
#include <vector>

#include "switchyard/routes.h"

namespace switchyard {

/// Drops padding from a batch. `topk_idx` int32 `[batch, seq, num_moe_layers, top_k]`;
/// `attention_mask` `[batch, seq]` of bool, uint8, int32 or int64 (nonzero = real token), left or
/// right padded (any pattern: real tokens are kept in order). Returns one table per batch row.
std::vector<RouteTable> drop_padding(const Tensor& topk_idx, const Tensor& attention_mask,
                                     int64_t num_experts);

/// Padding rule of packed (THD) sequences, as Megatron-Core pads them.
struct PackOptions {
  int64_t tp_size = 1;  ///< tensor-parallel size
  int64_t cp_size = 1;  ///< context-parallel size; >1 pads to 2*tp*cp (zigzag needs 2*cp chunks)
  /// Extra alignment for FP8 (0 = none, or e.g. 16 or 128); the multiple is lcm(rule, fp8_align).
  int64_t fp8_align = 0;
};

/// Multiple each sequence is padded to: tp (cp == 1) or 2*tp*cp, then lcm with fp8_align.
/// Throws std::invalid_argument when a size is < 1 (fp8_align < 0) or the multiple exceeds 2^20.
int64_t pack_alignment(const PackOptions& options);

/// Sequences packed into one THD table.
struct PackedRoutes {
  RouteTable table;                        ///< `[cu_seqlens_padded.back(), layers, K]`
  std::vector<int64_t> cu_seqlens;         ///< exclusive prefix sum of real lengths (n+1)
  std::vector<int64_t> cu_seqlens_padded;  ///< exclusive prefix sum of padded lengths (n+1)
};

/// Packs sequences end to end, each padded with -1 rows to pack_alignment(options).
/// All tables must share num_moe_layers, top_k and num_experts.
PackedRoutes pack_thd(const std::vector<RouteTable>& sequences, const PackOptions& options);
/// Inverse of pack_thd: the real rows of each sequence.
std::vector<RouteTable> unpack_thd(const PackedRoutes& packed);

/// Context-parallel zigzag split of a packed table: every sequence (padded length divisible by
/// 2*cp_size) is cut in 2*cp_size chunks and rank r keeps chunks r and 2*cp_size-1-r, sequence
/// after sequence (cp_size 1: the table itself). `cu_seqlens_padded` as from pack_thd.
RouteTable cp_zigzag_split(const RouteTable& packed, const std::vector<int64_t>& cu_seqlens_padded,
                           int64_t cp_size, int64_t cp_rank);
/// Inverse: the packed table from every rank's piece (index = cp rank).
RouteTable cp_zigzag_gather(const std::vector<RouteTable>& pieces,
                            const std::vector<int64_t>& cu_seqlens_padded);

/// Sequence-parallel split: rank r of tp_size keeps the r-th contiguous block of tokens
/// (num_tokens must be divisible by tp_size).
RouteTable sp_split(const RouteTable& table, int64_t tp_size, int64_t tp_rank);
/// Inverse: concatenates the pieces in rank order.
RouteTable sp_gather(const std::vector<RouteTable>& pieces);

/// Pipeline layout: which hidden layers a (virtual) pipeline chunk owns.
struct PipelineOptions {
  int64_t pp_size = 1;
  int64_t pp_rank = 0;
  int64_t vpp_size = 1;  ///< virtual stages per rank (model chunks)
  int64_t vpp_rank = 0;
  /// Hidden layers of the first / last pipeline stage when uneven (0 = even split), as
  /// Megatron-Core's decoder_first/last_pipeline_num_layers (only with vpp_size == 1).
  int64_t first_stage_layers = 0;
  int64_t last_stage_layers = 0;
};

/// MoE-layer range [begin, end) a pipeline chunk owns: hidden layers are split across
/// pp_size*vpp_size chunks (chunk = vpp_rank*pp_size + pp_rank) and only MoE layers are counted.
/// `moe_layers` are the hidden-layer indices of the MoE layers (moe_layer_indices).
std::pair<int64_t, int64_t> pp_moe_layer_range(const std::vector<int64_t>& moe_layers,
                                               int64_t num_hidden_layers,
                                               const PipelineOptions& options);
/// Layers [begin, end) of a table.
RouteTable slice_layers(const RouteTable& table, int64_t begin, int64_t end);
/// Inverse of slicing: concatenates tables along the layer dimension (same tokens and K).
RouteTable concat_layers(const std::vector<RouteTable>& pieces);

/// Splits sequences into consecutive micro-batches of `micro_batch_size` sequences (the last may be
/// shorter).
std::vector<std::vector<RouteTable>> split_micro_batches(const std::vector<RouteTable>& sequences,
                                                         int64_t micro_batch_size);

/// Concatenates tables along tokens (same layers, K and num_experts).
RouteTable concat_tokens(const std::vector<RouteTable>& pieces);

}  // namespace switchyard
