// Router gate kernels: one register-tiled GEMM microkernel (zmm, ymm or std::fma lanes by variant)
// whose every output is a single fixed-order FMA chain. See gate_kernels.h for the orders.
#include "gate_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "core/allocator.h"
#include "cpu/finite_kernels.h"
#include "cpu/simd.h"

// The variant being compiled (src/cpu/simd.h): AVX2 ymm code paths, the AVX-512 zmm tiles.
#ifdef SY_SIMD_AVX2
#define SY_GATE_AVX2 1
#endif
#ifdef SY_SIMD_AVX512
#define SY_GATE_AVX512 1
#endif

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

// Scratch buffers: 64-byte aligned, uninitialised, from the engine's allocator, whose cache hands
// a large block (packed W: 7 MB at DeepSeek-V3's gate) back on the next call instead of letting
// every call fault in fresh zeroed pages (a tenth of the sparse backward's time).
template <class T>
struct Scratch {
  explicit Scratch(int64_t n)
      : bytes(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T)),
        p(static_cast<T*>(detail::allocate(bytes))) {}
  ~Scratch() { detail::deallocate(p, bytes); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  size_t bytes;
  T* p;
};

// ---- the microkernel ----------------------------------------------------------------------

// The forward packs W in panels of kBW experts, the backward H in panels of kBW columns (32 fp32
// or 16 fp64: four ymm vectors, two zmm). A panel runs as register tiles of kMR rows x two
// vectors (TileVec): one 12-row tile of zmm registers in the avx512 variant (24 accumulators of
// the 32 registers), two 6-row tiles of ymm registers side by side in the avx2 variant (12 of the
// 16), and the same two tiles of eight-lane std::fma arrays in the scalar one. Every lane of every
// variant runs the same chain (a vector FMA lane is std::fma), so the tile shape never shows in a
// result; the zmm tile is the width per instruction the sgemm ceiling of such a CPU assumes.
template <class Acc>
constexpr int kNR = 2 * (32 / static_cast<int>(sizeof(Acc)));  // two ymm vectors of Acc
template <class Acc>
constexpr int kBW = 2 * kNR<Acc>;
#ifdef SY_GATE_AVX512
constexpr int kMR = 12;
#else
constexpr int kMR = 6;
#endif
#ifdef SY_GATE_AVX2
template <class Acc>
using TileVec = simd::Vec<Acc>;  // zmm in the avx512 variant, ymm in the avx2 one
#else
template <class Acc>
using TileVec = simd::Lanes<Acc, kNR<Acc> / 2>;
#endif
// Columns of a register tile.
template <class Acc>
constexpr int kTW = 2 * TileVec<Acc>::kLanes;
static_assert(kBW<float> % kTW<float> == 0 && kBW<double> % kTW<double> == 0);

enum class Chain { start, resume };

// Software prefetch (into L2) of `rows` row segments of `seg_bytes` each, `stride` bytes apart,
// one 64-byte line per step(): the grad_w microkernel steps it every few iterations of its
// k loop, the forward a share before each tile (burst()), so the next data arrives while this
// block computes, without one burst of prefetches that would stall on the line-fill buffers.
// Moves no value into any result.
struct LinePrefetch {
  const char* row = nullptr;
  int64_t stride = 0, seg_bytes = 0, off = 0, rows = 0;
  static LinePrefetch of(const void* first, int64_t stride, int64_t seg_bytes, int64_t rows) {
    return LinePrefetch{static_cast<const char*>(first), stride, seg_bytes, 0, rows};
  }
  // Steps per call when the lines left are spread over `calls` calls.
  int64_t share(int64_t calls) const {
    return (rows * ((seg_bytes + 63) / 64) + calls - 1) / calls;
  }
  void burst(int64_t n) {
    for (int64_t i = 0; i < n; ++i) step();
  }
  void step() {
    if (rows == 0) return;
    __builtin_prefetch(row + off, 0, 2);
    off += 64;
    if (off >= seg_bytes) {
      off = 0;
      row += stride;
      --rows;
    }
  }
};

// Where the A values are: A(i,k) = a[i*a_rs + k] (rows of a matrix: x, an x tile, G in place)
// or a[k*kMR + i] (a packed tile of kMR rows, k-major: the packed G of grad_w). Strides known at
// compile time keep the k loop's addresses in registers: with both at run time GCC spilled two
// of the 12-row tile's row offsets and reloaded them every k.
enum class ALayout { rows, tile };

