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
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr int64_t kBlockHeaderSize = 56;
inline constexpr int64_t kFooterSize = 24;
inline constexpr int64_t kIndexEntrySize = 24;
inline constexpr uint32_t kBlockHasNone = 1u;  // payload carries a bitmap of -1 entries
inline constexpr uint32_t kBlockRanked = 2u;   // ids stored as per-layer popularity ranks + perm
inline constexpr uint32_t kBlockKnownFlags = kBlockHasNone | kBlockRanked;
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

/// Raw (uncompressed) payload of one block: [ranked: per-layer rank permutation], ids (as per-layer
/// popularity ranks when ranked) in [layers, tokens, K] order, then a bitmap of -1 entries when
/// any. Returns the flags, or kBadIds (checking every id on the way: callers need no pass of
/// their own; check_route_table names the bad one).
uint32_t encode_payload(const int32_t* topk_idx, int64_t num_tokens, int64_t num_layers,
                        int64_t top_k, int64_t num_experts, std::string& out);
/// Raw payload size for a block.
int64_t payload_size(int64_t num_tokens, int64_t num_layers, int64_t top_k, int64_t num_experts,
                     uint32_t flags);
/// Inverse of encode_payload; returns an empty string on success, else what is wrong.
std::string decode_payload(const char* raw, int64_t raw_size, int64_t num_tokens,
                           int64_t num_layers, int64_t top_k, int64_t num_experts, uint32_t flags,
                           int32_t* topk_idx);

}  // namespace switchyard::detail
