// Version 3 block payload: rows coded as a token-delta match mask plus the unmatched ids as a SET
// (sorted popularity ranks: the first, then the gaps) and the slot order of that set (its Lehmer
// code), every symbol coded by a static rANS coder with the block's own frequency tables (per
// layer for ranks and gaps). Why this split (measured on bench/py_routes_rl_scale.py's batch):
// consecutive tokens share most experts slot for slot, so the mask removes most ids for ~0.6
// bits/id; what is left is a set whose sorted ranks cost about the per-layer order-0 entropy less
// log2(m!) per row; the order of those m ids is coded on its own, so a table whose slots follow
// popularity (a top-k's order) pays almost nothing for it and a random order pays log2(m!). The
// order is kept: a replayed row is used as given and combine sums its slots in slot order, so a
// lossy order would change the trainer's bits.
// Speed (bench_routes, Zipf s 1.0, E 128, K 8, 48 layers: 0.25-0.3 GB/s of int32 per core either
// way) is bounded by this layout, not by the code: a row costs 12 rANS symbols (mask, 8 set
// symbols, 3 order groups even when the order is free), 1.5 per routed id, on two interleaved
// states. Measured per block (CPU time, load ~4 on 2 cores): the encoder's rANS loop alone takes
// 2.7 ns per symbol, 4.1 ns per id (1 GB/s is 4 ns per id), the rows' modelling 6 ns per id and
// the ranks 3 ns per id; a bare static rANS decoder with one L1-resident lookup table takes 5 ns
// per symbol (17 ns with 96 per-layer full lookup tables, hence the bucket index). 1 GB/s needs
// another layout (notes/routes.md: fewer symbols per row, tables shared across layers, 16-32
// SIMD-interleaved states). Version 4 (kBlockSetRows, the second half of this file) is that layout:
// the order-free case folded into the mask symbol, tables shared by clusters of layers, the set
// symbols in 32 states with an AVX2 row step in the decoder (notes/routes.md, "Format version 4").
#include <algorithm>
#include <array>
#include <functional>
#include <memory>
#include <numeric>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "check.h"
#include "cpu/isa.h"
#include "route_codec.h"

