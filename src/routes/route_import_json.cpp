// JSON documents for the text importers (route_import_core.h, JsonReader): simdjson parses, the
// records reach the importers as nlohmann::json. Engines put megabytes of base64 in one string;
// nlohmann's lexer reads a string a character at a time (~10 ns per byte here, 96% of a vLLM
// HTTP import's time), simdjson's stage 1 reads 64 bytes a step and copies strings whole.
#include <simdjson.h>

#include <cstring>

#include "route_import_core.h"

namespace switchyard::detail {

namespace {

using nlohmann::json;
namespace dom = simdjson::dom;

// The same value as nlohmann's own parser builds from the same text: a non-negative integer is
// nlohmann's number_unsigned, a negative one number_integer; a repeated key keeps its last value.
json to_json(dom::element e) {
  switch (e.type()) {
    case dom::element_type::ARRAY: {
      json a = json::array();
      auto& v = a.get_ref<json::array_t&>();
      const dom::array arr = e.get_array().value_unsafe();
      v.reserve(arr.size());
      for (dom::element x : arr) v.push_back(to_json(x));
      return a;
    }
    case dom::element_type::OBJECT: {
      json o = json::object();
      auto& m = o.get_ref<json::object_t&>();
      const dom::object obj = e.get_object().value_unsafe();
      for (dom::key_value_pair kv : obj) m[std::string(kv.key)] = to_json(kv.value);
      return o;
    }
    case dom::element_type::INT64: {
      const int64_t v = e.get_int64().value_unsafe();
      return v >= 0 ? json(static_cast<uint64_t>(v)) : json(v);
    }
    case dom::element_type::UINT64:
      return json(e.get_uint64().value_unsafe());
    case dom::element_type::DOUBLE:
      return json(e.get_double().value_unsafe());
    case dom::element_type::STRING:
      return json(std::string(e.get_string().value_unsafe()));
    case dom::element_type::BOOL:
      return json(e.get_bool().value_unsafe());
    case dom::element_type::NULL_VALUE:
      break;
  }
  return json(nullptr);
}

}  // namespace

struct JsonReader::Impl {
  dom::parser parser;  // its buffers grow to the largest document and are reused
};

JsonReader::JsonReader() : impl_(std::make_unique<Impl>()) {}
JsonReader::~JsonReader() = default;

bool JsonReader::parse(std::string_view text, json& out) {
  // nlohmann skips a UTF-8 byte order mark at the start of its input; simdjson does not.
  std::string_view body = text;
  if (body.size() >= 3 && std::memcmp(body.data(), "\xEF\xBB\xBF", 3) == 0) body.remove_prefix(3);
  dom::element root;
  const simdjson::error_code err = impl_->parser.parse(body.data(), body.size()).get(root);
  if (!err) {
    out = to_json(root);
    return true;
  }
  // A structural error (text after the first value: JSONL, a missing comma, an unclosed
  // bracket) fails nlohmann's parse too. simdjson also refuses what nlohmann accepts: integers
  // past 64 bits and numbers past double's range (nlohmann: a double, inf), nesting deeper than
  // 1024, documents past 4 GiB or its memory: for those nlohmann decides, as before.
  if (err == simdjson::TAPE_ERROR) return false;
  out = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  return !out.is_discarded();
}

}  // namespace switchyard::detail
