// RouterReplay: per-layer FIFO queues of id tables. The ids themselves are validated row by row
// where they are used (topk_route), with the layer in the message; here only shapes and dtypes.
#include "switchyard/replay.h"

#include <stdexcept>

#include "check.h"

namespace switchyard {

namespace {
std::string where(int64_t layer) {
  return layer >= 0 ? detail::cat("layer ", layer, ": ") : std::string();
}
}  // namespace

RouterReplay::RouterReplay(const RouterReplayOptions& options) : options_(options) {
  if (options.top_k < 1) {
    detail::fail_arg("replay", where(options.layer),
                     "top_k must be >= 1, got top_k=", options.top_k);
  }
}

void RouterReplay::check_table(const Tensor& topk_idx, const char* op) const {
  detail::check_dtype(topk_idx, op, "topk_idx", {DType::int32});
  detail::check_shape(topk_idx, op, "topk_idx", {-1, options_.top_k});
}

void RouterReplay::record(const Tensor& topk_idx) {
  check_table(topk_idx, "replay.record");
  recorded_.push_back(topk_idx.clone());
}

Tensor RouterReplay::pop_recorded() {
  peek_recorded();  // the checks and their errors live in one place
  Tensor t = std::move(recorded_.front());
  recorded_.pop_front();
  return t;
}

Tensor RouterReplay::replay_forward(const Tensor& topk_idx) {
  check_table(topk_idx, "replay.replay_forward");
  Tensor copy = topk_idx.clone();
  pending_recompute_.push_back(copy);
  return copy;
}

Tensor RouterReplay::recompute(int64_t num_tokens) {
  peek_recompute(num_tokens);  // the checks and their errors live in one place
  Tensor t = std::move(pending_recompute_.front());
  pending_recompute_.pop_front();
  return t;
}

const Tensor& RouterReplay::peek_recorded() const {
  if (recorded_.empty()) {
    throw std::out_of_range(detail::cat("[replay.pop_recorded] ", where(options_.layer),
                                        "no recorded table is queued (record() was called ",
                                        "fewer times than pop_recorded())"));
  }
  return recorded_.front();
}

const Tensor& RouterReplay::peek_recompute(int64_t num_tokens) const {
  if (pending_recompute_.empty()) {
    throw std::out_of_range(detail::cat("[replay.recompute] ", where(options_.layer),
                                        "no forward table is queued (recompute() called ",
                                        "more often than replay_forward())"));
  }
  const Tensor& front = pending_recompute_.front();
  if (front.size(0) != num_tokens) {
    detail::fail_arg("replay.recompute", where(options_.layer),
                     "num_tokens must match the oldest queued forward table (", front.size(0),
                     " rows), got num_tokens=", num_tokens);
  }
  return front;
}

void RouterReplay::drop_newest_recompute(int64_t n) {
  for (; n > 0 && !pending_recompute_.empty(); --n) pending_recompute_.pop_back();
}

void RouterReplay::clear() {
  recorded_.clear();
  pending_recompute_.clear();
}

RouterReplay RouterReplay::clone() const {
  RouterReplay out(options_);
  for (const Tensor& t : recorded_) out.recorded_.push_back(t.clone());
  for (const Tensor& t : pending_recompute_) out.pending_recompute_.push_back(t.clone());
  return out;
}

}  // namespace switchyard