namespace switchyard::detail {

namespace {

// rANS state interval [L, 2^31) with 16-bit words out: below 2^31 the encoder's reciprocal
// division (multiply and shift) is exact, and one renormalisation step always suffices.
constexpr uint32_t kRansL = 1u << 15;
constexpr int kFixedHeader = 13;  // scale (1 byte), then u32 sizes of the head, rans, raw streams
constexpr int kBucketShift = 4;   // decode: 16 slots -> the first symbol in them, then a short scan
constexpr int kSymBits = 13;      // a buffered symbol: model << 13 | symbol (symbols < 4098)
constexpr int64_t kOrderAlphabet = 256;
constexpr uint8_t kZeroWord[2] = {0, 0};  // what the decoder reads past the end of its words  // an
                                          // order symbol packs Lehmer digits up to this product

int bit_width_of(uint64_t v) { return v == 0 ? 0 : 64 - __builtin_clzll(v); }

// Appends bits (LSB first) to a byte string; up to 57 bits per put.
struct Bits {
  std::string& out;
  uint64_t acc = 0;
  int n = 0;
  void put(uint64_t v, int bits) {
    if (bits > 32) {
      put(v & 0xffffffffu, 32);
      put(v >> 32, bits - 32);
      return;
    }
    acc |= (v & ((uint64_t{1} << bits) - 1)) << n;
    n += bits;
    while (n >= 8) {
      out.push_back(static_cast<char>(acc & 255));
      acc >>= 8;
      n -= 8;
    }
  }
  void gamma(uint32_t v) {  // v >= 1: (width - 1) zeros, a one, then v's lower width - 1 bits
    const int w = bit_width_of(v);
    put(0, w - 1);
    put(1, 1);
    put(v, w - 1);
  }
  void flush() {
    if (n > 0) out.push_back(static_cast<char>(acc & 255));
    acc = 0;
    n = 0;
  }
};

// Reads bits back; past the end it reads zeros and sets `over` (the caller reports corruption).
struct BitsIn {
  const uint8_t* p;
  int64_t size;
  int64_t pos = 0;  // in bits
  bool over = false;
  uint64_t get(int bits) {  // bits <= 32
    if (bits == 0) return 0;
    if (pos + bits > size * 8) {
      over = true;
      pos = size * 8;
      return 0;
    }
    uint64_t w = 0;
    const int64_t byte = pos >> 3;
    if (byte + 8 <= size) {
      std::memcpy(&w, p + byte, 8);
    } else {
      std::memcpy(&w, p + byte, size_t(size - byte));
    }
    const uint64_t v = (w >> (pos & 7)) & ((uint64_t{1} << bits) - 1);
    pos += bits;
    return v;
  }
  uint32_t gamma() {  // 0 on a malformed code (more than 31 leading zeros)
    int z = 0;
    while (get(1) == 0) {
      if (over || ++z > 31) {
        over = true;
        return 0;
      }
    }
    return uint32_t((uint64_t{1} << z) | get(z));
  }
  // Whole stream consumed: only the last byte's padding left, and it is zero.
  bool done() const {
    if (over || (pos + 7) / 8 != size) return false;
    return (pos & 7) == 0 || (p[size - 1] >> (pos & 7)) == 0;
  }
};

// The Lehmer digits of m slots (digit j in [0, m - j)) in groups of consecutive digits whose
// radix product is at most kOrderAlphabet: one symbol per group (the last digit, radix 1, is
// always 0 and is not coded).
struct OrderGroup {
  int first = 0, count = 0;  // digits first .. first + count - 1
  int64_t alphabet = 1;
};
std::vector<OrderGroup> order_groups(int m) {
  std::vector<OrderGroup> g;
  for (int j = 0; j < m - 1; ++j) {
    const int64_t radix = m - j;
    if (g.empty() || g.back().alphabet * radix > kOrderAlphabet) g.push_back({j, 0, 1});
    g.back().count += 1;
    g.back().alphabet *= radix;
  }
  return g;
}

// A static model: `n` symbols, at `first` in the flat per-symbol arrays.
struct Model {
  int64_t n = 0;
  int64_t first = 0;
  bool empty = true;
};

// The block's models, in header order: M0 (mask low 8 bits + escape + all-none), M1 (mask high
// bits, K > 8), the order groups of m = 2..K unmatched slots, then per layer F (smallest rank of
// the unmatched set) and G (gap - 1 to the next rank).
struct Models {
  std::vector<Model> m;
  std::vector<std::vector<OrderGroup>> groups;  // [m]
  std::vector<int64_t> order_model;             // [m]: model of the first group
  int64_t total = 0;
  int64_t layer0 = 0;  // model of F[0]
  // Version 4 (v4): M0 also carries the "unsorted" flag (twice the mask symbols) and the per
  // layer F, G tables are not here (L = 0; see the v4 coder below).
  Models(int64_t L, int64_t K, int64_t E, bool v4 = false) {
    const auto add = [&](int64_t n) {
      m.push_back({n, total, true});
      total += n;
    };
    add((int64_t{v4 ? 2 : 1} << std::min<int64_t>(K, 8)) + 2);
    add(K > 8 ? (int64_t{1} << (K - 8)) : 0);
    groups.resize(size_t(K + 1));
    order_model.assign(size_t(K + 1), -1);
    for (int mm = 2; mm <= K; ++mm) {
      groups[size_t(mm)] = order_groups(mm);
      order_model[size_t(mm)] = static_cast<int64_t>(m.size());
      for (const OrderGroup& g : groups[size_t(mm)]) add(g.alphabet);
    }
    layer0 = static_cast<int64_t>(m.size());
    for (int64_t l = 0; l < L; ++l) {
      add(E);
      add(std::max<int64_t>(E - 1, 1));
    }
  }
};

// The expert permutation of a ranked block (L * E values of bit_width(E - 1) bits), checked to
// be one per layer.
std::string read_perm(BitsIn& hb, int64_t head_n, int64_t L, int64_t E, std::vector<int32_t>& perm) {
  const int pb = bit_width_of(uint64_t(E - 1));
  if (pb > 0 && L * E > head_n * 8 / pb) {
    return "set-coded payload: header too short for the expert permutation";
  }
  perm.resize(static_cast<size_t>(L * E));
  std::vector<uint8_t> seen(static_cast<size_t>(E));
  for (int64_t l = 0; l < L; ++l) {
    std::fill(seen.begin(), seen.end(), 0);
    for (int64_t r = 0; r < E; ++r) {
      const uint64_t p = hb.get(pb);
      if (int64_t(p) >= E || seen[size_t(p)]) {
        return cat("layer ", l, " expert permutation is invalid at rank ", r);
      }
      seen[size_t(p)] = 1;
      perm[size_t(l * E + r)] = static_cast<int32_t>(p);
    }
  }
  return {};
}

// Digits of every order symbol: [m][group] -> value -> 4-bit Lehmer digits, first digit lowest.
std::vector<std::vector<std::vector<uint64_t>>> order_digits(const Models& models, int64_t K) {
  std::vector<std::vector<std::vector<uint64_t>>> digits(size_t(K + 1));
  for (int m = 2; m <= K; ++m) {
    for (const OrderGroup& g : models.groups[size_t(m)]) {
      std::vector<uint64_t> dv(size_t(g.alphabet));
      for (int64_t val = 0; val < g.alphabet; ++val) {
        int64_t rest = val;
        uint64_t packed = 0;
        for (int j = g.first + g.count - 1; j >= g.first; --j) {
          packed |= uint64_t(rest % (m - j)) << (4 * (j - g.first));
          rest /= (m - j);
        }
        dv[size_t(val)] = packed;
      }
      digits[size_t(m)].push_back(std::move(dv));
    }
  }
  return digits;
}

// Frequencies normalised to sum 2^S: every used symbol at least 1, the rest by share, the
// rounding remainder to the most used symbol.
void normalise(const uint32_t* count, int64_t n, int S, uint16_t* freq, bool& empty) {
  uint64_t total = 0;
  int64_t used = 0, top = 0;
  for (int64_t i = 0; i < n; ++i) {
    total += count[i];
    used += count[i] > 0;
    if (count[i] > count[top]) top = i;
  }
  empty = total == 0;
  if (empty) {
    std::fill(freq, freq + n, uint16_t{0});
    return;
  }
  const uint64_t spare = (uint64_t{1} << S) - uint64_t(used);  // used <= n <= 2^S
  uint64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    freq[i] = count[i] ? static_cast<uint16_t>(1 + count[i] * spare / total) : uint16_t{0};
    sum += freq[i];
  }
  freq[top] = static_cast<uint16_t>(freq[top] + ((uint64_t{1} << S) - sum));
}

// Encoder form of a symbol (the reciprocal division of ryg_rans, exact for states below 2^31).
struct EncSym {
  uint32_t x_max = 0, rcp_freq = 0, bias = 0;
  uint16_t cmpl_freq = 0, rcp_shift = 0;
};
static_assert(sizeof(EncSym) == 16, "the AVX2 set encoder loads an EncSym as 16 bytes");
EncSym enc_sym(uint32_t start, uint32_t freq, int S) {
  EncSym e;
  e.x_max = ((kRansL >> S) << 16) * freq;  // <= 2^31
  e.cmpl_freq = static_cast<uint16_t>((1u << S) - freq);
  if (freq < 2) {
    e.rcp_freq = ~0u;
    e.rcp_shift = 0;
    e.bias = start + (1u << S) - 1;
  } else {
    uint32_t shift = 0;
    while (freq > (1u << shift)) ++shift;
    e.rcp_freq = static_cast<uint32_t>(((uint64_t{1} << (shift + 31)) + freq - 1) / freq);
    e.rcp_shift = static_cast<uint16_t>(shift - 1);
    e.bias = start;
  }
  return e;
}

// One rANS encoder step (ryg_rans' reciprocal form): a word out when the state would leave
// [kRansL, 2^31), written at wp[-1] always and kept only then (no branch to mispredict).
[[gnu::always_inline]] inline void rans_put(uint32_t& st, const EncSym& e, uint16_t*& wp) {
  const uint32_t out_word = st >= e.x_max;
  wp[-1] = static_cast<uint16_t>(st & 0xffffu);
  wp -= out_word;
  st >>= 16 * out_word;
  const uint32_t q = static_cast<uint32_t>((uint64_t(st) * e.rcp_freq) >> 32) >> e.rcp_shift;
  st = st + e.bias + q * e.cmpl_freq;
}

// Bits set in a mask of at most 16 bits (the portable build has no popcnt instruction, and
// __builtin_popcount became a library call per row).
inline int popcount16(uint32_t v) {
  v = v - ((v >> 1) & 0x5555u);
  v = (v & 0x3333u) + ((v >> 2) & 0x3333u);
  v = (v + (v >> 4)) & 0x0f0fu;
  return int((v + (v >> 8)) & 0x1fu);
}

// Sorts a short row in place (m <= 16: insertion sort).
inline void sort_small(uint16_t* v, int m) {
  for (int i = 1; i < m; ++i) {
    const uint16_t x = v[i];
    int j = i - 1;
    while (j >= 0 && v[j] > x) {
      v[j + 1] = v[j];
      --j;
    }
    v[j + 1] = x;
  }
}

// log2(x) for x >= 1 within 0.09 (the float's exponent and mantissa read as a fixed-point number):
// deterministic on every machine, unlike libm's, so the encoder's choices below are too.
inline float approx_log2(float x) {
  uint32_t i;
  std::memcpy(&i, &x, 4);
  return float(i) * (1.0f / float(1u << 23)) - 127.0f;
}

// Whether a ranked block should mark slots that repeat the previous token's id (the match mask)
// or code every row as a whole set (mask 0: a valid choice, since the decoder takes a 0 bit as
// "coded in the set"). A match saves its id's share of the set, about log2(n_l / use(id)) bits,
// and costs the mask's entropy, about H(q) bits per slot for a match rate q; estimated on the
// block's first 256 tokens. Why: uncorrelated Zipf routes (bench_routes) match 10-20% of the time
// by chance alone, on the hot experts that the set codes cheaply, and the masks cost 0.15 bits
// per routed id more than they save (s 0.8-1.2); correlated tokens save far more than they pay.
#if defined(__x86_64__)
// matches_pay's scan on AVX2: per token, the slots that repeat the previous token's id (and are
// not -1) as a bitmap, 8 compares per instruction, then their savings in slot order: the same
// additions in the same order as the scalar scan (which compared and listed slot by slot).
__attribute__((target("avx2,bmi"))) void match_scan_avx2(const int32_t* idx, int64_t sample,
                                                        int64_t row, int64_t K, int64_t E,
                                                        const float* log_n, const uint32_t* used,
                                                        double& saved, int64_t& hits) {
  thread_local std::vector<uint64_t> bits;
  const int64_t nw = (row + 63) / 64;
  bits.resize(size_t(nw));
  uint64_t* const bw = bits.data();
  const __m256i neg1 = _mm256_set1_epi32(-1);
  for (int64_t t = 1; t < sample; ++t) {
    const int32_t* tok = idx + t * row;
    const int32_t* prv = tok - row;
    std::fill(bw, bw + nw, uint64_t{0});
    int64_t j = 0;
    for (; j + 8 <= row; j += 8) {  // j % 8 == 0: a group of 8 bits never spans two words
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tok + j));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(prv + j));
      const __m256i m = _mm256_and_si256(_mm256_cmpeq_epi32(a, b), _mm256_cmpgt_epi32(a, neg1));
      bw[j >> 6] |= uint64_t(unsigned(_mm256_movemask_ps(_mm256_castsi256_ps(m)))) << (j & 63);
    }
    for (; j < row; ++j) bw[j >> 6] |= uint64_t((tok[j] >= 0) & (tok[j] == prv[j])) << (j & 63);
    for (int64_t w = 0; w < nw; ++w) {
      for (uint64_t b = bw[w]; b != 0; b &= b - 1) {
        const int64_t jj = w * 64 + int64_t(__builtin_ctzll(b)), l = jj / K;
        ++hits;
        saved += log_n[size_t(l)] - approx_log2(float(used[size_t(l * E + tok[jj])]));
      }
    }
  }
}
#endif
bool matches_pay(const int32_t* idx, int64_t T, int64_t L, int64_t K, int64_t E,
                 const std::vector<uint32_t>& used) {
  const int64_t row = L * K, sample = std::min<int64_t>(T, 256);
  if (sample < 2) return false;
  std::vector<float> log_n(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    uint64_t n = 0;
    for (int64_t e = 0; e < E; ++e) n += used[size_t(l * E + e)];
    log_n[size_t(l)] = approx_log2(float(std::max<uint64_t>(n, 1)));
  }
  double saved = 0;
  int64_t hits = 0;
#if defined(__x86_64__)
  if (cpu_isa() != CpuIsa::scalar) {
    match_scan_avx2(idx, sample, row, K, E, log_n.data(), used.data(), saved, hits);
  } else
#endif
  {
  // Per token, the matching slots' indices first (compacted without a branch: a branch per slot
  // missed on the ~10% of chance matches), then their savings in slot order (the same sum).
  thread_local std::vector<int32_t> at;
  at.resize(static_cast<size_t>(row));
  for (int64_t t = 1; t < sample; ++t) {
    const int32_t* tok = idx + t * row;
    int64_t n = 0;
    for (int64_t j = 0; j < row; ++j) {
      at[size_t(n)] = int32_t(j);
      n += int64_t((tok[j] >= 0) & (tok[j] == tok[j - row]));
    }
    hits += n;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = at[size_t(i)], l = j / K;
      saved += log_n[size_t(l)] - approx_log2(float(used[size_t(l * E + tok[j])]));
    }
  }
  }
  // A set of K ids does not pay for their order: log2(K!)/K bits less per id.
  double log2_kfact = 0;
  for (int64_t k = 2; k <= K; ++k) log2_kfact += double(approx_log2(float(k)));
  saved -= double(hits) * log2_kfact / double(K);
  const double slots = double((sample - 1) * row), q = double(hits) / slots;
  if (hits == 0) return false;
  if (q >= 1.0) return true;
  const double h = q * double(approx_log2(float(1.0 / q))) +
                   (1.0 - q) * double(approx_log2(float(1.0 / (1.0 - q))));
  return saved > h * slots;
}

