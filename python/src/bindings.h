// One binding function per area; module.cpp calls each. Every area file keeps to its own headers.
#pragma once

#include <pybind11/pybind11.h>

namespace switchyard::py_bind {

namespace py = pybind11;

void bind_core(py::module_& m);
void bind_gate(py::module_& m);
void bind_dist(py::module_& m);
void bind_router(py::module_& m);
void bind_routes(py::module_& m);

}  // namespace switchyard::py_bind
