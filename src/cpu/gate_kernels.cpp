// Router gate kernels: a register-tiled GEMM microkernel (AVX2/FMA, portable scalar fallback)
// whose every output is a single fixed-order FMA chain. See gate_kernels.h for the orders.
#include "gate_kernels.h"

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SY_GATE_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>

// SY_ISA_NS: this file is compiled once per kernel variant (src/cpu/isa.h).
namespace switchyard::cpu::SY_ISA_NS {

namespace {

// ---- element conversions ------------------------------------------------------------------

template <class Acc, class T>
inline Acc to_acc(T v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return static_cast<Acc>(bf16_to_float(v));
  } else {
    return static_cast<Acc>(v);
  }
}

template <class Out, class Acc>
inline Out from_acc(Acc v) {
  if constexpr (std::is_same_v<Out, bf16>) {
    if constexpr (std::is_same_v<Acc, float>) {
      return float_to_bf16(v);
    } else {
      return double_to_bf16(v);
    }
  } else {
    return static_cast<Out>(v);  // same type, or fp64 -> fp32 rounded once to nearest
  }
}

// Scratch buffers: 64-byte aligned, uninitialised.
template <class T>
struct Scratch {
  explicit Scratch(int64_t n)
      : p(static_cast<T*>(
            std::aligned_alloc(64, static_cast<size_t>(((n * sizeof(T) + 63) / 64) * 64 + 64)))) {
    if (!p) throw std::bad_alloc();
  }
  ~Scratch() { std::free(p); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* p;
};

// ---- the microkernel ----------------------------------------------------------------------

// Register tile: MR rows x NR columns, NR = two vectors of the accumulation type.
template <class Acc>
constexpr int kNR = 2 * (32 / static_cast<int>(sizeof(Acc)));
constexpr int kMR = 6;

enum class Chain { start, resume };

#ifdef SY_GATE_AVX2
template <class Acc>
struct Simd;
template <>
struct Simd<float> {
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
};
template <>
struct Simd<double> {
  using V = __m256d;
  static V zero() { return _mm256_setzero_pd(); }
  static V load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, V v) { _mm256_storeu_pd(p, v); }
  static V bcast(const double* p) { return _mm256_broadcast_sd(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
};
#endif

// C[i, 0:NR] (i < MR) = chain over k of fma(A(i,k), B[k, 0:NR], C[i, :]) with A(i,k) =
// a[i*a_rs + k*a_cs] and B a packed kc x NR panel; C starts at 0 (Chain::start) or continues
// from the values in c (Chain::resume); `bias` (NR values, or null) is added after the chain.
template <class Acc, int MR>
void micro_full(int64_t kc, const Acc* a, int64_t a_rs, int64_t a_cs, const Acc* b, Acc* c,
                int64_t ldc, Chain chain, const Acc* bias) {
  constexpr int NR = kNR<Acc>;
#ifdef SY_GATE_AVX2
  using S = Simd<Acc>;
  using V = typename S::V;
  constexpr int L = NR / 2;
  // Accumulators as named variables, not arrays: GCC keeps arrays of vectors on the stack
  // (a store per FMA), which halved the throughput.
  V c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define SY_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define SY_INIT(i)                        \
  if constexpr (MR > i) {                 \
    if (chain == Chain::resume) {         \
      c##i##0 = S::load(c + i * ldc);     \
      c##i##1 = S::load(c + i * ldc + L); \
    } else {                              \
      c##i##0 = S::zero();                \
      c##i##1 = S::zero();                \
    }                                     \
  }
  SY_ROWS(SY_INIT)
#undef SY_INIT
  const Acc* ap = a;
  for (int64_t k = 0; k < kc; ++k) {
    const V b0 = S::load(b + k * NR);
    const V b1 = S::load(b + k * NR + L);
#define SY_FMA(i)                         \
  if constexpr (MR > i) {                 \
    const V ai = S::bcast(ap + i * a_rs); \
    c##i##0 = S::fma(ai, b0, c##i##0);    \
    c##i##1 = S::fma(ai, b1, c##i##1);    \
  }
    SY_ROWS(SY_FMA)
#undef SY_FMA
    ap += a_cs;
  }
  if (bias) {
    const V bb0 = S::load(bias), bb1 = S::load(bias + L);
#define SY_BIAS(i)                  \
  if constexpr (MR > i) {           \
    c##i##0 = S::add(c##i##0, bb0); \
    c##i##1 = S::add(c##i##1, bb1); \
  }
    SY_ROWS(SY_BIAS)
#undef SY_BIAS
  }
#define SY_STORE(i)                     \
  if constexpr (MR > i) {               \
    S::store(c + i * ldc, c##i##0);     \
    S::store(c + i * ldc + L, c##i##1); \
  }
  SY_ROWS(SY_STORE)
#undef SY_STORE
#undef SY_ROWS
  static_assert(MR <= 6, "the AVX2 microkernel has six rows of accumulators");
#else
  Acc acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = chain == Chain::resume ? c[i * ldc + j] : Acc(0);
  for (int64_t k = 0; k < kc; ++k) {
    for (int i = 0; i < MR; ++i) {
      const Acc ai = a[i * a_rs + k * a_cs];
      for (int j = 0; j < NR; ++j) acc[i][j] = std::fma(ai, b[k * NR + j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) c[i * ldc + j] = bias ? acc[i][j] + bias[j] : acc[i][j];
#endif
}

// As micro_full for `mr` (1..MR) rows and the first `nvalid` (1..NR) columns of c; the other
// columns of the tile are computed in a local buffer (their B columns are zero padding) and
// dropped. Each stored value is the same per-lane chain as in a full tile.
template <class Acc>
void micro(int64_t mr, int64_t nvalid, int64_t kc, const Acc* a, int64_t a_rs, int64_t a_cs,
           const Acc* b, Acc* c, int64_t ldc, Chain chain, const Acc* bias) {
  constexpr int NR = kNR<Acc>;
  Acc tmp[kMR * NR];
  Acc* cc = c;
  int64_t ldcc = ldc;
  if (nvalid < NR) {
    cc = tmp;
    ldcc = NR;
    for (int64_t i = 0; i < mr; ++i)
      for (int j = 0; j < NR; ++j)
        tmp[i * NR + j] = (chain == Chain::resume && j < nvalid) ? c[i * ldc + j] : Acc(0);
  }
  switch (mr) {
    case 1:
      micro_full<Acc, 1>(kc, a, a_rs, a_cs, b, cc, ldcc, chain, bias);
      break;
    case 2:
      micro_full<Acc, 2>(kc, a, a_rs, a_cs, b, cc, ldcc, chain, bias);
      break;
    case 3:
      micro_full<Acc, 3>(kc, a, a_rs, a_cs, b, cc, ldcc, chain, bias);
      break;
    case 4:
      micro_full<Acc, 4>(kc, a, a_rs, a_cs, b, cc, ldcc, chain, bias);
      break;
    case 5:
      micro_full<Acc, 5>(kc, a, a_rs, a_cs, b, cc, ldcc, chain, bias);
      break;
    default:
      micro_full<Acc, kMR>(kc, a, a_rs, a_cs, b, cc, ldcc, chain, bias);
      break;
  }
  if (nvalid < NR) {
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < nvalid; ++j) c[i * ldc + j] = tmp[i * NR + j];
  }
}

// ---- forward ------------------------------------------------------------------------------

// Blocking: KC values of the reduced dimension per pass (the packed W block, KC x E_pad, stays in
// L2; an A tile, MR x KC, in L1); MB tokens per parallel work item.
constexpr int64_t kKC = 256;
constexpr int64_t kMB = 16 * kMR;
// Below this many multiply-adds a call runs on one thread: a parallel region costs more than the
// work, and much more when the other core is busy. (Results never depend on it.)
constexpr int64_t kParallelMin = int64_t{1} << 18;

// Panel of the transposed weight: dst[h*NR + j] = w[(e0 + j)*H + h] as Acc, zero for e0+j >= E.
template <class Acc, class WT>
void pack_w_panel_scalar(const WT* w, Acc* dst, int64_t e0, int64_t E, int64_t H, int64_t h_begin) {
  constexpr int NR = kNR<Acc>;
  for (int64_t h0 = h_begin; h0 < H; h0 += 64) {
    const int64_t h1 = std::min(H, h0 + 64);
    for (int j = 0; j < NR; ++j) {
      const int64_t e = e0 + j;
      if (e < E) {
        const WT* src = w + e * H;
        for (int64_t h = h0; h < h1; ++h) dst[h * NR + j] = to_acc<Acc>(src[h]);
      } else {
        for (int64_t h = h0; h < h1; ++h) dst[h * NR + j] = Acc(0);
      }
    }
  }
}

#ifdef SY_GATE_AVX2
// Eight values of a weight row as fp32 (bf16 -> fp32 is a 16-bit shift).
inline __m256 load8_f32(const bf16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }

// In-register 8x8 transpose: r[k] becomes column k.
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
#endif

// Packing is pure data movement (exact conversions), so the vector and scalar versions give the
// same bytes. The scalar one cost ~0.5 ns per weight, which is most of a call at small T.
template <class Acc, class WT>
void pack_w_panel(const WT* w, Acc* dst, int64_t e0, int64_t E, int64_t H) {
#ifdef SY_GATE_AVX2
  if constexpr (std::is_same_v<Acc, float>) {
    static_assert(kNR<float> == 16);
    const int64_t h8 = H / 8 * 8;
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t h = 0; h < h8; h += 8) {
      for (int half = 0; half < 2; ++half) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) {
          const int64_t e = e0 + half * 8 + i;
          r[i] = e < E ? load8_f32(w + e * H + h) : zero;
        }
        transpose8(r);
        for (int k = 0; k < 8; ++k) _mm256_storeu_ps(dst + (h + k) * 16 + half * 8, r[k]);
      }
    }
    pack_w_panel_scalar<Acc, WT>(w, dst, e0, E, H, h8);
    return;
  }
#endif
  pack_w_panel_scalar<Acc, WT>(w, dst, e0, E, H, 0);
}

template <class Acc, class XT, class WT, class BT>
void forward_impl(const XT* x, const WT* w, const BT* bias, Acc* out, int64_t T, int64_t H,
                  int64_t E) {
  constexpr int NR = kNR<Acc>;
  if (T == 0 || E == 0) return;
  const int64_t npanel = (E + NR - 1) / NR;
  const int64_t e_pad = npanel * NR;
  Scratch<Acc> bpad(e_pad);
  for (int64_t e = 0; e < e_pad; ++e) bpad.p[e] = (bias && e < E) ? to_acc<Acc>(bias[e]) : Acc(0);
  if (H == 0) {  // empty chain: acc = 0, then the bias
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) out[t * E + e] = bias ? Acc(0) + bpad.p[e] : Acc(0);
    return;
  }
  // Pack W once: panel p holds experts [p*NR, p*NR+NR) as an H x NR row-major block (zero
  // columns past E), converted exactly to Acc.
  Scratch<Acc> wp(npanel * H * NR);
#pragma omp parallel for schedule(static) if (E * H >= kParallelMin)
  for (int64_t p = 0; p < npanel; ++p) pack_w_panel<Acc, WT>(w, wp.p + p * H * NR, p * NR, E, H);
  const int64_t nblk = (T + kMB - 1) / kMB;
  // Per-thread x tiles, allocated here: an exception must not leave a parallel region.
  constexpr bool kDirect = std::is_same_v<XT, Acc>;
  Scratch<Acc> xpack_all(kDirect ? 1 : omp_get_max_threads() * kMR * kKC);
#pragma omp parallel if (T * H * E >= kParallelMin)
  {
    Acc* const xpack = xpack_all.p + (kDirect ? 0 : omp_get_thread_num() * kMR * kKC);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const int64_t t0 = blk * kMB, t1 = std::min(T, t0 + kMB);
      for (int64_t k0 = 0; k0 < H; k0 += kKC) {
        const int64_t kc = std::min(kKC, H - k0);
        const Chain chain = k0 == 0 ? Chain::start : Chain::resume;
        const bool last = k0 + kc == H;
        for (int64_t tt = t0; tt < t1; tt += kMR) {
          const int64_t mr = std::min<int64_t>(kMR, t1 - tt);
          const Acc* a;
          int64_t a_rs;
          if constexpr (kDirect) {
            a = x + tt * H + k0;
            a_rs = H;
          } else {
            for (int64_t i = 0; i < mr; ++i) {
              const XT* src = x + (tt + i) * H + k0;
              Acc* dst = xpack + i * kc;
              for (int64_t k = 0; k < kc; ++k) dst[k] = to_acc<Acc>(src[k]);
            }
            a = xpack;
            a_rs = kc;
          }
          for (int64_t p = 0; p < npanel; ++p) {
            const int64_t nvalid = std::min<int64_t>(NR, E - p * NR);
            micro<Acc>(mr, nvalid, kc, a, a_rs, 1, wp.p + (p * H + k0) * NR, out + tt * E + p * NR,
                       E, chain, (last && bias) ? bpad.p + p * NR : nullptr);
          }
        }
      }
    }
  }
}

// ---- backward -----------------------------------------------------------------------------

template <class Acc, class XT, class WT>
void backward_impl(const Acc* g, const XT* x, const WT* w, XT* grad_x, WT* grad_w, Acc* grad_b,
                   int64_t T, int64_t H, int64_t E) {
  constexpr int NR = kNR<Acc>;
  const int64_t npanel = (H + NR - 1) / NR;
  const int64_t h_pad = npanel * NR;

  // grad_b: one sum per expert over t ascending (vectorised across experts, never across t).
  if (grad_b) {
    for (int64_t e = 0; e < E; ++e) grad_b[e] = Acc(0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) grad_b[e] = grad_b[e] + g[t * E + e];
  }
  if (H == 0) return;

  // grad_x = G · W: W packed as H/NR panels of E x NR (zero columns past H).
  if (T > 0) {
    if (E == 0) {
      for (int64_t i = 0; i < T * H; ++i) grad_x[i] = from_acc<XT>(Acc(0));
    } else {
      Scratch<Acc> wq(npanel * E * NR);
#pragma omp parallel for schedule(static) if (E * H >= kParallelMin)
      for (int64_t p = 0; p < npanel; ++p) {
        const int64_t nvalid = std::min<int64_t>(NR, H - p * NR);
        for (int64_t e = 0; e < E; ++e) {
          Acc* dst = wq.p + (p * E + e) * NR;
          const WT* src = w + e * H + p * NR;
          for (int64_t j = 0; j < nvalid; ++j) dst[j] = to_acc<Acc>(src[j]);
          for (int64_t j = nvalid; j < NR; ++j) dst[j] = Acc(0);
        }
      }
      const int64_t nblk = (T + kMB - 1) / kMB;
#pragma omp parallel for schedule(static) if (T * H * E >= kParallelMin)
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t t0 = blk * kMB, t1 = std::min(T, t0 + kMB);
        Acc tile[kMR * NR];
        for (int64_t tt = t0; tt < t1; tt += kMR) {
          const int64_t mr = std::min<int64_t>(kMR, t1 - tt);
          for (int64_t p = 0; p < npanel; ++p) {
            const int64_t nvalid = std::min<int64_t>(NR, H - p * NR);
            const Acc* b = wq.p + p * E * NR;
            if constexpr (std::is_same_v<XT, Acc>) {
              micro<Acc>(mr, nvalid, E, g + tt * E, E, 1, b, grad_x + tt * H + p * NR, H,
                         Chain::start, nullptr);
            } else {
              micro<Acc>(mr, NR, E, g + tt * E, E, 1, b, tile, NR, Chain::start, nullptr);
              for (int64_t i = 0; i < mr; ++i) {
                XT* dst = grad_x + (tt + i) * H + p * NR;
                for (int64_t j = 0; j < nvalid; ++j) dst[j] = from_acc<XT>(tile[i * NR + j]);
              }
            }
          }
        }
      }
    }
  }

