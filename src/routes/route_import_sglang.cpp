// SGLang: JSON / JSONL responses with base64 int32 routes (meta_info, or OpenAI-compatible
// choices).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "route_import_core.h"
#include "switchyard/error.h"

namespace switchyard {

using detail::cat;
using detail::fail_arg;
using namespace detail;  // the importers' shared room (route_import_core.h)

namespace {
constexpr const char* kOp = kImportOp;
}  // namespace

namespace {

// One SGLang route payload: base64 of little-endian int32 [rows, num_input_layers, top_k] (flat),
// covering tokens [start, seq_len - 1). `field` names it in errors.
ImportResult import_sglang_payload(const nlohmann::json& value, const std::string& name,
                                   const std::string& field, const char* start_field, int64_t start,
                                   int64_t prompt, int64_t completion,
                                   const ImportOptions& options) {
  if (!value.is_string()) fail_arg(kOp, name, ": ", field, " must be a base64 string");
  std::string raw;
  try {
    raw = base64_decode(value.get_ref<const std::string&>());
  } catch (const std::invalid_argument& e) {
    fail_arg(kOp, name, ": ", field, ": ", e.what());
  }
  const int64_t row = options.num_input_layers * options.top_k;
  // The id width on the wire: int32 today, uint8 / uint16 as proposed in sgl-project/sglang#31219
  // (options.routed_experts_dtype; check_import_options admits only these three).
  const DType dt = options.routed_experts_dtype;
  const Elem elem = dt == DType::uint8 ? Elem::u1 : dt == DType::uint16 ? Elem::u2 : Elem::i4;
  const size_t es = elem_size(elem);
  if (raw.size() % es != 0 || (raw.size() / es) % size_t(row) != 0) {
    fail_arg(kOp, name, ": routed_experts holds ", raw.size(), " bytes, not a whole number of ",
             dtype_name(dt), " rows of num_input_layers*top_k=", row,
             " (routed_experts_dtype=", dtype_name(dt), ")");
  }
  if (prompt >= 0 && start > prompt) {
    fail_arg(kOp, name, ": ", start_field, "=", start,
             " is past the prompt (prompt_tokens=", prompt, "); SGLang allows [0, prompt_tokens]");
  }
  const int64_t rows = static_cast<int64_t>(raw.size() / es) / row;
  ImportResult part;
  import_array(raw.data(), elem, rows, options.num_input_layers, options.top_k, name, options,
               part);
  prepend_none_rows(part, start, name, "routed_experts_start_len");
  if (prompt >= 0 && completion >= 0 && prompt + completion != start + rows + 1) {
    part.report.warnings.push_back(
        cat(name, ": prompt_tokens + completion_tokens = ", prompt + completion,
            " but routed_experts covers ", start + rows + 1, " tokens"));
  }
  return part;
}

}  // namespace

ImportResult import_sglang_text(std::string_view text, const std::string& source,
                                const ImportOptions& options) {
  check_import_options(options);
  if (options.num_input_layers < 1 || options.top_k < 1) {
    fail_arg(kOp, "SGLang routes are flat: num_input_layers and top_k must be given, got ",
             options.num_input_layers, " and ", options.top_k);
  }
  using nlohmann::json;
  ImportResult all;
  for (auto& [name, j] : json_records(text, source)) {
    if (j.is_object() && !j.contains("meta_info") && j.contains("choices")) {
      // OpenAI-compatible /v1/completions and /v1/chat/completions (sgl-project/sglang#17434):
      // choices[i].sgl_ext.routed_experts (older servers: choices[i].routed_experts), the same
      // base64 int32 payload. The request's routed_experts_start_len is not echoed: a
      // routed_experts_start_len saved next to the response, else options.prompt_start.
      const json& choices = j["choices"];
      if (!choices.is_array() || choices.empty())
        fail_arg(kOp, name, ": choices must be a non-empty array");
      const int64_t start = json_count(j, "routed_experts_start_len", options.prompt_start, name,
                                       "routed_experts_start_len");
      const json& usage = j.contains("usage") ? j["usage"] : json();
      const int64_t prompt = loose_count(usage, "prompt_tokens");
      for (size_t c = 0; c < choices.size(); ++c) {
        const json& ch = choices[c];
        const json* re = nullptr;
        std::string field;
        if (ch.is_object() && ch.contains("sgl_ext") && ch["sgl_ext"].is_object() &&
            ch["sgl_ext"].contains("routed_experts") &&
            !ch["sgl_ext"]["routed_experts"].is_null()) {
          re = &ch["sgl_ext"]["routed_experts"];
          field = cat("choices[", c, "].sgl_ext.routed_experts");
        } else if (ch.is_object() && ch.contains("routed_experts") &&
                   !ch["routed_experts"].is_null()) {
          re = &ch["routed_experts"];
          field = cat("choices[", c, "].routed_experts");
        } else {
          fail_arg(kOp, name, ": choices[", c,
                   "] has no sgl_ext.routed_experts (the request needs "
                   "return_routed_experts and the server --enable-return-routed-experts)");
        }
        const std::string where = cat(name, " ", field);
        // usage counts every choice's completion: compared only for a single choice.
        const int64_t completion =
            choices.size() == 1 ? loose_count(usage, "completion_tokens") : int64_t{-1};
        merge_import(all,
                     import_sglang_payload(*re, where, field, "routed_experts_start_len", start,
                                           prompt, completion, options),
                     where);
      }
      continue;
    }
    if (!j.is_object() || !j.contains("meta_info") || !j["meta_info"].is_object()) {
      fail_arg(kOp, name, ": record has no meta_info object (nor choices[i].sgl_ext)");
    }
    const json& meta = j["meta_info"];
    if (!meta.contains("routed_experts") || !meta["routed_experts"].is_string()) {
      fail_arg(kOp, name, ": meta_info.routed_experts must be a base64 string");
    }
    // meta_info.routed_experts_start_len: the response covers tokens [start_len, seqlen - 1).
    const int64_t start = json_count(meta, "routed_experts_start_len", options.prompt_start, name,
                                     "meta_info.routed_experts_start_len");
    const int64_t prompt = json_count(meta, "prompt_tokens", -1, name, "meta_info.prompt_tokens");
    merge_import(all,
                 import_sglang_payload(meta["routed_experts"], name, "meta_info.routed_experts",
                                       "meta_info.routed_experts_start_len", start, prompt,
                                       loose_count(meta, "completion_tokens"), options),
                 name);
  }
  return all;
}

ImportResult import_sglang(const std::vector<std::string>& paths, const ImportOptions& options) {
  return import_text_files(paths, options, &import_sglang_text);
}

}  // namespace switchyard
