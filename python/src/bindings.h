// One binding function per area; module.cpp calls each. Every area file keeps to its own headers.
#pragma once

#include <pybind11/pybind11.h>

#include "switchyard/dist.h"

namespace switchyard::py_bind {

namespace py = pybind11;

void bind_core(py::module_& m);
void bind_gate(py::module_& m);
void bind_dist(py::module_& m);
void bind_router(py::module_& m);
void bind_plan(py::module_& m);
void bind_routes(py::module_& m);

/// The engine communicator of a switchyard.dist.Communicator (None -> nullptr), for other areas'
/// bindings; ValueError naming op and argument for anything else. The Python object keeps it alive.
dist::Communicator* communicator_of(py::handle obj, const char* op, const char* name);

}  // namespace switchyard::py_bind
