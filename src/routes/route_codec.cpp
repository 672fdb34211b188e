// Block payload transform of the route file. Ids are rewritten per layer as popularity ranks
// (rank 0 = the layer's most used expert in this block): every layer then shows zstd the same
// skewed distribution, where raw ids mix 48 different permutations of it into a near-uniform one.
// Version 2 adds the token delta: an id equal to the one a token earlier in the same layer and slot
// (consecutive tokens share most experts) costs one bit of a match bitmap; only the others are
// stored (as ranks), so zstd entropy-codes about half the bytes and needs no match search for the
// correlation (notes/routes.md, "Route data at RL scale"). Version 1 (ranks laid out layer-major,
// every id stored) is decoded still.
#include "route_codec.h"

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <functional>
#include <numeric>

#include "check.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace switchyard::detail {

uint64_t checksum(const void* data, size_t n) { return XXH3_64bits(data, n); }

namespace {

// Size of a payload holding `n_lit` stored ids (version 1: all of them).
int64_t payload_bytes(int64_t num_tokens, int64_t num_layers, int64_t top_k, int64_t num_experts,
                      uint32_t flags, int64_t n_lit) {
  const int64_t w = id_width_for(num_experts);
  const int64_t numel = num_tokens * num_layers * top_k;
  int64_t n = ((flags & kBlockRanked) ? num_layers * num_experts * w : 0) + n_lit * w;
  if (flags & kBlockTokenDelta) n += (numel + 7) / 8;
  if (flags & kBlockHasNone) n += (numel + 7) / 8;
  return n;
}

}  // namespace

bool payload_size_ok(int64_t num_tokens, int64_t num_layers, int64_t top_k, int64_t num_experts,
                     uint32_t flags, int64_t raw_size) {
  // Set-coded: stream sizes after a 13-byte (version 3) or 21-byte (version 4) header, checked by
  // the decoder; an upper bound per row (mask symbols, raw escapes of K ids) keeps a header from
  // declaring absurd sizes.
  if (block_is_set_coded(flags)) {
    const int64_t rows = num_tokens * num_layers;
    return raw_size >= 21 &&
           raw_size <= 64 + num_layers * num_experts * 8 + rows * (8 + top_k * 8) + (1 << 20);
  }
  const int64_t numel = num_tokens * num_layers * top_k;
  const int64_t w = id_width_for(num_experts);
  const int64_t fixed = payload_bytes(num_tokens, num_layers, top_k, num_experts, flags, 0);
  if (!(flags & kBlockTokenDelta)) return raw_size == fixed + numel * w;
  return raw_size >= fixed && (raw_size - fixed) % w == 0 && (raw_size - fixed) / w <= numel;
}

