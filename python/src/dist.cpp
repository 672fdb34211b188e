// Bindings of the communicators and the expert-parallel dispatchers (include/switchyard/dist.h,
// dispatcher.h).
//
// MPI lifetime: `world()` initialises MPI when nobody has (MPI_Init_thread) and then finalises it
// at interpreter exit; when mpi4py (or the host program) initialised MPI, they keep ownership.
// Python holds communicators through a box, so that at exit every communicator made here is freed
// before MPI is finalised, whatever Python objects still point at it.
#include "switchyard/dist.h"

#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "bridge.h"
#include "switchyard/dispatcher.h"
#include "switchyard/error.h"

#ifdef SWITCHYARD_WITH_MPI
// C bindings only (the MPI C++ bindings would add symbols libmpi_cxx must provide).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace switchyard::py_bind {

namespace {

using dist::Communicator;
using CommPtr = std::shared_ptr<Communicator>;
using dist::DispatcherKind;

/// A communicator as Python holds it, with the Dispatcher (and so the scratch memory) that every
/// dispatcher call on it uses, kept across steps; emptied at interpreter exit.
struct CommBox {
  CommPtr comm;
  std::unique_ptr<dist::Dispatcher> disp;
  Communicator& get() const {
    if (!comm) throw std::runtime_error("[dist] communicator was released at interpreter exit");
    return *comm;
  }
  dist::Dispatcher& dispatcher() const {
    get();
    return *disp;
  }
};

std::vector<std::weak_ptr<CommBox>>& registry() {
  static auto* boxes = new std::vector<std::weak_ptr<CommBox>>();
  return *boxes;
}

std::shared_ptr<CommBox> box(CommPtr comm) {
  auto b = std::make_shared<CommBox>();
  b->disp = std::make_unique<dist::Dispatcher>(comm);
  b->comm = std::move(comm);
  registry().push_back(b);
  return b;
}

#ifdef SWITCHYARD_WITH_MPI
bool g_we_initialised_mpi = false;

void ensure_mpi() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) throw BackendError("[dist.world] MPI was already finalised in this process");
  int provided = 0;
  const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw BackendError("[dist.world] MPI_Init_thread failed: " + std::string(msg, len) + " (" +
                       __FILE__ + ":" + std::to_string(__LINE__) + ")");
  }
  g_we_initialised_mpi = true;
}
#endif

/// At interpreter exit: free every communicator, then finalise MPI if we initialised it.
void shutdown() {
  for (auto& w : registry()) {
    if (auto b = w.lock()) {
      b->disp.reset();
      b->comm.reset();
    }
  }
  registry().clear();
#ifdef SWITCHYARD_WITH_MPI
  if (g_we_initialised_mpi) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
    g_we_initialised_mpi = false;
  }
#endif
}

DispatcherKind kind_from_str(const std::string& s) {
  if (s == "all_to_all") return DispatcherKind::all_to_all;
  if (s == "all_gather") return DispatcherKind::all_gather;
  throw py::value_error("[dispatch] kind must be 'all_to_all' or 'all_gather', got '" + s + "'");
}

TokenDropPolicy drop_policy_from_str(const std::string& s) {
  if (s == "probs") return TokenDropPolicy::probs;
  if (s == "position") return TokenDropPolicy::position;
  throw py::value_error("[dispatch] token_drop_policy must be 'probs' or 'position', got '" + s +
                        "'");
}

WeightMode weights_opt(bool apply_weights) {
  return apply_weights ? WeightMode::apply : WeightMode::skip;
}

}  // namespace

