// Fuzz target: the SGLang JSON/JSONL importer (and its base64 decoder). Malformed input must raise
// std::invalid_argument; any other exception, crash or UB is a finding.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string_view>

#include "switchyard/route_import.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  switchyard::ImportOptions opt;
  opt.num_experts = 16;
  opt.num_input_layers = 3;
  opt.top_k = 2;
  opt.layer_map.first_k_dense = 1;
  try {
    switchyard::ImportResult r = switchyard::import_sglang_text(
        std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.jsonl", opt);
    for (const auto& t : r.sequences) switchyard::check_route_table(t, "fuzz", "table");
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