// The per-layer rank order of a ranked set-coded block (perm: rank -> id, [L, E]; rank: [L, E + 1]
// indexed by id + 1, slot 0 for -1). Experts by use over the whole block, most used first, ties to
// the lower id; then, for E <= kSetOrderMaxExperts, adjacent ranks are swapped wherever the
// block's rows put the lower-ranked expert in the earlier of two consecutive slots more often
// than the other way round (bounded bubble passes). Why: a set costs its slot order's Lehmer
// code, which is zero when the slots follow the rank order; counts from the block's first 256
// tokens (build_ranks' sample) order the tail experts by noise, and even exact counts tie experts
// of near-equal use that a top-k orders consistently. Measured on bench_routes' Zipf s 0.8 batch:
// 5.70 bits per routed id (sampled counts) -> 5.27 (whole-block counts) -> 5.14 (with the swaps).
// Returns false on an id outside [-1, E) (checked before it indexes anything); sets *any_none
// (when given) to whether the block has a -1.
constexpr int64_t kSetOrderMaxExperts = 256;
constexpr int kSetOrderPasses = 16;
constexpr int64_t kSetOrderSample = 512;
bool set_ranks(const int32_t* idx, int64_t T, int64_t L, int64_t K, int64_t E, uint16_t* perm,
               std::vector<uint16_t>& rank, std::vector<uint32_t>& used,
               bool* any_none = nullptr) {
  const int64_t E1 = E + 1, row = L * K;
  rank.assign(static_cast<size_t>(L * E1), 0);
  used.resize(static_cast<size_t>(L * E));
  thread_local std::vector<uint32_t> count;
  thread_local std::vector<uint16_t> pre;
  const bool order = E <= kSetOrderMaxExperts && K > 1;
  // Consecutive-slot pairs from the first kSetOrderSample tokens (a bounded cost per block; on
  // bench_routes' 1024-token blocks the whole block orders the ranks no better).
  const int64_t pairs = order ? std::min<int64_t>(T, kSetOrderSample) : 0;
  // Uses, token by token (the [L, E + 1] counters stay in L1; -1 lands in slot 0), each token's
  // range checked before it is counted (one read of the block, not a range pass of its own).
  // The pair counts below read the sampled tokens from the block itself, two layers per walk
  // (K 8: 64 bytes, about one cache line, per token); a u16 copy of the sample made here ([L,
  // pairs, K], 393 KB at L 48) cost more than the strided walks (+2-3% encode without it).
  count.assign(static_cast<size_t>(L * E1), 0);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* tok = idx + t * row;
    uint32_t bad = 0;
    for (int64_t j = 0; j < row; ++j) bad |= uint32_t(uint32_t(tok[j] + 1) > uint32_t(E));
    if (bad) return false;
    if (K == 8) {
      // the common top-8 with its slot loop unrolled (a loop of 8 made ~5 instructions per id)
      uint32_t* c = count.data() + 1;
      for (int64_t l = 0; l < L; ++l, c += E1) {
        const int32_t* x = tok + l * 8;
        ++c[x[0]];
        ++c[x[1]];
        ++c[x[2]];
        ++c[x[3]];
        ++c[x[4]];
        ++c[x[5]];
        ++c[x[6]];
        ++c[x[7]];
      }
    } else {
      for (int64_t l = 0; l < L; ++l) {
        uint32_t* c = count.data() + l * E1 + 1;
        for (int64_t k = 0; k < K; ++k) ++c[tok[l * K + k]];
      }
    }
  }
  if (any_none) {
    *any_none = false;
    for (int64_t l = 0; l < L; ++l) *any_none = *any_none || count[size_t(l * E1)] != 0;
  }
  // [a + 1][b + 1]: a just before b; u16 (at most kSetOrderSample * (K - 1) < 2^16 pairs) so the
  // table of E 128 (33 KiB) stays near L1
  static_assert(kSetOrderSample * (kSetMaxTopK - 1) < 65536);
  // Two layers' pair counts at a time, a table each, token by token (every id was range checked
  // above): on skewed routes the same hot pair repeats in consecutive tokens, 7 increments
  // apart, a chain of read-modify-writes of one counter through memory; two layers interleaved
  // run two such chains side by side.
  if (order) pre.assign(static_cast<size_t>(2 * E1 * E1), 0);
  std::vector<uint16_t> ord(static_cast<size_t>(E)), tmp(static_cast<size_t>(E));
  std::vector<uint32_t> key(static_cast<size_t>(E));
  const auto finish = [&](int64_t l, uint16_t* pl) {
    const uint32_t* c = count.data() + l * E1 + 1;
    std::copy(c, c + E, used.begin() + l * E);
    // By use, most used first, ties to the lower id: an LSD radix sort (8-bit digits, as many
    // as the largest count has) of max - use, starting from the ids in order; stable, so ties
    // keep the lower id first: the order a comparison sort on (use, ~id) gives, without its
    // branches (std::sort of the u64 keys was ~6% of the encoder, mostly mispredictions).
    uint32_t mx = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, c[e]);
    for (int64_t e = 0; e < E; ++e) {
      key[size_t(e)] = mx - c[e];
      ord[size_t(e)] = uint16_t(e);
    }
    for (int shift = 0; shift < 32 && (mx >> shift) != 0; shift += 8) {
      uint32_t at[256];
      const uint32_t nb = std::min<uint32_t>(mx >> shift, 255u) + 1;  // digits in use
      std::fill(at, at + nb, 0u);
      for (int64_t i = 0; i < E; ++i) ++at[(key[ord[size_t(i)]] >> shift) & 255u];
      uint32_t sum = 0;
      for (uint32_t d = 0; d < nb; ++d) {
        const uint32_t n = at[d];
        at[d] = sum;
        sum += n;
      }
      for (int64_t i = 0; i < E; ++i) {
        const uint16_t e = ord[size_t(i)];
        tmp[at[(key[e] >> shift) & 255u]++] = e;
      }
      ord.swap(tmp);
    }
    if (order) {
      const auto before = [&](uint16_t a, uint16_t b) { return pl[size_t((a + 1) * E1 + b + 1)]; };
      // Each pass compares again only the pairs that can have changed since the last pass
      // compared them (the same swaps as full passes): before the last pass's first swap - 1
      // no expert moved, and past its last swap a pair whose left expert did not just move is
      // the pair the last pass left in place.
      int64_t lo = 0, last = E;
      for (int pass = 0; pass < kSetOrderPasses; ++pass) {
        int64_t first_swap = -1, last_swap = -1;
        bool moved = false;  // whether the step before swapped
        for (int64_t r = lo; r + 1 < E; ++r) {
          if (r > last && !moved) break;
          moved = before(ord[size_t(r + 1)], ord[size_t(r)]) >
                  before(ord[size_t(r)], ord[size_t(r + 1)]);
          if (moved) {
            std::swap(ord[size_t(r)], ord[size_t(r + 1)]);
            if (first_swap < 0) first_swap = r;
            last_swap = r;
          }
        }
        if (first_swap < 0) break;
        lo = std::max<int64_t>(first_swap - 1, 0);
        last = last_swap;
      }
      std::fill(pl, pl + E1 * E1, uint16_t{0});  // for the next layer (faster than a re-walk)
    }
    for (int64_t r = 0; r < E; ++r) {
      perm[l * E + r] = ord[size_t(r)];
      rank[size_t(l * E1 + 1 + ord[size_t(r)])] = static_cast<uint16_t>(r);
    }
  };
  uint16_t* const p0 = order ? pre.data() : nullptr;
  uint16_t* const p1 = order ? pre.data() + E1 * E1 : nullptr;
  for (int64_t l = 0; l < L; l += 2) {
    const bool two = l + 1 < L;
    if (order) {
      // tables offset by one row and one column: [a + 1][b + 1] (a -1 lands in row or column 0)
      uint16_t* const q0 = p0 + E1 + 1;
      uint16_t* const q1 = p1 + E1 + 1;
      const int32_t* y0 = idx + l * K;
      if (two) {
        const int32_t* y1 = y0 + K;
        for (int64_t t = 0; t < pairs; ++t, y0 += row, y1 += row) {
          for (int64_t k = 0; k + 1 < K; ++k) {
            uint16_t& c0 = q0[y0[k] * E1 + y0[k + 1]];
            c0 = uint16_t(c0 + 1);
            uint16_t& c1 = q1[y1[k] * E1 + y1[k + 1]];
            c1 = uint16_t(c1 + 1);
          }
        }
      } else {
        for (int64_t t = 0; t < pairs; ++t, y0 += row) {
          for (int64_t k = 0; k + 1 < K; ++k) {
            uint16_t& c0 = q0[y0[k] * E1 + y0[k + 1]];
            c0 = uint16_t(c0 + 1);
          }
        }
      }
    }
    finish(l, p0);
    if (two) finish(l + 1, p1);
  }
  return true;
}

}  // namespace

bool set_coding_fits(int64_t num_layers, int64_t top_k, int64_t num_experts) {
  return top_k >= 1 && top_k <= kSetMaxTopK && num_experts >= 1 && num_experts <= kSetMaxExperts &&
         num_layers >= 1;
}