  // grad_w = Gᵀ · X: parallel over groups of H panels (never over t, so the chain over t is
  // fixed); the chain is kept in an Acc buffer across KC blocks of tokens and rounded once at the
  // end. A group packs kGP panels of a token block at once, so each x row is read as one
  // contiguous 128-column (or wider) segment: one panel at a time read 32 bytes per 4 KB-strided
  // row, a TLB miss per row, and the loads took a quarter of the backward.
  if (E == 0) return;
  constexpr int64_t kGP = 8;
  const int64_t ngroup = (npanel + kGP - 1) / kGP;
  Scratch<Acc> acc(E * h_pad);
  Scratch<Acc> xp_all(omp_get_max_threads() * kGP * kKC * NR);  // per-thread packed x blocks
#pragma omp parallel if (T * H * E >= kParallelMin)
  {
    Acc* const xp = xp_all.p + omp_get_thread_num() * kGP * kKC * NR;
#pragma omp for schedule(static)
    for (int64_t grp = 0; grp < ngroup; ++grp) {
      const int64_t p0 = grp * kGP, p1 = std::min(npanel, p0 + kGP);
      const int64_t h0 = p0 * NR, h1 = std::min(H, p1 * NR);  // valid columns of the group
      if (T == 0) {
        for (int64_t e = 0; e < E; ++e)
          for (int64_t h = h0; h < p1 * NR; ++h) acc.p[e * h_pad + h] = Acc(0);
      }
      for (int64_t k0 = 0; k0 < T; k0 += kKC) {
        const int64_t kc = std::min(kKC, T - k0);
        // Pack: xp[(p - p0)][k][j] = x[k0 + k, p*NR + j], zero past H.
        for (int64_t k = 0; k < kc; ++k) {
          const XT* src = x + (k0 + k) * H;
          for (int64_t p = p0; p < p1; ++p) {
            Acc* dst = xp + ((p - p0) * kc + k) * NR;
            const int64_t nvalid = std::min<int64_t>(NR, H - p * NR);
            if (nvalid == NR) {
              for (int j = 0; j < NR; ++j) dst[j] = to_acc<Acc>(src[p * NR + j]);
            } else {
              for (int64_t j = 0; j < nvalid; ++j) dst[j] = to_acc<Acc>(src[p * NR + j]);
              for (int64_t j = nvalid; j < NR; ++j) dst[j] = Acc(0);
            }
          }
        }
        const Chain chain = k0 == 0 ? Chain::start : Chain::resume;
        for (int64_t p = p0; p < p1; ++p) {
          const Acc* b = xp + (p - p0) * kc * NR;
          for (int64_t e0 = 0; e0 < E; e0 += kMR) {
            const int64_t mr = std::min<int64_t>(kMR, E - e0);
            micro<Acc>(mr, NR, kc, g + k0 * E + e0, 1, E, b, acc.p + e0 * h_pad + p * NR, h_pad,
                       chain, nullptr);
          }
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t h = h0; h < h1; ++h) grad_w[e * H + h] = from_acc<WT>(acc.p[e * h_pad + h]);
      }
    }
  }
}

// ---- dtype dispatch -----------------------------------------------------------------------

template <class F>
void with_float_type(DType d, F&& f) {
  switch (d) {
    case DType::bf16:
      f(bf16{});
      break;
    case DType::fp32:
      f(float{});
      break;
    default:
      f(double{});
      break;
  }
}

}  // namespace

