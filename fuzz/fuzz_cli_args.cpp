// libFuzzer target: the `switchyard` command line's handling of numbers, shapes and lists. The input
// is a list of arguments separated by '\n' (the first byte picks the subcommand they are appended
// to: `routes align FILE -o OUT`, `routes import --format vllm|sglang ...`, `routes stats FILE`,
// `routes export --format verl FILE -o OUT`, `routes import` of a vLLM HTTP response);
// the whole text also goes to parse_moe_layer_freq. The program must end with a CLI11 parse error
// or a clean RuntimeError (exit codes 1/2) or succeed; any other exception, crash or sanitizer
// report is a bug.
//
// Safety: the target works in its own temporary directory (chdir) and drops every argument that
// contains '/', so fuzzed paths (outputs, inputs) can only name files inside it.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "switchyard/route_file.h"
#include "switchyard/route_import.h"
#include "switchyard/routes.h"

namespace {

namespace fs = std::filesystem;
fs::path g_dir;

void cleanup() {
  std::error_code ec;
  fs::remove_all(g_dir, ec);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using namespace switchyard;
  g_dir = fs::temp_directory_path() / ("sy_fuzz_cli_" + std::to_string(::getpid()));
  fs::create_directories(g_dir);
  fs::current_path(g_dir);
  std::atexit(cleanup);
  // A route file with a layer map: 6 hidden layers (first dense), 5 MoE layers, K 2, E 8.
  RouteFileInfo info{8, 2, 5, {1, 2, 3, 4, 5}, 6, 0, 0};
  RouteFileWriter w("in.syr", info);
  for (int64_t s = 0; s < 5; ++s) {
    RouteTable t = RouteTable::none(3 + 2 * s, 5, 2, 8);
    int32_t* p = t.topk_idx.data<int32_t>();
    for (int64_t i = 0; i < t.topk_idx.numel(); ++i) p[i] = (i % 7 == 6) ? -1 : int32_t((i * 5 + s) % 8);
    w.append(t);
  }
  w.close();
  // One vLLM sequence: 4 rows, 4 input layers, K 2; and the same as one SGLang JSONL record.
  std::vector<int32_t> v;
  for (int32_t i = 0; i < 4 * 4 * 2; ++i) v.push_back(i % 8);
  std::ofstream("in.npy", std::ios::binary) << encode_npy_int32(Tensor::from_vector(v, {4, 4, 2}));
  std::ofstream("in.jsonl", std::ios::binary)
      << "{\"meta_info\": {\"routed_experts\": \""
      << switchyard::base64_encode(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4))
      << "\"}}\n";
  // Valid top-k rows (distinct ids, last token -1) for the verl export, which rejects mixed rows.
  {
    RouteFileWriter vw("verl.syr", info);
    for (int64_t s = 0; s < 3; ++s) {
      RouteTable t = RouteTable::none(2 + s, 5, 2, 8);
      int32_t* p = t.topk_idx.data<int32_t>();
      for (int64_t r = 0; r + 1 < t.num_tokens(); ++r)
        for (int64_t m = 0; m < 5; ++m) {
          p[(r * 5 + m) * 2] = int32_t((r + m + s) % 8);
          p[(r * 5 + m) * 2 + 1] = int32_t((r + m + s + 1) % 8);
        }
      vw.append(t);
    }
    vw.close();
  }
  // The same sequence as a vLLM >= 0.22 HTTP response (base64 of the .npy bytes).
  std::ofstream("in.http.json", std::ios::binary)
      << "{\"choices\": [{\"routed_experts\": \""
      << switchyard::base64_encode(encode_npy_int32(Tensor::from_vector(v, {4, 4, 2})))
      << "\"}], \"usage\": {\"prompt_tokens\": 3, \"completion_tokens\": 2}}\n";
  return 0;
}

