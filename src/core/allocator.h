// Host memory for tensors. Large blocks (>= 1 MiB) are kept in a small cache when freed and handed
// out again for the next request of the same rounded size: a training step allocates the same
// large buffers (recv_x, combine outputs, gradients) every micro-batch, and first-touch page faults
// on fresh memory cost more than the copies that fill it (measured in bench_dispatch: a quarter of
// rank 0's time was the kernel zeroing pages). Large blocks are 2 MiB aligned and advised for
// transparent huge pages.
#pragma once

#include <cstddef>
#include <cstdint>

namespace switchyard::detail {

/// At least `bytes` bytes, 64-byte aligned (2 MiB aligned for large blocks). Throws std::bad_alloc.
void* allocate(size_t bytes);
/// Returns a block from allocate(bytes) (same `bytes`).
void deallocate(void* p, size_t bytes) noexcept;
/// Ask the kernel to back [p, p+bytes) with transparent huge pages (Linux, THP in "madvise" mode);
/// advice only, failures are ignored.
void advise_huge_pages(void* p, int64_t bytes) noexcept;

}  // namespace switchyard::detail
