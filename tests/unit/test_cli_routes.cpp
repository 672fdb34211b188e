// The `switchyard routes` commands, run in-process through the same CLI11 app as the program
// (run_cli from tools/, the code main() runs): exit codes and human / --json output.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "cli_testing.h"
#include "switchyard/route_align.h"
#include "switchyard/route_file.h"
#include "switchyard/route_import.h"
#include "testing.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using switchyard::testing::CliRun;
using switchyard::testing::run;

class CliRoutes : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("sy_cli_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  // Three vLLM sequences: 4 input layers (1 dense), K 2, E 8; sequence i has 3 + i rows.
  std::vector<std::string> write_vllm(int32_t shift = 0) {
    std::vector<std::string> files;
    for (int i = 0; i < 3; ++i) {
      const int64_t rows = 3 + i;
      std::vector<int32_t> v;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t l = 0; l < 4; ++l)
          for (int64_t k = 0; k < 2; ++k)
            v.push_back(l == 0 ? 0 : int32_t((r + l + 3 * k + (r == 1 && l == 2 ? shift : 0)) % 8));
      files.push_back(p("s" + std::to_string(i) + "_" + std::to_string(shift) + ".npy"));
      std::ofstream(files.back(), std::ios::binary) << switchyard::encode_npy_int32(switchyard::Tensor::from_vector(v, {rows, 4, 2}));
    }
    return files;
  }
  fs::path dir_;
};

TEST_F(CliRoutes, ImportInspectValidateStats) {
  auto files = write_vllm();
  std::vector<std::string> args{"routes", "import",          "--format", "vllm", "--num-experts",
                                "8",      "--first-k-dense", "1",        "-o",   p("a.syr")};
  args.insert(args.end(), files.begin(), files.end());
  CliRun r = run(args);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("imported 3 sequences, 15 tokens (vllm, 4 input layers -> 3 MoE layers [1, "
                       "2, 3], top_k 2, 8 experts)"),
            std::string::npos)
      << r.out;
  args.push_back("--json");
  args[9] = p("a2.syr");
  r = run(args);
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["num_sequences"], 3);
  EXPECT_EQ(j["num_tokens"], 15);
  EXPECT_EQ(j["moe_layers"], json({1, 2, 3}));
  EXPECT_EQ(j["num_zero_rows"], 0);

  r = run({"routes", "inspect", p("a.syr")});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("complete"), std::string::npos);
  EXPECT_NE(r.out.find("3 sequences, 15 tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hidden layers [1, 2, 3] of 4"), std::string::npos) << r.out;
  r = run({"routes", "inspect", p("a.syr"), "--json", "--list"});
  j = json::parse(r.out);
  EXPECT_EQ(j["complete"], true);
  EXPECT_EQ(j["sequences"].size(), 3u);
  EXPECT_EQ(j["sequences"][2]["num_tokens"], 6);

  r = run({"routes", "validate", p("a.syr")});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find(": ok (3 sequences, 15 tokens)"), std::string::npos) << r.out;

  r = run({"routes", "stats", p("a.syr"), "--top", "2"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("layer 0 (hidden 1): 24 assignments, 3 rows without route"),
            std::string::npos)
      << r.out;
  r = run({"routes", "stats", p("a.syr"), "--json"});
  j = json::parse(r.out);
  ASSERT_EQ(j["layers"].size(), 3u);
  int64_t sum = 0;
  for (auto& c : j["layers"][0]["num_tokens_per_expert"]) sum += c.get<int64_t>();
  EXPECT_EQ(sum, 24);  // 12 routed tokens x K=2
}

