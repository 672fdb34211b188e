// Router replay per MoE layer (R2 and R3): record the ids of a native pass, force given ids in a
// forward pass, and hand the same ids again to the activation-checkpoint recompute of that forward.
// No global mode: one RouterReplay object per MoE layer, passed explicitly. The replay row rule
// (which rows of an id table are replayed, routed natively, merged or invalid) is
// classify_replay_rows, the one classifier every replay path uses.
#pragma once

#include <cstdint>
#include <deque>

#include "switchyard/router.h"
#include "switchyard/tensor.h"

namespace switchyard {

/// Kind of one row of a replay table (classify_replay_rows).
enum class ReplayRowKind : uint8_t {
  native = 0,    ///< all -1: routed natively
  replayed = 1,  ///< K distinct ids in [0, E): used as given
  invalid = 3,   ///< mixes -1 and ids, repeats an id or names one outside [0, E) (policy native)
  merged = 4,    ///< repeats an id, nothing else wrong (policy merge): one pair per distinct id
};

/// classify_replay_rows' answer. replayed + native == T; merged rows count as replayed, invalid
/// rows (routed natively) as native.
struct ReplayRows {
  Tensor kind;  ///< [T] uint8, a ReplayRowKind per row
  int64_t num_replayed = 0;
  int64_t num_merged = 0;
  int64_t num_native = 0;
  int64_t num_invalid = 0;
  /// (token, expert) pairs the replayed rows send: K per row, one per distinct id in merged rows.
  int64_t num_pairs = 0;
};

/// The replay row rule: classifies the rows of `topk_idx` ([T, K] int32 on the CPU, -1 = none)
/// for `num_experts` experts. An invalid row (mixes -1 and ids, names an id outside [0, E) or
/// repeats one, in that precedence) is, by `policy`: error -> std::invalid_argument "[replay]
/// layer L, token t: topk_idx row [..] <why>" (layer left out when -1); native -> kind invalid;
/// merge -> a row whose only fault is a repeated id is kind merged, any other invalid row is the
/// error. topk_route applies the same rule (policy error or native).
ReplayRows classify_replay_rows(const Tensor& topk_idx, int64_t num_experts,
                                ReplayRowPolicy policy = ReplayRowPolicy::error,
                                int64_t layer = -1);

/// Options of a RouterReplay.
struct RouterReplayOptions {
  int64_t layer = -1;  ///< MoE layer number, for error messages (-1 = unknown)
  int64_t top_k = 0;   ///< K of every table (> 0)
};

/// Replay queues of one MoE layer. "Recompute" is the activation-checkpoint re-run of a forward
/// (inside backward); it replays the ids its forward used.
///
/// R2 (record in the old-log-prob pass, replay in the update):
///   auto r = topk_route(logits, {}, cfg);            replay.record(r.topk_idx);
///   ... update pass, micro-batch i:  topk_route(logits, {.replay_idx =
///       replay.replay_forward(replay.peek_recorded())}, cfg);  then replay.pop_recorded()
/// R3 (ids from the rollout engine): replay.replay_forward(ids_from_route_table).
/// Recompute (1F1B: forward mb0, mb1, ...; backward mb0, mb1, ...):
///   topk_route(logits, {.replay_idx = replay.peek_recompute(T)}, cfg);  then replay.recompute(T)
/// (peek first, take once routing succeeded: a call that fails consumes nothing.)
/// Queues are first in, first out. Not thread-safe (one layer is driven by one thread).
class RouterReplay {
 public:
  explicit RouterReplay(const RouterReplayOptions& options);

  /// Appends a copy of `topk_idx` ([T, K] int32, -1 = none) to the record queue.
  void record(const Tensor& topk_idx);
  /// Removes and returns the oldest recorded table. std::out_of_range when none is queued.
  Tensor pop_recorded();

  /// Takes the table to replay in this forward ([T, K] int32), queues it for the recompute and
  /// returns it (pass it as RouteInputs::replay_idx). A copy is queued, so the caller may reuse
  /// its buffer.
  Tensor replay_forward(const Tensor& topk_idx);
  /// Removes and returns the oldest table queued by replay_forward (FIFO), for the recompute of
  /// that micro-batch. num_tokens must match its rows (std::invalid_argument otherwise, and the
  /// table stays queued). std::out_of_range when none is queued.
  Tensor recompute(int64_t num_tokens);

  /// The table pop_recorded() would return, left queued. std::out_of_range when none is queued.
  const Tensor& peek_recorded() const;
  /// The table recompute(num_tokens) would return, left queued (same errors).
  const Tensor& peek_recompute(int64_t num_tokens) const;

  int64_t num_recorded() const { return static_cast<int64_t>(recorded_.size()); }
  int64_t num_pending_recompute() const { return static_cast<int64_t>(pending_recompute_.size()); }
  int64_t layer() const { return options_.layer; }
  int64_t top_k() const { return options_.top_k; }
  /// Drops the n newest tables queued by replay_forward (those of a step that failed before its
  /// backward; n is clamped to the queue's length).
  void drop_newest_recompute(int64_t n);
  /// Drops every queued table.
  void clear();
  /// An independent copy (Python's copy.deepcopy): the same options and a clone of every queued
  /// table, so neither object's queues or tables change through the other.
  RouterReplay clone() const;

 private:
  void check_table(const Tensor& topk_idx, const char* op) const;
  RouterReplayOptions options_;
  std::deque<Tensor> recorded_;
  std::deque<Tensor> pending_recompute_;
};

}  // namespace switchyard
