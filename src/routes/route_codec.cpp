// Block payload transform of the route file. Ids are rewritten per layer as popularity ranks
// (rank 0 = the layer's most used expert in this block) and laid out layer-major: every layer then
// shows zstd the same skewed distribution, where raw ids mix 48 different permutations of it into a
// near-uniform one. Measured on Zipf-like routes (bench_routes): 4.6x -> 5.3x smaller than int32.
#include "route_codec.h"

#include <xxhash.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "check.h"

namespace switchyard::detail {

uint64_t checksum(const void* data, size_t n) { return XXH3_64bits(data, n); }

int64_t payload_size(int64_t num_tokens, int64_t num_layers, int64_t top_k, int64_t num_experts,
                     uint32_t flags) {
  const int64_t w = id_width_for(num_experts);
  const int64_t numel = num_tokens * num_layers * top_k;
  int64_t n = ((flags & kBlockRanked) ? num_layers * num_experts * w : 0) + numel * w;
  if (flags & kBlockHasNone) n += (numel + 7) / 8;
  return n;
}

namespace {

// Tokens between two counted ones in the rank pass: ranks only need the layer's popular experts
// in order (any permutation decodes, the block stores it), and about 16 ids per expert find them.
int64_t rank_stride(int64_t T, int64_t K, int64_t E) {
  return std::clamp<int64_t>(T * K / (16 * E), 1, 16);
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

// Writes the block's ids (and, when `bits`, the -1 bitmap of the input's flat order) in one pass
// over the input after a sampled counting pass. Every token's ids are range-checked before they
// index anything; returns -1 on an id outside [-1, E) (the caller names it), else whether any
// entry is -1. Counts and ranks are indexed by id + 1 so that -1 needs no branch (slot 0 counts
// the -1 entries and maps to stored value 0). Without `ranked`, ids are stored as they are.
template <class W>
int encode_as(const int32_t* idx, int64_t T, int64_t L, int64_t K, int64_t E, bool ranked,
              char* out, uint8_t* bits) {
  W* perm_out = reinterpret_cast<W*>(out);
  W* ids_out = ranked ? perm_out + L * E : perm_out;
  const int64_t E1 = E + 1, row = L * K;
  std::vector<W> rank(static_cast<size_t>(L * E1), W{0});
  if (ranked) {
    // Pass 1, token-major (the input's order), every stride-th token: per-layer expert counts.
    // uint32: a block holds < 2^32 ids per layer (kMaxRawBlockBytes), and 48 x 129 counters then
    // stay in L1.
    std::vector<uint32_t> count(static_cast<size_t>(L * E1), 0);
    const int64_t stride = rank_stride(T, K, E);
    for (int64_t t = 0; t < T; t += stride) {
      const int32_t* tok = idx + t * row;
      int32_t lo, hi;
      token_range(tok, row, lo, hi);
      if (lo < -1 || hi >= E) return -1;
      for (int64_t l = 0; l < L; ++l) {
        uint32_t* c = count.data() + l * E1 + 1;
        for (int64_t k = 0; k < K; ++k) ++c[tok[l * K + k]];
      }
    }
    // Ranks: most used expert first, ties to the lower id (a total, deterministic order). One
    // 64-bit key per expert (count high, inverted id low) sorts without a merge buffer.
    std::vector<uint64_t> key(static_cast<size_t>(E));
    for (int64_t l = 0; l < L; ++l) {
      const uint32_t* c = count.data() + l * E1 + 1;
      for (int64_t e = 0; e < E; ++e) {
        key[size_t(e)] = (uint64_t(c[e]) << 32) | uint64_t(0xffffffffu - uint32_t(e));
      }
      std::sort(key.begin(), key.end(), std::greater<uint64_t>());
      for (int64_t r = 0; r < E; ++r) {
        const int64_t e = int64_t(0xffffffffu - uint32_t(key[size_t(r)] & 0xffffffffu));
        perm_out[l * E + r] = static_cast<W>(e);
        rank[size_t(l * E1 + 1 + e)] = static_cast<W>(r);
      }
    }
  } else {
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t e = 0; e < E; ++e) rank[size_t(l * E1 + 1 + e)] = static_cast<W>(e);
    }
  }
  // Pass 2, token-major reads, layer-major writes ([layers, tokens, K]); a token whose L*K ids
  // fill whole bytes of the bitmap writes them here too.
  const bool bits_here = bits != nullptr && row % 8 == 0;
  bool any_none = false;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* tok = idx + t * row;
    int32_t lo, hi;
    token_range(tok, row, lo, hi);
    if (lo < -1 || hi >= E) return -1;
    any_none = any_none || lo < 0;
    for (int64_t l = 0; l < L; ++l) {
      const int32_t* src = tok + l * K;
      const W* rk = rank.data() + l * E1 + 1;
      W* dst = ids_out + (l * T + t) * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = rk[src[k]];
    }
    if (bits_here) {
      uint8_t* b = bits + t * (row / 8);
      for (int64_t j = 0; j < row / 8; ++j) {
        unsigned byte = 0;
        for (int i = 0; i < 8; ++i) byte |= unsigned(tok[j * 8 + i] < 0) << i;
        b[j] = static_cast<uint8_t>(byte);
      }
    }
  }
  return any_none ? 1 : 0;
}

