// Internal: the byte layout of route files (shared by the writer, the reader and the tests).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace switchyard::detail {

inline constexpr char kFileMagic[8] = {'S', 'Y', 'R', 'O', 'U', 'T', 'E', 'S'};
inline constexpr char kFooterMagic[8] = {'S', 'Y', 'R', 'T', 'E', 'N', 'D', '1'};
inline constexpr uint32_t kBlockMagic = 0x4b425953u;  // "SYBK"
inline constexpr uint32_t kIndexMagic = 0x58495953u;  // "SYIX"
// Version 2: token-delta blocks (kBlockTokenDelta). Version 3 adds set-coded blocks
// (kBlockSetDelta; a version 3 file holds either kind). Version 4 adds the two-stream set coding
// (kBlockSetRows, what the writer now uses for set coding). Versions 1 to 3 still read.
inline constexpr uint32_t kFormatVersion = 4;
inline constexpr uint32_t kFormatVersionMin = 1;
inline constexpr int64_t kBlockHeaderSize = 56;
inline constexpr int64_t kFooterSize = 24;
inline constexpr int64_t kIndexEntrySize = 24;
inline constexpr uint32_t kBlockHasNone = 1u;     // payload carries a bitmap of -1 entries
inline constexpr uint32_t kBlockRanked = 2u;      // ids stored as per-layer popularity ranks + perm
inline constexpr uint32_t kBlockTokenDelta = 4u;  // version 2: match bits + literals (see below)
inline constexpr uint32_t kBlockSetDelta = 8u;    // version 3: rANS-coded sets (see below)
inline constexpr uint32_t kBlockSetRows = 16u;    // version 4: two-stream set coding (see below)
/// Whether a block of a file of `version` may carry `flags`: version 1 blocks no delta flag,
/// version 2 blocks kBlockTokenDelta, version 3 blocks exactly one of the two delta flags,
/// version 4 blocks exactly one of the three.
inline bool block_flags_valid(uint32_t version, uint32_t flags) {
  const uint32_t known = kBlockHasNone | kBlockRanked | (version >= 2 ? kBlockTokenDelta : 0u) |
                         (version >= 3 ? kBlockSetDelta : 0u) | (version >= 4 ? kBlockSetRows : 0u);
  if ((flags & ~known) != 0) return false;
  const uint32_t delta = flags & (kBlockTokenDelta | kBlockSetDelta | kBlockSetRows);
  if (version <= 1) return delta == 0;
  return delta == kBlockTokenDelta || delta == kBlockSetDelta || delta == kBlockSetRows;
}
/// Whether a block is set-coded (either version): stored without zstd, decoded in place.
inline bool block_is_set_coded(uint32_t flags) {
  return (flags & (kBlockSetDelta | kBlockSetRows)) != 0;
}
// The rank transform pays for its permutation (num_experts ids per layer) once a layer holds about
// this many ids per expert (bench_routes, short sequences); below it ids are stored as they are.
inline constexpr int64_t kRankMinIdsPerExpert = 8;
// Bounds that keep a corrupt header from asking for absurd allocations.
inline constexpr int64_t kMaxExperts = 1 << 24;
inline constexpr int64_t kMaxTopK = 1 << 16;
inline constexpr int64_t kMaxLayers = 1 << 16;
inline constexpr int64_t kMaxRawBlockBytes = int64_t{1} << 32;
// One sequence decodes to at most this many bytes of int32 ids (4 GiB: a 1M-token sequence of
// 128 MoE layers x K 8); the writer refuses larger tables, so every file it writes is readable.
inline constexpr int64_t kMaxTableBytes = int64_t{1} << 32;
// zstd's format bound: a block decodes to at most 128 KiB (ZSTD_BLOCKSIZE_MAX) and costs at least
// 4 bytes (3-byte header + 1 RLE byte), so a payload of R bytes needs >= 4*ceil(R/128Ki) bytes.
// Checked before allocating, so a tiny crafted block cannot ask for gigabytes.
inline constexpr int64_t kZstdMaxBlock = int64_t{1} << 17;
inline constexpr int64_t kZstdMinBlockBytes = 4;

