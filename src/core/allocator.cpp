#include "allocator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

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

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCacheEnabled = false;  // let AddressSanitizer see every use after free
#else
constexpr bool kCacheEnabled = true;
#endif

// A cached block serves a request of rounded size n when its own size is in [n, 2n): best fit
// (the smallest such block; among equal sizes the earliest freed), so a buffer whose row count
// changes from step to step (recv_x, combine outputs under skewed routes) reuses last step's
// block instead of faulting in fresh pages, and at most half of a reused block is slack.
constexpr size_t kReuseFactor = 2;

struct Cache {
  std::mutex mutex;
  std::multimap<size_t, void*> blocks;       // block size -> free block
  std::unordered_map<void*, size_t> issued;  // large block in use -> its size (>= the request)
  size_t cached_bytes = 0;
};

// Never destroyed: tensors may be freed during static destruction.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
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
    if (size < kLargeBytes) {
      void* p = std::aligned_alloc(64, size);
      if (!p) throw std::bad_alloc();
      return p;
    }
    if (kCacheEnabled) {
      Cache& c = cache();
      std::lock_guard<std::mutex> lock(c.mutex);
      auto it = c.blocks.lower_bound(size);
      if (it != c.blocks.end() && it->first / kReuseFactor < size) {  // it->first < 2 * size
        void* p = it->second;
        const size_t block = it->first;
        c.blocks.erase(it);
        c.cached_bytes -= block;
        c.issued.emplace(p, block);
        return p;
      }
    }
    void* p = std::aligned_alloc(kHugePage, size);
    if (!p) throw std::bad_alloc();
    advise_huge_pages(p, static_cast<int64_t>(size));
    if (kCacheEnabled) {
      Cache& c = cache();
      std::lock_guard<std::mutex> lock(c.mutex);
      c.issued.emplace(p, size);
    }
    return p;
  }

  void deallocate(void* p, size_t bytes, const Device&) noexcept override {
    if (!p) return;
    const size_t size = rounded(bytes);
    if (kCacheEnabled && size >= kLargeBytes) {
      Cache& c = cache();
      std::lock_guard<std::mutex> lock(c.mutex);
      auto it = c.issued.find(p);
      const size_t block = it != c.issued.end() ? it->second : size;
      if (it != c.issued.end()) c.issued.erase(it);
      if (c.cached_bytes + block <= kMaxCachedBytes) {
        c.blocks.emplace(block, p);
        c.cached_bytes += block;
        return;
      }
    }
    std::free(p);
  }

  const char* name() const override { return kCacheEnabled ? "cpu (caching)" : "cpu"; }

  int64_t cached_bytes() const override {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    return static_cast<int64_t>(c.cached_bytes);
  }

  void release_cached() override {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    for (auto& [size, p] : c.blocks) std::free(p);
    c.blocks.clear();
    c.cached_bytes = 0;
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
