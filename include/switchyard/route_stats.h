// Statistics over route tables: expert load and hot experts per layer, and drift between two
// routings of the same tokens (rollout vs trainer, R3 vs live). Integer counting: deterministic.
#pragma once

#include <cstdint>
#include <vector>

#include "switchyard/routes.h"

namespace switchyard {

/// Token-expert assignments per layer and expert.
struct ExpertLoad {
  int64_t num_experts = 0;
  int64_t num_moe_layers = 0;
  /// `[num_moe_layers * num_experts]` (row-major): valid (token, expert) pairs per layer and
  /// expert.
  std::vector<int64_t> num_tokens_per_expert;
  /// Valid ids per layer (sum of the row above).
  std::vector<int64_t> num_assignments;
  /// Rows that are entirely -1, per layer.
  std::vector<int64_t> num_none_rows;
  int64_t count(int64_t layer, int64_t expert) const {
    return num_tokens_per_expert[static_cast<size_t>(layer * num_experts + expert)];
  }
};

/// Accumulates `table` into `load` (initialise with the first table, or pass an empty ExpertLoad).
void accumulate_expert_load(const RouteTable& table, ExpertLoad& load);
/// Load of one table.
ExpertLoad expert_load(const RouteTable& table);

/// An expert and its share of a layer's assignments.
struct HotExpert {
  int64_t expert = 0;
  int64_t count = 0;
  double share = 0.0;
};
/// The `n` most loaded experts of a layer, count descending (ties: lower id first).
std::vector<HotExpert> hot_experts(const ExpertLoad& load, int64_t layer, int64_t n);
/// max / mean of a layer's per-expert counts (1 = perfectly balanced; 0 when no assignment).
double load_imbalance(const ExpertLoad& load, int64_t layer);

/// Drift between two routings of the same tokens. A row (token, layer) is compared when both sides
/// have at least one valid id there; rows are compared as sets (the order inside a top-k row does
/// not change which experts run). A decision is one of the K ids of a compared row in A; it
/// differs when B's row does not contain it.
struct RouteDrift {
  int64_t num_tokens = 0;     ///< tokens with at least one compared row
  int64_t num_rows = 0;       ///< compared rows
  int64_t num_decisions = 0;  ///< valid ids in compared rows of A
  int64_t num_differing_decisions = 0;
  int64_t num_differing_rows = 0;
  int64_t num_differing_tokens = 0;                ///< tokens with at least one differing layer
  int64_t num_skipped_rows = 0;                    ///< rows where one side or both are all -1
  std::vector<int64_t> layer_decisions;            ///< per layer
  std::vector<int64_t> layer_differing_decisions;  ///< per layer

  double decision_mismatch() const;      ///< share of decisions that differ
  double token_mismatch() const;         ///< share of tokens with any differing layer
  double mean_differing_layers() const;  ///< differing rows per compared token
  double layer_mismatch(int64_t layer) const;
};

/// Drift of `b` against `a`; both tables need the same shape and num_experts.
RouteDrift route_drift(const RouteTable& a, const RouteTable& b);
/// Adds the drift of another pair of tables into `drift` (same layer count).
void accumulate_route_drift(const RouteTable& a, const RouteTable& b, RouteDrift& drift);

/// A router mismatch metric: the rows of several routings of the same tokens whose expert sets
/// differ from a reference routing's (a rollout's routes against the trainer routers' own choice
/// and against the ids they used).
struct RowMismatch {
  int64_t num_compared_rows = 0;            ///< reference rows compared
  std::vector<int64_t> num_differing_rows;  ///< per table: compared rows that differ
};

/// Counts, for each of `tables` (int32 [T, L, K], the reference's shape), the rows (token, layer)
/// whose K ids differ from `reference`'s (int32 [T, L, K]) as multisets (each row sorted, then
/// compared slot by slot). A row is compared where every one of the reference's K slots holds an
/// id (>= 0: a row with a -1 anywhere is not a route) and `token_mask` (bool or uint8 [T],
/// nonzero = kept; undefined = every token) keeps the token. Ids are not checked against an expert
/// count (any int32 value compares). `top_ks`: empty (every layer uses K slots), or one K_l in
/// [1, K] per layer: layer l's rows are its first K_l slots (a table as wide as the largest K holds
/// -1 past a smaller layer's own). Throws std::invalid_argument naming the argument for another
/// dtype, shape or K_l.
RowMismatch row_mismatch(const Tensor& reference, const Tensor& token_mask,
                         const std::vector<Tensor>& tables,
                         const std::vector<int64_t>& top_ks = {});

}  // namespace switchyard
