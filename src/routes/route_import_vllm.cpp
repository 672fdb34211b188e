// vLLM: .npy arrays (files, bytes, memory) and HTTP responses (base64 .npy), told apart by content.
#include <omp.h>

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

// vLLM >= 0.22 stores ids as uint8 when the model has <= 256 experts, else uint16: another
// unsigned width means --num-experts is not the model's expert count.
void check_vllm_width(Elem elem, const std::string& source, const ImportOptions& opt,
                      ImportResult& result) {
  const int64_t E = opt.num_experts;
  if (elem == Elem::u1 && E > 256) {
    result.report.warnings.push_back(
        cat(source, ": uint8 ids but num_experts=", E,
            "; vLLM writes uint8 only for <= 256 experts: is num_experts right?"));
  } else if (elem == Elem::u2 && E <= 256) {
    result.report.warnings.push_back(
        cat(source, ": uint16 ids but num_experts=", E,
            "; vLLM writes uint16 only for > 256 experts: is num_experts right?"));
  }
}

}  // namespace

ImportResult import_vllm_npy_bytes(std::string_view bytes, const std::string& source,
                                   const ImportOptions& options) {
  check_import_options(options);
  const Npy3 a = parse_npy3(bytes, source);
  const Elem elem = a.elem;
  ImportResult r;
  import_array(a.data, elem, a.shape[0], a.shape[1], a.shape[2], source, options, r);
  check_vllm_width(elem, source, options, r);
  prepend_none_rows(r, options.prompt_start, source, "prompt_start");
  return r;
}

ImportResult import_vllm(const std::vector<std::string>& paths, const ImportOptions& options) {
  check_import_options(options);
  ImportResult all;
  for (const auto& p : paths)
    merge_import(all, import_vllm_npy_bytes(read_import_file(p), p, options), p);
  return all;
}

ImportResult import_vllm_arrays(const std::vector<Tensor>& arrays, const ImportOptions& options) {
  check_import_options(options);
  auto one = [&](size_t i, ImportResult& r) {
    const Tensor& a = arrays[i];
    const std::string source = cat("arrays[", i, "]");
    if (a.dim() != 3) {
      fail_arg(kOp, source, ": expected a 3-D array [seq_len-1, num_layers, top_k], got ", a.dim(),
               " dimensions");
    }
    const Elem elem = tensor_elem(a, source);
    import_array(static_cast<const char*>(a.raw()), elem, a.size(0), a.size(1), a.size(2), source,
                 options, r);
    prepend_none_rows(r, options.prompt_start, source, "prompt_start");
  };
  // Sequences are independent: import them on the engine's threads and merge in order. Any error
  // (or sequences that disagree in shape) reruns the import in order, so the error raised is the
  // first one with its sequence index, exactly as the sequential import names it.
  const size_t n = arrays.size();
  int64_t bytes = 0;
  for (const Tensor& a : arrays) bytes += static_cast<int64_t>(a.nbytes());
  if (n > 1 && bytes >= (int64_t{1} << 20) && omp_get_max_threads() > 1) {
    std::vector<ImportResult> parts(n);
    std::vector<char> failed(n, 0);
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t i = 0; i < n; ++i) {
      try {
        one(i, parts[i]);
      } catch (...) {
        failed[i] = 1;
      }
    }
    bool ok = std::find(failed.begin(), failed.end(), 1) == failed.end();
    for (size_t i = 1; ok && i < n; ++i) {
      ok = parts[i].report.num_input_layers == parts[0].report.num_input_layers &&
           parts[i].report.top_k == parts[0].report.top_k;
    }
    if (ok) {
      ImportResult r;
      for (size_t i = 0; i < n; ++i) merge_import(r, std::move(parts[i]), cat("arrays[", i, "]"));
      return r;
    }
  }
  ImportResult r;
  for (size_t i = 0; i < n; ++i) one(i, r);
  return r;
}

// ---- vLLM HTTP responses (>= 0.22: choices[i].routed_experts, base64 of .npy bytes) -------------

