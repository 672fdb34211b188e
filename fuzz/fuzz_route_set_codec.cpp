// Set coding of format versions 4 and 3 (src/routes/route_codec_set.cpp) on its own, below the
// file layer's checksums: (1) a table built from the input round-trips exactly through set coding
// (the version picked by the input); (2) the input's tail, read as a set-coded payload of the
// same dimensions, decodes to in-range ids or an error, never a read outside it (it is copied
// into an exactly sized buffer).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "routes/route_codec.h"

using namespace switchyard::detail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const int64_t Es[] = {1, 2, 3, 8, 64, 128, 300, 4096};
  const int64_t L = 1 + data[0] % 3, K = 1 + data[1] % 16, E = Es[data[2] % 8];
  const bool ranked = data[3] & 1, v4 = (data[3] & 2) == 0;
  data += 4;
  size -= 4;
  // (1) ids from the bytes: value % (E + 1) - 1, so -1 and repeats occur; T from the length.
  const int64_t row = L * K, T = std::min<int64_t>(int64_t(size) / row, 64);
  std::vector<int32_t> v(size_t(T * row));
  for (size_t i = 0; i < v.size(); ++i) v[i] = int32_t(data[i] % (E + 1)) - 1;
  if (T > 0) {
    std::string raw;
    const uint32_t f = v4 ? encode_payload_set4(v.data(), T, L, K, E, ranked, raw)
                          : encode_payload_set(v.data(), T, L, K, E, ranked, raw);
    if (f == kBadIds) std::abort();
    std::unique_ptr<char[]> b(new char[raw.size()]);
    std::memcpy(b.get(), raw.data(), raw.size());
    std::vector<int32_t> out(v.size());
    const std::string err = decode_payload(b.get(), int64_t(raw.size()), T, L, K, E, f, out.data());
    if (!err.empty() || out != v) std::abort();
  }
  // (2) the bytes as a payload for a table of up to 16 tokens.
  const int64_t T2 = 1 + (size % 16);
  const uint32_t flags = (v4 ? kBlockSetRows : kBlockSetDelta) | (ranked ? kBlockRanked : 0u);
  if (!payload_size_ok(T2, L, K, E, flags, int64_t(size))) return 0;
  std::unique_ptr<char[]> b(new char[size]);
  std::memcpy(b.get(), data, size);
  std::vector<int32_t> out(size_t(T2 * row));
  if (decode_payload(b.get(), int64_t(size), T2, L, K, E, flags, out.data()).empty()) {
    for (int32_t id : out) {
      if (id < -1 || id >= E) std::abort();
    }
  }
  return 0;
}
