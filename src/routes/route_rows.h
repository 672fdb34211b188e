// Internal: the row kernels of the route data path, shared by the importers (route_import.cpp),
// verl's batch layout (route_verl.cpp) and the alignment functions (route_align.cpp).
//
// import_rows is one pass over a sequence's `[rows, layers_in, K]` input (any integer type) that
// keeps the MoE layers, validates every row by the row rule the replay core uses
// (src/cpu/row_rule.h: range, repeated ids, -1 mixed with ids; plus the importers' all-zero rows)
// and writes int32 ids. Every row takes the rule's branch-free fast test and only a row that fails
// it (an all-zero or -1 row, a bad id, a repeat) goes to the exact path (classify_row) that
// decides, and decide_row names the problem. Errors are returned, not thrown, so callers can run
// sequences on OpenMP threads and report the first failing sequence deterministically.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "check.h"
#include "cpu/row_rule.h"
#include "switchyard/route_import.h"

namespace switchyard::detail {

inline constexpr size_t kMaxReportedZeroRows = 8;

/// What an import keeps and checks; the same for every sequence of one import.
struct RowPlan {
  int64_t layers_in = 0;  ///< layers per token in the input (hidden + MTP)
  int64_t hidden = 0;     ///< hidden layers (layers_in - MTP layers)
  int64_t top_k = 0;
  int64_t num_experts = 0;
  std::vector<int64_t> moe;    ///< hidden-layer index of each kept layer, ascending
  std::vector<int64_t> dense;  ///< hidden layers that are not MoE (checked for stray ids)
  ZeroRowPolicy zero_rows = ZeroRowPolicy::keep;
  ReplayRowPolicy invalid_rows = ReplayRowPolicy::error;
  int64_t token_offset = 0;                    ///< token number of row 0, for messages
  const char* layer_word = ", hidden layer ";  ///< how messages name an input layer
};

/// What a sequence's rows held.
struct RowFindings {
  int64_t num_zero_rows = 0;
  int64_t num_invalid_rows = 0;
  std::vector<std::array<int64_t, 2>> first_zero_rows;  ///< {token, moe layer}, the first few
  int64_t dense_nonzero = 0;       ///< rows on dense layers holding a nonzero id
  int64_t first_dense_layer = -1;  ///< hidden layer of the first such row
  std::string error;               ///< the first error ("" = none), without op and source
  int64_t error_token = -1;        ///< its token
};

/// Refuses an invalid-row policy an importer cannot apply (ReplayRowPolicy::merge: a table stores
/// K ids per row, so a merged row cannot be stored).
inline void check_invalid_rows_policy(const char* op, ReplayRowPolicy policy) {
  if (policy == ReplayRowPolicy::error || policy == ReplayRowPolicy::native) return;
  fail_arg(op, "invalid_rows must be error or native, got ",
           policy == ReplayRowPolicy::merge ? std::string("merge")
                                            : std::to_string(static_cast<int>(policy)),
           policy == ReplayRowPolicy::merge
               ? " (a route table keeps K ids per row: import with error or native, replay with "
                 "merge)"
               : "");
}

/// A plan for `layers_in` input layers of `top_k` ids under `options` (throws like
/// moe_layer_indices, message prefixed by the caller).
inline RowPlan make_row_plan(const ImportOptions& options, int64_t layers_in, int64_t top_k) {
  RowPlan p;
  p.layers_in = layers_in;
  p.hidden = layers_in - options.layer_map.num_mtp_layers;
  p.top_k = top_k;
  p.num_experts = options.num_experts;
  p.moe = moe_layer_indices(options.layer_map, layers_in);
  std::vector<uint8_t> is_moe(static_cast<size_t>(layers_in), 0);
  for (int64_t l : p.moe) is_moe[size_t(l)] = 1;
  for (int64_t l = 0; l < p.hidden; ++l) {
    if (!is_moe[size_t(l)]) p.dense.push_back(l);
  }
  p.zero_rows = options.zero_rows;
  p.invalid_rows = options.invalid_rows;
  return p;
}

/// The exact path for one row: the row rule (cpu::classify_row) decides, the import's policies
/// act. An id outside [-1, E) is refused under every policy (it means a wrong num_experts or layer
/// map, not a bad row); then an all-zero row (K > 1) follows zero_rows; then a row that mixes -1
/// and ids or repeats an id follows invalid_rows. Returns false with f.error set.
template <class T>
bool decide_row(const T* row, int64_t r, int64_t l, int64_t m, const RowPlan& p, int32_t* dst,
                RowFindings& f, cpu::RowScratch& scratch) {
  const int64_t K = p.top_k, E = p.num_experts;
  const cpu::RowVerdict v = cpu::classify_row(row, K, E, scratch);
  if (v.bad_slot >= 0) {
    f.error = cat("expert id ", v.bad_id, " at token ", p.token_offset + r, p.layer_word, l,
                  ", slot ", v.bad_slot, " is outside [0, num_experts=", E, ")");
    f.error_token = r;
    return false;
  }
  // All zero: the rule's "repeats expert 0", told apart because engines zero-fill padding and
  // dense layers. K = 1: a 0 is a real route to expert 0.
  if (K > 1 && v.problem == cpu::ReplayRowProblem::repeated_id && v.repeats == K - 1 &&
      v.repeated_id == 0 && row[0] == 0) {
    if (p.zero_rows == ZeroRowPolicy::error) {
      f.error = cat("all-zero row at token ", p.token_offset + r, p.layer_word, l,
                    " (zero-filled padding?)");
      f.error_token = r;
      return false;
    }
    if (f.first_zero_rows.size() < kMaxReportedZeroRows) f.first_zero_rows.push_back({r, m});
    ++f.num_zero_rows;
    if (p.zero_rows == ZeroRowPolicy::to_none) {
      std::fill(dst, dst + K, -1);
    } else {
      std::fill(dst, dst + K, 0);
    }
    return true;
  }
  if (v.native || v.problem == cpu::ReplayRowProblem::none) {
    for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<int32_t>(row[k]);
    return true;
  }
  // A repeated id or -1 mixed with ids is an invalid row: never stored as if valid.
  if (p.invalid_rows != ReplayRowPolicy::native) {
    std::string ids = "[";
    for (int64_t k = 0; k < K; ++k) ids += (k ? ", " : "") + std::to_string(int64_t(row[k]));
    ids += "]";
    f.error =
        cat("row ", ids, " at token ", p.token_offset + r, p.layer_word, l,
            v.problem == cpu::ReplayRowProblem::repeated_id ? cat(" repeats expert ", v.repeated_id)
                                                            : std::string(" mixes -1 and ids"),
            " (invalid_rows='native' stores such rows as -1)");
    f.error_token = r;
    return false;
  }
  std::fill(dst, dst + K, -1);
  ++f.num_invalid_rows;
  return true;
}

/// Imports `rows` tokens: token r's input is `src_row(r)` (`[layers_in, K]` of T); writes
/// `[rows, moe.size(), K]` int32 to `out`. Returns false with f.error set on the first error.
template <class T, class SrcRow>
__attribute__((always_inline)) inline bool import_rows(SrcRow src_row, int64_t rows,
                                                       const RowPlan& p, int32_t* out,
                                                       RowFindings& f) {
  const int64_t M = static_cast<int64_t>(p.moe.size()), K = p.top_k;
  const int64_t* moe = p.moe.data();
  // int64 input is narrowed only after the exact path has seen it (an id of 2^32 + 3 must not
  // pass as 3), so it always takes the scalar test.
  const bool vec8 = K == 8 && sizeof(T) <= 4 && !std::is_same_v<T, uint32_t>;
  const int32_t e_max = static_cast<int32_t>(std::min<int64_t>(p.num_experts, INT32_MAX) - 1);
  cpu::RowScratch scratch;
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = src_row(r);
    for (int64_t l : p.dense) {  // a dense layer holding ids: the layer map may be off by one
      const T* row = in + l * K;
      bool nonzero = false;
      for (int64_t k = 0; k < K; ++k) nonzero |= row[k] != 0;
      if (nonzero && f.dense_nonzero++ == 0) f.first_dense_layer = l;
    }
    int32_t* dst = out + r * M * K;
    for (int64_t m = 0; m < M; ++m, dst += K) {
      const T* row = in + moe[m] * K;
      if constexpr (sizeof(T) <= 4) {
        if (vec8) {
          cpu::I32x8 v;
          if (cpu::row_is_valid8(row, e_max, v)) {
            std::memcpy(dst, &v, sizeof v);
            continue;
          }
        } else if (K <= cpu::kPairwiseMaxK &&
                   cpu::row_is_valid(row, K, static_cast<uint64_t>(p.num_experts))) {
          for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<int32_t>(row[k]);
          continue;
        }
      }
      if (!decide_row(row, r, moe[m], m, p, dst, f, scratch)) return false;
    }
  }
  return true;
}

