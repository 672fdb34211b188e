// Importers: vLLM .npy arrays (written here by a small .npy writer) and SGLang JSON/JSONL with
// base64 routes; layer maps (first-k-dense, frequency list, MTP excluded); errors and zero rows.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "switchyard/error.h"
#include "switchyard/route_import.h"
#include "testing.h"

namespace switchyard {
namespace {

// A .npy (version 1.0) of a C-ordered int array.
template <class T>
std::string npy(const std::vector<T>& v, const std::vector<int64_t>& shape,
                const std::string& descr) {
  std::string h = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i)
    h += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? ", " : "");
  h += "), }";
  while ((10 + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += static_cast<char>(h.size() & 0xff);
  out += static_cast<char>(h.size() >> 8);
  out += h;
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  return out;
}

// Engine-side array [rows, layers, K]: value at (r, l, k) = dense ? 0 : f(r, l, k).
std::vector<int32_t> engine_routes(int64_t rows, int64_t layers, int64_t K, int64_t E,
                                   const std::vector<bool>& moe) {
  std::vector<int32_t> v(size_t(rows * layers * K));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t k = 0; k < K; ++k)
        v[size_t((r * layers + l) * K + k)] = moe[size_t(l)] ? int32_t((r * 7 + l * 3 + k) % E) : 0;
  return v;
}

// Reference: expected table from the engine array and the MoE layer list.
RouteTable expected(const std::vector<int32_t>& v, int64_t rows, int64_t layers, int64_t K,
                    int64_t E, const std::vector<int64_t>& moe_layers) {
  RouteTable t = RouteTable::none(rows + 1, int64_t(moe_layers.size()), K, E);
  int32_t* p = t.topk_idx.data<int32_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (size_t m = 0; m < moe_layers.size(); ++m)
      for (int64_t k = 0; k < K; ++k)
        p[(r * int64_t(moe_layers.size()) + int64_t(m)) * K + k] =
            v[size_t((r * layers + moe_layers[m]) * K + k)];
  return t;
}

TEST(RouteImport, LayerMaps) {
  EXPECT_EQ(moe_layer_indices(LayerMap{}, 3), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(moe_layer_indices(LayerMap{2, {}, 0}, 5), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(moe_layer_indices(LayerMap{1, {}, 1}, 5), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(moe_layer_indices(LayerMap{0, {0, 1, 0, 1}, 1}, 5), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(parse_moe_layer_freq("3x0,2x1,0,1"), (std::vector<int64_t>{0, 0, 0, 1, 1, 0, 1}));
  SY_EXPECT_THROW_MSG(parse_moe_layer_freq("1,2"), std::invalid_argument,
                      "[layer_map] moe_layer_freq item must be");
  SY_EXPECT_THROW_MSG(parse_moe_layer_freq("ax1"), std::invalid_argument, "got \"ax1\"");
  SY_EXPECT_THROW_MSG(moe_layer_indices(LayerMap{0, {1, 1}, 0}, 3), std::invalid_argument,
                      "moe_layer_freq must have one entry per hidden layer (3 = 3 input layers - 0 "
                      "MTP layers), got 2");
  SY_EXPECT_THROW_MSG(moe_layer_indices(LayerMap{3, {}, 0}, 3), std::invalid_argument,
                      "first_k_dense must be < the 3 hidden layers, got 3");
  SY_EXPECT_THROW_MSG(moe_layer_indices(LayerMap{0, {0, 0}, 0}, 2), std::invalid_argument,
                      "marks no MoE layer");
}

TEST(RouteImport, VllmFirstKDenseWithMtp) {
  // 6 layers: 2 dense, 3 MoE, 1 MTP (whose routes are left out).
  const int64_t rows = 9, layers = 6, K = 4, E = 16;
  const std::vector<bool> moe{false, false, true, true, true, true};
  const auto v = engine_routes(rows, layers, K, E, moe);
  ImportOptions opt;
  opt.num_experts = E;
  opt.layer_map = LayerMap{2, {}, 1};
  ImportResult r = import_vllm_npy_bytes(npy(v, {rows, layers, K}, "<i4"), "seq0.npy", opt);
  ASSERT_EQ(r.sequences.size(), 1u);
  EXPECT_EQ(r.report.moe_layers, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(r.report.num_tokens, rows + 1);
  EXPECT_TRUE(route_tables_equal(r.sequences[0], expected(v, rows, layers, K, E, {2, 3, 4})));
  // The last token has no route.
  const int32_t* p = r.sequences[0].topk_idx.data<int32_t>();
  for (int64_t i = rows * 3 * K; i < (rows + 1) * 3 * K; ++i) EXPECT_EQ(p[i], -1);
  EXPECT_TRUE(r.report.warnings.empty());
  // int64 arrays give the same table.
  std::vector<int64_t> v64(v.begin(), v.end());
  ImportResult r64 = import_vllm_npy_bytes(npy(v64, {rows, layers, K}, "<i8"), "seq0.npy", opt);
  EXPECT_TRUE(route_tables_equal(r64.sequences[0], r.sequences[0]));
  // .npy bytes at any offset of the caller's buffer (an HTTP body, a file slice): the int64 data
  // is then misaligned and must be read as bytes (UBSan found a typed load here), same table.
  for (size_t shift = 1; shift < 8; ++shift) {
    const std::string bytes = std::string(shift, ' ') + npy(v64, {rows, layers, K}, "<i8");
    ImportResult moved = import_vllm_npy_bytes(std::string_view(bytes).substr(shift), "seq0.npy",
                                               opt);
    EXPECT_TRUE(route_tables_equal(moved.sequences[0], r.sequences[0])) << "shift " << shift;
  }
  // A wrong map (every layer MoE) sees the dense zeros as zero rows.
  opt.layer_map = LayerMap{};
  ImportResult wrong = import_vllm_npy_bytes(npy(v, {rows, layers, K}, "<i4"), "seq0.npy", opt);
  EXPECT_EQ(wrong.report.num_zero_rows, 2 * rows);
  ASSERT_FALSE(wrong.report.first_zero_rows.empty());
  EXPECT_EQ(wrong.report.first_zero_rows[0], (std::array<int64_t, 3>{0, 0, 0}));
  // A map that calls MoE layers dense warns.
  opt.layer_map = LayerMap{3, {}, 1};
  ImportResult shifted = import_vllm_npy_bytes(npy(v, {rows, layers, K}, "<i4"), "seq0.npy", opt);
  ASSERT_EQ(shifted.report.warnings.size(), 1u);
  EXPECT_NE(shifted.report.warnings[0].find("first on hidden layer 2"), std::string::npos);
}

TEST(RouteImport, VllmFrequencyListAndFiles) {
  const int64_t rows = 5, layers = 4, K = 2, E = 8;
  const std::vector<bool> moe{true, false, true, false};
  const auto v = engine_routes(rows, layers, K, E, moe);
  ImportOptions opt;
  opt.num_experts = E;
  opt.layer_map.moe_layer_freq = {1, 0, 1, 0};
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    paths.push_back((std::filesystem::temp_directory_path() /
                     ("sy_imp_" + std::to_string(::getpid()) + "_" + std::to_string(i) + ".npy"))
                        .string());
    // Sequence i holds the first rows - i rows.
    std::vector<int32_t> vi(v.begin(), v.begin() + (rows - i) * layers * K);
    std::ofstream(paths.back(), std::ios::binary) << npy(vi, {rows - i, layers, K}, "<i4");
  }
  ImportResult r = import_vllm(paths, opt);
  ASSERT_EQ(r.sequences.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> vi(v.begin(), v.begin() + (rows - i) * layers * K);
    EXPECT_TRUE(
        route_tables_equal(r.sequences[size_t(i)], expected(vi, rows - i, layers, K, E, {0, 2})));
    EXPECT_EQ(r.sources[size_t(i)], paths[size_t(i)]);
  }
  EXPECT_EQ(r.report.num_sequences, 3);
  EXPECT_EQ(r.report.num_tokens, 6 + 5 + 4);
  for (auto& p : paths) std::remove(p.c_str());
  EXPECT_THROW(import_vllm({paths[0]}, opt), BackendError);
}

TEST(RouteImport, VllmErrorsNameFileSequenceAndValue) {
  ImportOptions opt;
  opt.num_experts = 8;
  std::vector<int32_t> v{1, 2, 3, 9};
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes(npy(v, {2, 1, 2}, "<i4"), "a.npy", opt),
                      std::invalid_argument,
                      "[import] a.npy (sequence 0): expert id 9 at token 1, hidden layer 0, slot 1 "
                      "is outside [0, num_experts=8)");
  v[3] = -2;
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes(npy(v, {2, 1, 2}, "<i4"), "a.npy", opt),
                      std::invalid_argument, "expert id -2");
  v[3] = 4;
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes(npy(v, {4}, "<i4"), "a.npy", opt),
                      std::invalid_argument, "expected a 3-D array");
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes(npy(v, {2, 1, 2}, ">i4"), "a.npy", opt),
                      std::invalid_argument, "dtype must be a little-endian integer");
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes(npy(v, {2, 2, 2}, "<i4"), "a.npy", opt),
                      std::invalid_argument, ".npy data is 16 bytes, shape (2, 2, 2) needs 32");
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes("hello", "a.npy", opt), std::invalid_argument,
                      "not a .npy file");
  opt.num_input_layers = 3;
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes(npy(v, {2, 1, 2}, "<i4"), "a.npy", opt),
                      std::invalid_argument, "expected 3 layers per token, got 1");
  opt.num_input_layers = 0;
  opt.layer_map.moe_layer_freq = {1, 1};
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes(npy(v, {2, 1, 2}, "<i4"), "a.npy", opt),
                      std::invalid_argument,
                      "a.npy (sequence 0, 1 layers): [layer_map] moe_layer_freq must have one "
                      "entry per hidden layer");
  opt.layer_map = {};
  opt.num_experts = 0;
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes(npy(v, {2, 1, 2}, "<i4"), "a.npy", opt),
                      std::invalid_argument, "num_experts must be >= 1, got 0");
}

