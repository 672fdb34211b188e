// Crossing between torch tensors and switchyard::Tensor without copies.
//
// In: a contiguous torch tensor is borrowed (`Tensor::borrow` on `data_ptr()`, on the device its
// `__dlpack_device__` names: kDLCPU -> cpu, kDLCUDA -> cuda:N); any other layout is made contiguous
// once and the copy is kept alive by the returned `Arg`. A CUDA tensor in a build without CUDA,
// another device, a non-tensor or a wrong dtype raises ValueError naming the op and the argument
// (never read as host memory).
// Out: a result Tensor is exported as a DLPack capsule that owns the C++ storage and handed to
// `torch.from_dlpack` (zero copy, every dtype bf16 included, no numpy). Measured per call
// (bench/py_bridge_overhead.py) against the numpy route it replaces: see notes/python.md.
#pragma once

#include <pybind11/pybind11.h>

#include <initializer_list>
#include <optional>
#include <string>

#include "switchyard/tensor.h"

namespace switchyard::py_bridge {

namespace py = pybind11;

/// A borrowed torch tensor: `t` points into `keep`'s storage, which stays alive with this object.
struct Arg {
  Tensor t;
  py::object keep;
};

/// The torch module (imported once).
py::module_& torch_module();

/// switchyard dtype of a torch dtype object; throws ValueError naming op/name when unsupported.
DType dtype_from_torch(py::handle torch_dtype, const char* op, const char* name);
/// torch dtype object of a switchyard dtype.
py::object torch_dtype(DType dtype);

/// Borrow `obj` (a torch tensor). `allowed` empty = any supported dtype.
Arg borrow(py::handle obj, const char* op, const char* name,
           std::initializer_list<DType> allowed = {});
/// Same for an optional argument: None -> undefined Tensor.
Arg borrow_optional(py::handle obj, const char* op, const char* name,
                    std::initializer_list<DType> allowed = {});

/// A torch tensor sharing `t`'s storage (borrowed results are copied once, since their owner is
/// unknown). An undefined tensor becomes None.
py::object to_torch(Tensor t);

}  // namespace switchyard::py_bridge
