// vLLM (.npy) and SGLang (JSON/JSONL + base64) route importers.
#include "switchyard/route_import.h"

#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "check.h"
#include "route_rows.h"
#include "switchyard/error.h"

namespace switchyard {

using detail::cat;
using detail::fail_arg;

namespace {

constexpr const char* kOp = "import";
using detail::kMaxReportedZeroRows;

// One input element type (the .npy descr, or int32 for SGLang).
enum class Elem { i1, u1, i2, u2, i4, u4, i8 };

size_t elem_size(Elem e) {
  switch (e) {
    case Elem::i1:
    case Elem::u1:
      return 1;
    case Elem::i2:
    case Elem::u2:
      return 2;
    case Elem::i4:
    case Elem::u4:
      return 4;
    case Elem::i8:
      return 8;
  }
  return 0;
}

// Appends one sequence given as a [rows, num_input_layers, top_k] array to `result`.
void import_array(const char* data, Elem elem, int64_t rows, int64_t layers_in, int64_t top_k,
                  const std::string& source, const ImportOptions& opt, ImportResult& result) {
  ImportReport& rep = result.report;
  const int64_t seq = static_cast<int64_t>(result.sequences.size());
  if (opt.num_input_layers > 0 && layers_in != opt.num_input_layers) {
    fail_arg(kOp, source, " (sequence ", seq, "): expected ", opt.num_input_layers,
             " layers per token, got ", layers_in);
  }
  if (opt.top_k > 0 && top_k != opt.top_k) {
    fail_arg(kOp, source, " (sequence ", seq, "): expected top_k=", opt.top_k, ", got ", top_k);
  }
  if (top_k < 1 || layers_in < 1 || layers_in > 65536 || top_k > 65536 ||
      layers_in * top_k > (int64_t{1} << 20)) {
    fail_arg(kOp, source, " (sequence ", seq, "): array shape [", rows, ", ", layers_in, ", ",
             top_k,
             "] is not a route array (layers and top_k must be >= 1, their product <= 2^20)");
  }
  if (rep.num_sequences > 0 && (layers_in != rep.num_input_layers || top_k != rep.top_k)) {
    fail_arg(kOp, source, " (sequence ", seq, "): [", layers_in, " layers, top_k ", top_k,
             "] differs from the earlier sequences' [", rep.num_input_layers, ", ", rep.top_k, "]");
  }
  detail::RowPlan plan;
  try {
    plan = detail::make_row_plan(opt, layers_in, top_k);
  } catch (const std::invalid_argument& e) {
    fail_arg(kOp, source, " (sequence ", seq, ", ", layers_in, " layers): ", e.what());
  }
  const std::vector<int64_t>& moe = plan.moe;
  const int64_t M = static_cast<int64_t>(moe.size());
  RouteTable t;  // every row is written below; the last token's row is -1 (no route)
  t.num_experts = opt.num_experts;
  t.topk_idx = Tensor::empty({rows + 1, M, top_k}, DType::int32);
  std::fill_n(t.topk_idx.data<int32_t>() + rows * M * top_k, M * top_k, -1);
  detail::RowFindings f;
  bool ok = false;
  const int64_t row_elems = layers_in * top_k;
  auto run = [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    const T* in = reinterpret_cast<const T*>(data);
    ok = detail::import_rows<T>([&](int64_t r) { return in + r * row_elems; }, rows, plan,
                                t.topk_idx.data<int32_t>(), f);
  };
  switch (elem) {
    case Elem::i1:
      run(static_cast<const int8_t*>(nullptr));
      break;
    case Elem::u1:
      run(static_cast<const uint8_t*>(nullptr));
      break;
    case Elem::i2:
      run(static_cast<const int16_t*>(nullptr));
      break;
    case Elem::u2:
      run(static_cast<const uint16_t*>(nullptr));
      break;
    case Elem::i4:
      run(static_cast<const int32_t*>(nullptr));
      break;
    case Elem::u4:
      run(static_cast<const uint32_t*>(nullptr));
      break;
    case Elem::i8:
      run(static_cast<const int64_t*>(nullptr));
      break;
  }
  if (!ok) fail_arg(kOp, source, " (sequence ", seq, "): ", f.error);
  for (const auto& z : f.first_zero_rows) {
    if (rep.first_zero_rows.size() < kMaxReportedZeroRows)
      rep.first_zero_rows.push_back({seq, z[0], z[1]});
  }
  rep.num_zero_rows += f.num_zero_rows;
  rep.num_invalid_rows += f.num_invalid_rows;
  if (f.dense_nonzero > 0) {
    rep.warnings.push_back(cat(
        source, ": ", f.dense_nonzero, " rows on layers the map calls dense hold ",
        "nonzero ids (first on hidden layer ", f.first_dense_layer, "): is the layer map right?"));
  }
  rep.num_input_layers = layers_in;
  rep.top_k = top_k;
  rep.moe_layers = moe;
  ++rep.num_sequences;
  rep.num_tokens += rows + 1;
  result.sequences.push_back(std::move(t));
  result.sources.push_back(source);
}

void check_options(const ImportOptions& opt) {
  if (opt.num_experts < 1) fail_arg(kOp, "num_experts must be >= 1, got ", opt.num_experts);
  if (opt.num_input_layers < 0)
    fail_arg(kOp, "num_input_layers must be >= 0, got ", opt.num_input_layers);
  if (opt.top_k < 0) fail_arg(kOp, "top_k must be >= 0, got ", opt.top_k);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw BackendError(cat("open(", path, "): ", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw BackendError(cat("read(", path, "): ", std::strerror(errno)));
  return ss.str();
}

// Value of 'key' in a .npy header dict: the raw text up to the next top-level ',' or '}'.
std::string npy_field(const std::string& header, const std::string& key,
                      const std::string& source) {
  const size_t k = header.find("'" + key + "'");
  if (k == std::string::npos) fail_arg(kOp, source, ": .npy header has no '", key, "'");
  size_t p = header.find(':', k);
  if (p == std::string::npos) fail_arg(kOp, source, ": .npy header is malformed near '", key, "'");
  ++p;
  while (p < header.size() && header[p] == ' ') ++p;
  size_t end = p;
  if (p < header.size() && header[p] == '(') {
    end = header.find(')', p);
    if (end == std::string::npos) fail_arg(kOp, source, ": .npy header shape is not closed");
    return header.substr(p, end - p + 1);
  }
  if (p < header.size() && header[p] == '\'') {
    end = header.find('\'', p + 1);
    if (end == std::string::npos) fail_arg(kOp, source, ": .npy header string is not closed");
    return header.substr(p + 1, end - p - 1);
  }
  while (end < header.size() && header[end] != ',' && header[end] != '}') ++end;
  return header.substr(p, end - p);
}

}  // namespace

// ---- start offsets and engine dtypes (vLLM routed_experts_prompt_start, SGLang
// routed_experts_start_len; vLLM >= 0.22 uint8/uint16 ids) ----------------------------------------
namespace {

// Largest start offset accepted: far beyond any context length, small enough that a hostile
// value cannot make the importer allocate without bound.
constexpr int64_t kMaxStart = int64_t{1} << 24;

// Puts `start` rows of -1 before the last sequence of `result`: the tokens before the engine's
// first returned route. The report's token count and zero-row positions move with them.
void prepend_none_rows(ImportResult& result, int64_t start, const std::string& source,
                       const char* field) {
  if (result.sequences.empty()) return;
  const int64_t seq = static_cast<int64_t>(result.sequences.size()) - 1;
  if (start < 0 || start > kMaxStart) {
    fail_arg(kOp, source, " (sequence ", seq, "): ", field, " must be in [0, 2^24], got ", start);
  }
  if (start == 0) return;
  RouteTable& t = result.sequences.back();
  const int64_t T = t.num_tokens(), M = t.num_moe_layers(), K = t.top_k();
  if (static_cast<double>(start + T) * double(M) * double(K) > double(int64_t{1} << 31)) {
    fail_arg(kOp, source, " (sequence ", seq, "): ", field, "=", start, " plus ", T,
             " rows of ", M, "x", K, " ids is more than 2^31 ids");
  }
  RouteTable u = RouteTable::none(start + T, M, K, t.num_experts);
  std::memcpy(u.topk_idx.data<int32_t>() + start * M * K, t.topk_idx.data<int32_t>(),
              static_cast<size_t>(T * M * K) * sizeof(int32_t));
  t = std::move(u);
  result.report.num_tokens += start;
  for (auto& z : result.report.first_zero_rows)
    if (z[0] == seq) z[1] += start;
}

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

// A non-negative integer field of a JSON record (a count), or `fallback` when absent or null.
int64_t json_count(const nlohmann::json& obj, const char* key, int64_t fallback,
                   const std::string& source, const std::string& field) {
  if (!obj.is_object() || !obj.contains(key) || obj[key].is_null()) return fallback;
  const nlohmann::json& v = obj[key];
  if (!v.is_number_integer() || v.get<double>() < 0 || v.get<double>() > double(kMaxStart)) {
    fail_arg(kOp, source, ": ", field, " must be an integer in [0, 2^24], got ", v.dump());
  }
  return v.get<int64_t>();
}

// SGLang: meta_info.routed_experts_start_len (the response covers tokens [start_len, seqlen - 1),
// start_len in [0, prompt_tokens]); -1 rows before it. Returns the start used.
int64_t apply_sglang_start_len(const nlohmann::json& meta, ImportResult& part,
                               const std::string& name, const ImportOptions& opt) {
  const int64_t start = json_count(meta, "routed_experts_start_len", opt.prompt_start, name,
                                   "meta_info.routed_experts_start_len");
  const int64_t prompt = json_count(meta, "prompt_tokens", -1, name, "meta_info.prompt_tokens");
  if (prompt >= 0 && start > prompt) {
    fail_arg(kOp, name, ": meta_info.routed_experts_start_len=", start,
             " is past the prompt (prompt_tokens=", prompt, "); SGLang allows [0, prompt_tokens]");
  }
  prepend_none_rows(part, start, name, "routed_experts_start_len");
  return start;
}

}  // namespace

ImportResult import_vllm_npy_bytes(std::string_view bytes, const std::string& source,
                                   const ImportOptions& options) {
  check_options(options);
  if (bytes.size() < 10 || std::memcmp(bytes.data(), "\x93NUMPY", 6) != 0) {
    fail_arg(kOp, source, ": not a .npy file (bad magic)");
  }
  const int major = static_cast<uint8_t>(bytes[6]);
  size_t hlen = 0, hstart = 0;
  if (major == 1) {
    hlen = static_cast<uint8_t>(bytes[8]) | (size_t(static_cast<uint8_t>(bytes[9])) << 8);
    hstart = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) fail_arg(kOp, source, ": truncated .npy header");
    uint32_t v;
    std::memcpy(&v, bytes.data() + 8, 4);
    hlen = v;
    hstart = 12;
  } else {
    fail_arg(kOp, source, ": unsupported .npy version ", major);
  }
  if (hlen > bytes.size() - hstart) {
    fail_arg(kOp, source, ": truncated .npy header (", hlen, " bytes declared, ",
             bytes.size() - hstart, " present)");
  }
  const std::string header(bytes.substr(hstart, hlen));
  const std::string descr = npy_field(header, "descr", source);
  const std::string fortran = npy_field(header, "fortran_order", source);
  const std::string shape_text = npy_field(header, "shape", source);
  Elem elem;
  if (descr == "<i4" || descr == "=i4")
    elem = Elem::i4;
  else if (descr == "<i8" || descr == "=i8")
    elem = Elem::i8;
  else if (descr == "<i2" || descr == "=i2")
    elem = Elem::i2;
  else if (descr == "<u2" || descr == "=u2")
    elem = Elem::u2;
  else if (descr == "<u4" || descr == "=u4")
    elem = Elem::u4;
  else if (descr == "|i1" || descr == "<i1")
    elem = Elem::i1;
  else if (descr == "|u1" || descr == "<u1")
    elem = Elem::u1;
  else
    fail_arg(kOp, source, ": .npy dtype must be a little-endian integer (e.g. '<i4'), got '", descr,
             "'");
  if (fortran != "False")
    fail_arg(kOp, source, ": .npy must be C-ordered, got fortran_order ", fortran);
  std::vector<int64_t> shape;
  if (shape_text.size() < 2 || shape_text.front() != '(' || shape_text.back() != ')') {
    fail_arg(kOp, source, ": .npy shape must be a tuple, got ", shape_text);
  }
  {
    std::string inner = shape_text.substr(1, shape_text.size() - 2);
    size_t p = 0;
    while (p < inner.size()) {
      while (p < inner.size() && (inner[p] == ' ' || inner[p] == ',')) ++p;
      if (p >= inner.size()) break;
      size_t q = p;
      while (q < inner.size() && inner[q] >= '0' && inner[q] <= '9') ++q;
      if (q == p || q - p > 12) fail_arg(kOp, source, ": .npy shape ", shape_text, " is malformed");
      shape.push_back(std::stoll(inner.substr(p, q - p)));
      p = q;
      while (p < inner.size() && inner[p] == ' ') ++p;
      if (p < inner.size() && inner[p] != ',')
        fail_arg(kOp, source, ": .npy shape ", shape_text, " is malformed");
    }
  }
  if (shape.size() != 3) {
    fail_arg(kOp, source, ": expected a 3-D array [seq_len-1, num_layers, top_k], got shape ",
             shape_text);
  }
  const size_t data_off = hstart + hlen;
  const size_t have = bytes.size() - data_off;
  // Overflow-safe: each dim < 1e12, check the product step by step against the bytes present.
  long double want = static_cast<long double>(shape[0]) * shape[1] * shape[2] * elem_size(elem);
  if (want != static_cast<long double>(have)) {
    fail_arg(kOp, source, ": .npy data is ", have, " bytes, shape ", shape_text, " needs ",
             static_cast<double>(want));
  }
  ImportResult r;
  import_array(bytes.data() + data_off, elem, shape[0], shape[1], shape[2], source, options, r);
  check_vllm_width(elem, source, options, r);
  prepend_none_rows(r, options.prompt_start, source, "prompt_start");
  return r;
}

namespace {

void merge(ImportResult& into, ImportResult&& part, const std::string& source) {
  ImportReport& a = into.report;
  const ImportReport& b = part.report;
  if (a.num_sequences > 0 && b.num_sequences > 0 &&
      (a.num_input_layers != b.num_input_layers || a.top_k != b.top_k)) {
    fail_arg(kOp, source, ": [", b.num_input_layers, " layers, top_k ", b.top_k,
             "] differs from the earlier sequences' [", a.num_input_layers, ", ", a.top_k, "]");
  }
  for (auto z : b.first_zero_rows) {
    if (a.first_zero_rows.size() >= kMaxReportedZeroRows) break;
    z[0] += static_cast<int64_t>(into.sequences.size());
    a.first_zero_rows.push_back(z);
  }
  a.num_zero_rows += b.num_zero_rows;
  a.num_invalid_rows += b.num_invalid_rows;
  a.num_tokens += b.num_tokens;
  a.num_sequences += b.num_sequences;
  if (b.num_sequences > 0) {
    a.num_input_layers = b.num_input_layers;
    a.top_k = b.top_k;
    a.moe_layers = b.moe_layers;
  }
  a.warnings.insert(a.warnings.end(), b.warnings.begin(), b.warnings.end());
  for (auto& t : part.sequences) into.sequences.push_back(std::move(t));
  for (auto& s : part.sources) into.sources.push_back(std::move(s));
}

}  // namespace

ImportResult import_vllm(const std::vector<std::string>& paths, const ImportOptions& options) {
  check_options(options);
  ImportResult all;
  for (const auto& p : paths) merge(all, import_vllm_npy_bytes(read_file(p), p, options), p);
  return all;
}

ImportResult import_vllm_arrays(const std::vector<Tensor>& arrays, const ImportOptions& options) {
  check_options(options);
  auto one = [&](size_t i, ImportResult& r) {
    const Tensor& a = arrays[i];
    const std::string source = cat("arrays[", i, "]");
    if (a.dim() != 3) {
      fail_arg(kOp, source, ": expected a 3-D array [seq_len-1, num_layers, top_k], got ", a.dim(),
               " dimensions");
    }
    Elem elem = Elem::i4;
    switch (a.dtype()) {
      case DType::int32:
        elem = Elem::i4;
        break;
      case DType::int64:
        elem = Elem::i8;
        break;
      case DType::uint8:
        elem = Elem::u1;
        break;
      case DType::int16:
        elem = Elem::i2;
        break;
      case DType::uint16:
        elem = Elem::u2;
        break;
      default:
        fail_arg(kOp, source, ": dtype must be int32, int64, int16, uint16 or uint8, got ",
                 dtype_name(a.dtype()));
    }
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
      for (size_t i = 0; i < n; ++i) merge(r, std::move(parts[i]), cat("arrays[", i, "]"));
      return r;
    }
  }
  ImportResult r;
  for (size_t i = 0; i < n; ++i) one(i, r);
  return r;
}

namespace {

// Records of a JSON document: one object, a JSON array of objects, or JSONL (one per line),
// each named "source", "source[i]" or "source:line".
std::vector<std::pair<std::string, nlohmann::json>> json_records(std::string_view text,
                                                                 const std::string& source) {
  using nlohmann::json;
  std::vector<std::pair<std::string, json>> records;
  json whole = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (!whole.is_discarded()) {
    if (whole.is_array()) {
      for (size_t i = 0; i < whole.size(); ++i)
        records.emplace_back(cat(source, "[", i, "]"), std::move(whole[i]));
    } else {
      records.emplace_back(source, std::move(whole));
    }
    return records;
  }
  size_t pos = 0, line = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    ++line;
    std::string_view l = text.substr(pos, end - pos);
    pos = end + 1;
    if (l.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    json j = json::parse(l.begin(), l.end(), nullptr, false);
    if (j.is_discarded()) fail_arg(kOp, source, ":", line, ": not valid JSON (nor is the whole file)");
    records.emplace_back(cat(source, ":", line), std::move(j));
  }
  return records;
}

}  // namespace

ImportResult import_sglang_text(std::string_view text, const std::string& source,
                                const ImportOptions& options) {
  check_options(options);
  if (options.num_input_layers < 1 || options.top_k < 1) {
    fail_arg(kOp, "SGLang routes are flat: num_input_layers and top_k must be given, got ",
             options.num_input_layers, " and ", options.top_k);
  }
  using nlohmann::json;
  ImportResult all;
  for (auto& [name, j] : json_records(text, source)) {
    if (!j.is_object() || !j.contains("meta_info") || !j["meta_info"].is_object()) {
      fail_arg(kOp, name, ": record has no meta_info object");
    }
    const json& meta = j["meta_info"];
    if (!meta.contains("routed_experts") || !meta["routed_experts"].is_string()) {
      fail_arg(kOp, name, ": meta_info.routed_experts must be a base64 string");
    }
    std::string raw;
    try {
      raw = base64_decode(meta["routed_experts"].get_ref<const std::string&>());
    } catch (const std::invalid_argument& e) {
      fail_arg(kOp, name, ": meta_info.routed_experts: ", e.what());
    }
    const int64_t row = options.num_input_layers * options.top_k;
    if (raw.size() % 4 != 0 || (raw.size() / 4) % size_t(row) != 0) {
      fail_arg(kOp, name, ": routed_experts holds ", raw.size(), " bytes, not a whole number of ",
               "int32 rows of num_input_layers*top_k=", row);
    }
    const int64_t rows = static_cast<int64_t>(raw.size() / 4) / row;
    ImportResult part;
    import_array(raw.data(), Elem::i4, rows, options.num_input_layers, options.top_k, name, options,
                 part);
    const int64_t start = apply_sglang_start_len(meta, part, name, options);
    if (meta.contains("prompt_tokens") && meta.contains("completion_tokens") &&
        meta["prompt_tokens"].is_number_integer() &&
        meta["completion_tokens"].is_number_integer()) {
      // Compared in double: the counts come from outside and may be absurd (no overflow).
      const double len =
          meta["prompt_tokens"].get<double>() + meta["completion_tokens"].get<double>();
      if (len != static_cast<double>(start + rows + 1)) {
        part.report.warnings.push_back(cat(name, ": prompt_tokens + completion_tokens = ", len,
                                           " but routed_experts covers ", start + rows + 1,
                                           " tokens"));
      }
    }
    merge(all, std::move(part), name);
  }
  return all;
}

namespace {

// One importer of in-memory text over files: every file read and imported in order, results merged.
template <class ImportText>
ImportResult import_text_files(const std::vector<std::string>& paths, const ImportOptions& options,
                               ImportText import_text) {
  check_options(options);
  ImportResult all;
  for (const auto& p : paths) merge(all, import_text(read_file(p), p, options), p);
  return all;
}

}  // namespace

ImportResult import_sglang(const std::vector<std::string>& paths, const ImportOptions& options) {
  return import_text_files(paths, options, &import_sglang_text);
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
  check_options(options);
  using nlohmann::json;
  ImportResult all;
  for (auto& [name, j] : json_records(text, source)) {
    if (!j.is_object() || !j.contains("choices") || !j["choices"].is_array() ||
        j["choices"].empty()) {
      fail_arg(kOp, name, ": record has no choices array (a vLLM completion, chat completion or "
               "generate response)");
    }
    // The request's routed_experts_prompt_start, where the caller saved it with the response.
    int64_t start = options.prompt_start;
    if (j.contains("sampling_params"))
      start = json_count(j["sampling_params"], "routed_experts_prompt_start", start, name,
                         "sampling_params.routed_experts_prompt_start");
    start = json_count(j, "routed_experts_prompt_start", start, name,
                       "routed_experts_prompt_start");
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
        fail_arg(kOp, name, ": ", field, " is missing or null (the server needs "
                 "--enable-return-routed-experts; null also means the request was aborted before "
                 "any forward pass)");
      }
      if (!ch["routed_experts"].is_string()) {
        fail_arg(kOp, name, ": ", field, " must be a base64 string of .npy bytes (vLLM >= 0.22), "
                 "got JSON ", ch["routed_experts"].type_name());
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
          part.report.warnings.push_back(cat(where, ": usage.prompt_tokens + completion_tokens = ",
                                             prompt + completion, " but routed_experts with "
                                             "prompt_start ", start, " covers ", covered,
                                             " tokens (is the prompt start right?)"));
        }
      }
      merge(all, std::move(part), where);
    }
  }
  return all;
}

