// Importers of issue 25's engine layouts: TensorRT-LLM ([seq_len-1, num_moe_layers, K], MoE layers
// only), FlashInfer's per-layer routing_replay_out buffers split by cu_seqlens, vLLM streamed
// chunks (VllmRouteStream, recorded SSE streams) and SGLang's OpenAI-compatible
// choices[i].sgl_ext.routed_experts. Valid input, every bad-input class (each error names the
// source / request, token, layer and value; a failed chunk changes nothing), and the CLI formats.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "cli_testing.h"
#include "switchyard/route_file.h"
#include "switchyard/route_import.h"
#include "testing.h"

namespace switchyard {
namespace {

namespace fs = std::filesystem;

// A route array [rows, layers, K] of valid rows: distinct ids (r + l + k*3) % E, K <= E / 3.
std::vector<int32_t> routes(int64_t rows, int64_t layers, int64_t K, int64_t E, int64_t r0 = 0) {
  std::vector<int32_t> v;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t k = 0; k < K; ++k) v.push_back(int32_t((r0 + r + l + k * 3) % E));
  return v;
}

Tensor t3(const std::vector<int32_t>& v, int64_t rows, int64_t layers, int64_t K) {
  return Tensor::from_vector(v, {rows, layers, K});
}

std::string npy_i32(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
  return encode_npy("<i4", shape, v.data(), v.size() * sizeof(int32_t));
}

// Expected table: `rows` rows of `v` ([rows, L, K]) keeping columns `keep`, `pre` -1 rows before,
// `post` after.
RouteTable table_of(const std::vector<int32_t>& v, int64_t rows, int64_t L, int64_t K, int64_t E,
                    const std::vector<int64_t>& keep, int64_t pre, int64_t post) {
  const int64_t M = int64_t(keep.size());
  RouteTable t = RouteTable::none(pre + rows + post, M, K, E);
  int32_t* p = t.topk_idx.data<int32_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k)
        p[((pre + r) * M + m) * K + k] = v[size_t((r * L + keep[size_t(m)]) * K + k)];
  return t;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no std::invalid_argument)";
}

#define EXPECT_ERROR(stmt, piece) \
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, piece, error_of([&] { stmt; }))

ImportOptions opts(int64_t E, int64_t fkd = 0, int64_t mtp = 0) {
  ImportOptions o;
  o.num_experts = E;
  o.layer_map.first_k_dense = fkd;
  o.layer_map.num_mtp_layers = mtp;
  return o;
}

// ---- TensorRT-LLM
// --------------------------------------------------------------------------------

TEST(RouteEngines, TrtllmKeepsEveryMoeColumnAndNamesHiddenLayers) {
  const int64_t rows = 4, L = 3, K = 2, E = 16;
  const auto v = routes(rows, L, K, E);
  ImportOptions o = opts(E, /*fkd=*/1);
  ImportResult r = import_trtllm_arrays({t3(v, rows, L, K)}, o);
  ASSERT_EQ(r.sequences.size(), 1u);
  EXPECT_TRUE(route_tables_equal(r.sequences[0], table_of(v, rows, L, K, E, {0, 1, 2}, 0, 1)));
  EXPECT_EQ(r.report.moe_layers, (std::vector<int64_t>{1, 2, 3}));  // hidden layers, not dropped
  EXPECT_EQ(r.report.num_hidden_layers, 4);
  EXPECT_EQ(r.report.num_tokens, rows + 1);
  EXPECT_EQ(r.sources, (std::vector<std::string>{"trtllm[0]"}));
  // The same from .npy bytes; a frequency list names the columns; MTP columns are left out.
  ImportResult n = import_trtllm_npy_bytes(npy_i32(v, {rows, L, K}), "s.npy", o);
  EXPECT_TRUE(route_tables_equal(n.sequences[0], r.sequences[0]));
  ImportOptions f = opts(E);
  f.layer_map.moe_layer_freq = {0, 1, 0, 1, 1, 0};
  ImportResult fr = import_trtllm_arrays({t3(v, rows, L, K)}, f);
  EXPECT_EQ(fr.report.moe_layers, (std::vector<int64_t>{1, 3, 4}));
  EXPECT_EQ(fr.report.num_hidden_layers, 6);
  ImportResult m = import_trtllm_arrays({t3(v, rows, L, K)}, opts(E, 0, /*mtp=*/1));
  EXPECT_TRUE(route_tables_equal(m.sequences[0], table_of(v, rows, L, K, E, {0, 1}, 0, 1)));
  EXPECT_EQ(m.report.moe_layers, (std::vector<int64_t>{0, 1}));
  // prompt_start puts -1 rows first, as for vLLM.
  ImportOptions ps = o;
  ps.prompt_start = 2;
  EXPECT_TRUE(route_tables_equal(import_trtllm_arrays({t3(v, rows, L, K)}, ps).sequences[0],
                                 table_of(v, rows, L, K, E, {0, 1, 2}, 2, 1)));
}