dist::Communicator* communicator_of(py::handle obj, const char* op, const char* name) {
  if (obj.is_none()) return nullptr;
  if (!py::isinstance<CommBox>(obj)) {
    throw py::value_error(std::string("[") + op + "] " + name +
                          " must be a switchyard.dist.Communicator or None, got " +
                          py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
  }
  return &obj.cast<CommBox&>().get();
}

void bind_dist(py::module_& m) {
  py::class_<CommBox, std::shared_ptr<CommBox>>(m, "Communicator",
                                                "An expert-parallel communicator (MPI or local).")
      .def_property_readonly("rank", [](const CommBox& b) { return b.get().rank(); })
      .def_property_readonly("size", [](const CommBox& b) { return b.get().size(); })
      .def_property_readonly("name", [](const CommBox& b) { return b.get().name(); })
      .def("barrier",
           [](const CommBox& b) {
             py::gil_scoped_release nogil;
             b.get().barrier();
           })
      .def("allreduce_max",
           [](const CommBox& b, std::vector<int64_t> v) {
             {
               py::gil_scoped_release nogil;
               b.get().allreduce_max(v.data(), static_cast<int64_t>(v.size()));
             }
             return v;
           })
      .def("__repr__", [](const CommBox& b) {
        if (!b.comm) return std::string("<switchyard.dist.Communicator released>");
        return "<switchyard.dist.Communicator " + b.comm->name() + " rank " +
               std::to_string(b.comm->rank()) + " of " + std::to_string(b.comm->size()) + ">";
      });

  m.def("dist_mpi_built", &dist::mpi_built);
  m.def("dist_local", [] { return box(dist::local()); });
  m.def("dist_world", [] {
#ifdef SWITCHYARD_WITH_MPI
    ensure_mpi();
#endif
    return box(dist::world());
  });
  m.def(
      "dist_from_mpi_fortran", [](int64_t handle) { return box(dist::from_mpi_fortran(handle)); },
      py::arg("handle"));
  m.def("dist_shutdown", &shutdown);

  // The handle's integer tensors are what combine and the backwards read: Python gets copies (a
  // few ints per expert / row), so an in-place edit of them cannot corrupt a later backward.
  py::class_<dist::DispatchHandle>(m, "DispatchHandle",
                                   "What combine and the backwards need (returned by dispatch).")
      .def_property_readonly("kind",
                             [](const dist::DispatchHandle& h) {
                               return h.kind() == DispatcherKind::all_to_all ? "all_to_all"
                                                                             : "all_gather";
                             })
      .def_property_readonly("rank", &dist::DispatchHandle::rank)
      .def_property_readonly("world_size", &dist::DispatchHandle::world_size)
      .def_property_readonly("num_tokens", &dist::DispatchHandle::num_tokens)
      .def_property_readonly("hidden", &dist::DispatchHandle::hidden)
      .def_property_readonly("num_experts", &dist::DispatchHandle::num_experts)
      .def_property_readonly("num_local_experts", &dist::DispatchHandle::num_local_experts)
      .def_property_readonly("num_recv_tokens", &dist::DispatchHandle::num_recv_tokens)
      .def_property_readonly("num_tokens_per_expert",
                             [](const dist::DispatchHandle& h) {
                               return py_bridge::to_torch(h.num_tokens_per_expert().clone());
                             })
      .def_property_readonly(
          "num_unpadded_tokens_per_expert",
          [](const dist::DispatchHandle& h) {
            return py_bridge::to_torch(h.num_unpadded_tokens_per_expert().clone());
          })
      .def_property_readonly("expert_offsets",
                             [](const dist::DispatchHandle& h) {
                               return py_bridge::to_torch(h.expert_offsets().clone());
                             })
      .def_property_readonly("recv_src_rank",
                             [](const dist::DispatchHandle& h) {
                               return py_bridge::to_torch(h.recv_src_rank().clone());
                             })
      .def_property_readonly("recv_src_token",
                             [](const dist::DispatchHandle& h) {
                               return py_bridge::to_torch(h.recv_src_token().clone());
                             })
      .def_property_readonly("num_dropped", &dist::DispatchHandle::num_dropped);

  m.def(
      "dispatch",
      [](py::handle x, py::handle topk_idx, py::handle topk_weights, int64_t num_experts,
         const std::string& kind, double capacity_factor, const std::string& token_drop_policy,
         const CommBox& comm, int64_t expert_alignment, bool pad_to_capacity) {
        const char* op = "dispatch";
        dist::DispatchOptions opt;
        opt.num_experts = num_experts;
        opt.kind = kind_from_str(kind);
        opt.plan.capacity_factor = capacity_factor;
        opt.plan.token_drop_policy = drop_policy_from_str(token_drop_policy);
        opt.plan.expert_alignment = expert_alignment;
        opt.plan.pad_to_capacity = pad_to_capacity;
        py_bridge::Arg ax = py_bridge::borrow(x, op, "x");
        py_bridge::Arg ai = py_bridge::borrow(topk_idx, op, "topk_idx");
        py_bridge::Arg aw = py_bridge::borrow(topk_weights, op, "topk_weights");
        dist::Dispatcher& d = comm.dispatcher();
        dist::DispatchResult r;
        {
          py::gil_scoped_release nogil;
          r = d.dispatch(ax.t, ai.t, aw.t, opt);
        }
        py::object rx = py_bridge::to_torch(std::move(r.recv_x));
        py::object rw = py_bridge::to_torch(std::move(r.recv_topk_weights));
        return py::make_tuple(rx, rw, std::move(r.handle));
      },
      py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("num_experts"),
      py::arg("kind"), py::arg("capacity_factor"), py::arg("token_drop_policy"), py::arg("comm"),
      py::arg("expert_alignment") = 1, py::arg("pad_to_capacity") = false);
  m.def(
      "dist_fail_collective",
      [](const std::string& op, const std::string& message, const CommBox& comm) {
        const dist::CollectiveOp which =
            op == "dispatch" ? dist::CollectiveOp::dispatch : dist::CollectiveOp::combine;
        Communicator& c = comm.get();
        py::gil_scoped_release nogil;
        dist::fail_collective(which, message, c);
      },
      py::arg("op"), py::arg("message"), py::arg("comm"),
      "Joins op's error agreement with this rank's error: every rank raises ValueError.");
  m.def(
      "combine",
      [](py::handle expert_y, const dist::DispatchHandle& handle, bool apply_probs,
         const CommBox& comm) {
        py_bridge::Arg ay = py_bridge::borrow(expert_y, "combine", "expert_y");
        dist::Dispatcher& d = comm.dispatcher();
        Tensor y;
        {
          py::gil_scoped_release nogil;
          y = d.combine(ay.t, handle, weights_opt(apply_probs));
        }
        return py_bridge::to_torch(std::move(y));
      },
      py::arg("expert_y"), py::arg("handle"), py::arg("apply_probs"), py::arg("comm"));
  m.def(
      "dispatch_backward",
      [](py::handle grad_recv_x, const dist::DispatchHandle& handle, const CommBox& comm) {
        py_bridge::Arg ag = py_bridge::borrow(grad_recv_x, "dispatch_backward", "grad_recv_x");
        dist::Dispatcher& d = comm.dispatcher();
        Tensor g;
        {
          py::gil_scoped_release nogil;
          g = d.dispatch_backward(ag.t, handle);
        }
        return py_bridge::to_torch(std::move(g));
      },
      py::arg("grad_recv_x"), py::arg("handle"), py::arg("comm"));
  m.def(
      "dispatch_weights_backward",
      [](py::handle grad_recv_w, const dist::DispatchHandle& handle, const CommBox& comm) {
        py_bridge::Arg ag =
            py_bridge::borrow(grad_recv_w, "dispatch_weights_backward", "grad_recv_topk_weights");
        dist::Dispatcher& d = comm.dispatcher();
        Tensor g;
        {
          py::gil_scoped_release nogil;
          g = d.dispatch_weights_backward(ag.t, handle);
        }
        return py_bridge::to_torch(std::move(g));
      },
      py::arg("grad_recv_topk_weights"), py::arg("handle"), py::arg("comm"));
  m.def(
      "combine_backward",
      [](py::handle grad_y, py::handle expert_y, const dist::DispatchHandle& handle,
         bool apply_probs, const CommBox& comm) {
        const char* op = "combine_backward";
        py_bridge::Arg ag = py_bridge::borrow(grad_y, op, "grad_y");
        py_bridge::Arg ay = py_bridge::borrow(expert_y, op, "expert_y");
        dist::Dispatcher& d = comm.dispatcher();
        dist::CombineGrads g;
        {
          py::gil_scoped_release nogil;
          g = d.combine_backward(ag.t, ay.t, handle, weights_opt(apply_probs));
        }
        return py::make_tuple(py_bridge::to_torch(std::move(g.grad_expert_y)),
                              py_bridge::to_torch(std::move(g.grad_topk_weights)));
      },
      py::arg("grad_y"), py::arg("expert_y"), py::arg("handle"), py::arg("apply_probs"),
      py::arg("comm"));
}

}  // namespace switchyard::py_bind