namespace {

// Tokens counted by the rank pass: the block's first ones, about 16 ids per expert and layer.
// Ranks only need the layer's popular experts roughly in order (any permutation decodes, the
// block stores it; the literals' Huffman code needs each layer's skew lined up, not an exact
// order), and a contiguous prefix is read again from cache by the encoding pass right after.
int64_t rank_sample(int64_t T, int64_t K, int64_t E) {
  return std::min<int64_t>(T, std::max<int64_t>(1, (16 * E + K - 1) / K));
}

// Range of one token's ids (L*K of them, a vectorisable pass over data about to be used).
inline void token_range(const int32_t* v, int64_t n, int32_t& lo, int32_t& hi) {
  int32_t a = 0, b = 0;
  for (int64_t i = 0; i < n; ++i) {
    a = std::min(a, v[i]);
    b = std::max(b, v[i]);
  }
  lo = a;
  hi = b;
}

// Appends bits to a little-endian bitmap 64 at a time (the match bitmap, in flat id order).
struct BitWriter {
  uint8_t* out;
  uint64_t acc = 0;
  int pos = 0;
  int64_t word = 0;
  void put(uint64_t bits, int n) {  // n <= 8, bits < 2^n
    acc |= bits << pos;
    pos += n;
    if (pos >= 64) {
      std::memcpy(out + word * 8, &acc, 8);
      ++word;
      pos -= 64;
      acc = pos ? bits >> (n - pos) : 0;
    }
  }
  void finish(int64_t nbytes) {
    if (pos) std::memcpy(out + word * 8, &acc, size_t(nbytes - word * 8));
  }
};

// Reads it back, `n` bits at a time; bits past the bitmap read as 0.
struct BitReader {
  const uint8_t* in;
  int64_t nbytes;
  uint64_t cur = 0, next = 0;
  int pos = 64;
  int64_t word = -1;
  uint64_t load(int64_t w) const {
    uint64_t v = 0;
    if (w * 8 < nbytes) std::memcpy(&v, in + w * 8, size_t(std::min<int64_t>(8, nbytes - w * 8)));
    return v;
  }
  unsigned get(int n) {  // n <= 8
    if (pos >= 64) {
      cur = load(++word);
      pos = 0;
    }
    uint64_t v = cur >> pos;
    if (pos + n > 64) {
      cur = load(++word);
      v |= cur << (64 - pos);
      pos = pos + n - 64;
    } else {
      pos += n;
    }
    return unsigned(v & ((1u << n) - 1));
  }
};

// Stores `v` as the i-th W of a byte buffer without an alignment promise (one plain store on x86).
template <class W, class B>
inline void store_unaligned(B* bytes, int64_t i, W v) {
  std::memcpy(reinterpret_cast<char*>(bytes) + i * int64_t(sizeof(W)), &v, sizeof(W));
}

// The rank tables of a ranked block from a counting pass over its first tokens: writes the
// permutation (rank -> id per layer) to `perm_out` and fills `rank` ([L, E + 1], indexed by id + 1
// so that -1 needs no branch: slot 0 maps to stored value 0). Without `ranked`, rank is the
// identity. Returns false on a sampled id outside [-1, E).
template <class W>
bool build_ranks(const int32_t* idx, int64_t T, int64_t L, int64_t K, int64_t E, bool ranked,
                 char* perm_out, std::vector<W>& rank) {
  const int64_t E1 = E + 1, row = L * K;
  rank.assign(static_cast<size_t>(L * E1), W{0});
  if (!ranked) {
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t e = 0; e < E; ++e) rank[size_t(l * E1 + 1 + e)] = static_cast<W>(e);
    }
    return true;
  }
  // uint32: a block holds < 2^32 ids per layer (kMaxRawBlockBytes), and 48 x 129 counters then
  // stay in L1.
  std::vector<uint32_t> count(static_cast<size_t>(L * E1), 0);
  const int64_t sample = rank_sample(T, K, E);
  for (int64_t t = 0; t < sample; ++t) {
    const int32_t* tok = idx + t * row;
    int32_t lo, hi;
    token_range(tok, row, lo, hi);
    if (lo < -1 || hi >= E) return false;
    for (int64_t l = 0; l < L; ++l) {
      uint32_t* c = count.data() + l * E1 + 1;
      for (int64_t k = 0; k < K; ++k) ++c[tok[l * K + k]];
    }
  }
  // Most used expert first, ties to the lower id (a total, deterministic order; counts past
  // 65535 tie): a stable two-pass radix sort of the ids on 65535 - count (std::sort of 64-bit keys
  // was 7 ms per 64 sequences of 48 layers).
  std::vector<uint32_t> order(static_cast<size_t>(E)), tmp(static_cast<size_t>(E));
  std::vector<uint16_t> digit(static_cast<size_t>(E));
  for (int64_t l = 0; l < L; ++l) {
    const uint32_t* c = count.data() + l * E1 + 1;
    for (int64_t e = 0; e < E; ++e) {
      digit[size_t(e)] = static_cast<uint16_t>(65535u - std::min<uint32_t>(c[e], 65535u));
      order[size_t(e)] = static_cast<uint32_t>(e);
    }
    for (int shift : {0, 8}) {
      std::array<uint32_t, 257> at{};
      for (int64_t i = 0; i < E; ++i) ++at[size_t(((digit[order[size_t(i)]] >> shift) & 255) + 1)];
      for (size_t b = 1; b < at.size(); ++b) at[b] += at[b - 1];
      for (int64_t i = 0; i < E; ++i) {
        const uint32_t e = order[size_t(i)];
        tmp[at[size_t((digit[e] >> shift) & 255)]++] = e;
      }
      order.swap(tmp);
    }
    for (int64_t r = 0; r < E; ++r) {
      const int64_t e = order[size_t(r)];
      store_unaligned(perm_out, l * E + r, static_cast<W>(e));
      rank[size_t(l * E1 + 1 + e)] = static_cast<W>(r);
    }
  }
  return true;
}

}  // namespace

