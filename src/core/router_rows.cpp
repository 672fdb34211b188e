// The replay row rule, in one place: row kinds of a routing call (padded, native, replayed) and the
// public classify_replay_rows every replay path (topk_route, the Python replay driver, the HF and
// Megatron adapters) uses. Replay rows are checked here, before any routing, so a bad row throws
// (or, with ReplayRowPolicy::native, routes natively, counted; with ::merge, a repeated id merges).
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "check.h"
#include "router_internal.h"
#include "switchyard/replay.h"
#include "switchyard/router.h"

namespace switchyard::detail {

namespace {

std::string row_str(const int32_t* row, int64_t K) {
  std::ostringstream os;
  os << "[";
  for (int64_t k = 0; k < K; ++k) os << (k ? ", " : "") << row[k];
  os << "]";
  return os.str();
}

// Throws the invalid-row error for rows.first_invalid_row (when there is one and the policy does
// not route invalid rows natively).
void check_invalid_rows(const backend::ReplayRowSummary& rows, const int32_t* rp, int64_t K,
                        int64_t E, ReplayRowPolicy policy, int64_t layer) {
  if (rows.first_invalid_row < 0 || policy == ReplayRowPolicy::native) return;
  const int64_t t = rows.first_invalid_row;
  std::string why;
  switch (rows.first_problem) {
    case backend::ReplayRowProblem::mixes_none_and_ids:
      why = "mixes -1 and expert ids";
      break;
    case backend::ReplayRowProblem::id_out_of_range:
      why = detail::cat("names expert ", rows.first_problem_id, " outside [0, ", E, ")");
      break;
    default:
      why = detail::cat("repeats expert ", rows.first_problem_id);
      break;
  }
  detail::fail_arg("replay", layer_prefix(layer), "token ", t, ": topk_idx row ",
                   row_str(rp + t * K, K), " ", why,
                   policy == ReplayRowPolicy::merge ? " (merge merges only repeated ids)" : "");
}

}  // namespace

void classify_rows(const Tensor& replay, const Tensor& mask, int64_t T, int64_t K, int64_t E,
                   const RouteOptions& options, uint8_t* kind, RouteResult& r) {
  const bool* pad = mask.defined() ? mask.data<bool>() : nullptr;
  const int32_t* rp = replay.defined() ? replay.data<int32_t>() : nullptr;
  const backend::ReplayRowSummary rows =
      backend::classify_replay_rows(backend::Context{replay.defined() ? replay.device()
                                                     : mask.defined() ? mask.device()
                                                                      : kCpu,
                                                     nullptr, kRouteOp},
                                    rp, pad, T, K, E, kind,
                                    options.invalid_replay_rows == ReplayRowPolicy::merge);
  // A merged row routes as a replayed one: its slots keep their (repeated) ids, each with its
  // weight, so the combine adds them up and each slot's gradient is its own.
  for (int64_t t = 0; t < T && rows.num_merged > 0; ++t) {
    if (kind[t] == backend::kRowMerged) kind[t] = backend::kRowReplayed;
  }
  check_invalid_rows(rows, rp, K, E, options.invalid_replay_rows, options.layer);
  r.num_padded_rows = rows.num_padded;
  r.num_native_rows = rows.num_native;
  r.num_replayed_rows = rows.num_replayed;
  r.num_invalid_replay_rows = rows.num_invalid;
}

}  // namespace switchyard::detail

namespace switchyard {

ReplayRows classify_replay_rows(const Tensor& topk_idx, int64_t num_experts, ReplayRowPolicy policy,
                                int64_t layer) {
  constexpr const char* kOp = "replay.classify_rows";
  detail::check_dtype(topk_idx, kOp, "topk_idx", {DType::int32});
  detail::check_shape(topk_idx, kOp, "topk_idx", {-1, -1});
  if (num_experts < 1) {
    detail::fail_arg(kOp, detail::layer_prefix(layer),
                     "num_experts must be >= 1, got num_experts=", num_experts);
  }
  if (policy != ReplayRowPolicy::error && policy != ReplayRowPolicy::native &&
      policy != ReplayRowPolicy::merge) {
    detail::fail_arg(kOp, "policy must be error, native or merge, got value ",
                     static_cast<int>(policy));
  }
  const int64_t T = topk_idx.size(0), K = topk_idx.size(1);
  ReplayRows out;
  out.kind = Tensor::empty({T}, DType::uint8);
  const int32_t* rp = topk_idx.data<int32_t>();
  const backend::ReplayRowSummary rows = backend::classify_replay_rows(
      backend::Context{topk_idx.device(), nullptr, kOp}, rp, nullptr, T, K, num_experts,
      out.kind.data<uint8_t>(), policy == ReplayRowPolicy::merge, /*mark_invalid=*/true);
  detail::check_invalid_rows(rows, rp, K, num_experts, policy, layer);
  out.num_replayed = rows.num_replayed;
  out.num_merged = rows.num_merged;
  out.num_native = rows.num_native;
  out.num_invalid = rows.num_invalid;
  out.num_pairs = rows.num_replayed * K - rows.num_merged_slots;
  return out;
}

}  // namespace switchyard
