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
// aligned and advised for transparent huge pages. The bookkeeping is SegmentCache below, which the
// CUDA allocator uses too (one per device, src/cuda/runtime.cpp), with a policy for memory that is
// committed when allocated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "switchyard/device.h"

namespace switchyard::detail {

/// Where a SegmentCache gets its segments: the host (aligned_alloc, huge pages) or one CUDA device
/// (cudaMalloc).
class SegmentSource {
 public:
  virtual ~SegmentSource() = default;
  /// A fresh segment of exactly `bytes` bytes, or nullptr when the system has no memory for it
  /// (the cache then retries without headroom, then after freeing its wholly free segments). May
  /// throw for any other failure (a device runtime error).
  virtual char* allocate_segment(size_t bytes) = 0;
  /// Returns a segment from allocate_segment (same `bytes`).
  virtual void free_segment(char* p, size_t bytes) noexcept = 0;
  /// Bytes a fresh segment gets beyond a request of `size` bytes, kept as a free piece.
  virtual size_t headroom(size_t size) const = 0;
};

/// The bookkeeping of a caching allocator, one per host and one per CUDA device: memory comes in
/// segments from a SegmentSource, cut into pieces. A request takes the smallest free piece that
/// holds it (best fit; among equal sizes the lowest address) and splits off the rest; a freed piece
/// merges with its segment's free neighbours; wholly free segments go back to the source, largest
/// first, while more than `max_cached_bytes` are free. Sizes are whatever the caller rounds to (a
/// multiple of its alignment). Thread-safe.
class SegmentCache {
 public:
  SegmentCache(SegmentSource& source, size_t max_cached_bytes)
      : source_(source), max_cached_(max_cached_bytes) {}
  SegmentCache(const SegmentCache&) = delete;
  SegmentCache& operator=(const SegmentCache&) = delete;
  /// A block of `size` bytes, or nullptr when the source has none even after the cache returned
  /// its wholly free segments. No block in use changes when it returns nullptr or throws.
  char* allocate(size_t size);
  /// Returns a block from allocate; false (and nothing changes) when p is not a live block here.
  bool deallocate(void* p) noexcept;
  /// Frees wholly free segments, largest first, while more than `limit` bytes are free.
  void trim(size_t limit);
  /// Bytes in free pieces / in segments.
  size_t cached_bytes() const;
  size_t reserved_bytes() const;

 private:
  struct Piece {
    size_t size;
    char* segment;  // the segment this piece is part of
    size_t segment_size;
    bool free;
  };
  using Pieces = std::map<char*, Piece>;
  void mark_free(Pieces::iterator it);
  void unmark_free(Pieces::iterator it);
  void trim_locked(size_t limit);

  SegmentSource& source_;
  const size_t max_cached_;
  mutable std::mutex mutex_;
  Pieces pieces_;                                   // every piece of every segment, by address
  std::set<std::pair<size_t, char*>> free_pieces_;  // the free ones by (size, address)
  size_t cached_ = 0;                               // bytes in free pieces
  size_t reserved_ = 0;                             // bytes in segments
};

/// The size class of a request of `bytes`: below 1 MiB a multiple of `small_granule`; from 1 MiB
/// on a multiple of an eighth of its power of two, at least one 2 MiB huge page (at most 1/8
/// slack).
size_t size_class(size_t bytes, size_t small_granule);
/// Where size classes of cached blocks start.
inline constexpr size_t kLargeBlockBytes = size_t{1} << 20;
/// Headroom for memory that is committed when it is allocated (device memory: no lazy faulting as
/// on the host): a request under 1 MiB gets a 2 MiB segment, shared by later small requests; a
/// larger one gets none.
inline size_t committed_memory_headroom(size_t size) {
  constexpr size_t kSmallSegment = size_t{2} << 20;
  return size < kLargeBlockBytes ? kSmallSegment - size : 0;
}

/// Allocates and frees the storage of one device kind. Implementations are thread-safe.
class Allocator {
 public:
  virtual ~Allocator() = default;
  /// At least `bytes` bytes on `device` (of this allocator's kind), 64-byte aligned (or better).
  /// Throws std::bad_alloc (host) or BackendError (device runtime failure).
  virtual void* allocate(size_t bytes, const Device& device) = 0;
  /// Returns a block from allocate(bytes, device) (same `bytes` and `device`).
  virtual void deallocate(void* p, size_t bytes, const Device& device) noexcept = 0;
  /// "cpu (caching)", "cuda (caching)", for messages and tests.
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