bool build_ranks_u16(const int32_t* idx, int64_t T, int64_t L, int64_t K, int64_t E, bool ranked,
                     char* perm_out, std::vector<uint16_t>& rank) {
  return build_ranks<uint16_t>(idx, T, L, K, E, ranked, perm_out, rank);
}

namespace {

// encode_delta's loop for one-byte ranks, K a multiple of 4 and whole bytes of match bits per
// token (K = 8: every model we know of): 8 ids at a time, their compare and range check in SSE2
// registers (loaded once), the rank lookups indexed by the id's low 9 bits so that no id, valid or
// not, reads outside the table before the token's range check fails it.
int encode_delta_u8(const int32_t* idx, int64_t T, int64_t L, int64_t K, int64_t E,
                    const std::vector<uint8_t>& rank, uint8_t* match, uint8_t* lit,
                    uint8_t* none_bits, int64_t& n_lit) {
  const int64_t E1 = E + 1, row = L * K;
  std::vector<uint8_t> rk(static_cast<size_t>(L * 512), 0);  // [layer][id & 511]; -1 -> 511 -> 0
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t e = 0; e < E; ++e) rk[size_t(l * 512 + e)] = rank[size_t(l * E1 + 1 + e)];
  }
  std::vector<const uint8_t*> group(static_cast<size_t>(row / 4));  // table of ids j..j+3
  for (int64_t g = 0; g < row / 4; ++g) group[size_t(g)] = rk.data() + (g * 4 / K) * 512;
  bool any_none = false;
  int64_t m = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* tok = idx + t * row;
    const int32_t* prev = t > 0 ? tok - row : tok;
    const unsigned use = t > 0 ? 0xffu : 0u;  // the first token has no previous one
    uint8_t* mb = match + t * (row / 8);
    // Prefetch two tokens ahead (the hardware prefetcher alone left this loop waiting on memory
    // for half its time: 110 -> 55 ms per 64 sequences).
    const int64_t ahead = t + 2 < T ? 2 * row : 0;
#if defined(__SSE2__)
    const __m128i one = _mm_set1_epi32(1);
    const __m128i sign = _mm_set1_epi32(int32_t(0x80000000u));
    const __m128i lim = _mm_set1_epi32(int32_t(uint32_t(E) ^ 0x80000000u));
    __m128i bad = _mm_setzero_si128(), neg = _mm_setzero_si128();
#else
    uint32_t bad = 0;
    int32_t neg = 0;
#endif
    for (int64_t j = 0; j < row; j += 8) {
      const int32_t* v = tok + j;
#if defined(__SSE2__)
      _mm_prefetch(reinterpret_cast<const char*>(v + ahead), _MM_HINT_T0);
      const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
      const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 4));
      const __m128i y0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(prev + j));
      const __m128i y1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(prev + j + 4));
      const unsigned eq =
          (unsigned(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(x0, y0)))) |
           unsigned(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(x1, y1)))) << 4) &
          use;
      // (uint32)(id + 1) > E, as a signed compare with the sign bits flipped; neg: any -1 lane.
      bad = _mm_or_si128(bad, _mm_cmpgt_epi32(_mm_xor_si128(_mm_add_epi32(x0, one), sign), lim));
      bad = _mm_or_si128(bad, _mm_cmpgt_epi32(_mm_xor_si128(_mm_add_epi32(x1, one), sign), lim));
      neg = _mm_or_si128(neg, _mm_or_si128(x0, x1));
#else
      unsigned eq = 0;
      for (int q = 0; q < 8; ++q) {
        eq |= unsigned(v[q] == prev[j + q]) << q;
        bad |= uint32_t(uint32_t(v[q] + 1) > uint32_t(E));
        neg |= v[q];
      }
      eq &= use;
#endif
      const uint8_t* r0 = group[size_t(j / 4)];
      const uint8_t* r1 = group[size_t(j / 4 + 1)];
      const unsigned miss = ~eq;
      lit[m] = r0[v[0] & 511];
      m += miss & 1u;
      lit[m] = r0[v[1] & 511];
      m += (miss >> 1) & 1u;
      lit[m] = r0[v[2] & 511];
      m += (miss >> 2) & 1u;
      lit[m] = r0[v[3] & 511];
      m += (miss >> 3) & 1u;
      lit[m] = r1[v[4] & 511];
      m += (miss >> 4) & 1u;
      lit[m] = r1[v[5] & 511];
      m += (miss >> 5) & 1u;
      lit[m] = r1[v[6] & 511];
      m += (miss >> 6) & 1u;
      lit[m] = r1[v[7] & 511];
      m += (miss >> 7) & 1u;
      mb[j / 8] = static_cast<uint8_t>(eq);
    }
