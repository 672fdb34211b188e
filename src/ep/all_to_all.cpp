// The all_to_all dispatcher: each (token, expert) pair goes to its expert's rank only. Token rows
// are gathered once in plan order (this rank's own experts straight into recv_x), and every
// (expert, peer) block moves point-to-point straight into its place in the receive layout, and
// back the same way: no unpack on either side. Row metadata (token, weight) travels in the same
// round, as a second plane of blocks.
#include <cstring>

#include "backend/backend.h"
#include "dispatcher_common.h"

namespace switchyard::dist::detail::all_to_all {

namespace {

// This rank's plan rows as blocks: for every peer r and its local expert el (ascending), the real
// rows of expert r*L+el (its block's first rows; padding is never sent), exchanged with r. Empty
// blocks are left out (both sides skip them), so the work per call follows the pairs, not E.
void plan_blocks(const HandleState& h, std::vector<Communicator::Block>& out) {
  const int64_t P = h.world_size, L = h.num_local_experts;
  const int64_t* off = h.plan.expert_offsets.data<int64_t>();
  out.clear();
  for (int64_t r = 0; r < P; ++r)
    for (int64_t el = 0; el < L; ++el) {
      const int64_t e = r * L + el, n = count_at(h, h.rank, e);
      if (n > 0) out.push_back({static_cast<int>(r), off[e], n});
    }
}

// This rank's receive layout as blocks: for every local expert el (ascending) and source s, the
// real rows of (el, s), exchanged with s. Per peer, the same order as that peer's plan_blocks
// (blocks are matched per peer, in list order).
void expert_blocks(const HandleState& h, std::vector<Communicator::Block>& out) {
  const int64_t L = h.num_local_experts;
  out.clear();
  for_each_recv_block(h, [&](int64_t el, int64_t s, int64_t o) {
    const int64_t n = count_at(h, s, h.rank * L + el);
    if (n > 0) out.push_back({static_cast<int>(s), o, n});
  });
}

}  // namespace

namespace {

// Gathers the token rows of this rank's plan: rows for its own experts straight into their
// receive-layout place in `dst` (at EP=2 that is half of the rows, one copy instead of two), the
// others into the pack buffer in plan order; zero-fills the receive layout's padding rows; fills
// the blocks that still have to travel. Returns the pack buffer.
const unsigned char* gather_for_peers(const void* src, int64_t rb, void* dst, const HandleState& h,
                                      Scratch& scratch, std::vector<Communicator::Block>& send,
                                      std::vector<Communicator::Block>& recv) {
  const int64_t L = h.num_local_experts, me = h.rank;
  const int64_t* off = h.plan.expert_offsets.data<int64_t>();
  const int64_t* rt = h.plan.row_token.data<int64_t>();
  const int64_t self_begin = off[me * L], self_end = off[(me + 1) * L];
  auto* pk = static_cast<unsigned char*>(scratch.get(Scratch::pack, h.plan.num_rows * rb));
  if (h.plan.num_rows == h.plan.num_pairs) {
    backend::gather_rows(kHost, src, rt, self_begin, rb, pk);
    backend::gather_rows(kHost, src, rt + self_end, h.plan.num_rows - self_end, rb,
                         pk + self_end * rb);
  } else {
    // Only the real rows of each expert's block travel.
    for (int64_t e = 0; e < h.num_experts; ++e) {
      const int64_t n = count_at(h, me, e);
      if (n > 0 && (e < me * L || e >= (me + 1) * L))
        backend::gather_rows(kHost, src, rt + off[e], n, rb, pk + off[e] * rb);
    }
  }
  auto* out = static_cast<unsigned char*>(dst);
  for_each_recv_block(h, [&](int64_t el, int64_t s, int64_t o) {
    const int64_t e = me * L + el, n = count_at(h, s, e);
    // This rank's own rows (a parallel region per empty expert cost 1 µs each: skipped).
    if (s == me && n > 0) backend::gather_rows(kHost, src, rt + off[e], n, rb, out + o * rb);
    // Padding rows of the receive layout are zero rows.
    const int64_t pad = rows_at(h, s, e) - n;
    if (pad > 0) std::memset(out + (o + n) * rb, 0, static_cast<size_t>(pad * rb));
  });
  plan_blocks(h, send);
  expert_blocks(h, recv);
  for (auto& b : send) {
    if (b.peer == me) b.rows = 0;  // already in place
  }
  for (auto& b : recv) {
    if (b.peer == me) b.rows = 0;
  }
  return pk;
}

}  // namespace

void dispatch(const void* x, int64_t rb, void* recv_x, HandleState& h, Scratch& scratch,
              Communicator& comm) {
  const int64_t P = h.world_size, L = h.num_local_experts, me = h.rank, R = h.num_recv_tokens;
  int32_t* src_rank = h.recv_src_rank.data<int32_t>();
  int64_t* src_token = h.recv_src_token.data<int64_t>();
  float* recv_w = h.recv_topk_weights.data<float>();
  int64_t* gi = h.recv_gather_index.data<int64_t>();
  // Row metadata (token, weight) travels in the same round as the rows, as its own plane: whole
  // blocks, padding included (the metadata of a padding row says token -1, weight 0), from the
  // plan's rows straight into the receive layout.
  const int64_t np = h.plan.num_rows;
  RowMeta* send_meta = scratch.get<RowMeta>(Scratch::meta_send, np);
  RowMeta* recv_meta = scratch.get<RowMeta>(Scratch::meta_recv, R);
  const int64_t* rt = h.plan.row_token.data<int64_t>();
  const float* rw = h.plan.row_weight.data<float>();
  for (int64_t p = 0; p < np; ++p) send_meta[p] = {rt[p], rw[p], 0};
  const int64_t* off = h.plan.expert_offsets.data<int64_t>();
  std::vector<Communicator::Block> meta_send, meta_recv;
  for (int64_t r = 0; r < P; ++r)
    for (int64_t el = 0; el < L; ++el) {
      const int64_t e = r * L + el;
      if (off[e + 1] > off[e])
        meta_send.push_back({static_cast<int>(r), off[e], off[e + 1] - off[e]});
    }
  for_each_recv_block(h, [&](int64_t el, int64_t s, int64_t o) {
    const int64_t n = rows_at(h, s, me * L + el);
    if (n > 0) meta_recv.push_back({static_cast<int>(s), o, n});
    for (int64_t j = 0; j < n; ++j) src_rank[o + j] = static_cast<int32_t>(s);
  });
  std::vector<Communicator::Block> send, recv;
  const unsigned char* pk = gather_for_peers(x, rb, recv_x, h, scratch, send, recv);
  const Communicator::Plane planes[2] = {
      {pk, &send, recv_x, &recv, rb},
      {send_meta, &meta_send, recv_meta, &meta_recv, static_cast<int64_t>(sizeof(RowMeta))}};
  comm.exchange_planes(planes, 2);
  for (int64_t i = 0; i < R; ++i) {
    gi[i] = i;
    src_token[i] = recv_meta[i].token;
    recv_w[i] = recv_meta[i].weight;  // 0 for padding
    if (recv_meta[i].token < 0) src_rank[i] = -1;
  }
}

void send_rows(const void* src, int64_t rb, void* dst, const HandleState& h, Scratch& scratch,
               Communicator& comm) {
  std::vector<Communicator::Block> send, recv;
  const unsigned char* pk = gather_for_peers(src, rb, dst, h, scratch, send, recv);
  comm.exchange_blocks(pk, send, dst, recv, rb);
}

void return_rows(const void* src, int64_t rb, void* dst, const HandleState& h, Scratch&,
                 Communicator& comm) {
  // Each (local expert, source) block of the receive layout goes back as one message, straight
  // into the source's plan rows: no packing on either side.
  std::vector<Communicator::Block> send, recv;
  expert_blocks(h, send);
  plan_blocks(h, recv);
  comm.exchange_blocks(src, send, dst, recv, rb);
}

}  // namespace switchyard::dist::detail::all_to_all
