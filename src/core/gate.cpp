// Front-end of the router gate: validates every argument (dtypes, shapes, non-finite values)
// before any work, shapes and allocates the outputs, and calls the CPU kernels. No math here.
#include "switchyard/gate.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <string>

#include "check.h"
#include "cpu/gate_kernels.h"

namespace switchyard {
namespace {

constexpr const char* kFwd = "router_gating_linear";
constexpr const char* kBwd = "router_gating_linear_backward";

// Exponent all ones <=> NaN or Inf. Integer tests on the bits vectorise.
inline bool non_finite(bf16 v) { return (v.bits & 0x7f80u) == 0x7f80u; }
inline bool non_finite(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7f800000u) == 0x7f800000u;
}
inline bool non_finite(double v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

// Flat index of the first NaN/Inf in p[0, n), or n when there is none.
template <class T>
int64_t first_non_finite(const T* p, int64_t n) {
  constexpr int64_t kChunk = 4096;
  const int64_t nchunk = (n + kChunk - 1) / kChunk;
  int64_t first = n;
#pragma omp parallel for schedule(static) reduction(min : first) if (n > (int64_t{1} << 16))
  for (int64_t c = 0; c < nchunk; ++c) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    int bad = 0;
    for (int64_t i = i0; i < i1; ++i) bad |= static_cast<int>(non_finite(p[i]));
    if (bad) {
      for (int64_t i = i0; i < i1; ++i) {
        if (non_finite(p[i])) {
          first = std::min(first, i);
          break;
        }
      }
    }
  }
  return first;
}

std::string value_str(double v) {
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}

int64_t first_non_finite(const Tensor& t) {
  switch (t.dtype()) {
    case DType::bf16:
      return first_non_finite(t.data<bf16>(), t.numel());
    case DType::fp32:
      return first_non_finite(t.data<float>(), t.numel());
    default:
      return first_non_finite(t.data<double>(), t.numel());
  }
}

// Throws "[op] name has a non-finite value nan at row_name r, col_name c" for the first NaN/Inf of
// a 2-D (or 1-D, col_name null) tensor.
void check_finite(const Tensor& t, const char* op, const char* name, const char* row_name,
                  const char* col_name) {
  const int64_t i = first_non_finite(t);
  if (i == t.numel()) return;
  const std::string v = value_str(t.item_as_double(i));
  if (col_name == nullptr)
    detail::fail_arg(op, name, " has a non-finite value ", v, " at ", row_name, " ", i);
  const int64_t cols = t.size(1);
  detail::fail_arg(op, name, " has a non-finite value ", v, " at ", row_name, " ", i / cols, ", ",
                   col_name, " ", i % cols);
}

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

  Tensor logits = Tensor::empty({d.num_tokens, d.num_experts}, options.router_dtype);
  cpu::gate_forward(x.raw(), x.dtype(), weight.raw(), weight.dtype(),
                    bias.defined() ? bias.raw() : nullptr,
                    bias.defined() ? bias.dtype() : options.router_dtype, logits.raw(),
                    options.router_dtype, d.num_tokens, d.hidden, d.num_experts);
  return logits;
}

GateGrads router_gating_linear_backward(const Tensor& grad_logits, const Tensor& x,
                                        const Tensor& weight, const Tensor& bias,
                                        const GateOptions& options) {
  const Dims d = check_inputs(kBwd, x, weight, bias, options);
  detail::check_dtype(grad_logits, kBwd, "grad_logits", {options.router_dtype});
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
  g.grad_x = Tensor::empty(x.shape(), x.dtype());
  g.grad_weight = Tensor::empty(weight.shape(), weight.dtype());
  if (bias.defined()) g.grad_bias = Tensor::empty({d.num_experts}, options.router_dtype);
  cpu::gate_backward(grad_logits.raw(), x.raw(), x.dtype(), weight.raw(), weight.dtype(),
                     g.grad_x.raw(), g.grad_weight.raw(),
                     bias.defined() ? g.grad_bias.raw() : nullptr, options.router_dtype,
                     d.num_tokens, d.hidden, d.num_experts);
  return g;
}

}  // namespace switchyard