TEST(RouteEngines, TrtllmBadInputsNameSourceTokenLayerAndValue) {
  const int64_t rows = 3, L = 3, K = 2, E = 8;
  auto v = routes(rows, L, K, E);
  ImportOptions f = opts(E);
  f.layer_map.moe_layer_freq = {1, 0, 1};  // 2 MoE layers for 3 columns
  EXPECT_ERROR(import_trtllm_arrays({t3(v, rows, L, K)}, f),
               "the input has 3 MoE layers (its layer axis holds only MoE layers) but the layer "
               "map has 2");
  auto bad = v;
  bad[size_t((1 * L + 2) * K + 1)] = 9;  // token 1, MoE layer 2, slot 1
  EXPECT_ERROR(import_trtllm_arrays({t3(bad, rows, L, K)}, opts(E)),
               "[import] trtllm[0] (sequence 0): expert id 9 at token 1, MoE layer 2, slot 1 is "
               "outside [0, num_experts=8)");
  auto dup = v;
  dup[size_t((2 * L + 0) * K + 1)] = dup[size_t((2 * L + 0) * K)];
  EXPECT_ERROR(import_trtllm_arrays({t3(dup, rows, L, K)}, opts(E)),
               "at token 2, MoE layer 0 repeats expert");
  ImportOptions none = opts(E);
  none.invalid_rows = ReplayRowPolicy::native;
  ImportResult r = import_trtllm_arrays({t3(dup, rows, L, K)}, none);
  EXPECT_EQ(r.report.num_invalid_rows, 1);
  EXPECT_EQ(r.sequences[0].topk_idx.data<int32_t>()[(2 * L + 0) * K], -1);
  auto mixed = v;
  mixed[0] = -1;
  EXPECT_ERROR(import_trtllm_arrays({t3(mixed, rows, L, K)}, opts(E)), "mixes -1 and ids");
  EXPECT_ERROR(import_trtllm_arrays({Tensor::from_vector(v, {rows, L * K})}, opts(E)),
               "trtllm[0]: expected a 3-D array [seq_len-1, num_moe_layers, top_k]");
  EXPECT_ERROR(import_trtllm_arrays({Tensor::zeros({2, 2, 2}, DType::fp32)}, opts(E)),
               "trtllm[0]: dtype must be int32, int64, int16, uint16 or uint8, got fp32");
  EXPECT_ERROR(import_trtllm_npy_bytes("nope", "x.npy", opts(E)), "x.npy: not a .npy file");
  EXPECT_ERROR(import_trtllm_arrays({t3(v, rows, L, K)}, opts(E, 0, 3)), "no MoE layer left");
}

// ---- FlashInfer routing_replay_out -------------------------------------------------------------