// C[i, 0:kTW] (i < MR) = chain over k of fma(A(i,k), B[k, 0:kTW], C[i, :]) with A(i,k) as kA says
// and B[k, j] = b[k*kBW + j] (columns of a packed panel); C starts at 0 (Chain::start) or
// continues from the values in c (Chain::resume); `bias` (kTW values, or null) is added after the
// chain. With kPrefetch, pf steps every fourth k.
template <class Acc, int MR, bool kPrefetch, ALayout kA>
void micro_tile(int64_t kc, const Acc* a, int64_t lda, const Acc* b, Acc* c, int64_t ldc,
                Chain chain, const Acc* bias, LinePrefetch* pf) {
  using V = TileVec<Acc>;
  constexpr int L = V::kLanes;
  const int64_t a_rs = kA == ALayout::rows ? lda : 1;
  constexpr int64_t a_cs = kA == ALayout::rows ? 1 : kMR;
  static_assert(MR >= 1 && MR <= 12, "the microkernel has twelve rows of accumulators");
  // Accumulators as named variables, not arrays: GCC keeps arrays of vectors on the stack (a
  // store per FMA), which halved the throughput. Each B row (two loads) feeds 2·MR FMAs, and the
  // A values are broadcast from memory into the FMAs.
  V c0_0, c0_1, c1_0, c1_1, c2_0, c2_1, c3_0, c3_1, c4_0, c4_1, c5_0, c5_1, c6_0, c6_1, c7_0, c7_1,
      c8_0, c8_1, c9_0, c9_1, c10_0, c10_1, c11_0, c11_1;
#define SY_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define SY_INIT(i)                         \
  if constexpr (MR > i) {                  \
    if (chain == Chain::resume) {          \
      c##i##_0 = V::load(c + i * ldc);     \
      c##i##_1 = V::load(c + i * ldc + L); \
    } else {                               \
      c##i##_0 = V::zero();                \
      c##i##_1 = V::zero();                \
    }                                      \
  }
  SY_ROWS(SY_INIT)
#undef SY_INIT
  // The loop ends on the A pointer: a k counter beside the two pointers was one register more.
  const Acc* ap = a;
  const Acc* const a_end = a + kc * a_cs;
  const Acc* bp = b;
  [[maybe_unused]] int64_t k = 0;
  for (; ap != a_end; ap += a_cs, bp += kBW<Acc>) {
    if constexpr (kPrefetch) {
      if ((k++ & 3) == 0) pf->step();
    }
    const V b0 = V::load(bp);
    const V b1 = V::load(bp + L);
#define SY_FMA(i)                        \
  if constexpr (MR > i) {                \
    const V ai = V::bcast(ap[i * a_rs]); \
    c##i##_0 = fma(ai, b0, c##i##_0);    \
    c##i##_1 = fma(ai, b1, c##i##_1);    \
  }
    SY_ROWS(SY_FMA)
#undef SY_FMA
  }
  if (bias) {
    const V bb0 = V::load(bias), bb1 = V::load(bias + L);
#define SY_BIAS(i)             \
  if constexpr (MR > i) {      \
    c##i##_0 = c##i##_0 + bb0; \
    c##i##_1 = c##i##_1 + bb1; \
  }
    SY_ROWS(SY_BIAS)
#undef SY_BIAS
  }
#define SY_STORE(i)                    \
  if constexpr (MR > i) {              \
    (c##i##_0).store(c + i * ldc);     \
    (c##i##_1).store(c + i * ldc + L); \
  }
  SY_ROWS(SY_STORE)
#undef SY_STORE
#undef SY_ROWS
}

// micro_tile for `mr` (1..MR) rows: the row count as a template argument, the full tile first.
template <class Acc, bool kPrefetch, ALayout kA, int MR = kMR>
void micro_rows(int64_t mr, int64_t kc, const Acc* a, int64_t lda, const Acc* b, Acc* c,
                int64_t ldc, Chain chain, const Acc* bias, LinePrefetch* pf) {
  if constexpr (MR > 1) {
    if (mr < MR) {
      micro_rows<Acc, kPrefetch, kA, MR - 1>(mr, kc, a, lda, b, c, ldc, chain, bias, pf);
      return;
    }
  }
  micro_tile<Acc, MR, kPrefetch, kA>(kc, a, lda, b, c, ldc, chain, bias, pf);
}

// The C block of a tile whose last columns fall outside c: `mr` rows, the first `nvalid` of W
// columns valid. With nvalid < W the microkernel runs on a local W-wide copy (resumed chains
// start from c's values, the outside columns from 0) and store() writes the valid part back;
// otherwise it runs on c itself.
template <class Acc, int W>
struct EdgeTile {
  EdgeTile(int64_t mr_, int64_t nvalid_, Acc* c_out_, int64_t ldc_out_, Chain chain)
      : mr(mr_), nvalid(nvalid_), c_out(c_out_), ldc_out(ldc_out_), c(c_out_), ldc(ldc_out_) {
    if (nvalid < W) {
      c = tmp;
      ldc = W;
      for (int64_t i = 0; i < mr; ++i)
        for (int j = 0; j < W; ++j)
          tmp[i * W + j] = (chain == Chain::resume && j < nvalid) ? c_out[i * ldc_out + j] : Acc(0);
    }
  }
  void store() const {
    if (nvalid >= W) return;
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < nvalid; ++j) c_out[i * ldc_out + j] = tmp[i * W + j];
  }
  int64_t mr, nvalid;
  Acc* c_out;
  int64_t ldc_out;
  Acc* c;
  int64_t ldc;
  Acc tmp[kMR * W];
};

// The microkernel over a kBW-wide packed panel (B[k, j] = b[k*kBW + j]) for `mr` (1..kMR) rows
// and its first `nvalid` (1..kBW) columns, kTW columns per tile; the columns of a tile past
// nvalid are computed in a local buffer (their B columns are zero padding) and dropped, so each
// stored value is the same per-lane chain as in a full tile. `bias` (kBW values, or null) is added
// after the chain; `pf` (or null; only with a packed A tile, the grad_w case) is stepped about
// kc/4 times inside the k loop of the panel's first tile. A(i,k) = a[i*a_rs + k*a_cs] is either
// rows of a matrix (a_cs = 1) or a packed tile (a_rs = 1, a_cs = kMR).
template <class Acc>
void micro_panel(int64_t mr, int64_t nvalid, int64_t kc, const Acc* a, int64_t a_rs, int64_t a_cs,
                 const Acc* b, Acc* c, int64_t ldc, Chain chain, const Acc* bias = nullptr,
                 LinePrefetch* pf = nullptr) {
  assert((a_cs == 1 && !pf) || (a_rs == 1 && a_cs == kMR));
  constexpr int W = kTW<Acc>;
  for (int64_t j = 0; j < nvalid; j += W) {
    EdgeTile<Acc, W> edge(mr, std::min<int64_t>(W, nvalid - j), c + j, ldc, chain);
    const Acc* const bj = bias ? bias + j : nullptr;
    LinePrefetch* const pj = j == 0 ? pf : nullptr;
    if (a_cs == 1) {
      micro_rows<Acc, false, ALayout::rows>(mr, kc, a, a_rs, b + j, edge.c, edge.ldc, chain, bj,
                                            nullptr);
    } else if (pj) {
      micro_rows<Acc, true, ALayout::tile>(mr, kc, a, 1, b + j, edge.c, edge.ldc, chain, bj, pj);
    } else {
      micro_rows<Acc, false, ALayout::tile>(mr, kc, a, 1, b + j, edge.c, edge.ldc, chain, bj,
                                            nullptr);
    }
    edge.store();
  }
}

// ---- forward ------------------------------------------------------------------------------

// Blocking: KC values of the reduced dimension per pass (the packed W block, KC x E_pad, stays in
// L2; an A tile, MR x KC, in L1); MB tokens per parallel work item.
constexpr int64_t kKC = 256;
constexpr int64_t kMB = 96;     // a multiple of both kMR
constexpr int64_t kStrip = 12;  // forward blocks: a multiple of both kMR
// Below this many multiply-adds a call runs on one thread: a parallel region costs more than the
// work, and much more when the other core is busy. (Results never depend on it.)
constexpr int64_t kParallelMin = int64_t{1} << 18;

// Panel of the transposed weight: dst[h*NR + j] = w[(e0 + j)*H + h] as Acc, zero for e0+j >= E,
// NR = kBW (the panel width: 32 fp32 or 16 fp64 experts).
template <class Acc, class WT>
void pack_w_panel_scalar(const WT* w, Acc* dst, int64_t e0, int64_t E, int64_t H, int64_t h_begin) {
  constexpr int NR = kBW<Acc>;
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

// Packing is pure data movement (exact conversions), so the vector and scalar versions give the
// same bytes. The scalar one cost ~0.5 ns per weight, which is most of a call at small T.
template <class Acc, class WT>
void pack_w_panel(const WT* w, Acc* dst, int64_t e0, int64_t E, int64_t H) {
#ifdef SY_GATE_AVX2
  if constexpr (std::is_same_v<Acc, float>) {
    static_assert(kBW<float> == 32);
    const int64_t h8 = H / 8 * 8;
    const __m256 zero = _mm256_setzero_ps();
    // The 32 rows are 32 streams, more than the hardware prefetchers follow: when W comes from
    // memory (another layer or the optimizer ran since) each row's next line is prefetched
    // kAhead values ahead, once per line.
    constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(WT));
    constexpr int64_t kAhead = 8 * kLine;
    // The packed panel's lines (each step of 8 columns writes 1 KB) are prefetched for writing
    // 8 steps ahead: the 7 MB scratch is cold after the rest of a training step, and each store
    // first read its line from memory. Router fwd+bwd after PyTorch's step (DeepSeek-V3 fp32,
    // interleaved A/B, medians of 21): 34.50 -> 34.18 and 35.46 -> 34.88 ms at 1 thread,
    // 20.00 -> 19.77 and 19.12 -> 19.18 at 2.
    constexpr int64_t kAheadW = 64;
    const int64_t e_end = std::min<int64_t>(E, e0 + 32);
    for (int64_t h = 0; h < h8; h += 8) {
      if (h % kLine == 0 && h + kAhead < H) {
        for (int64_t e = e0; e < e_end; ++e) __builtin_prefetch(w + e * H + h + kAhead, 0, 3);
      }
      if (h + kAheadW < h8) {
        for (int64_t l = 0; l < 8 * 32; l += 16)
          __builtin_prefetch(dst + (h + kAheadW) * 32 + l, 1, 3);
      }
      for (int half = 0; half < 4; ++half) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) {
          const int64_t e = e0 + half * 8 + i;
          r[i] = e < E ? simd::load8_f32(w + e * H + h) : zero;
        }
        simd::transpose8(r);
        for (int k = 0; k < 8; ++k) _mm256_storeu_ps(dst + (h + k) * 32 + half * 8, r[k]);
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
  constexpr int NR =
      kBW<Acc>;  // panel width over E (run as two register halves, or one AVX-512 tile)
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
  // Blocks of up to mb_l2 tokens, each over the whole of H in kKC steps: a step's W slice (E x kKC)
  // stays in L2 across the block's strips, and the block's logits with it. Where W is larger than
  // L2 (7 MB at DeepSeek-V3's H 7168, E 256) every block streams all of W from L3, so blocks are up
  // to 384 tokens (at most 512 KB of logits), in equal shares per thread: DeepSeek-V3's forward at
  // 1 thread 27.4 -> 25.3 ms (96-token blocks before), Qwen3's 13.9 -> 13.6. Each logit is still
  // one chain over h ascending, whatever the block.
  const int64_t mb_l2 = std::clamp<int64_t>(
      (int64_t{512} << 10) / (E * static_cast<int64_t>(sizeof(Acc))) / kMB * kMB, kMB, 4 * kMB);
  // nblk blocks (a multiple of the thread count), each of a whole number of kStrip-token strips,
  // as equal as strips allow: a thread's share differs from another's by at most a strip or two
  // (with blocks of a rounded-up size instead, DeepSeek-V3's 1024 tokens split 528/496 at 2
  // threads).
  const int64_t nth = omp_get_max_threads();
  const int64_t nblk = nth * ((T + nth * mb_l2 - 1) / (nth * mb_l2));
  const int64_t nstrip = (T + kStrip - 1) / kStrip;
  // Per-thread x tiles, allocated here: an exception must not leave a parallel region.
  constexpr bool kDirect = std::is_same_v<XT, Acc>;
  Scratch<Acc> xpack_all(kDirect ? 1 : omp_get_max_threads() * kMR * kKC);
#pragma omp parallel if (T * H * E >= kParallelMin)
  {
    Acc* const xpack = xpack_all.p + (kDirect ? 0 : omp_get_thread_num() * kMR * kKC);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const int64_t t0 = blk * nstrip / nblk * kStrip;
      const int64_t t1 = std::min(T, (blk + 1) * nstrip / nblk * kStrip);
      if (t0 >= t1) continue;  // fewer strips than blocks
      for (int64_t k0 = 0; k0 < H; k0 += kKC) {
        const int64_t kc = std::min(kKC, H - k0);
        const Chain chain = k0 == 0 ? Chain::start : Chain::resume;
        const bool last = k0 + kc == H;
        // The packed W slice of the next k step (or the first one, for the next block) is
        // prefetched into L2 over this step's tiles, a share before each: a slice (E x kKC,
        // 256 KB at DeepSeek-V3's E 256) comes from L3, or from memory when the rest of a training
        // step ran since the pack, and the step's first strip waited on it. Router fwd+bwd after
        // PyTorch's step (interleaved A/B, DeepSeek-V3 fp32): 35.9 -> 35.6 and 34.8 -> 33.8 ms at
        // 1 thread, 19.3 -> 18.7 and 18.8 -> 18.4 ms at 2.
        LinePrefetch wpf;
        if (!last || blk + 1 < nblk) {
          const int64_t nk = last ? 0 : k0 + kc;
          wpf = LinePrefetch::of(wp.p + nk * NR, H * NR * static_cast<int64_t>(sizeof(Acc)),
                                 std::min(kKC, H - nk) * NR * static_cast<int64_t>(sizeof(Acc)),
                                 npanel);  // one segment per panel
        }
        const int64_t wpf_per = wpf.share((t1 - t0 + kMR - 1) / kMR * npanel);
        for (int64_t tt = t0; tt < t1; tt += kMR) {
          const int64_t mr = std::min<int64_t>(kMR, t1 - tt);
          // The x rows of the next strip (or the block's first strip at the next k step) are
          // prefetched into L2 while this strip runs, a share before each panel: kMR segments of
          // kc values, H apart, which the hardware prefetchers do not follow (a stream of 16 lines,
          // then a jump). When x comes from memory, as after the rest of a training step, the
          // forward stalled on every segment's first lines. DeepSeek-V3 fp32, T 1024, after a
          // 512 MB write (interleaved A/B, medians of 15): 26.3 -> 25.6 ms at 1 thread, 13.3 ->
          // 12.9 ms at 2 with the W pack's prefetch below; level when x is in cache.
          LinePrefetch pf;
          {
            const bool next_strip = tt + kMR < t1;
            const int64_t nt = next_strip ? tt + kMR : t0, nk = next_strip ? k0 : k0 + kc;
            if (nk < H) {
              pf = LinePrefetch::of(x + nt * H + nk, H * static_cast<int64_t>(sizeof(XT)),
                                    std::min(kKC, H - nk) * static_cast<int64_t>(sizeof(XT)),
                                    std::min<int64_t>(kMR, t1 - nt));
            }
          }
          const int64_t pf_per_panel = pf.share(npanel);
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
            pf.burst(pf_per_panel);
            wpf.burst(wpf_per);
            micro_panel<Acc>(mr, nvalid, kc, a, a_rs, 1, wp.p + (p * H + k0) * NR,
                             out + tt * E + p * NR, E, chain,
                             (last && bias) ? bpad.p + p * NR : nullptr);
          }
        }
      }
    }
  }
}