ImportResult import_vllm_npy_base64(std::string_view text, const std::string& source,
                                    const ImportOptions& options) {
  std::string raw;
  try {
    raw = base64_decode(text);
  } catch (const std::invalid_argument& e) {
    fail_arg(kOp, source, ": ", e.what());
  }
  return import_vllm_npy_bytes(raw, source, options);
}

ImportResult import_vllm_http_text(std::string_view text, const std::string& source,
                                   const ImportOptions& options) {
  check_import_options(options);
  using nlohmann::json;
  ImportResult all;
  for (auto& [name, j] : json_records(text, source)) {
    if (!j.is_object() || !j.contains("choices") || !j["choices"].is_array() ||
        j["choices"].empty()) {
      fail_arg(kOp, name,
               ": record has no choices array (a vLLM completion, chat completion or "
               "generate response)");
    }
    // The request's routed_experts_prompt_start, where the caller saved it with the response.
    int64_t start = options.prompt_start;
    if (j.contains("sampling_params"))
      start = json_count(j["sampling_params"], "routed_experts_prompt_start", start, name,
                         "sampling_params.routed_experts_prompt_start");
    start =
        json_count(j, "routed_experts_prompt_start", start, name, "routed_experts_prompt_start");
    const json& usage = j.contains("usage") ? j["usage"] : json();
    const int64_t prompt = json_count(usage, "prompt_tokens", -1, name, "usage.prompt_tokens");
    if (prompt >= 0 && start > 0 && start >= prompt) {
      fail_arg(kOp, name, ": routed_experts_prompt_start=", start,
               " is not inside the prompt (usage.prompt_tokens=", prompt,
               "); vLLM requires it to be smaller than the prompt length");
    }
    const json& choices = j["choices"];
    for (size_t c = 0; c < choices.size(); ++c) {
      const std::string field = cat("choices[", c, "].routed_experts");
      const std::string where = cat(name, " ", field);
      const json& ch = choices[c];
      if (!ch.is_object() || !ch.contains("routed_experts") || ch["routed_experts"].is_null()) {
        fail_arg(kOp, name, ": ", field,
                 " is missing or null (the server needs "
                 "--enable-return-routed-experts; null also means the request was aborted before "
                 "any forward pass)");
      }
      if (!ch["routed_experts"].is_string()) {
        fail_arg(kOp, name, ": ", field,
                 " must be a base64 string of .npy bytes (vLLM >= 0.22), "
                 "got JSON ",
                 ch["routed_experts"].type_name());
      }
      ImportOptions o = options;
      o.prompt_start = start;
      ImportResult part =
          import_vllm_npy_base64(ch["routed_experts"].get_ref<const std::string&>(), where, o);
      if (choices.size() == 1 && prompt >= 0) {
        const int64_t completion =
            json_count(usage, "completion_tokens", -1, name, "usage.completion_tokens");
        const int64_t covered = part.report.num_tokens;
        if (completion >= 0 && prompt + completion != covered) {
          part.report.warnings.push_back(
              cat(where, ": usage.prompt_tokens + completion_tokens = ", prompt + completion,
                  " but routed_experts with "
                  "prompt_start ",
                  start, " covers ", covered, " tokens (is the prompt start right?)"));
        }
      }
      merge_import(all, std::move(part), where);
    }
  }
  return all;
}

ImportResult import_vllm_files(const std::vector<std::string>& paths,
                               const ImportOptions& options) {
  check_import_options(options);
  ImportResult all;
  for (const auto& p : paths) {
    const std::string bytes = read_import_file(p);
    const bool npy = bytes.size() >= 6 && std::memcmp(bytes.data(), "\x93NUMPY", 6) == 0;
    const size_t first = bytes.find_first_not_of(" \t\r\n");
    const bool sse = !npy && first != std::string::npos && bytes.compare(first, 5, "data:") == 0;
    merge_import(all,
                 npy   ? import_vllm_npy_bytes(bytes, p, options)
                 : sse ? import_vllm_stream_text(bytes, p, options)
                       : import_vllm_http_text(bytes, p, options),
                 p);
  }
  return all;
}

}  // namespace switchyard
