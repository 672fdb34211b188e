// Shared code of the two dispatchers (all_to_all.cpp, all_gather.cpp): the dispatcher's scratch
// memory, the collective error agreement, the handle check, and the receive layout derived from
// the count matrix every rank holds after the header exchange.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "agreement.h"
#include "backend/backend.h"
#include "switchyard/dispatcher.h"

namespace switchyard::dist::detail {

// The dispatchers move host rows (the communicator exchanges host memory), so their row kernels
// run on the CPU backend; a device communicator (NCCL) would carry its device and stream here.
inline constexpr backend::Context kHost{kCpu, nullptr, "dispatch"};

/// Frees a block of the host caching allocator (Scratch's blocks come from it: huge-page advice
/// for large blocks, size classes, and a temporary Dispatcher gets the previous one's blocks back).
struct HostFree {
  size_t bytes = 0;
  void operator()(void* p) const noexcept;
};

/// The dispatcher's scratch memory: one buffer per use, grown to the high-water mark, never
/// shrunk, not zeroed, from the host caching allocator. Buffers are only valid inside one dispatcher call.
struct Scratch {
  enum Use : int {
    pack,         ///< all_to_all: token rows packed in plan order for the other ranks
    rows,         ///< rows coming back to the source side (combine, dots of combine_backward)
    grad,         ///< combine_backward: grad_y dispatched to the expert side
    staging,      ///< all_gather: every rank's rows gathered
    meta_send,    ///< row metadata (token, weight) in plan order
    meta_recv,    ///< row metadata as received
    floats,       ///< per-row fp32 values (dots, weight gradients), send side
    floats_back,  ///< per-row fp32 values, receive side
    routes,       ///< all_gather: every rank's topk_idx and topk_weights
    recv_index,   ///< combine_backward: the expert-side plan's int64 index arrays
    recv_expert,  ///< combine_backward: the expert-side plan's row experts
    counts,       ///< dispatch: this rank's rows per expert block [E], for the count exchange
    kCount
  };
  /// At least `bytes` bytes for `use`.
  void* get(Use use, int64_t bytes);
  template <class T>
  T* get(Use use, int64_t n) {
    return static_cast<T*>(get(use, n * static_cast<int64_t>(sizeof(T))));
  }
  int64_t bytes() const;

 private:
  struct Block {
    std::unique_ptr<void, HostFree> data;
    int64_t size = 0;
  };
  Block blocks_[kCount];
};

/// Row metadata travelling with each row in the all_to_all dispatcher.
struct RowMeta {
  int64_t token;
  float weight;
  int32_t pad;
};

inline int64_t row_bytes(int64_t H, DType d) { return H * static_cast<int64_t>(dtype_size(d)); }

/// Real pairs of source s for expert e.
inline int64_t count_at(const HandleState& h, int64_t s, int64_t e) {
  return h.rank_expert_counts[static_cast<size_t>(s * h.num_experts + e)];
}
/// Rows of the (expert e, source s) block, padding included (without padding the handle keeps
/// no second matrix: the rows are the pairs).
inline int64_t rows_at(const HandleState& h, int64_t s, int64_t e) {
  const std::vector<int64_t>& m =
      h.rank_expert_rows.empty() ? h.rank_expert_counts : h.rank_expert_rows;
  return m[static_cast<size_t>(s * h.num_experts + e)];
}

/// Throws std::invalid_argument when `h` cannot be a handle of dispatch on `comm` (call it inside
/// a try whose message goes into the agreement).
void check_handle(const char* op, const HandleState& h, const Communicator& comm);

/// Collective flag exchange of combine and the backwards: gathers (error length, dtype, weight
/// mode, handle layout id) and throws on every rank when any rank failed, or when the dtypes, the
/// weight modes or the handles (layout ids) differ between ranks.
void agree(const char* op, const std::string& local_error, DType dtype, const char* what,
           WeightMode mode, uint64_t layout_id, Communicator& comm);

/// The layout fingerprint of a handle: a hash of its kind, sizes and count matrix.
uint64_t layout_id(const HandleState& h);

/// Rows each rank receives, padding included (sum over its experts and all sources).
std::vector<int64_t> rows_per_rank(const HandleState& h);

/// Rows rank `r` receives (rows_per_rank(h)[r]), O(L * EP).
int64_t rows_of_rank(const HandleState& h, int64_t r);

/// Visits this rank's receive layout in its order (local expert el ascending, then source s):
/// fn(el, s, offset) with the block's first row in recv_x.
/// O(L * EP) time and no table: per call, nothing of size E or larger is allocated for it.
template <class Fn>
void for_each_recv_block(const HandleState& h, Fn fn) {
  const int64_t P = h.world_size, L = h.num_local_experts;
  int64_t run = 0;
  for (int64_t el = 0; el < L; ++el) {
    const int64_t e = h.rank * L + el;
    for (int64_t s = 0; s < P; ++s) {
      fn(el, s, run);
      run += rows_at(h, s, e);
    }
  }
}

// The two strategies. Each fills the strategy-specific part of the handle (recv_src_*,
// recv_topk_weights, recv_gather_index) and moves rows in both directions. Collective.
namespace all_to_all {
/// The forward: fills recv_src_*, recv_topk_weights, recv_gather_index (identity) and moves the
/// token rows [T, rb] of `x` into the receive layout `recv_x` [R, rb], rows and their metadata in
/// one round.
void dispatch(const void* x, int64_t rb, void* recv_x, HandleState& h, Scratch& scratch,
              Communicator& comm);
/// Source side -> expert side: token rows [T, rb] to the receive layout [R, rb], one per pair.
void send_rows(const void* src, int64_t rb, void* dst, const HandleState& h, Scratch& scratch,
               Communicator& comm);
/// Expert side -> source side: rows [R, rb] back as this rank's plan rows [num_rows, rb].
void return_rows(const void* src, int64_t rb, void* dst, const HandleState& h, Scratch& scratch,
                 Communicator& comm);
}  // namespace all_to_all
namespace all_gather {
void fill_handle(HandleState& h, const Tensor& topk_idx, const Tensor& topk_weights,
                 const RoutingPlanOptions& plan_options, Scratch& scratch, Communicator& comm);
void send_rows(const void* src, int64_t rb, void* dst, const HandleState& h, Scratch& scratch,
               Communicator& comm);
void return_rows(const void* src, int64_t rb, void* dst, const HandleState& h, Scratch& scratch,
                 Communicator& comm);
}  // namespace all_gather

}  // namespace switchyard::dist::detail
