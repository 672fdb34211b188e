// The CUDA backend's memory (SWITCHYARD_CUDA=ON): device storage on cudaMalloc/cudaFree, copies
// and zero fills ordered on the context's stream, the device count. Host code against the CUDA
// runtime API (compiled by the C++ compiler, linked with CUDA::cudart); the kernels, when they
// come, live in .cu files beside it (ops.cu). Every runtime call's return code is checked.
#include <cuda_runtime_api.h>

#include <algorithm>

#include "core/allocator.h"
#include "core/check.h"
#include "cuda/cuda_backend.h"
#include "switchyard/error.h"

namespace switchyard::cuda {

namespace {

// BackendError "[op] call on cuda:N failed: cudaErrorX: text (file:line)".
void check(cudaError_t err, const char* call, const char* op, const Device& device,
           const char* file, int line) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();  // clears a non-sticky error so the next call starts clean
  throw BackendError(detail::cat("[", op, "] ", call, " on ", device_str(device),
                                 " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err),
                                 " (", file, ":", line, ")"));
}

#define SY_CUDA_CHECK(call, op, device) check((call), #call, (op), (device), __FILE__, __LINE__)

// Makes `device` current for one call and restores the caller's device after it (the caller, a
// torch program, owns the current-device state).
class DeviceGuard {
 public:
  DeviceGuard(const Device& device, const char* op) {
    SY_CUDA_CHECK(cudaGetDevice(&previous_), op, device);
    if (previous_ != device.index) {
      SY_CUDA_CHECK(cudaSetDevice(device.index), op, device);
      restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (restore_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

// No cache yet: cudaMalloc/cudaFree per tensor (a caching allocator like the host one is the
// next step once kernels make steady-state steps worth measuring).
class CudaAllocator final : public detail::Allocator {
 public:
  void* allocate(size_t bytes, const Device& device) override {
    const DeviceGuard guard(device, "tensor.empty");
    void* p = nullptr;
    SY_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "tensor.empty", device);
    return p;  // 256-byte aligned
  }
  void deallocate(void* p, size_t, const Device& device) noexcept override {
    if (!p) return;
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess) previous = device.index;
    if (previous != device.index) (void)cudaSetDevice(device.index);
    (void)cudaFree(p);  // a destructor cannot throw; a failed free leaves the block to the driver
    if (previous != device.index) (void)cudaSetDevice(previous);
  }
  const char* name() const override { return "cuda (cudaMalloc)"; }
};

}  // namespace

bool built() noexcept { return true; }

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;  // no driver or no GPU
  }
  return n;
}

detail::Allocator& device_allocator(const char* op, const Device& device) {
  if (device.index < 0) {
    detail::fail_arg(op, "CUDA device index must be >= 0, got ", device_str(device));
  }
  static CudaAllocator* a = new CudaAllocator;  // never destroyed: tensors may outlive statics
  return *a;
}

void copy(void* dst, const Device& dst_device, const void* src, const Device& src_device,
          size_t bytes, void* stream, const char* op) {
  const Device& device = dst_device.is_cuda() ? dst_device : src_device;
  const DeviceGuard guard(device, op);
  auto s = static_cast<cudaStream_t>(stream);
  // cudaMemcpyDefault: unified addressing tells the direction (host<->device, device<->device).
  SY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), op, device);
  SY_CUDA_CHECK(cudaStreamSynchronize(s), op, device);
}

void fill_zero(void* p, size_t bytes, const Device& device, void* stream, const char* op) {
  const DeviceGuard guard(device, op);
  auto s = static_cast<cudaStream_t>(stream);
  SY_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, s), op, device);
  SY_CUDA_CHECK(cudaStreamSynchronize(s), op, device);
}

}  // namespace switchyard::cuda
