// The SIMD vocabulary of the CPU kernels, one header for every kernel file: the widest vector of
// the variant being compiled (zmm for avx512, ymm for avx2, one lane of std::fma for scalar),
// exact bf16 <-> fp32 conversions, and the bf16 rounding of an fp32 vector. Every operation is
// the IEEE operation lane by lane (a vector FMA lane is std::fma), so code written against it gives
// the same bits in every variant.
//
// Included by kernel files only (src/cpu/*_kernels.cpp): everything lives in the variant's
// namespace, so the three compilations of these inline functions never meet at link time
// (scripts/check_kernel_symbols.sh).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "switchyard/dtype.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SY_SIMD_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SY_SIMD_AVX512 1
#endif

namespace switchyard::cpu::SY_ISA_NS::simd {

/// bf16 -> fp32 is a 16-bit shift (exact); written without a memcpy the vectorizer dislikes.
inline float to_float(bf16 v) { return std::bit_cast<float>(static_cast<uint32_t>(v.bits) << 16); }
inline float to_float(float v) { return v; }

/// Whether v is -0 (the one value whose sign an FMA chain over fewer zero terms can change).
inline bool is_negative_zero(float v) { return std::bit_cast<uint32_t>(v) == 0x80000000u; }
inline bool is_negative_zero(double v) {
  return std::bit_cast<uint64_t>(v) == 0x8000000000000000ull;
}

#ifdef SY_SIMD_AVX2
/// Eight values as fp32 (bf16 -> fp32 is a 16-bit shift).
inline __m256 load8_f32(const bf16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }

/// In-register 8x8 transpose: r[k] becomes column k.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/// The lowest and highest lane of x (a fixed tree: the same value whatever the lane order).
inline float hmin8(__m256 x) {
  __m256 m = _mm256_min_ps(x, _mm256_permute2f128_ps(x, x, 1));
  m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm256_cvtss_f32(m);
}
inline float hmax8(__m256 x) {
  __m256 m = _mm256_max_ps(x, _mm256_permute2f128_ps(x, x, 1));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm256_cvtss_f32(m);
}

/// float_to_bf16 of eight lanes (round to nearest even on the bits, NaN kept quiet with its sign),
/// as eight 32-bit lanes holding the 16-bit results.
inline __m256i round8_bf16(__m256 f) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x0040);
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), lsb), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
  const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
  return _mm256_blendv_epi8(r, q, nan);
}

/// float_to_bf16(src[0:16]), in order.
inline __m256i round16_bf16(const float* src) {
  const __m256i packed =
      _mm256_packus_epi32(round8_bf16(_mm256_loadu_ps(src)), round8_bf16(_mm256_loadu_ps(src + 8)));
  return _mm256_permute4x64_epi64(packed, 0xD8);
}

/// dst[0:16] = float_to_bf16(src[0:16]).
inline void store16_bf16(bf16* dst, const float* src) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), round16_bf16(src));
}

/// The same with a non-temporal store (around the caches; dst 32-byte aligned).
inline void stream16_bf16(bf16* dst, const float* src) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), round16_bf16(src));
}
#endif

/// The bits of a bf16, fp32 or fp64 value (or an unsigned integer holding them), and the mask of
/// its exponent: all ones <=> NaN or Inf.
inline uint16_t value_bits(bf16 v) { return v.bits; }
inline uint32_t value_bits(float v) { return std::bit_cast<uint32_t>(v); }
inline uint64_t value_bits(double v) { return std::bit_cast<uint64_t>(v); }
template <class U, class = std::enable_if_t<std::is_unsigned_v<U>>>
inline U value_bits(U v) {
  return v;
}
template <class U>
constexpr U exponent_mask() {
  if constexpr (sizeof(U) == 2) {
    return 0x7f80u;
  } else if constexpr (sizeof(U) == 4) {
    return 0x7f800000u;
  } else {
    return 0x7ff0000000000000ull;
  }
}

/// Whether v / any of p[0, n) is NaN or Inf (the latter branch-free over the range): an integer
/// test on the bits (vectorises; no FP compare, so no FP exception or -ffast-math assumption is
/// involved). The one non-finite test of the kernels: the front-ends' scan (finite_kernels.cpp) and
/// the checks the gate backward folds into its own passes.
template <class T>
inline bool is_non_finite(T v) {
  using U = decltype(value_bits(v));
  constexpr U kExp = exponent_mask<U>();
  return (value_bits(v) & kExp) == kExp;
}
template <class T>
inline bool any_non_finite(const T* p, int64_t n) {
  using U = decltype(value_bits(p[0]));  // an accumulator of the element's width vectorises
  U bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<U>(is_non_finite(p[i]));
  return bad != 0;
}

/// dst[0:n] = float_to_bf16(src[0:n]) (vector body, scalar tail: the same bytes).
inline void store_bf16_row(bf16* dst, const float* src, int64_t n) {
  int64_t j = 0;
#ifdef SY_SIMD_AVX2
  for (; j + 16 <= n; j += 16) store16_bf16(dst + j, src + j);
#endif
  for (; j < n; ++j) dst[j] = float_to_bf16(src[j]);
}

