// The all_to_all dispatcher: each (token, expert) pair goes to its expert's rank only. Token rows
// are gathered once in plan order (this rank's own experts straight into recv_x), and every
// (expert, peer) block moves point-to-point straight into its place in the receive layout, and
// back the same way: no unpack on either side. Row metadata (token, weight) travels in its own
// small alltoallv.
#include <cstring>

#include "cpu/permute_kernels.h"
#include "dispatcher_common.h"

namespace switchyard::dist::detail::all_to_all {

namespace {

// All-to-all counts of this rank's metadata: plan rows (padding included) it sends to each rank
// and receives from each rank.
void a2a_counts(const DispatchHandle& h, std::vector<int64_t>& send, std::vector<int64_t>& recv) {
  const int64_t P = h.world_size, L = h.num_local_experts, me = h.rank;
  send.assign(static_cast<size_t>(P), 0);
  recv.assign(static_cast<size_t>(P), 0);
  for (int64_t r = 0; r < P; ++r)
    for (int64_t el = 0; el < L; ++el) {
      send[static_cast<size_t>(r)] += rows_at(h, me, r * L + el);
      recv[static_cast<size_t>(r)] += rows_at(h, r, me * L + el);
    }
}

// This rank's plan rows as blocks: for every peer r and its local expert el (ascending), the real
// rows of expert r*L+el (its block's first rows; padding is never sent), exchanged with r. Empty
// blocks are left out (both sides skip them), so the work per call follows the pairs, not E.
void plan_blocks(const DispatchHandle& h, std::vector<Communicator::Block>& out) {
  const int64_t P = h.world_size, L = h.num_local_experts;
  const int64_t* off = h.plan.expert_offsets.data<int64_t>();
  out.clear();
  for (int64_t r = 0; r < P; ++r)
    for (int64_t el = 0; el < L; ++el) {
      const int64_t e = r * L + el, n = count_at(h, h.rank, e);
      if (n > 0) out.push_back({static_cast<int>(r), off[e], n});
    }
}

// This rank's receive layout as blocks: for every source s and local expert el (ascending), the
// real rows of (el, s), exchanged with s. Per peer, the same order as that peer's plan_blocks.
void expert_blocks(const DispatchHandle& h, std::vector<Communicator::Block>& out) {
  const int64_t P = h.world_size, L = h.num_local_experts;
  const auto boff = block_offsets(h);
  out.clear();
  for (int64_t s = 0; s < P; ++s)
    for (int64_t el = 0; el < L; ++el) {
      const int64_t e = h.rank * L + el;
      const int64_t n = count_at(h, s, e);
      if (n > 0) out.push_back({static_cast<int>(s), boff[static_cast<size_t>(e * P + s)], n});
    }
}

bool padded_layout(const DispatchHandle& h) { return h.rank_expert_rows != h.rank_expert_counts; }

}  // namespace

void fill_handle(DispatchHandle& h, Scratch& scratch, Communicator& comm) {
  const int64_t P = h.world_size, L = h.num_local_experts, me = h.rank, R = h.num_recv_tokens;
  int32_t* src_rank = h.recv_src_rank.data<int32_t>();
  int64_t* src_token = h.recv_src_token.data<int64_t>();
  float* recv_w = h.recv_topk_weights.data<float>();
  int64_t* gi = h.recv_gather_index.data<int64_t>();
  const auto boff = block_offsets(h);
  std::vector<int64_t> send, recv;
  a2a_counts(h, send, recv);
  // Block (local expert el, source s) arrives inside s's chunk of the metadata exchange, after
  // s's rows for the lower local experts.
  std::vector<int64_t> chunk(static_cast<size_t>(P + 1), 0);
  for (int64_t s = 0; s < P; ++s) chunk[s + 1] = chunk[s] + recv[s];
  for (int64_t s = 0; s < P; ++s) {
    int64_t st = chunk[s];
    for (int64_t el = 0; el < L; ++el) {
      // The whole block, padding included (the metadata of padding rows says token -1).
      const int64_t e = me * L + el, n = rows_at(h, s, e), o = boff[static_cast<size_t>(e * P + s)];
      for (int64_t j = 0; j < n; ++j) {
        gi[o + j] = st + j;
        src_rank[o + j] = static_cast<int32_t>(s);
      }
      st += n;
    }
  }
  const int64_t np = h.plan.num_rows;
  RowMeta* send_meta = scratch.get<RowMeta>(Scratch::meta_send, np);
  RowMeta* recv_meta = scratch.get<RowMeta>(Scratch::meta_recv, R);
  const int64_t* rt = h.plan.row_token.data<int64_t>();
  const float* rw = h.plan.row_weight.data<float>();
  for (int64_t p = 0; p < np; ++p) send_meta[p] = {rt[p], rw[p], 0};
  comm.alltoallv(send_meta, send, recv_meta, recv, sizeof(RowMeta));
  for (int64_t i = 0; i < R; ++i) {
    const RowMeta& m = recv_meta[gi[i]];
    src_token[i] = m.token;
    recv_w[i] = m.weight;  // 0 for padding
    if (m.token < 0) src_rank[i] = -1;
  }
}

void send_rows(const void* src, int64_t rb, void* dst, const DispatchHandle& h, Scratch& scratch,
               Communicator& comm) {
  // Rows for this rank's own experts skip the pack: they are gathered from `src` straight into
  // their receive-layout place (at EP=2 that is half of the rows, one copy instead of two).
  const int64_t P = h.world_size, L = h.num_local_experts, me = h.rank;
  const int64_t* off = h.plan.expert_offsets.data<int64_t>();
  const int64_t* rt = h.plan.row_token.data<int64_t>();
  const int64_t self_begin = off[me * L], self_end = off[(me + 1) * L];
  auto* pk = static_cast<unsigned char*>(scratch.get(Scratch::pack, h.plan.num_rows * rb));
  const bool padded = h.plan.num_rows != h.plan.num_pairs;
  if (!padded) {
    cpu::gather_rows(src, rt, self_begin, rb, pk);
    cpu::gather_rows(src, rt + self_end, h.plan.num_rows - self_end, rb, pk + self_end * rb);
  } else {
    // Only the real rows of each expert's block travel.
    for (int64_t e = 0; e < h.num_experts; ++e) {
      const int64_t n = count_at(h, me, e);
      if (n > 0 && (e < me * L || e >= (me + 1) * L))
        cpu::gather_rows(src, rt + off[e], n, rb, pk + off[e] * rb);
    }
  }
  const auto boff = block_offsets(h);
  auto* out = static_cast<unsigned char*>(dst);
  for (int64_t el = 0; el < L; ++el) {
    const int64_t e = me * L + el, n = count_at(h, me, e);
    if (n == 0) continue;  // a parallel region per empty expert cost 1 µs each
    cpu::gather_rows(src, rt + off[e], n, rb, out + boff[static_cast<size_t>(e * P + me)] * rb);
  }
  // Padding rows of the receive layout are zero rows.
  for (int64_t el = 0; padded_layout(h) && el < L; ++el) {
    const int64_t e = me * L + el;
    for (int64_t s = 0; s < P; ++s) {
      const int64_t o = boff[static_cast<size_t>(e * P + s)], n = count_at(h, s, e);
      const int64_t pad = rows_at(h, s, e) - n;
      if (pad > 0) std::memset(out + (o + n) * rb, 0, static_cast<size_t>(pad * rb));
    }
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
  comm.exchange_blocks(pk, send, dst, recv, rb);
}

void return_rows(const void* src, int64_t rb, void* dst, const DispatchHandle& h, Scratch&,
                 Communicator& comm) {
  // Each (local expert, source) block of the receive layout goes back as one message, straight
  // into the source's plan rows: no packing on either side.
  std::vector<Communicator::Block> send, recv;
  expert_blocks(h, send);
  plan_blocks(h, recv);
  comm.exchange_blocks(src, send, dst, recv, rb);
}

}  // namespace switchyard::dist::detail::all_to_all