// ---- backward -----------------------------------------------------------------------------

// dst[0:n] = from_acc(src[0:n]). fp32 -> bf16 goes through simd::store_bf16_row (vector
// float_to_bf16 where the variant has one: the same bytes; the scalar conversion was a third of
// grad_x's time at bf16).
template <class Out, class Acc>
inline void store_row(Out* dst, const Acc* src, int64_t n) {
  if constexpr (std::is_same_v<Out, bf16> && std::is_same_v<Acc, float>) {
    simd::store_bf16_row(dst, src, n);
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = from_acc<Out>(src[j]);
  }
}

// dst[0:NR] = src[0:NR] as Acc (exact), for a full panel row.
template <class Acc, class XT>
inline void load_row(Acc* dst, const XT* src) {
  constexpr int NR = kNR<Acc>;
  if constexpr (std::is_same_v<Acc, float> &&
                (std::is_same_v<XT, bf16> || std::is_same_v<XT, float>)) {
    simd::load_f32_row(dst, src, NR);
  } else {
    for (int j = 0; j < NR; ++j) dst[j] = to_acc<Acc>(src[j]);
  }
}

// ---- backward of a sparse grad_logits ------------------------------------------------------

// After top-k routing without an aux or z loss, grad_logits has K nonzeros per token row (8 of
// 128 for Qwen3-30B-A3B, 8 of 256 for DeepSeek-V3): the dense products spend 15/16 of their FMAs
// on g = 0. These kernels run the same chains over the nonzero terms only:
//   grad_x[t,h] : for e ascending with g[t,e] != 0: acc = fma(g[t,e], w[e,h], acc)
//   grad_w[e,h] : for t ascending with g[t,e] != 0: acc = fma(g[t,e], x[t,h], acc)
// which is bitwise the dense chain. Proof: with finite inputs (the front-end rejects NaN/Inf), a
// term with g = 0 has product ±0, and acc + ±0 == acc for every acc except -0 + +0 = +0. So the
// two chains stay equal, or both zero with different signs; a later nonzero product p gives
// round(p) on both. The dense chain can turn -0 into +0 but never +0 into -0 (it starts at +0, and
// x + y rounds to -0 only when both are -0), so the results can differ only where the sparse chain
// ends at -0 (an underflow of a negative product): those outputs are recomputed with the dense
// chain. Chosen by the density of grad_logits alone (never by thread count or batch), and either
// path gives the same bits, so the choice is invisible.
constexpr int64_t kStreamMin = int64_t{8} << 20;  // grad_x bytes from which it is streamed
constexpr int64_t kSparseDensityInv = 8;          // sparse when at most one term in 8 is nonzero

