// Expert-parallel dispatch and combine (DeepEP's vocabulary). Rank r of an EP group of size EP
// holds experts [r*L, (r+1)*L), L = num_experts / EP. Two dispatchers move the same rows:
//  - all_to_all: each rank sends each (token, expert) pair to the expert's rank (MPI_Alltoallv);
//  - all_gather: every rank gathers every rank's tokens and keeps the pairs of its own experts;
//    combine gathers every expert output row back (more traffic, no all-to-all).
// Both give bitwise identical results, and the results are bitwise identical for any EP size: the
// received rows of a local expert come ordered by source rank then token, and combine sums a
// token's rows in fp32 in the fixed order of its slots (k ascending), on the token's own rank.
// Every size comes from a RoutingPlan (distinct valid pairs), never from T*K.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "switchyard/dist.h"
#include "switchyard/permute.h"
#include "switchyard/routing_plan.h"
#include "switchyard/tensor.h"

namespace switchyard::dist {

/// Which dispatcher moves the rows.
enum class DispatcherKind : uint8_t { all_to_all, all_gather };

/// Options of dispatch.
struct DispatchOptions {
  /// E, the global number of experts; must be divisible by the communicator's size.
  int64_t num_experts = 0;
  DispatcherKind kind = DispatcherKind::all_to_all;
  /// Capacity and padding options of the (per-rank) routing plan; must agree on every rank.
  /// Padding (Megatron-Core's `moe_router_padding_for_quantization` -> expert_alignment, and
  /// `moe_pad_expert_input_to_capacity` -> pad_to_capacity) pads each source rank's block of every
  /// expert, as Megatron's pad_routing_map and drop-and-pad do, so a local expert receives
  /// sum over sources of align_up(n or C) rows. Unlike Megatron, padding rows are never sent: they
  /// are zero rows with weight 0 (source rank and token -1) at the end of each (expert, source)
  /// block of recv_x, and combine and the backwards ignore them; real rows are bitwise those of
  /// the unpadded path.
  RoutingPlanOptions plan;
};

class DispatchHandle;

namespace detail {
struct Scratch;

/// The layout behind a DispatchHandle: what combine and the backwards read (src/ep/ only; users
/// read a handle through its accessors).
struct HandleState {
  DispatcherKind kind = DispatcherKind::all_to_all;
  int rank = 0;
  int world_size = 1;
  int64_t num_tokens = 0;         ///< T of this rank
  int64_t hidden = 0;             ///< H (same on every rank)
  int64_t num_experts = 0;        ///< E
  int64_t num_local_experts = 0;  ///< L = E / EP
  int64_t num_recv_tokens = 0;    ///< R: rows of recv_x, padding rows included
  /// This rank's routing plan over all E experts (its send order: expert-major, so rank-major).
  RoutingPlan plan;
  /// [L] int64: rows per local expert in recv_x, padding included (sum = R): what a grouped GEMM
  /// iterates over.
  Tensor num_tokens_per_expert;
  /// [L] int64: real (unpadded) received pairs per local expert; equal to num_tokens_per_expert
  /// without padding.
  Tensor num_unpadded_tokens_per_expert;
  /// [L+1] int64: exclusive prefix sum of num_tokens_per_expert.
  Tensor expert_offsets;
  /// [R] int32 / int64: source rank and source token of each received row (-1 for padding).
  Tensor recv_src_rank;
  Tensor recv_src_token;
  /// [EP * E] int64, rank-major: pairs per (source rank, expert), known on every rank.
  std::vector<int64_t> rank_expert_counts;
  /// [EP * E] int64: rows per (source rank, expert) block of the receive layout, padding
  /// included; empty without padding (the rows are then rank_expert_counts: at E = 2^24 a second
  /// copy was 128 MiB per rank and call).
  std::vector<int64_t> rank_expert_rows;
  /// [EP] int64: tokens per rank.
  std::vector<int64_t> rank_num_tokens;
  /// [R] fp32: the received rows' routing weights, 0 for padding (shares storage with
  /// DispatchResult's).
  Tensor recv_topk_weights;
  /// [R] int64, internal layout map: all_gather: row of the gathered token buffer that received
  /// row i comes from (-1 for padding); all_to_all: i (rows arrive in place).
  Tensor recv_gather_index;
  /// Fingerprint of the count matrix (the same on every rank for one dispatch): combine and the
  /// backwards check it in their error agreement, so handles of different steps on different
  /// ranks raise everywhere instead of hanging in mismatched exchanges.
  uint64_t layout_id = 0;
};

/// The state of a handle, for the dispatch implementation (src/ep/).
HandleState& state(DispatchHandle& h);
const HandleState& state(const DispatchHandle& h);
}  // namespace detail

/// What combine and the backwards need; returned by dispatch. Opaque, as DeepEP's handle: read it
/// through the accessors below (integers, not differentiable); only a handle that came from
/// dispatch on the same communicator is accepted by combine and the backwards (a
/// default-constructed one is rejected with std::invalid_argument on every rank).
class DispatchHandle {
 public:
  DispatcherKind kind() const { return s_.kind; }
  int rank() const { return s_.rank; }
  int world_size() const { return s_.world_size; }
  int64_t num_tokens() const { return s_.num_tokens; }                ///< T of this rank
  int64_t hidden() const { return s_.hidden; }                        ///< H (same on every rank)
  int64_t num_experts() const { return s_.num_experts; }              ///< E
  int64_t num_local_experts() const { return s_.num_local_experts; }  ///< L = E / EP
  /// R: rows of recv_x, padding rows included.
  int64_t num_recv_tokens() const { return s_.num_recv_tokens; }
  /// [L] int64: rows per local expert in recv_x, padding included (sum = R): what a grouped GEMM
  /// iterates over.
  const Tensor& num_tokens_per_expert() const { return s_.num_tokens_per_expert; }
  /// [L] int64: real (unpadded) received pairs per local expert; equal to num_tokens_per_expert
  /// without padding.
  const Tensor& num_unpadded_tokens_per_expert() const { return s_.num_unpadded_tokens_per_expert; }
  /// [L+1] int64: exclusive prefix sum of num_tokens_per_expert (where each local expert's rows
  /// start in recv_x).
  const Tensor& expert_offsets() const { return s_.expert_offsets; }
  /// [R] int32: source rank of each received row (-1 for padding).
  const Tensor& recv_src_rank() const { return s_.recv_src_rank; }
  /// [R] int64: source token (on its rank) of each received row (-1 for padding).
  const Tensor& recv_src_token() const { return s_.recv_src_token; }
  /// (token, expert) pairs this rank dropped by capacity.
  int64_t num_dropped() const { return s_.plan.num_dropped; }

