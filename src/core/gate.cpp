// Front-end of the router gate: validates every argument (dtypes, shapes, non-finite values)
// before any work, shapes and allocates the outputs on x's device, and calls the kernels through
// the backend seam (src/backend/backend.h). No math here.
#include "switchyard/gate.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <string>

#include "backend/backend.h"
#include "check.h"

namespace switchyard {
namespace {

constexpr const char* kFwd = "router_gating_linear";
constexpr const char* kBwd = "router_gating_linear_backward";

using detail::check_finite;

// An input in dtype `d` must convert exactly to the router dtype.
void check_upcast(const Tensor& t, const char* op, const char* name, DType router_dtype) {
  if (t.dtype() == DType::fp64 && router_dtype == DType::fp32) {
    detail::fail_arg(op, name,
                     " in fp64 needs options.router_dtype fp64 (inputs are upcast "
                     "exactly, never rounded down), got router_dtype fp32");
  }
}

struct Dims {
  int64_t num_tokens, hidden, num_experts;
};

// Checks options, x, weight and (optional) bias; returns T, H, E.
Dims check_inputs(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias,
                  const GateOptions& options) {
  const DType rd = options.router_dtype;
  if (rd != DType::fp32 && rd != DType::fp64) {
    detail::fail_arg(op, "options.router_dtype must be fp32 or fp64, got ", dtype_name(rd));
  }
  detail::check_dtype(x, op, "x", {DType::bf16, DType::fp32, DType::fp64});
  detail::check_dim(x, op, "x", 2);
  check_upcast(x, op, "x", rd);
  detail::check_dtype(weight, op, "weight", {DType::bf16, DType::fp32});
  detail::check_dim(weight, op, "weight", 2);
  detail::check_device(weight, op, "weight", x.device());
  detail::check_device(bias, op, "bias", x.device());
  const Dims d{x.size(0), x.size(1), weight.size(0)};
  if (weight.size(1) != d.hidden) {
    detail::fail_arg(op, "weight must have shape [num_experts, hidden=", d.hidden,
                     "] (hidden from x ", shape_str(x.shape()), "), got ",
                     shape_str(weight.shape()));
  }
  if (bias.defined()) {
    detail::check_dtype(bias, op, "bias", {DType::bf16, DType::fp32, DType::fp64});
    check_upcast(bias, op, "bias", rd);
    if (bias.dim() != 1 || bias.size(0) != d.num_experts) {
      detail::fail_arg(op, "bias must have shape [num_experts=", d.num_experts,
                       "] (num_experts from weight ", shape_str(weight.shape()), "), got ",
                       shape_str(bias.shape()));
    }
  }
  return d;
}

}  // namespace

Tensor router_gating_linear(const Tensor& x, const Tensor& weight, const Tensor& bias,
                            const GateOptions& options) {
  const Dims d = check_inputs(kFwd, x, weight, bias, options);
  check_finite(x, kFwd, "x", "token", "hidden");
  check_finite(weight, kFwd, "weight", "expert", "hidden");
  if (bias.defined()) check_finite(bias, kFwd, "bias", "expert", nullptr);

  Tensor logits = Tensor::empty({d.num_tokens, d.num_experts}, options.router_dtype, x.device());
  backend::gate_forward(backend::context_of(x, kFwd), x.raw(), x.dtype(), weight.raw(),
                        weight.dtype(), bias.defined() ? bias.raw() : nullptr,
                        bias.defined() ? bias.dtype() : options.router_dtype, logits.raw(),
                        options.router_dtype, d.num_tokens, d.hidden, d.num_experts);
  return logits;
}

GateGrads router_gating_linear_backward(const Tensor& grad_logits, const Tensor& x,
                                        const Tensor& weight, const Tensor& bias,
                                        const GateOptions& options) {
  const Dims d = check_inputs(kBwd, x, weight, bias, options);
  detail::check_dtype(grad_logits, kBwd, "grad_logits", {options.router_dtype});
  detail::check_device(grad_logits, kBwd, "grad_logits", x.device());
  if (grad_logits.dim() != 2 || grad_logits.size(0) != d.num_tokens ||
      grad_logits.size(1) != d.num_experts) {
    detail::fail_arg(kBwd, "grad_logits must have shape [num_tokens=", d.num_tokens,
                     ", num_experts=", d.num_experts, "] (from x ", shape_str(x.shape()),
                     " and weight ", shape_str(weight.shape()), "), got ",
                     shape_str(grad_logits.shape()));
  }
  check_finite(grad_logits, kBwd, "grad_logits", "token", "expert");
  check_finite(x, kBwd, "x", "token", "hidden");
  check_finite(weight, kBwd, "weight", "expert", "hidden");

  GateGrads g;
  g.grad_x = Tensor::empty(x.shape(), x.dtype(), x.device());
  g.grad_weight = Tensor::empty(weight.shape(), weight.dtype(), x.device());
  if (bias.defined()) {
    g.grad_bias = Tensor::empty({d.num_experts}, options.router_dtype, x.device());
  }
  backend::gate_backward(backend::context_of(x, kBwd), grad_logits.raw(), x.raw(), x.dtype(),
                         weight.raw(), weight.dtype(), g.grad_x.raw(), g.grad_weight.raw(),
                         bias.defined() ? g.grad_bias.raw() : nullptr, options.router_dtype,
                         d.num_tokens, d.hidden, d.num_experts);
  return g;
}

}  // namespace switchyard