// Whether an output of `rows` rows of `row_bytes` at p, at least `min_bytes` in all, is written
// around the caches: large enough, and every row starting on a cache line, so the kernels' pieces
// of a row are whole lines.
inline bool streamed_rows(const void* p, int64_t rows, int64_t row_bytes, int64_t min_bytes) {
  return rows * row_bytes >= min_bytes && reinterpret_cast<uintptr_t>(p) % 64 == 0 &&
         row_bytes % 64 == 0;
}

// Nonzeros of g [T,E] by token: row t's terms are (col[j], val[j]) for j in [ptr[t], ptr[t+1]),
// e ascending.
template <class Acc>
struct SparseRows {
  SparseRows(int64_t T, int64_t cap)
      : ptr(T + 1), col(std::max<int64_t>(1, cap)), val(std::max<int64_t>(1, cap)) {}
  Scratch<int64_t> ptr;
  Scratch<int32_t> col;
  Scratch<Acc> val;
};

// Counts the nonzeros of g per row (into r.ptr, then their prefix sum); returns false when there
// are more than `cap`, else fills col/val.
template <class Acc>
bool collect_nonzeros(const Acc* g, int64_t T, int64_t E, int64_t cap, SparseRows<Acc>& r) {
  int64_t* const ptr = r.ptr.p;
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    int64_t n = 0;
    for (int64_t e = 0; e < E; ++e) n += g[t * E + e] != Acc(0);
    ptr[t + 1] = n;
  }
  ptr[0] = 0;
  for (int64_t t = 0; t < T; ++t) ptr[t + 1] += ptr[t];
  if (ptr[T] > cap) return false;
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    int64_t j = ptr[t];
    for (int64_t e = 0; e < E; ++e) {
      const Acc v = g[t * E + e];
      if (v != Acc(0)) {
        r.col.p[j] = static_cast<int32_t>(e);
        r.val.p[j] = v;
        ++j;
      }
    }
  }
  return true;
}

