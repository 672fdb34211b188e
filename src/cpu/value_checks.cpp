// CPU value checks (see value_checks.h). Built once (not per ISA): they run at memory speed.
#include "cpu/value_checks.h"

#include <algorithm>
#include <climits>

#include "cpu/router_kernels.h"

namespace switchyard::cpu {

int64_t first_id_out_of_range(const int32_t* ids, int64_t n, int64_t lo, int64_t hi) {
  // A branch-free pass first (vectorises), the search only when something is out of range.
  int bad = 0;
  for (int64_t i = 0; i < n; ++i)
    bad |= static_cast<int>(ids[i] < lo) | static_cast<int>(ids[i] >= hi);
  if (!bad) return n;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < lo || ids[i] >= hi) return i;
  }
  return n;
}

ReplayRowSummary classify_replay_rows(const int32_t* replay_idx, const bool* padding_mask,
                                      int64_t T, int64_t K, int64_t E, uint8_t* row_kind,
                                      bool merge_repeated, bool mark_invalid) {
  ReplayRowSummary s;
  RowScratch scratch;
  const bool vec8 = K == 8 && E >= 1;
  const int32_t e_max = static_cast<int32_t>(std::min<int64_t>(E, INT32_MAX) - 1);
  for (int64_t t = 0; t < T; ++t) {
    if (padding_mask && padding_mask[t]) {
      row_kind[t] = kRowPadded;
      ++s.num_padded;
      continue;
    }
    row_kind[t] = kRowNative;
    if (!replay_idx) {
      ++s.num_native;
      continue;
    }
    const int32_t* row = replay_idx + t * K;
    I32x8 unused;
    if (vec8 ? row_is_valid8(row, e_max, unused)
             : K <= kPairwiseMaxK && row_is_valid(row, K, static_cast<uint64_t>(E))) {
      row_kind[t] = kRowReplayed;
      ++s.num_replayed;
      continue;
    }
    const RowVerdict v = classify_row(row, K, E, scratch);
    if (v.native) {
      ++s.num_native;
      continue;
    }
    if (v.problem == ReplayRowProblem::none) {
      row_kind[t] = kRowReplayed;
      ++s.num_replayed;
      continue;
    }
    if (v.problem == ReplayRowProblem::repeated_id && merge_repeated) {
      row_kind[t] = kRowMerged;
      ++s.num_replayed;
      ++s.num_merged;
      s.num_merged_slots += v.repeats;
      continue;
    }
    if (mark_invalid) row_kind[t] = kRowInvalid;
    ++s.num_native;
    ++s.num_invalid;
    if (s.first_invalid_row < 0) {
      s.first_invalid_row = t;
      s.first_problem = v.problem;
      s.first_problem_id =
          static_cast<int32_t>(v.problem == ReplayRowProblem::repeated_id       ? v.repeated_id
                               : v.problem == ReplayRowProblem::id_out_of_range ? v.bad_id
                                                                                : -1);
    }
  }
  return s;
}

}  // namespace switchyard::cpu