ImportResult import_vllm_http(const std::vector<std::string>& paths, const ImportOptions& options) {
  return import_text_files(paths, options, &import_vllm_http_text);
}

ImportResult import_vllm_files(const std::vector<std::string>& paths,
                               const ImportOptions& options) {
  check_options(options);
  ImportResult all;
  for (const auto& p : paths) {
    const std::string bytes = read_file(p);
    const bool npy = bytes.size() >= 6 && std::memcmp(bytes.data(), "\x93NUMPY", 6) == 0;
    merge(all,
          npy ? import_vllm_npy_bytes(bytes, p, options) : import_vllm_http_text(bytes, p, options),
          p);
  }
  return all;
}

std::string base64_decode(std::string_view text) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  size_t n = text.size();
  size_t pad = 0;
  while (pad < 2 && n > 0 && text[n - 1] == '=') {
    --n;
    ++pad;
  }
  if (pad > 0 && text.size() % 4 != 0) {
    fail_arg("base64", "padded input must have a length divisible by 4, got ", text.size());
  }
  if (n % 4 == 1) fail_arg("base64", "length ", n, " (without padding) cannot be base64");
  std::string out;
  out.reserve(n / 4 * 3 + 2);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < n; ++i) {
    const int v = val(text[i]);
    if (v < 0) {
      fail_arg("base64", "invalid character ",
               (text[i] == '=' ? "'=' before the end"
                               : "code " + std::to_string(static_cast<unsigned char>(text[i]))),
               " at position ", i);
    }
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  if (bits > 0 && (acc & ((1u << bits) - 1)) != 0) {
    fail_arg("base64", "non-zero padding bits at the end (not canonical base64)");
  }
  return out;
}

