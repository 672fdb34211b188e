// Communicators for expert parallelism. No MPI header here: an MPI communicator is made from an
// opaque handle (a pointer to an MPI_Comm, or its Fortran integer from MPI_Comm_c2f, which is what
// mpi4py's `comm.py2f()` gives), so the API never changes with the build.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace switchyard::dist {

/// The collectives the dispatchers need, on raw buffers of `elem_bytes`-sized elements. Counts are
/// in elements; variable-size buffers are packed in rank order (displacements are prefix sums).
/// Every method is collective over all ranks of the communicator (except rank, size and name);
/// exchange_blocks involves the listed peers only. Communication only: the dispatchers own their
/// buffers (dist::Dispatcher).
/// Environment failures throw switchyard::BackendError naming the call, its error string, the rank
/// and file:line.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// "local" or "mpi".
  virtual std::string name() const = 0;

  /// recv[size()*count]: rank r's `count` elements at r*count.
  virtual void allgather(const void* send, void* recv, int64_t count, int64_t elem_bytes) = 0;
  /// recv: recv_counts[r] elements from rank r, packed in rank order; recv_counts[rank()] must
  /// equal send_count.
  virtual void allgatherv(const void* send, int64_t send_count, void* recv,
                          const std::vector<int64_t>& recv_counts, int64_t elem_bytes) = 0;
  /// send_counts[r] elements go to rank r, recv_counts[r] come from rank r; both packed in rank
  /// order.
  virtual void alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                         const std::vector<int64_t>& recv_counts, int64_t elem_bytes) = 0;
  /// A run of `rows` consecutive rows starting at row `offset`, exchanged with rank `peer`.
  struct Block {
    int peer;
    int64_t offset;
    int64_t rows;
  };
  /// Block exchange: every send block goes to its peer, every receive block is filled from its
  /// peer; the blocks between two ranks are matched in list order, so both sides must list the
  /// same sizes in the same order (blocks of 0 rows are skipped). No packing: each block moves
  /// straight from `send` to `recv` (point-to-point messages, single-copy where MPI can).
  void exchange_blocks(const void* send, const std::vector<Block>& send_blocks, void* recv,
                       const std::vector<Block>& recv_blocks, int64_t row_bytes) {
    const Plane one{send, &send_blocks, recv, &recv_blocks, row_bytes};
    exchange_planes(&one, 1);
  }
  /// One block exchange of exchange_planes.
  struct Plane {
    const void* send;
    const std::vector<Block>* send_blocks;
    void* recv;
    const std::vector<Block>* recv_blocks;
    int64_t row_bytes;
  };
  /// Several block exchanges (each as exchange_blocks, its blocks matched among themselves) in one
  /// round: the dispatcher moves rows and their metadata together.
  virtual void exchange_planes(const Plane* planes, int num_planes) = 0;
  /// In place element-wise maximum of n small integers (flags, sizes) over all ranks.
  virtual void allreduce_max(int64_t* values, int64_t n) = 0;
  virtual void barrier() = 0;

  /// Marks the communicator in use for one dispatcher call (dispatch, combine and the backwards
  /// hold it for their whole duration). A communicator and the dispatchers on it serve one thread
  /// at a time: a second thread entering while it is held gets std::logic_error naming both
  /// calls, never interleaved collectives or a dispatcher's scratch overwritten mid-call. Give
  /// each thread its own communicator (a duplicate) to run them concurrently.
  class Exclusive {
   public:
    Exclusive(Communicator& comm, const char* op);
    ~Exclusive();
    Exclusive(const Exclusive&) = delete;
    Exclusive& operator=(const Exclusive&) = delete;

   private:
    Communicator& comm_;
  };

  /// Typed convenience: everyone's `values` (same length on every rank), rank-major.
  template <class T>
  std::vector<T> allgather(const std::vector<T>& values) {
    std::vector<T> out(values.size() * static_cast<size_t>(size()));
    allgather(values.data(), out.data(), static_cast<int64_t>(values.size()),
              static_cast<int64_t>(sizeof(T)));
    return out;
  }

 private:
  std::atomic<const char*> holder_{nullptr};  // the call holding Exclusive, or null
};

/// A size-1 communicator (rank 0 of 1): collectives are local copies. Always available.
std::shared_ptr<Communicator> local();

/// True when the library was built with MPI.
bool mpi_built();

/// Watchdog: with the environment variable SWITCHYARD_COLLECTIVE_TIMEOUT=<seconds> (> 0) set when
/// an MPI communicator is made, its collectives run as nonblocking MPI calls polled against that
/// deadline; one that does not complete in time (another rank in a different call, or failed
/// outside the error agreement) throws BackendError naming the call and the rank, on every rank
/// that waits, and the communicator refuses further use (MPI cannot cancel a collective: end the
/// job). Unset or 0: blocking MPI calls, no timeout. A value that is not a number is a
/// BackendError when the communicator is made.
///
/// A duplicate of MPI_COMM_WORLD (MPI_ERRORS_RETURN set on it, freed by the destructor). MPI must
/// be initialised by the caller (MPI_Init, or mpi4py). Throws BackendError when MPI is not
/// initialised or the library was built without MPI ("not built with MPI").
std::shared_ptr<Communicator> world();

/// A duplicate of the MPI communicator `*static_cast<MPI_Comm*>(mpi_comm)`.
std::shared_ptr<Communicator> from_mpi(const void* mpi_comm);

/// A duplicate of the communicator with Fortran handle `fortran_handle` (MPI_Comm_c2f; mpi4py's
/// `comm.py2f()`).
std::shared_ptr<Communicator> from_mpi_fortran(int64_t fortran_handle);

}  // namespace switchyard::dist
