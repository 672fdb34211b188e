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
  std::vector<int64_t> seen(rp ? static_cast<size_t>(E) : 0, -1);
  for (int64_t t = 0; t < T; ++t) {
    if (pad && pad[t]) {
      kind[t] = cpu::kRowPadded;
      ++r.num_padded_rows;
      continue;
    }
    kind[t] = cpu::kRowNative;
    if (!rp) {
      ++r.num_native_rows;
      continue;
    }
    const int32_t* row = rp + t * K;
    int64_t num_none = 0;
    for (int64_t k = 0; k < K; ++k) num_none += row[k] == -1;
    if (num_none == K) {
      ++r.num_native_rows;
      continue;
    }
    std::string why;
    if (num_none > 0) {
      why = "mixes -1 and expert ids";
    } else {
      for (int64_t k = 0; k < K && why.empty(); ++k) {
        if (row[k] < 0 || row[k] >= E) {
          why = detail::cat("names expert ", row[k], " outside [0, ", E, ")");
        } else if (seen[row[k]] == t) {
          why = detail::cat("repeats expert ", row[k]);
        } else {
          seen[row[k]] = t;
        }
      }
    }
    if (why.empty()) {
      kind[t] = cpu::kRowReplayed;
      ++r.num_replayed_rows;
    } else if (options.invalid_replay_rows == InvalidReplayRows::native) {
      ++r.num_native_rows;
      ++r.num_invalid_replay_rows;
    } else {
      detail::fail_arg("replay", layer_prefix(options.layer), "token ", t, ": topk_idx row ",
                       row_str(row, K), " ", why);
    }
  }
}

}  // namespace switchyard::detail
