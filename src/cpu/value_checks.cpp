// CPU value checks (see value_checks.h). Built once (not per ISA): they run at memory speed, and
// the exponent tests vectorise at the baseline ISA.
#include "cpu/value_checks.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/router_kernels.h"

namespace switchyard::cpu {

namespace {

// Exponent all ones <=> NaN or Inf. Integer tests on the bits vectorise.
inline bool non_finite(bf16 v) { return (v.bits & 0x7f80u) == 0x7f80u; }
inline bool non_finite(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7f800000u) == 0x7f800000u;
}
inline bool non_finite(double v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

// Flat index of the first NaN/Inf in p[0, n), or n when there is none.
template <class T>
int64_t first_non_finite_of(const T* p, int64_t n) {
  constexpr int64_t kChunk = 4096;
  const int64_t nchunk = (n + kChunk - 1) / kChunk;
  int64_t first = n;
#pragma omp parallel for schedule(static) reduction(min : first) if (n > (int64_t{1} << 16))
  for (int64_t c = 0; c < nchunk; ++c) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    int bad = 0;
    for (int64_t i = i0; i < i1; ++i) bad |= static_cast<int>(non_finite(p[i]));
    if (bad) {
      for (int64_t i = i0; i < i1; ++i) {
        if (non_finite(p[i])) {
          first = std::min(first, i);
          break;
        }
      }
    }
  }
  return first;
}

}  // namespace

int64_t first_non_finite(const void* p, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::bf16:
      return first_non_finite_of(static_cast<const bf16*>(p), n);
    case DType::fp32:
      return first_non_finite_of(static_cast<const float*>(p), n);
    default:
      return first_non_finite_of(static_cast<const double*>(p), n);
  }
}

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
                                      int64_t T, int64_t K, int64_t E, uint8_t* row_kind) {
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
    if (num_none > 0) {
      problem = ReplayRowProblem::mixes_none_and_ids;
    } else {
      for (int64_t k = 0; k < K && problem == ReplayRowProblem::none; ++k) {
        if (row[k] < 0 || row[k] >= E) {
          problem = ReplayRowProblem::id_out_of_range;
          id = row[k];
        } else if (seen[static_cast<size_t>(row[k])] == t) {
          problem = ReplayRowProblem::repeated_id;
          id = row[k];
        } else {
          seen[static_cast<size_t>(row[k])] = t;
        }
      }
    }
    if (problem == ReplayRowProblem::none) {
      row_kind[t] = kRowReplayed;
      ++s.num_replayed;
      continue;
    }
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
