#include "bridge.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace switchyard::py_bridge {

namespace {

[[noreturn]] void value_error(const std::string& msg) { throw py::value_error(msg); }

std::string allowed_str(std::initializer_list<DType> allowed) {
  std::string s;
  size_t i = 0;
  for (DType d : allowed) {
    if (i) s += (i + 1 == allowed.size()) ? " or " : ", ";
    s += dtype_name(d);
    ++i;
  }
  return s;
}

}  // namespace

py::module_& torch_module();

namespace {

// The Python names and torch objects every borrow reads, made once: an attribute looked up by a C
// string builds and hashes a new str per call, and torch's dtypes and Tensor type are singletons.
// Leaked on purpose (nothing may be released after the interpreter shuts down). Measured with
// bench/py_bridge_overhead.py: the borrow of a small tensor is mostly these lookups.
py::handle interned(const char* s) { return PyUnicode_InternFromString(s); }

struct Names {
  py::handle dtype = interned("dtype"), is_cpu = interned("is_cpu"),
             is_contiguous = interned("is_contiguous"), contiguous = interned("contiguous"),
             shape = interned("shape"), data_ptr = interned("data_ptr");
};
const Names& names() {
  static const Names* n = new Names();
  return *n;
}

// torch's dtypes in DType order (none where this torch lacks one: uint16 before torch 2.3).
constexpr DType kDTypes[] = {DType::fp32,  DType::fp64,    DType::bf16,  DType::int32, DType::int64,
                             DType::uint8, DType::boolean, DType::int16, DType::uint16};
constexpr const char* kDTypeNames[] = {"float32", "float64", "bfloat16", "int32", "int64",
                                       "uint8",   "bool",    "int16",    "uint16"};
constexpr size_t kNumDTypes = sizeof(kDTypes) / sizeof(kDTypes[0]);
const std::vector<py::handle>& torch_dtypes() {
  static const std::vector<py::handle>* d = [] {
    auto* v = new std::vector<py::handle>();
    for (const char* n : kDTypeNames) {
      v->push_back(py::hasattr(torch_module(), n) ? py::object(torch_module().attr(n)).release()
                                                  : py::handle());
    }
    return v;
  }();
  return *d;
}

// DLPack device codes (dlpack.h DLDeviceType).
constexpr int32_t kDLCPU = 1;
constexpr int32_t kDLCUDA = 2;
constexpr int32_t kDLCUDAHost = 3;  // pinned host memory: host-addressable

Device device_of(py::handle obj, const std::string& where) {
  // Fast path: a plain torch.Tensor or nn.Parameter (a router's weight) on the CPU. torch's own
  // __dlpack_device__ derives kDLCPU from exactly this, but through a Python-level method
  // (measured: 1.3 us of a 2 us borrow; a Parameter took the slow path, +2 us per gate call).
  static py::handle* tensor_type = new py::handle(torch_module().attr("Tensor"));
  static py::handle* parameter_type =
      new py::handle(torch_module().attr("nn").attr("Parameter"));
  const py::handle obj_type = py::type::handle_of(obj);
  if ((obj_type.is(*tensor_type) || obj_type.is(*parameter_type)) &&
      obj.attr(names().is_cpu).ptr() == Py_True) {
    return kCpu;
  }
  // Otherwise the DLPack protocol says where the memory is (torch.device spells every backend its
  // own way, and a subclass or a foreign tensor may not be what its .device claims to be).
  int32_t type = -1, index = 0;
  try {
    const auto dev = obj.attr("__dlpack_device__")().cast<std::pair<int32_t, int32_t>>();
    type = dev.first;
    index = dev.second;
  } catch (const py::error_already_set&) {
    value_error(where + " must be a CPU tensor, got device " +
                py::str(obj.attr("device")).cast<std::string>() +
                " (it has no DLPack device: memory switchyard cannot address)");
  }
  if (type == kDLCPU || type == kDLCUDAHost) return kCpu;
  if (type == kDLCUDA) {
    if (!built_with_cuda()) {
      value_error(where + " is a CUDA tensor (device cuda:" + std::to_string(index) +
                  "), but this switchyard was built without CUDA: pass a CPU tensor (" +
                  "tensor.cpu()) or rebuild with -DSWITCHYARD_CUDA=ON");
    }
    return cuda_device(index);
  }
  value_error(where + " must be a CPU" + std::string(built_with_cuda() ? " or CUDA" : "") +
              " tensor, got device " + py::str(obj.attr("device")).cast<std::string>() +
              " (DLPack device type " + std::to_string(type) + ")");
}

}  // namespace