#if defined(__SSE2__)
    if (_mm_movemask_epi8(bad) != 0) return -1;
    const bool has_none = _mm_movemask_ps(_mm_castsi128_ps(neg)) != 0;
#else
    if (bad) return -1;
    const bool has_none = neg < 0;
#endif
    any_none = any_none || has_none;
    if (none_bits) {
      uint8_t* b = none_bits + t * (row / 8);
      if (has_none) {
        for (int64_t j = 0; j < row / 8; ++j) {
          unsigned byte = 0;
          for (int q = 0; q < 8; ++q) byte |= unsigned(tok[j * 8 + q] < 0) << q;
          b[j] = static_cast<uint8_t>(byte);
        }
      } else {
        std::memset(b, 0, size_t(row / 8));
      }
    }
  }
  n_lit = m;
  return any_none ? 1 : 0;
}

// Version 2 payload in one pass over the input (token-major) after the rank pass: per id, its
// match bit (equal to the id one token earlier, same layer and slot) and, unless it matches, its
// rank as the next literal (written unconditionally, the literal cursor advancing on a miss: no
// branch). Every token's ids are range-checked before they index anything. `out` has room for
// every id as a literal. Returns -1 on an id outside [-1, E) (the caller names it), else whether
// any entry is -1; sets n_lit.
template <class W>
int encode_delta(const int32_t* idx, int64_t T, int64_t L, int64_t K, int64_t E, bool ranked,
                 char* out, uint8_t* none_bits, int64_t& n_lit) {
  const int64_t E1 = E + 1, row = L * K, numel = T * row;
  // `out` has no alignment promise (a payload inside a message): wider ids are stored with memcpy.
  char* perm_out = out;
  uint8_t* match = reinterpret_cast<uint8_t*>(out) + (ranked ? L * E * int64_t(sizeof(W)) : 0);
  uint8_t* lit_bytes = match + (numel + 7) / 8;
  std::vector<W> rank;
  if (!build_ranks<W>(idx, T, L, K, E, ranked, perm_out, rank)) return -1;
  if constexpr (sizeof(W) == 1) {
    if (K % 4 == 0 && row % 8 == 0) {
      return encode_delta_u8(idx, T, L, K, E, rank, match, lit_bytes, none_bits, n_lit);
    }
  }
  // rank row of each position of a token's row (its layer's table, shifted for id + 1).
  std::vector<const W*> rk(static_cast<size_t>(row));
  for (int64_t j = 0; j < row; ++j) rk[size_t(j)] = rank.data() + (j / K) * E1 + 1;
  const bool bits_here = row % 8 == 0;  // a token's -1 bits fill whole bytes
  bool any_none = false;
  int64_t m = 0;
  BitWriter bw{match};
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* tok = idx + t * row;
    int32_t lo, hi;
    token_range(tok, row, lo, hi);
    if (lo < -1 || hi >= E) return -1;
    any_none = any_none || lo < 0;
    if (t == 0) {  // no previous token: every id is a literal, its bit 0
      for (int64_t j = 0; j < row; ++j) store_unaligned(lit_bytes, m++, rk[size_t(j)][tok[j]]);
      for (int64_t j = 0; j < row; j += 8) bw.put(0, int(std::min<int64_t>(8, row - j)));
    } else {
      const int32_t* prev = tok - row;
      for (int64_t j = 0; j < row; ++j) {
        const unsigned eq = tok[j] == prev[j];
        store_unaligned(lit_bytes, m, rk[size_t(j)][tok[j]]);
        m += int64_t(eq ^ 1u);
        bw.put(eq, 1);
      }
    }
    if (bits_here && none_bits && lo < 0) {
      uint8_t* b = none_bits + t * (row / 8);
      for (int64_t j = 0; j < row / 8; ++j) {
        unsigned byte = 0;
        for (int q = 0; q < 8; ++q) byte |= unsigned(tok[j * 8 + q] < 0) << q;
        b[j] = static_cast<uint8_t>(byte);
      }
    } else if (bits_here && none_bits) {
      std::memset(none_bits + t * (row / 8), 0, size_t(row / 8));
    }
  }
  bw.finish((numel + 7) / 8);
  n_lit = m;
  return any_none ? 1 : 0;
}

