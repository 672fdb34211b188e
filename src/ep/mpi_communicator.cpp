// The Open MPI communicator: a duplicate of the caller's communicator (so our traffic never mixes
// with theirs), MPI_ERRORS_RETURN on it, every return code checked and turned into a BackendError
// naming the call, MPI's error string, the rank and file:line. Freed by the destructor unless MPI
// is already finalized.
// C API only: the deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "check.h"
#include "switchyard/dist.h"
#include "switchyard/error.h"

namespace switchyard::dist {

namespace {

void check_mpi(int rc, const char* call, int rank, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) len = 0;
  throw BackendError(detail::cat(call, " failed: ", std::string(buf, static_cast<size_t>(len)),
                                 " (error code ", rc, ", rank ", rank, ", ", file, ":", line, ")"));
}

#define SY_MPI_CHECK(call) check_mpi((call), #call, rank_, SY_SOURCE_FILE, __LINE__)

void require_initialized(const char* fn) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) {
    throw BackendError(detail::cat(
        "[dist] ", fn, ": MPI is ", fin ? "finalized" : "not initialised",
        "; call MPI_Init (or import mpi4py) first (", SY_SOURCE_FILE, ":", __LINE__, ")"));
  }
}

// A committed contiguous datatype of `bytes` bytes, freed on scope exit.
class RowType {
 public:
  RowType(int64_t bytes, int rank) : rank_(rank) {
    if (bytes <= 0 || bytes > INT_MAX) {
      throw BackendError(detail::cat("[dist] element size ", bytes,
                                     " bytes is outside (0, INT_MAX] (rank ", rank, ", ",
                                     SY_SOURCE_FILE, ":", __LINE__, ")"));
    }
    if (bytes == 1) {
      type_ = MPI_BYTE;
      return;
    }
    SY_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &type_));
    owned_ = true;
    SY_MPI_CHECK(MPI_Type_commit(&type_));
  }
  ~RowType() {
    if (owned_) MPI_Type_free(&type_);
  }
  RowType(const RowType&) = delete;
  RowType& operator=(const RowType&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  int rank_;
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  bool owned_ = false;
};

// On an early exit (a failed MPI call) pending requests are cancelled and freed, so no
// nonblocking operation outlives the buffers it points into.
struct RequestGuard {
  std::vector<MPI_Request>& reqs;
  ~RequestGuard() {
    for (MPI_Request& r : reqs) {
      if (r != MPI_REQUEST_NULL) {
        MPI_Cancel(&r);
        MPI_Request_free(&r);
      }
    }
  }
};

// Tag of exchange_blocks messages (collectives do not use tags; our own communicator is a dup).
constexpr int kBlockTag = 7301;