py::module_& torch_module() {
  // Leaked on purpose: module objects must not be released after the interpreter shuts down.
  static py::module_* torch = new py::module_(py::module_::import("torch"));
  return *torch;
}

DType dtype_from_torch(py::handle torch_dtype, const char* op, const char* name) {
  py::module_& torch = torch_module();
  const std::vector<py::handle>& dtypes = torch_dtypes();
  for (size_t i = 0; i < kNumDTypes; ++i) {
    if (dtypes[i] && torch_dtype.is(dtypes[i])) return kDTypes[i];
  }
  if (torch_dtype.is(torch.attr("float16"))) {
    // Decided: no fp16 kernels. Its range differs from bf16's, so it cannot be reinterpreted, and
    // a silent conversion would hide a copy; the caller casts (fp16 -> fp32 is exact).
    value_error("[" + std::string(op) + "] " + name +
                ": float16 is not supported; cast to torch.bfloat16 or torch.float32 first "
                "(x.float() is exact for float16)");
  }
  value_error("[" + std::string(op) + "] " + name +
              ": dtype must be one of bfloat16, float32, float64, int32, int64, uint8, bool, "
              "int16, uint16, got " +
              py::str(torch_dtype).cast<std::string>());
}

py::object torch_dtype(DType dtype) {
  const std::vector<py::handle>& dtypes = torch_dtypes();
  for (size_t i = 0; i < kNumDTypes; ++i) {
    if (kDTypes[i] == dtype && dtypes[i]) return py::reinterpret_borrow<py::object>(dtypes[i]);
  }
  py::module_& torch = torch_module();
  switch (dtype) {
    case DType::bf16:
      return torch.attr("bfloat16");
    case DType::fp32:
      return torch.attr("float32");
    case DType::fp64:
      return torch.attr("float64");
    case DType::int32:
      return torch.attr("int32");
    case DType::int64:
      return torch.attr("int64");
    case DType::uint8:
      return torch.attr("uint8");
    case DType::boolean:
      return torch.attr("bool");
    case DType::int16:
      return torch.attr("int16");
    case DType::uint16:
      return torch.attr("uint16");
  }
  throw std::logic_error("unknown dtype");
}

