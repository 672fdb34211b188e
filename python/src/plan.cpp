// Bindings of the routing plan (include/switchyard/routing_plan.h) and the single-process
// permute / unpermute over it (permute.h): the path on which a route's capacity and padding
// (pad_to_capacity, padding_for_quantization) become rows of the experts' input.
#include <pybind11/stl.h>

#include <string>

#include "bindings.h"
#include "bridge.h"
#include "switchyard/permute.h"
#include "switchyard/routing_plan.h"

namespace switchyard::py_bind {

namespace {

/// [T, K] ids as int32: int32 borrowed, int64 converted once (range-checked).
Tensor plan_ids(py::handle obj, py_bridge::Arg& arg) {
  arg = py_bridge::borrow(obj, "routing_plan", "topk_idx", {DType::int32, DType::int64});
  if (arg.t.dtype() == DType::int32) return arg.t;
  const int64_t* p = arg.t.data<int64_t>();
  for (int64_t i = 0; i < arg.t.numel(); ++i) {
    if (p[i] < INT32_MIN || p[i] > INT32_MAX) {
      throw py::value_error("[routing_plan] topk_idx holds " + std::to_string(p[i]) +
                            " at flat index " + std::to_string(i) + ", outside the int32 range");
    }
  }
  return arg.t.to(DType::int32);
}

UnpermuteOptions weight_mode(bool apply_weights) {
  UnpermuteOptions o;
  o.weights = apply_weights ? WeightMode::apply : WeightMode::skip;
  return o;
}

}  // namespace

void bind_plan(py::module_& m) {
  py::class_<RoutingPlan>(m, "RoutingPlan",
                          "Rows of a token permutation: counts, padded offsets, row sources.")
      .def_readonly("num_tokens", &RoutingPlan::num_tokens)
      .def_readonly("num_experts", &RoutingPlan::num_experts)
      .def_readonly("top_k", &RoutingPlan::top_k)
      .def_readonly("num_pairs", &RoutingPlan::num_pairs)
      .def_readonly("num_dropped", &RoutingPlan::num_dropped)
      .def_readonly("num_rows", &RoutingPlan::num_rows)
      .def_property_readonly(
          "num_tokens_per_expert",
          [](const RoutingPlan& p) { return py_bridge::to_torch(p.num_tokens_per_expert.clone()); })
      .def_property_readonly(
          "expert_offsets",
          [](const RoutingPlan& p) { return py_bridge::to_torch(p.expert_offsets.clone()); })
      .def_property_readonly(
          "row_token", [](const RoutingPlan& p) { return py_bridge::to_torch(p.row_token.clone()); })
      .def_property_readonly(
          "row_expert",
          [](const RoutingPlan& p) { return py_bridge::to_torch(p.row_expert.clone()); })
      .def_property_readonly(
          "row_weight",
          [](const RoutingPlan& p) { return py_bridge::to_torch(p.row_weight.clone()); })
      .def_property_readonly(
          "slot_row", [](const RoutingPlan& p) { return py_bridge::to_torch(p.slot_row.clone()); });
  m.def(
      "build_routing_plan",
      [](py::handle topk_idx, py::handle topk_weights, int64_t num_experts,
         int64_t expert_alignment, double capacity_factor, int64_t expert_capacity,
         const std::string& token_drop_policy, bool pad_to_capacity) {
        const char* op = "routing_plan";
        py_bridge::Arg ai;
        Tensor idx = plan_ids(topk_idx, ai);
        py_bridge::Arg aw = py_bridge::borrow_optional(topk_weights, op, "topk_weights");
        RoutingPlanOptions o;
        o.expert_alignment = expert_alignment;
        o.capacity_factor = capacity_factor;
        o.expert_capacity = expert_capacity;
        if (token_drop_policy != "probs" && token_drop_policy != "position") {
          throw py::value_error(
              "[routing_plan] token_drop_policy must be 'probs' or 'position', got '" +
              token_drop_policy + "'");
        }
        o.token_drop_policy = parse_token_drop_policy(token_drop_policy);
        o.pad_to_capacity = pad_to_capacity;
        py::gil_scoped_release nogil;
        return build_routing_plan(idx, aw.t, num_experts, o);
      },
      py::arg("topk_idx"), py::arg("topk_weights"), py::arg("num_experts"),
      py::arg("expert_alignment"), py::arg("capacity_factor"), py::arg("expert_capacity"),
      py::arg("token_drop_policy"), py::arg("pad_to_capacity"));
  m.def(
      "permute",
      [](py::handle x, const RoutingPlan& plan) {
        py_bridge::Arg ax = py_bridge::borrow(x, "permute", "x");
        Tensor out;
        {
          py::gil_scoped_release nogil;
          out = permute(ax.t, plan);
        }
        return py_bridge::to_torch(std::move(out));
      },
      py::arg("x"), py::arg("plan"));
  m.def(
      "permute_backward",
      [](py::handle grad, const RoutingPlan& plan) {
        py_bridge::Arg ag = py_bridge::borrow(grad, "permute_backward", "grad_permuted");
        Tensor out;
        {
          py::gil_scoped_release nogil;
          out = permute_backward(ag.t, plan);
        }
        return py_bridge::to_torch(std::move(out));
      },
      py::arg("grad_permuted"), py::arg("plan"));
  m.def(
      "unpermute",
      [](py::handle permuted, const RoutingPlan& plan, bool apply_weights) {
        py_bridge::Arg ap = py_bridge::borrow(permuted, "unpermute", "permuted");
        Tensor out;
        {
          py::gil_scoped_release nogil;
          out = unpermute(ap.t, plan, weight_mode(apply_weights));
        }
        return py_bridge::to_torch(std::move(out));
      },
      py::arg("permuted"), py::arg("plan"), py::arg("apply_weights"));
  m.def(
      "unpermute_backward",
      [](py::handle grad_y, py::handle permuted, const RoutingPlan& plan, bool apply_weights) {
        py_bridge::Arg ag = py_bridge::borrow(grad_y, "unpermute_backward", "grad_y");
        py_bridge::Arg ap = py_bridge::borrow(permuted, "unpermute_backward", "permuted");
        UnpermuteGrads g;
        {
          py::gil_scoped_release nogil;
          g = unpermute_backward(ag.t, ap.t, plan, weight_mode(apply_weights));
        }
        return py::make_tuple(py_bridge::to_torch(std::move(g.grad_permuted)),
                              py_bridge::to_torch(std::move(g.grad_topk_weights)));
      },
      py::arg("grad_y"), py::arg("permuted"), py::arg("plan"), py::arg("apply_weights"));
}

}  // namespace switchyard::py_bind