template <class W>
std::string decode_as(const char* raw, int64_t T, int64_t L, int64_t K, int64_t E, bool ranked,
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
  if (none_bits) {
    for (int64_t b = 0; b < (numel + 7) / 8; ++b) {
      if (none_bits[b] == 0) continue;
      for (int64_t j = 0; j < 8 && b * 8 + j < numel; ++j) {
        if ((none_bits[b] >> j) & 1) idx[b * 8 + j] = -1;
      }
    }
  }
  return {};
}

}  // namespace

uint32_t encode_payload(const int32_t* topk_idx, int64_t num_tokens, int64_t num_layers,
                        int64_t top_k, int64_t num_experts, std::string& out) {
  const int64_t numel = num_tokens * num_layers * top_k;
  const bool ranked = num_tokens * top_k >= kRankMinIdsPerExpert * num_experts;
  const uint32_t rank_flag = ranked ? kBlockRanked : 0u;
  // Sized for the bitmap too (written while encoding); trimmed below when there is no -1.
  const int64_t full =
      payload_size(num_tokens, num_layers, top_k, num_experts, kBlockHasNone | rank_flag);
  out.resize(static_cast<size_t>(full));
  char* p = out.data();
  auto* bits = reinterpret_cast<uint8_t*>(p + full - (numel + 7) / 8);
  int any_none = 0;
  const int64_t T = num_tokens, L = num_layers, K = top_k, E = num_experts;
  switch (id_width_for(num_experts)) {
    case 1:
      any_none = encode_as<uint8_t>(topk_idx, T, L, K, E, ranked, p, bits);
      break;
    case 2:
      any_none = encode_as<uint16_t>(topk_idx, T, L, K, E, ranked, p, bits);
      break;
    default:
      any_none = encode_as<uint32_t>(topk_idx, T, L, K, E, ranked, p, bits);
      break;
  }
  if (any_none < 0) return kBadIds;
  const uint32_t flags = (any_none ? kBlockHasNone : 0u) | rank_flag;
  const int64_t n = payload_size(num_tokens, num_layers, top_k, num_experts, flags);
  out.resize(static_cast<size_t>(n));
  if (any_none && (num_layers * top_k) % 8 != 0) {  // the bitmap was not written on the way
    const int64_t whole = numel / 8;
    for (int64_t b = 0; b < whole; ++b) {
      const int32_t* v = topk_idx + b * 8;
      unsigned byte = 0;
      for (int j = 0; j < 8; ++j) byte |= unsigned(v[j] < 0) << j;
      bits[b] = static_cast<uint8_t>(byte);
    }
    if (numel % 8) {
      unsigned byte = 0;
      for (int64_t j = 0; j < numel % 8; ++j) byte |= unsigned(topk_idx[whole * 8 + j] < 0) << j;
      bits[whole] = static_cast<uint8_t>(byte);
    }
  }
  return flags;
}

std::string decode_payload(const char* raw, int64_t raw_size, int64_t num_tokens,
                           int64_t num_layers, int64_t top_k, int64_t num_experts, uint32_t flags,
                           int32_t* topk_idx) {
  const int64_t want = payload_size(num_tokens, num_layers, top_k, num_experts, flags);
  if (raw_size != want) return cat("payload is ", raw_size, " bytes, expected ", want);
  const int64_t numel = num_tokens * num_layers * top_k;
  const uint8_t* bits = (flags & kBlockHasNone)
                            ? reinterpret_cast<const uint8_t*>(raw + raw_size - (numel + 7) / 8)
                            : nullptr;
  const bool ranked = (flags & kBlockRanked) != 0;
  const int64_t T = num_tokens, L = num_layers, K = top_k, E = num_experts;
  switch (id_width_for(num_experts)) {
    case 1:
      return decode_as<uint8_t>(raw, T, L, K, E, ranked, bits, topk_idx);
    case 2:
      return decode_as<uint16_t>(raw, T, L, K, E, ranked, bits, topk_idx);
    default:
      return decode_as<uint32_t>(raw, T, L, K, E, ranked, bits, topk_idx);
  }
}

}  // namespace switchyard::detail
