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
  auto check_all_finite = [&] {
    check_finite(x, kFwd, "x", "token", "hidden");
    check_finite(weight, kFwd, "weight", "expert", "hidden");
    if (bias.defined()) check_finite(bias, kFwd, "bias", "expert", nullptr);
  };
  // Every logit is a chain over all of x's row and W's row (+ the bias): a NaN/Inf anywhere in
  // x[t, :] makes every logits[t, :] non-finite, one in W[e, :] or b[e] every logits[:, e] (an
  // fma with an Inf operand gives ±Inf or NaN, and nothing finite comes back from either). So with
  // T, H, E >= 1, finite logits prove finite inputs, and the scan reads T·E values instead of
  // T·H + E·H (16x fewer at Qwen3's H 2048, E 128). When a logit is not finite, the inputs are
  // scanned in the usual order for the message (finite inputs can still overflow: then the logits
  // are returned as computed). The forward has no state to undo, so rejecting after the product
  // leaves nothing behind.
  const bool scan_inputs_first = d.num_tokens == 0 || d.hidden == 0 || d.num_experts == 0;
  if (scan_inputs_first) check_all_finite();

  Tensor logits = Tensor::empty({d.num_tokens, d.num_experts}, options.router_dtype, x.device());
  backend::gate_forward(backend::context_of(x, kFwd), x.raw(), x.dtype(), weight.raw(),
                        weight.dtype(), bias.defined() ? bias.raw() : nullptr,
                        bias.defined() ? bias.dtype() : options.router_dtype, logits.raw(),
                        options.router_dtype, d.num_tokens, d.hidden, d.num_experts);
  if (!scan_inputs_first && detail::first_non_finite(logits) < logits.numel()) check_all_finite();
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
  auto check_x_and_weight = [&] {
    check_finite(x, kBwd, "x", "token", "hidden");
    check_finite(weight, kBwd, "weight", "expert", "hidden");
  };
  // x [T,H] is the one large input. A NaN/Inf at x[t,h] reaches grad_weight[e,h] for every e
  // with grad_logits[t,e] != 0 (fma(g != 0, ±Inf or NaN, acc) is not finite, and nothing finite
  // comes back), and for every e on the dense path (g = 0 gives NaN). So after the product: scan
  // grad_weight [E,H] and the x rows whose grad_logits row is all zero (the sparse path skips
  // them); only when one of those is not finite are x and W scanned in the usual order for the
  // message (finite inputs can still overflow: then the gradients are returned as computed).
  // W itself is tested directly (grad_x rows that use it are as large as x). The kernel tests W
  // and grad_weight in its own passes over them (W as it packs it, grad_weight as it stores it)
  // and says whether both were finite: a separate scan read 2·E·H values again, 14 MB at
  // DeepSeek-V3's router in fp32. No state to undo.
  const bool scan_inputs_first = d.num_tokens == 0 || d.hidden == 0 || d.num_experts == 0;
  if (scan_inputs_first) check_x_and_weight();

  GateGrads g;
  g.grad_x = Tensor::empty(x.shape(), x.dtype(), x.device());
  g.grad_weight = Tensor::empty(weight.shape(), weight.dtype(), x.device());
  if (bias.defined()) {
    g.grad_bias = Tensor::empty({d.num_experts}, options.router_dtype, x.device());
  }
  const bool weight_and_grad_finite =
      backend::gate_backward(backend::context_of(x, kBwd), grad_logits.raw(), x.raw(), x.dtype(),
                             weight.raw(), weight.dtype(), g.grad_x.raw(), g.grad_weight.raw(),
                             bias.defined() ? g.grad_bias.raw() : nullptr, options.router_dtype,
                             d.num_tokens, d.hidden, d.num_experts);
  if (!scan_inputs_first) {
    bool suspect = !weight_and_grad_finite;
    const int64_t E = d.num_experts, H = d.hidden;
    const size_t esize = dtype_size(x.dtype());
    for (int64_t t = 0; t < d.num_tokens && !suspect; ++t) {
      bool empty_row = true;
      for (int64_t e = 0; e < E && empty_row; ++e) {
        empty_row = grad_logits.dtype() == DType::fp64
                        ? grad_logits.data<double>()[t * E + e] == 0.0
                        : grad_logits.data<float>()[t * E + e] == 0.0f;
      }
      if (empty_row) {
        const void* row = static_cast<const char*>(x.raw()) + static_cast<size_t>(t * H) * esize;
        suspect = backend::first_non_finite(backend::context_of(x, kBwd), row, x.dtype(), H) < H;
      }
    }
    if (suspect) check_x_and_weight();
  }
  return g;
}

}  // namespace switchyard