// Returns whether every value of w and of grad_w is finite: w's rows are tested as each segment
// is packed (all of w is packed, in L1 when tested), grad_w's as each row chunk is stored.
template <class Acc, class XT, class WT>
bool sparse_backward(const SparseRows<Acc>& r, const Acc* g, const XT* x, const WT* w, XT* grad_x,
                     WT* grad_w, int64_t T, int64_t H, int64_t E) {
  using V = simd::Vec<Acc>;
  constexpr int64_t L = V::kLanes;
  const int64_t* const ptr = r.ptr.p;
  const int32_t* const col = r.col.p;
  const Acc* const val = r.val.p;
  constexpr bool kDirectX = std::is_same_v<XT, Acc>;
  // A large grad_x is written around the caches: its lines are not read in first. Its memory is
  // usually cold (last written a step ago, the other layers ran since): in the router benchmark,
  // which alternates with PyTorch's step, DeepSeek-V3's fp32 backward 13.1 -> 10.9 ms. fp32/fp64
  // rows are streamed from the registers, bf16 rows (an fp32 router) as each 32-value sub-segment
  // is rounded. Streamed only when every row starts on a cache line (torch's 64-byte-aligned
  // tensors, H·size a multiple of 64), so each sub-segment below is whole lines.
#ifdef SY_SIMD_AVX2
  constexpr bool kStreamBf16 = std::is_same_v<XT, bf16> && std::is_same_v<Acc, float>;
#else
  constexpr bool kStreamBf16 = false;
#endif
  const bool stream_x = (kDirectX || kStreamBf16) &&
                        streamed_rows(grad_x, T, H * static_cast<int64_t>(sizeof(XT)), kStreamMin);
  const int nthreads = omp_get_max_threads();
  // grad_x segments of xb columns: the packed W segment (E x xb) at most 1 MB, at most 1024
  // columns (DeepSeek-V3: 1024 of fp32 for E 256; Qwen3-30B-A3B's E 128 also 1024), computed in
  // sub-segments of kGxS columns (128 bytes: kGxV vectors).
  const int64_t xb = std::clamp<int64_t>(
      (int64_t{1} << 20) / (std::max<int64_t>(E, 1) * static_cast<int64_t>(sizeof(Acc))) / 64 * 64,
      64, 1024);
  constexpr int64_t kGxS = std::max<int64_t>(L, 128 / static_cast<int64_t>(sizeof(Acc)));
  constexpr int kGxV = static_cast<int>(kGxS / L);
  Scratch<Acc> rows(nthreads * kGxS);  // per-thread grad_x sub-segment before rounding
  // grad_w by expert: the nonzeros re-sorted by expert, t ascending within an expert (the chain's
  // order), from the token-sorted lists.
  const int64_t nnz = ptr[T];
  Scratch<int64_t> eptr(E + 1), cursor(E);
  Scratch<int32_t> erow(nnz);
  Scratch<Acc> eval(nnz);
  for (int64_t e = 0; e <= E; ++e) eptr.p[e] = 0;
  for (int64_t j = 0; j < nnz; ++j) ++eptr.p[col[j] + 1];
  for (int64_t e = 0; e < E; ++e) {
    eptr.p[e + 1] += eptr.p[e];
    cursor.p[e] = eptr.p[e];
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = ptr[t]; j < ptr[t + 1]; ++j) {
      const int64_t pos = cursor.p[col[j]]++;
      erow.p[pos] = static_cast<int32_t>(t);
      eval.p[pos] = val[j];
    }
  }
  // grad_w work items: chunks of hc columns; within an item, blocks of kTB tokens in order, and
  // per block every expert's tokens. The block's x rows (kTB x hc, 1 MB) are packed contiguous
  // and stay in L2 while its K experts read each row; each (expert, column) chain resumes from the
  // previous block. 512-token blocks make the chunks 512 fp32 columns: each packed row segment
  // is a 2 KB run of x, where 1024-token blocks read 1 KB runs (-2 to -4 % for the DeepSeek-V3
  // fp32 kernel, interleaved A/B at 1 and 2 threads).
  constexpr int64_t kTB = 512;
  int64_t hc = (int64_t{1} << 20) /
               (std::max<int64_t>(1, std::min(T, kTB)) * static_cast<int64_t>(sizeof(Acc)));
  hc = std::clamp<int64_t>(hc / 64 * 64, 64, 512);
  const int64_t nchunk = (H + hc - 1) / hc;
  // An fp32/fp64 grad_w from 4 MB on is written around the caches too: each chunk row once, at
  // the end, into memory as cold as grad_x's (through the caches every line was read in first).
  // DeepSeek-V3 fp32 (7 MB; kernel A/B, medians of 11): 11.51 -> 10.00 ms at 1 thread, 11.53 ->
  // 10.11 after a 256 MB write. Only when every chunk row is whole lines (hc is a multiple of 64).
  const bool stream_w =
      std::is_same_v<WT, Acc> &&
      streamed_rows(grad_w, E, H * static_cast<int64_t>(sizeof(WT)), kStreamMin / 2);
  Scratch<Acc> waccs(nthreads * E * hc);                  // per-thread chains of a chunk
  Scratch<Acc> xpacks(nthreads * std::min(T, kTB) * hc);  // per-thread packed x rows of a block
  Scratch<Acc> wpacks(nthreads * E * xb);                 // per-thread packed W segment
  const int64_t nseg = (H + xb - 1) / xb;
  const int64_t ntblk =
      std::clamp<int64_t>((nthreads + nseg - 1) / nseg, 1, std::max<int64_t>(T, 1));
  const int64_t tblk = (T + ntblk - 1) / ntblk;
  Scratch<int64_t> wcursors(nthreads * E);
  bool non_finite = false;
