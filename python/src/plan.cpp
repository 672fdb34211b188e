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

/// The five row maps of a plan given as tensors (torch.ops.switchyard.permute / unpermute carry a
/// plan as tensors, so a compiled graph and torch.export can hold it), as a RoutingPlan that
/// borrows them. The kernels trust a plan, so every value that indexes memory is checked here:
/// row_token [R] int64 in [-1, T), row_weight [R] fp32, slot_row [T, K] int64 in [-1, R),
/// token_offsets [T+1] int64 from 0, nondecreasing, ending at P, token_rows [P] int64 in [0, R).
struct RowPlan {
  RoutingPlan plan;
  py_bridge::Arg keep[5];
};

void check_range(const Tensor& t, const char* op, const char* name, int64_t lo, int64_t hi) {
  const int64_t* p = t.data<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (p[i] < lo || p[i] >= hi) {
      throw py::value_error(std::string("[") + op + "] " + name + " must hold values in [" +
                            std::to_string(lo) + ", " + std::to_string(hi) + "), got " +
                            std::to_string(p[i]) + " at flat index " + std::to_string(i));
    }
  }
}

void check_rank(const Tensor& t, const char* op, const char* name, int64_t dim) {
  if (t.dim() != dim) {
    throw py::value_error(std::string("[") + op + "] " + name + " must have " +
                          std::to_string(dim) + " dimension(s), got " + std::to_string(t.dim()));
  }
}

void plan_of_rows(RowPlan& rp, const char* op, py::handle row_token, py::handle row_weight,
                  py::handle slot_row, py::handle token_offsets, py::handle token_rows) {
  py_bridge::Arg* k = rp.keep;
  k[0] = py_bridge::borrow(row_token, op, "row_token", {DType::int64});
  k[1] = py_bridge::borrow(row_weight, op, "row_weight", {DType::fp32});
  k[2] = py_bridge::borrow(slot_row, op, "slot_row", {DType::int64});
  k[3] = py_bridge::borrow(token_offsets, op, "token_offsets", {DType::int64});
  k[4] = py_bridge::borrow(token_rows, op, "token_rows", {DType::int64});
  check_rank(k[0].t, op, "row_token", 1);
  check_rank(k[1].t, op, "row_weight", 1);
  check_rank(k[2].t, op, "slot_row", 2);
  check_rank(k[3].t, op, "token_offsets", 1);
  check_rank(k[4].t, op, "token_rows", 1);
  const int64_t R = k[0].t.size(0), T = k[2].t.size(0), P = k[4].t.size(0);
  if (k[1].t.size(0) != R) {
    throw py::value_error(std::string("[") + op + "] row_weight must have row_token's " +
                          std::to_string(R) + " rows, got " + std::to_string(k[1].t.size(0)));
  }
  if (k[3].t.size(0) != T + 1) {
    throw py::value_error(std::string("[") + op + "] token_offsets must have num_tokens + 1 = " +
                          std::to_string(T + 1) + " entries (slot_row has " + std::to_string(T) +
                          " rows), got " + std::to_string(k[3].t.size(0)));
  }
  check_range(k[0].t, op, "row_token", -1, T);
  check_range(k[2].t, op, "slot_row", -1, R);
  check_range(k[4].t, op, "token_rows", 0, R);
  const int64_t* off = k[3].t.data<int64_t>();
  for (int64_t t = 0; t <= T; ++t) {
    const int64_t want_lo = t == 0 ? 0 : off[t - 1];
    if ((t == 0 && off[0] != 0) || off[t] < want_lo || off[t] > P || (t == T && off[T] != P)) {
      throw py::value_error(std::string("[") + op + "] token_offsets must start at 0, not " +
                            "decrease and end at token_rows' length " + std::to_string(P) +
                            ", got " + std::to_string(off[t]) + " at index " + std::to_string(t));
    }
  }
  RoutingPlan& p = rp.plan;
  p.num_tokens = T;
  p.top_k = k[2].t.size(1);
  p.num_rows = R;
  p.num_pairs = P;
  p.row_token = k[0].t;
  p.row_weight = k[1].t;
  p.slot_row = k[2].t;
  p.token_offsets = k[3].t;
  p.token_rows = k[4].t;
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
          "slot_row", [](const RoutingPlan& p) { return py_bridge::to_torch(p.slot_row.clone()); })
      .def_property_readonly(
          "token_offsets",
          [](const RoutingPlan& p) { return py_bridge::to_torch(p.token_offsets.clone()); })
      .def_property_readonly("token_rows", [](const RoutingPlan& p) {
        return py_bridge::to_torch(p.token_rows.clone());
      });
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

  // The same four over a plan given as its row maps (row_token, row_weight, slot_row,
  // token_offsets, token_rows): the kernels of torch.ops.switchyard.permute / unpermute.
  m.def(
      "permute_rows",
      [](py::handle x, py::handle rt, py::handle rw, py::handle sr, py::handle to, py::handle tr,
         bool backward) {
        const char* op = backward ? "permute_backward" : "permute";
        RowPlan rp;
        plan_of_rows(rp, op, rt, rw, sr, to, tr);
        py_bridge::Arg ax = py_bridge::borrow(x, op, backward ? "grad_permuted" : "x");
        Tensor out;
        {
          py::gil_scoped_release nogil;
          out = backward ? permute_backward(ax.t, rp.plan) : permute(ax.t, rp.plan);
        }
        return py_bridge::to_torch(std::move(out));
      },
      py::arg("x"), py::arg("row_token"), py::arg("row_weight"), py::arg("slot_row"),
      py::arg("token_offsets"), py::arg("token_rows"), py::arg("backward") = false);
  m.def(
      "unpermute_rows",
      [](py::handle permuted, py::handle rt, py::handle rw, py::handle sr, py::handle to,
         py::handle tr, bool apply_weights) {
        RowPlan rp;
        plan_of_rows(rp, "unpermute", rt, rw, sr, to, tr);
        py_bridge::Arg ap = py_bridge::borrow(permuted, "unpermute", "permuted");
        Tensor out;
        {
          py::gil_scoped_release nogil;
          out = unpermute(ap.t, rp.plan, weight_mode(apply_weights));
        }
        return py_bridge::to_torch(std::move(out));
      },
      py::arg("permuted"), py::arg("row_token"), py::arg("row_weight"), py::arg("slot_row"),
      py::arg("token_offsets"), py::arg("token_rows"), py::arg("apply_weights"));
  m.def(
      "unpermute_rows_backward",
      [](py::handle grad_y, py::handle permuted, py::handle rt, py::handle rw, py::handle sr,
         py::handle to, py::handle tr, bool apply_weights) {
        RowPlan rp;
        plan_of_rows(rp, "unpermute_backward", rt, rw, sr, to, tr);
        py_bridge::Arg ag = py_bridge::borrow(grad_y, "unpermute_backward", "grad_y");
        py_bridge::Arg ap = py_bridge::borrow(permuted, "unpermute_backward", "permuted");
        UnpermuteGrads g;
        {
          py::gil_scoped_release nogil;
          g = unpermute_backward(ag.t, ap.t, rp.plan, weight_mode(apply_weights));
        }
        return py::make_tuple(py_bridge::to_torch(std::move(g.grad_permuted)),
                              py_bridge::to_torch(std::move(g.grad_topk_weights)));
      },
      py::arg("grad_y"), py::arg("permuted"), py::arg("row_token"), py::arg("row_weight"),
      py::arg("slot_row"), py::arg("token_offsets"), py::arg("token_rows"),
      py::arg("apply_weights"));
}

}  // namespace switchyard::py_bind
