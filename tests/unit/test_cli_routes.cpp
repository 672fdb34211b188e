// The `switchyard routes` commands, run in-process through the same CLI11 app as the program
// (run_cli from tools/, the code main() runs): exit codes and human / --json output.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

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
  r = run({"routes", "inspect", p("cut.syr")});
  EXPECT_EQ(r.code, 0);
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

}  // namespace