// Sets the entries the -1 bitmap marks (when there is one) to -1.
void apply_none(const uint8_t* none_bits, int64_t numel, int32_t* idx) {
  if (!none_bits) return;
  for (int64_t b = 0; b < (numel + 7) / 8; ++b) {
    if (none_bits[b] == 0) continue;
    for (int64_t q = 0; q < 8 && b * 8 + q < numel; ++q) {
      if ((none_bits[b] >> q) & 1) idx[b * 8 + q] = -1;
    }
  }
}

template <class W>
std::string decode_v1(const char* raw, int64_t T, int64_t L, int64_t K, int64_t E, bool ranked,
                      const uint8_t* none_bits, int32_t* idx) {
  std::vector<W> perm(static_cast<size_t>(L * E));
  if (ranked) {
    std::memcpy(perm.data(), raw, perm.size() * sizeof(W));
  } else {
    for (int64_t l = 0; l < L; ++l)
      std::iota(perm.begin() + l * E, perm.begin() + (l + 1) * E, W{0});
  }
  const int64_t numel = T * L * K;
  // The rank plane is read in place (memcpy loads: the payload has no alignment promise).
  const char* plane = raw + (ranked ? perm.size() * sizeof(W) : 0);
  const auto rank_at = [plane](int64_t i) {
    W v;
    std::memcpy(&v, plane + i * int64_t(sizeof(W)), sizeof(W));
    return v;
  };
  std::vector<uint8_t> seen(static_cast<size_t>(E));
  for (int64_t l = 0; l < L && ranked; ++l) {
    const W* p = perm.data() + l * E;
    std::fill(seen.begin(), seen.end(), 0);
    for (int64_t r = 0; r < E; ++r) {
      if (int64_t(p[r]) >= E || seen[size_t(p[r])]) {
        return cat("layer ", l, " expert permutation is invalid at rank ", r);
      }
      seen[size_t(p[r])] = 1;
    }
  }
  // Range check in one vectorisable pass, so the copy below needs no branch.
  W max_rank = 0;
  for (int64_t i = 0; i < numel; ++i) max_rank = std::max(max_rank, rank_at(i));
  if (numel > 0 && int64_t(max_rank) >= E) {
    int64_t i = 0;
    while (int64_t(rank_at(i)) < E) ++i;
    return cat("token ", (i / K) % T, ", layer ", i / (T * K), ": rank ", int64_t(max_rank),
               " >= num_experts");
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t l = 0; l < L; ++l) {
      const int64_t src = (l * T + t) * K;
      const W* p = perm.data() + l * E;
      int32_t* out = idx + (t * L + l) * K;
      for (int64_t k = 0; k < K; ++k) out[k] = static_cast<int32_t>(p[rank_at(src + k)]);
    }
  }
  apply_none(none_bits, numel, idx);
  return {};
}