/// Calls fn(type tag) with a pointer type for an id tensor's dtype (int16, uint16, uint8, int32,
/// int64); returns false for any other dtype.
template <class Fn>
bool visit_id_dtype(DType d, Fn&& fn) {
  switch (d) {
    case DType::uint8:
      fn(static_cast<const uint8_t*>(nullptr));
      return true;
    case DType::int16:
      fn(static_cast<const int16_t*>(nullptr));
      return true;
    case DType::uint16:
      fn(static_cast<const uint16_t*>(nullptr));
      return true;
    case DType::int32:
      fn(static_cast<const int32_t*>(nullptr));
      return true;
    case DType::int64:
      fn(static_cast<const int64_t*>(nullptr));
      return true;
    default:
      return false;
  }
}

/// Real positions of row b of an attention mask (bool, uint8, int32 or int64; nonzero = real),
/// appended to `pos` (cleared first). Typed reads: no per-element dispatch.
inline void mask_positions(const Tensor& mask, int64_t b, std::vector<int64_t>& pos) {
  const int64_t S = mask.size(1);
  pos.clear();
  auto scan = [&](auto* p) {
    p += b * S;
    for (int64_t s = 0; s < S; ++s) {
      if (p[s] != 0) pos.push_back(s);
    }
  };
  switch (mask.dtype()) {
    case DType::boolean:
      scan(static_cast<const uint8_t*>(mask.raw()));
      break;
    case DType::uint8:
      scan(static_cast<const uint8_t*>(mask.raw()));
      break;
    case DType::int32:
      scan(static_cast<const int32_t*>(mask.raw()));
      break;
    case DType::int64:
      scan(static_cast<const int64_t*>(mask.raw()));
      break;
    default:
      break;  // the caller checked the dtype
  }
}

/// Copies n int32 ids and returns whether every one is -1 or in [0, num_experts) (one pass; the
/// caller names the bad id with check_route_table when it is not).
inline bool copy_ids_checked(int32_t* dst, const int32_t* src, int64_t n, int64_t num_experts) {
  int32_t lo = -1, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t v = src[i];
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    dst[i] = v;
  }
  return lo >= -1 && hi < num_experts;
}

/// Widens n ids of any integer type to int32 and returns whether every one is -1 or in
/// [0, num_experts) (one pass; an int64 id beyond int32 fails the check before it is narrowed).
template <class T>
inline bool widen_ids_checked(int32_t* dst, const T* src, int64_t n, int64_t num_experts) {
  using A = std::conditional_t<(sizeof(T) == 8), int64_t, int32_t>;
  A lo = -1, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    const A v = static_cast<A>(src[i]);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    dst[i] = static_cast<int32_t>(v);
  }
  return lo >= -1 && static_cast<int64_t>(hi) < num_experts;
}

}  // namespace switchyard::detail
