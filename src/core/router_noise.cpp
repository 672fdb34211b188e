// Counter-based random numbers of the router: a value depends only on its seed and position, so
// draws are deterministic and thread-count invariant. Forced logits (Megatron's
// moe_router_force_load_balancing / force_biased) and input jitter (moe_input_jitter_eps).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "check.h"
#include "router_internal.h"
#include "switchyard/router.h"

namespace switchyard {
namespace detail {

double unit_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (static_cast<double>(z >> 40) + 0.5) * (1.0 / 16777216.0);
}

double unit_normal(uint64_t seed, uint64_t i) {
  const double u1 = unit_uniform(seed, 2 * i), u2 = unit_uniform(seed, 2 * i + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

Tensor forced_logits(const Tensor& logits, const RouterConfig& c, const RouteOptions& o) {
  const int64_t T = logits.size(0), E = c.num_experts;
  std::vector<double> bias(static_cast<size_t>(E), 0.0);
  if (c.force_biased != 0.0) {
    for (int64_t e = 0; e < E; ++e)
      bias[e] = std::fabs(c.force_biased) * unit_normal(o.force_bias_seed, e);
  }
  Tensor out = Tensor::empty({T, E}, logits.dtype());
  for (int64_t i = 0; i < T * E; ++i) {
    const double v = unit_normal(o.force_seed, static_cast<uint64_t>(i)) + bias[i % E];
    if (logits.dtype() == DType::fp64) {
      out.data<double>()[i] = v;
    } else {
      out.data<float>()[i] = static_cast<float>(v);
    }
  }
  return out;
}

}  // namespace detail

Tensor forced_router_logits(const Tensor& logits, const RouterConfig& config,
                            const RouteOptions& options) {
  validate_router_config(config);
  detail::check_dtype(logits, "route", "logits", {DType::bf16, DType::fp32, DType::fp64});
  detail::check_shape(logits, "route", "logits", {-1, config.num_experts});
  if (logits.dtype() == DType::bf16) {
    return detail::forced_logits(Tensor::empty(logits.shape(), DType::fp32), config, options);
  }
  return detail::forced_logits(logits, config, options);
}

namespace {

// u in [1 - eps, 1 + eps) for element i.
inline double jitter_unit(uint64_t seed, uint64_t i) { return detail::unit_uniform(seed, i); }

Tensor jitter_apply(const Tensor& x, double eps, uint64_t seed, const char* op, const char* name) {
  detail::check_dtype(x, op, name, {DType::bf16, DType::fp32, DType::fp64});
  if (!std::isfinite(eps) || eps < 0.0 || eps >= 1.0) {
    detail::fail_arg(op, "eps must be in [0, 1), got ", eps);
  }
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  const int64_t n = x.numel();
  if (x.dtype() == DType::fp64) {
    const double* a = x.data<double>();
    double* o = out.data<double>();
    for (int64_t i = 0; i < n; ++i) {
      o[i] = a[i] * (1.0 - eps + 2.0 * eps * jitter_unit(seed, static_cast<uint64_t>(i)));
    }
  } else if (x.dtype() == DType::fp32) {
    const float* a = x.data<float>();
    float* o = out.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      const float u = static_cast<float>(1.0 - eps + 2.0 * eps * jitter_unit(seed, i));
      o[i] = a[i] * u;
    }
  } else {
    const bf16* a = x.data<bf16>();
    bf16* o = out.data<bf16>();
    for (int64_t i = 0; i < n; ++i) {
      const float u = static_cast<float>(1.0 - eps + 2.0 * eps * jitter_unit(seed, i));
      o[i] = float_to_bf16(bf16_to_float(a[i]) * u);
    }
  }
  return out;
}

}  // namespace

Tensor input_jitter(const Tensor& x, double eps, uint64_t seed) {
  return jitter_apply(x, eps, seed, "input_jitter", "x");
}

Tensor input_jitter_backward(const Tensor& grad, double eps, uint64_t seed) {
  // d(x * u)/dx = u: the same multiplication.
  return jitter_apply(grad, eps, seed, "input_jitter_backward", "grad");
}

}  // namespace switchyard