// Set coding (version 3) covers top_k <= 16 (a mask of two symbols, an order index below 2^45)
// and num_experts <= 4096 (ranks as symbols of 12-bit-precision tables); other tables are
// token-delta blocks in a version 3 file.
inline constexpr int64_t kSetMaxTopK = 16;
inline constexpr int64_t kSetMaxExperts = 4096;
inline constexpr int kSetScaleBits = 12;  // rANS frequency precision (tables sum to 2^12)
// The automatic coding picks set coding for a block whose first 256 tokens repeat the previous
// token's id (same layer and slot) for fewer than this share of ids (see encode_payload).
inline constexpr int64_t kSetMaxMatchPercent = 25;

/// Bytes per stored id for num_experts experts.
inline int64_t id_width_for(int64_t num_experts) {
  return num_experts <= 256 ? 1 : (num_experts <= 65536 ? 2 : 4);
}

/// Little-endian append / read helpers (the machine is little-endian; the format says so).
inline void put_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
inline void put_u64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }
inline uint32_t get_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t get_u64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

/// Checksum of the format (XXH3 64-bit).
uint64_t checksum(const void* data, size_t n);

/// What encode_payload returns for an id outside [-1, num_experts) (never a valid flag set).
inline constexpr uint32_t kBadIds = 0xffffffffu;

/// Raw (uncompressed) payload of one block. Version 1 (flags without kBlockTokenDelta):
/// [ranked: per-layer rank permutation], every id (as its layer's popularity rank when ranked) in
/// [layers, tokens, K] order, then a bitmap of -1 entries when any. Version 2 (kBlockTokenDelta):
/// [ranked: permutation], a match bitmap (bit i, in the table's flat [tokens, layers, K] order:
/// id i equals the id one token earlier in the same layer and slot; zero for the first token),
/// the literals (the ids, as ranks when ranked, of the entries whose bit is 0, in flat order),
/// then the -1 bitmap when any (a -1 entry stores rank 0 and its bit there restores it).
/// The pieces a version 2 encoder compresses as separate zstd frames (their concatenation is the
/// raw payload; an empty literal or -1 piece gets no frame).
struct PayloadPieces {
  bool stored = false;     // version 3 set coding: the whole buffer is stored as is (no zstd)
  int64_t head_size = 0;   // permutation + match bitmap, at offset 0 of the buffer
  int64_t lit_offset = 0;  // literals in the buffer (== head_size)
  int64_t lit_size = 0;
  int64_t none_offset = 0;  // the -1 bitmap in the buffer (not after the literals: see encode)
  int64_t none_size = 0;
};
/// Version 3 set coding (kBlockSetDelta), stored without zstd: it is its own entropy code.
/// Layout: u8 scale bits (12), u32 sizes of the head, rANS and raw streams, then the streams.
/// - head (bits, LSB first): when ranked, the per-layer permutation (rank -> id, L*E values of
///   bit_width(E-1) bits); then the frequency tables in order M0, [M1 when K > 8], and per layer
///   F, G: a bit 1 for an unused (empty) table, else 0 and every symbol's frequency f as the
///   Elias-gamma code of f + 1 (frequencies sum to 2^12); zero padding to a byte.
/// - rANS: two 32-bit final states x0, x1, then 16-bit words; symbol i (in row order) is decoded
///   by state i % 2 (32-bit states in [2^16, 2^32), tables of 2^12), both states end at 2^16.
/// - raw (bits, LSB first): order indices and escaped rows, in row order; zero padding.
/// Per (token, layer) row, in flat order: M0 symbol = the match mask's low 8 bits (bit k: slot k
/// equals the previous token's slot k; 0 for token 0), or 2^min(K,8) (escaped: K raw values
/// id + 1 of bit_width(E) bits), or 2^min(K,8) + 1 (every slot -1). A mask row continues with
/// M1 = mask >> 8 (K > 8); then its m unmatched slots' ranks, distinct and none -1, sorted: the
/// smallest from F[layer], each next as gap - 1 from G[layer]; then for m > 1 the Lehmer index of
/// the slot order (digit j = place of slot j's rank among the unplaced, radix m - j) in
/// ceil(log2(m!)) raw bits. Rows whose unmatched slots hold -1 or repeat a rank are escaped, so
/// every table round-trips exactly, slot order included.
/// Version 4 set coding (kBlockSetRows), stored without zstd. Layout: u8 scale bits (12), u32 C
/// (table clusters, 1..min(L, 32)), u32 sizes of the head, row, set and raw streams, then the
/// streams.
/// - head (bits, LSB first): when ranked, the permutation as version 3; the cluster of each layer
///   (bit_width(C - 1) bits); the row tables M0, [M1 when K > 8], the order groups of m = 2..K;
///   then per cluster F (E symbols) and G (max(E - 1, 1) symbols); each table coded as version 3.
/// - row stream: two 32-bit final states, then 16-bit words (symbol i by state i % 2, as version
///   3). Per (token, layer) row, in flat order: M0 = mask low bits | u << min(K, 8), u = 1 when the
///   unmatched slots are not in rank order; 2 << min(K, 8) escapes the row (raw ids, as version
///   3), that + 1 is a row of -1. M1 = mask >> 8 (K > 8, mask rows). For u = 1, the Lehmer
///   groups of version 3 (nothing for u = 0: the slots are in rank order).
/// - set stream: 2W final states (W = 8 for K <= 8, else 16), then 16-bit words. Row r = t * L +
///   l with m unmatched slots codes its sorted ranks s_0 < ... < s_{m-1}: s_j by state (r & 1) * W
///   + j, s_0 from F[cluster(l)], s_j - s_{j-1} - 1 from G[cluster(l)]; the decoder decodes the
///   lanes in order, each followed by its renormalisation (a word when the state is below 2^15).
///   Every state ends at 2^15.
/// - raw (bits): escaped rows, as version 3.
bool set_coding_fits(int64_t num_layers, int64_t top_k, int64_t num_experts);
/// How encode_payload codes a table: `automatic` picks set coding (version 4) when it fits and
/// the block is large enough to pay for its tables (the kRankMinIdsPerExpert rule), else token
/// delta. `set_delta_v3` writes version 3's set coding (files written before version 4; tests).
enum class PayloadCoding { automatic, token_delta, set_delta, set_delta_v3 };
/// Encodes one table as a version 2 or 3 payload into `out` (scratch, pieces as described by
/// `pieces`). Returns the flags, or kBadIds (checking every id on the way: callers need no pass of
/// their own; check_route_table names the bad one). `set_delta` falls back to token delta where
/// set coding does not fit.
uint32_t encode_payload(const int32_t* topk_idx, int64_t num_tokens, int64_t num_layers,
                        int64_t top_k, int64_t num_experts, std::string& out, PayloadPieces& pieces,
                        PayloadCoding coding = PayloadCoding::automatic);