void gate_forward(const void* x, DType x_dtype, const void* weight, DType w_dtype, const void* bias,
                  DType bias_dtype, void* logits, DType acc_dtype, int64_t num_tokens,
                  int64_t hidden, int64_t num_experts) {
  if (bias == nullptr) bias_dtype = acc_dtype;  // any instantiable type: the pointer is unused
  auto run = [&](auto acc_tag) {
    using Acc = decltype(acc_tag);
    with_float_type(x_dtype, [&](auto x_tag) {
      using XT = decltype(x_tag);
      with_float_type(w_dtype, [&](auto w_tag) {
        using WT = decltype(w_tag);
        with_float_type(bias_dtype, [&](auto b_tag) {
          using BT = decltype(b_tag);
          if constexpr ((std::is_same_v<Acc, float> &&
                         (std::is_same_v<XT, double> || std::is_same_v<WT, double> ||
                          std::is_same_v<BT, double>)) ||
                        std::is_same_v<WT, double>) {
            return;  // not an exact upcast (or no fp64 weight): rejected by the front-end
          } else {
            forward_impl<Acc, XT, WT, BT>(static_cast<const XT*>(x), static_cast<const WT*>(weight),
                                          static_cast<const BT*>(bias), static_cast<Acc*>(logits),
                                          num_tokens, hidden, num_experts);
          }
        });
      });
    });
  };
  if (acc_dtype == DType::fp64) {
    run(double{});
  } else {
    run(float{});
  }
}

