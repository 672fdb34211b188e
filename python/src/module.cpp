// The extension module `switchyard._switchyard`. Exceptions: std::invalid_argument -> ValueError
// and std::out_of_range -> IndexError (pybind11's defaults); BackendError and DataError become
// switchyard.BackendError / switchyard.DataError, both subclasses of RuntimeError; any other
// std::runtime_error -> RuntimeError. Messages are the engine's, unchanged.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "switchyard/error.h"

namespace py = pybind11;

PYBIND11_MODULE(_switchyard, m) {
  m.doc() = "switchyard: MoE routing engine (FP32 router, router replay, expert-parallel dispatch)";
  py::register_exception<switchyard::BackendError>(m, "BackendError", PyExc_RuntimeError);
  py::register_exception<switchyard::DataError>(m, "DataError", PyExc_RuntimeError);
  switchyard::py_bind::bind_core(m);
  switchyard::py_bind::bind_gate(m);
  switchyard::py_bind::bind_dist(m);
  switchyard::py_bind::bind_router(m);
  switchyard::py_bind::bind_plan(m);
  switchyard::py_bind::bind_routes(m);
}