// Inverse of encode_delta. Checks the structure before it indexes anything: the permutation of
// every layer, the literals below E, the first token's match bits 0, the padding bits 0 and the
// literal count equal to the misses.
template <class W, bool Ranked>
std::string decode_delta(const char* raw, int64_t n_lit, int64_t T, int64_t L, int64_t K, int64_t E,
                         const uint8_t* none_bits, int32_t* idx) {
  const int64_t row = L * K, numel = T * row;
  std::vector<W> perm(Ranked ? static_cast<size_t>(L * E) : 0);
  if (Ranked) std::memcpy(perm.data(), raw, perm.size() * sizeof(W));
  const auto* match =
      reinterpret_cast<const uint8_t*>(raw) + (Ranked ? L * E * int64_t(sizeof(W)) : 0);
  const char* lit_bytes = reinterpret_cast<const char*>(match + (numel + 7) / 8);
  if (Ranked) {
    std::vector<uint8_t> seen(static_cast<size_t>(E));
    for (int64_t l = 0; l < L; ++l) {
      const W* p = perm.data() + l * E;
      std::fill(seen.begin(), seen.end(), 0);
      for (int64_t r = 0; r < E; ++r) {
        if (int64_t(p[r]) >= E || seen[size_t(p[r])]) {
          return cat("layer ", l, " expert permutation is invalid at rank ", r);
        }
        seen[size_t(p[r])] = 1;
      }
    }
  }
  const auto word_at = [match, numel](int64_t w) {  // 64 match bits, zero past the bitmap
    uint64_t v = 0;
    std::memcpy(&v, match + w * 8, size_t(std::min<int64_t>(8, (numel + 7) / 8 - w * 8)));
    return v;
  };
  int64_t hits = 0;
  for (int64_t w = 0; w * 64 < numel; ++w) {
    const uint64_t v = word_at(w);
    const int64_t lo = w * 64, hi = std::min(numel, lo + 64);
    uint64_t bad = 0;
    if (hi - lo < 64) bad |= v >> (hi - lo);  // padding bits
    if (lo < row)
      bad |= v & (std::min<int64_t>(row - lo, 64) == 64
                      ? ~uint64_t{0}
                      : ((uint64_t{1} << std::min<int64_t>(row - lo, 64)) - 1));
    if (bad) return cat("match bit set with no previous token (word ", w, ")");
    hits += __builtin_popcountll(v);
  }
  if (hits + n_lit != numel) {
    return cat(n_lit, " literals for ", numel - hits, " unmatched ids");
  }
  // Literals below E in one vectorisable pass (the payload has no alignment promise: memcpy
  // loads), so the decode loop below needs no check.
  const auto lit_at = [lit_bytes](int64_t j) {
    W v;
    std::memcpy(&v, lit_bytes + j * int64_t(sizeof(W)), sizeof(W));
    return v;
  };
  W max_lit = 0;
  for (int64_t j = 0; j < n_lit; ++j) max_lit = std::max(max_lit, lit_at(j));
  if (n_lit > 0 && int64_t(max_lit) >= E) {
    int64_t j = 0;
    while (int64_t(lit_at(j)) < E) ++j;
    return cat("literal ", j, ": rank ", int64_t(lit_at(j)), " >= num_experts");
  }
  // One pass in output order: a hit copies the id one token back (already decoded), a miss takes
  // the next literal (read on a hit too, the cursor staying: no branch; past the last literal it
  // reads rank 0).
  if constexpr (sizeof(W) == 1) {
    if (row % 8 == 0) {
      // Whole bytes of match bits per token: each token starts as a copy of the previous one,
      // then the misses (zero bits, 64 at a time) take the next literals. The bit checks above
      // guarantee exactly n_lit misses, so no literal read is out of bounds.
      std::vector<int32_t> table(static_cast<size_t>(L * 256), 0);
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t r = 0; r < E; ++r) {
          table[size_t(l * 256 + r)] = Ranked ? int32_t(perm[size_t(l * E + r)]) : int32_t(r);
        }
      }
      std::vector<const int32_t*> at(static_cast<size_t>(row));  // table of each position
      for (int64_t q = 0; q < row; ++q) at[size_t(q)] = table.data() + (q / K) * 256;
      const auto* lit = reinterpret_cast<const uint8_t*>(lit_bytes);
      int64_t j = 0;
      const int64_t row_bytes = row / 8;
      // The current row is built in a scratch row (which holds the previous token's ids: a token
      // starts as a copy of it) and streamed to the output, which is then never read back: with
      // SSE2 by non-temporal stores (no read-for-ownership of output lines that are only written).
      std::vector<int32_t> cur(static_cast<size_t>(row));
      int32_t* c = cur.data();
#if defined(__SSE2__)
      const bool stream = row % 4 == 0 && reinterpret_cast<uintptr_t>(idx) % 16 == 0;
#endif
      for (int64_t t = 0; t < T; ++t) {
        if (t == 0) {
          for (int64_t q = 0; q < row; ++q) c[q] = at[size_t(q)][lit[j++]];
        } else {
          const uint8_t* mb = match + t * row_bytes;
          for (int64_t b = 0; b < row_bytes; b += 8) {
            const int64_t nb = std::min<int64_t>(8, row_bytes - b);
            uint64_t word = 0;
            std::memcpy(&word, mb + b, size_t(nb));
            uint64_t miss = ~word;
            if (nb < 8) miss &= (uint64_t{1} << (nb * 8)) - 1;
            while (miss) {
              const int64_t q = b * 8 + __builtin_ctzll(miss);
              miss &= miss - 1;
              c[q] = at[size_t(q)][lit[j++]];
            }
          }
        }
        int32_t* out = idx + t * row;
#if defined(__SSE2__)
        if (stream) {
          for (int64_t q = 0; q < row; q += 4) {
            _mm_stream_si128(reinterpret_cast<__m128i*>(out + q),
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + q)));
          }
          continue;
        }
