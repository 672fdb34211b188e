// The size-1 local communicator: every collective is a copy (or nothing). Always built.
#include <cstring>

#include "check.h"
#include "switchyard/dist.h"

namespace switchyard::dist {

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
      detail::fail_arg("local.alltoallv", "send_counts must have 1 entry, got ", send_counts.size());
    }
    check_counts("alltoallv", "recv_counts", recv_counts, send_counts[0]);
    copy(send, recv, send_counts[0] * elem_bytes);
  }
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
