#include "allocator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <utility>

#include "check.h"
#include "cuda/cuda_backend.h"
#include "switchyard/tensor.h"

namespace switchyard {
namespace detail {
namespace {

constexpr size_t kLargeBytes = kLargeBlockBytes;  // blocks from here on are cached
constexpr size_t kHugePage = size_t{2} << 20;
// Cached bytes are bounded so a burst of differently sized buffers cannot pin memory forever.
constexpr size_t kMaxCachedBytes = size_t{4} << 30;
// Most headroom a fresh segment gets beyond its first request (see HostCachingAllocator::allocate).
constexpr size_t kMaxHeadroom = size_t{1} << 30;

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCacheEnabled = false;  // let AddressSanitizer see every use after free
#else
constexpr bool kCacheEnabled = true;
#endif

}  // namespace

void SegmentCache::mark_free(Pieces::iterator it) {
  free_pieces_.emplace(it->second.size, it->first);
  cached_ += it->second.size;
}

void SegmentCache::unmark_free(Pieces::iterator it) {
  free_pieces_.erase({it->second.size, it->first});
  cached_ -= it->second.size;
}

void SegmentCache::trim_locked(size_t limit) {
  for (auto it = free_pieces_.end(); it != free_pieces_.begin() && cached_ > limit;) {
    --it;
    const auto piece = pieces_.find(it->second);
    if (piece->first != piece->second.segment || piece->second.size != piece->second.segment_size) {
      continue;
    }
    cached_ -= it->first;
    reserved_ -= it->first;
    source_.free_segment(piece->first, it->first);
    pieces_.erase(piece);
    it = free_pieces_.erase(it);
  }
}

void SegmentCache::trim(size_t limit) {
  std::lock_guard<std::mutex> lock(mutex_);
  trim_locked(limit);
}

size_t SegmentCache::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_;
}

size_t SegmentCache::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}

// Why split instead of handing out only blocks in [n, 2n): under skewed routes a rank's recv_x
// moves by up to 9x from step to step (one hot rank: 0.2x-1.8x the mean at EP 2). With the
// [n, 2n) rule a step that received few rows found only blocks over twice its size and faulted a
// fresh one (bench_dispatch skew:2, fp32 T 4096: a fresh 104-120 MiB block in 3 of 12 steps,
// 0.7 s against 0.17 s); splitting serves it from memory the process already touched, and the
// rest of that segment stays usable for the other buffers of the step.
char* SegmentCache::allocate(size_t size) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto fit = free_pieces_.lower_bound({size, nullptr});
  if (fit != free_pieces_.end()) {
    const auto it = pieces_.find(fit->second);
    unmark_free(it);
    Piece& piece = it->second;
    if (piece.size == size) {
      piece.free = false;
      return it->first;
    }
    // Split. When the piece before this one is in use (a free one would have merged), the request
    // takes the top end, leaving the free room next to that block: it is the headroom that block
    // grows into when it is freed and asked for again, larger. Otherwise a long-lived buffer (the
    // dispatcher's pack scratch) cut from the headroom of recv_x's segment pinned recv_x at its
    // first size, and the hot rank's next larger recv_x faulted a fresh segment.
    const bool after_used = it != pieces_.begin() && std::prev(it)->second.segment == piece.segment;
    if (after_used) {
      piece.size -= size;
      mark_free(it);
      char* top = it->first + piece.size;
      pieces_.emplace_hint(std::next(it), top,
                           Piece{size, piece.segment, piece.segment_size, false});
      return top;
    }
    piece.free = false;
    const auto rest =
        pieces_.emplace_hint(std::next(it), it->first + size,
                             Piece{piece.size - size, piece.segment, piece.segment_size, true});
    piece.size = size;
    mark_free(rest);
    return it->first;
  }
  // A fresh segment: the request plus the source's headroom, which stays a free piece. On the
  // host headroom is address space only (a page costs memory and a fault when first touched), so
  // a buffer that later grows past its high-water mark touches only the growth: a hot rank that
  // received 428 MiB and then 471 MiB faulted a whole new 480 MiB segment (240 huge pages, a 5 s
  // step against 0.7 s) with exact-size segments. When the system has no memory for it: the
  // request alone, then the same after returning the wholly free segments.
  const size_t headroom = source_.headroom(size);
  size_t segment = size + headroom;
  char* p = source_.allocate_segment(segment);
  if (!p && headroom > 0) p = source_.allocate_segment(segment = size);
  if (!p && cached_ > 0) {
    trim_locked(0);
    p = source_.allocate_segment(segment = size);
  }
  if (!p) return nullptr;
  const auto it = pieces_.emplace(p, Piece{size, p, segment, false}).first;
  if (segment > size) {
    mark_free(
        pieces_.emplace_hint(std::next(it), p + size, Piece{segment - size, p, segment, true}));
  }
  reserved_ += segment;
  return p;
}