void gate_backward(const void* grad_logits, const void* x, DType x_dtype, const void* weight,
                   DType w_dtype, void* grad_x, void* grad_weight, void* grad_bias, DType acc_dtype,
                   int64_t num_tokens, int64_t hidden, int64_t num_experts) {
  auto run = [&](auto acc_tag) {
    using Acc = decltype(acc_tag);
    with_float_type(x_dtype, [&](auto x_tag) {
      using XT = decltype(x_tag);
      with_float_type(w_dtype, [&](auto w_tag) {
        using WT = decltype(w_tag);
        if constexpr ((std::is_same_v<Acc, float> && std::is_same_v<XT, double>) ||
                      std::is_same_v<WT, double>) {
          return;  // rejected by the front-end
        } else {
          backward_impl<Acc, XT, WT>(static_cast<const Acc*>(grad_logits),
                                     static_cast<const XT*>(x), static_cast<const WT*>(weight),
                                     static_cast<XT*>(grad_x), static_cast<WT*>(grad_weight),
                                     static_cast<Acc*>(grad_bias), num_tokens, hidden, num_experts);
        }
      });
    });
  };
  if (acc_dtype == DType::fp64) {
    run(double{});
  } else {
    run(float{});
  }
}

}  // namespace switchyard::cpu::SY_ISA_NS