uint32_t encode_payload_set(const int32_t* idx, int64_t T, int64_t L, int64_t K, int64_t E,
                            bool ranked, std::string& out) {
  const int64_t row = L * K, E1 = E + 1;
  const int S = kSetScaleBits;
  // Ranks (per layer, see set_ranks) and the permutation.
  thread_local std::vector<uint16_t> perm, rank;
  thread_local std::vector<uint32_t> used;
  perm.resize(static_cast<size_t>(ranked ? L * E : 0));
  if (ranked ? !set_ranks(idx, T, L, K, E, perm.data(), rank, used)
             : !build_ranks_u16(idx, T, L, K, E, false, nullptr, rank)) {
    return kBadIds;
  }
  // Unranked (small) blocks keep the matches: no counts to weigh them with.
  const bool match = !ranked || matches_pay(idx, T, L, K, E, used);
  const Models models(L, K, E);
  thread_local std::vector<uint32_t> count;
  count.assign(static_cast<size_t>(models.total), 0);
  // Every symbol in row order (at most 2 + K + K/2 per row, ~2 on correlated tokens), then coded
  // last to first. Grown as needed (checked per token), so the scratch is what the block uses.
  // Uninitialised scratch (a vector's growth zero-filled megabytes per block), sized for ~3
  // symbols per row when tokens match (correlated), for every row's worst case when they do not.
  thread_local std::unique_ptr<uint32_t[]> syms;
  thread_local int64_t syms_cap = 0;
  const int64_t token_max = L * (3 + K + K / 2);
  const int64_t want = std::max<int64_t>(match ? T * L * 3 : T * token_max, token_max);
  if (syms_cap < want) {
    syms.reset(new uint32_t[size_t(want)]);
    syms_cap = want;
  }
  uint32_t* sp = syms.get();
  std::string raw;  // raw bit stream: escaped rows
  Bits rawbits{raw};
  const int id_bits = bit_width_of(uint64_t(E));  // an escaped id + 1 in [0, E]
  const uint32_t esc = 1u << std::min<int64_t>(K, 8), none_sym = esc + 1;
  const int Kc = int(K);
  const uint32_t full = (1u << Kc) - 1;
  uint32_t* cnt = count.data();
  const auto push = [&](int64_t model, uint32_t sym) __attribute__((always_inline)) {
    ++cnt[models.m[size_t(model)].first + sym];
    *sp++ = uint32_t(model) << kSymBits | sym;
  };
  bool any_none = false;
  for (int64_t t = 0; t < T; ++t) {
    if (syms.get() + syms_cap - sp < token_max) {
      const int64_t at = sp - syms.get();
      std::unique_ptr<uint32_t[]> more(new uint32_t[size_t(2 * syms_cap)]);
      std::memcpy(more.get(), syms.get(), size_t(at) * sizeof(uint32_t));
      syms = std::move(more);
      syms_cap *= 2;
      sp = syms.get() + at;
    }
    const int32_t* tok = idx + t * row;
    const int32_t* prev = t > 0 ? tok - row : nullptr;
    uint32_t bad = 0;
    int32_t neg_any = 0;
    for (int64_t j = 0; j < row; ++j) {
      bad |= uint32_t(uint32_t(tok[j] + 1) > uint32_t(E));
      neg_any |= tok[j];
    }
    if (bad) return kBadIds;
    any_none = any_none || neg_any < 0;
    for (int64_t l = 0; l < L; ++l) {
      const int32_t* x = tok + l * K;
      const uint16_t* rk = rank.data() + l * E1 + 1;  // rk[-1] == 0
      uint32_t mask = 0;
      if (prev && match) {
        const int32_t* p = prev + l * K;
        for (int k = 0; k < Kc; ++k) mask |= uint32_t(x[k] == p[k]) << k;
      }
      if (mask == full) {  // the previous token's row again
        push(0, mask & 255u);
        if (K > 8) push(1, mask >> 8);
        continue;
      }
      // The unmatched slots' ranks in slot order (v) and sorted (s); a -1 or a repeated rank
      // among them escapes the row (raw ids), a row of -1 is one symbol.
      std::array<uint16_t, kSetMaxTopK> v, s;
      int m = 0;
      bool neg = false, all_neg = true;
      for (int k = 0; k < Kc; ++k) {
        all_neg &= x[k] < 0;
        if (!((mask >> k) & 1u)) {
          neg |= x[k] < 0;
          v[size_t(m++)] = rk[x[k]];
        }
      }
      if (all_neg) {
        push(0, none_sym);
        continue;
      }
      // Slots already in rank order (the common case once the ranks follow the rows' order, see
      // set_ranks): the set is v itself and every Lehmer digit is 0, no sort needed.
      bool sorted = !neg;
      for (int i = 1; i < m; ++i) sorted &= v[size_t(i)] > v[size_t(i - 1)];
      const uint16_t* sv = v.data();
      if (!sorted) {
        std::copy(v.begin(), v.begin() + m, s.begin());
        sort_small(s.data(), m);
        bool regular = !neg;
        for (int i = 1; i < m && regular; ++i) regular = s[size_t(i)] != s[size_t(i - 1)];
        if (!regular) {
          push(0, esc);
          for (int k = 0; k < Kc; ++k) rawbits.put(uint64_t(x[k] + 1), id_bits);
          continue;
        }
        sv = s.data();
      }
      push(0, mask & 255u);
      if (K > 8) push(1, mask >> 8);
      const int64_t fm = models.layer0 + 2 * l;
      push(fm, sv[0]);
      for (int i = 1; i < m; ++i) push(fm + 1, uint32_t(sv[i] - sv[i - 1] - 1));
      if (m > 1) {
        int64_t om = models.order_model[size_t(m)];
        if (sorted) {
          for (size_t g = 0; g < models.groups[size_t(m)].size(); ++g) push(om++, 0);
          continue;
        }
        // Lehmer digit j: how many later unmatched slots hold a smaller rank.
        std::array<uint32_t, kSetMaxTopK> d{};
        for (int j = 0; j < m; ++j) {
          uint32_t c = 0;
          for (int i = j + 1; i < m; ++i) c += v[size_t(i)] < v[size_t(j)];
          d[size_t(j)] = c;
        }
        for (const OrderGroup& g : models.groups[size_t(m)]) {
          uint32_t sym = 0;
          for (int j = g.first; j < g.first + g.count; ++j)
            sym = sym * uint32_t(m - j) + d[size_t(j)];
          push(om++, sym);
        }
      }
    }
  }
  rawbits.flush();
  const int64_t n_syms = sp - syms.get();
  // Models: normalised frequencies, written as Elias-gamma codes of f + 1 after an "empty" bit.
  std::string head;
  Bits hb{head};
  if (ranked) {
    const int pb = bit_width_of(uint64_t(E - 1));
    for (int64_t i = 0; i < L * E; ++i) hb.put(perm[size_t(i)], pb);
  }
  thread_local std::vector<uint16_t> freq;
  freq.assign(static_cast<size_t>(models.total), 0);
  thread_local std::vector<EncSym> es;
  es.resize(static_cast<size_t>(models.total));
  for (const Model& md : models.m) {
    if (md.n == 0) continue;
    bool empty = true;
    normalise(count.data() + md.first, md.n, S, freq.data() + md.first, empty);
    hb.put(empty ? 1 : 0, 1);
    if (empty) continue;
    uint32_t start = 0;
    for (int64_t i = 0; i < md.n; ++i) {
      const uint32_t f = freq[size_t(md.first + i)];
      hb.gamma(f + 1);
      if (f) es[size_t(md.first + i)] = enc_sym(start, f, S);
      start += f;
    }
  }
  hb.flush();
  // rANS, two interleaved states (symbol i by state i % 2), coded last to first; words are
  // written backwards (at most one per symbol).
  thread_local std::vector<int64_t> model_first;
  model_first.resize(models.m.size());
  for (size_t i = 0; i < models.m.size(); ++i) model_first[i] = models.m[i].first;
  thread_local std::vector<uint16_t> words;
  words.resize(static_cast<size_t>(n_syms + 1));
  uint16_t* wend = words.data() + words.size();
  uint16_t* wp = wend;
  uint32_t x0 = kRansL, x1 = kRansL;
  const EncSym* esp = es.data();
  const int64_t* mf = model_first.data();
  const auto put = [&](uint32_t & st, uint32_t sy) __attribute__((always_inline)) {
    rans_put(st, esp[mf[sy >> kSymBits] + (sy & ((1u << kSymBits) - 1))], wp);
  };
  int64_t i = n_syms - 1;
  const uint32_t* sy = syms.get();
  if (i >= 0 && (i & 1)) put(x1, sy[i--]);
  for (; i >= 1; i -= 2) {
    put(x0, sy[i]);
    put(x1, sy[i - 1]);
  }
  if (i == 0) put(x0, sy[0]);
  // Output: fixed header, head bits, rans (states x0 x1, then the words), raw bits.
  const int64_t n_words = wend - wp;
  const int64_t rans_bytes = 8 + 2 * n_words;
  out.clear();
  out.reserve(size_t(kFixedHeader + int64_t(head.size()) + rans_bytes + int64_t(raw.size())));
  out.push_back(static_cast<char>(S));
  put_u32(out, static_cast<uint32_t>(head.size()));
  put_u32(out, static_cast<uint32_t>(rans_bytes));
  put_u32(out, static_cast<uint32_t>(raw.size()));
  out += head;
  put_u32(out, x0);
  put_u32(out, x1);
  out.append(reinterpret_cast<const char*>(wp), size_t(2 * n_words));
  out += raw;
  if (syms_cap > int64_t{64 << 20} / int64_t(sizeof(uint32_t))) {  // keep no large scratch
    syms.reset();
    syms_cap = 0;
    std::vector<uint16_t>().swap(words);
  }
  return kBlockSetDelta | (ranked ? kBlockRanked : 0u) | (any_none ? kBlockHasNone : 0u);
}

