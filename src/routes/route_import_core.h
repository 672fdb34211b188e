// The shared room of the route importers (route_import_*.cpp, one file per engine format): the
// element types an engine writes ids in, the one row writer every format goes through (layer map,
// row rule, zero rows, -1 rows for tokens without a route), .npy parsing, the report merge, and
// JSON record helpers. Internal (namespace detail); the public API is switchyard/route_import.h.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "check.h"
#include "route_rows.h"
#include "switchyard/route_import.h"

namespace switchyard::detail {

/// The op name in every importer message ("[import] ...").
inline constexpr const char* kImportOp = "import";

/// Largest start offset accepted: far beyond any context length, small enough that a hostile
/// value cannot make the importer allocate without bound.
inline constexpr int64_t kMaxStart = int64_t{1} << 24;

// One input element type (the .npy descr, or int32 for SGLang).
enum class Elem { i1, u1, i2, u2, i4, u4, i8 };

// Calls f with a null `const T*` of the element's C++ type (the one place Elem meets a type).
template <class F>
decltype(auto) visit_elem(Elem e, F&& f) {
  switch (e) {
    case Elem::i1:
      return f(static_cast<const int8_t*>(nullptr));
    case Elem::u1:
      return f(static_cast<const uint8_t*>(nullptr));
    case Elem::i2:
      return f(static_cast<const int16_t*>(nullptr));
    case Elem::u2:
      return f(static_cast<const uint16_t*>(nullptr));
    case Elem::i4:
      return f(static_cast<const int32_t*>(nullptr));
    case Elem::u4:
      return f(static_cast<const uint32_t*>(nullptr));
    case Elem::i8:
      break;
  }
  return f(static_cast<const int64_t*>(nullptr));
}

inline size_t elem_size(Elem e) {
  return visit_elem(e, [](auto* typed) { return sizeof(*typed); });
}

/// The element type of an in-memory route array (int32, int64, int16, uint16 or uint8).
Elem tensor_elem(const Tensor& a, const std::string& source);

// How an input array maps to a table beyond its shape.
struct ArrayLayout {
  bool last_token_row = true;  // append a -1 row: the last sampled token has no route
  int64_t token_offset = 0;    // token index of row 0 (error messages, zero-row positions)
  bool moe_only = false;       // the layer axis holds only MoE layers (then trailing MTP layers)
};

/// Appends one sequence given as a [rows, layers_in, top_k] array of `elem` at `data` (any
/// alignment) to `result`: shape checks against the options and the earlier sequences, the layer
/// map, the row rule (detail::import_rows), the all-zero-payload refusal, the report.
void import_array(const char* data, Elem elem, int64_t rows, int64_t layers_in, int64_t top_k,
                  const std::string& source, const RouteImportOptions& opt, ImportResult& result,
                  const ArrayLayout& lay = {});

/// Puts `start` rows of -1 before the last sequence of `result` (tokens before the engine's first
/// returned route); `field` names the start in errors.
void prepend_none_rows(ImportResult& result, int64_t start, const std::string& source,
                       const char* field);

/// Appends `part` to `into` (sequences, sources, report); `source` names `part` in errors.
void merge_import(ImportResult& into, ImportResult&& part, const std::string& source);

/// A file's bytes. BackendError when it cannot be read.
std::string read_import_file(const std::string& path);

/// A 3-D integer .npy file: where its data starts, its element type and shape (checked against the
/// bytes present).
struct Npy3 {
  const char* data = nullptr;
  Elem elem = Elem::i4;
  int64_t shape[3] = {0, 0, 0};
};
Npy3 parse_npy3(std::string_view bytes, const std::string& source);

/// A non-negative integer field of a JSON record (a count), or `fallback` when absent or null.
int64_t json_count(const nlohmann::json& obj, const char* key, int64_t fallback,
                   const std::string& source, const std::string& field);
/// A count field that may be absent, null or (from outside) absurd: -1 unless a sane integer.
int64_t loose_count(const nlohmann::json& obj, const char* key);
/// A JSON parser for documents that carry megabytes of base64 in a string (route_import_json.cpp:
/// simdjson; nlohmann's lexer reads a character at a time). One reader per thread; its buffers
/// are reused from one document to the next.
class JsonReader {
 public:
  JsonReader();
  ~JsonReader();
  JsonReader(const JsonReader&) = delete;
  JsonReader& operator=(const JsonReader&) = delete;
  /// Parses `text` into `out`: false when it is not one JSON value, exactly where
  /// nlohmann::json::parse(text, nullptr, false) is discarded (RFC 8259, a leading UTF-8 BOM
  /// skipped), and `out` the value nlohmann would build.
  bool parse(std::string_view text, nlohmann::json& out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Records of a JSON document: one object, a JSON array of objects, or JSONL (one per line),
/// each named "source", "source[i]" or "source:line".
std::vector<std::pair<std::string, nlohmann::json>> json_records(std::string_view text,
                                                                 const std::string& source);

/// An importer's message without its "[import] " prefix (to raise it again under a source).
std::string strip_import_prefix(const std::invalid_argument& e);

/// One importer of in-memory text over files: every file read and imported in order, results
/// merged.
template <class ImportText>
ImportResult import_text_files(const std::vector<std::string>& paths,
                               const RouteImportOptions& options, ImportText import_text) {
  check_import_options(options);
  ImportResult all;
  for (const auto& p : paths) merge_import(all, import_text(read_import_file(p), p, options), p);
  return all;
}

}  // namespace switchyard::detail
