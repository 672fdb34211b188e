// Core bindings: thread count and the tensor bridge's own probes (used by the tests to show that
// tensors cross without copies).
#include <pybind11/stl.h>

#include "bindings.h"
#include "bridge.h"
#include "switchyard/cpu.h"
#include "switchyard/device.h"
#include "switchyard/tensor.h"

namespace switchyard::py_bind {

void bind_core(py::module_& m) {
  m.def("num_threads", &switchyard::num_threads, "Number of CPU threads the kernels use.");
  m.def("set_num_threads", &switchyard::set_num_threads, py::arg("n"),
        "Set the number of CPU threads (>= 1); results never depend on it.");
  m.def(
      "cpu_isa", [] { return std::string(cpu_isa_name(cpu_isa())); },
      "The CPU kernel variant in use: 'avx512', 'avx2' or 'scalar' "
      "(SWITCHYARD_CPU_ISA=auto|scalar|avx2|avx512 forces it; all give bitwise the same results).");
  m.def(
      "set_cpu_isa",
      [](const std::string& isa) {
        CpuIsa v;
        if (isa == "scalar") {
          v = CpuIsa::scalar;
        } else if (isa == "avx2") {
          v = CpuIsa::avx2;
        } else if (isa == "avx512") {
          v = CpuIsa::avx512;
        } else {
          throw py::value_error("[set_cpu_isa] isa must be 'scalar', 'avx2' or 'avx512', got '" +
                                isa + "'");
        }
        set_cpu_isa(v);
      },
      py::arg("isa"),
      "Use the 'scalar', 'avx2' or 'avx512' CPU kernels from now on (process-wide); raises "
      "ValueError when this CPU cannot run them.");
  m.def("built_with_cuda", &switchyard::built_with_cuda,
        "Whether this build has the CUDA backend (SWITCHYARD_CUDA=ON).");
  m.def("cuda_device_count", &switchyard::cuda_device_count,
        "CUDA devices visible to the engine (0 without the CUDA backend, a GPU or a driver).");
  // Bridge probes for the tests and the bridge benchmark: not public API (switchyard._testing).
  py::module_ testing = m.def_submodule("_testing", "Bridge probes for tests; not public API.");
  testing.def(
      "borrow_device",
      [](py::handle t) { return device_str(py_bridge::borrow(t, "borrow", "t").t.device()); },
      py::arg("t"), "The device of the engine's view of `t`: 'cpu' or 'cuda:N'.");
  testing.def(
      "borrow_info",
      [](py::handle t) {
        py_bridge::Arg a = py_bridge::borrow(t, "borrow", "t");
        return py::make_tuple(reinterpret_cast<uintptr_t>(a.t.raw()), a.t.shape(),
                              std::string(dtype_name(a.t.dtype())));
      },
      py::arg("t"), "(address, shape, dtype) of the engine's view of `t`.");
  testing.def(
      "clone",
      [](py::handle t) {
        return py_bridge::to_torch(py_bridge::borrow(t, "clone", "t").t.clone());
      },
      py::arg("t"), "An engine-owned copy of `t`, returned through the zero-copy path.");
  testing.def(
      "full",
      [](const Shape& shape, py::handle dtype, double value) {
        return py_bridge::to_torch(
            Tensor::full(shape, py_bridge::dtype_from_torch(dtype, "full", "dtype"), value));
      },
      py::arg("shape"), py::arg("dtype"), py::arg("value"),
      "An engine-owned tensor of `shape` filled with `value`, returned through the zero-copy "
      "path.");
}

}  // namespace switchyard::py_bind