std::string decode_payload_set(const char* raw_c, int64_t raw_size, int64_t T, int64_t L, int64_t K,
                               int64_t E, uint32_t flags, int32_t* idx) {
  if (!set_coding_fits(L, K, E)) {
    return cat("set-coded block for num_experts=", E, ", top_k=", K,
               " (set coding covers top_k <= ", kSetMaxTopK, ", num_experts <= ", kSetMaxExperts,
               ")");
  }
  const auto* raw = reinterpret_cast<const uint8_t*>(raw_c);
  if (raw_size < kFixedHeader) return cat("set-coded payload of ", raw_size, " bytes is too short");
  const int S = raw[0];
  if (S != kSetScaleBits) {
    return cat("set-coded payload: scale ", S, " bits (this build reads ", kSetScaleBits, ")");
  }
  const int64_t head_n = get_u32(raw_c + 1), rans_n = get_u32(raw_c + 5);
  const int64_t raw_n = get_u32(raw_c + 9);
  if (kFixedHeader + head_n + rans_n + raw_n != raw_size || rans_n < 8 || rans_n % 2 != 0) {
    return cat("set-coded payload: stream sizes ", head_n, " + ", rans_n, " + ", raw_n,
               " do not fill its ", raw_size, " bytes");
  }
  const bool ranked = (flags & kBlockRanked) != 0;
  const int64_t row = L * K;
  BitsIn hb{raw + kFixedHeader, head_n};
  // Every allocation below is paid for by header bits: a permutation entry by >= 1 bit, a table
  // symbol by >= 1 bit (its gamma code), a table's bucket index (512 bytes) by >= 2 bits.
  std::vector<int32_t> perm;
  if (ranked) {
    std::string err = read_perm(hb, head_n, L, E, perm);
    if (!err.empty()) return err;
  }
  Models models(L, K, E);
  const uint32_t M = 1u << S;
  std::vector<uint32_t> sf;   // start | freq << 16 of every used table's symbols
  std::vector<uint16_t> lut;  // per used table, M >> kBucketShift first symbols
  std::vector<int64_t> lut_at(models.m.size(), -1);
  for (size_t mi = 0; mi < models.m.size(); ++mi) {
    Model& md = models.m[mi];
    if (md.n == 0) continue;
    md.empty = hb.get(1) != 0;
    if (hb.over) return "set-coded payload: header ends inside the frequency tables";
    if (md.empty) continue;
    if (md.n > head_n * 8 - hb.pos) {
      return cat("set-coded payload: header too short for frequency table ", mi);
    }
    md.first = static_cast<int64_t>(sf.size());
    sf.resize(sf.size() + size_t(md.n));
    lut_at[mi] = static_cast<int64_t>(lut.size());
    lut.resize(lut.size() + (M >> kBucketShift));
    uint16_t* bucket = lut.data() + lut_at[mi];
    uint32_t start = 0;
    for (int64_t i = 0; i < md.n; ++i) {
      const uint32_t g = hb.gamma();
      if (hb.over || g == 0 || g - 1 > M - start) {
        return cat("set-coded payload: frequency table ", mi, " is corrupt at symbol ", i);
      }
      const uint32_t f = g - 1;
      sf[size_t(md.first + i)] = start | (f << 16);
      // Buckets whose first slot falls in [start, start + f) begin their scan at symbol i.
      for (uint32_t b = (start + (1u << kBucketShift) - 1) >> kBucketShift;
           (b << kBucketShift) < start + f; ++b) {
        bucket[b] = static_cast<uint16_t>(i);
      }
      start += f;
    }
    if (start != M) {
      return cat("set-coded payload: frequency table ", mi, " sums to ", start, ", not ", M);
    }
  }
  if (!hb.done()) return "set-coded payload: header has bytes past its tables";
  // Per model: its symbols and bucket index (null for an unused model: a row needing it is an
  // error, checked where the row's kind is known).
  std::vector<const uint32_t*> tab(models.m.size(), nullptr);
  std::vector<const uint16_t*> bkt(models.m.size(), nullptr);
  for (size_t mi = 0; mi < models.m.size(); ++mi) {
    if (lut_at[mi] < 0) continue;
    tab[mi] = sf.data() + models.m[mi].first;
    bkt[mi] = lut.data() + lut_at[mi];
  }
  const uint8_t* rp = raw + kFixedHeader + head_n;
  uint32_t x0 = get_u32(raw_c + kFixedHeader + head_n);
  uint32_t x1 = get_u32(raw_c + kFixedHeader + head_n + 4);
  if (x0 < kRansL || x1 < kRansL || x0 >= (1u << 31) || x1 >= (1u << 31)) {
    return "set-coded payload: rANS state out of range";
  }
  const uint8_t* wp = rp + 8;
  const uint8_t* wend = rp + rans_n;
  bool under = false;
  // One symbol (state x0, then the states swap: symbol i is state i % 2's). The bucket scan
  // stays in the table: its frequencies sum to M, so some symbol's range holds the slot.
  const auto dec = [&](size_t mi) __attribute__((always_inline))->uint32_t {
    const uint32_t* tb = tab[mi];
    const uint32_t slot = x0 & (M - 1);
    uint32_t sym = bkt[mi][slot >> kBucketShift];
    uint32_t e = tb[sym];
    while (slot >= (e & 0xffffu) + (e >> 16)) e = tb[++sym];
    uint32_t nx = (e >> 16) * (x0 >> S) + slot - (e & 0xffffu);
    // Branch-free renormalisation (see the encoder); past the end a zero word is read and the
    // stream flagged short.
    const bool in_word = nx < kRansL, have = wp < wend;
    uint16_t wd;
    std::memcpy(&wd, have ? wp : kZeroWord, 2);
    under |= in_word & !have;
    wp += 2 * int(in_word & have);
    nx = in_word ? (nx << 16) | wd : nx;
    x0 = x1;
    x1 = nx;
    return sym;
  };
  const auto digits = order_digits(models, K);
  BitsIn rb{raw + kFixedHeader + head_n + rans_n, raw_n};
  const int id_bits = bit_width_of(uint64_t(E));
  const uint32_t esc = 1u << std::min<int64_t>(K, 8), none_sym = esc + 1;
  const int Kc = int(K);
  const bool has_m1 = K > 8;
  if (T > 0 && !tab[0]) return "set-coded payload: the mask table is empty";
  for (int64_t t = 0; t < T; ++t) {
    int32_t* tok = idx + t * row;
    const int32_t* prev = t > 0 ? tok - row : nullptr;
    for (int64_t l = 0; l < L; ++l) {
      int32_t* out = tok + l * K;
      uint32_t mask = dec(0);
      if (mask == none_sym) {
        for (int k = 0; k < Kc; ++k) out[k] = -1;
        continue;
      }
      if (mask == esc) {
        for (int k = 0; k < Kc; ++k) {
          const uint64_t v = rb.get(id_bits);
          if (int64_t(v) > E) {
            return cat("token ", t, ", layer ", l, ": escaped id ", int64_t(v) - 1,
                       " >= num_experts");
          }
          out[k] = int32_t(v) - 1;
        }
        if (rb.over) return cat("token ", t, ", layer ", l, ": raw bits end inside a row");
        continue;
      }
      if (has_m1) {  // unused (empty) when every row is escaped or -1
        if (!tab[1]) return cat("token ", t, ", layer ", l, ": the high mask table is empty");
        mask |= dec(1) << 8;
      }
      if (!prev && mask != 0) {
        return cat("token 0, layer ", l, ": match bits with no previous token");
      }
      if (prev) std::memcpy(out, prev + l * K, size_t(K) * 4);
      const int m = Kc - popcount16(mask);
      if (m == 0) continue;
      const size_t fm = size_t(models.layer0 + 2 * l);
      if (!tab[fm] || (m > 1 && !tab[fm + 1])) {
        return cat("token ", t, ", layer ", l, ": a row needs an empty frequency table");
      }
      std::array<uint32_t, kSetMaxTopK> s;
      s[0] = dec(fm);
      for (int i = 1; i < m; ++i) s[size_t(i)] = s[size_t(i - 1)] + 1 + dec(fm + 1);
      if (int64_t(s[size_t(m - 1)]) >= E) {
        return cat("token ", t, ", layer ", l, ": rank ", s[size_t(m - 1)], " >= num_experts");
      }
      const int32_t* pl = ranked ? perm.data() + l * E : nullptr;
      if (m == 1) {
        const int k = __builtin_ctz(~mask);
        out[k] = pl ? pl[s[0]] : int32_t(s[0]);
        continue;
      }
      // The order: per group one symbol, split into its digits. All zero (slots in rank order,
      // the common case: see set_ranks) places the sorted ranks as they are.
      std::array<int, kSetMaxTopK> d;
      size_t om = size_t(models.order_model[size_t(m)]);
      const auto& groups = models.groups[size_t(m)];
      uint64_t any = 0;
      for (size_t gi = 0; gi < groups.size(); ++gi, ++om) {
        if (!tab[om]) return cat("token ", t, ", layer ", l, ": an order table is empty");
        const uint64_t packed = digits[size_t(m)][gi][dec(om)];
        any |= packed;
        for (int c = 0; c < groups[gi].count; ++c) {
          d[size_t(groups[gi].first + c)] = int((packed >> (4 * c)) & 15u);
        }
      }
      if (any == 0) {
        int j = 0;
        for (int k = 0; k < Kc; ++k) {
          if ((mask >> k) & 1u) continue;
          out[k] = pl ? pl[s[size_t(j)]] : int32_t(s[size_t(j)]);
          ++j;
        }
        continue;
      }
      d[size_t(m - 1)] = 0;                // the last digit (radix 1) is not coded
      uint32_t free_bits = (1u << m) - 1;  // sorted ranks not placed yet
      int j = 0;
      for (int k = 0; k < Kc; ++k) {
        if ((mask >> k) & 1u) continue;
        uint32_t f = free_bits;  // the d-th lowest still free
        for (int q = 0; q < d[size_t(j)]; ++q) f &= f - 1;
        const int i = __builtin_ctz(f);
        free_bits &= ~(1u << i);
        out[k] = pl ? pl[s[size_t(i)]] : int32_t(s[size_t(i)]);
        ++j;
      }
    }
  }
  if (under || wp != wend || x0 != kRansL || x1 != kRansL) {
    return "set-coded payload: the rANS stream does not end where its symbols do";
  }
  if (!rb.done()) return "set-coded payload: raw bits do not end where the rows do";
  return {};
}


// ---------------------------------------------------------------------------------------------
// Version 4 (kBlockSetRows): the symbols of version 3 split into two rANS streams so that the hot
// one has no data-dependent model choice and many independent states. The row stream (2 states,
// as version 3) carries per row the mask symbol, with the "order free" case folded in (M0 = mask
// low bits | unsorted << min(K, 8); escape and all -1 after them), M1 when K > 8 and the Lehmer
// order symbols only for rows whose slots are not in rank order. The set stream carries the
// sorted ranks: the j-th smallest of row r (flat t * L + l) by state (r & 1) * W + j (W = 8 for
// K <= 8, else 16), the smallest from F, the others as gap - 1 from G, where F and G are the
// tables of the layer's cluster (layers whose rank statistics agree share one pair of tables:
// fewer header bits, and the decoder's full slot lookups stay in L1). A row's lanes are
// independent states, so the decoder overlaps them, and two rows in flight use different banks.
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int kV4Header = 21;  // scale (u8), u32 sizes: clusters, head, row, set, raw streams
constexpr int64_t kV4MaxClusters = 32;
constexpr uint32_t kV4Slots = 1u << kSetScaleBits;
constexpr int kV4SetStates = 32;  // set stream: 32 / W banks of W lanes
constexpr int kV4RowStates = 4;   // row stream: symbol i by state i % 4

int v4_lanes(int64_t K) { return K <= 8 ? 8 : 16; }

// log2(x) for x >= 1 within 0.008 (exponent plus a quadratic of the mantissa): deterministic on
// every machine, like approx_log2, and close enough to weigh tables against their header bits.
inline float fine_log2(float x) {
  uint32_t i;
  std::memcpy(&i, &x, 4);
  const float e = float(int32_t(i >> 23) - 127);
  const uint32_t mi = (i & 0x7fffffu) | 0x3f800000u;
  float m;
  std::memcpy(&m, &mi, 4);
  const float f = m - 1.0f;
  return e + f * (1.3465f - 0.3465f * f);
}
// x log2 x summed over counts, and the total's: the bits of coding them with their own table is
// total log2 total - this.
inline float xlogx(float x) { return x > 0 ? x * fine_log2(x) : 0.0f; }

