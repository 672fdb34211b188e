// THE row rule of a top-k id table (DESIGN.md, Replay), per row, in one place: every path that
// decides what a row of ids is uses it. cpu::classify_replay_rows (the replay core: topk_route,
// RouterReplay, the Python replay driver, the HF and Megatron adapters) and the route importers'
// row kernel (src/routes/route_rows.h) both call classify_row for the exact answer and
// row_is_valid / row_is_valid8 for the branch-free fast test that clears most rows.
//
// A row of K ids is: native when it is all -1; otherwise it mixes -1 and ids, names an id
// outside [0, E), or repeats an id (in that order of precedence); else it is valid (K distinct
// ids in [0, E)). What a caller does with a problem (error, route natively, merge a repeat, store
// -1) is its policy, not part of the rule.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace switchyard::cpu {

/// Why a row is invalid (DESIGN.md, Replay).
enum class ReplayRowProblem : uint8_t { none, mixes_none_and_ids, id_out_of_range, repeated_id };

/// classify_row's answer for one row.
struct RowVerdict {
  bool native = false;  ///< all -1 (problem is none)
  ReplayRowProblem problem = ReplayRowProblem::none;
  /// The first id outside [-1, E) and its slot (-1: none), whatever the problem's precedence: an
  /// importer refuses such an id under every policy.
  int64_t bad_id = -1;
  int64_t bad_slot = -1;
  int64_t repeated_id = -1;    ///< the first id that repeats an earlier slot's (problem repeated)
  int64_t repeated_slot = -1;  ///< its slot
  int64_t repeats = 0;         ///< slots that repeat an earlier slot's id (when no other problem)
};

/// Scratch of classify_row for wide rows (K > kPairwiseMaxK): an E-sized stamp array, reused
/// across rows.
struct RowScratch {
  std::vector<int64_t> seen;
  int64_t stamp = 0;
};

/// Up to this K, repeats are found by comparing pairs (cheaper than any set).
inline constexpr int64_t kPairwiseMaxK = 16;

/// The exact rule for one row of K ids of any integer type (compared as int64: an int64 id of
/// 2^32 + 3 is out of range, never 3).
template <class T>
inline RowVerdict classify_row(const T* row, int64_t K, int64_t E, RowScratch& scratch) {
  RowVerdict v;
  int64_t num_none = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t id = static_cast<int64_t>(row[k]);
    num_none += id == -1;
    if ((id < -1 || id >= E) && v.bad_slot < 0) {
      v.bad_id = id;
      v.bad_slot = k;
    }
  }
  if (num_none == K) {
    v.native = true;
    return v;
  }
  if (num_none > 0) {
    v.problem = ReplayRowProblem::mixes_none_and_ids;
    return v;
  }
  if (v.bad_slot >= 0) {
    v.problem = ReplayRowProblem::id_out_of_range;
    return v;
  }
  // Every id is in [0, E) here.
  if (K <= kPairwiseMaxK) {
    for (int64_t k = 1; k < K; ++k) {
      for (int64_t j = 0; j < k; ++j) {
        if (row[j] == row[k]) {
          if (v.repeats++ == 0) {
            v.repeated_id = static_cast<int64_t>(row[k]);
            v.repeated_slot = k;
          }
          break;
        }
      }
    }
  } else {
    if (scratch.seen.size() < static_cast<size_t>(E)) scratch.seen.assign(size_t(E), -1);
    const int64_t stamp = scratch.stamp++;
    for (int64_t k = 0; k < K; ++k) {
      int64_t& s = scratch.seen[static_cast<size_t>(row[k])];
      if (s == stamp) {
        if (v.repeats++ == 0) {
          v.repeated_id = static_cast<int64_t>(row[k]);
          v.repeated_slot = k;
        }
      } else {
        s = stamp;
      }
    }
  }
  if (v.repeats > 0) v.problem = ReplayRowProblem::repeated_id;
  return v;
}

/// Any K: true only when classify_row would call the row valid (K distinct ids in [0, E)); false
/// says "ask classify_row". Branch-free, for K up to kPairwiseMaxK.
template <class T>
inline bool row_is_valid(const T* row, int64_t K, uint64_t E) {
  bool ok = true;
  for (int64_t k = 0; k < K; ++k) {
    ok &= static_cast<uint64_t>(static_cast<int64_t>(row[k])) < E;
    for (int64_t j = 0; j < k; ++j) ok &= row[j] != row[k];
  }
  return ok;
}

typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef int16_t I16x8 __attribute__((vector_size(16)));

/// K = 8, ids of at most 32 bits (callers send uint32 and int64 ids to row_is_valid: a signed
/// 32-bit lane would wrap them): row_is_valid's test with eight lanes
/// compared with their rotations by 1..4 (that covers every pair), widening the row into `out`.
/// Only signed compares (the baseline ISA has no unsigned ones: they would be done lane by
/// lane), in 16-bit lanes for 8- and 16-bit ids (one SSE register), 32-bit lanes otherwise.
/// `e_max` = E - 1.
template <class T>
__attribute__((always_inline)) inline bool row_is_valid8(const T* row, int32_t e_max, I32x8& out) {
  typedef T Tx8 __attribute__((vector_size(8 * sizeof(T))));
  Tx8 raw;
  std::memcpy(&raw, row, sizeof raw);
  uint64_t lanes[4] = {0, 0, 0, 0};
  if constexpr (sizeof(T) == 1 || std::is_same_v<T, int16_t>) {
    const I16x8 v = __builtin_convertvector(raw, I16x8);
    const int16_t hi = static_cast<int16_t>(std::min<int32_t>(e_max, INT16_MAX));
    const I16x8 bad = (v == __builtin_shufflevector(v, v, 1, 2, 3, 4, 5, 6, 7, 0)) |
                      (v == __builtin_shufflevector(v, v, 2, 3, 4, 5, 6, 7, 0, 1)) |
                      (v == __builtin_shufflevector(v, v, 3, 4, 5, 6, 7, 0, 1, 2)) |
                      (v == __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3)) | (v < 0) |
                      (v > hi);
    std::memcpy(lanes, &bad, sizeof bad);
    out = __builtin_convertvector(v, I32x8);
  } else {
    const I32x8 v = __builtin_convertvector(raw, I32x8);
    const I32x8 bad = (v == __builtin_shufflevector(v, v, 1, 2, 3, 4, 5, 6, 7, 0)) |
                      (v == __builtin_shufflevector(v, v, 2, 3, 4, 5, 6, 7, 0, 1)) |
                      (v == __builtin_shufflevector(v, v, 3, 4, 5, 6, 7, 0, 1, 2)) |
                      (v == __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3)) | (v < 0) |
                      (v > e_max);
    std::memcpy(lanes, &bad, sizeof bad);
    out = v;
  }
  return (lanes[0] | lanes[1] | lanes[2] | lanes[3]) == 0;
}

}  // namespace switchyard::cpu