 private:
  friend detail::HandleState& detail::state(DispatchHandle& h);
  friend const detail::HandleState& detail::state(const DispatchHandle& h);
  detail::HandleState s_;
};

namespace detail {
inline HandleState& state(DispatchHandle& h) { return h.s_; }
inline const HandleState& state(const DispatchHandle& h) { return h.s_; }
}  // namespace detail

/// Result of dispatch.
struct DispatchResult {
  /// [R, H], x's dtype: rows grouped by local expert ascending, then source rank, then token.
  Tensor recv_x;
  /// [R] fp32: each row's routing weight (summed over repeated ids), for experts that apply it.
  Tensor recv_topk_weights;
  DispatchHandle handle;
};

/// Gradients of combine.
struct CombineGrads {
  /// [R,H], grad_y's dtype: w_row * grad_y[token(row)] (grad_y[token(row)] with WeightMode::skip).
  Tensor grad_expert_y;
  /// [T,K] fp32: <expert_y[row(t,k)], grad_y[t]> for every slot with a row (repeated ids get it in
  /// each slot); 0 for `-1` slots and with WeightMode::skip.
  Tensor grad_topk_weights;
};

/// DeepEP's `Buffer` for this engine: the object a training loop keeps across steps. It owns the
/// scratch memory of dispatch, combine and the backwards (pack buffers, rows coming back, row
/// metadata), grown to the high-water mark and reused, so that steady-state steps never fault
/// fresh pages (first-touch zeroing of multi-MiB buffers cost about a third of a step when every
/// step allocated them). Results that outlive the call (recv_x, y, gradients, the handle) are
/// Tensors; their storage comes from the tensor allocator's cache. This class is the C++ API of
/// dispatch and combine (there is no free-function form); a one-off call may use a temporary,
/// `Dispatcher(comm).dispatch(...)`, at the cost of fresh scratch. Not thread-safe; one dispatcher
/// and its communicator serve one thread at a time (std::logic_error otherwise).
class Dispatcher {
 public:
  explicit Dispatcher(std::shared_ptr<Communicator> comm);
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  Communicator& comm() const { return *comm_; }
  /// Bytes of scratch memory held now (grows to the largest step seen; never shrinks).
  int64_t scratch_bytes() const;