// Layer -> cluster (numbered by first layer). A layer joins the cluster whose merged counts cost
// the fewest extra bits when that is less than its own tables' header bits (about 9 bits per used
// symbol, 1 per unused one), else starts a new cluster (at most kV4MaxClusters). cnt: [L, 2E]
// (F counts, then G counts); ccnt gets [C, 2E].
int64_t v4_clusters(const uint32_t* cnt, int64_t L, int64_t E, std::vector<uint32_t>& map,
                    std::vector<uint32_t>& ccnt) {
  const int64_t E2 = 2 * E;
  map.assign(size_t(L), 0);
  ccnt.clear();
  std::vector<float> own_s;  // per cluster: sum x log x of F, of G, and the totals
  std::vector<uint64_t> tot;
  std::vector<float> msum;  // per cluster: the merged sums of the current layer's halves
  int64_t C = 0;
  // The x log x terms of E counts (a + b when b is given) into xl without a branch (so the loop
  // vectorises), then summed one by one in order: the same floats as summing xlogx() in the loop
  // (a zero count gives 0; counts < 2^31, as int32). The sums' chain of float adds stays serial.
  thread_local std::vector<float> xl;
  xl.resize(size_t(E));
  float* const xp = xl.data();
  const auto sum_xlogx = [&](const uint32_t* a, const uint32_t* b) {
    if (b) {
      for (int64_t i = 0; i < E; ++i) {
        const float x = float(int32_t(a[i] + b[i]));
        xp[i] = x > 0 ? x * fine_log2(x) : 0.0f;
      }
    } else {
      for (int64_t i = 0; i < E; ++i) {
        const float x = float(int32_t(a[i]));
        xp[i] = x > 0 ? x * fine_log2(x) : 0.0f;
      }
    }
    float sum = 0;
    for (int64_t i = 0; i < E; ++i) sum += xp[i];
    return sum;
  };
  for (int64_t l = 0; l < L; ++l) {
    const uint32_t* c = cnt + l * E2;
    uint64_t t2[2] = {0, 0};
    float s2[2];
    int64_t nz[2] = {0, 0};
    for (int h = 0; h < 2; ++h) {
      for (int64_t i = 0; i < E; ++i) {
        t2[h] += c[h * E + i];
        nz[h] += c[h * E + i] != 0;
      }
      s2[h] = sum_xlogx(c + h * E, nullptr);
    }
    int64_t best = -1;
    float best_cost = 0;
    msum.resize(size_t(2 * C));
    for (int64_t k = 0; k < C; ++k) {
      const uint32_t* cc = ccnt.data() + k * E2;
      float cost = 0;
      for (int h = 0; h < 2; ++h) {
        if (t2[h] == 0) continue;
        const float merged = sum_xlogx(cc + h * E, c + h * E);
        msum[size_t(2 * k + h)] = merged;
        // H(merged) - H(cluster) - H(layer), with H = n log n - sum x log x
        const float n = float(tot[size_t(2 * k + h)] + t2[h]);
        cost += (xlogx(n) - merged) - (xlogx(float(tot[size_t(2 * k + h)])) -
                                       own_s[size_t(2 * k + h)]) -
                (xlogx(float(t2[h])) - s2[h]);
      }
      if (best < 0 || cost < best_cost) {
        best = k;
        best_cost = cost;
      }
    }
    // 9 bits per used symbol, 1 per unused one (whole numbers: exact in float in any order)
    float table_bits = 0;
    for (int h = 0; h < 2; ++h) {
      if (t2[h] == 0) continue;
      table_bits += float(9 * nz[h] + (E - nz[h]));
    }
    map[size_t(l)] = uint32_t(best);
    if (best < 0 || (best_cost > table_bits && C < kV4MaxClusters)) {
      // a new cluster: its counts, sums and totals are the layer's own
      best = C++;
      map[size_t(l)] = uint32_t(best);
      ccnt.insert(ccnt.end(), c, c + E2);
      own_s.insert(own_s.end(), s2, s2 + 2);
      tot.insert(tot.end(), t2, t2 + 2);
      continue;
    }
    // joins `best`: its new sums are the merged sums just computed (a half the layer does not
    // use is unchanged)
    uint32_t* cc = ccnt.data() + best * E2;
    for (int64_t i = 0; i < E2; ++i) cc[i] += c[i];
    for (int h = 0; h < 2; ++h) {
      if (t2[h] == 0) continue;
      tot[size_t(2 * best + h)] += t2[h];
      own_s[size_t(2 * best + h)] = msum[size_t(2 * best + h)];
    }
  }
  return C;
}

// Inputs and outputs of the v4 modelling pass (one pass over the block in row order).
struct V4Rows {
  const int32_t* idx;
  int64_t T, L, K, E;
  bool match;
  const uint16_t* rank;  // [L, E + 1]
  const Models* rows;    // the row stream's models
  uint32_t* rsyms;       // out: row stream symbols, as indices into the row models' counts
  uint16_t* ss;          // out: set symbols in row order
  uint8_t* rm;           // out: per row, its number of set symbols
  uint32_t* cnt_row;     // counts of the row models
  uint32_t* cnt_set;     // [L, 2E]: F then G counts per layer
  bool rank_padded;      // rank has one readable entry past [L, E + 1] (the AVX2 row's gather)
  // Every id is known to be in [-1, E) and any_none is set (set_ranks checked and counted them):
  // the pass skips its own per-token check.
  bool ids_checked = false;
  bool any_none = false;
  int64_t n_rsyms = 0, n_ss = 0;
};

// The hot passes, built for the baseline ISA and for AVX2 (the same symbols, so both write the
// same bytes: test_routes_codec_set compares them); picked by switchyard::cpu_isa().
// For the AVX2 set-stream encoder: the lanes set in an 8-bit mask, in order, in the top lanes
// (lane 8 - c + i holds the i-th set lane of c), so a row's words, compressed, end at the write
// position.
struct WordCompress {
  uint32_t at[256][8];
  constexpr WordCompress() : at{} {
    for (unsigned n = 0; n < 256; ++n) {
      unsigned c = 0;
      for (unsigned j = 0; j < 8; ++j) c += (n >> j) & 1u;
      unsigned i = 8 - c;
      for (unsigned j = 0; j < 8; ++j) {
        if ((n >> j) & 1u) at[n][i++] = j;
      }
    }
  }
};
constexpr WordCompress kWordCompressTable{};
constexpr const uint32_t (&kWordCompress)[256][8] = kWordCompressTable.at;

// The functions between SY_AVX2_REGION_BEGIN and SY_AVX2_REGION_END are compiled for AVX2 (the
// .inc row loops built a second time; callers check the CPU first).
#define SY_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define SY_AVX2_REGION_BEGIN                                                \
  SY_PRAGMA(clang attribute push(__attribute__((target("avx2,bmi,bmi2,popcnt"))), \
                                 apply_to = function))
#define SY_AVX2_REGION_END SY_PRAGMA(clang attribute pop)
#else
#define SY_AVX2_REGION_BEGIN \
  SY_PRAGMA(GCC push_options) SY_PRAGMA(GCC target("avx2,bmi,bmi2,popcnt"))
#define SY_AVX2_REGION_END SY_PRAGMA(GCC pop_options)
#endif

namespace v4enc_base {
#define SY_V4_SIMD 0
#include "route_codec_set4_model.inc"
#undef SY_V4_SIMD
}  // namespace v4enc_base
SY_AVX2_REGION_BEGIN
namespace v4enc_avx2 {
#define SY_V4_SIMD 1
#include "route_codec_set4_model.inc"
#undef SY_V4_SIMD
}  // namespace v4enc_avx2
SY_AVX2_REGION_END
bool v4_model_rows_base(V4Rows& a, Bits& b) { return v4enc_base::v4_model_rows(a, b); }
__attribute__((target("avx2,bmi,bmi2,popcnt"))) bool v4_model_rows_avx2(V4Rows& a, Bits& b) {
  return v4enc_avx2::v4_model_rows(a, b);
}
void v4_encode_sets_base(const uint16_t* ss, int64_t n_ss, const uint8_t* rm, int64_t T,
                         int64_t L, int64_t E, int W, const uint32_t* cmap, const EncSym* es,
                         uint32_t* st, uint16_t*& wp) {
  v4enc_base::v4_encode_sets(ss, n_ss, rm, T, L, E, W, cmap, es, st, wp);
}
__attribute__((target("avx2,bmi,bmi2,popcnt"))) void v4_encode_sets_avx2(
    const uint16_t* ss, int64_t n_ss, const uint8_t* rm, int64_t T, int64_t L, int64_t E, int W,
    const uint32_t* cmap, const EncSym* es, uint32_t* st, uint16_t*& wp) {
  v4enc_avx2::v4_encode_sets(ss, n_ss, rm, T, L, E, W, cmap, es, st, wp);
}
void v4_encode_row_groups_base(const uint32_t* sy, int64_t i, const EncSym* esr, uint32_t* rx,
                               uint16_t*& wp) {
  v4enc_base::v4_encode_row_groups(sy, i, esr, rx, wp);
}
__attribute__((target("avx2,bmi,bmi2,popcnt"))) void v4_encode_row_groups_avx2(
    const uint32_t* sy, int64_t i, const EncSym* esr, uint32_t* rx, uint16_t*& wp) {
  v4enc_avx2::v4_encode_row_groups(sy, i, esr, rx, wp);
}
bool v4_simd() { return cpu_isa() != CpuIsa::scalar; }

// Normalises one table, writes it (empty bit, then Elias-gamma of f + 1 per symbol) and its
// encoder symbols.
void write_table(Bits& hb, const uint32_t* count, int64_t n, uint16_t* freq, EncSym* es) {
  bool empty = true;
  normalise(count, n, kSetScaleBits, freq, empty);
  hb.put(empty ? 1 : 0, 1);
  if (empty) return;
  uint32_t start = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t f = freq[i];
    hb.gamma(f + 1);
    if (f) es[i] = enc_sym(start, f, kSetScaleBits);
    start += f;
  }
}

// Reads one table written by write_table: calls put(i, start, f) per symbol; returns "" or what is
// wrong (`what` names the table). `empty` is set for an unused table.
template <class Put>
std::string read_table(BitsIn& hb, int64_t n, int64_t head_bits, bool& empty, const char* what,
                       int64_t which, Put&& put) {
  empty = hb.get(1) != 0;
  if (hb.over) return "set-coded payload: header ends inside the frequency tables";
  if (empty) return {};
  if (n > head_bits - hb.pos) return cat("set-coded payload: header too short for ", what, which);
  const uint32_t M = kV4Slots;
  uint32_t start = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t g = hb.gamma();
    if (hb.over || g == 0 || g - 1 > M - start) {
      return cat("set-coded payload: ", what, which, " is corrupt at symbol ", i);
    }
    put(i, start, g - 1);
    start += g - 1;
  }
  if (start != M) return cat("set-coded payload: ", what, which, " sums to ", start, ", not ", M);
  return {};
}

}  // namespace

