// Bad inputs across the public C++ API: each row is one call with one thing wrong, the exception type
// it must raise and a piece of the message it must carry. The rows are the README's table of bad
// inputs (notes/reliability.md); with SY_BAD_INPUT_TABLE=<file> set, the test also writes that table
// in Markdown from the messages it actually got, so the table cannot drift from the code.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>

#include "switchyard/dispatcher.h"
#include "switchyard/error.h"
#include "switchyard/gate.h"
#include "switchyard/permute.h"
#include "switchyard/route_align.h"
#include "switchyard/route_file.h"
#include "switchyard/route_import.h"
#include "switchyard/route_verl.h"
#include "switchyard/router.h"
#include "switchyard/routing_plan.h"
#include "router_testing.h"
#include "testing.h"

namespace switchyard {
namespace {

using switchyard::testing::router_config;

enum class Kind { invalid_argument, out_of_range, data_error, backend_error, logic_error };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::invalid_argument: return "std::invalid_argument";
    case Kind::out_of_range: return "std::out_of_range";
    case Kind::data_error: return "switchyard::DataError";
    case Kind::backend_error: return "switchyard::BackendError";
    case Kind::logic_error: return "std::logic_error";
  }
  return "?";
}

struct Row {
  const char* call;   // the API entry point
  const char* tried;  // what is wrong with the input
  Kind kind;
  const char* expect;  // a piece of the message
  std::function<void()> fn;
};

Tensor f32(const Shape& s, double v = 0.5) { return Tensor::full(s, DType::fp32, v); }
Tensor i32(const std::vector<int32_t>& v, const Shape& s) { return Tensor::from_vector(v, s); }