  // The operations, on this dispatcher's communicator. Each is collective and deterministic; a
  // handle may be used with any Dispatcher on the same communicator (the handle holds no scratch).

  /// Send each distinct valid (token, expert) pair of this rank to the expert's rank.
  /// With padding options, recv_x holds zero padding rows (weight 0, source -1) at the end of each
  /// (local expert, source) block; handle.num_tokens_per_expert() counts them.
  /// `x` [T,H] fp32|bf16 (T may differ per rank, may be 0), `topk_idx` [T,K] int32 (-1 = none),
  /// `topk_weights` [T,K] fp32. Data errors on any rank (an id outside [-1,E), a hidden size or
  /// dtype that differs between ranks, a bad shape) throw the same std::invalid_argument on every
  /// rank, with the message of the lowest failing rank; no rank hangs. E not divisible by EP (or
  /// any bad option) is rejected the same way, before any payload moves.
  DispatchResult dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                          const DispatchOptions& options);
  /// Return expert outputs to their tokens: y[t] = sum over t's pairs (slot order, k ascending) of
  /// w * expert_y[row], fp32 accumulation, written in expert_y's dtype. `expert_y` [R,H] fp32|bf16
  /// in recv_x's layout -> [T,H]. With `weights` WeightMode::skip the weights are not applied (the
  /// experts already applied recv_topk_weights). Bitwise independent of EP and of the dispatcher.
  Tensor combine(const Tensor& expert_y, const DispatchHandle& handle,
                 WeightMode weights = WeightMode::apply);
  /// Backward of dispatch (= combine without weights): grad_x[t] = sum of grad_recv_x over t's
  /// rows. `grad_recv_x` [R,H] fp32|bf16 -> [T,H].
  Tensor dispatch_backward(const Tensor& grad_recv_x, const DispatchHandle& handle);
  /// Backward of dispatch's `recv_topk_weights` output (for experts that apply the weights
  /// themselves): each received row's weight gradient goes back to its source rank and to every
  /// slot of that pair (a merged repeated id gives the row's gradient to each of its slots, since
  /// the row's weight is their sum). `grad_recv_topk_weights` [R] fp32 -> grad_topk_weights [T,K]
  /// fp32, 0 for `-1` and dropped slots. A bad argument on one rank raises on every rank.
  Tensor dispatch_weights_backward(const Tensor& grad_recv_topk_weights,
                                   const DispatchHandle& handle);
  /// Backward of combine (= dispatch of grad_y reusing the handle, plus the weight gradients).
  /// `grad_y` [T,H]; `expert_y` the forward's [R,H] input.
  CombineGrads combine_backward(const Tensor& grad_y, const Tensor& expert_y,
                                const DispatchHandle& handle,
                                WeightMode weights = WeightMode::apply);

 private:
  Tensor combine_impl(const char* op, const char* name, const Tensor& expert_y,
                      const detail::HandleState& h, WeightMode weights);
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<detail::Scratch> scratch_;
};

/// Which collective's error agreement fail_collective joins.
enum class CollectiveOp : uint8_t { dispatch, combine };

/// For a caller (a binding, a framework adapter) whose own checks failed on this rank before it
/// could call the collective: joins that collective's error agreement in its place, so every rank
/// raises the same std::invalid_argument (the lowest failing rank's message) instead of the others
/// waiting for this rank. `op`: dispatch for dispatch(), combine for combine(),
/// dispatch_backward(), dispatch_weights_backward() and combine_backward(). Collective; always
/// throws.
[[noreturn]] void fail_collective(CollectiveOp op, const std::string& message, Communicator& comm);

}  // namespace switchyard::dist