std::string base64_encode(std::string_view bytes) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = (uint32_t(uint8_t(bytes[i])) << 16) |
                       (uint32_t(uint8_t(bytes[i + 1])) << 8) | uint8_t(bytes[i + 2]);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  if (i + 1 == bytes.size()) {
    const uint32_t v = uint32_t(uint8_t(bytes[i])) << 16;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == bytes.size()) {
    const uint32_t v = (uint32_t(uint8_t(bytes[i])) << 16) | (uint32_t(uint8_t(bytes[i + 1])) << 8);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

std::string encode_npy(std::string_view descr, const std::vector<int64_t>& shape,
                       const void* data, size_t nbytes) {
  std::string header = "{'descr': '" + std::string(descr) + "', 'fortran_order': False, 'shape': (";
  for (size_t d = 0; d < shape.size(); ++d) {
    header += std::to_string(shape[d]) + (shape.size() == 1 || d + 1 < shape.size() ? ", " : "");
  }
  header += "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';  // data starts 64-byte aligned
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  out += header;
  out.append(static_cast<const char*>(data), nbytes);  // x86: already little-endian
  return out;
}

std::string encode_npy_int32(const Tensor& array) {
  detail::check_dtype(array, "encode_npy", "array", {DType::int32});
  std::vector<int64_t> shape;
  for (int64_t d = 0; d < array.dim(); ++d) shape.push_back(array.size(d));
  return encode_npy("<i4", shape, array.raw(), array.nbytes());
}

}  // namespace switchyard