Arg borrow(py::handle obj, const char* op, const char* name, std::initializer_list<DType> allowed) {
  static py::handle* tensor_type = new py::handle(torch_module().attr("Tensor"));
  const std::string where = "[" + std::string(op) + "] " + name;
  if (!py::isinstance(obj, *tensor_type)) {
    value_error(where + " must be a torch.Tensor, got " +
                py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
  }
  const Names& n = names();
  const Device device = device_of(obj, where);
  const DType dtype = dtype_from_torch(obj.attr(n.dtype), op, name);
  if (allowed.size() != 0) {
    bool ok = false;
    for (DType d : allowed) ok = ok || d == dtype;
    if (!ok) {
      value_error(where + " must have dtype " + allowed_str(allowed) + ", got " +
                  dtype_name(dtype));
    }
  }
  Arg arg;
  arg.keep = py::reinterpret_borrow<py::object>(obj);
  if (arg.keep.attr(n.is_contiguous)().ptr() != Py_True) arg.keep = arg.keep.attr(n.contiguous)();
  Shape shape;
  for (py::handle s : arg.keep.attr(n.shape)) shape.push_back(s.cast<int64_t>());
  const auto ptr = arg.keep.attr(n.data_ptr)().cast<uintptr_t>();
  arg.t = Tensor::borrow(reinterpret_cast<void*>(ptr), shape, dtype, device);
  return arg;
}

Arg borrow_optional(py::handle obj, const char* op, const char* name,
                    std::initializer_list<DType> allowed) {
  if (obj.is_none()) return Arg{};
  return borrow(obj, op, name, allowed);
}

namespace {

// DLPack (the array-exchange ABI torch.from_dlpack consumes), the few types it needs, as its
// stable C ABI defines them (dlpack.h v0.8+: DLManagedTensor, codes kDLInt 0, kDLUInt 1,
// kDLFloat 2, kDLBfloat 4, kDLBool 6; devices kDLCPU 1, kDLCUDA 2).
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

// Owns the engine storage (a Tensor handle shares it) and the shape/stride arrays DLPack points at.
struct Exported {
  DLManagedTensor managed{};
  Tensor tensor;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

DLDataType dl_dtype(DType d) {
  switch (d) {
    case DType::bf16:
      return {4, 16, 1};
    case DType::fp32:
      return {2, 32, 1};
    case DType::fp64:
      return {2, 64, 1};
    case DType::int32:
      return {0, 32, 1};
    case DType::int64:
      return {0, 64, 1};
    case DType::uint8:
      return {1, 8, 1};
    case DType::boolean:
      return {6, 8, 1};
    case DType::int16:
      return {0, 16, 1};
    case DType::uint16:
      return {1, 16, 1};
  }
  throw std::logic_error("unknown dtype");
}

void delete_exported(DLManagedTensor* m) { delete static_cast<Exported*>(m->manager_ctx); }

}  // namespace

py::object to_torch(Tensor t) {
  if (!t.defined()) return py::none();
  if (!t.owns_storage()) t = t.clone();
  auto owner = std::make_unique<Exported>();
  owner->tensor = std::move(t);
  const Shape& shape = owner->tensor.shape();
  owner->shape.assign(shape.begin(), shape.end());
  owner->strides.resize(shape.size());
  int64_t stride = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    owner->strides[d] = stride;
    stride *= std::max<int64_t>(shape[d], 1);
  }
  DLTensor& dl = owner->managed.dl_tensor;
  dl.data = owner->tensor.raw();
  const Device& device = owner->tensor.device();
  dl.device = device.is_cpu() ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, device.index};
  dl.ndim = static_cast<int32_t>(shape.size());
  dl.dtype = dl_dtype(owner->tensor.dtype());
  dl.shape = owner->shape.data();
  dl.strides = owner->strides.data();
  dl.byte_offset = 0;
  owner->managed.manager_ctx = owner.get();
  owner->managed.deleter = &delete_exported;
  // The capsule protocol: the consumer renames it "used_dltensor" and calls the deleter when its
  // tensor dies; a capsule never consumed still named "dltensor" frees the storage itself.
  PyObject* cap = PyCapsule_New(&owner->managed, "dltensor", [](PyObject* c) {
    if (PyCapsule_IsValid(c, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
      m->deleter(m);
    }
  });
  if (!cap) throw py::error_already_set();
  owner.release();
  // torch.from_dlpack is a Python function that hands a capsule to torch._C._from_dlpack: call
  // that directly where this torch has it (a Python frame less per result).
  static py::object* from_dlpack = [] {
    py::object c = torch_module().attr("_C");
    return new py::object(py::hasattr(c, "_from_dlpack") ? c.attr("_from_dlpack")
                                                         : torch_module().attr("from_dlpack"));
  }();
  return (*from_dlpack)(py::reinterpret_steal<py::object>(cap));
}

}  // namespace switchyard::py_bridge
