// Double-precision references for the router gate, written from the maths in plain loops:
//   logits = x·Wᵀ + b,  grad_x = G·W,  grad_w = Gᵀ·X,  grad_b = Σ_t G.
// Plus the "chain" references: the exact reduction order the gate promises (one fma chain per
// output, in the router dtype, rounded once), also in plain loops, for bitwise checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "switchyard/tensor.h"

namespace switchyard::ref {

/// A value and Σ|terms| (for rigorous rounding-error bounds).
struct GateRefOut {
  std::vector<double> value;
  std::vector<double> abs_sum;
};

/// logits[t,e] = Σ_h x[t,h]·w[e,h] + b[e] in double (bias may be undefined).
inline GateRefOut gate_forward_ref(const Tensor& x, const Tensor& w, const Tensor& b) {
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  const std::vector<double> xd = x.to_double_vector(), wd = w.to_double_vector();
  const std::vector<double> bd = b.defined() ? b.to_double_vector() : std::vector<double>();
  GateRefOut r{std::vector<double>(T * E), std::vector<double>(T * E)};
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double s = 0, a = 0;
      for (int64_t h = 0; h < H; ++h) {
        s += xd[t * H + h] * wd[e * H + h];
        a += std::fabs(xd[t * H + h] * wd[e * H + h]);
      }
      if (b.defined()) {
        s += bd[e];
        a += std::fabs(bd[e]);
      }
      r.value[t * E + e] = s;
      r.abs_sum[t * E + e] = a;
    }
  }
  return r;
}

struct GateGradRef {
  GateRefOut grad_x, grad_w, grad_b;
};

/// grad_x = G·W, grad_w = Gᵀ·X, grad_b = Σ_t G, in double.
inline GateGradRef gate_backward_ref(const Tensor& g, const Tensor& x, const Tensor& w) {
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  const std::vector<double> gd = g.to_double_vector(), xd = x.to_double_vector(),
                            wd = w.to_double_vector();
  GateGradRef r;
  r.grad_x = {std::vector<double>(T * H), std::vector<double>(T * H)};
  r.grad_w = {std::vector<double>(E * H), std::vector<double>(E * H)};
  r.grad_b = {std::vector<double>(E), std::vector<double>(E)};
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const double ge = gd[t * E + e];
      r.grad_b.value[e] += ge;
      r.grad_b.abs_sum[e] += std::fabs(ge);
      for (int64_t h = 0; h < H; ++h) {
        r.grad_x.value[t * H + h] += ge * wd[e * H + h];
        r.grad_x.abs_sum[t * H + h] += std::fabs(ge * wd[e * H + h]);
        r.grad_w.value[e * H + h] += ge * xd[t * H + h];
        r.grad_w.abs_sum[e * H + h] += std::fabs(ge * xd[t * H + h]);
      }
    }
  }
  return r;
}

/// bf16 nearest to v (ties to even mantissa), chosen among neighbours by distance in double.
inline bf16 round_to_bf16(double v) {
  if (std::isnan(v)) return float_to_bf16(static_cast<float>(v));
  const bf16 c = float_to_bf16(static_cast<float>(v));  // within one bf16 step of the answer
  bf16 best = c;
  double best_err = INFINITY;
  for (int d = -1; d <= 1; ++d) {
    const bf16 n{static_cast<uint16_t>(c.bits + d)};
    const double nv = bf16_to_float(n);
    if (std::isnan(nv) || (nv == 0 && v != 0 && std::signbit(nv) != std::signbit(v))) continue;
    const double err =
        std::isinf(nv) ? (std::fabs(v) >= 0x1.ffp127 ? 0 : INFINITY) : std::fabs(nv - v);
    if (err < best_err || (err == best_err && (n.bits & 1) == 0 && (best.bits & 1) == 1)) {
      best = n;
      best_err = err;
    }
  }
  return best;
}

/// Store double v into element i of tensor t (bf16/fp32/fp64), rounded once to nearest even.
inline void store_rounded(Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::bf16:
      t.data<bf16>()[i] = round_to_bf16(v);
      break;
    case DType::fp32:
      t.data<float>()[i] = static_cast<float>(v);
      break;
    default:
      t.data<double>()[i] = v;
      break;
  }
}

/// The gate's promised order in accumulation type Acc: acc = 0; for h: acc = fma(x, w, acc);
/// then acc + b. Returns [T,E] in Acc's dtype.
template <class Acc>
Tensor gate_forward_chain(const Tensor& x, const Tensor& w, const Tensor& b) {
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  Tensor out = Tensor::empty({T, E}, dtype_of<Acc>());
  Acc* o = out.data<Acc>();
  // Inputs are exactly representable in Acc (the gate only upcasts), so via double is exact.
  const std::vector<double> xd = x.to_double_vector(), wd = w.to_double_vector();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      Acc acc = 0;
      for (int64_t h = 0; h < H; ++h) {
        acc = std::fma(static_cast<Acc>(xd[t * H + h]), static_cast<Acc>(wd[e * H + h]), acc);
      }
      if (b.defined()) acc = acc + static_cast<Acc>(b.item_as_double(e));
      o[t * E + e] = acc;
    }
  }
  return out;
}

/// The backward's promised orders in Acc, rounded once to x's / w's dtype:
/// grad_x[t,h] over e ascending, grad_w[e,h] over t ascending, grad_b[e] over t ascending.
template <class Acc>
void gate_backward_chain(const Tensor& g, const Tensor& x, const Tensor& w, Tensor* grad_x,
                         Tensor* grad_w, Tensor* grad_b) {
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0);
  *grad_x = Tensor::empty({T, H}, x.dtype());
  *grad_w = Tensor::empty({E, H}, w.dtype());
  *grad_b = Tensor::empty({E}, dtype_of<Acc>());
  const Acc* gp = g.data<Acc>();
  const std::vector<double> xd = x.to_double_vector(), wd = w.to_double_vector();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      Acc acc = 0;
      for (int64_t e = 0; e < E; ++e)
        acc = std::fma(gp[t * E + e], static_cast<Acc>(wd[e * H + h]), acc);
      store_rounded(*grad_x, t * H + h, acc);
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t h = 0; h < H; ++h) {
      Acc acc = 0;
      for (int64_t t = 0; t < T; ++t)
        acc = std::fma(gp[t * E + e], static_cast<Acc>(xd[t * H + h]), acc);
      store_rounded(*grad_w, e * H + h, acc);
    }
    Acc s = 0;
    for (int64_t t = 0; t < T; ++t) s = s + gp[t * E + e];
    grad_b->data<Acc>()[e] = s;
  }
}

}  // namespace switchyard::ref
