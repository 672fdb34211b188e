// Bindings of the router (include/switchyard/router.h) and router replay (replay.h).
#include "switchyard/router.h"

#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bindings.h"
#include "bridge.h"
#include "switchyard/replay.h"

namespace switchyard::py_bind {

namespace {
// The one spelling of ReplayRowPolicy in Python: "error", "native", "merge". Old spellings name the
// new one ("to_none" was route import's word for "native").
ReplayRowPolicy replay_row_policy(const std::string& s, const char* op, const char* name) {
  if (s == "error") return ReplayRowPolicy::error;
  if (s == "native") return ReplayRowPolicy::native;
  if (s == "merge") return ReplayRowPolicy::merge;
  if (s == "to_none") {
    throw py::value_error(std::string("[") + op + "] " + name +
                          "='to_none' is now spelled 'native' (the row is routed natively and "
                          "counted)");
  }
  throw py::value_error(std::string("[") + op + "] " + name +
                        " must be 'error', 'native' or 'merge', got '" + s + "'");
}
}  // namespace

namespace {

/// A RouteResult plus the Python objects whose storage it borrows (the logits): backward reads
/// them, so they live as long as the result.
struct PyRoute {
  RouteResult r;
  py::object keep_logits;
};

/// [T, K] ids as int32: int32 borrowed as is, int64 converted once (range-checked).
// Whether a row of this ReplayRowKind takes its ids (replayed, or merged repeats), as
// ReplayRows' counts count it; native and invalid rows are routed natively.
bool takes_ids(uint8_t kind) {
  const auto k = static_cast<ReplayRowKind>(kind);
  return k == ReplayRowKind::replayed || k == ReplayRowKind::merged;
}

Tensor ids_int32(py::handle obj, const char* op, const char* name, py_bridge::Arg& arg) {
  arg = py_bridge::borrow(obj, op, name, {DType::int32, DType::int64});
  if (arg.t.dtype() == DType::int32) return arg.t;
  const int64_t* p = arg.t.data<int64_t>();
  for (int64_t i = 0; i < arg.t.numel(); ++i) {
    if (p[i] < INT32_MIN || p[i] > INT32_MAX) {
      throw py::value_error(std::string("[") + op + "] " + name + " holds " + std::to_string(p[i]) +
                            " at flat index " + std::to_string(i) + ", outside the int32 range");
    }
  }
  return arg.t.to(DType::int32);
}

std::string config_repr(const RouterConfig& c) {
  std::string s = "RouterConfig(num_experts=" + std::to_string(c.num_experts) +
                  ", top_k=" + std::to_string(c.top_k) + ", score_function='" +
                  score_function_name(c.score_function) +
                  "', pre_softmax=" + (c.pre_softmax ? "True" : "False");
  s += ", num_groups=" + (c.num_groups ? std::to_string(c.num_groups) : std::string("None"));
  s += ", group_topk=" + (c.group_topk ? std::to_string(c.group_topk) : std::string("None"));
  s += ", topk_scaling_factor=" + py::repr(py::float_(c.topk_scaling_factor)).cast<std::string>();
  s += ", capacity_factor=" + (c.capacity_factor
                                   ? py::repr(py::float_(*c.capacity_factor)).cast<std::string>()
                                   : std::string("None"));
  s += std::string(", token_drop_policy='") + token_drop_policy_name(c.token_drop_policy) + "'";
  s += std::string(", pad_to_capacity=") + (c.pad_to_capacity ? "True" : "False");
  if (c.padding_for_quantization) {
    s += ", padding_for_quantization=True, padding_align_size=" +
         std::to_string(c.padding_align_size);
  }
  if (!c.aux_loss_types.empty()) {
    std::string t = "[", v = "[";
    for (size_t i = 0; i < c.aux_loss_types.size(); ++i) {
      t += std::string(i ? ", " : "") + "'" + aux_loss_type_name(c.aux_loss_types[i]) + "'";
      v += std::string(i ? ", " : "") +
           py::repr(py::float_(c.aux_loss_coeffs[i])).cast<std::string>();
    }
    s += ", aux_loss_type=" + t + "], aux_loss_coeff=" + v + "]";
  } else {
    s += std::string(", aux_loss_type=") +
         (c.aux_loss_type == AuxLossType::none
              ? std::string("None")
              : "'" + std::string(aux_loss_type_name(c.aux_loss_type)) + "'");
    s += ", aux_loss_coeff=" + py::repr(py::float_(c.aux_loss_coeff)).cast<std::string>();
  }
  if (c.calculate_per_token_loss) s += ", calculate_per_token_loss=True";
  if (c.is_mtp_layer) {
    s += std::string(", is_mtp_layer=True, mtp_use_repeated_layer=") +
         (c.mtp_use_repeated_layer ? "True" : "False") +
         ", mtp_num_layers=" + std::to_string(c.mtp_num_layers);
  }
  s += ", z_loss_coeff=" + py::repr(py::float_(c.z_loss_coeff)).cast<std::string>() + ")";
  return s;
}

/// Runs a collective update's conversions; one that fails on this rank joins the update's
/// agreement over `comm` (when given), so the other ranks raise too instead of waiting.
template <class Fn>
void joined(RouterCollective op, dist::Communicator* comm, Fn fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    if (comm && comm->size() > 1) {
      RouteComms comms;
      comms.loss = comm;
      const std::string msg = e.what();
      py::gil_scoped_release nogil;
      fail_router_collective(op, msg, comms);
    }
    throw;
  }
}

}  // namespace

