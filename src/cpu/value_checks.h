// CPU kernels of the value checks the front-ends run before any work: the id-range scan and the
// classification of replayed top-k rows (the non-finite scan is src/cpu/finite_kernels.h). Raw
// pointers, int64_t sizes; they report where the first bad value is and leave the message to the
// front-end (which names the op, the argument and the coordinate). Every result is the lowest index
// whatever the thread count.
#pragma once

#include <cstdint>

#include "cpu/row_rule.h"
#include "switchyard/dtype.h"

namespace switchyard::cpu {

/// Flat index of the first id outside [lo, hi) in ids[0, n), or n when there is none.
int64_t first_id_out_of_range(const int32_t* ids, int64_t n, int64_t lo, int64_t hi);

/// Counts of classify_replay_rows, and the first invalid row.
struct ReplayRowSummary {
  int64_t num_padded = 0;
  int64_t num_native = 0;  // no replay table, an all -1 row, or an invalid row
  int64_t num_replayed = 0;
  int64_t num_invalid = 0;
  int64_t num_merged = 0;          // rows of kind kRowMerged (counted in num_replayed)
  int64_t num_merged_slots = 0;    // slots of merged rows that repeat an earlier slot's id
  int64_t first_invalid_row = -1;  // -1: every row is valid (merged rows are valid)
  ReplayRowProblem first_problem = ReplayRowProblem::none;
  int32_t first_problem_id = -1;  // the out-of-range or repeated id
};

/// Row kinds beyond router_kernels.h's kRowNative / kRowReplayed / kRowPadded (0 / 1 / 2), written
/// only when asked (the routing kernels never see them): an invalid row, a row merged.
inline constexpr uint8_t kRowInvalid = 3;
inline constexpr uint8_t kRowMerged = 4;

/// Row kinds of T rows by the row rule (cpu/row_rule.h): padded when padding_mask[t] (null: none
/// is); else, with a replay table replay_idx [T,K] (null: none), replayed when the row holds K
/// distinct ids in [0, E), native when it is all -1, invalid when it mixes -1 and ids, names an id
/// outside [0, E) or repeats an id (the first problem in that order of precedence, then slot
/// order). A row whose only problem is a repeated id is kRowMerged (counted replayed) when
/// merge_repeated. Invalid rows are written kRowInvalid when mark_invalid, else kRowNative (what
/// the kernels route). Writes row_kind [T].
ReplayRowSummary classify_replay_rows(const int32_t* replay_idx, const bool* padding_mask,
                                      int64_t T, int64_t K, int64_t E, uint8_t* row_kind,
                                      bool merge_repeated = false, bool mark_invalid = false);

}  // namespace switchyard::cpu