// SWITCHYARD_COLLECTIVE_TIMEOUT: seconds a collective may wait for the other ranks (unset or 0:
// forever, MPI's blocking calls as they are). Read when a communicator is made.
double collective_timeout(int rank) {
  const char* v = std::getenv("SWITCHYARD_COLLECTIVE_TIMEOUT");
  if (v == nullptr || *v == '\0') return 0.0;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  if (end == v || *end != '\0' || !std::isfinite(t) || t < 0.0) {
    throw BackendError(detail::cat("[dist] SWITCHYARD_COLLECTIVE_TIMEOUT must be a number of ",
                                   "seconds >= 0 (0 = no timeout), got \"", v, "\" (rank ", rank,
                                   ", ", SY_SOURCE_FILE, ":", __LINE__, ")"));
  }
  return t;
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm parent) {
    int prank = 0;
    MPI_Comm_rank(parent, &prank);
    rank_ = prank;
    timeout_ = collective_timeout(prank);
    SY_MPI_CHECK(MPI_Comm_dup(parent, &comm_));
    try {
      SY_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
      SY_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
      SY_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    } catch (...) {
      MPI_Comm_free(&comm_);  // the destructor will not run for a half-built object
      throw;
    }
  }
  ~MpiCommunicator() override {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  void allgather(const void* send, void* recv, int64_t count, int64_t elem_bytes) override {
    usable();
    RowType t(elem_bytes, rank_);
    if (timeout_ > 0) {
      MPI_Request r = MPI_REQUEST_NULL;
      SY_MPI_CHECK(
          MPI_Iallgather(send, to_int(count), t.get(), recv, to_int(count), t.get(), comm_, &r));
      wait(&r, 1, "MPI_Iallgather");
      return;
    }
    SY_MPI_CHECK(MPI_Allgather(send, to_int(count), t.get(), recv, to_int(count), t.get(), comm_));
  }

  void allgatherv(const void* send, int64_t send_count, void* recv,
                  const std::vector<int64_t>& recv_counts, int64_t elem_bytes) override {
    check_size("allgatherv", recv_counts);
    std::vector<int> counts, displs;
    to_counts(recv_counts, counts, displs);
    RowType t(elem_bytes, rank_);
    usable();
    if (timeout_ > 0) {
      MPI_Request r = MPI_REQUEST_NULL;
      SY_MPI_CHECK(MPI_Iallgatherv(send, to_int(send_count), t.get(), recv, counts.data(),
                                   displs.data(), t.get(), comm_, &r));
      wait(&r, 1, "MPI_Iallgatherv");
      return;
    }
    SY_MPI_CHECK(MPI_Allgatherv(send, to_int(send_count), t.get(), recv, counts.data(),
                                displs.data(), t.get(), comm_));
  }

  void alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                 const std::vector<int64_t>& recv_counts, int64_t elem_bytes) override {
    check_size("alltoallv", send_counts);
    check_size("alltoallv", recv_counts);
    std::vector<int> sc, sd, rc, rd;
    to_counts(send_counts, sc, sd);
    to_counts(recv_counts, rc, rd);
    RowType t(elem_bytes, rank_);
    usable();
    if (timeout_ > 0) {
      MPI_Request r = MPI_REQUEST_NULL;
      SY_MPI_CHECK(MPI_Ialltoallv(send, sc.data(), sd.data(), t.get(), recv, rc.data(), rd.data(),
                                  t.get(), comm_, &r));
      wait(&r, 1, "MPI_Ialltoallv");
      return;
    }
    SY_MPI_CHECK(MPI_Alltoallv(send, sc.data(), sd.data(), t.get(), recv, rc.data(), rd.data(),
                               t.get(), comm_));
  }

  void exchange_planes(const Plane* planes, int num_planes) override {
    // Nonblocking point-to-point, one message per non-empty block, all planes in flight at once;
    // messages between two ranks with the same tag arrive in order (MPI's non-overtaking rule),
    // which is what matches blocks, and each plane has its own tag. Blocks to or from this rank
    // are plain copies.
    usable();
    std::vector<std::unique_ptr<RowType>> types;
    std::vector<MPI_Request> reqs;
    RequestGuard guard{reqs};
    size_t n_req = 0;
    for (int p = 0; p < num_planes; ++p)
      n_req += planes[p].send_blocks->size() + planes[p].recv_blocks->size();
    reqs.reserve(n_req);  // no reallocation: MPI holds pointers into it until the wait
    for (int p = 0; p < num_planes; ++p) {
      const Plane& pl = planes[p];
      const int64_t row_bytes = pl.row_bytes;
      types.push_back(std::make_unique<RowType>(row_bytes, rank_));
      const MPI_Datatype row = types.back()->get();
      const int tag = kBlockTag + p;
      const auto* s = static_cast<const unsigned char*>(pl.send);
      auto* d = static_cast<unsigned char*>(pl.recv);
      std::vector<const Block*> self_send, self_recv;
      for (const Block& b : *pl.recv_blocks) {
        if (b.rows == 0) continue;
        if (b.peer == rank_) {
          self_recv.push_back(&b);
          continue;
        }
        reqs.push_back(MPI_REQUEST_NULL);
        SY_MPI_CHECK(MPI_Irecv(d + b.offset * row_bytes, to_int(b.rows), row, b.peer, tag, comm_,
                               &reqs.back()));
      }
      for (const Block& b : *pl.send_blocks) {
        if (b.rows == 0) continue;
        if (b.peer == rank_) {
          self_send.push_back(&b);
          continue;
        }
        reqs.push_back(MPI_REQUEST_NULL);
        SY_MPI_CHECK(MPI_Isend(s + b.offset * row_bytes, to_int(b.rows), row, b.peer, tag, comm_,
                               &reqs.back()));
      }
      if (self_send.size() != self_recv.size()) {
        throw BackendError(detail::cat(
            "[dist] exchange_blocks: ", self_send.size(), " blocks to self but ", self_recv.size(),
            " from self (rank ", rank_, ", ", SY_SOURCE_FILE, ":", __LINE__, ")"));
      }
      for (size_t i = 0; i < self_send.size(); ++i) {
        std::memcpy(d + self_recv[i]->offset * row_bytes, s + self_send[i]->offset * row_bytes,
                    static_cast<size_t>(self_send[i]->rows * row_bytes));
      }
    }
    if (timeout_ > 0) {
      wait(reqs.data(), static_cast<int>(reqs.size()), "MPI_Isend/MPI_Irecv (exchange_blocks)");
    } else {
      SY_MPI_CHECK(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
    }
    reqs.clear();
  }

  void allreduce_max(int64_t* values, int64_t n) override {
    usable();
    if (timeout_ > 0) {
      MPI_Request r = MPI_REQUEST_NULL;
      SY_MPI_CHECK(
          MPI_Iallreduce(MPI_IN_PLACE, values, to_int(n), MPI_INT64_T, MPI_MAX, comm_, &r));
      wait(&r, 1, "MPI_Iallreduce");
      return;
    }
    SY_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values, to_int(n), MPI_INT64_T, MPI_MAX, comm_));
  }

  void barrier() override {
    usable();
    if (timeout_ > 0) {
      MPI_Request r = MPI_REQUEST_NULL;
      SY_MPI_CHECK(MPI_Ibarrier(comm_, &r));
      wait(&r, 1, "MPI_Ibarrier");
      return;
    }
    SY_MPI_CHECK(MPI_Barrier(comm_));
  }

 private:
  int to_int(int64_t v) const {
    if (v < 0 || v > INT_MAX) {
      throw BackendError(detail::cat("[dist] count ", v, " is outside the int range of MPI (rank ",
                                     rank_, ", ", SY_SOURCE_FILE, ":", __LINE__, ")"));
    }
    return static_cast<int>(v);
  }
  void check_size(const char* op, const std::vector<int64_t>& counts) const {
    if (static_cast<int64_t>(counts.size()) != size_) {
      detail::fail_arg(op, "counts must have one entry per rank (", size_, "), got ",
                       counts.size());
    }
  }
  void to_counts(const std::vector<int64_t>& in, std::vector<int>& counts,
                 std::vector<int>& displs) const {
    counts.resize(in.size());
    displs.resize(in.size());
    int64_t off = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      counts[i] = to_int(in[i]);
      displs[i] = to_int(off);
      off += in[i];
    }
    to_int(off);
  }

  // The watchdog: polls the requests until they complete or the deadline passes. A timed-out
  // collective cannot be cancelled (MPI has no such call), so the communicator is unusable after
  // it: every later call throws instead of mixing with the stuck one.
  void wait(MPI_Request* reqs, int n, const char* call) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration<double>(timeout_);
    for (int spins = 0;; ++spins) {
      int done = 0;
      check_mpi(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE), call, rank_, SY_SOURCE_FILE,
                __LINE__);
      if (done) return;
      if (clock::now() > deadline) {
        broken_ = call;
        throw BackendError(detail::cat(
            "[dist] ", call, " did not complete within ", timeout_,
            " s (SWITCHYARD_COLLECTIVE_TIMEOUT) on rank ", rank_, " of ", size_,
            ": another rank is not in the same collective (a different number of calls, or a ",
            "failure outside the error agreement); this communicator is unusable now (",
            SY_SOURCE_FILE, ":", __LINE__, ")"));
      }
      // Spin briefly (latency), then yield the core (ranks may share cores).
      if (spins > 2000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  void usable() const {
    if (broken_ != nullptr) {
      throw BackendError(detail::cat(
          "[dist] the mpi communicator (rank ", rank_, " of ", size_, ") is unusable: ", broken_,
          " timed out earlier (SWITCHYARD_COLLECTIVE_TIMEOUT) and MPI ",
          "cannot cancel it; end the job (", SY_SOURCE_FILE, ":", __LINE__, ")"));
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = -1;
  int size_ = 0;
  double timeout_ = 0.0;          // SWITCHYARD_COLLECTIVE_TIMEOUT, 0 = none
  const char* broken_ = nullptr;  // the call that timed out, if any
};

}  // namespace

bool mpi_built() { return true; }

std::shared_ptr<Communicator> world() {
  require_initialized("world()");
  return std::make_shared<MpiCommunicator>(MPI_COMM_WORLD);
}

std::shared_ptr<Communicator> from_mpi(const void* mpi_comm) {
  require_initialized("from_mpi()");
  if (mpi_comm == nullptr)
    detail::fail_arg("dist", "from_mpi: mpi_comm must point to an MPI_Comm, got null");
  return std::make_shared<MpiCommunicator>(*static_cast<const MPI_Comm*>(mpi_comm));
}

std::shared_ptr<Communicator> from_mpi_fortran(int64_t fortran_handle) {
  require_initialized("from_mpi_fortran()");
  MPI_Comm c = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
  if (c == MPI_COMM_NULL) {
    detail::fail_arg("dist", "from_mpi_fortran: handle ", fortran_handle, " is MPI_COMM_NULL");
  }
  return std::make_shared<MpiCommunicator>(c);
}

}  // namespace switchyard::dist