void bind_router(py::module_& m) {
  py::class_<RouterConfig>(m, "RouterConfig",
                           "Router configuration; names and defaults follow Megatron-Core.")
      .def(py::init([](int64_t num_experts, int64_t top_k, const std::string& score_function,
                       bool pre_softmax, std::optional<int64_t> num_groups,
                       std::optional<int64_t> group_topk, std::optional<double> topk_scaling_factor,
                       std::optional<double> capacity_factor, const std::string& token_drop_policy,
                       bool pad_to_capacity, py::object aux_loss_type, py::object aux_loss_coeff,
                       double z_loss_coeff, bool calculate_per_token_loss, bool is_mtp_layer,
                       bool mtp_use_repeated_layer, std::optional<int64_t> mtp_num_layers,
                       bool force_load_balancing, std::optional<double> force_biased,
                       bool padding_for_quantization, bool padding_for_fp8,
                       std::optional<int64_t> padding_align_size) {
             RouterConfig c;
             c.num_experts = num_experts;
             c.top_k = top_k;
             c.score_function = parse_score_function(score_function);
             c.pre_softmax = pre_softmax;
             c.num_groups = num_groups.value_or(0);
             c.group_topk = group_topk.value_or(0);
             c.topk_scaling_factor = topk_scaling_factor.value_or(1.0);
             c.capacity_factor = capacity_factor;
             c.token_drop_policy = parse_token_drop_policy(token_drop_policy);
             c.pad_to_capacity = pad_to_capacity;
             // Megatron: moe_router_load_balancing_type is a name or a list of names, and
             // moe_aux_loss_coeff a number or a list of the same length.
             if (py::isinstance<py::list>(aux_loss_type) ||
                 py::isinstance<py::tuple>(aux_loss_type)) {
               for (py::handle t : aux_loss_type) {
                 c.aux_loss_types.push_back(parse_aux_loss_type(t.cast<std::string>()));
               }
               if (py::isinstance<py::list>(aux_loss_coeff) ||
                   py::isinstance<py::tuple>(aux_loss_coeff)) {
                 for (py::handle v : aux_loss_coeff) c.aux_loss_coeffs.push_back(v.cast<double>());
               } else {
                 throw py::value_error(
                     "[route] aux_loss_coeff must be a list with one coefficient per "
                     "aux_loss_type entry when aux_loss_type is a list, got " +
                     py::repr(aux_loss_coeff).cast<std::string>());
               }
             } else {
               c.aux_loss_type = aux_loss_type.is_none()
                                     ? AuxLossType::none
                                     : parse_aux_loss_type(aux_loss_type.cast<std::string>());
               if (py::isinstance<py::list>(aux_loss_coeff) ||
                   py::isinstance<py::tuple>(aux_loss_coeff)) {
                 throw py::value_error(
                     "[route] aux_loss_coeff is a list, so aux_loss_type must be a list of the "
                     "same length, got aux_loss_type=" +
                     py::repr(aux_loss_type).cast<std::string>());
               }
               c.aux_loss_coeff = aux_loss_coeff.cast<double>();
             }
             c.z_loss_coeff = z_loss_coeff;
             c.calculate_per_token_loss = calculate_per_token_loss;
             c.is_mtp_layer = is_mtp_layer;
             c.mtp_use_repeated_layer = mtp_use_repeated_layer;
             c.mtp_num_layers = mtp_num_layers.value_or(0);
             c.force_load_balancing = force_load_balancing;
             c.force_biased = force_biased.value_or(0.0);
             // Megatron: moe_router_padding_for_fp8 is the older alias; either turns padding on.
             c.padding_for_quantization = padding_for_quantization || padding_for_fp8;
             if (padding_align_size) c.padding_align_size = *padding_align_size;
             validate_router_config(c);
             return c;
           }),
           py::kw_only(), py::arg("num_experts"), py::arg("top_k"),
           py::arg("score_function") = "softmax", py::arg("pre_softmax") = false,
           py::arg("num_groups") = py::none(), py::arg("group_topk") = py::none(),
           py::arg("topk_scaling_factor") = py::none(), py::arg("capacity_factor") = py::none(),
           py::arg("token_drop_policy") = "probs", py::arg("pad_to_capacity") = false,
           py::arg("aux_loss_type") = py::none(), py::arg("aux_loss_coeff") = 0.0,
           py::arg("z_loss_coeff") = 0.0, py::arg("calculate_per_token_loss") = false,
           py::arg("is_mtp_layer") = false, py::arg("mtp_use_repeated_layer") = false,
           py::arg("mtp_num_layers") = py::none(), py::arg("force_load_balancing") = false,
           py::arg("force_biased") = py::none(), py::arg("padding_for_quantization") = false,
           py::arg("padding_for_fp8") = false, py::arg("padding_align_size") = py::none())
      .def_readonly("num_experts", &RouterConfig::num_experts)
      .def_readonly("top_k", &RouterConfig::top_k)
      .def_property_readonly(
          "score_function",
          [](const RouterConfig& c) { return score_function_name(c.score_function); })
      .def_readonly("pre_softmax", &RouterConfig::pre_softmax)
      .def_property_readonly("num_groups",
                             [](const RouterConfig& c) -> std::optional<int64_t> {
                               if (c.num_groups) return c.num_groups;
                               return std::nullopt;
                             })
      .def_property_readonly("group_topk",
                             [](const RouterConfig& c) -> std::optional<int64_t> {
                               if (c.group_topk) return c.group_topk;
                               return std::nullopt;
                             })
      .def_readonly("topk_scaling_factor", &RouterConfig::topk_scaling_factor)
      .def_readonly("capacity_factor", &RouterConfig::capacity_factor)
      .def_property_readonly(
          "token_drop_policy",
          [](const RouterConfig& c) { return token_drop_policy_name(c.token_drop_policy); })
      .def_readonly("pad_to_capacity", &RouterConfig::pad_to_capacity)
      .def_readonly("padding_for_quantization", &RouterConfig::padding_for_quantization)
      .def_readonly("padding_align_size", &RouterConfig::padding_align_size)
      .def_property_readonly("aux_loss_type",
                             [](const RouterConfig& c) -> py::object {
                               if (!c.aux_loss_types.empty()) {
                                 py::list l;
                                 for (AuxLossType t : c.aux_loss_types) l.append(aux_loss_type_name(t));
                                 return l;
                               }
                               if (c.aux_loss_type == AuxLossType::none) return py::none();
                               return py::str(aux_loss_type_name(c.aux_loss_type));
                             })
      .def_property_readonly("aux_loss_coeff",
                             [](const RouterConfig& c) -> py::object {
                               if (!c.aux_loss_types.empty()) return py::cast(c.aux_loss_coeffs);
                               return py::float_(c.aux_loss_coeff);
                             })
      .def_readonly("calculate_per_token_loss", &RouterConfig::calculate_per_token_loss)
      .def_readonly("is_mtp_layer", &RouterConfig::is_mtp_layer)
      .def_readonly("force_load_balancing", &RouterConfig::force_load_balancing)
      .def_property_readonly("force_biased",
                             [](const RouterConfig& c) -> std::optional<double> {
                               if (c.force_biased != 0.0) return c.force_biased;
                               return std::nullopt;
                             })
      .def_readonly("mtp_use_repeated_layer", &RouterConfig::mtp_use_repeated_layer)
      .def_property_readonly("mtp_num_layers",
                             [](const RouterConfig& c) -> std::optional<int64_t> {
                               if (c.mtp_num_layers) return c.mtp_num_layers;
                               return std::nullopt;
                             })
      .def_readonly("z_loss_coeff", &RouterConfig::z_loss_coeff)
      .def("__repr__", &config_repr);

  py::class_<GlobalAuxLossState>(
      m, "GlobalAuxLossState", "Running per-expert counts of global_aux_loss (one per MoE layer).")
      .def(py::init<>())
      .def("reset", &GlobalAuxLossState::reset)
      .def(
          "copy",
          [](const GlobalAuxLossState& s) {
            GlobalAuxLossState c;
            c.steps = s.steps;
            if (s.num_tokens_per_expert.defined()) c.num_tokens_per_expert = s.num_tokens_per_expert.clone();
            return c;
          },
          "An independent snapshot (for a recompute that must reproduce its forward).")
      .def_readonly("steps", &GlobalAuxLossState::steps)
      .def_property_readonly("num_tokens_per_expert", [](const GlobalAuxLossState& s) {
        return py_bridge::to_torch(s.num_tokens_per_expert.defined() ? s.num_tokens_per_expert.clone()
                                                                 : Tensor());
      });

  py::class_<PyRoute>(m, "RouteResult", "Result of topk_route and the handle of its backward.")
      .def_property_readonly("topk_weights",
                             [](const PyRoute& p) { return py_bridge::to_torch(p.r.topk_weights); })
      .def_property_readonly("topk_idx",
                             [](const PyRoute& p) { return py_bridge::to_torch(p.r.topk_idx); })
      .def_property_readonly(
          "num_tokens_per_expert",
          [](const PyRoute& p) { return py_bridge::to_torch(p.r.num_tokens_per_expert); })
      .def_property_readonly("expert_capacity",
                             [](const PyRoute& p) { return p.r.expert_capacity; })
      .def_property_readonly("num_dropped", [](const PyRoute& p) { return p.r.num_dropped; })
      .def_property_readonly("pad_to_capacity",
                             [](const PyRoute& p) { return p.r.pad_to_capacity; })
      .def_property_readonly("expert_alignment",
                             [](const PyRoute& p) { return p.r.expert_alignment; })
      .def_property_readonly(
          "qb_beta_local", [](const PyRoute& p) { return py_bridge::to_torch(p.r.qb_beta_local); })
      .def_property_readonly("aux_loss", [](const PyRoute& p) { return p.r.aux_loss; })
      .def_property_readonly("z_loss", [](const PyRoute& p) { return p.r.z_loss; })
      .def_property_readonly("aux_loss_parts",
                             [](const PyRoute& p) {
                               py::dict d;
                               d["aux_loss"] = p.r.aux_loss_parts.aux_loss;
                               d["seq_aux_loss"] = p.r.aux_loss_parts.seq_aux_loss;
                               d["global_aux_loss"] = p.r.aux_loss_parts.global_aux_loss;
                               return d;
                             })
      .def_property_readonly("num_replayed_rows",
                             [](const PyRoute& p) { return p.r.num_replayed_rows; })
      .def_property_readonly("num_native_rows",
                             [](const PyRoute& p) { return p.r.num_native_rows; })
      .def_property_readonly("num_padded_rows",
                             [](const PyRoute& p) { return p.r.num_padded_rows; })
      .def_property_readonly("num_invalid_replay_rows",
                             [](const PyRoute& p) { return p.r.num_invalid_replay_rows; });

  m.def(
      "topk_route",
      [](py::handle logits, const RouterConfig& config, py::handle expert_bias,
         py::handle replay_idx, py::handle padding_mask, GlobalAuxLossState* global_state,
         const std::string& invalid_replay_rows, int64_t layer, int64_t seq_length,
         bool accumulate_global_aux_loss, uint64_t force_seed, uint64_t force_bias_seed,
         bool training, py::handle qb_beta, py::handle loss_comm,
         py::handle global_aux_loss_comm) {
        const char* op = "topk_route";
        RouteComms comms;
        comms.loss = communicator_of(loss_comm, op, "loss_comm");
        comms.global_aux_loss = communicator_of(global_aux_loss_comm, op, "global_aux_loss_comm");
        bool engine_called = false;
        try {
          RouteOptions opt;
          opt.invalid_replay_rows = replay_row_policy(invalid_replay_rows, op, "invalid_replay_rows");
          opt.layer = layer;
          opt.seq_length = seq_length;
          opt.global_aux_loss_update = accumulate_global_aux_loss ? GlobalAuxLossUpdate::accumulate
                                                                  : GlobalAuxLossUpdate::read_only;
          opt.force_seed = force_seed;
          opt.training = training;
          opt.force_bias_seed = force_bias_seed;
          py_bridge::Arg al = py_bridge::borrow(logits, op, "logits");
          py_bridge::Arg ab = py_bridge::borrow_optional(expert_bias, op, "expert_bias");
          py_bridge::Arg am = py_bridge::borrow_optional(padding_mask, op, "padding_mask");
          py_bridge::Arg ar;
          py_bridge::Arg aq = py_bridge::borrow_optional(qb_beta, op, "qb_beta");
          RouteInputs in;
          in.qb_beta = aq.t;
          in.expert_bias = ab.t;
          in.padding_mask = am.t;
          if (!replay_idx.is_none()) in.replay_idx = ids_int32(replay_idx, op, "replay_idx", ar);
          in.global_aux_loss_state = global_state;
          auto out = std::make_unique<PyRoute>();
          {
            py::gil_scoped_release nogil;
            engine_called = true;
            out->r = comms.loss || comms.global_aux_loss ? topk_route(al.t, in, config, opt, comms)
                                                         : topk_route(al.t, in, config, opt);
          }
          out->keep_logits = al.keep;
          return out;
        } catch (const std::exception& e) {
          // A conversion that failed on this rank only joins the route's agreement, so the other
          // ranks raise too instead of waiting for this one (the engine call agrees by itself).
          if (!engine_called && ((comms.loss && comms.loss->size() > 1) ||
                                 (comms.global_aux_loss && comms.global_aux_loss->size() > 1))) {
            const std::string msg = e.what();
            py::gil_scoped_release nogil;
            fail_router_collective(RouterCollective::topk_route, msg, comms);
          }
          throw;
        }
      },
      py::arg("logits"), py::arg("config"), py::arg("expert_bias"), py::arg("replay_idx"),
      py::arg("padding_mask"), py::arg("global_aux_loss_state"), py::arg("invalid_replay_rows"),
      py::arg("layer"), py::arg("seq_length"), py::arg("accumulate_global_aux_loss") = true,
      py::arg("force_seed") = 0, py::arg("force_bias_seed") = 0, py::arg("training") = true,
      py::arg("qb_beta") = py::none(), py::arg("loss_comm") = py::none(),
      py::arg("global_aux_loss_comm") = py::none());
  m.def(
      "router_fail_collective",
      [](const std::string& op, const std::string& message, py::handle loss_comm,
         py::handle global_aux_loss_comm) {
        const RouterCollective which = op == "topk_route" ? RouterCollective::topk_route
                                       : op == "update_expert_bias"
                                           ? RouterCollective::update_expert_bias
                                           : RouterCollective::update_qb_beta;
        RouteComms comms;
        comms.loss = communicator_of(loss_comm, op.c_str(), "loss_comm");
        comms.global_aux_loss =
            communicator_of(global_aux_loss_comm, op.c_str(), "global_aux_loss_comm");
        py::gil_scoped_release nogil;
        fail_router_collective(which, message, comms);
      },
      py::arg("op"), py::arg("message"), py::arg("loss_comm") = py::none(),
      py::arg("global_aux_loss_comm") = py::none());
  m.def(
      "topk_route_backward",
      [](py::handle grad_topk_weights, const PyRoute& route, double loss_grad_scale) {
        py_bridge::Arg ag = py_bridge::borrow_optional(grad_topk_weights, "topk_route_backward",
                                                       "grad_topk_weights");
        RouteBackwardOptions opt;
        opt.loss_grad_scale = loss_grad_scale;
        RouteGrads g;
        {
          py::gil_scoped_release nogil;
          g = topk_route_backward(ag.t, route.r, opt);
        }
        return py_bridge::to_torch(std::move(g.grad_logits));
      },
      py::arg("grad_topk_weights"), py::arg("route"), py::arg("loss_grad_scale"));
  m.def(
      "input_jitter",
      [](py::handle x, double eps, uint64_t seed, bool backward) {
        const char* op = backward ? "input_jitter_backward" : "input_jitter";
        py_bridge::Arg ax = py_bridge::borrow(x, op, backward ? "grad" : "x");
        Tensor out;
        {
          py::gil_scoped_release nogil;
          out = backward ? input_jitter_backward(ax.t, eps, seed) : input_jitter(ax.t, eps, seed);
        }
        return py_bridge::to_torch(std::move(out));
      },
      py::arg("x"), py::arg("eps"), py::arg("seed"), py::arg("backward") = false);
  m.def(
      "update_expert_bias",
      [](py::handle expert_bias, py::handle num_tokens_per_expert, double rate, py::handle comm) {
        const char* op = "update_expert_bias";
        dist::Communicator* c = communicator_of(comm, op, "comm");
        py_bridge::Arg ab, ac;
        joined(RouterCollective::update_expert_bias, c, [&] {
          ab = py_bridge::borrow(expert_bias, op, "expert_bias");
          ac = py_bridge::borrow(num_tokens_per_expert, op, "num_tokens_per_expert");
        });
        Tensor out;
        {
          py::gil_scoped_release nogil;
          out = c ? update_expert_bias(ab.t, ac.t, rate, *c) : update_expert_bias(ab.t, ac.t, rate);
        }
        return py_bridge::to_torch(std::move(out));
      },
      py::arg("expert_bias"), py::arg("num_tokens_per_expert"), py::arg("rate"),
      py::arg("comm") = py::none());

  m.def(
      "update_qb_beta",
      [](py::handle qb_beta, py::handle qb_beta_accum, int64_t count, double ema, py::handle comm) {
        const char* op = "update_qb_beta";
        dist::Communicator* c = communicator_of(comm, op, "comm");
        py_bridge::Arg ab, aa;
        joined(RouterCollective::update_qb_beta, c, [&] {
          ab = py_bridge::borrow(qb_beta, op, "qb_beta");
          aa = py_bridge::borrow(qb_beta_accum, op, "qb_beta_accum");
        });
        Tensor out;
        {
          py::gil_scoped_release nogil;
          out = c ? update_qb_beta(ab.t, aa.t, count, ema, *c)
                  : update_qb_beta(ab.t, aa.t, count, ema);
        }
        return py_bridge::to_torch(std::move(out));
      },
      py::arg("qb_beta"), py::arg("qb_beta_accum"), py::arg("count"), py::arg("ema"),
      py::arg("comm") = py::none());

  py::class_<RouterReplay>(m, "RouterReplayCore", "Replay queues of one MoE layer (engine object).")
      .def(py::init([](int64_t top_k, int64_t layer) {
             RouterReplayOptions o;
             o.top_k = top_k;
             o.layer = layer;
             return RouterReplay(o);
           }),
           py::arg("top_k"), py::arg("layer") = -1)
      .def("record",
           [](RouterReplay& r, py::handle ids) {
             py_bridge::Arg a;
             r.record(ids_int32(ids, "replay.record", "topk_idx", a));
           })
      .def("pop_recorded", [](RouterReplay& r) { return py_bridge::to_torch(r.pop_recorded()); })
      .def("replay_forward",
           [](RouterReplay& r, py::handle ids) {
             py_bridge::Arg a;
             return py_bridge::to_torch(
                 r.replay_forward(ids_int32(ids, "replay.replay_forward", "topk_idx", a)));
           })
      .def("recompute",
           [](RouterReplay& r, int64_t num_tokens) {
             return py_bridge::to_torch(r.recompute(num_tokens));
           })
      .def("peek_recorded",
           [](const RouterReplay& r) { return py_bridge::to_torch(r.peek_recorded().clone()); })
      .def("peek_recompute",
           [](const RouterReplay& r, int64_t num_tokens) {
             return py_bridge::to_torch(r.peek_recompute(num_tokens).clone());
           })
      .def_property_readonly("num_recorded", &RouterReplay::num_recorded)
      .def_property_readonly("num_pending_recompute", &RouterReplay::num_pending_recompute)
      .def_property_readonly("layer", &RouterReplay::layer)
      .def("drop_newest_recompute", &RouterReplay::drop_newest_recompute, py::arg("n"))
      .def_property_readonly("top_k", &RouterReplay::top_k)
      .def("clear", &RouterReplay::clear)
      // copy.deepcopy of a model that holds replays (e.g. TRL's reference model): independent
      // queues, every table cloned.
      .def("__copy__", [](const RouterReplay& r) { return r.clone(); })
      .def(
          "__deepcopy__", [](const RouterReplay& r, py::dict) { return r.clone(); },
          py::arg("memo"));

  py::class_<ReplayRows>(m, "ReplayRowsCore", "Row kinds of a replay table (engine object).")
      .def_property_readonly("kind",
                             [](const ReplayRows& r) { return py_bridge::to_torch(r.kind); })
      // [T] bool: the rows that take their ids (replayed and merged), made here in one pass
      // (the same mask from torch comparisons of `kind` is three operators per layer and step).
      .def_property_readonly("replayed",
                             [](const ReplayRows& r) {
                               const int64_t T = r.kind.numel();
                               Tensor out = Tensor::empty({T}, DType::boolean);
                               const uint8_t* k = r.kind.data<uint8_t>();
                               bool* o = out.data<bool>();
                               for (int64_t i = 0; i < T; ++i) o[i] = takes_ids(k[i]);
                               return py_bridge::to_torch(out);
                             })
      // int64 [n]: the rows routed natively (native and invalid), in order: a replayed forward
      // selects live ids for these rows alone.
      .def_property_readonly("native_rows",
                             [](const ReplayRows& r) {
                               const int64_t T = r.kind.numel();
                               const uint8_t* k = r.kind.data<uint8_t>();
                               int64_t n = 0;
                               for (int64_t i = 0; i < T; ++i) n += !takes_ids(k[i]);
                               Tensor out = Tensor::empty({n}, DType::int64);
                               int64_t* o = out.data<int64_t>();
                               for (int64_t i = 0, j = 0; i < T; ++i) {
                                 if (!takes_ids(k[i])) o[j++] = i;
                               }
                               return py_bridge::to_torch(out);
                             })
      .def_readonly("num_replayed", &ReplayRows::num_replayed)
      .def_readonly("num_merged", &ReplayRows::num_merged)
      .def_readonly("num_native", &ReplayRows::num_native)
      .def_readonly("num_invalid", &ReplayRows::num_invalid)
      .def_readonly("num_pairs", &ReplayRows::num_pairs);
  m.def(
      "classify_replay_rows",
      [](py::handle topk_idx, int64_t num_experts, const std::string& policy, int64_t layer) {
        const char* op = "replay.classify_rows";
        const ReplayRowPolicy p = replay_row_policy(policy, op, "policy");
        py_bridge::Arg a;
        return classify_replay_rows(ids_int32(topk_idx, op, "topk_idx", a), num_experts, p, layer);
      },
      py::arg("topk_idx"), py::arg("num_experts"), py::arg("policy") = "error",
      py::arg("layer") = -1);
}

}  // namespace switchyard::py_bind