// Options that size what the CLI allocates and compresses: --seq-len the export's batch
// ([B, seq_len, 6, 2] int32), --tp/--cp/--fp8-align the alignment padding of every packed sequence
// (2·tp·cp or lcm(.., fp8_align) tokens). A legitimate value of a few hundred thousand asks for
// gigabytes or minutes (the CLI reports out of memory; libFuzzer's 2 GB malloc limit and 10 s
// timeout count it as a finding: --seq-len millions, then --tp 461904). So fuzzed values stay
// small (or hold no digit at all, for the parse errors); the overflow and huge-value cases are
// rows of test_bad_inputs and test_cli_bad_inputs.
bool sizes_small(const std::vector<std::string>& args) {
  static const std::pair<const char*, long> kLimits[] = {
      {"--seq-len", 65536}, {"--tp", 64}, {"--cp", 64}, {"--fp8-align", 256}};
  for (size_t i = 0; i < args.size(); ++i) {
    for (const auto& [name, limit] : kLimits) {
      const std::string opt(name), eq = opt + "=";
      std::string v;
      if (args[i] == opt && i + 1 < args.size()) v = args[i + 1];
      if (args[i].rfind(eq, 0) == 0) v = args[i].substr(eq.size());
      if (v.find_first_of("0123456789") == std::string::npos) continue;
      const bool small = !v.empty() && v.size() <= 6 &&
                         v.find_first_not_of("0123456789") == std::string::npos &&
                         std::stol(v) <= limit;
      if (!small) return false;
    }
  }
  return true;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    (void)switchyard::parse_moe_layer_freq(text);
  } catch (const std::invalid_argument&) {
  }

  std::vector<std::string> args;
  if (data[0] % 16 >= 8) {
    // Newer formats: `routes export --format verl in.syr -o out` (both .npy files on success) and
    // `routes import --format vllm` of an HTTP response (--prompt-start and friends fuzzed).
    const bool do_export = data[0] % 16 < 12;
    if (do_export)
      args = {"routes", "export", "--format", "verl", "verl.syr", "-o", "out"};
    else
      args = {"routes", "import", "--format", "vllm", "--num-experts", "8", "-o", "out.syr", "in.http.json"};
    std::stringstream ss(text);
    std::string a;
    int n = 0;
    while (std::getline(ss, a, '\n') && n++ < 24) {
      if (a.find('/') == std::string::npos && a != "-o" && a != "--output") args.push_back(a);
    }
    if (!sizes_small(args)) return 0;
    std::ostringstream out, err;
    const int code = run_cli(args, out, err);
    // Exit 0 also comes from --help (a fuzzed "-h..."): check the files when the export says so.
    if (do_export && code == 0 && out.str().find("out.routed_experts.npy") != std::string::npos &&
        !(std::filesystem::exists("out.routed_experts.npy") &&
          std::filesystem::exists("out.attention_mask.npy")))
      __builtin_trap();
    std::error_code ec;
    std::filesystem::remove("out.routed_experts.npy", ec);
    std::filesystem::remove("out.attention_mask.npy", ec);
    return 0;
  }
  if (data[0] % 8 >= 4) {
    // The CLI's file handling: `routes align in.syr -o in.syr` with fuzzed options. Whatever the
    // exit code, the input is either intact (failure) or a complete, valid route file (success);
    // no partial file is ever left behind.
    static const std::string original = [] {
      std::ifstream in("in.syr", std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    }();
    args = {"routes", "align", "in.syr", "-o", "in.syr"};
    std::stringstream ss(text);
    std::string a;
    int n = 0;
    while (std::getline(ss, a, '\n') && n++ < 24) {
      if (a.find('/') == std::string::npos && a != "-o" && a != "--output") args.push_back(a);
    }
    if (!sizes_small(args)) return 0;
    std::ostringstream out, err;
    const int code = run_cli(args, out, err);
    std::ifstream in("in.syr", std::ios::binary);
    const std::string now(std::istreambuf_iterator<char>(in), {});
    if (code != 0 && now != original) __builtin_trap();
    if (code == 0 && !switchyard::verify_route_file("in.syr").ok) __builtin_trap();
    if (std::filesystem::exists(switchyard::RouteFileWriter::partial_path("in.syr"))) __builtin_trap();
    std::ofstream("in.syr", std::ios::binary) << original;  // the next input starts from it
    return 0;
  }
  switch (data[0] % 4) {
    case 0: args = {"routes", "align", "in.syr", "-o", "out.syr"}; break;
    case 1: args = {"routes", "import", "--format", "vllm", "--num-experts", "8", "-o", "out.syr", "in.npy"}; break;
    case 2: args = {"routes", "import", "--format", "sglang", "--num-experts", "8", "-o", "out.syr", "in.jsonl"}; break;
    default: args = {"routes", "stats", "in.syr"}; break;
  }
  std::stringstream ss(text);
  std::string a;
  int n = 0;
  while (std::getline(ss, a, '\n') && n++ < 24) {
    if (a.find('/') != std::string::npos) continue;
    args.push_back(a);
  }
  if (!sizes_small(args)) return 0;
  std::ostringstream out, err;
  (void)run_cli(args, out, err);
  return 0;
}
