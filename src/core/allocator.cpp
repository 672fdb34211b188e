#include "allocator.h"

#include <sys/mman.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <new>

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

struct Cache {
  std::mutex mutex;
  std::multimap<size_t, void*> blocks;  // rounded size -> free block
  size_t cached_bytes = 0;
};

// Never destroyed: tensors may be freed during static destruction.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

size_t rounded(size_t bytes) {
  if (bytes >= kLargeBytes) return (bytes + kHugePage - 1) / kHugePage * kHugePage;
  return bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
}

}  // namespace

void advise_huge_pages(void* p, int64_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = kHugePage;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) & ~(huge - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

void* allocate(size_t bytes) {
  const size_t size = rounded(bytes);
  if (size < kLargeBytes) {
    void* p = std::aligned_alloc(64, size);
    if (!p) throw std::bad_alloc();
    return p;
  }
  if (kCacheEnabled) {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.blocks.find(size);
    if (it != c.blocks.end()) {
      void* p = it->second;
      c.blocks.erase(it);
      c.cached_bytes -= size;
      return p;
    }
  }
  void* p = std::aligned_alloc(kHugePage, size);
  if (!p) throw std::bad_alloc();
  advise_huge_pages(p, static_cast<int64_t>(size));
  return p;
}

void deallocate(void* p, size_t bytes) noexcept {
  if (!p) return;
  const size_t size = rounded(bytes);
  if (kCacheEnabled && size >= kLargeBytes) {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.cached_bytes + size <= kMaxCachedBytes) {
      c.blocks.emplace(size, p);
      c.cached_bytes += size;
      return;
    }
  }
  std::free(p);
}

}  // namespace detail

int64_t cached_memory_bytes() {
  detail::Cache& c = detail::cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return static_cast<int64_t>(c.cached_bytes);
}

void release_cached_memory() {
  detail::Cache& c = detail::cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  for (auto& [size, p] : c.blocks) std::free(p);
  c.blocks.clear();
  c.cached_bytes = 0;
}

}  // namespace switchyard
