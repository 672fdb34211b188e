// Fuzz target: the vLLM HTTP response importer (JSON / JSONL, choices[i].routed_experts = base64
// of .npy bytes, routed_experts_prompt_start, usage). Malformed input must raise
// std::invalid_argument; any other exception, crash or UB is a finding. The first byte picks the
// layer map and the default prompt start.
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
  opt.layer_map.first_k_dense = mode & 1;
  opt.prompt_start = (mode >> 1) & 7;
  try {
    switchyard::ImportResult r = switchyard::import_vllm_http_text(
        std::string_view(reinterpret_cast<const char*>(data + 1), size - 1), "fuzz.json", opt);
    for (const auto& t : r.sequences) switchyard::check_route_table(t, "fuzz", "table");
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