/// dst[0:n] = src[0:n] as fp32 (exact).
template <class T>
inline void load_f32_row(float* dst, const T* src, int64_t n) {
  int64_t j = 0;
#ifdef SY_SIMD_AVX2
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, load8_f32(src + j));
#endif
  for (; j < n; ++j) dst[j] = to_float(src[j]);
}

/// N lanes of Acc in an array, every operation the IEEE one lane by lane (std::fma): the scalar
/// variant's Vec (N = 1), and where a kernel's register tile wants more lanes than that variant
/// has (the gate microkernel's tiles, eight fp32 lanes per vector as on AVX2).
template <class Acc, int N>
struct Lanes {
  static constexpr int kLanes = N;
  Acc v[N];
  static Lanes zero() { return bcast(Acc(0)); }
  template <class T>
  static Lanes load(const T* p) {
    Lanes r;
    for (int l = 0; l < N; ++l) {
      if constexpr (std::is_same_v<T, bf16>) {
        r.v[l] = static_cast<Acc>(to_float(p[l]));
      } else {
        r.v[l] = static_cast<Acc>(p[l]);
      }
    }
    return r;
  }
  static Lanes bcast(Acc x) {
    Lanes r;
    for (int l = 0; l < N; ++l) r.v[l] = x;
    return r;
  }
  void store(Acc* p) const {
    for (int l = 0; l < N; ++l) p[l] = v[l];
  }
  void stream(Acc* p) const { store(p); }
  friend Lanes fma(Lanes a, Lanes b, Lanes c) {
    for (int l = 0; l < N; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
    return c;
  }
  friend Lanes operator+(Lanes a, Lanes b) {
    for (int l = 0; l < N; ++l) a.v[l] = a.v[l] + b.v[l];
    return a;
  }
  bool any_negative_zero() const {
    bool any = false;
    for (int l = 0; l < N; ++l) any |= is_negative_zero(v[l]);
    return any;
  }
};

/// Orders this thread's `stream` stores (non-temporal: written around the caches) before its later
/// loads and stores.
inline void stream_fence() {
#ifdef SY_SIMD_AVX2
  _mm_sfence();
#endif
}

/// The widest vector of Acc (float or double) in this variant: kLanes lanes, IEEE lane by lane.
/// `stream(p)` stores non-temporally (p aligned to the vector's size): for outputs much larger than
/// the caches, whose lines would otherwise be read in from memory before being overwritten.
#if defined(SY_SIMD_AVX512)
template <class Acc>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int kLanes = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const bf16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  static Vec bcast(float x) { return {_mm512_set1_ps(x)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void stream(float* p) const { _mm512_stream_ps(p, v); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  /// Whether any lane is -0.
  bool any_negative_zero() const {
    return _mm512_cmpeq_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)) != 0;
  }
};
template <>
struct Vec<double> {
  static constexpr int kLanes = 8;
  __m512d v;
  static Vec zero() { return {_mm512_setzero_pd()}; }
  static Vec load(const double* p) { return {_mm512_loadu_pd(p)}; }
  static Vec load(const float* p) { return {_mm512_maskz_cvtps_pd(0xff, _mm256_loadu_ps(p))}; }
  static Vec load(const bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm512_maskz_cvtps_pd(
        0xff, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)))};
  }
  static Vec bcast(double x) { return {_mm512_set1_pd(x)}; }
  void store(double* p) const { _mm512_storeu_pd(p, v); }
  void stream(double* p) const { _mm512_stream_pd(p, v); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_pd(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_pd(a.v, b.v)}; }
  bool any_negative_zero() const {
    return _mm512_cmpeq_epi64_mask(_mm512_castpd_si512(v), _mm512_set1_epi64(INT64_MIN)) != 0;
  }
};
#elif defined(SY_SIMD_AVX2)
template <class Acc>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int kLanes = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const bf16* p) { return {load8_f32(p)}; }
  static Vec bcast(float x) { return {_mm256_set1_ps(x)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void stream(float* p) const { _mm256_stream_ps(p, v); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  bool any_negative_zero() const {
    const __m256i eq = _mm256_cmpeq_epi32(_mm256_castps_si256(v), _mm256_set1_epi32(INT32_MIN));
    return _mm256_movemask_epi8(eq) != 0;
  }
};
template <>
struct Vec<double> {
  static constexpr int kLanes = 4;
  __m256d v;
  static Vec zero() { return {_mm256_setzero_pd()}; }
  static Vec load(const double* p) { return {_mm256_loadu_pd(p)}; }
  static Vec load(const float* p) { return {_mm256_cvtps_pd(_mm_loadu_ps(p))}; }
  static Vec load(const bf16* p) {
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16)))};
  }
  static Vec bcast(double x) { return {_mm256_set1_pd(x)}; }
  void store(double* p) const { _mm256_storeu_pd(p, v); }
  void stream(double* p) const { _mm256_stream_pd(p, v); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_pd(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_pd(a.v, b.v)}; }
  bool any_negative_zero() const {
    const __m256i eq = _mm256_cmpeq_epi64(_mm256_castpd_si256(v), _mm256_set1_epi64x(INT64_MIN));
    return _mm256_movemask_epi8(eq) != 0;
  }
};
#else
template <class Acc>
using Vec = Lanes<Acc, 1>;
#endif

}  // namespace switchyard::cpu::SY_ISA_NS::simd
