// Fuzz target: the sizes a route file's headers declare (issue 35). The input is a script that
// builds a message with valid checksums everywhere (file header, block headers, payload XXH3,
// index, footer), so mutated sizes reach the decoder's size checks instead of a checksum: each
// block's token count, raw payload size and flags, the zstd frames' declared content sizes and
// their raw / RLE blocks (an RLE block turns 4 bytes into up to 128 KiB), and the index's token
// counts. The message is decoded with a 16 MiB limit and with the default one (64 MiB for these
// sizes); libFuzzer's -malloc_limit_mb (fuzz/fuzz_route_sizes.options) turns any single
// allocation past the cap into a finding. Must end in success (tables within the limit, ids in
// range) or switchyard::DataError.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "routes/route_codec.h"
#include "switchyard/error.h"
#include "switchyard/route_file.h"

namespace {

struct Script {
  const uint8_t* p;
  size_t n;
  uint64_t take(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes && n > 0; ++i, ++p, --n) v |= uint64_t{*p} << (8 * i);
    return v;
  }
  uint8_t u8() { return static_cast<uint8_t>(take(1)); }
};

using switchyard::detail::put_u32;
using switchyard::detail::put_u64;

// One zstd frame: declared content size (may lie), then raw / RLE blocks from the script.
std::string frame(Script& s, int64_t& content) {
  std::string f;
  put_u32(f, 0xFD2FB528u);
  f += static_cast<char>(0xE0);  // 8-byte content size, single segment
  const size_t fcs_at = f.size();
  put_u64(f, 0);
  const int nblocks = 1 + s.u8() % 8;
  content = 0;
  for (int b = 0; b < nblocks; ++b) {
    const uint8_t kind = s.u8();
    const bool rle = kind & 1;
    // Sizes up to 128 KiB (zstd's block maximum) for RLE, small for raw blocks.
    const uint32_t size = rle ? static_cast<uint32_t>(s.take(3) % ((1u << 17) + 1))
                              : static_cast<uint32_t>(s.u8() % 64);
    const uint32_t h = (size << 3) | ((rle ? 1u : 0u) << 1) | (b + 1 == nblocks ? 1u : 0u);
    f.append(reinterpret_cast<const char*>(&h), 3);
    if (rle) {
      f += static_cast<char>(s.u8());
    } else {
      for (uint32_t i = 0; i < size; ++i) f += static_cast<char>(s.u8());
    }
    content += size;
  }
  const uint8_t lie = s.u8();
  const int64_t declared = lie < 224 ? content : content + int64_t(s.take(4)) - (1 << 20);
  const uint64_t fcs = static_cast<uint64_t>(std::max<int64_t>(declared, 0));
  std::memcpy(f.data() + fcs_at, &fcs, 8);
  content = static_cast<int64_t>(fcs);
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Script s{data, size};
  static const int64_t kExperts[] = {1, 8, 200, 256, 300, 70000};
  switchyard::RouteFileInfo info;
  info.num_experts = kExperts[s.u8() % 6];
  info.num_moe_layers = 1 + s.u8() % 4;
  info.top_k = std::min<int64_t>(1 + s.u8() % 8, info.num_experts);
  std::string msg;
  try {
    const switchyard::Tensor empty = switchyard::encode_route_file({}, info);
    uint32_t hsize = 0;
    std::memcpy(&hsize, static_cast<const char*>(empty.raw()) + 12, 4);
    msg.assign(static_cast<const char*>(empty.raw()), hsize);
  } catch (const std::exception&) {
    std::abort();  // the header of valid info must encode
  }
  const int nblocks = s.u8() % 4;
  std::vector<std::array<uint64_t, 3>> index;
  for (int b = 0; b < nblocks; ++b) {
    const uint32_t flags = s.u8() % 8;
    const uint64_t tokens = s.take(4) >> (s.u8() % 32);
    std::string comp;
    int64_t raw = 0;
    const int nframes = 1 + s.u8() % 3;
    for (int f = 0; f < nframes; ++f) {
      int64_t c = 0;
      comp += frame(s, c);
      raw += c;
    }
    const uint8_t raw_lie = s.u8();
    const uint64_t raw_size = raw_lie < 224 ? static_cast<uint64_t>(raw) : s.take(8);
    const size_t at = msg.size();
    put_u32(msg, switchyard::detail::kBlockMagic);
    put_u32(msg, flags);
    put_u64(msg, static_cast<uint64_t>(b));
    put_u64(msg, tokens);
    put_u64(msg, raw_size);
    put_u64(msg, comp.size());
    put_u64(msg, switchyard::detail::checksum(comp.data(), comp.size()));
    put_u64(msg, switchyard::detail::checksum(msg.data() + at, 48));
    msg += comp;
    const uint8_t ix_lie = s.u8();
    index.push_back({at, ix_lie < 240 ? tokens : s.take(8), 56 + comp.size()});
  }
  const uint64_t ix_at = msg.size();
  std::string ix;
  put_u32(ix, switchyard::detail::kIndexMagic);
  put_u32(ix, 0);
  put_u64(ix, index.size());
  for (const auto& e : index) {
    put_u64(ix, e[0]);
    put_u64(ix, e[1]);
    put_u64(ix, e[2]);
  }
  put_u64(ix, switchyard::detail::checksum(ix.data(), ix.size()));
  put_u64(ix, ix_at);
  put_u64(ix, switchyard::detail::checksum(ix.data() + ix.size() - 8, 8));
  ix.append(switchyard::detail::kFooterMagic, 8);
  msg += ix;

  for (const int64_t limit : {int64_t{16} << 20, int64_t{0}}) {
    try {
      switchyard::RouteFileInfo got;
      const auto tables =
          switchyard::decode_route_file(msg, &got, switchyard::RouteDecodeOptions{limit});
      const int64_t cap = switchyard::decode_limit({limit}, int64_t(msg.size()), "fuzz");
      int64_t bytes = 0;
      for (const auto& t : tables) {
        bytes += t.topk_idx.nbytes();
        switchyard::check_route_table(t, "fuzz", "table");
      }
      if (bytes > cap) std::abort();  // decoded past the limit
    } catch (const switchyard::DataError&) {
    }
  }
  return 0;
}
