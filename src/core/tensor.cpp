#include "switchyard/tensor.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "allocator.h"
#include "backend/backend.h"
#include "check.h"

namespace switchyard {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::bf16: return 2;
    case DType::fp32: return 4;
    case DType::fp64: return 8;
    case DType::int32: return 4;
    case DType::int64: return 8;
    case DType::uint8: return 1;
    case DType::boolean: return 1;
    case DType::int16:
      return 2;
    case DType::uint16:
      return 2;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bf16";
    case DType::fp32: return "fp32";
    case DType::fp64: return "fp64";
    case DType::int32: return "int32";
    case DType::int64: return "int64";
    case DType::uint8: return "uint8";
    case DType::boolean: return "bool";
    case DType::int16:
      return "int16";
    case DType::uint16:
      return "uint16";
  }
  return "?";
}

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

namespace {

int64_t checked_numel(const Shape& shape) {
  for (int64_t s : shape) {
    if (s < 0) detail::fail_arg("tensor", "shape ", shape_str(shape), " has a negative size");
  }
  int64_t n = 1;
  for (int64_t s : shape) {
    if (__builtin_mul_overflow(n, s, &n)) {
      detail::fail_arg("tensor", "shape ", shape_str(shape), " has more than ",
                       std::numeric_limits<int64_t>::max(), " elements");
    }
  }
  return n;
}

template <class T>
void fill_as(void* p, int64_t n, double v) {
  T* d = static_cast<T*>(p);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<T>(v);
}

}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  return empty_for("tensor.empty", shape, dtype, device);
}

Tensor Tensor::without_storage(const Shape& shape, DType dtype, const Device& device) {
  Tensor t;
  t.shape_ = shape;
  t.numel_ = checked_numel(shape);
  t.dtype_ = dtype;
  t.dtype_set_ = true;
  t.device_ = device;
  return t;
}

Tensor Tensor::empty_for(const char* op, const Shape& shape, DType dtype, const Device& device) {
  Tensor t = without_storage(shape, dtype, device);
  // At most 2^62 bytes: the allocators' size classes and headroom stay far from overflowing.
  if (t.numel_ > (int64_t{1} << 62) / static_cast<int64_t>(dtype_size(dtype))) {
    detail::fail_arg(op, "shape ", shape_str(shape), " of ", dtype_name(dtype), " needs ",
                     t.numel_, " x ", dtype_size(dtype), " bytes, more than 2^62");
  }
  const size_t bytes = t.nbytes();
  detail::Allocator& a = detail::allocator_for(device, op);
  void* p = a.allocate(bytes, device);
  t.storage_ = std::shared_ptr<void>(
      p, [ap = &a, bytes, device](void* q) { ap->deallocate(q, bytes, device); });
  t.data_ = p;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty_for("tensor.zeros", shape, dtype, device);
  backend::fill_zero(backend::context_of(t, "tensor.zeros"), t.data_, t.nbytes());
  return t;
}

Tensor Tensor::full(const Shape& shape, DType dtype, double value, Device device) {
  if (!device.is_cpu()) return full(shape, dtype, value).to(device);
  Tensor t = empty(shape, dtype);
  switch (dtype) {
    case DType::bf16: {
      bf16 b = float_to_bf16(static_cast<float>(value));
      auto* d = static_cast<bf16*>(t.data_);
      for (int64_t i = 0; i < t.numel_; ++i) d[i] = b;
      break;
    }
    case DType::fp32: fill_as<float>(t.data_, t.numel_, value); break;
    case DType::fp64: fill_as<double>(t.data_, t.numel_, value); break;
    case DType::int32: fill_as<int32_t>(t.data_, t.numel_, value); break;
    case DType::int64: fill_as<int64_t>(t.data_, t.numel_, value); break;
    case DType::uint8: fill_as<uint8_t>(t.data_, t.numel_, value); break;
    case DType::boolean: fill_as<bool>(t.data_, t.numel_, value != 0.0); break;
    case DType::int16:
      fill_as<int16_t>(t.data_, t.numel_, value);
      break;
    case DType::uint16:
      fill_as<uint16_t>(t.data_, t.numel_, value);
      break;
  }
  return t;
}

