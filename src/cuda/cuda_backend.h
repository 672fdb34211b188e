// The CUDA backend's entry points as the rest of the library sees them. The declarations are the
// same in every build; the definitions come from src/cuda/stub.cpp when SWITCHYARD_CUDA is OFF
// (each one throws BackendError "[op] device cuda:N: not built with CUDA (configure with
// -DSWITCHYARD_CUDA=ON)") and from src/cuda/runtime.cpp + src/cuda/ops.cu when it is ON (memory on
// cudaMalloc/cudaFree, copies with cudaMemcpyAsync on the context's stream, no kernels yet).
// Only src/backend and the allocator registry call these; front-ends go through src/backend.
#pragma once

#include <cstddef>

#include "switchyard/device.h"

namespace switchyard::detail {
class Allocator;
}

namespace switchyard::cuda {

/// Whether this build has the CUDA backend.
bool built() noexcept;
/// Visible CUDA devices (0 without the backend, a GPU or a driver).
int device_count() noexcept;
/// The cudaMalloc/cudaFree allocator (per device ordinal through Device::index).
detail::Allocator& device_allocator(const char* op, const Device& device);
/// Copies `bytes` bytes between any two of host memory and CUDA devices, ordered on `stream`
/// (a cudaStream_t; null = the default stream) and finished before returning.
void copy(void* dst, const Device& dst_device, const void* src, const Device& src_device,
          size_t bytes, void* stream, const char* op);
/// Zeroes `bytes` bytes of device memory, finished before returning.
void fill_zero(void* p, size_t bytes, const Device& device, void* stream, const char* op);
/// Throws BackendError: "[op] kernel has no CUDA kernel yet (device cuda:N)" in a CUDA build,
/// "[op] kernel on cuda:N: not built with CUDA ..." otherwise (op null: "[kernel] ..."). The
/// backend seam calls it for every kernel without a CUDA version.
[[noreturn]] void no_kernel(const char* op, const char* kernel, const Device& device);

}  // namespace switchyard::cuda
