// The text importers' JSON (src/routes/route_import_json.cpp: simdjson, nlohmann where simdjson
// refuses what nlohmann accepts): one document or JSONL told apart as before, JSON escapes in the
// base64 strings, and the inputs simdjson alone would refuse (huge numbers, deep nesting, a BOM).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "switchyard/route_import.h"
#include "testing.h"

namespace switchyard {
namespace {

constexpr int64_t kL = 2, kK = 2, kE = 8;

std::string payload(int64_t rows, int64_t r0) {
  std::vector<int32_t> v;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t l = 0; l < kL; ++l)
      for (int64_t k = 0; k < kK; ++k) v.push_back(int32_t((r0 + r + l + k * 3) % kE));
  return base64_encode(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
}

std::string record(const std::string& b64, const std::string& extra = "") {
  return "{\"meta_info\": {\"routed_experts\": \"" + b64 + "\"" + extra + "}}";
}

ImportOptions opts() {
  ImportOptions o;
  o.num_experts = kE;
  o.num_input_layers = kL;
  o.top_k = kK;
  return o;
}

std::vector<std::string> sources(const std::string& text) {
  return import_sglang_text(text, "s", opts()).sources;
}

using Names = std::vector<std::string>;

TEST(RouteImportJson, OneDocumentOrJsonlAsBefore) {
  const std::string a = record(payload(3, 0)), b = record(payload(5, 1));
  EXPECT_EQ(sources(a + "\n" + b), (Names{"s:1", "s:2"}));
  EXPECT_EQ(sources(a + "\r\n" + b + "\r\n"), (Names{"s:1", "s:2"}));
  EXPECT_EQ(sources("\n \t\n\xEF\xBB\xBF" + a + "\n\n" + b), (Names{"s:3", "s:5"}));
  // One value then only whitespace: one document (named without a line).
  EXPECT_EQ(sources(a + "\n \n\t\r\n"), (Names{"s"}));
  EXPECT_EQ(sources("\n" + a), (Names{"s"}));
  // Pretty-printed: the first line alone is not a value.
  EXPECT_EQ(
      sources("{\n  \"meta_info\": {\n    \"routed_experts\": \"" + payload(2, 0) + "\"\n  }\n}\n"),
      (Names{"s"}));
  EXPECT_EQ(sources("[\n" + a + ",\n" + b + "\n]"), (Names{"s[0]", "s[1]"}));
  // The first line's value spans lines only inside a document: two values are JSONL, line 2 bad.
  SY_EXPECT_THROW_MSG(sources(a + "\n" + b + ","), std::invalid_argument,
                      "s:2: not valid JSON (nor is the whole file)");
  SY_EXPECT_THROW_MSG(sources(a + "\n" + b + "\n{\"meta_info\": "), std::invalid_argument,
                      "s:3: not valid JSON (nor is the whole file)");
  SY_EXPECT_THROW_MSG(sources("[1,\n" + a), std::invalid_argument,
                      "s:1: not valid JSON (nor is the whole file)");
  // Invalid UTF-8, lone surrogates, a raw control character and a number past double's range
  // are not JSON, for both parsers.
  for (const std::string& bad :
       {std::string("1e400"), std::string("\"\xC3\x28\""), std::string("\"\\ud800\""),
        std::string("\"\\udc00\""), std::string("\"a\tb\"")}) {
    SCOPED_TRACE(bad);
    SY_EXPECT_THROW_MSG(sources(record(payload(1, 0), ", \"x\": " + bad)), std::invalid_argument,
                        "s:1: not valid JSON");
  }
}

TEST(RouteImportJson, EscapedBase64DecodesAsItsCharacters) {
  // JSON encoders may write any character as \uXXXX ('/' also as "\/", which these ids never
  // produce in base64).
  const std::string b64 = payload(40, 2);
  std::string escaped;
  for (char c : b64) {
    if (c == 'A')
      escaped += "\\u0041";
    else if (c == 'g')
      escaped += "\\u0067";
    else
      escaped += c;
  }
  ASSERT_NE(escaped, b64);
  const ImportResult want = import_sglang_text(record(b64), "s", opts());
  const ImportResult got = import_sglang_text(record(escaped), "s", opts());
  ASSERT_EQ(got.sequences.size(), 1u);
  EXPECT_TRUE(route_tables_equal(got.sequences[0], want.sequences[0]));
  // An escape that is not base64 is reported at its decoded position.
  SY_EXPECT_THROW_MSG(sources(record(b64.substr(0, 4) + "\\n" + b64.substr(5))),
                      std::invalid_argument, "invalid character code 10 at position 4");
}

TEST(RouteImportJson, WhatOnlyNlohmannAcceptsStillImports) {
  const std::string b64 = payload(3, 0);
  std::string deep;
  for (int i = 0; i < 1500; ++i) deep += "[";
  for (int i = 0; i < 1500; ++i) deep += "]";
  for (const std::string& extra :
       {std::string(", \"big\": 123456789012345678901234567890"),
        std::string(", \"neg\": -123456789012345678901234567890"), ", \"deep\": " + deep}) {
    EXPECT_EQ(sources(record(b64, extra)), (Names{"s"})) << extra.substr(0, 20);
    EXPECT_EQ(sources(record(b64, extra) + "\n" + record(b64)), (Names{"s:1", "s:2"}));
  }
  EXPECT_EQ(sources("\xEF\xBB\xBF" + record(b64)), (Names{"s"}));
  // A count past 64 bits is nlohmann's double, refused by name as before.
  SY_EXPECT_THROW_MSG(sources(record(b64, ", \"prompt_tokens\": 123456789012345678901234567890")),
                      std::invalid_argument,
                      "meta_info.prompt_tokens must be an integer in [0, 2^24], got 1.2");
  // Counts that fit: unsigned and negative 64-bit integers, as nlohmann reads them.
  SY_EXPECT_THROW_MSG(sources(record(b64, ", \"prompt_tokens\": -1")), std::invalid_argument,
                      "meta_info.prompt_tokens must be an integer in [0, 2^24], got -1");
  SY_EXPECT_THROW_MSG(
      sources(record(b64, ", \"prompt_tokens\": 18446744073709551615")), std::invalid_argument,
      "meta_info.prompt_tokens must be an integer in [0, 2^24], got 18446744073709551615");
}

}  // namespace
}  // namespace switchyard
