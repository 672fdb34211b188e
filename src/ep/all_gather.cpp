// The all_gather dispatcher: every rank gathers every rank's tokens and routes, rebuilds each
// source's (deterministic) plan and keeps its own experts' rows; combine gathers every expert
// output row back and each rank sums its own tokens. EP times the traffic of all_to_all by
// construction; it exists for parity with Megatron-Core's AllGather dispatcher and as a
// cross-check (bitwise equal to all_to_all), not for speed.
#include "backend/backend.h"
#include "dispatcher_common.h"

namespace switchyard::dist::detail::all_gather {

namespace {

// Source side: for each row p of this rank's plan, its row in the buffer of every rank's expert
// outputs gathered in rank order.
void plan_rows_in_gathered(const HandleState& h, int64_t* map) {
  // Walks every owner's receive layout in its order (no [E x EP] table of them): `run` is the
  // gathered buffer's row where block (expert e, source s) starts.
  const int64_t P = h.world_size;
  const int64_t* off = h.plan.expert_offsets.data<int64_t>();
  int64_t run = 0;
  for (int64_t e = 0; e < h.num_experts; ++e) {
    for (int64_t s = 0; s < P; ++s) {
      if (s == h.rank) {
        for (int64_t p = off[e]; p < off[e + 1]; ++p) map[p] = run + (p - off[e]);  // pads unread
      }
      run += rows_at(h, s, e);
    }
  }
}

int64_t total(const std::vector<int64_t>& v) {
  int64_t n = 0;
  for (int64_t x : v) n += x;
  return n;
}

}  // namespace

void fill_handle(HandleState& h, const Tensor& topk_idx, const Tensor& topk_weights,
                 const RoutingPlanOptions& plan_options, Scratch& scratch, Communicator& comm) {
  const int64_t P = h.world_size, L = h.num_local_experts, me = h.rank, E = h.num_experts;
  const int64_t K = topk_idx.size(1), N = total(h.rank_num_tokens);
  int32_t* src_rank = h.recv_src_rank.data<int32_t>();
  int64_t* src_token = h.recv_src_token.data<int64_t>();
  float* recv_w = h.recv_topk_weights.data<float>();
  int64_t* gi = h.recv_gather_index.data<int64_t>();
  // This rank's receive layout: block (local expert el, source s) starts at boff[el * P + s].
  std::vector<int64_t> boff(static_cast<size_t>(L * P));
  for_each_recv_block(
      h, [&](int64_t el, int64_t s, int64_t o) { boff[static_cast<size_t>(el * P + s)] = o; });
  auto* routes = static_cast<unsigned char*>(scratch.get(Scratch::routes, N * K * 8));
  auto* all_idx = reinterpret_cast<int32_t*>(routes);
  auto* all_w = reinterpret_cast<float*>(routes + N * K * 4);
  comm.allgatherv(topk_idx.raw(), h.num_tokens, all_idx, h.rank_num_tokens,
                  K * static_cast<int64_t>(sizeof(int32_t)));
  comm.allgatherv(topk_weights.raw(), h.num_tokens, all_w, h.rank_num_tokens,
                  K * static_cast<int64_t>(sizeof(float)));
  int64_t tok_off = 0;
  for (int64_t s = 0; s < P; ++s) {
    const int64_t Ts = h.rank_num_tokens[static_cast<size_t>(s)];
    RoutingPlan ps =
        s == me ? h.plan
                : build_routing_plan(Tensor::borrow(all_idx + tok_off * K, {Ts, K}, DType::int32),
                                     Tensor::borrow(all_w + tok_off * K, {Ts, K}, DType::fp32), E,
                                     plan_options);
    const int64_t* rt = ps.row_token.data<int64_t>();
    const float* rw = ps.row_weight.data<float>();
    const int64_t* off = ps.expert_offsets.data<int64_t>();
    for (int64_t el = 0; el < L; ++el) {
      const int64_t e = me * L + el, o = boff[static_cast<size_t>(el * P + s)];
      // The source's whole block, padding included (row token -1, weight 0: a zero row).
      for (int64_t j = 0; j < off[e + 1] - off[e]; ++j) {
        const int64_t t = rt[off[e] + j];
        gi[o + j] = t < 0 ? -1 : tok_off + t;
        src_rank[o + j] = t < 0 ? -1 : static_cast<int32_t>(s);
        src_token[o + j] = t;
        recv_w[o + j] = rw[off[e] + j];
      }
    }
    tok_off += Ts;
  }
}

void send_rows(const void* src, int64_t rb, void* dst, const HandleState& h, Scratch& scratch,
               Communicator& comm) {
  void* all = scratch.get(Scratch::staging, total(h.rank_num_tokens) * rb);
  comm.allgatherv(src, h.num_tokens, all, h.rank_num_tokens, rb);
  backend::gather_rows(kHost, all, h.recv_gather_index.data<int64_t>(), h.num_recv_tokens, rb, dst);
}

void return_rows(const void* src, int64_t rb, void* dst, const HandleState& h, Scratch& scratch,
                 Communicator& comm) {
  const auto per_rank = rows_per_rank(h);
  void* all = scratch.get(Scratch::staging, total(per_rank) * rb);
  comm.allgatherv(src, h.num_recv_tokens, all, per_rank, rb);
  // The map lives in the routes buffer (free again once the handle is built).
  int64_t* map = scratch.get<int64_t>(Scratch::routes, h.plan.num_rows);
  plan_rows_in_gathered(h, map);
  backend::gather_rows(kHost, all, map, h.plan.num_rows, rb, dst);
}

}  // namespace switchyard::dist::detail::all_gather
