// Bad inputs to the `switchyard` command line, run in-process through the same CLI11 app as the
// program (as tests/unit/test_cli_routes.cpp does): each row is one command line with one thing
// wrong, the exit code it must end with and a piece of what it must print on stderr. With
// SY_BAD_INPUT_TABLE_CLI=<file> set, the test writes the README's table from the real runs.
// Also the regressions found by fuzz/fuzz_cli_args.cpp (numbers that overflow, huge sizes).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "cli_testing.h"
#include "switchyard/route_align.h"
#include "switchyard/route_file.h"
#include "switchyard/route_import.h"
#include "testing.h"

namespace {

namespace fs = std::filesystem;

using switchyard::testing::CliRun;
using switchyard::testing::run;

class CliBadInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("sy_cli_bad_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    switchyard::RouteFileInfo info{8, 2, 3, {1, 2, 3}, 4, 0, 0};
    switchyard::RouteFileWriter w(p("in.syr"), info);
    for (int s = 0; s < 3; ++s) w.append(switchyard::RouteTable::none(4 + s, 3, 2, 8));
    w.close();
    switchyard::RouteFileInfo shifted{8, 2, 3, {0, 1, 2}, 4, 0, 0};  // same sizes, layers moved
    switchyard::RouteFileWriter ws(p("shifted.syr"), shifted);
    for (int s = 0; s < 3; ++s) ws.append(switchyard::RouteTable::none(4 + s, 3, 2, 8));
    ws.close();
    std::ofstream(p("dup.npy"), std::ios::binary) << switchyard::encode_npy_int32(
        switchyard::Tensor::from_vector(std::vector<int32_t>{1, 2, 3, 3}, {1, 2, 2}));
    std::ofstream(p("bad.npy")) << "not an npy file";
    // A valid vLLM array: 3 rows, 4 layers, K 2, ids < 8.
    std::string h = "{'descr': '<i4', 'fortran_order': False, 'shape': (3, 4, 2), }";
    while ((10 + h.size() + 1) % 64 != 0) h += ' ';
    h += '\n';
    std::string npy("\x93NUMPY\x01\x00", 8);
    npy += static_cast<char>(h.size());
    npy += '\0';
    npy += h;
    for (int32_t i = 0; i < 24; ++i) {
      const int32_t v = i % 8;
      npy.append(reinterpret_cast<const char*>(&v), 4);
    }
    std::ofstream(p("ok.npy"), std::ios::binary) << npy;
    std::ofstream(p("bad.jsonl")) << "{\"meta_info\": {}}\n";
    std::ofstream(p("cut.syr"), std::ios::binary) << std::string(24, 'S');
    {  // in.syr cut 3 bytes before the end of its last block
      std::ifstream f(p("in.syr"), std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      const auto r = switchyard::RouteFileReader::from_bytes(bytes);
      std::ofstream(p("trunc.syr"), std::ios::binary)
          << bytes.substr(0, size_t(r.entry(2).offset + r.entry(2).stored_bytes - 3));
    }
    // A vLLM stream recorded without its finish_reason chunk.
    std::ofstream(p("cut.sse")) << "data: {\"request_id\": \"q\", \"choices\": [{\"index\": 0, "
                                   "\"token_ids\": [7], \"routed_experts\": null, "
                                   "\"finish_reason\": null}]}\n";
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

struct Row {
  std::string tried;
  std::vector<std::string> args;  // "@x" is replaced by the temporary path of x
  int code;
  std::string expect;  // on stderr (or stdout for CLI11's own messages)
};

TEST_F(CliBadInputs, EveryRowExitsWithItsCodeAndMessage) {
  const std::vector<Row> rows = {
      {"no subcommand", {}, 106, "A subcommand is required"},
      {"unknown subcommand", {"route"}, 106, "A subcommand is required"},
      {"--num-experts not a number", {"routes", "import", "--format", "vllm", "--num-experts", "abc", "-o", "@o.syr", "@bad.npy"},
       104, "Could not convert: --num-experts = abc"},
      {"--num-experts past int64", {"routes", "import", "--format", "vllm", "--num-experts", "99999999999999999999", "-o", "@o.syr", "@ok.npy"},
       2, "num_experts"},
      {"--level 0", {"routes", "import", "--format", "vllm", "--num-experts", "8", "--level", "0", "-o", "@o.syr", "@ok.npy"},
       2, "compression_level must be in [1, 19], got 0"},
      {"--format unknown", {"routes", "import", "--format", "torch", "--num-experts", "8", "-o", "@o.syr", "@bad.npy"},
       105, "torch"},
      {"input file missing", {"routes", "import", "--format", "vllm", "--num-experts", "8", "-o", "@o.syr", "@nope.npy"},
       105, "nope.npy"},
      {"--first-k-dense with --moe-layers", {"routes", "import", "--format", "vllm", "--num-experts", "8", "--first-k-dense", "1", "--moe-layers", "0,1", "-o", "@o.syr", "@bad.npy"},
       108, "excludes"},
      {"--moe-layers with a 2", {"routes", "import", "--format", "vllm", "--num-experts", "8", "--moe-layers", "0,2", "-o", "@o.syr", "@bad.npy"},
       2, "[layer_map]"},
      {"--moe-layers repeat count past int64", {"routes", "import", "--format", "vllm", "--num-experts", "8", "--moe-layers", "99999999999999999999x1", "-o", "@o.syr", "@bad.npy"},
       2, "[layer_map]"},
      {"not a .npy file", {"routes", "import", "--format", "vllm", "--num-experts", "8", "-o", "@o.syr", "@bad.npy"},
       2, "bad.npy"},
      {"--top-k 0 (vllm infers K only when it is left out)", {"routes", "import", "--format", "vllm", "--num-experts", "8", "--top-k", "0", "-o", "@o.syr", "@ok.npy"},
       105, "--top-k: Value 0 not in range"},
      {"sglang without --num-layers/--top-k", {"routes", "import", "--format", "sglang", "--num-experts", "8", "-o", "@o.syr", "@bad.jsonl"},
       2, "--format sglang needs --num-layers and --top-k"},
      {"sglang record without routed_experts", {"routes", "import", "--format", "sglang", "--num-experts", "8", "--num-layers", "1", "--top-k", "1", "-o", "@o.syr", "@bad.jsonl"},
       2, "bad.jsonl"},
      {"inspect a missing file", {"routes", "inspect", "@nope.syr"}, 2, "nope.syr"},
      {"inspect a 24-byte file", {"routes", "inspect", "@cut.syr"}, 1, "not a route file"},
      {"validate a 24-byte file", {"routes", "validate", "@cut.syr"}, 1, "not a route file"},
      {"stats --top -1", {"routes", "stats", "@in.syr", "--top", "-1"}, 2, "[hot_experts] n must be >= 0, got -1"},
      {"stats of a route file cut inside its last block", {"routes", "stats", "@trunc.syr"}, 1,
       "is damaged (2 sequences readable before the damage)"},
      {"align a route file cut inside its last block (used to write 2 of 3 sequences and exit 0)", {"routes", "align", "@trunc.syr", "-o", "@o.syr"}, 1,
       "block 2 at byte offset"},
      {"export --format verl a route file cut inside its last block (used to write 2 of 3 sequences and exit 0)", {"routes", "export", "--format", "verl", "@trunc.syr", "-o", "@x"}, 1,
       "nothing was written; rerun with --salvage"},
      {"stats --max-decoded-bytes -1", {"routes", "stats", "@in.syr", "--max-decoded-bytes", "-1"}, 105,
       "--max-decoded-bytes"},
      {"align --tp 0", {"routes", "align", "@in.syr", "-o", "@o.syr", "--tp", "0"}, 2, "tp_size must be >= 1, got 0"},
      {"align --cp-rank out of range", {"routes", "align", "@in.syr", "-o", "@o.syr", "--cp", "2", "--cp-rank", "2"}, 2, "cp_rank"},
      {"align --pp-rank out of range", {"routes", "align", "@in.syr", "-o", "@o.syr", "--pp", "2", "--pp-rank", "5"}, 2, "pp_rank"},
      {"align --micro-batch-size -3", {"routes", "align", "@in.syr", "-o", "@o.syr", "--micro-batch-size", "-3"}, 2, "--micro-batch-size must be >= 0"},
      {"align --pp larger than the layer count", {"routes", "align", "@in.syr", "-o", "@o.syr", "--pp", "100000", "--pp-rank", "1", "--first-stage-layers", "1"}, 2,
       "pp_size and vpp_size must be <= num_hidden_layers=4"},
      {"align --pp 0", {"routes", "align", "@in.syr", "-o", "@o.syr", "--pp", "0"}, 2, "--pp and --vpp must be >= 1, got --pp 0"},
      {"align --pp -1", {"routes", "align", "@in.syr", "-o", "@o.syr", "--pp", "-1"}, 2, "--pp and --vpp must be >= 1, got --pp -1"},
      {"align --vpp 0", {"routes", "align", "@in.syr", "-o", "@o.syr", "--vpp", "0"}, 2, "--vpp 0"},
      {"align --first-stage-layers -1", {"routes", "align", "@in.syr", "-o", "@o.syr", "--pp", "2", "--first-stage-layers", "-1"}, 105,
       "--first-stage-layers: Value -1 not in range 0 to 65536"},
      {"align --last-stage-layers -2", {"routes", "align", "@in.syr", "-o", "@o.syr", "--pp", "2", "--last-stage-layers", "-2"}, 105,
       "--last-stage-layers: Value -2 not in range 0 to 65536"},
      {"align --num-hidden-layers -4", {"routes", "align", "@in.syr", "-o", "@o.syr", "--pp", "2", "--num-hidden-layers", "-4"}, 105,
       "--num-hidden-layers: Value -4 not in range 0 to 65536"},
      {"export --num-hidden-layers -4", {"routes", "export", "--format", "verl", "@in.syr", "-o", "@x", "--num-hidden-layers", "-4"}, 105,
       "--num-hidden-layers: Value -4 not in range 0 to 65536"},
      {"diff of files with different MoE layer maps", {"routes", "diff", "@in.syr", "@shifted.syr"}, 2,
       "[routes diff] files have different MoE layer maps"},
      {"trtllm: not a .npy file", {"routes", "import", "--format", "trtllm", "--num-experts", "8", "-o", "@o.syr", "@bad.npy"},
       2, "bad.npy: not a .npy file"},
      {"flashinfer: --cu-seqlens not a list of integers", {"routes", "import", "--format", "flashinfer", "--num-experts", "8", "--cu-seqlens", "0,x", "-o", "@o.syr", "@ok.npy"},
       2, "--cu-seqlens '0,x' is not a comma-separated list of integers"},
      {"vllm-stream: a stream cut before finish_reason", {"routes", "import", "--format", "vllm-stream", "--num-experts", "8", "-o", "@o.syr", "@cut.sse"},
       2, "never got a chunk with finish_reason: the stream is truncated"},
      {"import: a row that repeats an id", {"routes", "import", "--format", "vllm", "--num-experts", "8", "-o", "@o.syr", "@dup.npy"}, 2,
       "repeats expert"},
      {"quickcheck --out that cannot be created", {"quickcheck", "--hidden", "16", "--experts", "4", "--top-k", "2", "--layers", "1", "--sequences", "1", "--seq-len", "4", "--out", "@cut.syr/sub"}, 2,
       "[quickcheck] --out"},
      {"the old name demo", {"demo"}, 2, "`switchyard demo` was renamed `switchyard quickcheck`"},
      {"align --tp huge (2*tp*cp overflows)", {"routes", "align", "@in.syr", "-o", "@o.syr", "--tp", "4611686018427387904", "--cp", "2"}, 2, "tp"},
      {"align --fp8-align huge (lcm overflows)", {"routes", "align", "@in.syr", "-o", "@o.syr", "--tp", "3", "--fp8-align", "9223372036854775807"}, 2, "fp8_align"},
  };
  std::string table = "| command line | input tried | exit code | message |\n|---|---|---|---|\n";
  for (const Row& row : rows) {
    std::vector<std::string> args;
    std::string shown = "switchyard";
    for (const std::string& a : row.args) {
      args.push_back(a.size() > 1 && a[0] == '@' ? p(a.substr(1)) : a);
      shown += " " + (a.size() > 1 && a[0] == '@' ? a.substr(1) : a);
    }
    SCOPED_TRACE(shown);
    const CliRun r = run(args);
    const std::string all = r.err + r.out;
    EXPECT_EQ(r.code, row.code) << all;
    EXPECT_NE(all.find(row.expect), std::string::npos) << "printed: " << all << "\nexpected: " << row.expect;
    // The first line of what it printed, the temporary directory left out.
    std::string line = all.substr(0, all.find('\n'));
    for (size_t q; (q = line.find(dir_.string() + "/")) != std::string::npos;) line.erase(q, dir_.string().size() + 1);
    for (size_t q = 0; (q = line.find('|', q)) != std::string::npos; q += 2) line.replace(q, 1, "\\|");
    table += "| `" + shown + "` | " + row.tried + " | " + std::to_string(r.code) + " | " + line + " |\n";
  }
  if (const char* out = std::getenv("SY_BAD_INPUT_TABLE_CLI")) std::ofstream(out) << table;
}

}  // namespace