TEST(RouteImport, ZeroRowPolicies) {
  ImportOptions opt;
  opt.num_experts = 8;
  std::vector<int32_t> v{0, 0, 1, 2, 0, 0};  // [3, 1, 2]: rows 0 and 2 all zero
  ImportResult keep = import_vllm_npy_bytes(npy(v, {3, 1, 2}, "<i4"), "z.npy", opt);
  EXPECT_EQ(keep.report.num_zero_rows, 2);
  EXPECT_EQ(keep.report.first_zero_rows[1], (std::array<int64_t, 3>{0, 2, 0}));
  EXPECT_EQ(keep.sequences[0].topk_idx.data<int32_t>()[0], 0);
  opt.zero_rows = ZeroRowPolicy::to_none;
  ImportResult none = import_vllm_npy_bytes(npy(v, {3, 1, 2}, "<i4"), "z.npy", opt);
  EXPECT_EQ(none.sequences[0].topk_idx.to_double_vector(),
            (std::vector<double>{-1, -1, 1, 2, -1, -1, -1, -1}));
  // K = 1: zeros are routes to expert 0, never flagged or changed.
  ImportResult k1 = import_vllm_npy_bytes(npy(v, {6, 1, 1}, "<i4"), "z.npy", opt);
  EXPECT_EQ(k1.report.num_zero_rows, 0);
  EXPECT_EQ(k1.sequences[0].topk_idx.data<int32_t>()[0], 0);
  opt.zero_rows = ZeroRowPolicy::error;
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes(npy(v, {3, 1, 2}, "<i4"), "z.npy", opt),
                      std::invalid_argument,
                      "z.npy (sequence 0): all-zero row at token 0, hidden layer 0");
}

