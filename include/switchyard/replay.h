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
/// These compositions change the queue before topk_route validates the ids; route_forward,
/// route_forward_recorded and route_backward do the same but commit only after routing succeeded.
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

  /// The table pop_recorded() would return, left queued. std::out_of_range when none is queued.
  const Tensor& peek_recorded() const;
  /// The table replay_backward(num_tokens) would return, left queued (same errors).
  const Tensor& peek_backward(int64_t num_tokens) const;

  /// Transactional forms: route with the table the queues hand out and change the queues only
  /// when topk_route succeeded, so a call that fails validation (a bad id, a T that does not match
  /// the logits) consumes nothing and the corrected retry replays the same micro-batch.
  /// R3: replays `topk_idx` and queues it for the recompute (= replay_forward + topk_route).
  RouteResult route_forward(const Tensor& logits, const Tensor& topk_idx, RouteInputs inputs,
                            const RouterConfig& config, const RouteOptions& options = {});
  /// R2: replays the oldest recorded table (= replay_forward(pop_recorded()) + topk_route).
  RouteResult route_forward_recorded(const Tensor& logits, RouteInputs inputs,
                                     const RouterConfig& config, const RouteOptions& options = {});
  /// Recompute: replays the oldest table queued for backward (= replay_backward + topk_route).
  RouteResult route_backward(const Tensor& logits, RouteInputs inputs, const RouterConfig& config,
                             const RouteOptions& options = {});

  int64_t num_recorded() const { return static_cast<int64_t>(recorded_.size()); }
  int64_t num_pending_backward() const { return static_cast<int64_t>(pending_backward_.size()); }
  int64_t layer() const { return options_.layer; }
  /// Drops every queued table.
  void clear();
  /// An independent copy (Python's copy.deepcopy): the same options and a clone of every queued
  /// table, so neither object's queues or tables change through the other.
  RouterReplay clone() const;

 private:
  void check_table(const Tensor& topk_idx, const char* op) const;
  RouterReplayOptions options_;
  std::deque<Tensor> recorded_;
  std::deque<Tensor> pending_backward_;
};

}  // namespace switchyard
