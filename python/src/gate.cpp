// Bindings of the router gate (include/switchyard/gate.h).
#include "switchyard/gate.h"

#include <pybind11/stl.h>

#include "bindings.h"
#include "bridge.h"

namespace switchyard::py_bind {

namespace {

GateOptions gate_options(py::handle router_dtype) {
  GateOptions opt;
  opt.router_dtype =
      py_bridge::dtype_from_torch(router_dtype, "router_gating_linear", "router_dtype");
  if (opt.router_dtype != DType::fp32 && opt.router_dtype != DType::fp64) {
    throw py::value_error(
        std::string("[router_gating_linear] router_dtype must be torch.float32 or "
                    "torch.float64, got ") +
        dtype_name(opt.router_dtype));
  }
  return opt;
}

}  // namespace

void bind_gate(py::module_& m) {
  m.def(
      "router_gating_linear",
      [](py::handle x, py::handle weight, py::handle bias, py::handle router_dtype) {
        const char* op = "router_gating_linear";
        const GateOptions opt = gate_options(router_dtype);
        py_bridge::Arg ax = py_bridge::borrow(x, op, "x");
        py_bridge::Arg aw = py_bridge::borrow(weight, op, "weight");
        py_bridge::Arg ab = py_bridge::borrow_optional(bias, op, "bias");
        Tensor out;
        {
          py::gil_scoped_release nogil;
          out = router_gating_linear(ax.t, aw.t, ab.t, opt);
        }
        return py_bridge::to_torch(std::move(out));
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("router_dtype"),
      "logits [T, E] = x [T, H] · weight [E, H]ᵀ (+ bias [E]) in router_dtype (no autograd).");
  m.def(
      "router_gating_linear_backward",
      [](py::handle grad_logits, py::handle x, py::handle weight, py::handle bias,
         py::handle router_dtype) {
        const char* op = "router_gating_linear_backward";
        const GateOptions opt = gate_options(router_dtype);
        py_bridge::Arg ag = py_bridge::borrow(grad_logits, op, "grad_logits");
        py_bridge::Arg ax = py_bridge::borrow(x, op, "x");
        py_bridge::Arg aw = py_bridge::borrow(weight, op, "weight");
        py_bridge::Arg ab = py_bridge::borrow_optional(bias, op, "bias");
        GateGrads g;
        {
          py::gil_scoped_release nogil;
          g = router_gating_linear_backward(ag.t, ax.t, aw.t, ab.t, opt);
        }
        return py::make_tuple(py_bridge::to_torch(std::move(g.grad_x)),
                              py_bridge::to_torch(std::move(g.grad_weight)),
                              py_bridge::to_torch(std::move(g.grad_bias)));
      },
      py::arg("grad_logits"), py::arg("x"), py::arg("weight"), py::arg("bias"),
      py::arg("router_dtype"), "(grad_x, grad_weight, grad_bias) of router_gating_linear.");
}

}  // namespace switchyard::py_bind