#endif
        std::memcpy(out, c, size_t(row) * sizeof(int32_t));
      }
#if defined(__SSE2__)
      _mm_sfence();  // the streamed stores are visible before the -1 pass and the caller
#endif
      apply_none(none_bits, numel, idx);
      return {};
    }
  }
  // Permutation row of each position of a token's row.
  std::vector<int64_t> poff(static_cast<size_t>(row));
  for (int64_t q = 0; q < row; ++q) poff[size_t(q)] = (q / K) * E;
  const auto id_of = [&](int64_t q, W r) {
    return Ranked ? static_cast<int32_t>(perm[size_t(poff[size_t(q)] + r)])
                  : static_cast<int32_t>(r);
  };
  int64_t j = 0;
  BitReader br{match, (numel + 7) / 8};
  for (int64_t t = 0; t < T; ++t) {
    int32_t* out = idx + t * row;
    if (t == 0) {  // every id a literal (its bits checked 0 above)
      for (int64_t q = 0; q < row; ++q) out[q] = id_of(q, lit_at(j++));
      for (int64_t q = 0; q < row; q += 8) (void)br.get(int(std::min<int64_t>(8, row - q)));
      continue;
    }
    const int32_t* prev = out - row;
    int64_t q = 0;
    for (; q + 4 <= row; q += 4) {
      const unsigned hits = br.get(4);
      for (int64_t u = 0; u < 4; ++u) {
        const unsigned hit = (hits >> u) & 1u;
        const W r = j < n_lit ? lit_at(j) : W{0};
        const int32_t v = id_of(q + u, r);
        const int32_t keep = -int32_t(hit);  // all ones on a hit
        out[q + u] = (prev[q + u] & keep) | (v & ~keep);
        j += int64_t(hit ^ 1u);
      }
    }
    for (; q < row; ++q) {
      const unsigned hit = br.get(1);
      const W r = j < n_lit ? lit_at(j) : W{0};
      const int32_t v = id_of(q, r);
      const int32_t keep = -int32_t(hit);
      out[q] = (prev[q] & keep) | (v & ~keep);
      j += int64_t(hit ^ 1u);
    }
  }
  apply_none(none_bits, numel, idx);
  return {};
}

}  // namespace