Tensor Tensor::borrow(void* data, const Shape& shape, DType dtype, Device device) {
  Tensor t = without_storage(shape, dtype, device);
  if (data == nullptr && t.numel_ > 0) {
    detail::fail_arg("tensor", "borrow: null data for shape ", shape_str(shape));
  }
  if (device.index < 0 || (device.is_cpu() && device.index != 0)) {
    detail::fail_arg("tensor", "borrow: device index must be ",
                     device.is_cpu() ? "0 for the CPU" : ">= 0", ", got ", device_str(device));
  }
  t.data_ = data;
  return t;
}

int64_t Tensor::size(int64_t d) const {
  const int64_t n = dim();
  const int64_t i = d < 0 ? d + n : d;
  if (i < 0 || i >= n) {
    detail::fail_arg("tensor", "size(", d, ") out of range for shape ", shape_str(shape_));
  }
  return shape_[static_cast<size_t>(i)];
}

void Tensor::check_dtype(DType want) const {
  if (want != dtype_) {
    detail::fail_arg("tensor", "data<", dtype_name(want), ">() on a tensor of dtype ",
                     dtype_name(dtype_));
  }
}

void Tensor::check_host(const char* op) const {
  if (!device_.is_cpu()) {
    detail::fail_arg(op, "needs a CPU tensor, got one on ", device_str(device_),
                     " (copy it to the host first: tensor.to(kCpu))");
  }
}

Tensor Tensor::clone() const {
  if (!defined()) return Tensor();
  Tensor t = empty_for("tensor.clone", shape_, dtype_, device_);
  backend::copy_bytes(backend::context_of(*this, "tensor.clone"), t.data_, device_, data_, device_,
                      nbytes());
  return t;
}

Tensor Tensor::to(Device device) const {
  if (!defined()) return Tensor();
  if (device == device_) return clone();
  Tensor t = empty_for("tensor.to", shape_, dtype_, device);
  backend::copy_bytes(backend::context_of(device_.is_cpu() ? t : *this, "tensor.to"), t.data_,
                      device, data_, device_, nbytes());
  return t;
}

double Tensor::item_as_double(int64_t i) const {
  check_host("tensor.item_as_double");
  switch (dtype_) {
    case DType::bf16: return bf16_to_float(static_cast<const bf16*>(data_)[i]);
    case DType::fp32: return static_cast<const float*>(data_)[i];
    case DType::fp64: return static_cast<const double*>(data_)[i];
    case DType::int32: return static_cast<const int32_t*>(data_)[i];
    case DType::int64: return static_cast<double>(static_cast<const int64_t*>(data_)[i]);
    case DType::uint8: return static_cast<const uint8_t*>(data_)[i];
    case DType::boolean: return static_cast<const bool*>(data_)[i] ? 1.0 : 0.0;
    case DType::int16:
      return static_cast<const int16_t*>(data_)[i];
    case DType::uint16:
      return static_cast<const uint16_t*>(data_)[i];
  }
  return 0.0;
}

std::vector<double> Tensor::to_double_vector() const {
  check_host("tensor.to_double_vector");
  std::vector<double> v(static_cast<size_t>(numel_));
  for (int64_t i = 0; i < numel_; ++i) v[static_cast<size_t>(i)] = item_as_double(i);
  return v;
}