#pragma omp parallel reduction(|| : non_finite) if (T * H * E >= kParallelMin)
  {
    const int tid = omp_get_thread_num();
    // grad_x in segments of xb columns, each segment over a block of tokens (all T unless that
    // leaves a thread idle). The segment's W columns are packed (E x xb, the accumulation type)
    // into a contiguous per-thread block that stays in L2 across the block's tokens: read in
    // place, each of a token's K rows was a different 4 KB page of W (28 KB apart at DeepSeek-V3's
    // H 7168), a TLB miss per row, and W was streamed from L3 once per 32 tokens. The block is
    // [sub][e][kGxS]: sub-segments of kGxS columns (128 bytes), the last one zero-padded.
    Acc* const seg = rows.p + tid * kGxS;
    Acc* const wpk = wpacks.p + tid * E * xb;
#pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < nseg * ntblk; ++item) {
      const int64_t hb = item / ntblk * xb, nb = std::min(xb, H - hb);
      const int64_t t0 = item % ntblk * tblk, t1 = std::min(T, t0 + tblk);
      for (int64_t e = 0; e < E; ++e) {
        const WT* const src = w + e * H + hb;
        for (int64_t s = 0; s < nb; s += kGxS) {
          Acc* const dst = wpk + s * E + e * kGxS;
          const int64_t n = std::min(kGxS, nb - s);
          for (int64_t h = 0; h < n; ++h) dst[h] = to_acc<Acc>(src[s + h]);
          for (int64_t h = n; h < kGxS; ++h) dst[h] = Acc(0);
        }
        non_finite = non_finite || simd::any_non_finite(src, nb);
      }
      // grad_x[t, hb+s : hb+s+kGxS): kGxV chains in registers over the token's terms.
      const auto sub = [&](int64_t t, int64_t s) {
        const Acc* const ws = wpk + s * E;
        const int64_t n = std::min(kGxS, nb - s);
        V a[kGxV];
        for (int i = 0; i < kGxV; ++i) a[i] = V::zero();
        for (int64_t j = ptr[t]; j < ptr[t + 1]; ++j) {
          const V gv = V::bcast(val[j]);
          const Acc* const wr = ws + col[j] * kGxS;
          for (int i = 0; i < kGxV; ++i) a[i] = fma(gv, V::load(wr + i * L), a[i]);
        }
        Acc* const out = kDirectX ? reinterpret_cast<Acc*>(grad_x + t * H + hb + s) : seg;
        bool negative_zero = false;
        if (n == kGxS) {
          for (int i = 0; i < kGxV; ++i) negative_zero |= a[i].any_negative_zero();
          if (kDirectX && stream_x) {
            for (int i = 0; i < kGxV; ++i) a[i].stream(out + i * L);
            if (negative_zero) simd::stream_fence();  // read back below
          } else {
            for (int i = 0; i < kGxV; ++i) a[i].store(out + i * L);
          }
        } else {  // the last, partial sub-segment: its padded lanes are dropped
          Acc tail[kGxS];
          for (int i = 0; i < kGxV; ++i) a[i].store(tail + i * L);
          for (int64_t h = 0; h < n; ++h) {
            out[h] = tail[h];
            negative_zero |= simd::is_negative_zero(tail[h]);
          }
        }
        for (int64_t h = 0; negative_zero && h < n; ++h) {
          if (simd::is_negative_zero(out[h])) {  // the dense chain decides the sign (see above)
            Acc d = Acc(0);
            for (int64_t e = 0; e < E; ++e) d = std::fma(g[t * E + e], ws[e * kGxS + h], d);
            out[h] = d;
          }
        }
#ifdef SY_SIMD_AVX2
        if constexpr (kStreamBf16) {
          if (stream_x && n == kGxS) {
            static_assert(kGxS == 32);
            simd::stream16_bf16(grad_x + t * H + hb + s, out);
            simd::stream16_bf16(grad_x + t * H + hb + s + 16, out + 16);
            return;
          }
        }
#endif
        if constexpr (!kDirectX) store_row<XT, Acc>(grad_x + t * H + hb + s, out, n);
      };
      // Streamed, each sub-segment runs over all the block's tokens, so its W (E x kGxS, 32 KB at
      // E 256 fp32) stays in L1 while every token reads its K rows; a token's whole segment at a
      // time read those rows from L2 (4 KB each) and was bound by L2 bandwidth. DeepSeek-V3 fp32
      // backward kernel (interleaved A/B, medians): 9.48 -> 8.68 ms at 1 thread, 4.91 -> 4.51 ms
      // at 2. Written through the caches, that order leaves 128-byte pieces of every row to be
      // read in and written back, so there a token's row segment stays the unit.
      if (stream_x) {
        for (int64_t s = 0; s < nb; s += kGxS)
          for (int64_t t = t0; t < t1; ++t) sub(t, s);
      } else {
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t s = 0; s < nb; s += kGxS) sub(t, s);
      }
    }
    if (stream_x) simd::stream_fence();
    // grad_w, one chunk of hc columns per item (see above), eight chains of L columns at a time
    // in registers.
    Acc* const wacc = waccs.p + tid * E * hc;
    Acc* const xpk = xpacks.p + tid * std::min(T, kTB) * hc;
    int64_t* const cur = wcursors.p + tid * E;
#pragma omp for schedule(dynamic)
    for (int64_t c = 0; c < nchunk; ++c) {
      const int64_t h0 = c * hc, nv = std::min(hc, H - h0);
      const XT* const xc = x + h0;
      for (int64_t e = 0; e < E; ++e) cur[e] = eptr.p[e];
      for (int64_t tb0 = 0; tb0 < std::max<int64_t>(T, 1); tb0 += kTB) {
        const int64_t tb1 = std::min(T, tb0 + kTB);
        const bool first = tb0 == 0;
        // The block's x rows of this chunk, packed contiguous in the accumulation type (each row
        // is read by its K experts: in place, every read was another 4 KB page, and bf16 was
        // converted K times). Rows without a nonzero term are never read.
        for (int64_t t = tb0; t < tb1; ++t) {
          if (ptr[t] == ptr[t + 1]) continue;
          Acc* const dst = xpk + (t - tb0) * hc;
          const XT* const src = xc + t * H;
          for (int64_t h = 0; h < nv; ++h) dst[h] = to_acc<Acc>(src[h]);
        }
        for (int64_t e = 0; e < E; ++e) {
          const int64_t j0 = cur[e];
          int64_t j1 = j0;
          while (j1 < eptr.p[e + 1] && erow.p[j1] < tb1) ++j1;
          cur[e] = j1;
          if (j0 == j1 && !first) continue;  // no term: the chains stand
          Acc* const arow = wacc + e * hc;
          int64_t h = 0;
          for (; h + 8 * L <= nv; h += 8 * L) {
            V a[8];
            for (int i = 0; i < 8; ++i) a[i] = first ? V::zero() : V::load(arow + h + i * L);
            for (int64_t j = j0; j < j1; ++j) {
              const V gv = V::bcast(eval.p[j]);
              const Acc* xr = xpk + (erow.p[j] - tb0) * hc + h;
              for (int i = 0; i < 8; ++i) a[i] = fma(gv, V::load(xr + i * L), a[i]);
            }
            for (int i = 0; i < 8; ++i) a[i].store(arow + h + i * L);
          }
          for (; h + L <= nv; h += L) {
            V a0 = first ? V::zero() : V::load(arow + h);
            for (int64_t j = j0; j < j1; ++j)
              a0 = fma(V::bcast(eval.p[j]), V::load(xpk + (erow.p[j] - tb0) * hc + h), a0);
            a0.store(arow + h);
          }
          for (; h < nv; ++h) {
            Acc a = first ? Acc(0) : arow[h];
            for (int64_t j = j0; j < j1; ++j)
              a = std::fma(eval.p[j], xpk[(erow.p[j] - tb0) * hc + h], a);
            arow[h] = a;
          }
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        Acc* const arow = wacc + e * hc;
        bool negative_zero = false;
        int64_t h = 0;
        for (; h + L <= nv; h += L) negative_zero |= V::load(arow + h).any_negative_zero();
        for (; h < nv; ++h) negative_zero |= simd::is_negative_zero(arow[h]);
        for (h = 0; negative_zero && h < nv; ++h) {
          if (simd::is_negative_zero(arow[h])) {  // the dense chain decides the sign (see above)
            Acc d = Acc(0);
            for (int64_t t = 0; t < T; ++t)
              d = std::fma(g[t * E + e], to_acc<Acc>(xc[t * H + h]), d);
            arow[h] = d;
          }
        }
        WT* const dst = grad_w + e * H + h0;
        if constexpr (std::is_same_v<WT, Acc>) {
          // The values as stored, tested while in L1; then streamed when the row is whole lines.
          non_finite = non_finite || simd::any_non_finite(arow, nv);
          if (stream_w) {
            assert(nv % L == 0);  // H·size is a multiple of 64 bytes
            for (int64_t h = 0; h < nv; h += L) V::load(arow + h).stream(dst + h);
          } else {
            store_row<WT, Acc>(dst, arow, nv);
          }
        } else {  // rounded to bf16 (which can overflow to inf): tested as stored
          store_row<WT, Acc>(dst, arow, nv);
          non_finite = non_finite || simd::any_non_finite(dst, nv);
        }
      }
    }
    if (stream_w) simd::stream_fence();
  }
  return !non_finite;
}

