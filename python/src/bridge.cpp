#include "bridge.h"

#include <sstream>
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

py::module_& torch_module() {
  // Leaked on purpose: module objects must not be released after the interpreter shuts down.
  static py::module_* torch = new py::module_(py::module_::import("torch"));
  return *torch;
}

DType dtype_from_torch(py::handle torch_dtype, const char* op, const char* name) {
  py::module_& torch = torch_module();
  if (torch_dtype.is(torch.attr("float32"))) return DType::fp32;
  if (torch_dtype.is(torch.attr("float64"))) return DType::fp64;
  if (torch_dtype.is(torch.attr("bfloat16"))) return DType::bf16;
  if (torch_dtype.is(torch.attr("int32"))) return DType::int32;
  if (torch_dtype.is(torch.attr("int64"))) return DType::int64;
  if (torch_dtype.is(torch.attr("uint8"))) return DType::uint8;
  if (torch_dtype.is(torch.attr("bool"))) return DType::boolean;
  value_error("[" + std::string(op) + "] " + name +
              ": dtype must be one of bfloat16, float32, float64, int32, int64, uint8, bool, got " +
              py::str(torch_dtype).cast<std::string>());
}

py::object torch_dtype(DType dtype) {
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
  }
  throw std::logic_error("unknown dtype");
}

Arg borrow(py::handle obj, const char* op, const char* name, std::initializer_list<DType> allowed) {
  py::module_& torch = torch_module();
  const std::string where = "[" + std::string(op) + "] " + name;
  if (!py::isinstance(obj, torch.attr("Tensor"))) {
    value_error(where + " must be a torch.Tensor, got " +
                py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
  }
  py::object device = obj.attr("device");
  if (device.attr("type").cast<std::string>() != "cpu") {
    value_error(where + " must be a CPU tensor, got device " + py::str(device).cast<std::string>());
  }
  const DType dtype = dtype_from_torch(obj.attr("dtype"), op, name);
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
  if (!arg.keep.attr("is_contiguous")().cast<bool>()) arg.keep = arg.keep.attr("contiguous")();
  Shape shape;
  for (py::handle s : arg.keep.attr("shape")) shape.push_back(s.cast<int64_t>());
  const auto ptr = arg.keep.attr("data_ptr")().cast<uintptr_t>();
  arg.t = Tensor::borrow(reinterpret_cast<void*>(ptr), shape, dtype);
  return arg;
}

Arg borrow_optional(py::handle obj, const char* op, const char* name,
                    std::initializer_list<DType> allowed) {
  if (obj.is_none()) return Arg{};
  return borrow(obj, op, name, allowed);
}

py::object to_torch(Tensor t) {
  if (!t.defined()) return py::none();
  if (!t.owns_storage()) t = t.clone();
  py::dtype np_dtype;
  switch (t.dtype()) {
    case DType::bf16:
      np_dtype = py::dtype::of<int16_t>();
      break;
    case DType::fp32:
      np_dtype = py::dtype::of<float>();
      break;
    case DType::fp64:
      np_dtype = py::dtype::of<double>();
      break;
    case DType::int32:
      np_dtype = py::dtype::of<int32_t>();
      break;
    case DType::int64:
      np_dtype = py::dtype::of<int64_t>();
      break;
    case DType::uint8:
      np_dtype = py::dtype::of<uint8_t>();
      break;
    case DType::boolean:
      np_dtype = py::dtype::of<bool>();
      break;
  }
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  std::vector<py::ssize_t> strides(shape.size());
  py::ssize_t stride = static_cast<py::ssize_t>(dtype_size(t.dtype()));
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<py::ssize_t>(shape[d], 1);
  }
  // The capsule holds a Tensor handle (shared storage): numpy, then torch, keep it alive.
  auto* holder = new Tensor(t);
  py::capsule owner(holder, [](void* p) { delete static_cast<Tensor*>(p); });
  py::array arr(np_dtype, shape, strides, holder->raw(), owner);
  py::object out = torch_module().attr("from_numpy")(arr);
  if (t.dtype() == DType::bf16) out = out.attr("view")(torch_module().attr("bfloat16"));
  return out;
}

}  // namespace switchyard::py_bridge
