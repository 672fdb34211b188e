// CPU value checks (see value_checks.h). Built once (not per ISA): they run at memory speed.
#include "cpu/value_checks.h"

#include <vector>

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
  // `seen[e] == t` marks expert e as used earlier in row t (one E-sized array for all rows).
  std::vector<int64_t> seen(replay_idx ? static_cast<size_t>(E) : 0, -1);
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
    int64_t num_none = 0;
    for (int64_t k = 0; k < K; ++k) num_none += row[k] == -1;
    if (num_none == K) {
      ++s.num_native;
      continue;
    }
    ReplayRowProblem problem = ReplayRowProblem::none;
    int32_t id = -1;
    int64_t repeats = 0;
    if (num_none > 0) {
      problem = ReplayRowProblem::mixes_none_and_ids;
    } else {
      int32_t repeated = -1;
      for (int64_t k = 0; k < K; ++k) {
        if (row[k] < 0 || row[k] >= E) {
          problem = ReplayRowProblem::id_out_of_range;
          id = row[k];
          break;
        }
        if (seen[static_cast<size_t>(row[k])] == t) {
          if (repeats++ == 0) repeated = row[k];
        } else {
          seen[static_cast<size_t>(row[k])] = t;
        }
      }
      if (problem == ReplayRowProblem::none && repeats > 0) {
        problem = ReplayRowProblem::repeated_id;
        id = repeated;
      }
    }
    if (problem == ReplayRowProblem::none) {
      row_kind[t] = kRowReplayed;
      ++s.num_replayed;
      continue;
    }
    if (problem == ReplayRowProblem::repeated_id && merge_repeated) {
      row_kind[t] = kRowMerged;
      ++s.num_replayed;
      ++s.num_merged;
      s.num_merged_slots += repeats;
      continue;
    }
    if (mark_invalid) row_kind[t] = kRowInvalid;
    ++s.num_native;
    ++s.num_invalid;
    if (s.first_invalid_row < 0) {
      s.first_invalid_row = t;
      s.first_problem = problem;
      s.first_problem_id = id;
    }
  }
  return s;
}

}  // namespace switchyard::cpu