// Returns whether every value of w and of grad_w is finite (see gate_kernels.h).
template <class Acc, class XT, class WT>
bool backward_impl(const Acc* g, const XT* x, const WT* w, XT* grad_x, WT* grad_w, Acc* grad_b,
                   int64_t T, int64_t H, int64_t E) {
  constexpr int NR = kNR<Acc>;
  constexpr int BW = kBW<Acc>;  // panel width over H
  const int64_t npanel = (H + BW - 1) / BW;
  const int64_t h_pad = npanel * BW;

  // grad_b: one sum per expert over t ascending (vectorised across experts, never across t).
  if (grad_b) {
    for (int64_t e = 0; e < E; ++e) grad_b[e] = Acc(0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) grad_b[e] = grad_b[e] + g[t * E + e];
  }
  if (H == 0) return true;  // w and grad_w have no elements
  if (E == 0) {             // empty chains; grad_w has no elements
    for (int64_t i = 0; i < T * H; ++i) grad_x[i] = from_acc<XT>(Acc(0));
    return true;
  }
  if (T > 0) {
    const int64_t cap = T * E / kSparseDensityInv;
    SparseRows<Acc> rows(T, cap);
    if (collect_nonzeros(g, T, E, cap, rows)) {
      return sparse_backward<Acc, XT, WT>(rows, g, x, w, grad_x, grad_w, T, H, E);
    }
  }

  // grad_x = G · W: W packed as H/BW panels of E x BW (zero columns past H). Each output is one
  // chain over all E (kc = E), so no partial sum ever leaves the registers. Per block of kMB
  // tokens the panel loop is outside the strip loop: the panel (E x BW) stays in L1 across the
  // block's strips and the block's G rows in L2; with the strips outside, every strip streamed the
  // whole packed W (E·H values: 7 MB at H 7168, E 256) from L3.
  //
  // grad_w = Gᵀ · X: parallel over groups of H panels (never over t, so the chain over t is
  // fixed); the chain is kept in an Acc buffer across KC blocks of tokens and rounded once at the
  // end. A group packs kGP panels of a token block at once, so each x row is read as one
  // contiguous 512-column segment (1 KB at bf16): one narrow panel at a time read 32 bytes per
  // 4 KB-strided row, a TLB miss per row, and 128-column groups still spent a fifth of the
  // backward stalled in that pack; the next block's segments are prefetched (LinePrefetch) while
  // a block computes. G is packed once, before the groups, into MR-expert tiles per KC block of
  // tokens (gp[blk][tile][k][i] = g[t0 + k, tile*MR + i], zero past E): read in place, the
  // microkernel's broadcasts walked G's rows E·4 bytes apart, a stride that maps a block's 256
  // rows onto a few L1 sets.
  //
  // One parallel region, one barrier (after the packing): grad_x's token blocks and grad_w's
  // groups are independent work items taken dynamically, so a thread that loses its core for a
  // while (a shared machine) delays its items, not a barrier. No item's result depends on which
  // thread runs it or when.
  constexpr int64_t kGP = 16;  // panels per group: 16 x 32 fp32 columns
  const int64_t ngroup = (npanel + kGP - 1) / kGP;
  const int64_t ntile = (E + kMR - 1) / kMR;
  const int64_t nkb = (T + kKC - 1) / kKC;
  const int64_t nblk = (T + kMB - 1) / kMB;
  Scratch<Acc> wq(T > 0 ? npanel * E * BW : 1);
  Scratch<Acc> acc(E * h_pad);
  Scratch<Acc> gp(std::max<int64_t>(1, T * ntile * kMR));
  Scratch<Acc> xp_all(omp_get_max_threads() * kGP * kKC * BW);  // per-thread packed x blocks
#pragma omp parallel if (T * H * E >= kParallelMin)
  {
#pragma omp for schedule(static) nowait
    for (int64_t p = 0; p < (T > 0 ? npanel : 0); ++p) {
      const int64_t nvalid = std::min<int64_t>(BW, H - p * BW);
      for (int64_t e = 0; e < E; ++e) {
        Acc* dst = wq.p + (p * E + e) * BW;
        const WT* src = w + e * H + p * BW;
        if (nvalid == BW) {
          load_row<Acc, WT>(dst, src);
          load_row<Acc, WT>(dst + NR, src + NR);
        } else {
          for (int64_t j = 0; j < nvalid; ++j) dst[j] = to_acc<Acc>(src[j]);
          for (int64_t j = nvalid; j < BW; ++j) dst[j] = Acc(0);
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t k0 = kb * kKC, kc = std::min(kKC, T - k0);
      Acc* const dst = gp.p + k0 * ntile * kMR;
      for (int64_t ti = 0; ti < ntile; ++ti) {
        const int64_t e0 = ti * kMR, nv = std::min<int64_t>(kMR, E - e0);
        Acc* const d = dst + ti * kc * kMR;
        for (int64_t k = 0; k < kc; ++k) {
          const Acc* src = g + (k0 + k) * E + e0;
          for (int64_t i = 0; i < nv; ++i) d[k * kMR + i] = src[i];
          for (int64_t i = nv; i < kMR; ++i) d[k * kMR + i] = Acc(0);
        }
      }
    }  // implicit barrier: wq and gp are complete below

    // grad_x, one block of kMB tokens per item.
#pragma omp for schedule(dynamic) nowait
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const int64_t t0 = blk * kMB, t1 = std::min(T, t0 + kMB);
      Acc tile[kMR * BW];
      for (int64_t p = 0; p < npanel; ++p) {
        const int64_t nvalid = std::min<int64_t>(BW, H - p * BW);
        const Acc* b = wq.p + p * E * BW;
        for (int64_t tt = t0; tt < t1; tt += kMR) {
          const int64_t mr = std::min<int64_t>(kMR, t1 - tt);
          if constexpr (std::is_same_v<XT, Acc>) {
            micro_panel<Acc>(mr, nvalid, E, g + tt * E, E, 1, b, grad_x + tt * H + p * BW, H,
                             Chain::start);
          } else {
            micro_panel<Acc>(mr, BW, E, g + tt * E, E, 1, b, tile, BW, Chain::start);
            for (int64_t i = 0; i < mr; ++i)
              store_row<XT, Acc>(grad_x + (tt + i) * H + p * BW, tile + i * BW, nvalid);
          }
        }
      }
    }

    // grad_w, one group of kGP panels per item.
    Acc* const xp = xp_all.p + omp_get_thread_num() * kGP * kKC * BW;
#pragma omp for schedule(dynamic)
    for (int64_t grp = 0; grp < ngroup; ++grp) {
      const int64_t p0 = grp * kGP, p1 = std::min(npanel, p0 + kGP);
      const int64_t h0 = p0 * BW, h1 = std::min(H, p1 * BW);  // valid columns of the group
      if (T == 0) {
        for (int64_t e = 0; e < E; ++e)
          for (int64_t h = h0; h < p1 * BW; ++h) acc.p[e * h_pad + h] = Acc(0);
      }
      for (int64_t k0 = 0; k0 < T; k0 += kKC) {
        const int64_t kc = std::min(kKC, T - k0);
        // Pack: xp[(p - p0)][k][j] = x[k0 + k, p*BW + j], zero past H.
        for (int64_t k = 0; k < kc; ++k) {
          const XT* src = x + (k0 + k) * H;
          for (int64_t p = p0; p < p1; ++p) {
            Acc* dst = xp + ((p - p0) * kc + k) * BW;
            const int64_t nvalid = std::min<int64_t>(BW, H - p * BW);
            if (nvalid == BW) {
              load_row<Acc, XT>(dst, src + p * BW);
              load_row<Acc, XT>(dst + NR, src + p * BW + NR);
            } else {
              for (int64_t j = 0; j < nvalid; ++j) dst[j] = to_acc<Acc>(src[p * BW + j]);
              for (int64_t j = nvalid; j < BW; ++j) dst[j] = Acc(0);
            }
          }
        }
        const Chain chain = k0 == 0 ? Chain::start : Chain::resume;
        const Acc* const gblk = gp.p + k0 * ntile * kMR;
        // The next token block's x segments, prefetched while this block computes.
        LinePrefetch pf;
        if (k0 + kKC < T) {
          pf = LinePrefetch::of(x + (k0 + kKC) * H + h0, H * static_cast<int64_t>(sizeof(XT)),
                                (h1 - h0) * static_cast<int64_t>(sizeof(XT)),
                                std::min(kKC, T - k0 - kKC));
        }
        for (int64_t p = p0; p < p1; ++p) {
          const Acc* b = xp + (p - p0) * kc * BW;
          for (int64_t ti = 0; ti < ntile; ++ti) {
            const int64_t e0 = ti * kMR, mr = std::min<int64_t>(kMR, E - e0);
            micro_panel<Acc>(mr, BW, kc, gblk + ti * kc * kMR, 1, kMR, b,
                             acc.p + e0 * h_pad + p * BW, h_pad, chain, nullptr, &pf);
          }
        }
      }
      for (int64_t e = 0; e < E; ++e)
        store_row<WT, Acc>(grad_w + e * H + h0, acc.p + e * h_pad + h0, h1 - h0);
    }
  }
  // The dense products are compute-bound: one scan of each afterwards costs little beside them.
  return first_non_finite(w, dtype_of<WT>(), E * H) == E * H &&
         first_non_finite(grad_w, dtype_of<WT>(), E * H) == E * H;
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

// Acc (the router dtype: float or double), XT and WT (bf16, float or double) from the run-time
// dtypes, as tags: f(Acc{}, XT{}, WT{}).
template <class F>
void with_gate_types(DType acc_dtype, DType x_dtype, DType w_dtype, F&& f) {
  auto run = [&](auto acc_tag) {
    with_float_type(x_dtype, [&](auto x_tag) {
      with_float_type(w_dtype, [&](auto w_tag) { f(acc_tag, x_tag, w_tag); });
    });
  };
  if (acc_dtype == DType::fp64) {
    run(double{});
  } else {
    run(float{});
  }
}

}  // namespace

void gate_forward(const void* x, DType x_dtype, const void* weight, DType w_dtype, const void* bias,
                  DType bias_dtype, void* logits, DType acc_dtype, int64_t num_tokens,
                  int64_t hidden, int64_t num_experts) {
  if (bias == nullptr) bias_dtype = acc_dtype;  // any instantiable type: the pointer is unused
  with_gate_types(acc_dtype, x_dtype, w_dtype, [&](auto acc_tag, auto x_tag, auto w_tag) {
    using Acc = decltype(acc_tag);
    using XT = decltype(x_tag);
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
}

bool gate_backward(const void* grad_logits, const void* x, DType x_dtype, const void* weight,
                   DType w_dtype, void* grad_x, void* grad_weight, void* grad_bias, DType acc_dtype,
                   int64_t num_tokens, int64_t hidden, int64_t num_experts) {
  bool finite = true;
  with_gate_types(acc_dtype, x_dtype, w_dtype, [&](auto acc_tag, auto x_tag, auto w_tag) {
    using Acc = decltype(acc_tag);
    using XT = decltype(x_tag);
    using WT = decltype(w_tag);
    if constexpr ((std::is_same_v<Acc, float> && std::is_same_v<XT, double>) ||
                  std::is_same_v<WT, double>) {
      return;  // rejected by the front-end
    } else {
      finite = backward_impl<Acc, XT, WT>(
          static_cast<const Acc*>(grad_logits), static_cast<const XT*>(x),
          static_cast<const WT*>(weight), static_cast<XT*>(grad_x), static_cast<WT*>(grad_weight),
          static_cast<Acc*>(grad_bias), num_tokens, hidden, num_experts);
    }
  });
  return finite;
}

}  // namespace switchyard::cpu::SY_ISA_NS
