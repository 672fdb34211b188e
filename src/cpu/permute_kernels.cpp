#include "cpu/permute_kernels.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace switchyard::cpu {

namespace {

inline float load(float v) { return v; }
inline float load(bf16 v) { return bf16_to_float(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) { *p = float_to_bf16(v); }

// acc[h] = fma(w, y[h], acc[h]). Written as plain loops so GCC vectorizes them (fmaf becomes a
// vector fma under -mfma; the result is the same single rounding either way).
inline void axpy(float w, const float* y, float* acc, int64_t H) {
  for (int64_t h = 0; h < H; ++h) acc[h] = std::fma(w, y[h], acc[h]);
}
inline void axpy(float w, const bf16* y, float* acc, int64_t H) {
  const uint16_t* yb = reinterpret_cast<const uint16_t*>(y);
  for (int64_t h = 0; h < H; ++h) {
    const uint32_t u = static_cast<uint32_t>(yb[h]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    acc[h] = std::fma(w, f, acc[h]);
  }
}
inline void add(const float* y, float* acc, int64_t H) {
  for (int64_t h = 0; h < H; ++h) acc[h] += y[h];
}
inline void add(const bf16* y, float* acc, int64_t H) {
  const uint16_t* yb = reinterpret_cast<const uint16_t*>(y);
  for (int64_t h = 0; h < H; ++h) {
    const uint32_t u = static_cast<uint32_t>(yb[h]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    acc[h] += f;
  }
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
      for (int64_t j = offsets[t]; j < offsets[t + 1]; ++j) {
        const int64_t r = rows[j];
        if (weight) {
          axpy(weight[r], y + r * H, acc, H);
        } else {
          add(y + r * H, acc, H);
        }
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
    if (num_rows * H > 0) std::memcpy(static_cast<void*>(out), g, static_cast<size_t>(num_rows * H) * sizeof(X));
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
    const X* s = g + i * H;
    const float w = weight[r];
    for (int64_t h = 0; h < H; ++h) store(o + h, w * load(s[h]));
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

}  // namespace switchyard::cpu
