// Importers for the routes rollout engines return: vLLM's per-sequence int32
// `[seq_len - 1, num_layers, top_k]` arrays saved as .npy, and SGLang's `meta_info.routed_experts`
// (base64 of the same array as little-endian int32) in JSON or JSONL responses.
//
// Both give a route for every token but the last sampled one, on every hidden layer (dense layers
// hold 0) and possibly on MTP layers. Import keeps the MoE layers (LayerMap), drops the others, and
// appends a `-1` row for the missing last token, giving a RouteTable `[seq_len, moe_layers,
// top_k]`.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/routes.h"

namespace switchyard {

/// What to do with an all-zero row on a MoE layer: with top_k > 1 it repeats expert 0, which no
/// top-k produces — it is how zero-filled padding shows up. Such rows are always counted in the
/// report. With top_k == 1 a 0 is a real route to expert 0 and is never flagged.
enum class ZeroRowPolicy : uint8_t {
  keep,     ///< keep the zeros (default: import never changes data silently)
  to_none,  ///< turn the row into -1 ("no route")
  error,    ///< throw std::invalid_argument naming the first one
};

/// What to do with an invalid row on a MoE layer (DESIGN.md's replay rules): one that repeats an
/// id (other than the all-zero rows of ZeroRowPolicy) or mixes -1 with ids. Storing it as if valid
/// would make replay reject it later, far from its source.
enum class InvalidRowPolicy : uint8_t {
  error,    ///< throw std::invalid_argument naming sequence, token, layer and row (default)
  to_none,  ///< store the row as -1 ("no route": replay routes it natively and counts it)
};

/// Options of the importers.
struct ImportOptions {
  int64_t num_experts = 0;  ///< E; every id must be -1 or in [0, E)
  LayerMap layer_map;
  /// Tokens of each sequence before its first returned route: vLLM's request parameter
  /// `routed_experts_prompt_start` (responses do not echo it) and SGLang's
  /// `routed_experts_start_len` (used when `meta_info` does not carry it). Those tokens get -1
  /// rows, so a table still has one row per token of the sequence. 0 = routes from token 0.
  int64_t prompt_start = 0;
  /// Layers per token in the input (hidden + MTP). vLLM: 0 = take it from the array (checked
  /// when given). SGLang: required (the payload is flat).
  int64_t num_input_layers = 0;
  /// K. vLLM: 0 = from the array. SGLang: required.
  int64_t top_k = 0;
  ZeroRowPolicy zero_rows = ZeroRowPolicy::keep;
  InvalidRowPolicy invalid_rows = InvalidRowPolicy::error;
};

/// Counts and findings of an import.
struct ImportReport {
  int64_t num_sequences = 0;
  int64_t num_tokens = 0;  ///< tokens in the output tables (last token included)
  int64_t num_input_layers = 0;
  int64_t top_k = 0;
  std::vector<int64_t> moe_layers;  ///< hidden-layer index of every kept layer
  int64_t num_zero_rows = 0;        ///< all-zero rows on MoE layers
  /// The first few zero rows as {sequence, token, moe layer}.
  std::vector<std::array<int64_t, 3>> first_zero_rows;
  /// Rows stored as -1 by InvalidRowPolicy::to_none (repeated id, or -1 mixed with ids).
  int64_t num_invalid_rows = 0;
  std::vector<std::string> warnings;
};

/// Sequences imported, in input order, and the report.
struct ImportResult {
  std::vector<RouteTable> sequences;
  /// Name of each sequence's source ("file.npy", "file.jsonl:3").
  std::vector<std::string> sources;
  ImportReport report;
};

/// Imports one vLLM array from .npy bytes (dtype int32 or int64, little-endian, C order, 3-D).
/// `source` names the input in error messages. Throws std::invalid_argument naming source, value
/// and position on a malformed file, an id outside [-1, E), or a layer count the map does not fit.
ImportResult import_vllm_npy_bytes(std::string_view bytes, const std::string& source,
                                   const ImportOptions& options);
/// Imports one .npy file per sequence. BackendError when a file cannot be read.
ImportResult import_vllm(const std::vector<std::string>& paths, const ImportOptions& options);
/// Imports vLLM arrays already in memory (e.g. captured by switchyard.integrations.hf, or a
/// response decoded by the caller): one contiguous `[seq_len-1, num_layers, top_k]` tensor per
/// sequence, int32, int64, int16, uint16 or uint8 (read as they are, no widening copy). The same
/// checks, layer map and report as import_vllm; sources are named "arrays[i]". Sequences run on
/// the engine's OpenMP threads; the result and the error raised (the first failing sequence) do
/// not depend on the thread count.
ImportResult import_vllm_arrays(const std::vector<Tensor>& arrays, const ImportOptions& options);

/// Imports SGLang responses from text: one JSON object, a JSON array of objects, or JSONL (one
/// object per line). Each object needs `meta_info.routed_experts` (a base64 string), whose length
/// in int32 must be a multiple of num_input_layers * top_k. Throws std::invalid_argument naming the
/// source, the record and what is wrong.
ImportResult import_sglang_text(std::string_view text, const std::string& source,
                                const ImportOptions& options);
/// Imports SGLang JSON / JSONL files, in order.
ImportResult import_sglang(const std::vector<std::string>& paths, const ImportOptions& options);

/// Strict base64 (RFC 4648, with or without '=' padding; no whitespace or other characters).
/// Throws std::invalid_argument ("[base64] ...") naming the first bad character and its position.
std::string base64_decode(std::string_view text);
/// Standard base64 with padding (tests, tools).
std::string base64_encode(std::string_view bytes);

// ---- Route data from the newest engines (vLLM >= 0.22 HTTP responses) --------------------------
//
// vLLM's OpenAI-compatible server (completions, chat completions and the token-in/token-out
// generate endpoint) returns, per choice, `routed_experts`: base64 of the bytes of a .npy file
// holding `[num_tokens - 1 - prompt_start, num_hidden_layers(+MTP), K]`, dtype uint8 when the model
// has <= 256 experts, else uint16 (int32 before 0.22). Rows start at token `prompt_start`
// (`routed_experts_prompt_start` of the request, 0 by default); the imported table puts -1 rows at
// tokens [0, prompt_start) and at the last token, so it has num_tokens rows.

/// Imports one base64 .npy string (a choice's `routed_experts`); `source` names it in errors.
ImportResult import_vllm_npy_base64(std::string_view text, const std::string& source,
                                    const ImportOptions& options);
/// Imports vLLM HTTP responses from text: one JSON object, a JSON array of them, or JSONL. Every
/// element of a record's `choices` is one sequence and needs `routed_experts` (a base64 .npy
/// string). A record may carry `routed_experts_prompt_start` (an integer saved next to the
/// response, top level or in `sampling_params`), which overrides options.prompt_start. Errors
/// name the source, the record / line, the choice and the field.
ImportResult import_vllm_http_text(std::string_view text, const std::string& source,
                                   const ImportOptions& options);
/// Imports vLLM HTTP response files (JSON / JSONL), in order.
ImportResult import_vllm_http(const std::vector<std::string>& paths, const ImportOptions& options);
/// Imports vLLM files of either kind, told apart by content: .npy (magic "\x93NUMPY") or JSON /
/// JSONL HTTP responses. What `switchyard routes import --format vllm` reads.
ImportResult import_vllm_files(const std::vector<std::string>& paths, const ImportOptions& options);

/// The bytes of a .npy file (version 1.0, little-endian, C order) holding `array`, an int32 tensor
/// of any shape — e.g. one sequence's vLLM `routed_experts` `[seq_len-1, num_hidden_layers, K]`.
/// For exporting routes to tools that read vLLM's format (and for tests and the demo).
std::string encode_npy_int32(const Tensor& array);
/// The bytes of a .npy file (version 1.0, C order) of `shape` with element type `descr` ("<i2",
/// "<i8", ...) over `nbytes` bytes of little-endian `data` (the caller's, checked by nobody here).
std::string encode_npy(std::string_view descr, const std::vector<int64_t>& shape,
                       const void* data, size_t nbytes);

}  // namespace switchyard
