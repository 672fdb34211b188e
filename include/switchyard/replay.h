// Router replay per MoE layer (R2 and R3): record the ids of a native pass, force given ids in a
// forward pass, and hand the same ids again to activation-checkpoint recompute inside backward.
// No global mode: one RouterReplay object per MoE layer, passed explicitly.
#pragma once

#include <cstdint>
#include <deque>

#include "switchyard/router.h"
#include "switchyard/tensor.h"

namespace switchyard {

/// Options of a RouterReplay.
struct RouterReplayOptions {
  int64_t layer = -1;  ///< MoE layer number, for error messages (-1 = unknown)
  int64_t top_k = 0;   ///< K of every table (> 0)
};

/// Replay queues of one MoE layer.
///
/// R2 (record in the old-log-prob pass, replay in the update):
///   auto r = topk_route(logits, {}, cfg);            replay.record(r.topk_idx);
///   ... update pass, micro-batch i:  topk_route(logits, {.replay_idx =
///       replay.replay_forward(replay.pop_recorded())}, cfg);
/// R3 (ids from the rollout engine): replay.replay_forward(ids_from_route_table).
/// Recompute inside backward (1F1B: forward mb0, mb1, ...; backward mb0, mb1, ...):
///   topk_route(logits, {.replay_idx = replay.replay_backward(T)}, cfg);
/// Queues are first in, first out. The replayed/native counts of every call are in RouteResult.
/// Not thread-safe (one layer is driven by one thread).
class RouterReplay {
 public:
  explicit RouterReplay(const RouterReplayOptions& options);

  /// Appends a copy of `topk_idx` ([T, K] int32, -1 = none) to the record queue.
  void record(const Tensor& topk_idx);
  /// Removes and returns the oldest recorded table. std::out_of_range when none is queued.
  Tensor pop_recorded();

  /// Takes the table to replay in this forward ([T, K] int32), queues it for the backward
  /// recompute and returns it (pass it as RouteInputs::replay_idx). A copy is queued, so the
  /// caller may reuse its buffer.
  Tensor replay_forward(const Tensor& topk_idx);
  /// Removes and returns the oldest table queued by replay_forward (FIFO), for the recompute of
  /// that micro-batch. num_tokens must match its rows (std::invalid_argument otherwise, and the
  /// table stays queued). std::out_of_range when none is queued.
  Tensor replay_backward(int64_t num_tokens);

  int64_t num_recorded() const { return static_cast<int64_t>(recorded_.size()); }
  int64_t num_pending_backward() const { return static_cast<int64_t>(pending_backward_.size()); }
  int64_t layer() const { return options_.layer; }
  /// Drops every queued table.
  void clear();

 private:
  void check_table(const Tensor& topk_idx, const char* op) const;
  RouterReplayOptions options_;
  std::deque<Tensor> recorded_;
  std::deque<Tensor> pending_backward_;
};

}  // namespace switchyard
