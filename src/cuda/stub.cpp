// The CUDA backend of a build without CUDA (SWITCHYARD_CUDA=OFF): the API stays the same and every
// request for CUDA memory, a copy or a kernel throws one clear error.
#include "core/allocator.h"
#include "core/check.h"
#include "cuda/cuda_backend.h"
#include "switchyard/error.h"

namespace switchyard::cuda {

namespace {

[[noreturn]] void not_built(const char* op, const Device& device) {
  throw BackendError(detail::cat("[", op, "] device ", device_str(device),
                                 ": not built with CUDA (configure with -DSWITCHYARD_CUDA=ON)"));
}

// The device that is not the CPU in a copy (the one this build cannot reach).
const Device& cuda_side(const Device& a, const Device& b) { return a.is_cpu() ? b : a; }

}  // namespace

bool built() noexcept { return false; }

int device_count() noexcept { return 0; }

detail::Allocator& device_allocator(const char* op, const Device& device) { not_built(op, device); }

void copy(void*, const Device& dst_device, const void*, const Device& src_device, size_t, void*,
          const char* op) {
  not_built(op, cuda_side(dst_device, src_device));
}

void fill_zero(void*, size_t, const Device& device, void*, const char* op) {
  not_built(op, device);
}

void no_kernel(const char* op, const char* kernel, const Device& device) {
  if (op == nullptr) not_built(kernel, device);
  throw BackendError(detail::cat("[", op, "] ", kernel, " on ", device_str(device),
                                 ": not built with CUDA (configure with -DSWITCHYARD_CUDA=ON)"));
}

}  // namespace switchyard::cuda
