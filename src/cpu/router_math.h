// Row primitives of the router kernels: max, sums and dot products in a fixed 8-lane order (so the
// result depends only on the row, never on threads or batch), and an exp for fp32 that runs 8 lanes
// at a time with AVX2/FMA and gives bitwise the same values in its scalar tail and fallback.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/simd.h"

#ifdef SY_SIMD_AVX2
#define SY_ROUTER_AVX2 1
#endif

// Included by kernel files only: inside the variant namespace, so the two compilations of these
// inline functions (scalar and AVX2) never meet at link time.
namespace switchyard::cpu::SY_ISA_NS::rmath {

// Lane l accumulates elements i with i % 8 == l; the lanes are then combined in a fixed tree.
template <class S>
inline S combine8(const S* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

template <class S>
inline S max_of(const S* x, int64_t n) {
  S m = x[0];
  int64_t i = 0;
  if (n >= 8) {
    S acc[8];
    for (int l = 0; l < 8; ++l) acc[l] = x[l];
    for (i = 8; i + 8 <= n; i += 8) {
      for (int l = 0; l < 8; ++l) acc[l] = acc[l] < x[i + l] ? x[i + l] : acc[l];
    }
    m = acc[0];
    for (int l = 1; l < 8; ++l) m = m < acc[l] ? acc[l] : m;
  }
  for (; i < n; ++i) m = m < x[i] ? x[i] : m;
  return m;
}

template <class S>
inline S sum_of(const S* x, int64_t n) {
  S acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += x[i + l];
  }
  for (; i < n; ++i) acc[i & 7] += x[i];
  return combine8(acc);
}

template <class S>
inline S dot_of(const S* x, const S* y, int64_t n) {
  S acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += x[i + l] * y[i + l];
  }
  for (; i < n; ++i) acc[i & 7] += x[i] * y[i];
  return combine8(acc);
}

// exp for fp32 (Cephes-style: n = round(x log2 e), r = x - n ln2 in two fused steps, degree-7
// polynomial, scale by 2^n); about 1 ulp. Inputs below -87.34 give 0 and above 88 are clamped,
// which is all the router needs (shifted softmax exponents <= 0; sigmoid saturates).
namespace expc {
constexpr float kLo = -87.33654f, kHi = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace expc

inline float exp_f32(float x) {
  using namespace expc;
  const bool under = x < kLo;
  x = std::fmin(std::fmax(x, kLo), kHi);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(-n, kC1, x);
  r = std::fma(-n, kC2, r);
  float y = kP0;
  y = std::fma(y, r, kP1);
  y = std::fma(y, r, kP2);
  y = std::fma(y, r, kP3);
  y = std::fma(y, r, kP4);
  y = std::fma(y, r, kP5);
  y = std::fma(y, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return under ? 0.0f : y * scale;
}

#ifdef SY_ROUTER_AVX2
inline __m256 exp_f32x8(__m256 x) {
  using namespace expc;
  const __m256 lo = _mm256_set1_ps(kLo);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(kHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kC1), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kC2), r);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP5));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}
#endif

// out[i] = exp(x[i] - shift), returns their sum (8-lane order). fp64 uses std::exp.
inline float exp_shift_sum(const float* x, float shift, int64_t n, float* out) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
#ifdef SY_ROUTER_AVX2
  if (n >= 8) {
    const __m256 s = _mm256_set1_ps(shift);
    __m256 a = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = exp_f32x8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
      _mm256_storeu_ps(out + i, v);
      a = _mm256_add_ps(a, v);
    }
    _mm256_storeu_ps(acc, a);
  }
#endif
  for (; i < n; ++i) {
    out[i] = exp_f32(x[i] - shift);
    acc[i & 7] += out[i];
  }
  return combine8(acc);
}

inline double exp_shift_sum(const double* x, double shift, int64_t n, double* out) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; ++i) {
    out[i] = std::exp(x[i] - shift);
    acc[i & 7] += out[i];
  }
  return combine8(acc);
}

inline float exp_s(float x) { return exp_f32(x); }
inline double exp_s(double x) { return std::exp(x); }

// out[i] = sigmoid(x[i]) = 1 / (1 + exp(-x)).
inline void sigmoid_row(const float* x, int64_t n, float* out) {
  int64_t i = 0;
#ifdef SY_ROUTER_AVX2
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_f32x8(_mm256_sub_ps(zero, _mm256_loadu_ps(x + i)));
    _mm256_storeu_ps(out + i, _mm256_div_ps(one, _mm256_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) out[i] = 1.0f / (1.0f + exp_f32(0.0f - x[i]));
  // Below -80, exp(-x) nears the fp32 range where exp_f32 clamps (above 88): there the sigmoid
  // went flat at 1/(1+e^88). Those (rare) lanes take exp(x)/(1+exp(x)) in double, rounded once,
  // down to the fp32 denormals; the same code on both paths keeps AVX2 and scalar bitwise equal.
  int32_t any = 0;  // a branch-free scan first (it vectorises); the fix-up loop is rare
  for (int64_t j = 0; j < n; ++j) any |= x[j] < -80.0f ? 1 : 0;
  if (!any) return;
  for (int64_t j = 0; j < n; ++j) {
    if (x[j] < -80.0f) {
      const double e = std::exp(static_cast<double>(x[j]));
      out[j] = static_cast<float>(e / (1.0 + e));
    }
  }
}

inline void sigmoid_row(const double* x, int64_t n, double* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = 1.0 / (1.0 + std::exp(-x[i]));
}

}  // namespace switchyard::cpu::SY_ISA_NS::rmath
