// Crafted route file messages for the decode-limit tests: valid, checksummed version 2 files
// written here from the format's spec (include/switchyard/route_file.h, src/routes/route_codec.h)
// whose blocks decode to far more than they store. Every later token matches the one before, so
// the payload is one match bit per id, and the match bits are zstd RLE blocks (4 bytes for each
// 128 KiB of payload): 460 bytes declare an 8M-token table of 256 MiB.
#pragma once

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "switchyard/route_file.h"

namespace switchyard::testing {

inline void bomb_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
inline void bomb_u64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }
inline uint64_t bomb_xxh3(const std::string& s, size_t from = 0, size_t n = std::string::npos) {
  n = std::min(n, s.size() - from);
  return XXH3_64bits(s.data() + from, n);
}

/// The ids every block of bomb_message decodes to: token 0 holds layer l's ids
/// l*K .. l*K+K-1 (E = 8: L * K must be 8), and every token repeats token 0.
constexpr int64_t kBombLayers = 2, kBombTopK = 4, kBombExperts = 8;

/// A complete message (header, `blocks` blocks of `tokens` tokens each, index, footer) with valid
/// checksums everywhere. Decodes, where the limit allows, to tables whose every token is token 0.
inline std::string bomb_message(int64_t tokens, int blocks = 1) {
  const int64_t L = kBombLayers, K = kBombTopK, numel = tokens * L * K;
  // The header, as the encoder writes it (no layer map).
  RouteFileInfo info;
  info.num_experts = kBombExperts;
  info.top_k = K;
  info.num_moe_layers = L;
  const Tensor empty = encode_route_file({}, info);
  uint32_t header_size = 0;
  std::memcpy(&header_size, static_cast<const char*>(empty.raw()) + 12, 4);
  std::string out(static_cast<const char*>(empty.raw()), header_size);
  // The payload: match bitmap (token 0's 8 bits 0, the rest 1) then token 0's 8 literals, as one
  // zstd frame declaring its content size: a raw block, RLE blocks of 0xff, a raw block.
  const int64_t bitmap = numel / 8, raw_size = bitmap + L * K;
  std::string frame;
  bomb_u32(frame, 0xFD2FB528u);
  frame += static_cast<char>(0xE0);  // 8-byte content size, single segment, no checksum
  bomb_u64(frame, static_cast<uint64_t>(raw_size));
  const auto block = [&](uint32_t type, uint32_t size, bool last) {
    const uint32_t h = (size << 3) | (type << 1) | (last ? 1u : 0u);
    frame.append(reinterpret_cast<const char*>(&h), 3);
  };
  block(0, 1, false);
  frame += '\0';
  for (int64_t left = bitmap - 1; left > 0;) {
    const int64_t n = std::min<int64_t>(left, int64_t{1} << 17);
    block(1, static_cast<uint32_t>(n), false);
    frame += static_cast<char>(0xff);
    left -= n;
  }
  block(0, static_cast<uint32_t>(L * K), true);
  for (int64_t i = 0; i < L * K; ++i) frame += static_cast<char>(i);
  std::vector<int64_t> offsets;
  for (int b = 0; b < blocks; ++b) {
    offsets.push_back(static_cast<int64_t>(out.size()));
    const size_t at = out.size();
    bomb_u32(out, 0x4b425953u);  // "SYBK"
    bomb_u32(out, 4u);           // token delta, unranked, no -1
    bomb_u64(out, static_cast<uint64_t>(b));
    bomb_u64(out, static_cast<uint64_t>(tokens));
    bomb_u64(out, static_cast<uint64_t>(raw_size));
    bomb_u64(out, frame.size());
    bomb_u64(out, bomb_xxh3(frame));
    bomb_u64(out, bomb_xxh3(out, at, 48));
    out += frame;
  }
  const int64_t index_at = static_cast<int64_t>(out.size());
  std::string ix;
  bomb_u32(ix, 0x58495953u);  // "SYIX"
  bomb_u32(ix, 0);
  bomb_u64(ix, static_cast<uint64_t>(blocks));
  for (int b = 0; b < blocks; ++b) {
    bomb_u64(ix, static_cast<uint64_t>(offsets[size_t(b)]));
    bomb_u64(ix, static_cast<uint64_t>(tokens));
    bomb_u64(ix, 56 + frame.size());
  }
  bomb_u64(ix, bomb_xxh3(ix));
  std::string end;
  bomb_u64(end, static_cast<uint64_t>(index_at));
  ix += end;
  bomb_u64(ix, bomb_xxh3(end));
  ix.append("SYRTEND1", 8);
  return out + ix;
}

}  // namespace switchyard::testing
