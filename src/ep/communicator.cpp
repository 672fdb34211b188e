// The size-1 local communicator: every collective is a copy (or nothing). Always built.
#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "check.h"
#include "switchyard/dist.h"

namespace switchyard::dist {

Communicator::Exclusive::Exclusive(Communicator& comm, const char* op) : comm_(comm) {
  const char* expected = nullptr;
  if (!comm.holder_.compare_exchange_strong(expected, op, std::memory_order_acquire)) {
    throw std::logic_error(detail::cat(
        "[", op, "] the ", comm.name(), " communicator (rank ", comm.rank(), " of ", comm.size(),
        ") is in use by another thread (", expected ? expected : "?",
        "); a communicator and the dispatchers on it serve one thread at a time: give each thread "
        "its own communicator"));
  }
}

Communicator::Exclusive::~Exclusive() { comm_.holder_.store(nullptr, std::memory_order_release); }

namespace {

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "local"; }

  void allgather(const void* send, void* recv, int64_t count, int64_t elem_bytes) override {
    copy(send, recv, count * elem_bytes);
  }
  void allgatherv(const void* send, int64_t send_count, void* recv,
                  const std::vector<int64_t>& recv_counts, int64_t elem_bytes) override {
    check_counts("allgatherv", "recv_counts", recv_counts, send_count);
    copy(send, recv, send_count * elem_bytes);
  }
  void alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                 const std::vector<int64_t>& recv_counts, int64_t elem_bytes) override {
    if (send_counts.size() != 1) {
      detail::fail_arg("local.alltoallv", "send_counts must have 1 entry, got ",
                       send_counts.size());
    }
    check_counts("alltoallv", "recv_counts", recv_counts, send_counts[0]);
    copy(send, recv, send_counts[0] * elem_bytes);
  }
  void exchange_planes(const Plane* planes, int num_planes) override {
    for (int p = 0; p < num_planes; ++p) {
      exchange_one(planes[p].send, *planes[p].send_blocks, planes[p].recv, *planes[p].recv_blocks,
                   planes[p].row_bytes);
    }
  }

 private:
  static void exchange_one(const void* send, const std::vector<Block>& send_blocks, void* recv,
                           const std::vector<Block>& recv_blocks, int64_t row_bytes) {
    std::vector<Block> sb, rb;
    for (const Block& b : send_blocks) {
      if (b.rows > 0) sb.push_back(b);
    }
    for (const Block& b : recv_blocks) {
      if (b.rows > 0) rb.push_back(b);
    }
    if (sb.size() != rb.size()) {
      detail::fail_arg("local.exchange_blocks", "send and receive blocks must match, got ",
                       sb.size(), " non-empty send blocks and ", rb.size(), " receive blocks");
    }
    for (size_t i = 0; i < sb.size(); ++i) {
      if (sb[i].peer != 0 || rb[i].peer != 0 || sb[i].rows != rb[i].rows) {
        detail::fail_arg("local.exchange_blocks", "block ", i, " does not match: send ", sb[i].rows,
                         " rows to peer ", sb[i].peer, ", receive ", rb[i].rows, " rows from peer ",
                         rb[i].peer);
      }
    }
    const auto* s = static_cast<const unsigned char*>(send);
    auto* d = static_cast<unsigned char*>(recv);
    const int64_t n = static_cast<int64_t>(sb.size());
#pragma omp parallel for schedule(dynamic) if (n > 1)
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(d + rb[static_cast<size_t>(i)].offset * row_bytes,
                  s + sb[static_cast<size_t>(i)].offset * row_bytes,
                  static_cast<size_t>(sb[static_cast<size_t>(i)].rows * row_bytes));
    }
  }

 public:
  void allreduce_max(int64_t*, int64_t) override {}
  void barrier() override {}

 private:
  static void copy(const void* send, void* recv, int64_t bytes) {
    if (bytes > 0 && send != recv) std::memcpy(recv, send, static_cast<size_t>(bytes));
  }
  static void check_counts(const char* op, const char* name, const std::vector<int64_t>& counts,
                           int64_t want) {
    if (counts.size() != 1 || counts[0] != want) {
      detail::fail_arg(op, name, " must be [", want, "] on a size-1 communicator, got ",
                       shape_str(counts));
    }
  }
};

}  // namespace

std::shared_ptr<Communicator> local() { return std::make_shared<LocalCommunicator>(); }

}  // namespace switchyard::dist
