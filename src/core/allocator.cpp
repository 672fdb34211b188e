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

constexpr size_t kLargeBytes = size_t{1} << 20;  // blocks from here on are cached
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

// Large memory comes in segments (one aligned_alloc each, advised for huge pages, with headroom:
// see allocate) cut into pieces. A request of rounded size n takes the smallest free piece of at
// least n bytes (best fit; among equal sizes the lowest address) and, when the piece is larger,
// splits it (see allocate for which end is handed out); the rest stays free as its own piece. A
// freed piece merges with free neighbours of its segment, so a segment whose pieces are all back
// is one piece again. Sizes are multiples of the huge page, so every piece starts on one.
//
// Why split instead of handing out only blocks in [n, 2n): under skewed routes a rank's recv_x
// moves by up to 9x from step to step (one hot rank: 0.2x-1.8x the mean at EP 2). With the
// [n, 2n) rule a step that received few rows found only blocks over twice its size and faulted a
// fresh one (bench_dispatch skew:2, fp32 T 4096: a fresh 104-120 MiB block in 3 of 12 steps,
// 0.7 s against 0.17 s); splitting serves it from memory the process already touched, and the
// rest of that segment stays usable for the other buffers of the step.
struct Piece {
  size_t size;
  char* segment;  // the aligned_alloc block this piece is part of
  size_t segment_size;
  bool free;
};

struct Cache {
  std::mutex mutex;
  std::map<char*, Piece> pieces;                   // every piece of every segment, by address
  std::set<std::pair<size_t, char*>> free_pieces;  // the free ones by (size, address)
  size_t cached_bytes = 0;                         // bytes in free pieces
  size_t reserved_bytes = 0;                       // bytes in segments
};

// Never destroyed: tensors may be freed during static destruction.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

void mark_free(Cache& c, std::map<char*, Piece>::iterator it) {
  c.free_pieces.emplace(it->second.size, it->first);
  c.cached_bytes += it->second.size;
}

void unmark_free(Cache& c, std::map<char*, Piece>::iterator it) {
  c.free_pieces.erase({it->second.size, it->first});
  c.cached_bytes -= it->second.size;
}

// Frees segments that are wholly free, largest first, while the cache holds more than `limit`.
void trim_to(Cache& c, size_t limit) {
  for (auto it = c.free_pieces.end(); it != c.free_pieces.begin() && c.cached_bytes > limit;) {
    --it;
    const auto piece = c.pieces.find(it->second);
    if (piece->first != piece->second.segment || piece->second.size != piece->second.segment_size) {
      continue;
    }
    c.cached_bytes -= it->first;
    c.reserved_bytes -= it->first;
    std::free(piece->first);
    c.pieces.erase(piece);
    it = c.free_pieces.erase(it);
  }
}

// Large sizes round up to a size class: a multiple of an eighth of their power of two (at least
// one huge page), so at most 1/8 of a block is slack. A buffer whose size moves by a few percent
// from step to step (recv_x under changing routes) then mostly asks for the same class as last
// step and gets last step's block; rounding to huge pages alone made a 268 MB fp32 recv_x a new
// size almost every step, and one of them faulted 132 fresh huge pages into a timed step (750 ms
// against 137-153 ms; bench_dispatch fresh:1).
size_t rounded(size_t bytes) {
  if (bytes >= kLargeBytes) {
    size_t pow2 = kLargeBytes;
    while (pow2 <= bytes / 2) pow2 *= 2;  // the largest power of two <= bytes
    const size_t step = std::max(kHugePage, pow2 / 8);
    return (bytes + step - 1) / step * step;
  }
  return bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
}

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

// Host memory, caching large blocks (see allocator.h for why).
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
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    const auto fit = c.free_pieces.lower_bound({size, nullptr});
    if (fit != c.free_pieces.end()) {
      const auto it = c.pieces.find(fit->second);
      unmark_free(c, it);
      Piece& piece = it->second;
      if (piece.size == size) {
        piece.free = false;
        return it->first;
      }
      // Split (both sizes are multiples of the huge page). When the piece before this one is in
      // use (a free one would have merged), the request takes the top end, leaving the free room
      // next to that block: it is the headroom that block grows into when it is freed and asked
      // for again, larger. Otherwise a long-lived buffer (the dispatcher's pack scratch) cut from
      // the headroom of recv_x's segment pinned recv_x at its first size, and the hot rank's next
      // larger recv_x faulted a fresh segment.
      const bool after_used =
          it != c.pieces.begin() && std::prev(it)->second.segment == piece.segment;
      if (after_used) {
        piece.size -= size;
        mark_free(c, it);
        char* top = it->first + piece.size;
        c.pieces.emplace_hint(std::next(it), top,
                              Piece{size, piece.segment, piece.segment_size, false});
        return top;
      }
      piece.free = false;
      const auto rest =
          c.pieces.emplace_hint(std::next(it), it->first + size,
                                Piece{piece.size - size, piece.segment, piece.segment_size, true});
      piece.size = size;
      mark_free(c, rest);
      return it->first;
    }
    // A fresh segment: the request plus as much again (at most kMaxHeadroom) of headroom, which
    // stays a free piece. Headroom is address space only (a page costs memory and a fault when
    // first touched), so a buffer that later grows past its high-water mark touches only the
    // growth: a hot rank that received 428 MiB and then 471 MiB faulted a whole new 480 MiB
    // segment (240 huge pages, a 5 s step against 0.7 s) with exact-size segments.
    size_t segment = size + std::min(size, kMaxHeadroom);
    char* p = static_cast<char*>(std::aligned_alloc(kHugePage, segment));
    if (!p) {  // address space or overcommit limits: the request alone
      segment = size;
      p = static_cast<char*>(std::aligned_alloc(kHugePage, segment));
      if (!p) throw std::bad_alloc();
    }
    advise_huge_pages(p, static_cast<int64_t>(segment));
    const auto it = c.pieces.emplace(p, Piece{size, p, segment, false}).first;
    if (segment > size) {
      mark_free(c, c.pieces.emplace_hint(std::next(it), p + size,
                                         Piece{segment - size, p, segment, true}));
    }
    c.reserved_bytes += segment;
    return p;
  }

  void deallocate(void* ptr, size_t bytes, const Device&) noexcept override {
    if (!ptr) return;
    if (!kCacheEnabled || rounded(bytes) < kLargeBytes) {
      std::free(ptr);
      return;
    }
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.pieces.find(static_cast<char*>(ptr));
    if (it == c.pieces.end() || it->second.free) return;  // not ours: a caller's bug, leak it
    it->second.free = true;
    // Merge with the free neighbours of the same segment.
    const auto next = std::next(it);
    if (next != c.pieces.end() && next->second.free && next->second.segment == it->second.segment) {
      unmark_free(c, next);
      it->second.size += next->second.size;
      c.pieces.erase(next);
    }
    if (it != c.pieces.begin()) {
      const auto prev = std::prev(it);
      if (prev->second.free && prev->second.segment == it->second.segment) {
        unmark_free(c, prev);
        prev->second.size += it->second.size;
        c.pieces.erase(it);
        it = prev;
      }
    }
    mark_free(c, it);
    trim_to(c, kMaxCachedBytes);
  }

  const char* name() const override { return kCacheEnabled ? "cpu (caching)" : "cpu"; }

  int64_t cached_bytes() const override {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    return static_cast<int64_t>(c.cached_bytes);
  }

  int64_t reserved_bytes() const override {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    return static_cast<int64_t>(c.reserved_bytes);
  }

  void release_cached() override {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    trim_to(c, 0);
  }
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