Tensor Tensor::to(DType dtype) const {
  if (!defined()) return Tensor();
  if (dtype == dtype_) return clone();
  check_host("tensor.to");
  Tensor t = empty(shape_, dtype);
  const int64_t n = numel_;
  if (dtype == DType::bf16 && dtype_ == DType::fp32) {
    const float* s = static_cast<const float*>(data_);
    bf16* d = static_cast<bf16*>(t.data_);
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
    return t;
  }
  for (int64_t i = 0; i < n; ++i) {
    const double v = item_as_double(i);
    switch (dtype) {
      case DType::bf16:
        static_cast<bf16*>(t.data_)[i] = double_to_bf16(v);  // one rounding, nearest even
        break;
      case DType::fp32: static_cast<float*>(t.data_)[i] = static_cast<float>(v); break;
      case DType::fp64: static_cast<double*>(t.data_)[i] = v; break;
      case DType::int32: static_cast<int32_t*>(t.data_)[i] = static_cast<int32_t>(v); break;
      case DType::int64: static_cast<int64_t*>(t.data_)[i] = static_cast<int64_t>(v); break;
      case DType::uint8: static_cast<uint8_t*>(t.data_)[i] = static_cast<uint8_t>(v); break;
      case DType::boolean: static_cast<bool*>(t.data_)[i] = v != 0.0; break;
      case DType::int16:
        static_cast<int16_t*>(t.data_)[i] = static_cast<int16_t>(v);
        break;
      case DType::uint16:
        static_cast<uint16_t*>(t.data_)[i] = static_cast<uint16_t>(v);
        break;
    }
  }
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (checked_numel(shape) != numel_) {
    detail::fail_arg("tensor", "reshape: cannot view shape ", shape_str(shape_), " as ",
                     shape_str(shape));
  }
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

int num_threads() { return omp_get_max_threads(); }

void set_num_threads(int n) {
  // Each OpenMP thread reserves a stack (OMP_STACKSIZE, 8 MiB by default here): 100000 threads
  // ask for ~800 GB of address space and the runtime crashes at the next parallel region. The
  // bound is the documented kMaxThreads, lowered to the runtime's own thread limit.
  if (n < 1) detail::fail_arg("set_num_threads", "n must be >= 1, got n=", n);
  const int limit = std::min(kMaxThreads, omp_get_thread_limit());
  if (n > limit) {
    detail::fail_arg("set_num_threads", "n must be <= ", limit,
                     " (kMaxThreads, or the OpenMP thread limit when lower), got n=", n);
  }
  omp_set_num_threads(n);
}

namespace detail {

void check_defined(const Tensor& t, const char* op, const char* name) {
  if (!t.defined()) fail_arg(op, name, " must be a defined tensor, got an undefined one");
}

void check_dtype(const Tensor& t, const char* op, const char* name,
                 std::initializer_list<DType> allowed) {
  check_defined(t, op, name);
  std::string list;
  for (DType d : allowed) {
    if (d == t.dtype()) return;
    list += (list.empty() ? "" : " or ");
    list += dtype_name(d);
  }
  fail_arg(op, name, " must have dtype ", list, ", got ", dtype_name(t.dtype()));
}

void check_device(const Tensor& t, const char* op, const char* name, const Device& device) {
  if (t.defined() && t.device() != device) {
    fail_arg(op, name, " must be on ", device_str(device), ", got ", device_str(t.device()));
  }
}

void check_dim(const Tensor& t, const char* op, const char* name, int64_t ndim) {
  check_defined(t, op, name);
  if (t.dim() != ndim) {
    fail_arg(op, name, " must have ", ndim, " dimensions, got shape ", shape_str(t.shape()));
  }
}

void check_shape(const Tensor& t, const char* op, const char* name, const Shape& expected) {
  check_defined(t, op, name);
  bool ok = t.dim() == static_cast<int64_t>(expected.size());
  for (size_t i = 0; ok && i < expected.size(); ++i) {
    if (expected[i] >= 0 && expected[i] != t.shape()[i]) ok = false;
  }
  if (!ok) {
    std::string exp = "[";
    for (size_t i = 0; i < expected.size(); ++i) {
      exp += (i ? ", " : "");
      exp += expected[i] < 0 ? std::string("*") : std::to_string(expected[i]);
    }
    exp += "]";
    fail_arg(op, name, " must have shape ", exp, ", got ", shape_str(t.shape()));
  }
}

}  // namespace detail
}  // namespace switchyard
