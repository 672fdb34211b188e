// Route data from the newest engines: vLLM >= 0.22 HTTP responses (choices[i].routed_experts =
// base64 of .npy bytes, uint8 ids for <= 256 experts else uint16, routed_experts_prompt_start),
// SGLang's meta_info.routed_experts_start_len, and the export to verl's batch layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>

#include "switchyard/route_align.h"
#include "switchyard/route_import.h"
#include "switchyard/route_verl.h"
#include "testing.h"

namespace switchyard {
namespace {

using nlohmann::json;

// The byte-exact wire form of vLLM's np.save of uint8 [[[0,0],[3,1]],[[0,0],[2,5]]] (2 tokens, 2
// layers of which layer 0 is dense, K 2), base64-encoded, as numpy 2 writes it.
const char* kVllmU8 =
    "k05VTVBZAQB2AHsnZGVzY3InOiAnfHUxJywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDIsIDIsIDIp"
    "LCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAoAAAMBAAACBQ==";
// SGLang's form of the same routes: base64 of little-endian int32.
const char* kSglangI32 = "AAAAAAAAAAADAAAAAQAAAAAAAAAAAAAAAgAAAAUAAAA=";

ImportOptions opts(int64_t E) {
  ImportOptions o;
  o.num_experts = E;
  o.layer_map.first_k_dense = 1;
  return o;
}

// [start + 2 + 1, 1, 2]: -1 rows before start, the fixture's MoE-layer rows, -1 for the last token.
RouteTable fixture_table(int64_t start) {
  RouteTable t = RouteTable::none(start + 3, 1, 2, 8);
  int32_t* p = t.topk_idx.data<int32_t>();
  const int32_t rows[2][2] = {{3, 1}, {2, 5}};
  for (int64_t r = 0; r < 2; ++r) std::memcpy(p + (start + r) * 2, rows[r], sizeof rows[r]);
  return t;
}

TEST(RouteFormats, FixtureDecodesToTheNpyNumpyWrites) {
  const std::string raw = base64_decode(kVllmU8);
  const uint8_t ids[] = {0, 0, 3, 1, 0, 0, 2, 5};
  ASSERT_EQ(raw.size(), 128u + 8u);  // 64-byte aligned header, then the uint8 data
  EXPECT_EQ(raw.substr(0, 6), "\x93NUMPY");
  EXPECT_NE(raw.find("'descr': '|u1'"), std::string::npos);
  EXPECT_EQ(std::memcmp(raw.data() + 128, ids, 8), 0);
  const std::string sg = base64_decode(kSglangI32);
  ASSERT_EQ(sg.size(), 32u);
  for (int i = 0; i < 8; ++i) {
    int32_t v;
    std::memcpy(&v, sg.data() + 4 * i, 4);
    EXPECT_EQ(v, ids[i]) << i;
  }
}

TEST(RouteFormats, VllmHttpCompletionAndChat) {
  json completion = {{"object", "text_completion"},
                           {"choices", {{{"index", 0}, {"text", "x"}, {"routed_experts", kVllmU8}}}},
                           {"usage", {{"prompt_tokens", 1}, {"completion_tokens", 2}}}};
  ImportResult r = import_vllm_http_text(completion.dump(), "resp.json", opts(8));
  ASSERT_EQ(r.sequences.size(), 1u);
  EXPECT_TRUE(route_tables_equal(r.sequences[0], fixture_table(0)));
  EXPECT_EQ(r.sources[0], "resp.json choices[0].routed_experts");
  EXPECT_TRUE(r.report.warnings.empty());
  // A chat response saved with the request's prompt start; usage agrees with 4 + 3 tokens.
  json chat = {{"object", "chat.completion"},
               {"routed_experts_prompt_start", 4},
               {"choices", {{{"message", {{"role", "assistant"}}}, {"routed_experts", kVllmU8}}}},
               {"usage", {{"prompt_tokens", 5}, {"completion_tokens", 2}}}};
  r = import_vllm_http_text(chat.dump(), "chat.json", opts(8));
  EXPECT_TRUE(route_tables_equal(r.sequences[0], fixture_table(4)));
  EXPECT_EQ(r.report.num_tokens, 7);
  EXPECT_TRUE(r.report.warnings.empty());
  // The option is the default for records that do not carry the field.
  ImportOptions o = opts(8);
  o.prompt_start = 2;
  json bare = completion;
  bare.erase("usage");
  r = import_vllm_http_text(json::array({bare, bare}).dump(), "a.json", o);
  ASSERT_EQ(r.sequences.size(), 2u);
  EXPECT_TRUE(route_tables_equal(r.sequences[1], fixture_table(2)));
  EXPECT_EQ(r.sources[1], "a.json[1] choices[0].routed_experts");
  EXPECT_TRUE(r.report.warnings.empty());
  // usage that disagrees with the routes' length (prompt start 0 assumed, 1 + 3 tokens said).
  completion["usage"]["completion_tokens"] = 3;
  r = import_vllm_http_text(completion.dump(), "u.json", opts(8));
  ASSERT_EQ(r.report.warnings.size(), 1u);
  EXPECT_EQ(r.report.warnings[0],
            "u.json choices[0].routed_experts: usage.prompt_tokens + completion_tokens = 4 but "
            "routed_experts with prompt_start 0 covers 3 tokens (is the prompt start right?)");
}

TEST(RouteFormats, VllmHttpErrorsNameRecordChoiceAndField) {
  auto msg = [](const std::string& text) {
    try {
      import_vllm_http_text(text, "r.jsonl", opts(8));
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string ok = json{{"choices", {{{"routed_experts", kVllmU8}}}}}.dump();
  EXPECT_EQ(msg(ok + "\n" + json{{"choices", {{{"routed_experts", nullptr}}}}}.dump()),
            "[import] r.jsonl:2: choices[0].routed_experts is missing or null (the server needs "
            "--enable-return-routed-experts; null also means the request was aborted before any "
            "forward pass)");
  EXPECT_EQ(msg(json{{"choices", {{{"routed_experts", 3}}}}}.dump()),
            "[import] r.jsonl: choices[0].routed_experts must be a base64 string of .npy bytes "
            "(vLLM >= 0.22), got JSON number");
  EXPECT_EQ(msg(json{{"choices", {{{"routed_experts", kSglangI32}}}}}.dump()),
            "[import] r.jsonl choices[0].routed_experts: not a .npy file (bad magic)");
  EXPECT_EQ(msg(json{{"id", 1}}.dump()),
            "[import] r.jsonl: record has no choices array (a vLLM completion, chat completion or "
            "generate response)");
  EXPECT_EQ(msg(json{{"sampling_params", {{"routed_experts_prompt_start", true}}},
                     {"choices", {{{"routed_experts", kVllmU8}}}}}
                    .dump()),
            "[import] r.jsonl: sampling_params.routed_experts_prompt_start must be an integer in "
            "[0, 2^24], got true");
  EXPECT_EQ(msg(json{{"routed_experts_prompt_start", 3},
                     {"usage", {{"prompt_tokens", 2}}},
                     {"choices", {{{"routed_experts", kVllmU8}}}}}
                    .dump()),
            "[import] r.jsonl: routed_experts_prompt_start=3 is not inside the prompt "
            "(usage.prompt_tokens=2); vLLM requires it to be smaller than the prompt length");
}

TEST(RouteFormats, VllmWidthWarningsAndNpyPromptStart) {
  // uint16 ids with a model of <= 256 experts: vLLM would have written uint8.
  const std::vector<uint16_t> v = {0, 0, 3, 1};
  std::string h = "{'descr': '<u2', 'fortran_order': False, 'shape': (1, 2, 2), }";
  while ((10 + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::string npy("\x93NUMPY\x01\x00", 8);
  npy += static_cast<char>(h.size());
  npy += '\0';
  npy += h;
  npy.append(reinterpret_cast<const char*>(v.data()), 8);
  ImportOptions o = opts(8);
  o.prompt_start = 3;
  ImportResult r = import_vllm_npy_bytes(npy, "s.npy", o);
  ASSERT_EQ(r.report.warnings.size(), 1u);
  EXPECT_NE(r.report.warnings[0].find("s.npy: uint16 ids but num_experts=8"), std::string::npos);
  ASSERT_EQ(r.sequences[0].num_tokens(), 5);  // 3 absent + 1 routed + the last
  RouteTable want = RouteTable::none(5, 1, 2, 8);
  want.topk_idx.data<int32_t>()[6] = 3;
  want.topk_idx.data<int32_t>()[7] = 1;
  EXPECT_TRUE(route_tables_equal(r.sequences[0], want));
  EXPECT_EQ(r.report.num_tokens, 5);
}

TEST(RouteFormats, SglangStartLen) {
  ImportOptions o = opts(8);
  o.num_input_layers = 2;
  o.top_k = 2;
  json rec = {{"text", "x"},
              {"meta_info",
               {{"routed_experts", kSglangI32}, {"routed_experts_start_len", 3},
                {"prompt_tokens", 3}, {"completion_tokens", 3}}}};
  ImportResult r = import_sglang_text(rec.dump(), "g.json", o);
  EXPECT_TRUE(route_tables_equal(r.sequences[0], fixture_table(3)));
  EXPECT_TRUE(r.report.warnings.empty()) << r.report.warnings[0];
  rec["meta_info"]["routed_experts_start_len"] = 5;
  try {
    import_sglang_text(rec.dump(), "g.json", o);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "[import] g.json: meta_info.routed_experts_start_len=5 is past the prompt "
                 "(prompt_tokens=3); SGLang allows [0, prompt_tokens]");
  }
}

// Random valid tables: distinct ids per row, the last token -1.
std::vector<RouteTable> random_tables(const std::vector<int64_t>& lengths, int64_t M, int64_t K,
                                      int64_t E, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<RouteTable> out;
  for (int64_t T : lengths) {
    RouteTable t = RouteTable::none(T, M, K, E);
    int32_t* p = t.topk_idx.data<int32_t>();
    std::vector<int32_t> perm(static_cast<size_t>(E));
    for (int64_t r = 0; r + 1 < T; ++r)
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t e = 0; e < E; ++e) perm[size_t(e)] = int32_t(e);
        std::shuffle(perm.begin(), perm.end(), rng);
        std::memcpy(p + (r * M + m) * K, perm.data(), size_t(K) * 4);
      }
    out.push_back(std::move(t));
  }
  return out;
}

TEST(RouteFormats, ToVerlLayoutAndInverse) {
  const auto tables = random_tables({3, 5}, 2, 2, 16, 42);
  const std::vector<int64_t> moe = {1, 3};
  VerlOptions o;
  o.num_hidden_layers = 4;
  o.seq_len = 6;
  for (PaddingSide side : {PaddingSide::left, PaddingSide::right}) {
    o.padding_side = side;
    VerlBatch v = to_verl(tables, moe, o);
    ASSERT_EQ(v.routed_experts.shape(), (Shape{2, 6, 4, 2}));
    ASSERT_EQ(v.routed_experts.dtype(), DType::int16);  // verl's dtype
    const int16_t* ids = v.routed_experts.data<int16_t>();
    const int64_t* mask = v.attention_mask.data<int64_t>();
    for (int64_t b = 0; b < 2; ++b) {
      const RouteTable& t = tables[size_t(b)];
      const int64_t first = side == PaddingSide::left ? 6 - t.num_tokens() : 0;
      for (int64_t s = 0; s < 6; ++s) {
        const bool real = s >= first && s < first + t.num_tokens();
        EXPECT_EQ(mask[b * 6 + s], real ? 1 : 0);
        for (int64_t h = 0; h < 4; ++h)
          for (int64_t k = 0; k < 2; ++k) {
            int32_t want = 0;
            const int64_t m = h == 1 ? 0 : h == 3 ? 1 : -1;
            if (real && m >= 0) want = std::max(0, t.topk_idx.data<int32_t>()[((s - first) * 2 + m) * 2 + k]);
            ASSERT_EQ(ids[((b * 6 + s) * 4 + h) * 2 + k], want) << b << "," << s << "," << h;
          }
      }
    }
    // Inverse (what from_verl does): drop_padding, keep the MoE layers, all-zero rows -> -1.
    std::vector<RouteTable> back = drop_padding(
        Tensor::from_vector(std::vector<int32_t>(ids, ids + 2 * 6 * 4 * 2), {2, 6, 4, 2}),
        v.attention_mask, 16);
    ASSERT_EQ(back.size(), 2u);
    for (size_t b = 0; b < 2; ++b) {
      const RouteTable& t = tables[b];
      ASSERT_EQ(back[b].num_tokens(), t.num_tokens());
      for (int64_t r = 0; r < t.num_tokens(); ++r)
        for (int64_t m = 0; m < 2; ++m) {
          const int32_t* got = back[b].topk_idx.data<int32_t>() + (r * 4 + moe[size_t(m)]) * 2;
          const int32_t* want = t.topk_idx.data<int32_t>() + (r * 2 + m) * 2;
          const bool none = got[0] == 0 && got[1] == 0;
          for (int64_t k = 0; k < 2; ++k) ASSERT_EQ(none ? -1 : got[k], want[k]) << b << "," << r;
        }
    }
  }
}

TEST(RouteFormats, ToVerlErrors) {
  auto tables = random_tables({3}, 2, 2, 8, 1);
  VerlOptions o;
  o.num_hidden_layers = 2;
  auto msg = [&](const std::vector<RouteTable>& ts, const std::vector<int64_t>& moe) {
    try {
      to_verl(ts, moe, o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(msg(tables, {1, 0}),
            "[to_verl] moe_layers must be strictly increasing hidden-layer indices in [0, "
            "num_hidden_layers=2), got 0 at position 1");
  tables[0].topk_idx.data<int32_t>()[3] = -1;  // token 0, MoE layer 1, slot 1
  EXPECT_EQ(msg(tables, {0, 1}),
            "[to_verl] tables[0]: row at token 0, MoE layer 1 mixes -1 with expert ids; verl's "
            "layout has no place for it");
  o.seq_len = 2;
  EXPECT_EQ(msg(random_tables({3}, 2, 2, 8, 1), {0, 1}),
            "[to_verl] seq_len=2 is shorter than the longest table (3 tokens)");
  const Tensor mask = Tensor::from_vector(std::vector<int64_t>{1, 0, 1, 0}, {1, 4});
  try {
    to_verl(random_tables({3}, 2, 2, 8, 1), {0, 1}, 2, mask);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "[to_verl] attention_mask row 0 has 2 real tokens, tables[0] has 3 rows");
  }
}

}  // namespace
}  // namespace switchyard
