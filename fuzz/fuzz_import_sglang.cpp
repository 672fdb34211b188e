// libFuzzer target: the SGLang JSON/JSONL importer and strict base64 over arbitrary text. The first
// byte picks the import options; the rest is the response text. Success or std::invalid_argument
// only; every imported table must be a valid route table, and base64 must round-trip.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "switchyard/route_import.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace switchyard;
  if (size < 1) return 0;
  const uint8_t sel = data[0];
  ImportOptions opt;
  opt.num_experts = (sel & 1) ? 8 : 64;
  opt.num_input_layers = 1 + (sel >> 1) % 4;
  opt.top_k = 1 + (sel >> 3) % 3;
  if (sel & 0x20) opt.layer_map.first_k_dense = 1;
  opt.zero_rows = static_cast<ZeroRowPolicy>((sel >> 6) % 3);
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    ImportResult r = import_sglang_text(text, "fuzz.jsonl", opt);
    for (const RouteTable& t : r.sequences) check_route_table(t, "fuzz_import_sglang", "imported");
  } catch (const std::invalid_argument&) {
  }
  try {
    const std::string decoded = base64_decode(text);
    if (base64_decode(base64_encode(decoded)) != decoded) __builtin_trap();
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