TEST(RouteImport, Base64) {
  std::mt19937_64 rng(testing::test_seed(3));
  for (size_t n = 0; n < 40; ++n) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng());
    EXPECT_EQ(base64_decode(base64_encode(s)), s) << n;
  }
  EXPECT_EQ(base64_encode("Man"), "TWFu");
  EXPECT_EQ(base64_decode("TWE="), "Ma");
  EXPECT_EQ(base64_decode("TWE"), "Ma");
  SY_EXPECT_THROW_MSG(base64_decode("TW!u"), std::invalid_argument,
                      "[base64] invalid character code 33 at position 2");
  SY_EXPECT_THROW_MSG(base64_decode("T"), std::invalid_argument, "cannot be base64");
  SY_EXPECT_THROW_MSG(base64_decode("TWF="), std::invalid_argument, "non-zero padding bits");
  SY_EXPECT_THROW_MSG(base64_decode("TW=u"), std::invalid_argument, "'=' before the end");
}

std::string sglang_record(const std::vector<int32_t>& v, int64_t prompt = -1,
                          int64_t completion = -1) {
  std::string b64 =
      base64_encode(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  std::string meta = "\"routed_experts\": \"" + b64 + "\"";
  if (prompt >= 0)
    meta += ", \"prompt_tokens\": " + std::to_string(prompt) +
            ", \"completion_tokens\": " + std::to_string(completion);
  return "{\"text\": \"hi\", \"meta_info\": {" + meta + "}}";
}

TEST(RouteImport, SglangJsonJsonlAndArray) {
  const int64_t layers = 4, K = 2, E = 8;
  const std::vector<bool> moe{false, true, true, true};
  const auto a = engine_routes(3, layers, K, E, moe), b = engine_routes(6, layers, K, E, moe);
  ImportOptions opt;
  opt.num_experts = E;
  opt.num_input_layers = layers;
  opt.top_k = K;
  opt.layer_map.first_k_dense = 1;
  const RouteTable ea = expected(a, 3, layers, K, E, {1, 2, 3}),
                   eb = expected(b, 6, layers, K, E, {1, 2, 3});
  ImportResult one = import_sglang_text(sglang_record(a, 2, 2), "r.json", opt);
  ASSERT_EQ(one.sequences.size(), 1u);
  EXPECT_TRUE(route_tables_equal(one.sequences[0], ea));
  EXPECT_TRUE(one.report.warnings.empty());
  ImportResult lines =
      import_sglang_text(sglang_record(a) + "\n\n" + sglang_record(b, 5, 5) + "\n", "r.jsonl", opt);
  ASSERT_EQ(lines.sequences.size(), 2u);
  EXPECT_TRUE(route_tables_equal(lines.sequences[0], ea));
  EXPECT_TRUE(route_tables_equal(lines.sequences[1], eb));
  EXPECT_EQ(lines.sources[1], "r.jsonl:3");
  ASSERT_EQ(lines.report.warnings.size(), 1u);  // 5 + 5 tokens but routes for 7
  EXPECT_NE(lines.report.warnings[0].find("= 10 but routed_experts covers 7 tokens"),
            std::string::npos);
  ImportResult arr =
      import_sglang_text("[" + sglang_record(b) + ", " + sglang_record(a) + "]", "r.json", opt);
  ASSERT_EQ(arr.sequences.size(), 2u);
  EXPECT_TRUE(route_tables_equal(arr.sequences[1], ea));
  EXPECT_EQ(arr.sources[1], "r.json[1]");
}

TEST(RouteImport, SglangErrors) {
  ImportOptions opt;
  opt.num_experts = 8;
  opt.num_input_layers = 2;
  opt.top_k = 2;
  const std::vector<int32_t> v{1, 2, 3, 4, 5, 6, 7, 0};
  SY_EXPECT_THROW_MSG(import_sglang_text("{\"meta_info\": {}}", "r.json", opt),
                      std::invalid_argument,
                      "[import] r.json: meta_info.routed_experts must be a base64 string");
  SY_EXPECT_THROW_MSG(import_sglang_text(sglang_record(v) + "\n{oops\n", "r.jsonl", opt),
                      std::invalid_argument, "r.jsonl:2: not valid JSON");
  SY_EXPECT_THROW_MSG(
      import_sglang_text("{\"meta_info\": {\"routed_experts\": \"AA$A\"}}", "r.json", opt),
      std::invalid_argument, "r.json: meta_info.routed_experts: [base64] invalid character");
  std::vector<int32_t> short_v(v.begin(), v.begin() + 6);
  SY_EXPECT_THROW_MSG(
      import_sglang_text(sglang_record(short_v), "r.json", opt), std::invalid_argument,
      "holds 24 bytes, not a whole number of int32 rows of num_input_layers*top_k=4");
  std::vector<int32_t> bad = v;
  bad[5] = 8;
  SY_EXPECT_THROW_MSG(import_sglang_text(sglang_record(bad), "r.json", opt), std::invalid_argument,
                      "r.json (sequence 0): expert id 8 at token 1, hidden layer 0, slot 1");
  opt.top_k = 0;
  SY_EXPECT_THROW_MSG(import_sglang_text(sglang_record(v), "r.json", opt), std::invalid_argument,
                      "num_input_layers and top_k must be given");
}

TEST(RouteImport, EncodeNpyMatchesAnIndependentWriterAndImports) {
  std::vector<int32_t> v(5 * 3 * 2);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>(i % 8);
  const std::string bytes = encode_npy_int32(Tensor::from_vector(v, {5, 3, 2}));
  EXPECT_EQ(bytes, npy(v, {5, 3, 2}, "<i4"));
  ImportOptions opt;
  opt.num_experts = 8;
  ImportResult r = import_vllm_npy_bytes(bytes, "enc.npy", opt);
  ASSERT_EQ(r.sequences.size(), 1u);
  EXPECT_EQ(r.sequences[0].num_tokens(), 6);  // 5 rows + the last token's -1 row
  EXPECT_EQ(encode_npy_int32(Tensor::from_vector<int32_t>({7}, {1})),
            npy(std::vector<int32_t>{7}, {1}, "<i4"));
  SY_EXPECT_THROW_MSG(encode_npy_int32(Tensor::zeros({2}, DType::fp32)), std::invalid_argument,
                      "array must have dtype int32, got fp32");
}

TEST(RouteImport, VllmArraysInMemoryMatchTheNpyImport) {
  // Two sequences in memory (int32, int64 and uint8 ids) against the same arrays as .npy bytes.
  const int64_t layers = 4, K = 2, E = 200;
  const std::vector<bool> moe{false, true, true, true};
  const std::vector<int64_t> rows{6, 3};
  ImportOptions opt;
  opt.num_experts = E;
  opt.layer_map.first_k_dense = 1;
  std::vector<Tensor> i32, i64, u8;
  ImportResult ref;
  for (size_t s = 0; s < rows.size(); ++s) {
    const auto v = engine_routes(rows[s], layers, K, E, moe);
    ImportResult one = import_vllm_npy_bytes(npy(v, {rows[s], layers, K}, "<i4"), "s.npy", opt);
    ref.sequences.push_back(std::move(one.sequences[0]));
    i32.push_back(Tensor::from_vector(v, {rows[s], layers, K}));
    i64.push_back(i32.back().to(DType::int64));
    std::vector<uint8_t> v8(v.begin(), v.end());
    u8.push_back(Tensor::from_vector(v8, {rows[s], layers, K}));
  }
  for (const auto* arrays : {&i32, &i64, &u8}) {
    ImportResult r = import_vllm_arrays(*arrays, opt);
    ASSERT_EQ(r.sequences.size(), 2u);
    EXPECT_EQ(r.report.moe_layers, (std::vector<int64_t>{1, 2, 3}));
    EXPECT_EQ(r.report.num_tokens, 7 + 4);
    EXPECT_EQ(r.sources, (std::vector<std::string>{"arrays[0]", "arrays[1]"}));
    for (size_t s = 0; s < rows.size(); ++s)
      EXPECT_TRUE(route_tables_equal(r.sequences[s], ref.sequences[s]));
  }
  SY_EXPECT_THROW_MSG(import_vllm_arrays({Tensor::zeros({3, 2}, DType::int32)}, opt),
                      std::invalid_argument,
                      "[import] arrays[0]: expected a 3-D array [seq_len-1, num_layers, top_k], "
                      "got 2 dimensions");
  SY_EXPECT_THROW_MSG(import_vllm_arrays({Tensor::zeros({3, 4, 2}, DType::fp32)}, opt),
                      std::invalid_argument,
                      "arrays[0]: dtype must be int32, int64, int16, uint16 or uint8");
}

}  // namespace
}  // namespace switchyard
