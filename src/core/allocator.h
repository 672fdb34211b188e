// Memory for tensors, one allocator per device kind. The registry (`allocator_for`) is the only
// place that knows which allocator serves which kind: the CPU one below, the CUDA one in a CUDA
// build (src/cuda), and in a build without CUDA none (asking throws BackendError "not built with
// CUDA").
//
// The CPU allocator caches: large blocks (>= 1 MiB, rounded up to a size class: eighths of their
// power of two, whole 2 MiB huge pages) are cut from segments it keeps when freed (up to 4 GiB of
// free bytes in all). A request takes the smallest free piece that holds it and splits off the
// rest, and a freed piece merges with its free neighbours, so buffers whose size changes every
// step (recv_x under skewed routes: up to 9x between steps on one rank) run on memory the process
// already touched. A fresh segment is twice its first request (at most 1 GiB more): untouched
// address space, so a buffer growing past its high-water mark faults in only the growth. A training
// step allocates the same large buffers (recv_x, combine outputs, gradients) every micro-batch, and
// first-touch page faults on fresh memory cost more than the copies that fill it (measured in
// bench_dispatch: a quarter of rank 0's time was the kernel zeroing pages). Large blocks are 2 MiB
// aligned and advised for transparent huge pages.
#pragma once

#include <cstddef>
#include <cstdint>

#include "switchyard/device.h"

namespace switchyard::detail {

/// Allocates and frees the storage of one device kind. Implementations are thread-safe.
class Allocator {
 public:
  virtual ~Allocator() = default;
  /// At least `bytes` bytes on `device` (of this allocator's kind), 64-byte aligned (or better).
  /// Throws std::bad_alloc (host) or BackendError (device runtime failure).
  virtual void* allocate(size_t bytes, const Device& device) = 0;
  /// Returns a block from allocate(bytes, device) (same `bytes` and `device`).
  virtual void deallocate(void* p, size_t bytes, const Device& device) noexcept = 0;
  /// "cpu (caching)", "cuda (cudaMalloc)", for messages and tests.
  virtual const char* name() const = 0;
  /// Bytes held in this allocator's cache: free, ready for the next request (0 when it does not
  /// cache).
  virtual int64_t cached_bytes() const { return 0; }
  /// Bytes this allocator holds from the system for cached-size blocks, in use or free (0 when it
  /// does not cache): what stays flat when a step's buffers reuse earlier memory.
  virtual int64_t reserved_bytes() const { return 0; }
  /// Frees every cached block that no live block shares a segment with (the CPU allocator's free
  /// pieces of a partly used segment stay until the segment is wholly free).
  virtual void release_cached() {}
};

/// The allocator of `device.kind`. Throws BackendError "[op] device cuda:0: not built with CUDA
/// ..." when the build has none for that kind.
Allocator& allocator_for(const Device& device, const char* op = "tensor");

/// The CPU (host) caching allocator.
Allocator& host_allocator();

/// Host memory from the CPU allocator (what Tensor::empty uses for kCpu), for buffers that are not
/// tensors (the dispatcher's and the kernels' scratch).
void* allocate(size_t bytes);
/// Returns a block from allocate(bytes) (same `bytes`).
void deallocate(void* p, size_t bytes) noexcept;
/// Ask the kernel to back [p, p+bytes) with transparent huge pages (Linux, THP in "madvise" mode);
/// advice only, failures are ignored.
void advise_huge_pages(void* p, int64_t bytes) noexcept;

}  // namespace switchyard::detail