TEST(RouteEngines, FlashinferSplitsTheBatchBySequenceAndIgnoresRowsPastIt) {
  const int64_t N = 7, used = 5, L = 2, K = 2, E = 16;
  // Per-layer buffers [N, K]; rows past `used` hold what an oversized buffer held (garbage).
  std::vector<std::vector<int16_t>> bufs(L);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        bufs[size_t(l)].push_back(n < used ? int16_t((n + l + 3 * k) % E) : int16_t(999));
  const std::vector<int64_t> cu = {0, 2, 2, 5};  // sequence 1 has no token in this batch
  ImportResult r = import_flashinfer_replay({bufs[0].data(), bufs[1].data()}, N, K, cu, opts(E, 1));
  ASSERT_EQ(r.sequences.size(), 3u);
  EXPECT_EQ(r.report.moe_layers, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(r.report.num_tokens, 5);
  for (int s = 0; s < 3; ++s) {
    const RouteTable& t = r.sequences[size_t(s)];
    ASSERT_EQ(t.num_tokens(), cu[size_t(s) + 1] - cu[size_t(s)]);  // no -1 row appended
    for (int64_t i = 0; i < t.num_tokens(); ++i)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t k = 0; k < K; ++k)
          EXPECT_EQ(t.topk_idx.data<int32_t>()[(i * L + l) * K + k],
                    bufs[size_t(l)][size_t((cu[size_t(s)] + i) * K + k)]);
  }
  // Tensors (int16 widened by the caller) give the same tables; so does one stacked .npy.
  std::vector<Tensor> ts;
  std::vector<int32_t> stacked;
  for (auto& b : bufs) {
    std::vector<int32_t> w(b.begin(), b.end());
    ts.push_back(Tensor::from_vector(w, {N, K}));
  }
  for (auto& b : bufs) stacked.insert(stacked.end(), b.begin(), b.end());
  ImportResult rt = import_flashinfer_replay(ts, cu, opts(E, 1));
  std::vector<int16_t> s16(stacked.begin(), stacked.end());
  ImportResult rn = import_flashinfer_npy_bytes(
      encode_npy("<i2", {L, N, K}, s16.data(), s16.size() * 2), "b.npy", cu, opts(E, 1));
  for (size_t s = 0; s < 3; ++s) {
    EXPECT_TRUE(route_tables_equal(rt.sequences[s], r.sequences[s]));
    EXPECT_TRUE(route_tables_equal(rn.sequences[s], r.sequences[s]));
  }
}

TEST(RouteEngines, FlashinferBadInputsNameTheSequenceTokenLayerAndValue) {
  const int64_t N = 4, K = 2, E = 8;
  std::vector<int16_t> a = {0, 1, 2, 3, 4, 5, 6, 7}, b = {1, 2, 3, 4, 5, 6, 7, 0};
  auto run = [&](const std::vector<int64_t>& cu, const ImportOptions& o) {
    return import_flashinfer_replay({a.data(), b.data()}, N, K, cu, o);
  };
  EXPECT_ERROR(run({1, 4}, opts(E)), "cu_seqlens must start at 0, got 1");
  EXPECT_ERROR(run({0, 3, 2}, opts(E)), "cu_seqlens must be non-decreasing");
  EXPECT_ERROR(run({0, 5}, opts(E)), "cu_seqlens ends at 5 but the buffers hold 4 rows");
  EXPECT_ERROR(run({}, opts(E)), "cu_seqlens must start at 0");
  b[5] = 11;  // batch row 2, layer 1, slot 1 -> sequence 1 token 0
  EXPECT_ERROR(run({0, 2, 4}, opts(E)),
               "[import] flashinfer (batch rows 2..4) (sequence 1): expert id 11 at "
               "token 0, MoE layer 1, slot 1 is outside [0, num_experts=8)");
  b[5] = 5;  // row [5, 5]: repeats expert 5
  EXPECT_ERROR(run({0, 2, 4}, opts(E)), "row [5, 5] at token 0, MoE layer 1 repeats expert 5");
  ImportOptions none = opts(E);
  none.invalid_rows = ReplayRowPolicy::native;
  EXPECT_EQ(run({0, 2, 4}, none).report.num_invalid_rows, 1);
  EXPECT_ERROR(import_flashinfer_replay(std::vector<Tensor>{Tensor::zeros({4, 2}, DType::int32),
                                                            Tensor::zeros({4, 3}, DType::int32)},
                                        {0, 4}, opts(E)),
               "layers[1]: [4, 3] int32 differs from layers[0]: [4, 2] int32");
  EXPECT_ERROR(import_flashinfer_replay(std::vector<Tensor>{}, {0}, opts(E)),
               "one routing_replay_out per MoE layer");
}

// ---- vLLM streamed chunks ----------------------------------------------------------------------

