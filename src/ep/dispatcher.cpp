// The Dispatcher: the C++ API of dispatch, combine and the backwards. Shape of every exchange:
//   1. local validation and the routing plan; errors are caught, not thrown yet;
//   2. one allgather of a small header per rank {error length, T, H, dtype, K, E, kind, padding},
//      then
//      (once E agrees) the per-expert counts: counts travel before payloads, and an error on any
//      rank reaches every rank here;
//   3. payloads, sized only from the count matrix, moved by the strategy (all_to_all.cpp,
//      all_gather.cpp).
// Rows for a local expert are ordered by source rank then token, and combine always sums on the
// token's own rank with unpermute's kernel, which is why results are bitwise identical for any EP
// size and for both dispatchers.
#include "switchyard/dispatcher.h"

#include <stdexcept>

#include "check.h"
#include "dispatcher_common.h"

namespace switchyard::dist {

namespace {

using detail::count_at;
using detail::HandleState;
using detail::row_bytes;
using detail::Scratch;
using switchyard::detail::check_defined;
using switchyard::detail::check_device;
using switchyard::detail::check_dim;
using switchyard::detail::check_dtype;
using switchyard::detail::check_shape;
using switchyard::detail::fail_arg;

// error length, T, H, dtype, K, E, dispatcher kind, expert_alignment, pad_to_capacity
constexpr int64_t kHeader = 9;

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

// The header exchange: raises on every rank when any rank failed its local checks or when the
// sizes and options that must agree differ. Returns the gathered headers.
std::vector<int64_t> exchange_header(const char* op, const std::string& err, const Tensor& x,
                                     const Tensor& topk_idx, const DispatchOptions& options,
                                     Communicator& comm) {
  const int64_t P = comm.size();
  std::vector<int64_t> header(static_cast<size_t>(kHeader), 0);
  header[0] = static_cast<int64_t>(err.size());
  header[5] = options.num_experts;
  header[6] = static_cast<int64_t>(options.kind);
  header[7] = options.plan.expert_alignment;
  header[8] = options.plan.pad_to_capacity ? 1 : 0;
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
  // Computed from the same gathered header everywhere, so every rank throws the same message.
  auto kind_name = [](int64_t k) { return k == 0 ? "all_to_all" : "all_gather"; };
  for (int64_t r = 1; r < P; ++r) {
    if (at(r, 5) != at(0, 5)) {
      fail_arg(op, "num_experts must be the same on every rank, got ", at(0, 5), " on rank 0 and ",
               at(r, 5), " on rank ", r);
    }
    if (at(r, 6) != at(0, 6)) {
      fail_arg(op, "options.kind must be the same on every rank, got ", kind_name(at(0, 6)),
               " on rank 0 and ", kind_name(at(r, 6)), " on rank ", r);
    }
    if (at(r, 7) != at(0, 7) || at(r, 8) != at(0, 8)) {
      fail_arg(op, "options.plan padding must be the same on every rank, got expert_alignment=",
               at(0, 7), " pad_to_capacity=", at(0, 8) ? "true" : "false", " on rank 0 and ",
               "expert_alignment=", at(r, 7), " pad_to_capacity=", at(r, 8) ? "true" : "false",
               " on rank ", r);
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
  return all;
}

}  // namespace

Dispatcher::Dispatcher(std::shared_ptr<Communicator> comm)
    : comm_(std::move(comm)), scratch_(std::make_unique<detail::Scratch>()) {
  if (!comm_) fail_arg("Dispatcher", "comm must be a communicator, got null");
}

Dispatcher::~Dispatcher() = default;

int64_t Dispatcher::scratch_bytes() const { return scratch_->bytes(); }

DispatchResult Dispatcher::dispatch(const Tensor& x, const Tensor& topk_idx,
                                    const Tensor& topk_weights, const DispatchOptions& options) {
  const char* op = "dispatch";
  Communicator& comm = *comm_;
  const Communicator::Exclusive busy(comm, op);
  const int64_t P = comm.size(), me = comm.rank(), E = options.num_experts;
  RoutingPlan plan;
  const std::string err = local_checks_dispatch(x, topk_idx, topk_weights, options, P, plan);
  const std::vector<int64_t> headers = exchange_header(op, err, x, topk_idx, options, comm);
  const bool padded = options.plan.expert_alignment != 1 || options.plan.pad_to_capacity;

  DispatchResult out;
  HandleState& h = detail::state(out.handle);
  h.kind = options.kind;
  h.rank = static_cast<int>(me);
  h.world_size = static_cast<int>(P);
  h.num_tokens = x.size(0);
  h.hidden = x.size(1);
  h.num_experts = E;
  h.num_local_experts = E / P;
  h.plan = std::move(plan);
  // The count exchange (E agrees by now): every rank's pairs per expert straight from its plan
  // into the handle's matrix, and with padding the rows of each expert's (padded) block into the
  // other. The only O(E) work of the call besides the plan's own arrays: no staging copies, no
  // table over all ranks' layouts (at E = 2^24 each of those was 128 MiB per rank and call).
  h.rank_expert_counts.resize(static_cast<size_t>(P * E));
  comm.allgather(h.plan.num_tokens_per_expert.raw(), h.rank_expert_counts.data(), E,
                 static_cast<int64_t>(sizeof(int64_t)));
  if (padded) {
    int64_t* rows = scratch_->get<int64_t>(Scratch::counts, E);
    const int64_t* off = h.plan.expert_offsets.data<int64_t>();
    for (int64_t e = 0; e < E; ++e) rows[e] = off[e + 1] - off[e];
    h.rank_expert_rows.resize(static_cast<size_t>(P * E));
    comm.allgather(rows, h.rank_expert_rows.data(), E, static_cast<int64_t>(sizeof(int64_t)));
  }  // else no second matrix: the rows are the pairs (rank_expert_rows stays empty)
  h.rank_num_tokens.resize(static_cast<size_t>(P));
  for (int64_t r = 0; r < P; ++r)
    h.rank_num_tokens[static_cast<size_t>(r)] = headers[static_cast<size_t>(r * kHeader + 1)];
  const int64_t L = h.num_local_experts, H = h.hidden;
  const int64_t R = detail::rows_of_rank(h, me);
  h.num_recv_tokens = R;
  h.num_tokens_per_expert = Tensor::empty({L}, DType::int64);
  // Without padding the unpadded counts are the counts: one tensor (read-only) for both.
  h.num_unpadded_tokens_per_expert =
      padded ? Tensor::empty({L}, DType::int64) : h.num_tokens_per_expert;
  h.expert_offsets = Tensor::empty({L + 1}, DType::int64);
  {
    int64_t* n = h.num_tokens_per_expert.data<int64_t>();
    int64_t* u = h.num_unpadded_tokens_per_expert.data<int64_t>();
    int64_t* o = h.expert_offsets.data<int64_t>();
    o[0] = 0;
    for (int64_t el = 0; el < L; ++el) {
      int64_t rows = 0, pairs = 0;
      for (int64_t s = 0; s < P; ++s) {
        rows += detail::rows_at(h, s, me * L + el);
        pairs += count_at(h, s, me * L + el);
      }
      n[el] = rows;
      u[el] = pairs;  // == rows when u and n are one tensor
      o[el + 1] = o[el] + rows;
    }
  }
  h.recv_src_rank = Tensor::empty({R}, DType::int32);
  h.recv_src_token = Tensor::empty({R}, DType::int64);
  h.recv_topk_weights = Tensor::empty({R}, DType::fp32);
  h.recv_gather_index = Tensor::empty({R}, DType::int64);
  h.layout_id = detail::layout_id(h);
  out.recv_x = Tensor::empty({R, H}, x.dtype());
  const int64_t rb = row_bytes(H, x.dtype());
  if (options.kind == DispatcherKind::all_to_all) {
    detail::all_to_all::dispatch(x.raw(), rb, out.recv_x.raw(), h, *scratch_, comm);
  } else {
    detail::all_gather::fill_handle(h, topk_idx, topk_weights, options.plan, *scratch_, comm);
    detail::all_gather::send_rows(x.raw(), rb, out.recv_x.raw(), h, *scratch_, comm);
  }
  out.recv_topk_weights = h.recv_topk_weights;
  return out;
}

namespace {

void send_rows(const void* src, int64_t rb, void* dst, const HandleState& h, Scratch& s,
               Communicator& comm) {
  if (h.kind == DispatcherKind::all_to_all) {
    detail::all_to_all::send_rows(src, rb, dst, h, s, comm);
  } else {
    detail::all_gather::send_rows(src, rb, dst, h, s, comm);
  }
}

void return_rows(const void* src, int64_t rb, void* dst, const HandleState& h, Scratch& s,
                 Communicator& comm) {
  if (h.kind == DispatcherKind::all_to_all) {
    detail::all_to_all::return_rows(src, rb, dst, h, s, comm);
  } else {
    detail::all_gather::return_rows(src, rb, dst, h, s, comm);
  }
}

}  // namespace

namespace {

// The expert side as a plan over the received rows, in scratch memory (built when a backward
// needs it, so dispatch allocates nothing for it): row i is "token" i with one slot, routed to
// its local expert, weight recv_topk_weights[i]; a padding row is a token without a row (row
// token and slot -1), so unpermute's backward gives it zeros.
RoutingPlan recv_plan(const HandleState& h, Scratch& scratch) {
  const int64_t R = h.num_recv_tokens, L = h.num_local_experts;
  RoutingPlan p;
  p.num_tokens = R;
  p.num_experts = L;
  p.top_k = 1;
  p.num_rows = R;
  p.num_tokens_per_expert = h.num_unpadded_tokens_per_expert;
  p.expert_offsets = h.expert_offsets;
  p.row_weight = h.recv_topk_weights;
  int64_t* to = scratch.get<int64_t>(Scratch::recv_index, 3 * R + 1);
  int64_t* rt = to + R + 1;
  int64_t* tr = rt + R;
  int32_t* re = scratch.get<int32_t>(Scratch::recv_expert, R);
  const int32_t* src = h.recv_src_rank.data<int32_t>();
  const int64_t* off = h.expert_offsets.data<int64_t>();
  to[0] = 0;
  int64_t n = 0;
  for (int64_t el = 0; el < L; ++el) {
    for (int64_t i = off[el]; i < off[el + 1]; ++i) {
      re[i] = static_cast<int32_t>(el);
      rt[i] = src[i] < 0 ? -1 : i;
      if (rt[i] >= 0) tr[n++] = i;
      to[i + 1] = n;
    }
  }
  p.num_pairs = n;
  p.token_offsets = Tensor::borrow(to, {R + 1}, DType::int64);
  p.row_token = Tensor::borrow(rt, {R}, DType::int64);
  p.slot_row = Tensor::borrow(rt, {R, 1}, DType::int64);
  p.token_rows = Tensor::borrow(tr, {n}, DType::int64);
  p.row_expert = Tensor::borrow(re, {R}, DType::int32);
  return p;
}

}  // namespace

// `name`: the caller's name of expert_y, for messages ("expert_y", "grad_recv_x").
Tensor Dispatcher::combine_impl(const char* op, const char* name, const Tensor& expert_y,
                                const HandleState& h, WeightMode weights) {
  Communicator& comm = *comm_;
  const Communicator::Exclusive busy(comm, op);
  std::string err;
  try {
    // Inside the agreement: a bad handle on one rank raises on every rank instead of leaving
    // the others waiting in the exchange.
    detail::check_handle(op, h, comm);
    check_defined(expert_y, op, name);
    check_dtype(expert_y, op, name, {DType::fp32, DType::bf16});
    check_device(expert_y, op, name, kCpu);
    check_shape(expert_y, op, name, {h.num_recv_tokens, h.hidden});
    switchyard::detail::check_finite(expert_y, op, name, "row", "hidden");
  } catch (const std::invalid_argument& e) {
    err = e.what();
  }
  detail::agree(op, err, err.empty() ? expert_y.dtype() : DType::fp32, name, weights, h.layout_id,
                comm);
  const DType dt = expert_y.dtype();
  // The returned rows are scratch (reused step after step); only y is a fresh result.
  const int64_t rb = row_bytes(h.hidden, dt);
  Tensor rows = Tensor::borrow(scratch_->get(Scratch::rows, h.plan.num_rows * rb),
                               {h.plan.num_rows, h.hidden}, dt);
  return_rows(expert_y.raw(), rb, rows.raw(), h, *scratch_, comm);
  return unpermute(rows, h.plan, UnpermuteOptions{weights});
}

Tensor Dispatcher::combine(const Tensor& expert_y, const DispatchHandle& handle,
                           WeightMode weights) {
  return combine_impl("combine", "expert_y", expert_y, detail::state(handle), weights);
}

Tensor Dispatcher::dispatch_backward(const Tensor& grad_recv_x, const DispatchHandle& handle) {
  return combine_impl("dispatch_backward", "grad_recv_x", grad_recv_x, detail::state(handle),
                      WeightMode::skip);
}

Tensor Dispatcher::dispatch_weights_backward(const Tensor& grad_recv_topk_weights,
                                             const DispatchHandle& handle) {
  const HandleState& h = detail::state(handle);
  const char* op = "dispatch_weights_backward";
  const char* name = "grad_recv_topk_weights";
  Communicator& comm = *comm_;
  const Communicator::Exclusive busy(comm, op);
  std::string err;
  try {
    detail::check_handle(op, h, comm);
    check_dtype(grad_recv_topk_weights, op, name, {DType::fp32});
    check_device(grad_recv_topk_weights, op, name, kCpu);
    check_shape(grad_recv_topk_weights, op, name, {h.num_recv_tokens});
  } catch (const std::invalid_argument& e) {
    err = e.what();
  }
  detail::agree(op, err, DType::fp32, name, WeightMode::apply, h.layout_id, comm);
  // Each received row's gradient goes back to its plan row (the same move as combine's, one
  // fp32 per row), then to every slot of that pair.
  Tensor plan_grad = Tensor::borrow(scratch_->get<float>(Scratch::floats_back, h.plan.num_rows),
                                    {h.plan.num_rows}, DType::fp32);
  return_rows(grad_recv_topk_weights.raw(), sizeof(float), plan_grad.raw(), h, *scratch_, comm);
  return rows_to_slots(plan_grad, h.plan);
}

CombineGrads Dispatcher::combine_backward(const Tensor& grad_y, const Tensor& expert_y,
                                          const DispatchHandle& handle, WeightMode weights) {
  const HandleState& h = detail::state(handle);
  const char* op = "combine_backward";
  Communicator& comm = *comm_;
  const Communicator::Exclusive busy(comm, op);
  const bool apply = weights == WeightMode::apply;
  std::string err;
  try {
    detail::check_handle(op, h, comm);
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
  detail::agree(op, err, err.empty() ? grad_y.dtype() : DType::fp32, "grad_y", weights, h.layout_id,
                comm);
  const DType dt = grad_y.dtype();
  const int64_t R = h.num_recv_tokens, H = h.hidden, rb = row_bytes(H, dt);
  // Dispatch of grad_y; with weights it is an intermediate (scratch), without it is the result.
  Tensor g_recv = apply ? Tensor::borrow(scratch_->get(Scratch::grad, R * rb), {R, H}, dt)
                        : Tensor::empty({R, H}, dt);
  send_rows(grad_y.raw(), rb, g_recv.raw(), h, *scratch_, comm);
  CombineGrads out;
  if (!apply) {
    out.grad_expert_y = g_recv;
    out.grad_topk_weights = Tensor::zeros({h.num_tokens, h.plan.top_k}, DType::fp32);
    return out;
  }
  // The expert side is unpermute's backward on the received rows: grad_expert_y = w * g and the
  // per-row dots <expert_y, g>, which go back to the source rows and then to the slots.
  UnpermuteGrads u =
      unpermute_backward(g_recv, expert_y, recv_plan(h, *scratch_), UnpermuteOptions{weights});
  out.grad_expert_y = std::move(u.grad_permuted);
  Tensor plan_dots = Tensor::borrow(scratch_->get<float>(Scratch::floats_back, h.plan.num_rows),
                                    {h.plan.num_rows}, DType::fp32);
  return_rows(u.grad_topk_weights.raw(), sizeof(float), plan_dots.raw(), h, *scratch_, comm);
  out.grad_topk_weights = rows_to_slots(plan_dots, h.plan);
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
    detail::agree("combine", err, DType::fp32, "expert_y", WeightMode::apply, 0, comm);
  }
  throw std::logic_error("[fail_collective] the agreement did not raise");  // not reached
}

}  // namespace switchyard::dist
