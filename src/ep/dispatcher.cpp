// The AlltoAll and AllGather dispatchers. Shape of every exchange:
//   1. local validation and the routing plan; errors are caught, not thrown yet;
//   2. one allgather of a small header per rank {error length, T, H, dtype, K, E, pairs per
//   expert}:
//      counts travel before payloads, and an error on any rank reaches every rank here;
//   3. payloads, sized only from the count matrix.
// Rows for a local expert are ordered by source rank then token, and combine always sums on the
// token's own rank with the same kernel as unpermute, which is why results are bitwise identical
// for any EP size and for both dispatchers.
#include "switchyard/dispatcher.h"

#include <cstring>
#include <stdexcept>

#include "backend/backend.h"
#include "check.h"
#include "dispatcher_layout.h"

namespace switchyard::dist {

namespace {

using switchyard::detail::check_defined;
using switchyard::detail::check_device;
using switchyard::detail::check_dim;
using switchyard::detail::check_dtype;
using switchyard::detail::check_shape;
using switchyard::detail::fail_arg;

constexpr int64_t kHeader = 7;  // error length, T, H, dtype, K, E, dispatcher kind

// The dispatchers move host rows (the communicator exchanges host memory), so their row kernels
// run on the CPU backend; a device communicator (NCCL) would carry its device and stream here.
constexpr backend::Context kHost{kCpu, nullptr, "dispatch"};

// Metadata travelling with each row in the AlltoAll dispatcher.
struct RowMeta {
  int64_t token;
  float weight;
  int32_t pad;
};

int64_t row_bytes(int64_t H, DType d) { return H * static_cast<int64_t>(dtype_size(d)); }

int64_t count_at(const DispatchHandle& h, int64_t s, int64_t e) {
  return h.rank_expert_counts[static_cast<size_t>(s * h.num_experts + e)];
}

void check_handle(const char* op, const DispatchHandle& h, const Communicator& comm) {
  if (h.world_size != comm.size() || h.rank != comm.rank() || !h.plan.row_token.defined()) {
    fail_arg(op, "handle must come from dispatch on this communicator (rank ", comm.rank(), " of ",
             comm.size(), "), got a handle for rank ", h.rank, " of ", h.world_size);
  }
}

// All-to-all counts of rank `me`: rows it sends to each rank and receives from each rank.
void a2a_counts(const DispatchHandle& h, std::vector<int64_t>& send, std::vector<int64_t>& recv) {
  const int64_t P = h.world_size, L = h.num_local_experts, me = h.rank;
  send.assign(static_cast<size_t>(P), 0);
  recv.assign(static_cast<size_t>(P), 0);
  for (int64_t r = 0; r < P; ++r)
    for (int64_t el = 0; el < L; ++el) {
      send[static_cast<size_t>(r)] += count_at(h, me, r * L + el);
      recv[static_cast<size_t>(r)] += count_at(h, r, me * L + el);
    }
}

// Communicator workspace slots of the dispatchers (0-7 belong to the communicator itself).
constexpr int kRowsSlot = 8;
constexpr int kStagingSlot = 9;
constexpr int kGradSlot = 10;
constexpr int kPackSlot = 11;

// This rank's plan rows as blocks: for every peer r and its local expert el (ascending), the rows
// of expert r*L+el, exchanged with r.
void plan_blocks(const DispatchHandle& h, std::vector<Communicator::Block>& out) {
  const int64_t P = h.world_size, L = h.num_local_experts;
  const int64_t* off = h.plan.expert_offsets.data<int64_t>();
  out.clear();
  for (int64_t r = 0; r < P; ++r)
    for (int64_t el = 0; el < L; ++el) {
      const int64_t e = r * L + el;
      // Empty blocks are left out here (both sides skip them), so the work per call follows
      // the pairs, not E.
      if (off[e + 1] > off[e]) out.push_back({static_cast<int>(r), off[e], off[e + 1] - off[e]});
    }
}

// This rank's receive layout as blocks: for every source s and local expert el (ascending), the
// rows of (el, s), exchanged with s. Per peer, the same order as that peer's plan_blocks.
void expert_blocks(const DispatchHandle& h, std::vector<Communicator::Block>& out) {
  const int64_t P = h.world_size, L = h.num_local_experts;
  const auto boff = detail::block_offsets(h);
  out.clear();
  for (int64_t s = 0; s < P; ++s)
    for (int64_t el = 0; el < L; ++el) {
      const int64_t e = h.rank * L + el;
      const int64_t n = count_at(h, s, e);
      if (n > 0) out.push_back({static_cast<int>(s), boff[static_cast<size_t>(e * P + s)], n});
    }
}

// Source side of the AllGather layout: for each row p of this rank's plan, its row in the buffer
// of every rank's expert outputs gathered in rank order.
std::vector<int64_t> plan_rows_in_gathered(const DispatchHandle& h) {
  const auto boff = detail::block_offsets(h);
  const auto per_rank = detail::rows_per_rank(h);
  std::vector<int64_t> rank_off(per_rank.size() + 1, 0);
  for (size_t r = 0; r < per_rank.size(); ++r) rank_off[r + 1] = rank_off[r] + per_rank[r];
  const int64_t P = h.world_size, L = h.num_local_experts;
  const int64_t* off = h.plan.expert_offsets.data<int64_t>();
  std::vector<int64_t> map(static_cast<size_t>(h.plan.num_rows));
  for (int64_t e = 0; e < h.num_experts; ++e) {
    const int64_t base =
        rank_off[static_cast<size_t>(e / L)] + boff[static_cast<size_t>(e * P + h.rank)];
    for (int64_t p = off[e]; p < off[e + 1]; ++p) map[static_cast<size_t>(p)] = base + (p - off[e]);
  }
  return map;
}

// Expert side -> source side: rows [R, row_bytes] in the receive layout come back as this rank's
// plan rows [num_pairs, row_bytes] (its send order). Collective.
void return_rows(const void* src, int64_t rb, void* dst, const DispatchHandle& h,
                 Communicator& comm) {
  const int64_t R = h.num_recv_tokens;
  if (h.kind == DispatcherKind::all_to_all) {
    // Each (local expert, source) block of the receive layout goes back as one message, straight
    // into the source's plan rows: no packing on either side.
    std::vector<Communicator::Block> send, recv;
    expert_blocks(h, send);
    plan_blocks(h, recv);
    comm.exchange_blocks(src, send, dst, recv, rb);
  } else {
    const auto per_rank = detail::rows_per_rank(h);
    int64_t total = 0;
    for (int64_t n : per_rank) total += n;
    void* all = comm.workspace(kStagingSlot, total * rb);
    comm.allgatherv(src, R, all, per_rank, rb);
    const auto map = plan_rows_in_gathered(h);
    backend::gather_rows(kHost, all, map.data(), h.plan.num_rows, rb, dst);
  }
}

// Source side -> expert side: token rows [T, row_bytes] go to the receive layout [R, row_bytes],
// one row per pair (what dispatch does to x). Collective.
void send_rows(const void* src, int64_t rb, void* dst, const DispatchHandle& h,
               Communicator& comm) {
  const int64_t R = h.num_recv_tokens;
  if (h.kind == DispatcherKind::all_to_all) {
    // Token rows are packed once in plan order (rows repeat: one per pair); each (expert, peer)
    // block then lands directly at its place in the receive layout.
    // Rows for this rank's own experts skip the pack: they are gathered from `src` straight into
    // their receive-layout place (at EP=2 that is half of the rows, one copy instead of two).
    const int64_t P = h.world_size, L = h.num_local_experts, me = h.rank;
    const int64_t* off = h.plan.expert_offsets.data<int64_t>();
    const int64_t* rt = h.plan.row_token.data<int64_t>();
    const int64_t self_begin = off[me * L], self_end = off[(me + 1) * L];
    void* packed = comm.workspace(kPackSlot, h.plan.num_rows * rb);
    auto* pk = static_cast<unsigned char*>(packed);
    backend::gather_rows(kHost, src, rt, self_begin, rb, pk);
    backend::gather_rows(kHost, src, rt + self_end, h.plan.num_rows - self_end, rb,
                         pk + self_end * rb);
    const auto boff = detail::block_offsets(h);
    auto* out = static_cast<unsigned char*>(dst);
    for (int64_t el = 0; el < L; ++el) {
      const int64_t e = me * L + el;
      if (off[e + 1] == off[e]) continue;  // a parallel region per empty expert cost 1 µs each
      backend::gather_rows(kHost, src, rt + off[e], off[e + 1] - off[e], rb,
                           out + boff[static_cast<size_t>(e * P + me)] * rb);
    }
    std::vector<Communicator::Block> send, recv;
    plan_blocks(h, send);
    expert_blocks(h, recv);
    for (auto& b : send) {
      if (b.peer == me) b.rows = 0;  // already in place
    }
    for (auto& b : recv) {
      if (b.peer == me) b.rows = 0;
    }
    comm.exchange_blocks(packed, send, dst, recv, rb);
  } else {
    int64_t total = 0;
    for (int64_t n : h.rank_num_tokens) total += n;
    void* all = comm.workspace(kStagingSlot, total * rb);
    comm.allgatherv(src, h.num_tokens, all, h.rank_num_tokens, rb);
    backend::gather_rows(kHost, all, h.recv_gather_index.data<int64_t>(), R, rb, dst);
  }
}

std::string local_checks_dispatch(const Tensor& x, const Tensor& topk_idx,
                                  const Tensor& topk_weights, const DispatchOptions& options,
                                  int64_t P, RoutingPlan& plan) {
  const char* op = "dispatch";
  try {
    // Options are normally the same everywhere, but if one rank's differ, a local throw would
    // leave the others waiting in the header exchange: so these go through it too (still before
    // any payload moves).
    const int64_t E = options.num_experts;
    if (E < 1) fail_arg(op, "num_experts must be >= 1, got num_experts=", E);
    if (E % P != 0) {
      fail_arg(op, "num_experts must be divisible by the expert-parallel size ", P,
               ", got num_experts=", E);
    }
    if (options.plan.expert_alignment != 1 || options.plan.pad_to_capacity) {
      fail_arg(op,
               "options.plan must not pad (padding rows are never sent): expected "
               "expert_alignment=1 and pad_to_capacity=false, got expert_alignment=",
               options.plan.expert_alignment,
               " and pad_to_capacity=", options.plan.pad_to_capacity);
    }

    check_defined(x, op, "x");
    check_dim(x, op, "x", 2);
    check_dtype(x, op, "x", {DType::fp32, DType::bf16});
    check_device(x, op, "x", kCpu);
    check_defined(topk_idx, op, "topk_idx");
    check_dim(topk_idx, op, "topk_idx", 2);
    check_dtype(topk_idx, op, "topk_idx", {DType::int32});
    check_device(topk_idx, op, "topk_idx", kCpu);
    if (topk_idx.size(0) != x.size(0)) {
      fail_arg(op, "topk_idx must have x's ", x.size(0), " rows, got shape ",
               shape_str(topk_idx.shape()));
    }
    check_defined(topk_weights, op, "topk_weights");
    check_dtype(topk_weights, op, "topk_weights", {DType::fp32});
    check_device(topk_weights, op, "topk_weights", kCpu);
    check_shape(topk_weights, op, "topk_weights", topk_idx.shape());
    // NaN/Inf would travel silently into every expert and into combine's sums (the gate and the
    // router reject them too): the same scan, inside the agreement, so every rank raises.
    switchyard::detail::check_finite(x, op, "x", "token", "hidden");
    switchyard::detail::check_finite(topk_weights, op, "topk_weights", "token", "slot");
    plan = build_routing_plan(topk_idx, topk_weights, options.num_experts, options.plan);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return {};
}

// `name`: the caller's name of expert_y, for messages ("expert_y", "grad_recv_x").
Tensor combine_impl(const char* op, const char* name, const Tensor& expert_y,
                    const DispatchHandle& h, const UnpermuteOptions& options, Communicator& comm) {
  const Communicator::Exclusive busy(comm, op);
  std::string err;
  try {
    // Inside the agreement: a bad handle on one rank raises on every rank instead of leaving
    // the others waiting in the exchange.
    check_handle(op, h, comm);
    check_defined(expert_y, op, name);
    check_dtype(expert_y, op, name, {DType::fp32, DType::bf16});
    check_device(expert_y, op, name, kCpu);
    check_shape(expert_y, op, name, {h.num_recv_tokens, h.hidden});
    switchyard::detail::check_finite(expert_y, op, name, "row", "hidden");
  } catch (const std::invalid_argument& e) {
    err = e.what();
  }
  detail::agree(op, err, err.empty() ? expert_y.dtype() : DType::fp32, name, options.weights,
                comm);
  const DType dt = expert_y.dtype();
  // The returned rows live in the communicator's workspace (reused step after step).
  const int64_t rb = row_bytes(h.hidden, dt);
  Tensor rows = Tensor::borrow(comm.workspace(kRowsSlot, h.plan.num_rows * rb),
                               {h.plan.num_rows, h.hidden}, dt);
  return_rows(expert_y.raw(), rb, rows.raw(), h, comm);
  return unpermute(rows, h.plan, options);
}

}  // namespace

DispatchResult dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                        const DispatchOptions& options, Communicator& comm) {
  const char* op = "dispatch";
  const Communicator::Exclusive busy(comm, op);
  const int64_t P = comm.size(), me = comm.rank(), E = options.num_experts;
  RoutingPlan plan;
  const std::string err = local_checks_dispatch(x, topk_idx, topk_weights, options, P, plan);
  // Phase 1, fixed size on every rank: error flag and the sizes that must agree. Phase 2 (once E
  // is known to agree): the per-expert counts.
  std::vector<int64_t> header(static_cast<size_t>(kHeader), 0);
  header[0] = static_cast<int64_t>(err.size());
  header[5] = E;
  header[6] = static_cast<int64_t>(options.kind);
  if (err.empty()) {
    header[1] = x.size(0);
    header[2] = x.size(1);
    header[3] = static_cast<int64_t>(x.dtype());
    header[4] = topk_idx.size(1);
  }
  const std::vector<int64_t> all = comm.allgather(header);
  auto at = [&](int64_t r, int64_t i) { return all[static_cast<size_t>(r * kHeader + i)]; };
  std::vector<int64_t> lens(static_cast<size_t>(P));
  for (int64_t r = 0; r < P; ++r) lens[static_cast<size_t>(r)] = at(r, 0);
  detail::raise_if_any(op, err, lens, comm);
  // Agreement between ranks: computed from the same gathered header everywhere, so every rank
  // throws the same message.
  for (int64_t r = 1; r < P; ++r) {
    if (at(r, 5) != at(0, 5)) {
      fail_arg(op, "num_experts must be the same on every rank, got ", at(0, 5), " on rank 0 and ",
               at(r, 5), " on rank ", r);
    }
    if (at(r, 6) != at(0, 6)) {
      fail_arg(op, "options.kind must be the same on every rank, got ",
               at(0, 6) == 0 ? "all_to_all" : "all_gather", " on rank 0 and ",
               at(r, 6) == 0 ? "all_to_all" : "all_gather", " on rank ", r);
    }
    if (at(r, 2) != at(0, 2)) {
      fail_arg(op, "x must have the same hidden size on every rank, got hidden=", at(0, 2),
               " on rank 0 and hidden=", at(r, 2), " on rank ", r);
    }
    if (at(r, 3) != at(0, 3)) {
      fail_arg(op, "x must have the same dtype on every rank, got ",
               dtype_name(static_cast<DType>(at(0, 3))), " on rank 0 and ",
               dtype_name(static_cast<DType>(at(r, 3))), " on rank ", r);
    }
    if (at(r, 4) != at(0, 4)) {
      fail_arg(op, "topk_idx must have the same top_k on every rank, got top_k=", at(0, 4),
               " on rank 0 and top_k=", at(r, 4), " on rank ", r);
    }
  }
  const int64_t* my_counts = plan.num_tokens_per_expert.data<int64_t>();
  const std::vector<int64_t> counts =
      comm.allgather(std::vector<int64_t>(my_counts, my_counts + E));

  DispatchHandle h;
  h.kind = options.kind;
  h.rank = static_cast<int>(me);
  h.world_size = static_cast<int>(P);
  h.num_tokens = x.size(0);
  h.hidden = x.size(1);
  h.num_experts = E;
  h.num_local_experts = E / P;
  h.plan = std::move(plan);
  h.rank_expert_counts.resize(static_cast<size_t>(P * E));
  h.rank_num_tokens.resize(static_cast<size_t>(P));
  for (int64_t r = 0; r < P; ++r) {
    h.rank_num_tokens[static_cast<size_t>(r)] = at(r, 1);
    for (int64_t e = 0; e < E; ++e)
      h.rank_expert_counts[static_cast<size_t>(r * E + e)] = counts[static_cast<size_t>(r * E + e)];
  }
  const int64_t L = h.num_local_experts, H = h.hidden, K = topk_idx.size(1);
  const int64_t R = detail::rows_per_rank(h)[static_cast<size_t>(me)];
  h.num_recv_tokens = R;
  h.num_tokens_per_expert = Tensor::empty({L}, DType::int64);
  h.expert_offsets = Tensor::empty({L + 1}, DType::int64);
  {
    int64_t* n = h.num_tokens_per_expert.data<int64_t>();
    int64_t* o = h.expert_offsets.data<int64_t>();
    o[0] = 0;
    for (int64_t el = 0; el < L; ++el) {
      n[el] = 0;
      for (int64_t s = 0; s < P; ++s) n[el] += count_at(h, s, me * L + el);
      o[el + 1] = o[el] + n[el];
    }
  }
  h.recv_src_rank = Tensor::empty({R}, DType::int32);
  h.recv_src_token = Tensor::empty({R}, DType::int64);
  h.recv_topk_weights = Tensor::empty({R}, DType::fp32);
  h.recv_gather_index = Tensor::empty({R}, DType::int64);
  int32_t* src_rank = h.recv_src_rank.data<int32_t>();
  int64_t* src_token = h.recv_src_token.data<int64_t>();
  float* recv_w = h.recv_topk_weights.data<float>();
  int64_t* gi = h.recv_gather_index.data<int64_t>();
  const auto boff = detail::block_offsets(h);
  const int64_t rb = row_bytes(H, x.dtype());
  DispatchResult out;
  out.recv_x = Tensor::empty({R, H}, x.dtype());

  if (options.kind == DispatcherKind::all_to_all) {
    std::vector<int64_t> send, recv;
    a2a_counts(h, send, recv);
    // Receive layout: block (local expert el, source s) arrives inside s's chunk after s's rows
    // for the lower local experts.
    std::vector<int64_t> chunk(static_cast<size_t>(P + 1), 0);
    for (int64_t s = 0; s < P; ++s) chunk[s + 1] = chunk[s] + recv[s];
    for (int64_t s = 0; s < P; ++s) {
      int64_t st = chunk[s];
      for (int64_t el = 0; el < L; ++el) {
        const int64_t e = me * L + el, n = count_at(h, s, e),
                      o = boff[static_cast<size_t>(e * P + s)];
        for (int64_t j = 0; j < n; ++j) {
          gi[o + j] = st + j;
          src_rank[o + j] = static_cast<int32_t>(s);
        }
        st += n;
      }
    }
    // Row metadata (token, weight), then the payload rows.
    const int64_t np = h.plan.num_rows;
    std::vector<RowMeta> send_meta(static_cast<size_t>(np)), recv_meta(static_cast<size_t>(R));
    const int64_t* rt = h.plan.row_token.data<int64_t>();
    const float* rw = h.plan.row_weight.data<float>();
    for (int64_t p = 0; p < np; ++p) send_meta[static_cast<size_t>(p)] = {rt[p], rw[p], 0};
    comm.alltoallv(send_meta.data(), send, recv_meta.data(), recv, sizeof(RowMeta));
    for (int64_t i = 0; i < R; ++i) {
      const RowMeta& m = recv_meta[static_cast<size_t>(gi[i])];
      src_token[i] = m.token;
      recv_w[i] = m.weight;
    }
    send_rows(x.raw(), rb, out.recv_x.raw(), h, comm);
  } else {
    // Every rank gathers every rank's routes, rebuilds each source's plan (the same deterministic
    // plan the source built), and keeps the pairs of its own experts.
    int64_t total = 0;
    for (int64_t n : h.rank_num_tokens) total += n;
    std::vector<int32_t> all_idx(static_cast<size_t>(total * K));
    std::vector<float> all_w(static_cast<size_t>(total * K));
    comm.allgatherv(topk_idx.raw(), h.num_tokens, all_idx.data(), h.rank_num_tokens,
                    K * static_cast<int64_t>(sizeof(int32_t)));
    comm.allgatherv(topk_weights.raw(), h.num_tokens, all_w.data(), h.rank_num_tokens,
                    K * static_cast<int64_t>(sizeof(float)));
    int64_t tok_off = 0;
    for (int64_t s = 0; s < P; ++s) {
      const int64_t Ts = h.rank_num_tokens[static_cast<size_t>(s)];
      RoutingPlan ps =
          s == me ? h.plan
                  : build_routing_plan(
                        Tensor::borrow(all_idx.data() + tok_off * K, {Ts, K}, DType::int32),
                        Tensor::borrow(all_w.data() + tok_off * K, {Ts, K}, DType::fp32), E,
                        options.plan);
      const int64_t* rt = ps.row_token.data<int64_t>();
      const float* rw = ps.row_weight.data<float>();
      const int64_t* off = ps.expert_offsets.data<int64_t>();
      for (int64_t el = 0; el < L; ++el) {
        const int64_t e = me * L + el, o = boff[static_cast<size_t>(e * P + s)];
        for (int64_t j = 0; j < off[e + 1] - off[e]; ++j) {
          gi[o + j] = tok_off + rt[off[e] + j];
          src_rank[o + j] = static_cast<int32_t>(s);
          src_token[o + j] = rt[off[e] + j];
          recv_w[o + j] = rw[off[e] + j];
        }
      }
      tok_off += Ts;
    }
    send_rows(x.raw(), rb, out.recv_x.raw(), h, comm);
  }
  out.recv_topk_weights = h.recv_topk_weights;
  out.handle = std::move(h);
  return out;
}

Tensor combine(const Tensor& expert_y, const DispatchHandle& handle,
               const UnpermuteOptions& options, Communicator& comm) {
  return combine_impl("combine", "expert_y", expert_y, handle, options, comm);
}

Tensor dispatch_backward(const Tensor& grad_recv_x, const DispatchHandle& handle,
                         Communicator& comm) {
  return combine_impl("dispatch_backward", "grad_recv_x", grad_recv_x, handle,
                      UnpermuteOptions{WeightMode::skip}, comm);
}

Tensor dispatch_weights_backward(const Tensor& grad_recv_topk_weights, const DispatchHandle& h,
                                 Communicator& comm) {
  const char* op = "dispatch_weights_backward";
  const char* name = "grad_recv_topk_weights";
  const Communicator::Exclusive busy(comm, op);
  std::string err;
  try {
    check_handle(op, h, comm);
    check_dtype(grad_recv_topk_weights, op, name, {DType::fp32});
    check_device(grad_recv_topk_weights, op, name, kCpu);
    check_shape(grad_recv_topk_weights, op, name, {h.num_recv_tokens});
  } catch (const std::invalid_argument& e) {
    err = e.what();
  }
  detail::agree(op, err, DType::fp32, name, WeightMode::apply, comm);
  const int P = h.world_size;
  const int64_t R = h.num_recv_tokens, E = h.num_experts, L = h.num_local_experts;
  // Received rows are ordered (local expert, source rank, token): a stable bucket by source rank
  // gives each source its rows in (expert, token) order, which is its plan's row order.
  const int32_t* src = h.recv_src_rank.data<int32_t>();
  std::vector<int64_t> send_counts(static_cast<size_t>(P), 0), recv_counts(static_cast<size_t>(P), 0);
  for (int64_t i = 0; i < R; ++i) ++send_counts[static_cast<size_t>(src[i])];
  std::vector<int64_t> next(static_cast<size_t>(P), 0);
  for (int r = 1; r < P; ++r) next[r] = next[r - 1] + send_counts[static_cast<size_t>(r - 1)];
  std::vector<float> send(static_cast<size_t>(R));
  const float* g = grad_recv_topk_weights.data<float>();
  for (int64_t i = 0; i < R; ++i) send[static_cast<size_t>(next[src[i]]++)] = g[i];
  for (int r = 0; r < P; ++r) {
    for (int64_t e = r * L; e < (r + 1) * L; ++e) {
      recv_counts[static_cast<size_t>(r)] += h.rank_expert_counts[static_cast<size_t>(h.rank * E + e)];
    }
  }
  std::vector<float> recv(static_cast<size_t>(h.plan.num_rows));
  comm.alltoallv(send.data(), send_counts, recv.data(), recv_counts, sizeof(float));
  const int64_t TK = h.plan.num_tokens * h.plan.top_k;
  Tensor out = Tensor::empty({h.plan.num_tokens, h.plan.top_k}, DType::fp32);
  const int64_t* slot_row = h.plan.slot_row.data<int64_t>();
  float* o = out.data<float>();
  for (int64_t i = 0; i < TK; ++i) o[i] = slot_row[i] >= 0 ? recv[static_cast<size_t>(slot_row[i])] : 0.0f;
  return out;
}

CombineGrads combine_backward(const Tensor& grad_y, const Tensor& expert_y, const DispatchHandle& h,
                              const UnpermuteOptions& options, Communicator& comm) {
  const char* op = "combine_backward";
  const Communicator::Exclusive busy(comm, op);
  const bool apply = options.weights == WeightMode::apply;
  std::string err;
  try {
    check_handle(op, h, comm);
    check_defined(grad_y, op, "grad_y");
    check_dtype(grad_y, op, "grad_y", {DType::fp32, DType::bf16});
    check_device(grad_y, op, "grad_y", kCpu);
    check_shape(grad_y, op, "grad_y", {h.num_tokens, h.hidden});
    if (apply) {
      check_defined(expert_y, op, "expert_y");
      check_device(expert_y, op, "expert_y", kCpu);
      check_shape(expert_y, op, "expert_y", {h.num_recv_tokens, h.hidden});
      if (expert_y.dtype() != grad_y.dtype()) {
        fail_arg(op, "expert_y must have grad_y's dtype ", dtype_name(grad_y.dtype()), ", got ",
                 dtype_name(expert_y.dtype()));
      }
    }
  } catch (const std::invalid_argument& e) {
    err = e.what();
  }
  detail::agree(op, err, err.empty() ? grad_y.dtype() : DType::fp32, "grad_y", options.weights,
                comm);
  const DType dt = grad_y.dtype();
  const int64_t R = h.num_recv_tokens, H = h.hidden;
  // With weights, the dispatched gradient is an intermediate: keep it in the workspace.
  Tensor g_recv = apply
                      ? Tensor::borrow(comm.workspace(kGradSlot, R * row_bytes(H, dt)), {R, H}, dt)
                      : Tensor::empty({R, H}, dt);
  send_rows(grad_y.raw(), row_bytes(H, dt), g_recv.raw(), h, comm);
  CombineGrads out;
  out.grad_topk_weights = Tensor::zeros({h.num_tokens, h.plan.top_k}, DType::fp32);
  if (!apply) {
    out.grad_expert_y = g_recv;
    return out;
  }
  out.grad_expert_y = Tensor::empty({R, H}, dt);
  Tensor dots = Tensor::empty({R}, DType::fp32);
  backend::by_row_dtype(dt, [&](auto tag) {
    using X = decltype(tag);
    const X* g = static_cast<const X*>(g_recv.raw());
    backend::gather_scale_rows<X>(kHost, g, h.recv_topk_weights.data<float>(), nullptr, R, H,
                                  static_cast<X*>(out.grad_expert_y.raw()));
    backend::row_dots<X>(kHost, static_cast<const X*>(expert_y.raw()), g, nullptr, R, H,
                         dots.data<float>());
  });
  std::vector<float> plan_dots(static_cast<size_t>(h.plan.num_rows));
  return_rows(dots.raw(), sizeof(float), plan_dots.data(), h, comm);
  const int64_t* sr = h.plan.slot_row.data<int64_t>();
  float* gw = out.grad_topk_weights.data<float>();
  for (int64_t s = 0; s < h.num_tokens * h.plan.top_k; ++s) {
    if (sr[s] >= 0) gw[s] = plan_dots[static_cast<size_t>(sr[s])];
  }
  return out;
}

void fail_collective(CollectiveOp op, const std::string& message, Communicator& comm) {
  const Communicator::Exclusive busy(comm, "fail_collective");
  const std::string err = message.empty() ? std::string("failed before the call") : message;
  if (op == CollectiveOp::dispatch) {
    // dispatch()'s phase-1 header, error length first (the other fields are not read on error).
    std::vector<int64_t> header(static_cast<size_t>(kHeader), 0);
    header[0] = static_cast<int64_t>(err.size());
    const std::vector<int64_t> all = comm.allgather(header);
    std::vector<int64_t> lens(static_cast<size_t>(comm.size()));
    for (size_t r = 0; r < lens.size(); ++r) lens[r] = all[r * kHeader];
    detail::raise_if_any("dispatch", err, lens, comm);
  } else {
    detail::agree("combine", err, DType::fp32, "expert_y", WeightMode::apply, comm);
  }
  throw std::logic_error("[fail_collective] the agreement did not raise");  // not reached
}

}  // namespace switchyard::dist