std::string npy_header(const std::string& dict) {
  std::string h = dict;
  while ((10 + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += static_cast<char>(h.size() & 0xff);
  out += static_cast<char>(h.size() >> 8);
  return out + h;
}

RouteFileInfo info(int64_t E, int64_t K, int64_t L) { return RouteFileInfo{E, K, L, {}, 0, 0, 0}; }

std::string small_file() {
  const std::string path = ::testing::TempDir() + "sy_bad_inputs_small.syr";
  {
    RouteFileWriter w(path, info(8, 2, 1));
    w.append(RouteTable::none(3, 1, 2, 8));
  }
  return path;
}

std::vector<Row> rows() {
  ImportOptions iopt;
  iopt.num_experts = 8;
  ImportOptions sopt = iopt;
  sopt.num_input_layers = 1;
  sopt.top_k = 1;
  std::vector<Row> r = {
      // ---- tensor / threads
      {"Tensor::from_vector", "3 values for shape [2, 2]", Kind::invalid_argument,
       "[tensor] from_vector: 3 values do not fill shape [2, 2]",
       [] { Tensor::from_vector(std::vector<float>{1, 2, 3}, {2, 2}); }},
      {"Tensor::empty", "negative size", Kind::invalid_argument, "[tensor] shape [2, -1] has a negative size",
       [] { Tensor::empty({2, -1}, DType::fp32); }},
      // found by fuzz_cli_args: `routes export --seq-len 9223372036854775807` multiplied the
      // verl batch's shape into a signed overflow (undefined behaviour) before any check
      {"Tensor::zeros", "element count over 2^63-1", Kind::invalid_argument,
       "[tensor] shape [3, 9223372036854775807] has more than 9223372036854775807 elements",
       [] { Tensor::zeros({3, std::numeric_limits<int64_t>::max()}, DType::int32); }},
      {"Tensor::empty", "bytes over 2^62", Kind::invalid_argument,
       "[tensor.empty] shape [2199023255552, 1048576] of fp32 needs 2305843009213693952 x 4 bytes, "
       "more than 2^62",
       [] { Tensor::empty({int64_t{1} << 41, int64_t{1} << 20}, DType::fp32); }},
      {"set_num_threads", "0 threads", Kind::invalid_argument, "[set_num_threads] n must be >= 1, got n=0",
       [] { set_num_threads(0); }},
      {"set_num_threads", "100000 threads (the OpenMP runtime crashed)", Kind::invalid_argument,
       "[set_num_threads] n must be <= 1024", [] { set_num_threads(100000); }},
      // ---- gate
      {"router_gating_linear", "x is 1-D", Kind::invalid_argument, "[router_gating_linear] x must have 2 dimensions, got shape [4]",
       [] { router_gating_linear(f32({4}), f32({8, 4}), Tensor()); }},
      {"router_gating_linear", "hidden of x and weight differ", Kind::invalid_argument,
       "[router_gating_linear] weight must have shape [num_experts, hidden=4] (hidden from x [3, 4]), got [8, 5]",
       [] { router_gating_linear(f32({3, 4}), f32({8, 5}), Tensor()); }},
      {"router_gating_linear", "NaN in x", Kind::invalid_argument,
       "[router_gating_linear] x has a non-finite value nan at token 1, hidden 2",
       [] {
         Tensor x = f32({3, 4});
         x.data<float>()[6] = std::numeric_limits<float>::quiet_NaN();
         router_gating_linear(x, f32({8, 4}), Tensor());
       }},
      {"router_gating_linear", "fp64 x with the fp32 router", Kind::invalid_argument, "[router_gating_linear] x in fp64 needs options.router_dtype fp64 (inputs are upcast exactly, never rounded down), got router_dtype fp32",
       [] { router_gating_linear(Tensor::zeros({3, 4}, DType::fp64), f32({8, 4}), Tensor()); }},
      {"router_gating_linear_backward", "grad_logits of the wrong shape", Kind::invalid_argument,
       "[router_gating_linear_backward] grad_logits must have shape [num_tokens=3, num_experts=8] (from x [3, 4] and weight [8, 4]), got [3, 7]",
       [] { router_gating_linear_backward(f32({3, 7}), f32({3, 4}), f32({8, 4}), Tensor()); }},
      // ---- router
      {"topk_route", "top_k > num_experts", Kind::invalid_argument, "[route] top_k must be in [1, num_experts=4], got top_k=5",
       [] { topk_route(f32({2, 4}), {}, router_config(4, 5)); }},
      {"topk_route", "num_groups does not divide num_experts", Kind::invalid_argument, "[route] num_groups must divide num_experts=6, got num_groups=4",
       [] {
         RouterConfig c = router_config(6, 2);
         c.num_groups = 4;
         c.group_topk = 1;
         topk_route(f32({2, 6}), {}, c);
       }},
      {"topk_route", "int32 logits", Kind::invalid_argument, "[route] logits must have dtype bf16 or fp32 or fp64, got int32",
       [] { topk_route(Tensor::zeros({2, 4}, DType::int32), {}, router_config(4, 2)); }},
      {"topk_route", "+inf logit", Kind::invalid_argument, "[route] logits must be finite, got inf at token 1, expert 1",
       [] {
         Tensor l = f32({2, 4});
         l.data<float>()[5] = std::numeric_limits<float>::infinity();
         topk_route(l, {}, router_config(4, 2));
       }},
      {"topk_route", "replay id outside [0, E)", Kind::invalid_argument, "[replay] token 1: topk_idx row [2, 9] names expert 9 outside [0, 4)",
       [] {
         RouteInputs in;
         in.replay_idx = i32({0, 1, 2, 9}, {2, 2});
         topk_route(f32({2, 4}), in, router_config(4, 2));
       }},
      {"topk_route", "replay row repeats an id", Kind::invalid_argument, "[replay] token 1: topk_idx row [3, 3] repeats expert 3",
       [] {
         RouteInputs in;
         in.replay_idx = i32({0, 1, 3, 3}, {2, 2});
         topk_route(f32({2, 4}), in, router_config(4, 2));
       }},
      {"topk_route", "global_aux_loss without its state", Kind::invalid_argument, "[route] global_aux_loss needs inputs.global_aux_loss_state, got nullptr",
       [] {
         RouterConfig c = router_config(4, 2);
         c.aux_loss_type = AuxLossType::global_aux_loss;
         c.aux_loss_coeff = 0.1;
         topk_route(f32({2, 4}), {}, c);
       }},
      {"topk_route", "negative capacity_factor", Kind::invalid_argument, "[route] capacity_factor must be finite and > 0 (or unset), got -1",
       [] {
         RouterConfig c = router_config(4, 2);
         c.capacity_factor = -1.0;
         topk_route(f32({2, 4}), {}, c);
       }},
      {"parse_score_function", "unknown name", Kind::invalid_argument, "[route] score_function must be softmax, sigmoid or sqrtsoftplus, got \"softmx\"",
       [] { parse_score_function("softmx"); }},
      {"update_expert_bias", "bias and counts of different lengths", Kind::invalid_argument, "[update_expert_bias] num_tokens_per_expert must have shape [4], got [5]",
       [] { update_expert_bias(f32({4}), Tensor::zeros({5}, DType::int64), 1e-3); }},
      // ---- routing plan, permute
      {"build_routing_plan", "id == num_experts", Kind::invalid_argument,
       "[routing_plan] topk_idx must hold ids in [0, num_experts=4) or -1, got topk_idx[1, 0]=4",
       [] { build_routing_plan(i32({0, 1, 4, 2}, {2, 2}), Tensor(), 4); }},
      {"build_routing_plan", "expert_alignment 0", Kind::invalid_argument, "[routing_plan] expert_alignment must be >= 1, got expert_alignment=0",
       [] {
         RoutingPlanOptions o;
         o.expert_alignment = 0;
         build_routing_plan(i32({0, 1}, {1, 2}), Tensor(), 4, o);
       }},
      {"permute", "x has other tokens than the plan", Kind::invalid_argument, "[permute] x must have 1 rows (from the routing plan), got shape [3, 8]",
       [] { permute(f32({3, 8}), build_routing_plan(i32({0, 1}, {1, 2}), Tensor(), 4)); }},
      {"unpermute", "fp64 rows", Kind::invalid_argument, "[unpermute] permuted must have dtype fp32 or bf16, got fp64",
       [] {
         RoutingPlan p = build_routing_plan(i32({0, 1}, {1, 2}), Tensor(), 4);
         unpermute(Tensor::zeros({p.num_rows, 8}, DType::fp64), p);
       }},
      // ---- dispatch (size-1 communicator)
      {"dist::Dispatcher::dispatch", "num_experts 0", Kind::invalid_argument, "[dispatch] num_experts must be >= 1, got num_experts=0",
       [] {
         dist::DispatchOptions o;
         dist::Dispatcher(dist::local()).dispatch(f32({1, 4}), i32({0}, {1, 1}), f32({1, 1}), o);
       }},
      {"dist::Dispatcher::dispatch", "pad_to_capacity without a capacity", Kind::invalid_argument, "[routing_plan] pad_to_capacity needs a capacity (capacity_factor > 0 or expert_capacity >= 0), got neither",
       [] {
         dist::DispatchOptions o;
         o.num_experts = 4;
         o.plan.pad_to_capacity = true;
         dist::Dispatcher(dist::local()).dispatch(f32({1, 4}), i32({0}, {1, 1}), f32({1, 1}), o);
       }},
      {"dist::Dispatcher::dispatch", "NaN in x", Kind::invalid_argument,
       "[dispatch] on rank 0: [dispatch] x has a non-finite value nan at token 0, hidden 1",
       [] {
         dist::DispatchOptions o;
         o.num_experts = 4;
         Tensor x = f32({1, 4});
         x.data<float>()[1] = std::numeric_limits<float>::quiet_NaN();
         dist::Dispatcher(dist::local()).dispatch(x, i32({0}, {1, 1}), f32({1, 1}), o);
       }},
      {"dist::Dispatcher::dispatch", "inf in topk_weights", Kind::invalid_argument,
       "[dispatch] on rank 0: [dispatch] topk_weights has a non-finite value inf at token 0, slot 0",
       [] {
         dist::DispatchOptions o;
         o.num_experts = 4;
         dist::Dispatcher(dist::local())
             .dispatch(f32({1, 4}), i32({0}, {1, 1}),
                       f32({1, 1}, std::numeric_limits<double>::infinity()), o);
       }},
      {"dist::Dispatcher::dispatch", "capacity_factor -1 (meant no capacity)",
       Kind::invalid_argument,
       "capacity_factor must be finite and >= 0 (0 = no capacity), got capacity_factor=-1",
       [] {
         dist::DispatchOptions o;
         o.num_experts = 4;
         o.plan.capacity_factor = -1;
         dist::Dispatcher(dist::local()).dispatch(f32({1, 4}), i32({0}, {1, 1}), f32({1, 1}), o);
       }},
      {"dist::Dispatcher::combine", "a handle that never came from dispatch",
       Kind::invalid_argument,
       "[combine] on rank 0: [combine] handle must come from dispatch on this communicator",
       [] { dist::Dispatcher(dist::local()).combine(f32({0, 4}), dist::DispatchHandle{}); }},
      {"dist::Dispatcher::combine", "NaN in expert_y", Kind::invalid_argument,
       "[combine] on rank 0: [combine] expert_y has a non-finite value nan at row 0, hidden 0",
       [] {
         dist::DispatchOptions o;
         o.num_experts = 4;
         dist::Dispatcher disp(dist::local());
         dist::DispatchResult d = disp.dispatch(f32({1, 4}), i32({0}, {1, 1}), f32({1, 1}), o);
         disp.combine(f32({1, 4}, std::numeric_limits<double>::quiet_NaN()), d.handle);
       }},
      {"dist::Dispatcher::dispatch", "a communicator another thread is using", Kind::logic_error,
       "[dispatch] the local communicator (rank 0 of 1) is in use by another thread (combine)",
       [] {
         dist::DispatchOptions o;
         o.num_experts = 4;
         auto c = dist::local();
         const dist::Communicator::Exclusive other(*c, "combine");
         dist::Dispatcher(c).dispatch(f32({1, 4}), i32({0}, {1, 1}), f32({1, 1}), o);
       }},
      // ---- routes
      {"parse_moe_layer_freq", "entry 2", Kind::invalid_argument, "[layer_map] moe_layer_freq item must be 0, 1 or NxV with V in {0,1}, got \"2\"",
       [] { parse_moe_layer_freq("1,2"); }},
      {"parse_moe_layer_freq", "repeat count missing", Kind::invalid_argument, "[layer_map] moe_layer_freq item must be 0, 1 or NxV, got \"x1\"",
       [] { parse_moe_layer_freq("x1"); }},
      {"moe_layer_indices", "frequency list of the wrong length", Kind::invalid_argument, "[layer_map] moe_layer_freq must have one entry per hidden layer (5 = 5 input layers - 0 MTP layers), got 3 entries",
       [] {
         LayerMap m;
         m.moe_layer_freq = {0, 1, 1};
         moe_layer_indices(m, 5);
       }},
      {"check_route_table", "id >= num_experts", Kind::invalid_argument, "[check] t: ids must be -1 or in [0, num_experts=8), got 9 at token 0, layer 0, slot 1",
       [] {
         RouteTable t{i32({0, 9}, {1, 1, 2}), 8};
         check_route_table(t, "check", "t");
       }},
      {"RouteFileWriter", "top_k 0", Kind::invalid_argument, "[route_file] top_k must be in [1, 65536], got 0",
       [] { RouteFileWriter w(::testing::TempDir() + "sy_bad_inputs_k0.syr", info(8, 0, 2)); }},
      {"RouteFileWriter", "directory does not exist", Kind::backend_error, "/no/such/dir/x.syr",
       [] { RouteFileWriter w("/no/such/dir/x.syr", info(8, 2, 2)); }},
      {"RouteFileWriter", "a second writer on the same path", Kind::backend_error,
       "is being written by another RouteFileWriter (lock on",
       [] {
         const std::string path = ::testing::TempDir() + "sy_bad_inputs_twice.syr";
         RouteFileWriter first(path, info(8, 2, 1));
         RouteFileWriter second(path, info(8, 2, 1));
       }},
      {"RouteFileWriter", "path is a directory (the commit would rename over it)",
       Kind::invalid_argument, "[route_file] path must be a regular file or not exist, got /tmp (a directory)",
       [] { RouteFileWriter w("/tmp", info(8, 2, 1)); }},
      {"RouteFileWriter::append", "table with 2 layers into a 1-layer file", Kind::invalid_argument, "[route_file.append] table must have num_experts=8, num_moe_layers=1, top_k=2 like the file, got num_experts=8, num_moe_layers=2, top_k=2",
       [] {
         RouteFileWriter w(::testing::TempDir() + "sy_bad_inputs_append.syr", info(8, 2, 1));
         w.append(RouteTable::none(3, 2, 2, 8));
       }},
      // the source location from src/ on, whatever directory the build ran in (ccache's
      // CCACHE_BASEDIR hands the compiler "../src/...")
      {"RouteFileReader::open", "missing file", Kind::backend_error,
       "open(/no/such/file.syr): No such file or directory (src/routes/route_file.cpp:",
       [] { RouteFileReader::open("/no/such/file.syr"); }},
      {"RouteFileReader::from_bytes", "100 bytes of text", Kind::data_error,
       "[route_file] <memory>: not a route file (bad magic at byte offset 0)", [] { RouteFileReader::from_bytes(std::string(100, 'x')); }},
      {"RouteFileReader::from_bytes", "the first 20 bytes of a file", Kind::data_error, "[route_file] <memory>: truncated header: file has 20 bytes, a header needs at least 48",
       [] {
         std::ifstream in(small_file(), std::ios::binary);
         std::string b(std::istreambuf_iterator<char>(in), {});
         RouteFileReader::from_bytes(b.substr(0, 20));
       }},
      {"RouteFileReader::read", "sequence index past the end", Kind::out_of_range, "[route_file] sequence 5 out of range [0, 1)",
       [] { RouteFileReader::open(small_file()).read(5); }},
      {"import_vllm_npy_bytes", "not a .npy file", Kind::invalid_argument, "[import] x.npy: not a .npy file (bad magic)",
       [iopt] { import_vllm_npy_bytes("hello", "x.npy", iopt); }},
      {"import_vllm_npy_bytes", "float32 array", Kind::invalid_argument, "[import] x.npy: .npy dtype must be a little-endian integer (e.g. '<i4'), got '<f4'",
       [iopt] {
         import_vllm_npy_bytes(npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1), }") +
                                   std::string(4, '\0'),
                               "x.npy", iopt);
       }},
      {"import_vllm_npy_bytes", "id 8 with num_experts 8", Kind::invalid_argument, "[import] x.npy (sequence 0): expert id 8 at token 0, hidden layer 0, slot 0 is outside [0, num_experts=8)",
       [iopt] {
         const int32_t v = 8;
         import_vllm_npy_bytes(npy_header("{'descr': '<i4', 'fortran_order': False, 'shape': (1, 1, 1), }") +
                                   std::string(reinterpret_cast<const char*>(&v), 4),
                               "x.npy", iopt);
       }},
      {"import_vllm_npy_bytes", "header claims more data than present", Kind::invalid_argument, "[import] x.npy: .npy data is 0 bytes, shape (1000, 4, 2) needs 32000",
       [iopt] {
         import_vllm_npy_bytes(npy_header("{'descr': '<i4', 'fortran_order': False, 'shape': (1000, 4, 2), }"),
                               "x.npy", iopt);
       }},
      {"import_vllm_npy_bytes", "a row that repeats an id", Kind::invalid_argument,
       "[import] x.npy (sequence 0): row [3, 3] at token 0, hidden layer 0 repeats expert 3",
       [iopt] {
         import_vllm_npy_bytes(encode_npy_int32(i32({3, 3}, {1, 1, 2})), "x.npy", iopt);
       }},
      {"import_sglang_text", "record without meta_info", Kind::invalid_argument, "[import] r.jsonl: record has no meta_info object",
       [sopt] { import_sglang_text("{\"text\": \"hi\"}\n", "r.jsonl", sopt); }},
      {"import_sglang_text", "not JSON", Kind::invalid_argument, "[import] r.jsonl:1: not valid JSON (nor is the whole file)",
       [sopt] { import_sglang_text("{\"meta_info\": ", "r.jsonl", sopt); }},
      {"import_sglang_text", "start_len past the prompt", Kind::invalid_argument, "[import] g.json: meta_info.routed_experts_start_len=5 is past the prompt (prompt_tokens=3); SGLang allows [0, prompt_tokens]",
       [sopt] {
         import_sglang_text("{\"meta_info\": {\"routed_experts\": \"AAAAAA==\", \"routed_experts_start_len\": 5, \"prompt_tokens\": 3}}",
                            "g.json", sopt);
       }},
      {"import_vllm_http_text", "a choice without routes", Kind::invalid_argument, "[import] r.json: choices[0].routed_experts is missing or null (the server needs --enable-return-routed-experts; null also means the request was aborted before any forward pass)",
       [iopt] { import_vllm_http_text("{\"choices\": [{\"routed_experts\": null}]}", "r.json", iopt); }},
      {"import_vllm_http_text", "prompt start outside the prompt", Kind::invalid_argument, "[import] r.json: routed_experts_prompt_start=3 is not inside the prompt (usage.prompt_tokens=2); vLLM requires it to be smaller than the prompt length",
       [iopt] {
         import_vllm_http_text("{\"routed_experts_prompt_start\": 3, \"usage\": {\"prompt_tokens\": 2}, \"choices\": [{\"routed_experts\": \"x\"}]}",
                               "r.json", iopt);
       }},
      {"to_verl", "a row mixing -1 with ids", Kind::invalid_argument, "[to_verl] tables[0]: row at token 0, MoE layer 1 mixes -1 with expert ids; verl's layout has no place for it",
       [] {
         RouteTable t = RouteTable::none(1, 2, 2, 8);
         t.topk_idx.data<int32_t>()[2] = 3;
         to_verl({t}, {0, 1}, VerlOptions{2, PaddingSide::left, 0});
       }},
      {"to_verl", "seq_len too short", Kind::invalid_argument, "[to_verl] seq_len=2 is shorter than the longest table (3 tokens)",
       [] { to_verl({RouteTable::none(3, 2, 2, 8)}, {0, 1}, VerlOptions{2, PaddingSide::left, 2}); }},
      {"to_verl", "seq_len whose batch overflows (found by fuzz_cli_args)", Kind::invalid_argument,
       "[to_verl] seq_len=9223372036854775807 makes routed_experts [1, 9223372036854775807, 2, 2] "
       "larger than 2^62 bytes",
       [] {
         to_verl({RouteTable::none(3, 2, 2, 8)}, {0, 1},
                 VerlOptions{2, PaddingSide::right, std::numeric_limits<int64_t>::max()});
       }},
      {"base64_decode", "a '*' in the text", Kind::invalid_argument, "[base64] invalid character code 42 at position 3",
       [] { base64_decode("AAA*"); }},
      {"pack_thd", "tp_size 0", Kind::invalid_argument, "[pack_thd] tp_size must be >= 1, got 0",
       [] { pack_alignment({0, 1, 0}); }},
      {"sp_split", "tokens not divisible by tp_size", Kind::invalid_argument, "[sp_split] num_tokens must be a multiple of tp_size=2, got 5",
       [] { sp_split(RouteTable::none(5, 1, 1, 4), 2, 0); }},
  };
  return r;
}