uint32_t encode_payload(const int32_t* topk_idx, int64_t num_tokens, int64_t num_layers,
                        int64_t top_k, int64_t num_experts, std::string& out, PayloadPieces& pieces,
                        PayloadCoding coding) {
  const int64_t T = num_tokens, L = num_layers, K = top_k, E = num_experts;
  const int64_t numel = T * L * K, w = id_width_for(E), nb = (numel + 7) / 8;
  const bool ranked = T * K >= kRankMinIdsPerExpert * E;
  // Set coding pays for its tables (and its permutation) once the block is as large as the rank
  // rule asks, and beats token delta + zstd only where the token delta removes little: on
  // bench/py_routes_rl_scale.py's correlated batch (about half the ids match the previous token)
  // token delta is smaller (3.88 against 4.07 bits per routed id) and 6-10x faster; on
  // uncorrelated tokens (bench_routes, ~10% matches) set coding is 13% smaller. A forced set
  // coding of a small block is unranked.
  bool set = T > 0 && set_coding_fits(L, K, E) &&
             (coding == PayloadCoding::set_delta || coding == PayloadCoding::set_delta_v3 ||
              (coding == PayloadCoding::automatic && ranked));
  if (set && coding == PayloadCoding::automatic) {
    const int64_t sample = std::min<int64_t>(T, 256), row = L * K;
    int64_t hits = 0;
    for (int64_t i = row; i < sample * row; ++i) hits += topk_idx[i] == topk_idx[i - row];
    set = hits * 100 < kSetMaxMatchPercent * std::max<int64_t>(1, (sample - 1) * row);
  }
  if (set) {
    const uint32_t flags = coding == PayloadCoding::set_delta_v3
                               ? encode_payload_set(topk_idx, T, L, K, E, ranked, out)
                               : encode_payload_set4(topk_idx, T, L, K, E, ranked, out);
    pieces = PayloadPieces{};
    pieces.stored = true;
    pieces.head_size = static_cast<int64_t>(out.size());
    return flags;
  }
  const uint32_t base = kBlockTokenDelta | (ranked ? kBlockRanked : 0u);
  // Room for every id as a literal, then the -1 bitmap (its own frame: it need not follow the
  // literals in memory, so their count need not be known first).
  const int64_t head = payload_bytes(T, L, K, E, base, 0);
  const int64_t none_at = head + numel * w;
  out.resize(static_cast<size_t>(none_at + nb));
  char* p = out.data();
  auto* bits = reinterpret_cast<uint8_t*>(p + none_at);
  int64_t n_lit = 0;
  int any_none = 0;
  switch (w) {
    case 1:
      any_none = encode_delta<uint8_t>(topk_idx, T, L, K, E, ranked, p, bits, n_lit);
      break;
    case 2:
      any_none = encode_delta<uint16_t>(topk_idx, T, L, K, E, ranked, p, bits, n_lit);
      break;
    default:
      any_none = encode_delta<uint32_t>(topk_idx, T, L, K, E, ranked, p, bits, n_lit);
      break;
  }
  if (any_none < 0) return kBadIds;
  if (any_none && (L * K) % 8 != 0) {  // the bitmap was not written on the way
    std::memset(bits, 0, size_t(nb));
    for (int64_t i = 0; i < numel; ++i)
      bits[i >> 3] |= uint8_t(unsigned(topk_idx[i] < 0) << (i & 7));
  }
  pieces.head_size = head;
  pieces.lit_offset = head;
  pieces.lit_size = n_lit * w;
  pieces.none_offset = none_at;
  pieces.none_size = any_none ? nb : 0;
  return base | (any_none ? kBlockHasNone : 0u);
}

std::string decode_payload(const char* raw, int64_t raw_size, int64_t num_tokens,
                           int64_t num_layers, int64_t top_k, int64_t num_experts, uint32_t flags,
                           int32_t* topk_idx) {
  const int64_t T = num_tokens, L = num_layers, K = top_k, E = num_experts;
  if (!payload_size_ok(T, L, K, E, flags, raw_size)) {
    return cat("payload of ", raw_size, " bytes does not fit the block's dimensions");
  }
  if (flags & kBlockSetDelta) return decode_payload_set(raw, raw_size, T, L, K, E, flags, topk_idx);
  if (flags & kBlockSetRows) return decode_payload_set4(raw, raw_size, T, L, K, E, flags, topk_idx);
  const int64_t numel = T * L * K;
  const uint8_t* bits = (flags & kBlockHasNone)
                            ? reinterpret_cast<const uint8_t*>(raw + raw_size - (numel + 7) / 8)
                            : nullptr;
  const bool ranked = (flags & kBlockRanked) != 0;
  if (flags & kBlockTokenDelta) {
    const int64_t w = id_width_for(E);
    const int64_t n_lit = (raw_size - payload_bytes(T, L, K, E, flags, 0)) / w;
    switch (w) {
      case 1:
        return ranked ? decode_delta<uint8_t, true>(raw, n_lit, T, L, K, E, bits, topk_idx)
                      : decode_delta<uint8_t, false>(raw, n_lit, T, L, K, E, bits, topk_idx);
      case 2:
        return ranked ? decode_delta<uint16_t, true>(raw, n_lit, T, L, K, E, bits, topk_idx)
                      : decode_delta<uint16_t, false>(raw, n_lit, T, L, K, E, bits, topk_idx);
      default:
        return ranked ? decode_delta<uint32_t, true>(raw, n_lit, T, L, K, E, bits, topk_idx)
                      : decode_delta<uint32_t, false>(raw, n_lit, T, L, K, E, bits, topk_idx);
    }
  }
  switch (id_width_for(E)) {
    case 1:
      return decode_v1<uint8_t>(raw, T, L, K, E, ranked, bits, topk_idx);
    case 2:
      return decode_v1<uint16_t>(raw, T, L, K, E, ranked, bits, topk_idx);
    default:
      return decode_v1<uint32_t>(raw, T, L, K, E, ranked, bits, topk_idx);
  }
}

}  // namespace switchyard::detail
