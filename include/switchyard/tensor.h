// A small dense, row-major tensor: owned or borrowed storage, a dtype, a shape and a device. Not a
// tensor library: it carries data across the API and checks shapes; the math lives in the ops.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "switchyard/device.h"
#include "switchyard/dtype.h"

namespace switchyard {

using Shape = std::vector<int64_t>;

/// "[2, 3]" for error messages.
std::string shape_str(const Shape& shape);

/// Dense row-major tensor. Copying a Tensor shares its storage (like a handle); `clone()` copies
/// the data. A borrowed tensor points at caller memory that must outlive it.
///
/// Every tensor lives on a device (default: the CPU). Storage on a device comes from that device's
/// allocator; a build without CUDA throws switchyard::BackendError "not built with CUDA" for CUDA
/// storage. Host-only operations (`item_as_double`, `to_double_vector`, `to(DType)`) on a tensor
/// that is not on the CPU throw std::invalid_argument naming the operation and the device.
class Tensor {
 public:
  /// An undefined tensor (`defined() == false`), used for optional arguments.
  Tensor() = default;

  /// Uninitialised owned storage on `device`, 64-byte aligned.
  static Tensor empty(const Shape& shape, DType dtype, Device device = kCpu);
  /// Zero-filled owned storage.
  static Tensor zeros(const Shape& shape, DType dtype, Device device = kCpu);
  /// Owned storage with every element equal to `value` (converted to `dtype`; filled on the host,
  /// then copied to `device`).
  static Tensor full(const Shape& shape, DType dtype, double value, Device device = kCpu);
  /// Non-owning view of `data` (row-major, contiguous) on `device`. The caller keeps `data`
  /// alive. Nothing is checked about the pointer beyond null: it must really be `device` memory.
  static Tensor borrow(void* data, const Shape& shape, DType dtype, Device device = kCpu);
  /// Owned copy of a vector's contents with the given shape (numel must match), on `device`.
  template <class T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device = kCpu);

  bool defined() const { return data_ != nullptr || (dtype_set_ && numel_ == 0); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  /// Size of dimension `d`; negative `d` counts from the end.
  int64_t size(int64_t d) const;
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  bool owns_storage() const { return static_cast<bool>(storage_); }
  /// The device the storage lives on.
  const Device& device() const { return device_; }

  void* raw() { return data_; }
  const void* raw() const { return data_; }
  /// Typed pointer (a device pointer for a tensor not on the CPU); throws std::invalid_argument
  /// when T does not match dtype().
  template <class T>
  T* data();
  template <class T>
  const T* data() const;

  /// Deep copy into owned storage on the same device.
  Tensor clone() const;
  /// Converted copy (bf16 rounding to nearest even; float -> int truncates toward zero). Host
  /// only: on another device, a different dtype throws std::invalid_argument (the same dtype is a
  /// clone).
  Tensor to(DType dtype) const;
  /// Copy on `device` (a clone when it is this tensor's device).
  Tensor to(Device device) const;
  /// Same storage, new shape with the same numel.
  Tensor reshape(const Shape& shape) const;
  /// Copy of the values as doubles (tests, references, printing). Host only.
  std::vector<double> to_double_vector() const;
  /// Element i (flat index) as a double. Host only.
  double item_as_double(int64_t i) const;

 private:
  void check_dtype(DType want) const;
  // Throws std::invalid_argument "[tensor.<op>] needs a CPU tensor, got device cuda:0 ..." when
  // the storage is not host memory.
  void check_host(const char* op) const;
  // empty() whose allocation errors name `op` (clone, to, zeros).
  static Tensor empty_for(const char* op, const Shape& shape, DType dtype, const Device& device);
  // A tensor with its shape, dtype and device set and no storage yet (empty_for and borrow).
  static Tensor without_storage(const Shape& shape, DType dtype, const Device& device);
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::fp32;
  bool dtype_set_ = false;
  Device device_ = kCpu;
};

template <class T>
T* Tensor::data() {
  check_dtype(dtype_of<T>());
  return static_cast<T*>(data_);
}

template <class T>
const T* Tensor::data() const {
  check_dtype(dtype_of<T>());
  return static_cast<const T*>(data_);
}

template <class T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape, Device device) {
  Tensor t = empty(shape, dtype_of<T>());
  if (static_cast<int64_t>(values.size()) != t.numel()) {
    throw std::invalid_argument("[tensor] from_vector: " + std::to_string(values.size()) +
                                " values do not fill shape " + shape_str(shape));
  }
  T* d = t.data<T>();
  for (size_t i = 0; i < values.size(); ++i) d[i] = values[i];
  return device.is_cpu() ? t : t.to(device);
}

/// Bytes of freed large host tensor storage (>= 1 MiB blocks) kept for reuse by the CPU allocator,
/// with the untouched headroom of its segments (address space, not yet memory).
/// Steady-state training steps allocate the same large buffers every micro-batch; reusing them
/// avoids first-touch page faults. The cache is bounded (4 GiB) and off in AddressSanitizer builds.
int64_t cached_memory_bytes();
/// Frees every cached block (e.g. between phases with different shapes); free parts of a block
/// that a live tensor still uses part of stay cached until that tensor is freed.
void release_cached_memory();

/// Number of threads the CPU kernels use (OpenMP). Results never depend on it.
int num_threads();
/// Most CPU threads set_num_threads accepts (each OpenMP thread reserves a stack; a machine with
/// more cores than this is not a target).
inline constexpr int kMaxThreads = 1024;
/// Set the number of CPU threads: n in [1, min(kMaxThreads, the OpenMP thread limit)], else
/// std::invalid_argument.
void set_num_threads(int n);

}  // namespace switchyard
