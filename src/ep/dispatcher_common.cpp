#include "dispatcher_common.h"

#include <algorithm>
#include <stdexcept>

#include "check.h"
#include "core/allocator.h"

namespace switchyard::dist::detail {

void* Scratch::get(Use use, int64_t bytes) {
  Block& b = blocks_[use];
  if (bytes > b.size || !b.data) {
    // Grow with headroom: routes change every step, and a buffer that grows by a few rows each
    // step would be freshly faulted each step.
    const int64_t size = std::max<int64_t>({bytes + bytes / 8, b.size, 4096});
    b.data.reset();
    b.data = std::unique_ptr<void, HostFree>(switchyard::detail::allocate(static_cast<size_t>(size)),
                                             HostFree{static_cast<size_t>(size)});
    b.size = size;
  }
  return b.data.get();
}

void HostFree::operator()(void* p) const noexcept {
  switchyard::detail::deallocate(p, bytes);
}

int64_t Scratch::bytes() const {
  int64_t n = 0;
  for (const Block& b : blocks_) n += b.size;
  return n;
}

void check_handle(const char* op, const HandleState& h, const Communicator& comm) {
  if (h.world_size != comm.size() || h.rank != comm.rank() || !h.plan.row_token.defined() ||
      !h.recv_src_rank.defined()) {
    switchyard::detail::fail_arg(op, "handle must come from dispatch on this communicator (rank ",
                                 comm.rank(), " of ", comm.size(), "), got a handle for rank ",
                                 h.rank, " of ", h.world_size);
  }
}

void agree(const char* op, const std::string& local_error, DType dtype, const char* what,
           WeightMode mode, uint64_t layout, Communicator& comm) {
  constexpr size_t kFields = 4;
  const std::vector<int64_t> mine = {static_cast<int64_t>(local_error.size()),
                                     static_cast<int64_t>(dtype), static_cast<int64_t>(mode),
                                     static_cast<int64_t>(layout)};
  const std::vector<int64_t> all = comm.allgather(mine);
  const size_t P = static_cast<size_t>(comm.size());
  std::vector<int64_t> lens(P);
  for (size_t r = 0; r < P; ++r) lens[r] = all[kFields * r];
  raise_if_any(op, local_error, lens, comm);
  auto mode_name = [](int64_t m) { return m == 0 ? "apply" : "skip"; };
  for (size_t r = 1; r < P; ++r) {
    if (all[kFields * r + 3] != all[3]) {
      switchyard::detail::fail_arg(
          op,
          "handle must come from the same dispatch call on every rank, got handles of "
          "different dispatches on rank 0 and rank ",
          r, " (their count matrices differ)");
    }
    if (all[kFields * r + 1] != all[1]) {
      switchyard::detail::fail_arg(op, what, " must have the same dtype on every rank, got ",
                                   dtype_name(static_cast<DType>(all[1])), " on rank 0 and ",
                                   dtype_name(static_cast<DType>(all[kFields * r + 1])),
                                   " on rank ", r);
    }
    if (all[kFields * r + 2] != all[2]) {
      switchyard::detail::fail_arg(op, "weights must be the same on every rank, got ",
                                   mode_name(all[2]), " on rank 0 and ",
                                   mode_name(all[kFields * r + 2]), " on rank ", r);
    }
  }
}

uint64_t layout_id(const HandleState& h) {
  // FNV-1a-style over the fields every rank shares, a word at a time (the count matrices hold
  // EP * E words: byte-wise it cost 0.3 s at E = 2^24); the top bit is cleared so the id survives
  // the int64 exchange unchanged. Only compared between ranks of one build.
  uint64_t x = 1469598103934665603ull;
  auto mix = [&](int64_t v) {
    x ^= static_cast<uint64_t>(v);
    x *= 1099511628211ull;
    x ^= x >> 29;
  };
  mix(static_cast<int64_t>(h.kind));
  mix(h.world_size);
  mix(h.hidden);
  mix(h.num_experts);
  for (int64_t v : h.rank_num_tokens) mix(v);
  for (int64_t v : h.rank_expert_counts) mix(v);
  mix(static_cast<int64_t>(h.rank_expert_rows.size()));
  for (int64_t v : h.rank_expert_rows) mix(v);
  return x & 0x7fffffffffffffffull;
}

int64_t rows_of_rank(const HandleState& h, int64_t r) {
  const int64_t P = h.world_size, L = h.num_local_experts;
  int64_t rows = 0;
  for (int64_t s = 0; s < P; ++s)
    for (int64_t e = r * L; e < (r + 1) * L; ++e) rows += rows_at(h, s, e);
  return rows;
}

std::vector<int64_t> rows_per_rank(const HandleState& h) {
  const int64_t P = h.world_size, E = h.num_experts, L = h.num_local_experts;
  std::vector<int64_t> rows(static_cast<size_t>(P), 0);
  for (int64_t s = 0; s < P; ++s)
    for (int64_t e = 0; e < E; ++e) rows[static_cast<size_t>(e / L)] += rows_at(h, s, e);
  return rows;
}

}  // namespace switchyard::dist::detail