// One request: prompt P tokens, G generated; vLLM's whole array [P + G - 1, L, K].
struct Rollout {
  int64_t P = 5, G = 4, L = 3, K = 2, E = 16;
  std::vector<int32_t> all = routes(P + G - 1, L, K, E);
  std::vector<int32_t> rows(int64_t b, int64_t e) const {
    return {all.begin() + b * L * K, all.begin() + e * L * K};
  }
  Tensor chunk(int64_t b, int64_t e) const { return t3(rows(b, e), e - b, L, K); }
};

TEST(RouteEngines, StreamDeltaAndTerminalChunksGiveTheWholeArraysTable) {
  Rollout x;
  ImportOptions o = opts(x.E, 1);
  const RouteTable whole = import_vllm_arrays({t3(x.all, x.P + x.G - 1, x.L, x.K)}, o).sequences[0];
  // Delta: the prefill chunk brings the prompt's P rows and token 1, then one row per token.
  VllmRouteStream d(o);
  d.add("a", x.chunk(0, x.P), -1, 1, x.P);
  for (int64_t g = 1; g < x.G; ++g) d.add("a", x.chunk(x.P + g - 1, x.P + g), -1, 1);
  EXPECT_EQ(d.pending(), (std::vector<std::string>{"a"}));
  ImportResult r = d.finish("a");
  EXPECT_TRUE(route_tables_equal(r.sequences[0], whole));
  EXPECT_EQ(r.report.moe_layers, (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(d.pending().empty());
  // Terminal: tokens without routes, then the whole array on the last chunk (prompt inferred).
  VllmRouteStream t(o);
  t.add_tokens("b", 1);
  t.add_tokens("b", 2);
  t.add("b", x.chunk(0, x.P + x.G - 1), -1, 1);
  EXPECT_TRUE(route_tables_equal(t.finish("b").sequences[0], whole));
  // Explicit starts, and a prompt_start: -1 rows before it.
  VllmRouteStream s(o);
  s.set_prompt_start("c", 2);
  s.add("c", x.chunk(2, 4), 2);
  s.add("c", x.chunk(4, 8), 4);
  ImportOptions o2 = o;
  o2.prompt_start = 2;
  EXPECT_TRUE(route_tables_equal(s.finish("c").sequences[0],
                                 import_vllm_arrays({x.chunk(2, 8)}, o2).sequences[0]));
}

TEST(RouteEngines, StreamRejectsGapsOverlapsAndShapeChangesAndAFailedChunkChangesNothing) {
  Rollout x;
  ImportOptions o = opts(x.E);
  VllmRouteStream s(o);
  s.add("r1", x.chunk(0, x.P), -1, 1, x.P);
  EXPECT_ERROR(s.add("r1", x.chunk(x.P + 1, x.P + 2), x.P + 1),
               "request 'r1' chunk 1: routes start at token 6 but the request's routes so far end "
               "at token 5: a gap, tokens 5..5 have no chunk");
  EXPECT_ERROR(s.add("r1", x.chunk(x.P - 1, x.P), x.P - 1), "an overlap, tokens 4..4 already came");
  // A cumulative chunk (every row so far again) for one new token: an overlap by token count.
  EXPECT_ERROR(s.add("r1", x.chunk(0, x.P + 1), -1, 1),
               "request 'r1' chunk 1: routes now end at token 11 but the prompt (5 tokens) and 2 "
               "generated tokens need routes up to token 6: an overlap");
  // A dropped chunk: 2 new tokens, 1 row.
  EXPECT_ERROR(s.add("r1", x.chunk(x.P, x.P + 1), -1, 2), ": a gap (a chunk without its routes?)");
  EXPECT_ERROR(s.add("r1", t3(routes(1, x.L + 1, x.K, x.E), 1, x.L + 1, x.K)),
               "request 'r1' chunk 1: [1, 4, 2] routes, but the stream's chunks have 3 layers and "
               "top_k 2");
  auto bad = x.rows(x.P, x.P + 1);
  bad[3] = 77;  // layer 1, slot 1 of token 5
  EXPECT_ERROR(
      s.add("r1", t3(bad, 1, x.L, x.K), -1, 1),
      "request 'r1' chunk 1 (sequence 0): expert id 77 at token 5, hidden layer 1, slot 1");
  auto dup = x.rows(x.P, x.P + 1);
  dup[1] = dup[0];
  EXPECT_ERROR(s.add("r1", t3(dup, 1, x.L, x.K), -1, 1),
               "at token 5, hidden layer 0 repeats expert");
  EXPECT_ERROR(s.add_npy("r1", "garbage"), "request 'r1': not a .npy file");
  // None of that changed the request: the right chunks still complete it.
  for (int64_t g = 1; g < x.G; ++g) s.add("r1", x.chunk(x.P + g - 1, x.P + g), -1, 1);
  EXPECT_TRUE(
      route_tables_equal(s.finish("r1").sequences[0],
                         import_vllm_arrays({t3(x.all, x.P + x.G - 1, x.L, x.K)}, o).sequences[0]));
  // A truncated request, an unknown one, one without routes.
  s.add("r2", x.chunk(0, x.P), -1, 1, x.P);
  s.add_tokens("r2", 2);
  EXPECT_ERROR(s.finish("r2"),
               "request 'r2': routes cover tokens 0..4 but 5 prompt and 3 "
               "generated tokens need routes up to token 6 (the stream is "
               "truncated?)");
  EXPECT_THROW(s.finish("nope"), std::out_of_range);
  s.add_tokens("r3", 1);
  EXPECT_ERROR(s.finish("r3"), "request 'r3': no routes arrived in its 1 chunks");
  EXPECT_ERROR(VllmRouteStream bad_stream(opts(0)), "num_experts must be >= 1");
  // A finished request takes no more chunks (a repeated final chunk).
  EXPECT_ERROR(s.add("r1", x.chunk(0, 1)), "request 'r1' already finished");
  EXPECT_ERROR(s.add_tokens("r1", 1), "request 'r1' already finished");
}

std::string sse(const std::string& id, int64_t index, int64_t tokens, const std::string& npy,
                bool finish, int64_t prompt = -1) {
  std::string toks = "[";
  for (int64_t i = 0; i < tokens; ++i) toks += (i ? ",7" : "7");
  toks += "]";
  std::string s = "data: {\"request_id\": \"" + id +
                  "\", \"choices\": [{\"index\": " + std::to_string(index) +
                  ", \"token_ids\": " + toks + ", \"routed_experts\": " +
                  (npy.empty() ? std::string("null") : "\"" + base64_encode(npy) + "\"") +
                  ", \"finish_reason\": " + (finish ? "\"stop\"" : "null") + "}]";
  if (prompt >= 0) s += ", \"usage\": {\"prompt_tokens\": " + std::to_string(prompt) + "}";
  return s + "}";
}

TEST(RouteEngines, RecordedSseStreamsInterleaveRequestsAndMustFinish) {
  Rollout x;
  ImportOptions o = opts(x.E, 1);
  auto npy = [&](int64_t b, int64_t e) { return npy_i32(x.rows(b, e), {e - b, x.L, x.K}); };
  std::string text = ": keep-alive\n" + sse("q", 0, 1, npy(0, x.P), false, x.P) + "\n\n" +
                     sse("p", 0, 2, "", false) + "\n";
  for (int64_t g = 1; g < x.G; ++g)
    text += sse("q", 0, 1, npy(x.P + g - 1, x.P + g), g + 1 == x.G) + "\n";
  text += sse("p", 0, 2, npy(0, x.P + x.G - 1), true) + "\ndata: [DONE]\n";
  ImportResult r = import_vllm_stream_text(text, "s.txt", o);
  const RouteTable whole = import_vllm_arrays({t3(x.all, x.P + x.G - 1, x.L, x.K)}, o).sequences[0];
  ASSERT_EQ(r.sequences.size(), 2u);
  EXPECT_EQ(r.sources, (std::vector<std::string>{"s.txt request 'q/0'", "s.txt request 'p/0'"}));
  EXPECT_TRUE(route_tables_equal(r.sequences[0], whole));
  EXPECT_TRUE(route_tables_equal(r.sequences[1], whole));
  // Truncated: the last chunk of q lost.
  std::string cut =
      text.substr(0, text.rfind(sse("q", 0, 1, npy(x.P + x.G - 2, x.P + x.G - 1), true)));
  EXPECT_ERROR(import_vllm_stream_text(cut, "s.txt", o),
               "s.txt: request 'q/0' (and 1 more) never got a chunk with finish_reason: the stream "
               "is truncated");
  // A chunk that repeats the earlier routes: the error names the file and line.
  std::string rep =
      sse("q", 0, 1, npy(0, x.P), false, x.P) + "\n" + sse("q", 0, 1, npy(0, x.P + 1), true) + "\n";
  EXPECT_ERROR(import_vllm_stream_text(rep, "s.txt", o),
               "[import] s.txt:2: request 'q/0' chunk 1: routes now end at token 11");
  EXPECT_ERROR(import_vllm_stream_text("data: {nope\n", "s.txt", o),
               "s.txt:1: stream chunk: not a JSON object");
  // Continuous usage: a chunk repeated (or lost) shows in completion_tokens even when its routes
  // would fit.
  auto with_usage = [&](int64_t b, int64_t e, int64_t done, bool fin) {
    std::string c = sse("u", 0, 1, npy(b, e), fin);
    return c.substr(0, c.size() - 1) +
           ", \"usage\": {\"prompt_tokens\": 1, \"completion_tokens\": " + std::to_string(done) +
           "}}\n";
  };
  const std::string ok = with_usage(0, 1, 1, false) + with_usage(1, 2, 2, true);
  EXPECT_EQ(import_vllm_stream_text(ok, "u.txt", o).sequences.size(), 1u);
  const std::string again = with_usage(0, 1, 1, false) + with_usage(0, 1, 1, false);
  EXPECT_ERROR(import_vllm_stream_text(again, "u.txt", o),
               "u.txt:2: request 'u/0' chunk 1: usage.completion_tokens=1 but the chunks so far "
               "emitted 2 tokens (a repeated chunk?)");
  EXPECT_ERROR(
      import_vllm_stream_text(
          "data: {\"id\": \"z\", \"choices\": [{\"index\": 0, \"routed_experts\": \"@@\"}]}\n",
          "s.txt", o),
      "s.txt:1: request 'z/0' chunk: routed_experts: [base64] invalid character");
}

// ---- SGLang's OpenAI-compatible responses ------------------------------------------------------

TEST(RouteEngines, SglangChatCompletionSglExtWithSavedStartLen) {
  const int64_t rows = 3, L = 2, K = 2, E = 8;
  auto v = routes(rows, L, K, E);
  for (int64_t r = 0; r < rows; ++r) v[size_t(r * L * K)] = v[size_t(r * L * K) + 1] = 0;  // dense
  const std::string b64 =
      base64_encode(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  ImportOptions o = opts(E, 1);
  o.num_input_layers = L;
  o.top_k = K;
  const std::string chat =
      "{\"object\": \"chat.completion\", \"routed_experts_start_len\": 2, "
      "\"choices\": [{\"index\": 0, \"message\": {\"content\": \"x\"}, "
      "\"sgl_ext\": {\"routed_experts\": \"" +
      b64 +
      "\"}}], "
      "\"usage\": {\"prompt_tokens\": 4, \"completion_tokens\": 2}}";
  ImportResult r = import_sglang_text(chat, "c.json", o);
  ASSERT_EQ(r.sequences.size(), 1u);
  EXPECT_TRUE(route_tables_equal(r.sequences[0], table_of(v, rows, L, K, E, {1}, 2, 1)));
  EXPECT_EQ(r.sources, (std::vector<std::string>{"c.json choices[0].sgl_ext.routed_experts"}));
  EXPECT_TRUE(r.report.warnings.empty());  // 4 + 2 = 2 + 3 + 1
  // Older servers: choices[i].routed_experts.
  const std::string old = "{\"choices\": [{\"routed_experts\": \"" + b64 + "\"}]}";
  EXPECT_TRUE(route_tables_equal(import_sglang_text(old, "c.json", o).sequences[0],
                                 table_of(v, rows, L, K, E, {1}, 0, 1)));
  EXPECT_ERROR(import_sglang_text("{\"choices\": [{\"text\": \"x\"}]}", "c.json", o),
               "c.json: choices[0] has no sgl_ext.routed_experts");
  EXPECT_ERROR(import_sglang_text("{\"routed_experts_start_len\": 9, \"choices\": [{\"sgl_ext\": "
                                  "{\"routed_experts\": \"" +
                                      b64 +
                                      "\"}}], \"usage\": "
                                      "{\"prompt_tokens\": 4}}",
                                  "c.json", o),
               "routed_experts_start_len=9 is past the prompt (prompt_tokens=4)");
  EXPECT_ERROR(import_sglang_text("{\"choices\": [{\"sgl_ext\": {\"routed_experts\": \"AAAA\"}}]}",
                                  "c.json", o),
               "c.json choices[0].sgl_ext.routed_experts: routed_experts holds 3 bytes");
}

// ---- the CLI: each format imports; bad input writes nothing ------------------------------------

class CliEngines : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("sy_cli_engines_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  void write(const std::string& name, const std::string& bytes) const {
    std::ofstream(p(name), std::ios::binary) << bytes;
  }
  fs::path dir_;
};

TEST_F(CliEngines, EachFormatImportsAndABadInputLeavesTheOutputAsItWas) {
  Rollout x;
  write("t.npy", npy_i32(x.all, {x.P + x.G - 1, x.L, x.K}));
  std::vector<int16_t> fl;
  for (int64_t l = 0; l < x.L; ++l)
    for (int64_t n = 0; n < 6; ++n)
      for (int64_t k = 0; k < x.K; ++k) fl.push_back(int16_t((n + l + 3 * k) % x.E));
  write("f.npy", encode_npy("<i2", {x.L, 6, x.K}, fl.data(), fl.size() * 2));
  auto npy = [&](int64_t b, int64_t e) { return npy_i32(x.rows(b, e), {e - b, x.L, x.K}); };
  write("s.sse", sse("q", 0, 1, npy(0, x.P), false, x.P) + "\n" +
                     sse("q", 0, 3, npy(x.P, x.P + x.G - 1), true) + "\n");
  const std::string E = std::to_string(x.E);
  using testing::run;
  auto r = run({"routes", "import", "--format", "trtllm", "--num-experts", E, "--first-k-dense",
                "1", "-o", p("t.syr"), p("t.npy")});
  ASSERT_EQ(r.code, 0) << r.err;
  RouteFileReader t = RouteFileReader::open(p("t.syr"));
  EXPECT_EQ(t.info().moe_layers, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(t.info().num_hidden_layers, 4);
  r = run({"routes", "import", "--format", "flashinfer", "--num-experts", E, "--cu-seqlens",
           "0,2,6", "-o", p("f.syr"), p("f.npy")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(RouteFileReader::open(p("f.syr")).num_sequences(), 2);
  r = run({"routes", "import", "--format", "vllm-stream", "--num-experts", E, "-o", p("s.syr"),
           p("s.sse")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(RouteFileReader::open(p("s.syr")).read(0).num_tokens(), x.P + x.G);
  // Bad inputs: exit 2, the message, and the existing output untouched, no partial file.
  write("cut.sse", sse("q", 0, 1, npy(0, x.P), false, x.P) + "\n");
  const auto before = fs::file_size(p("t.syr"));
  const std::vector<std::vector<std::string>> bad = {
      {"--format", "trtllm", "--moe-layers", "1,0", p("t.npy")},
      {"--format", "flashinfer", "--cu-seqlens", "0,9", p("f.npy")},
      {"--format", "flashinfer", "--cu-seqlens", "0,x", p("f.npy")},
      {"--format", "vllm-stream", p("cut.sse")},
  };
  for (const auto& b : bad) {
    std::vector<std::string> args = {"routes", "import", "--num-experts", E, "-o", p("t.syr")};
    args.insert(args.end(), b.begin(), b.end());
    r = run(args);
    EXPECT_EQ(r.code, 2) << b[1] << ": " << r.err;
    EXPECT_EQ(fs::file_size(p("t.syr")), before) << b[1];
    EXPECT_FALSE(fs::exists(p("t.syr") + ".partial")) << b[1];
    EXPECT_TRUE(RouteFileReader::open(p("t.syr")).info().moe_layers ==
                (std::vector<int64_t>{1, 2, 3}));
  }
}

}  // namespace
}  // namespace switchyard
