// The CUDA backend's memory (SWITCHYARD_CUDA=ON): device storage cached over cudaMalloc, copies
// and zero fills ordered on the context's stream, the device count. Host code against the CUDA
// runtime API (compiled by the C++ compiler, linked with CUDA::cudart); the kernels, when they
// come, live in .cu files beside it (ops.cu). Every runtime call's return code is checked.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

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

#define SY_CUDA_CHECK(call, op, device) \
  check((call), #call, (op), (device), SY_SOURCE_FILE, __LINE__)

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

// One device's segments: cudaMalloc'd on that device. Device memory is committed when it is
// allocated (no lazy faulting as on the host), so a large request gets a segment of exactly its
// size class and no headroom; requests under 1 MiB share 2 MiB segments (a cudaMalloc per small
// tensor costs more than the tensor's work): detail::committed_memory_headroom. Out of memory
// returns nullptr (the cache frees its wholly free segments and retries once); any other runtime
// error throws, naming the call.
class CudaSegments final : public detail::SegmentSource {
 public:
  explicit CudaSegments(const Device& device) : device_(device) {}
  char* allocate_segment(size_t bytes) override {
    const DeviceGuard guard(device_, "tensor.empty");
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    SY_CUDA_CHECK(err, "tensor.empty", device_);
    return static_cast<char*>(p);  // 256-byte aligned
  }
  void free_segment(char* p, size_t) noexcept override {
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess) previous = device_.index;
    if (previous != device_.index) (void)cudaSetDevice(device_.index);
    (void)cudaFree(p);  // cannot throw here; a failed free leaves the block to the driver
    if (previous != device_.index) (void)cudaSetDevice(previous);
  }
  size_t headroom(size_t size) const override { return detail::committed_memory_headroom(size); }

 private:
  Device device_;
};

// Caching device memory, one SegmentCache per device (the host allocator's bookkeeping): a
// training step asks for the same buffers every micro-batch, and cudaMalloc/cudaFree synchronise
// the device. Reuse is safe while every op of this backend runs to completion on its stream
// before returning (copy and fill_zero synchronise); kernels that return early will need the
// freed block's stream recorded before it is handed out again (as PyTorch's recordStream).
// Free blocks are kept without a bound, as PyTorch does, and returned when cudaMalloc runs out.
class CudaAllocator final : public detail::Allocator {
 public:
  void* allocate(size_t bytes, const Device& device) override {
    const size_t size = detail::size_class(bytes, kGranule);
    char* p = cache(device).allocate(size);
    if (!p) {
      throw BackendError(detail::cat("[tensor.empty] cudaMalloc of ", size, " bytes on ",
                                     device_str(device),
                                     " failed: cudaErrorMemoryAllocation: out of memory (after "
                                     "returning the cached free segments)"));
    }
    return p;
  }
  void deallocate(void* p, size_t, const Device& device) noexcept override {
    if (!p) return;
    detail::SegmentCache* c = nullptr;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto it = devices_.find(device.index);
      if (it != devices_.end()) c = &it->second->cache;
    }
    if (c) (void)c->deallocate(p);  // false (or no cache): not ours, a caller's bug; leak it
  }
  const char* name() const override { return "cuda (caching)"; }
  int64_t cached_bytes() const override {
    return sum([](const detail::SegmentCache& c) { return c.cached_bytes(); });
  }
  int64_t reserved_bytes() const override {
    return sum([](const detail::SegmentCache& c) { return c.reserved_bytes(); });
  }
  void release_cached() override {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [index, d] : devices_) d->cache.trim(0);
  }

 private:
  static constexpr size_t kGranule = 512;
  struct PerDevice {
    explicit PerDevice(const Device& device) : segments(device) {}
    CudaSegments segments;
    detail::SegmentCache cache{segments, std::numeric_limits<size_t>::max()};
  };
  detail::SegmentCache& cache(const Device& device) {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::unique_ptr<PerDevice>& d = devices_[device.index];
    if (!d) d = std::make_unique<PerDevice>(device);
    return d->cache;
  }
  template <class F>
  int64_t sum(F f) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    size_t total = 0;
    for (const auto& [index, d] : devices_) total += f(d->cache);
    return static_cast<int64_t>(total);
  }
  mutable std::mutex mutex_;
  std::map<int, std::unique_ptr<PerDevice>> devices_;
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
