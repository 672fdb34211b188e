#include "cpu/permute_kernels.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/simd.h"

#if defined(__linux__)
#endif

// SY_ISA_NS: this file is compiled once per kernel variant (src/cpu/isa.h).
namespace switchyard::cpu::SY_ISA_NS {

namespace {

inline float load(float v) { return v; }
inline float load(bf16 v) { return simd::to_float(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) { *p = float_to_bf16(v); }

// acc[h] = fma(w, y[h], acc[h]) (or acc[h] += y[h] when w is null), one cache line of y at a
// time while prefetching the same line of `next` (the token's next row). Rows sit at scattered
// places, and the hardware prefetcher stops at each 4 KiB page, so without this every row starts
// cold. AVX2/FMA intrinsics (GCC keeps the plain loop scalar: acc may alias y), with a portable
// fallback; fma is one rounding either way, so both paths give the same bits.

template <class X>
inline void accumulate_row(const float* w, const X* y, const X* next, float* acc, int64_t H) {
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(X));
  int64_t h = 0;
#ifdef SY_SIMD_AVX2
  if (w) {
    const __m256 wv = _mm256_set1_ps(*w);
    for (; h + kLine <= H; h += kLine) {
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + h), _MM_HINT_T1);
      for (int64_t i = 0; i < kLine; i += 8) {
        _mm256_storeu_ps(acc + h + i,
                         _mm256_fmadd_ps(wv, simd::load8_f32(y + h + i), _mm256_loadu_ps(acc + h + i)));
      }
    }
  } else {
    for (; h + kLine <= H; h += kLine) {
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + h), _MM_HINT_T1);
      for (int64_t i = 0; i < kLine; i += 8) {
        _mm256_storeu_ps(acc + h + i,
                         _mm256_add_ps(_mm256_loadu_ps(acc + h + i), simd::load8_f32(y + h + i)));
      }
    }
  }
#else
  // The same per-element operations one line at a time, with the same prefetch of `next`.
  for (; h + kLine <= H; h += kLine) {
    if (next) __builtin_prefetch(next + h, 0, 2);
    for (int64_t i = h; i < h + kLine; ++i) {
      acc[i] = w ? std::fma(*w, load(y[i]), acc[i]) : acc[i] + load(y[i]);
    }
  }
#endif
  for (; h < H; ++h) acc[h] = w ? std::fma(*w, load(y[h]), acc[h]) : acc[h] + load(y[h]);
}

}  // namespace

void gather_rows(const void* src, const int64_t* index, int64_t num_rows, int64_t row_bytes,
                 void* dst) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
#pragma omp parallel for schedule(static) if (num_rows * row_bytes > (1 << 18))
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t i = index[r];
    if (i >= 0) {
      std::memcpy(d + r * row_bytes, s + i * row_bytes, static_cast<size_t>(row_bytes));
    } else {
      std::memset(d + r * row_bytes, 0, static_cast<size_t>(row_bytes));
    }
  }
}

// How many rows ahead combine_rows prefetches: several rows in flight hide DRAM latency better
// than one (measured with bench_permute; 1 -> 4 rows).
constexpr int64_t kAhead = 4;

template <class X>
void combine_rows(const X* y, const float* weight, const int64_t* offsets, const int64_t* rows,
                  int64_t T, int64_t H, X* out) {
#pragma omp parallel if (T * H > (1 << 16))
  {
    std::vector<float> buf;
    if constexpr (!std::is_same_v<X, float>) buf.resize(static_cast<size_t>(H));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* acc;
      if constexpr (std::is_same_v<X, float>) {
        acc = out + t * H;
      } else {
        acc = buf.data();
      }
      for (int64_t h = 0; h < H; ++h) acc[h] = 0.0f;
      const int64_t jend = offsets[t + 1];
      for (int64_t j = offsets[t]; j < jend; ++j) {
        const int64_t r = rows[j];
        // Prefetch the row this thread reads kAhead rows later (CSR order runs across tokens).
        const int64_t jn = j + kAhead;
        const X* next = jn < offsets[T] ? y + rows[jn] * H : nullptr;
        accumulate_row<X>(weight ? weight + r : nullptr, y + r * H, next, acc, H);
      }
      if constexpr (!std::is_same_v<X, float>) {
        for (int64_t h = 0; h < H; ++h) store(out + t * H + h, acc[h]);
      }
    }
  }
}

template <class X>
void gather_scale_rows(const X* g, const float* weight, const int64_t* index, int64_t num_rows,
                       int64_t H, X* out) {
  if (!weight && index) {
    gather_rows(g, index, num_rows, H * static_cast<int64_t>(sizeof(X)), out);
    return;
  }
  if (!weight) {
    if (num_rows * H > 0)
      std::memcpy(static_cast<void*>(out), g, static_cast<size_t>(num_rows * H) * sizeof(X));
    return;
  }
#pragma omp parallel for schedule(static) if (num_rows * H > (1 << 16))
  for (int64_t r = 0; r < num_rows; ++r) {
    X* o = out + r * H;
    const int64_t i = index ? index[r] : r;
    if (i < 0) {
      std::memset(static_cast<void*>(o), 0, static_cast<size_t>(H) * sizeof(X));
      continue;
    }
    const X* __restrict s = g + i * H;
    X* __restrict od = o;
    const float w = weight[r];
    for (int64_t h = 0; h < H; ++h) store(od + h, w * load(s[h]));
  }
}

template <class X>
void row_dots(const X* a, const X* b, const int64_t* index, int64_t num_rows, int64_t H,
              float* out) {
  constexpr int64_t kLanes = 16;
#pragma omp parallel for schedule(static) if (num_rows * H > (1 << 16))
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t i = index ? index[r] : r;
    if (i < 0) {
      out[r] = 0.0f;
      continue;
    }
    const X* pa = a + r * H;
    const X* pb = b + i * H;
    // Fixed lane structure: lane l sums elements h = l (mod 16) in h order; lanes are then added
    // in a fixed order in double. Deterministic and vectorizable.
    float lanes[kLanes] = {};
    int64_t h = 0;
    for (; h + kLanes <= H; h += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) {
        lanes[l] = std::fma(load(pa[h + l]), load(pb[h + l]), lanes[l]);
      }
    }
    for (int64_t l = 0; h < H; ++h, ++l) lanes[l] = std::fma(load(pa[h]), load(pb[h]), lanes[l]);
    double s = 0.0;
    for (int64_t l = 0; l < kLanes; ++l) s += lanes[l];
    out[r] = static_cast<float>(s);
  }
}

template void combine_rows<float>(const float*, const float*, const int64_t*, const int64_t*,
                                  int64_t, int64_t, float*);
template void combine_rows<bf16>(const bf16*, const float*, const int64_t*, const int64_t*, int64_t,
                                 int64_t, bf16*);
template void gather_scale_rows<float>(const float*, const float*, const int64_t*, int64_t, int64_t,
                                       float*);
template void gather_scale_rows<bf16>(const bf16*, const float*, const int64_t*, int64_t, int64_t,
                                      bf16*);
template void row_dots<float>(const float*, const float*, const int64_t*, int64_t, int64_t, float*);
template void row_dots<bf16>(const bf16*, const bf16*, const int64_t*, int64_t, int64_t, float*);

}  // namespace switchyard::cpu::SY_ISA_NS