TEST_F(CliRoutes, ValidateFailsOnDamage) {
  auto files = write_vllm();
  std::vector<std::string> args{"routes",        "import", "--format", "vllm",
                                "--num-experts", "8",      "-o",       p("a.syr")};
  args.insert(args.end(), files.begin(), files.end());
  ASSERT_EQ(run(args).code, 0);
  std::string bytes;
  {
    std::ifstream in(p("a.syr"), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto rd = switchyard::RouteFileReader::from_bytes(bytes);
  // Flip a payload byte of block 1.
  std::string bad = bytes;
  bad[size_t(rd.entry(1).offset + 60)] ^= 0x40;
  std::ofstream(p("bad.syr"), std::ios::binary) << bad;
  CliRun r = run({"routes", "validate", p("bad.syr")});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("INVALID (2 of 3 sequences readable)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("block 1 (sequence 1)"), std::string::npos) << r.out;
  r = run({"routes", "validate", p("bad.syr"), "--json"});
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(json::parse(r.out)["ok"], false);
  // Cut after block 1: no index.
  std::ofstream(p("cut.syr"), std::ios::binary) << bytes.substr(0, size_t(rd.entry(2).offset));
  r = run({"routes", "validate", p("cut.syr")});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("no index footer"), std::string::npos) << r.out;
  // inspect verifies what it reads too (issue 35): an incomplete file exits 1; --salvage shows
  // what is readable and still exits 1.
  r = run({"routes", "inspect", p("cut.syr")});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("is damaged (2 sequences readable before the damage): no index footer"),
            std::string::npos) << r.err;
  r = run({"routes", "inspect", p("cut.syr"), "--salvage"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("INCOMPLETE"), std::string::npos);
  // Not a file at all.
  r = run({"routes", "validate", p("missing.syr")});
  EXPECT_NE(r.code, 0);
  std::ofstream(p("junk.syr")) << "not a route file at all, just some text";
  r = run({"routes", "inspect", p("junk.syr")});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("not a route file"), std::string::npos) << r.err;
}

TEST_F(CliRoutes, DiffHumanAndJson) {
  auto a = write_vllm(0),
       b = write_vllm(5);  // b differs at token 1, hidden layer 2 of every sequence
  std::vector<std::string> ia{"routes", "import",       "--format", "vllm", "--num-experts",
                              "8",      "--moe-layers", "0,1,1,1",  "-o",   p("a.syr")};
  std::vector<std::string> ib = ia;
  ib[9] = p("b.syr");
  ia.insert(ia.end(), a.begin(), a.end());
  ib.insert(ib.end(), b.begin(), b.end());
  ASSERT_EQ(run(ia).code, 0);
  ASSERT_EQ(run(ib).code, 0);
  CliRun r = run({"routes", "diff", p("a.syr"), p("b.syr"), "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["num_tokens"], 12);  // last tokens have no route
  EXPECT_EQ(j["num_differing_tokens"], 3);
  EXPECT_EQ(j["num_differing_rows"], 3);
  EXPECT_EQ(j["num_decisions"], 72);
  EXPECT_DOUBLE_EQ(j["token_mismatch"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(j["layer_mismatch"][0].get<double>(), 0.0);
  EXPECT_GT(j["layer_mismatch"][1].get<double>(), 0.0);
  r = run({"routes", "diff", p("a.syr"), p("b.syr")});
  EXPECT_NE(r.out.find("tokens with a differing layer:  25.00% (3 of 12)"), std::string::npos)
      << r.out;
  r = run({"routes", "diff", p("a.syr"), p("a.syr")});
  EXPECT_NE(r.out.find("router decisions that differ:   0.00%"), std::string::npos) << r.out;
}

TEST_F(CliRoutes, SglangImportAndErrors) {
  std::vector<int32_t> v;
  for (int i = 0; i < 2 * 3 * 2; ++i) v.push_back(i % 8);
  const std::string b64 =
      switchyard::base64_encode(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  std::ofstream(p("r.jsonl")) << "{\"meta_info\": {\"routed_experts\": \"" << b64 << "\"}}\n"
                              << "{\"meta_info\": {\"routed_experts\": \"" << b64 << "\"}}\n";
  CliRun r = run({"routes", "import", "--format", "sglang", "--num-experts", "8", "--num-layers",
                  "3", "--top-k", "2", "-o", p("s.syr"), p("r.jsonl")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("imported 2 sequences, 6 tokens"), std::string::npos) << r.out;
  r = run({"routes", "import", "--format", "sglang", "--num-experts", "8", "-o", p("s2.syr"),
           p("r.jsonl")});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("needs --num-layers and --top-k"), std::string::npos) << r.err;
  r = run({"routes", "import", "--format", "sglang", "--num-experts", "4", "--num-layers", "3",
           "--top-k", "2", "-o", p("s3.syr"), p("r.jsonl")});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("expert id 4"), std::string::npos) << r.err;
  // Usage errors come from CLI11.
  EXPECT_NE(
      run({"routes", "import", "--format", "tgi", "--num-experts", "8", "-o", p("x"), p("r.jsonl")})
          .code,
      0);
  EXPECT_NE(run({"routes", "import", "--format", "vllm", "--num-experts", "8", "--first-k-dense",
                 "1", "--moe-layers", "0,1,1", "-o", p("x"), p("r.jsonl")})
                .code,
            0);
}

TEST_F(CliRoutes, AlignWritesOneRecordPerMicroBatch) {
  auto files = write_vllm();  // lengths 4, 5, 6; 3 MoE layers at hidden 1..3 of 4
  std::vector<std::string> args{"routes", "import",          "--format", "vllm", "--num-experts",
                                "8",      "--first-k-dense", "1",        "-o",   p("a.syr")};
  args.insert(args.end(), files.begin(), files.end());
  ASSERT_EQ(run(args).code, 0);
  CliRun r =
      run({"routes", "align", p("a.syr"),  "-o", p("al.syr"),           "--tp",      "2",
           "--cp",   "2",     "--cp-rank", "1",  "--sequence-parallel", "--tp-rank", "0",
           "--pp",   "2",     "--pp-rank", "1",  "--micro-batch-size",  "2",         "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["pack_alignment"], 8);
  EXPECT_EQ(j["moe_layer_range"], json({1, 3}));  // stage 1 owns hidden layers 2, 3
  ASSERT_EQ(j["micro_batches"].size(), 2u);
  EXPECT_EQ(j["micro_batches"][0]["cu_seqlens_padded"], json({0, 8, 16}));
  EXPECT_EQ(j["micro_batches"][0]["num_local_tokens"], 4);  // 16 / cp 2 / tp 2
  auto rd = switchyard::RouteFileReader::open(p("al.syr"));
  ASSERT_EQ(rd.num_sequences(), 2);
  EXPECT_EQ(rd.info().num_moe_layers, 2);
  EXPECT_EQ(rd.info().moe_layers, (std::vector<int64_t>{2, 3}));
  // Against the library: the same steps by hand.
  auto src = switchyard::RouteFileReader::open(p("a.syr"));
  auto packed = switchyard::pack_thd({src.read(0), src.read(1)}, {2, 2, 0});
  auto want = switchyard::slice_layers(
      switchyard::sp_split(
          switchyard::cp_zigzag_split(packed.table, packed.cu_seqlens_padded, 2, 1), 2, 0),
      1, 3);
  EXPECT_TRUE(switchyard::route_tables_equal(rd.read(0), want));
  r = run({"routes", "align", p("a.syr"), "-o", p("al2.syr"), "--pp", "3"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("must be divisible by pp_size*vpp_size=3"), std::string::npos) << r.err;
  r = run({"routes", "align", p("a.syr"), "-o", p("al3.syr"), "--tp", "3"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("cu_seqlens_padded [0, 6, 12, 18]"), std::string::npos) << r.out;
}


// ---- vLLM >= 0.22 HTTP responses, SGLang's start_len, and the export to verl's layout ----------

// vLLM's np.save of uint8 [[[0,0],[3,1]],[[0,0],[2,5]]] (layer 0 dense, K 2), base64 (the wire).
const char* kVllmU8 =
    "k05VTVBZAQB2AHsnZGVzY3InOiAnfHUxJywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDIsIDIsIDIp"
    "LCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAoAAAMBAAACBQ==";

// The .npy payload of a file the export wrote: (descr, shape text, data bytes).
std::tuple<std::string, std::string, std::string> read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t hlen = static_cast<uint8_t>(b[8]) | (size_t(static_cast<uint8_t>(b[9])) << 8);
  const std::string h = b.substr(10, hlen);
  auto field = [&](const std::string& key, char open, char close) {
    const size_t k = h.find(key);
    const size_t a = h.find(open, k + key.size());
    return h.substr(a + 1, h.find(close, a + 1) - a - 1);
  };
  return {field("'descr'", '\'', '\''), field("'shape'", '(', ')'), b.substr(10 + hlen)};
}

TEST_F(CliRoutes, VllmHttpImportWithPromptStartThenVerlExport) {
  std::ofstream(p("resp.jsonl"))
      << json{{"choices", {{{"index", 0}, {"routed_experts", kVllmU8}}}}}.dump() << "\n"
      << json{{"routed_experts_prompt_start", 1},
              {"choices", {{{"index", 0}, {"routed_experts", kVllmU8}}}}}
             .dump()
      << "\n";
  CliRun r = run({"routes", "import", "--format", "vllm", "--num-experts", "8", "--first-k-dense",
                  "1", "--prompt-start", "2", "-o", p("h.syr"), p("resp.jsonl")});
  ASSERT_EQ(r.code, 0) << r.err;
  // Record 1 uses --prompt-start (2 + 2 + 1 rows), record 2 its own field (1 + 2 + 1).
  EXPECT_NE(r.out.find("imported 2 sequences, 9 tokens (vllm, 2 input layers -> 1 MoE layers [1]"),
            std::string::npos)
      << r.out;
  switchyard::RouteFileReader f = switchyard::RouteFileReader::open(p("h.syr"));
  ASSERT_EQ(f.num_sequences(), 2);
  switchyard::RouteTable t = f.read(1);
  const std::vector<int32_t> want = {-1, -1, 3, 1, 2, 5, -1, -1};
  ASSERT_EQ(t.num_tokens(), 4);
  EXPECT_EQ(std::vector<int32_t>(t.topk_idx.data<int32_t>(), t.topk_idx.data<int32_t>() + 8), want);

  r = run({"routes", "export", "--format", "verl", p("h.syr"), "-o", p("batch"), "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["routed_experts_shape"], json({2, 5, 2, 2}));
  auto [descr, shape, data] = read_npy(p("batch.routed_experts.npy"));
  EXPECT_EQ(descr, "<i2");
  EXPECT_EQ(shape, "2, 5, 2, 2");
  ASSERT_EQ(data.size(), 2u * 5 * 2 * 2 * 2);
  std::vector<int16_t> ids(data.size() / 2);
  std::memcpy(ids.data(), data.data(), data.size());
  // Row 1 (4 tokens) is left padded by one column: token r sits at column r + 1, hidden layer 1.
  std::vector<int16_t> row1(ids.begin() + 20, ids.end());
  const std::vector<int16_t> want1 = {0, 0, 0, 0, /*tok0*/ 0, 0, 0, 0, /*tok1*/ 0, 0, 3, 1,
                                      /*tok2*/ 0, 0, 2, 5, /*tok3*/ 0, 0, 0, 0};
  EXPECT_EQ(row1, want1);
  auto [mdescr, mshape, mdata] = read_npy(p("batch.attention_mask.npy"));
  EXPECT_EQ(mdescr, "<i8");
  EXPECT_EQ(mshape, "2, 5");
  std::vector<int64_t> mask(10);
  std::memcpy(mask.data(), mdata.data(), 80);
  EXPECT_EQ(mask, (std::vector<int64_t>{1, 1, 1, 1, 1, 0, 1, 1, 1, 1}));

  r = run({"routes", "export", "--format", "verl", p("h.syr"), "-o", p("b2"), "--padding-side",
           "right", "--seq-len", "3"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("[to_verl] seq_len=3 is shorter than the longest table (5 tokens)"),
            std::string::npos)
      << r.err;
  // Found by fuzz_cli_args: the batch's element count overflowed int64 before any check.
  r = run({"routes", "export", "--format", "verl", p("h.syr"), "-o", p("b3"), "--padding-side",
           "right", "--seq-len", "9223372036854775807"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("[to_verl] seq_len=9223372036854775807 makes routed_experts [2, "
                       "9223372036854775807,"),
            std::string::npos)
      << r.err;
}

TEST_F(CliRoutes, VllmHttpAndSglangStartLenErrors) {
  std::ofstream(p("bad.json")) << json{{"choices", {{{"routed_experts", nullptr}}}}}.dump();
  CliRun r = run({"routes", "import", "--format", "vllm", "--num-experts", "8", "-o", p("x.syr"),
                  p("bad.json")});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find(p("bad.json") + ": choices[0].routed_experts is missing or null"),
            std::string::npos)
      << r.err;
  const std::string b64 = "AAAAAAAAAAADAAAAAQAAAAAAAAAAAAAAAgAAAAUAAAA=";  // int32, 2 rows x 2 x 2
  std::ofstream(p("g.jsonl")) << json{{"meta_info", {{"routed_experts", b64},
                                                    {"routed_experts_start_len", 3}}}}
                                     .dump()
                              << "\n";
  r = run({"routes", "import", "--format", "sglang", "--num-experts", "8", "--num-layers", "2",
           "--top-k", "2", "--first-k-dense", "1", "-o", p("g.syr"), p("g.jsonl"), "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["num_tokens"], 6);  // 3 absent + 2 routed + the last
  r = run({"routes", "export", "--format", "npz", p("g.syr"), "-o", p("g")});
  EXPECT_NE(r.code, 0);
}

}  // namespace

namespace {

// --invalid-rows speaks the replay core's vocabulary: native stores an invalid row as -1; none,
// the old word, still works with a warning naming native.
TEST_F(CliRoutes, InvalidRowsNativeAndTheOldSpelling) {
  std::vector<int32_t> v{1, 2, 3, 3};  // two tokens, one layer, K 2: the second repeats 3
  std::ofstream(p("dup.npy"), std::ios::binary)
      << switchyard::encode_npy_int32(switchyard::Tensor::from_vector(v, {2, 1, 2}));
  for (const char* word : {"native", "none"}) {
    CliRun r = run({"routes", "import", "--format", "vllm", "--num-experts", "8",
                    "--invalid-rows", word, "--json", "-o", p(std::string(word) + ".syr"),
                    p("dup.npy")});
    ASSERT_EQ(r.code, 0) << word << ": " << r.err;
    EXPECT_EQ(r.err.find("deprecated") != std::string::npos, std::string(word) == "none") << r.err;
    EXPECT_EQ(json::parse(r.out)["num_invalid_rows"], 1) << r.out;
  }
  CliRun r = run({"routes", "import", "--format", "vllm", "--num-experts", "8", "--invalid-rows",
                  "merge", "-o", p("m.syr"), p("dup.npy")});
  EXPECT_NE(r.code, 0);
}

}  // namespace