bool SegmentCache::deallocate(void* ptr) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pieces_.find(static_cast<char*>(ptr));
  if (it == pieces_.end() || it->second.free) return false;
  it->second.free = true;
  // Merge with the free neighbours of the same segment.
  const auto next = std::next(it);
  if (next != pieces_.end() && next->second.free && next->second.segment == it->second.segment) {
    unmark_free(next);
    it->second.size += next->second.size;
    pieces_.erase(next);
  }
  if (it != pieces_.begin()) {
    const auto prev = std::prev(it);
    if (prev->second.free && prev->second.segment == it->second.segment) {
      unmark_free(prev);
      prev->second.size += it->second.size;
      pieces_.erase(it);
      it = prev;
    }
  }
  mark_free(it);
  trim_locked(max_cached_);
  return true;
}

// Large sizes round up to a size class: a multiple of an eighth of their power of two (at least
// one huge page), so at most 1/8 of a block is slack. A buffer whose size moves by a few percent
// from step to step (recv_x under changing routes) then mostly asks for the same class as last
// step and gets last step's block; rounding to huge pages alone made a 268 MB fp32 recv_x a new
// size almost every step, and one of them faulted 132 fresh huge pages into a timed step (750 ms
// against 137-153 ms; bench_dispatch fresh:1).
size_t size_class(size_t bytes, size_t small_granule) {
  if (bytes >= kLargeBlockBytes) {
    size_t pow2 = kLargeBlockBytes;
    while (pow2 <= bytes / 2) pow2 *= 2;  // the largest power of two <= bytes
    const size_t step = std::max(kHugePage, pow2 / 8);
    return (bytes + step - 1) / step * step;
  }
  return bytes == 0 ? small_granule : (bytes + small_granule - 1) / small_granule * small_granule;
}

namespace {
size_t rounded(size_t bytes) { return size_class(bytes, 64); }
}  // namespace

void advise_huge_pages(void* p, int64_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = kHugePage;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const uintptr_t end =
      (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) & ~(huge - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

namespace {

// Host segments: 2 MiB aligned, advised for transparent huge pages, with as much headroom as the
// request (at most kMaxHeadroom): address space that costs nothing until touched.
class HostSegments final : public SegmentSource {
 public:
  char* allocate_segment(size_t bytes) override {
    char* p = static_cast<char*>(std::aligned_alloc(kHugePage, bytes));
    if (p) advise_huge_pages(p, static_cast<int64_t>(bytes));
    return p;
  }
  void free_segment(char* p, size_t) noexcept override { std::free(p); }
  size_t headroom(size_t size) const override { return std::min(size, kMaxHeadroom); }
};

// Host memory, caching large blocks (see allocator.h for why) in one SegmentCache.
class HostCachingAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, const Device&) override {
    const size_t size = rounded(bytes);
    if (size < kLargeBytes || !kCacheEnabled) {
      void* p = std::aligned_alloc(size < kLargeBytes ? 64 : kHugePage, size);
      if (!p) throw std::bad_alloc();
      if (size >= kLargeBytes) advise_huge_pages(p, static_cast<int64_t>(size));
      return p;
    }
    char* p = cache_.allocate(size);
    if (!p) throw std::bad_alloc();
    return p;
  }

  void deallocate(void* ptr, size_t bytes, const Device&) noexcept override {
    if (!ptr) return;
    if (!kCacheEnabled || rounded(bytes) < kLargeBytes) {
      std::free(ptr);
      return;
    }
    (void)cache_.deallocate(ptr);  // false: not ours, a caller's bug; leak it
  }

  const char* name() const override { return kCacheEnabled ? "cpu (caching)" : "cpu"; }
  int64_t cached_bytes() const override { return static_cast<int64_t>(cache_.cached_bytes()); }
  int64_t reserved_bytes() const override { return static_cast<int64_t>(cache_.reserved_bytes()); }
  void release_cached() override { cache_.trim(0); }

 private:
  HostSegments segments_;
  SegmentCache cache_{segments_, kMaxCachedBytes};
};

}  // namespace

Allocator& host_allocator() {
  static HostCachingAllocator* a = new HostCachingAllocator;  // never destroyed, like the cache
  return *a;
}

Allocator& allocator_for(const Device& device, const char* op) {
  switch (device.kind) {
    case DeviceKind::cpu:
      return host_allocator();
    case DeviceKind::cuda:
      return cuda::device_allocator(op, device);  // throws in a build without CUDA
  }
  fail_arg(op, "unknown device kind ", static_cast<int>(device.kind));
}

void* allocate(size_t bytes) { return host_allocator().allocate(bytes, kCpu); }

void deallocate(void* p, size_t bytes) noexcept { host_allocator().deallocate(p, bytes, kCpu); }

}  // namespace detail

int64_t cached_memory_bytes() { return detail::host_allocator().cached_bytes(); }

void release_cached_memory() { detail::host_allocator().release_cached(); }

}  // namespace switchyard
