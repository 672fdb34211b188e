// libFuzzer target: the vLLM .npy importer over arbitrary bytes. The first byte picks the import
// options (layer map, zero-row policy, E); the rest is the .npy file. Success or
// std::invalid_argument only; every imported table must be a valid route table.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string_view>

#include "switchyard/route_import.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace switchyard;
  if (size < 1) return 0;
  const uint8_t sel = data[0];
  ImportOptions opt;
  opt.num_experts = (sel & 1) ? 8 : 300;
  if (sel & 2) opt.layer_map.first_k_dense = 1;
  if (sel & 4) opt.layer_map.num_mtp_layers = 1;
  if (sel & 8) opt.layer_map.moe_layer_freq = {0, 1, 1};
  opt.zero_rows = static_cast<ZeroRowPolicy>((sel >> 4) % 3);
  if (sel & 0x40) opt.top_k = 2;
  if (sel & 0x80) opt.num_input_layers = 4;
  const std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    ImportResult r = import_vllm_npy_bytes(bytes, "fuzz.npy", opt);
    for (const RouteTable& t : r.sequences) check_route_table(t, "fuzz_import_vllm", "imported");
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