// The pieces of route_codec.cpp the set coder shares: the rank tables (uint16 ids, E <= 65536;
// rank indexed by id + 1, [L, E + 1]; perm_out gets L*E uint16) and the set coder itself.
bool build_ranks_u16(const int32_t* idx, int64_t T, int64_t L, int64_t K, int64_t E, bool ranked,
                     char* perm_out, std::vector<uint16_t>& rank);
uint32_t encode_payload_set(const int32_t* topk_idx, int64_t T, int64_t L, int64_t K, int64_t E,
                            bool ranked, std::string& out);
std::string decode_payload_set(const char* raw, int64_t raw_size, int64_t T, int64_t L, int64_t K,
                               int64_t E, uint32_t flags, int32_t* topk_idx);
uint32_t encode_payload_set4(const int32_t* topk_idx, int64_t T, int64_t L, int64_t K, int64_t E,
                             bool ranked, std::string& out);
std::string decode_payload_set4(const char* raw, int64_t raw_size, int64_t T, int64_t L,
                                int64_t K, int64_t E, uint32_t flags, int32_t* topk_idx);
/// Whether `raw_size` is a possible payload size for a block of these dimensions and flags
/// (version 2: any literal count in [0, tokens*layers*K]).
bool payload_size_ok(int64_t num_tokens, int64_t num_layers, int64_t top_k, int64_t num_experts,
                     uint32_t flags, int64_t raw_size);
/// Bytes after a payload that decode_payload may read (and ignore): the caller allocates them.
inline constexpr int64_t kPayloadSlack = 8;
/// Inverse of encode_payload (any version); returns an empty string on success, else what is
/// wrong. `raw` must have kPayloadSlack readable bytes after raw_size (set-coded payloads need
/// none: they are decoded from the stored bytes in place).
std::string decode_payload(const char* raw, int64_t raw_size, int64_t num_tokens,
                           int64_t num_layers, int64_t top_k, int64_t num_experts, uint32_t flags,
                           int32_t* topk_idx);

}  // namespace switchyard::detail
