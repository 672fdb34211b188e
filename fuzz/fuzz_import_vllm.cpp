// Fuzz target: the vLLM .npy importer. Malformed input must raise std::invalid_argument; any other
// exception, crash or UB is a finding. The first byte picks the layer map.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string_view>

#include "switchyard/route_import.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  switchyard::ImportOptions opt;
  opt.num_experts = 16;
  const uint8_t mode = data[0];
  opt.layer_map.first_k_dense = mode & 3;
  opt.layer_map.num_mtp_layers = (mode >> 2) & 1;
  if (mode & 8) opt.layer_map.moe_layer_freq = {0, 1, 1, 1};
  opt.zero_rows = static_cast<switchyard::ZeroRowPolicy>((mode >> 4) % 3);
  if (mode & 64) opt.prompt_start = 3;  // vLLM's routed_experts_prompt_start: -1 rows first
  try {
    switchyard::ImportResult r = switchyard::import_vllm_npy_bytes(
        std::string_view(reinterpret_cast<const char*>(data + 1), size - 1), "fuzz.npy", opt);
    for (const auto& t : r.sequences) switchyard::check_route_table(t, "fuzz", "table");
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