TEST(BadInputs, EveryRowRaisesItsTypeWithItsMessage) {
  std::string table =
      "| call | input tried | exception | message |\n|---|---|---|---|\n";
  for (const Row& row : rows()) {
    SCOPED_TRACE(std::string(row.call) + ": " + row.tried);
    std::string got_kind = "no exception", msg;
    try {
      row.fn();
    } catch (const DataError& e) {
      got_kind = kind_name(Kind::data_error), msg = e.what();
    } catch (const BackendError& e) {
      got_kind = kind_name(Kind::backend_error), msg = e.what();
    } catch (const std::invalid_argument& e) {
      got_kind = kind_name(Kind::invalid_argument), msg = e.what();
    } catch (const std::out_of_range& e) {
      got_kind = kind_name(Kind::out_of_range), msg = e.what();
    } catch (const std::logic_error& e) {
      got_kind = kind_name(Kind::logic_error), msg = e.what();
    } catch (const std::exception& e) {
      got_kind = std::string("other: ") + typeid(e).name(), msg = e.what();
    }
    EXPECT_EQ(got_kind, kind_name(row.kind)) << msg;
    EXPECT_NE(msg.find(row.expect), std::string::npos) << "message: " << msg << "\nexpected to contain: " << row.expect;
    std::string m = msg;
    for (size_t p = 0; (p = m.find('|', p)) != std::string::npos; p += 2) m.replace(p, 1, "\\|");
    table += std::string("| `") + row.call + "` | " + row.tried + " | `" + got_kind + "` | " + m + " |\n";
  }
  if (const char* out = std::getenv("SY_BAD_INPUT_TABLE")) std::ofstream(out) << table;
}

}  // namespace
}  // namespace switchyard
