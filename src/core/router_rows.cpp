// Row kinds of a routing call: padded, native or replayed. Replay rows are checked here, before
// any routing, so a bad row throws (or, with InvalidReplayRows::native, routes natively, counted).
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "check.h"
#include "router_internal.h"
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
                                    rp, pad, T, K, E, kind);
  if (rows.first_invalid_row >= 0 && options.invalid_replay_rows == InvalidReplayRows::error) {
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
    detail::fail_arg("replay", layer_prefix(options.layer), "token ", t, ": topk_idx row ",
                     row_str(rp + t * K, K), " ", why);
  }
  r.num_padded_rows = rows.num_padded;
  r.num_native_rows = rows.num_native;
  r.num_replayed_rows = rows.num_replayed;
  r.num_invalid_replay_rows = rows.num_invalid;
}

}  // namespace switchyard::detail