uint32_t encode_payload_set4(const int32_t* idx, int64_t T, int64_t L, int64_t K, int64_t E,
                             bool ranked, std::string& out) {
  const int64_t R = T * L;
  const int W = v4_lanes(K);
  thread_local std::vector<uint16_t> perm, rank;
  thread_local std::vector<uint32_t> used;
  perm.resize(static_cast<size_t>(ranked ? L * E : 0));
  bool any_none = false;
  if (ranked ? !set_ranks(idx, T, L, K, E, perm.data(), rank, used, &any_none)
             : !build_ranks_u16(idx, T, L, K, E, false, nullptr, rank)) {
    return kBadIds;
  }
  const bool match = !ranked || matches_pay(idx, T, L, K, E, used);
  const Models rows(0, K, E, true);
  // Scratch, grown and never shrunk below what a block of this size needs (no zero fill per
  // block): row symbols (at most 2 + K / 2 per row), set symbols (K per row), m per row.
  thread_local std::vector<uint32_t> rsyms, cnt_row, cnt_set;
  thread_local std::vector<uint16_t> ss;
  thread_local std::vector<uint8_t> rm;
  const auto grow = [](auto& v, int64_t n) {
    if (int64_t(v.size()) < n) v.resize(size_t(n));
  };
  grow(rsyms, R * (3 + K / 2));
  grow(ss, R * K + 8);  // + 8: the AVX2 row stores 8 symbols and keeps K
  grow(rm, R);
  cnt_row.assign(size_t(rows.total), 0);
  cnt_set.assign(size_t(L * 2 * E + 8), 0);  // + 8: per-lane dummy counters of the AVX2 row
  std::string raw;
  Bits rawbits{raw};
  rank.push_back(0);  // read (and ignored) by the AVX2 row's 4-byte gathers of rk[E - 1]
  V4Rows a{idx,          T,          L,           K,       E, match, rank.data(), &rows,
           rsyms.data(), ss.data(),  rm.data(),   cnt_row.data(), cnt_set.data(), true,
           ranked,       any_none};
  if (!(v4_simd() ? v4_model_rows_avx2(a, rawbits) : v4_model_rows_base(a, rawbits))) {
    return kBadIds;
  }
  rawbits.flush();
  thread_local std::vector<uint32_t> cmap, ccnt;
  const int64_t C = v4_clusters(cnt_set.data(), L, E, cmap, ccnt);
  // Header: permutation, cluster map, row tables, then per cluster F and G.
  std::string head;
  Bits hb{head};
  if (ranked) {
    const int pb = bit_width_of(uint64_t(E - 1));
    for (int64_t i = 0; i < L * E; ++i) hb.put(perm[size_t(i)], pb);
  }
  const int cb = bit_width_of(uint64_t(C - 1));
  for (int64_t l = 0; l < L; ++l) hb.put(cmap[size_t(l)], cb);
  thread_local std::vector<uint16_t> freq;
  thread_local std::vector<EncSym> es_row, es_set;
  freq.assign(size_t(std::max<int64_t>(rows.total, 2 * E)), 0);
  es_row.resize(size_t(rows.total));
  es_set.resize(size_t(C * 2 * E));
  for (const Model& md : rows.m) {
    if (md.n == 0) continue;
    write_table(hb, cnt_row.data() + md.first, md.n, freq.data() + md.first,
                es_row.data() + md.first);
  }
  for (int64_t c = 0; c < C; ++c) {
    const uint32_t* cc = ccnt.data() + c * 2 * E;
    write_table(hb, cc, E, freq.data(), es_set.data() + c * 2 * E);
    write_table(hb, cc + E, std::max<int64_t>(E - 1, 1), freq.data(), es_set.data() + c * 2 * E + E);
  }
  hb.flush();
  // Set stream.
  // 8 words of slack below the stream (the AVX2 encoder stores a row's 8 words ending at the
  // write position), and 8 zero symbols past the last row (it loads 8 symbols per row).
  std::fill_n(ss.begin() + a.n_ss, 8, uint16_t{0});
  thread_local std::vector<uint16_t> words;
  grow(words, 8 + a.n_ss + 1);
  uint16_t* wend = words.data() + 8 + a.n_ss + 1;
  uint16_t* wp = wend;
  std::array<uint32_t, 32> st;
  st.fill(kRansL);
  if (v4_simd()) {
    v4_encode_sets_avx2(ss.data(), a.n_ss, rm.data(), T, L, E, W, cmap.data(), es_set.data(),
                        st.data(), wp);
  } else {
    v4_encode_sets_base(ss.data(), a.n_ss, rm.data(), T, L, E, W, cmap.data(), es_set.data(),
                        st.data(), wp);
  }
  const int64_t set_words = wend - wp;
  // Row stream: four interleaved states (symbol i by state i % 4), last to first. 8 words of
  // slack below the stream (the AVX2 groups store 8 words ending at the write position).
  thread_local std::vector<uint16_t> rwords;
  grow(rwords, 8 + a.n_rsyms + 1);
  uint16_t* rend = rwords.data() + 8 + a.n_rsyms + 1;
  uint16_t* rwp = rend;
  std::array<uint32_t, kV4RowStates> rx;
  rx.fill(kRansL);
  {
    // The top n % 4 symbols one by one, then groups of 4 with the states in registers (an
    // indexed array kept them in memory, a store-to-load round trip on each state's chain).
    const uint32_t* sy = rsyms.data();
    const EncSym* esr = es_row.data();
    int64_t i = a.n_rsyms - 1;
    for (; i >= 0 && ((i + 1) & 3) != 0; --i) rans_put(rx[size_t(i & 3)], esr[sy[i]], rwp);
    if (v4_simd()) {
      v4_encode_row_groups_avx2(sy, i, esr, rx.data(), rwp);
    } else {
      v4_encode_row_groups_base(sy, i, esr, rx.data(), rwp);
    }
  }
  const int64_t row_words = rend - rwp;
  const int64_t row_bytes = 4 * kV4RowStates + 2 * row_words,
                set_bytes = 4 * kV4SetStates + 2 * set_words;
  out.clear();
  out.reserve(size_t(kV4Header + int64_t(head.size()) + row_bytes + set_bytes +
                     int64_t(raw.size())));
  out.push_back(static_cast<char>(kSetScaleBits));
  put_u32(out, static_cast<uint32_t>(C));
  put_u32(out, static_cast<uint32_t>(head.size()));
  put_u32(out, static_cast<uint32_t>(row_bytes));
  put_u32(out, static_cast<uint32_t>(set_bytes));
  put_u32(out, static_cast<uint32_t>(raw.size()));
  out += head;
  for (uint32_t x : rx) put_u32(out, x);
  out.append(reinterpret_cast<const char*>(rwp), size_t(2 * row_words));
  for (int j = 0; j < kV4SetStates; ++j) put_u32(out, st[size_t(j)]);
  out.append(reinterpret_cast<const char*>(wp), size_t(2 * set_words));
  out += raw;
  return kBlockSetRows | (ranked ? kBlockRanked : 0u) | (a.any_none ? kBlockHasNone : 0u);
}


namespace {

// What the v4 row loop reads (built and checked by decode_payload_set4).
struct V4Dec {
  int64_t T, L, K, E;
  const int32_t* perm;  // [L, E] or null (unranked)
  // For E <= 128 (ranked): each layer's permutation as 128 bytes, the 16-byte tables of ranks
  // [16i, 16i + 16) ordered T0 T4 T1 T5 T2 T6 T3 T7 (one 32-byte load gives the AVX2 row two of
  // them, one per 128-bit lane), null otherwise.
  const uint8_t* perm8;
  // Row stream: per model its symbols (start | freq << 16) and bucket index, null when unused.
  const std::vector<const uint32_t*>* tab;
  const std::vector<const uint16_t*>* bkt;
  const uint16_t* m0_sym;  // M0's full slot lookup: slot -> symbol (tab[0][symbol] for the rest)
  // Per order model (null for the others and empty ones): the full slot lookup, entries as the
  // set stream's (f - 1 | (slot - start) << 12 | symbol << 24; order alphabets are <= 256), and
  // its symbols' packed digits.
  const uint32_t* const* ofull;
  const uint64_t* const* odig;
  const Models* rows;
  const std::vector<std::vector<std::vector<uint64_t>>>* digits;
  const uint8_t *rwp, *rwend;
  uint32_t rx[kV4RowStates];
  // Set stream: per cluster the full slot lookups of F and G (entry: f - 1 | (slot - start) << 12
  // | low 8 bits of the symbol << 24; `hi`: the symbol's high bits when E > 256), null when empty.
  const uint32_t* const* lut;  // [C][2]
  const uint8_t* const* hi;    // [C][2]
  const uint32_t* cmap;
  uint32_t st[32];
  const uint8_t *swp, *swend;
  BitsIn* rb;
  bool under = false;
};

// For the AVX2 fast row: lane j of a row's renormalisation takes word number popcount(need &
// ((1 << j) - 1)) of the 8 words at the stream position (need: the lanes that read one).
struct WordSpread {
  uint32_t at[256][8];
  constexpr WordSpread() : at{} {
    for (unsigned n = 0; n < 256; ++n) {
      unsigned c = 0;
      for (unsigned j = 0; j < 8; ++j) {
        at[n][j] = c;
        c += (n >> j) & 1u;
      }
    }
  }
};
constexpr WordSpread kWordSpreadTable{};
constexpr const uint32_t (&kWordSpread)[256][8] = kWordSpreadTable.at;

// The row loop, built twice: for the baseline ISA and, with its AVX2 fast row, for AVX2.
namespace v4base {
#define SY_V4_SIMD 0
#include "route_codec_set4_rows.inc"
#undef SY_V4_SIMD
}  // namespace v4base
SY_AVX2_REGION_BEGIN
namespace v4avx2 {
#define SY_V4_SIMD 1
#include "route_codec_set4_rows.inc"
#undef SY_V4_SIMD
}  // namespace v4avx2
SY_AVX2_REGION_END

std::string v4_decode_base(V4Dec& d, int32_t* idx, bool wide) {
  return wide ? v4base::v4_decode_rows<true>(d, idx) : v4base::v4_decode_rows<false>(d, idx);
}
__attribute__((target("avx2,bmi,bmi2,popcnt"))) std::string v4_decode_avx2(V4Dec& d,
                                                                           int32_t* idx,
                                                                           bool wide) {
  return wide ? v4avx2::v4_decode_rows<true>(d, idx) : v4avx2::v4_decode_rows<false>(d, idx);
}

}  // namespace

std::string decode_payload_set4(const char* raw_c, int64_t raw_size, int64_t T, int64_t L,
                                int64_t K, int64_t E, uint32_t flags, int32_t* idx) {
  if (!set_coding_fits(L, K, E)) {
    return cat("set-coded block for num_experts=", E, ", top_k=", K,
               " (set coding covers top_k <= ", kSetMaxTopK, ", num_experts <= ", kSetMaxExperts,
               ")");
  }
  const auto* raw = reinterpret_cast<const uint8_t*>(raw_c);
  if (raw_size < kV4Header) return cat("set-coded payload of ", raw_size, " bytes is too short");
  if (raw[0] != kSetScaleBits) {
    return cat("set-coded payload: scale ", int(raw[0]), " bits (this build reads ",
               kSetScaleBits, ")");
  }
  const int64_t C = get_u32(raw_c + 1), head_n = get_u32(raw_c + 5), row_n = get_u32(raw_c + 9),
                set_n = get_u32(raw_c + 13), raw_n = get_u32(raw_c + 17);
  if (kV4Header + head_n + row_n + set_n + raw_n != raw_size || row_n < 4 * kV4RowStates ||
      row_n % 2 != 0 || set_n < 4 * kV4SetStates || set_n % 2 != 0) {
    return cat("set-coded payload: stream sizes ", head_n, " + ", row_n, " + ", set_n, " + ",
               raw_n, " do not fill its ", raw_size, " bytes");
  }
  if (C < 1 || C > std::min<int64_t>(L, kV4MaxClusters)) {
    return cat("set-coded payload: ", C, " table clusters for ", L, " layers (at most ",
               kV4MaxClusters, ")");
  }
  BitsIn hb{raw + kV4Header, head_n};
  std::vector<int32_t> perm;
  if (flags & kBlockRanked) {
    std::string err = read_perm(hb, head_n, L, E, perm);
    if (!err.empty()) return err;
  }
  const int cb = bit_width_of(uint64_t(C - 1));
  std::vector<uint32_t> cmap(static_cast<size_t>(L));
  if (L * cb > head_n * 8) return "set-coded payload: header too short for the cluster map";
  for (int64_t l = 0; l < L; ++l) {
    cmap[size_t(l)] = uint32_t(hb.get(cb));
    if (cmap[size_t(l)] >= C) {
      return cat("set-coded payload: layer ", l, " in cluster ", cmap[size_t(l)], " of ", C);
    }
  }
  // Row tables: symbols and bucket index, as version 3.
  Models rows(0, K, E, true);
  const uint32_t M = kV4Slots;
  std::vector<uint32_t> sf;
  std::vector<uint16_t> bl;
  std::vector<int64_t> bl_at(rows.m.size(), -1);
  // M0 (one symbol per row) gets a full slot -> symbol lookup (8 KiB): no bucket scan, whose
  // data-dependent trip count was a branch miss per row in the decoder's hottest loop.
  std::vector<uint16_t> m0_sym(M);
  for (size_t mi = 0; mi < rows.m.size(); ++mi) {
    Model& md = rows.m[mi];
    if (md.n == 0) continue;
    const int64_t first = static_cast<int64_t>(sf.size());
    const int64_t at = static_cast<int64_t>(bl.size());
    bool empty = true;
    std::string err = read_table(
        hb, md.n, head_n * 8, empty, "frequency table ", int64_t(mi),
        [&](int64_t i, uint32_t start, uint32_t f) {
          if (i == 0) {
            sf.resize(sf.size() + size_t(md.n));
            bl.resize(bl.size() + (M >> kBucketShift));
          }
          sf[size_t(first + i)] = start | (f << 16);
          if (mi == 0) std::fill_n(m0_sym.data() + start, f, static_cast<uint16_t>(i));
          for (uint32_t b = (start + (1u << kBucketShift) - 1) >> kBucketShift;
               (b << kBucketShift) < start + f; ++b) {
            bl[size_t(at + b)] = static_cast<uint16_t>(i);
          }
        });
    if (!err.empty()) return err;
    md.empty = empty;
    if (!empty) {
      md.first = first;
      bl_at[mi] = at;
    }
  }
  std::vector<const uint32_t*> tab(rows.m.size(), nullptr);
  std::vector<const uint16_t*> bkt(rows.m.size(), nullptr);
  for (size_t mi = 0; mi < rows.m.size(); ++mi) {
    if (bl_at[mi] < 0) continue;
    tab[mi] = sf.data() + rows.m[mi].first;
    bkt[mi] = bl.data() + bl_at[mi];
  }
  // Set tables: full slot lookups (at most kV4MaxClusters * 2 * 16 KiB).
  const bool wide = E > 256;
  std::vector<uint32_t> lut_mem(size_t(C * 2 * M));
  std::vector<uint8_t> hi_mem(wide ? size_t(C * 2 * M) : 0);
  std::vector<const uint32_t*> lut(size_t(2 * C), nullptr);
  std::vector<const uint8_t*> hi(size_t(2 * C), nullptr);
  for (int64_t c = 0; c < 2 * C; ++c) {
    uint32_t* ent = lut_mem.data() + c * M;
    uint8_t* h = wide ? hi_mem.data() + c * M : nullptr;
    bool empty = true;
    const int64_t n = (c & 1) ? std::max<int64_t>(E - 1, 1) : E;
    std::string err = read_table(hb, n, head_n * 8, empty, (c & 1) ? "gap table " : "first table ",
                                 c / 2, [&](int64_t i, uint32_t start, uint32_t f) {
                                   for (uint32_t q = 0; q < f; ++q) {
                                     ent[start + q] = (f - 1) | (q << 12) | (uint32_t(i) << 24);
                                     if (h) h[start + q] = uint8_t(i >> 8);
                                   }
                                 });
    if (!err.empty()) return err;
    if (!empty) {
      lut[size_t(c)] = ent;
      hi[size_t(c)] = h;
    }
  }
  if (!hb.done()) return "set-coded payload: header has bytes past its tables";
  const auto digits = order_digits(rows, K);
  // Order models: full slot lookups (16 KiB each, only for the tables present), in place of the
  // bucket scan whose data-dependent trip count missed in the decoder's unsorted rows.
  std::vector<const uint32_t*> ofull(rows.m.size(), nullptr);
  std::vector<const uint64_t*> odig(rows.m.size(), nullptr);
  int64_t n_ofull = 0;
  for (size_t mi = 2; mi < rows.m.size(); ++mi) n_ofull += tab[mi] ? 1 : 0;
  std::vector<uint32_t> ofull_mem(size_t(n_ofull * M));
  {
    uint32_t* at = ofull_mem.data();
    for (int64_t mm = 2; mm <= K; ++mm) {
      const auto& groups = rows.groups[size_t(mm)];
      for (size_t gi = 0; gi < groups.size(); ++gi) {
        const size_t mi = size_t(rows.order_model[size_t(mm)]) + gi;
        odig[mi] = digits[size_t(mm)][gi].data();
        if (!tab[mi]) continue;
        for (int64_t i = 0; i < rows.m[mi].n; ++i) {
          const uint32_t start = tab[mi][i] & 0xffffu, f = tab[mi][i] >> 16;
          for (uint32_t q = 0; q < f; ++q) at[start + q] = (f - 1) | (q << 12) | uint32_t(i) << 24;
        }
        ofull[mi] = at;
        at += M;
      }
    }
  }
  const uint8_t* rp = raw + kV4Header + head_n;
  const uint8_t* sp = rp + row_n;
  V4Dec d{};
  d.T = T;
  d.L = L;
  d.K = K;
  d.E = E;
  d.perm = perm.empty() ? nullptr : perm.data();
  std::vector<uint8_t> perm8;
  if (!perm.empty() && E <= 128) {
    perm8.assign(size_t(L * 128), 0);
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t r = 0; r < E; ++r) {
        const int64_t i = r >> 4;  // table i sits at 32 (i mod 4) + 16 (i / 4)
        perm8[size_t(l * 128 + 32 * (i & 3) + 16 * (i >> 2) + (r & 15))] =
            uint8_t(perm[size_t(l * E + r)]);
      }
    }
    d.perm8 = perm8.data();
  }
  d.tab = &tab;
  d.bkt = &bkt;
  d.m0_sym = m0_sym.data();
  d.ofull = ofull.data();
  d.odig = odig.data();
  d.rows = &rows;
  d.digits = &digits;
  bool states_ok = true;
  for (int j = 0; j < kV4RowStates; ++j) {
    d.rx[j] = get_u32(raw_c + (rp - raw) + 4 * j);
    states_ok &= d.rx[j] >= kRansL && d.rx[j] < (1u << 31);
  }
  d.rwp = rp + 4 * kV4RowStates;
  d.rwend = rp + row_n;
  d.lut = lut.data();
  d.hi = hi.data();
  d.cmap = cmap.data();
  for (int j = 0; j < kV4SetStates; ++j) {
    d.st[j] = get_u32(raw_c + (sp - raw) + 4 * j);
    states_ok &= d.st[j] >= kRansL && d.st[j] < (1u << 31);
  }
  if (!states_ok) return "set-coded payload: rANS state out of range";
  d.swp = sp + 4 * kV4SetStates;
  d.swend = sp + set_n;
  BitsIn rb{sp + set_n, raw_n};
  d.rb = &rb;
  if (T > 0 && !tab[0]) return "set-coded payload: the mask table is empty";
  std::string err = v4_simd() ? v4_decode_avx2(d, idx, wide) : v4_decode_base(d, idx, wide);
  if (!err.empty()) return err;
  bool ends = !d.under && d.rwp == d.rwend && d.swp == d.swend;
  for (int j = 0; j < kV4RowStates; ++j) ends &= d.rx[j] == kRansL;
  for (int j = 0; j < kV4SetStates; ++j) ends &= d.st[j] == kRansL;
  if (!ends) return "set-coded payload: the rANS streams do not end where their symbols do";
  if (!rb.done()) return "set-coded payload: raw bits do not end where the rows do";
  return {};
}

}  // namespace switchyard::detail
