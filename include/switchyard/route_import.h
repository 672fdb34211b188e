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
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/router.h"
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

// What to do with an invalid row on a MoE layer (the replay row rule, replay.h): one that
// repeats an id (other than the all-zero rows of ZeroRowPolicy) or mixes -1 with ids. Storing it
// as if valid would make replay reject it later, far from its source. ImportOptions::invalid_rows
// is the replay core's ReplayRowPolicy: error (throw std::invalid_argument naming sequence, token,
// layer and row; default) or native (store the row as -1, "no route": replay routes it natively
// and counts it). merge is refused (std::invalid_argument): a route table stores K ids per row,
// so a merged row could not be stored; keep repeated rows with error/native and replay them with
// merge. An id outside [-1, num_experts) is refused under every policy.

/// Options of the importers: one object every importer takes (bound once to Python as
/// `_switchyard.RouteImportOptions`; switchyard.routes builds it in one place).
struct RouteImportOptions {
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
  ReplayRowPolicy invalid_rows = ReplayRowPolicy::error;
  /// SGLang only: the element type of the base64 payload, int32 (what SGLang returns today),
  /// uint8 or uint16 (the narrow widths proposed in sgl-project/sglang#31219). An unsigned id
  /// never holds -1: a wrapped -1 (255 / 65535) is an id outside [0, E) and refused.
  DType routed_experts_dtype = DType::int32;
};

/// The spelling of RouteImportOptions before it was bound to Python under that name.
using ImportOptions = RouteImportOptions;

/// Checks every field of `options` (what each importer checks first): throws
/// std::invalid_argument ("[import] FIELD ... got VALUE") naming the first bad field and its value:
/// num_experts < 1, num_input_layers < 0, top_k < 0, prompt_start outside [0, 2^24], a negative
/// first_k_dense or num_mtp_layers, a moe_layer_freq entry other than 0/1, invalid_rows merge (a
/// table keeps K ids per row), a policy value outside its enum, or a routed_experts_dtype other
/// than int32, uint8 or uint16.
void check_import_options(const RouteImportOptions& options);

/// Counts and findings of an import.
struct ImportReport {
  int64_t num_sequences = 0;
  int64_t num_tokens = 0;  ///< tokens in the output tables (last token included)
  int64_t num_input_layers = 0;
  int64_t num_hidden_layers = 0;  ///< the model's decoder layers (MTP excluded)
  int64_t top_k = 0;
  std::vector<int64_t> moe_layers;  ///< hidden-layer index of every kept layer
  int64_t num_zero_rows = 0;        ///< all-zero rows on MoE layers
  /// The first few zero rows as {sequence, token, moe layer}.
  std::vector<std::array<int64_t, 3>> first_zero_rows;
  /// Rows stored as -1 by ReplayRowPolicy::native (repeated id, or -1 mixed with ids).
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
/// Imports vLLM files of any kind, told apart by content: .npy (magic "\x93NUMPY"), a recorded
/// stream (SSE text, starting "data:"; see import_vllm_stream_text) or JSON / JSONL HTTP
/// responses. What `switchyard routes import --format vllm` reads.
ImportResult import_vllm_files(const std::vector<std::string>& paths, const ImportOptions& options);

// ---- Engine layouts beyond vLLM / SGLang (issue 25) ---------------------------------------------
//
// TensorRT-LLM (PR NVIDIA/TensorRT-LLM#18397, RFC #17778): `CompletionOutput.routed_experts`,
// `[seq_len - 1, num_moe_layers, K]`, the pre-EPLB logical expert ids captured in
// `routing_method.apply()`. The layer axis holds only MoE layers, so nothing is dropped: the layer
// map only names the hidden layer of each column (first_k_dense: columns are hidden layers
// [first_k_dense, first_k_dense + M); moe_layer_freq: its 1 entries, which must number M) and
// num_mtp_layers trailing columns are left out.

/// Imports TensorRT-LLM arrays in memory: one `[seq_len-1, num_moe_layers(+MTP), K]` tensor per
/// sequence (int32, int64 or uint8; the caller widens int16). A -1 row is appended for the last
/// token and options.prompt_start -1 rows are put first, as for vLLM. Sources are "trtllm[i]".
ImportResult import_trtllm_arrays(const std::vector<Tensor>& arrays, const ImportOptions& options);
/// Imports one TensorRT-LLM array saved as .npy (any little-endian integer dtype, 3-D, C order).
ImportResult import_trtllm_npy_bytes(std::string_view bytes, const std::string& source,
                                     const ImportOptions& options);
/// Imports TensorRT-LLM .npy files, one per sequence. What `--format trtllm` reads.
ImportResult import_trtllm(const std::vector<std::string>& paths, const ImportOptions& options);

// FlashInfer's fused MoE kernels (flashinfer-ai/flashinfer#3024, #3382, #4894) take an optional
// `routing_replay_out`: an int16 `[N, top_k]` tensor (N >= the batch's tokens; rows past them are
// left as they were) that the routing kernel fills with the routed (not shared) expert ids of each
// token. One such buffer per MoE layer for one forward pass of a batch.

/// Route tables of the sequences of one batch from its per-MoE-layer replay buffers (one per MoE
/// layer, in layer order, then num_mtp_layers MTP layers, which are left out): each a 2-D
/// `[N, K]` tensor (int32, int64 or uint8; the caller widens int16), all of one shape.
/// `cu_seqlens` (`[0, n_0, n_0 + n_1, ...]`, non-decreasing, last <= N) splits the batch's tokens
/// into sequences; rows past its last entry are ignored. Every token of the batch went through the
/// router, so a table has exactly its sequence's rows (no -1 row appended). Sources are
/// "flashinfer (batch rows b..e)". Layer map, ids and row checks as for TensorRT-LLM.
ImportResult import_flashinfer_replay(const std::vector<Tensor>& layers,
                                      const std::vector<int64_t>& cu_seqlens,
                                      const ImportOptions& options);
/// The same over raw int16 buffers as the kernel writes them, each `num_rows * top_k` values.
ImportResult import_flashinfer_replay(const std::vector<const int16_t*>& layers, int64_t num_rows,
                                      int64_t top_k, const std::vector<int64_t>& cu_seqlens,
                                      const ImportOptions& options);

// vLLM streamed outputs. With `stream: true`, vLLM's /inference/v1/generate SSE chunks
// (`GenerateStreamResponse`: `request_id`, `choices[i]` with `index`, delta `token_ids`,
// `routed_experts` = base64 .npy or null, `finish_reason`) carry routes either once, on the
// chunk where the engine has them (vllm-project/vllm#44638: the whole
// `[num_tokens - 1 - prompt_start, layers, K]` array), or per chunk, sliced to the tokens the chunk
// emits (vllm-project/vllm#37094: the rows of the forward passes that produced them, appended in
// order). Either way, after a chunk that brought the request to G generated tokens, the routes
// received so far cover tokens [prompt_start, prompt_tokens + G - 1).

/// Assembles streamed route chunks per request into route tables, validating each chunk as it
/// arrives: its layer count and K (against the first chunk, or options.num_input_layers/top_k),
/// ids and rows (as import_vllm), and its token positions (no gap, no overlap). A chunk that fails
/// changes nothing. Not thread-safe.
class VllmRouteStream {
 public:
  explicit VllmRouteStream(const ImportOptions& options);

  /// Appends one chunk of request `request_id`: `routes` `[rows, layers, K]` (int32, int64 or
  /// uint8), the routes of tokens [start, start + rows). `start` < 0: right after the previous
  /// chunk (the first chunk starts at the request's prompt_start). `new_tokens` >= 0: tokens the
  /// chunk emitted; `prompt_tokens` >= 0: the prompt's length (see the invariant above, checked
  /// when both are known; the prompt length is otherwise inferred from the first routed chunk).
  void add(const std::string& request_id, const Tensor& routes, int64_t start = -1,
           int64_t new_tokens = -1, int64_t prompt_tokens = -1);
  /// The same for a chunk given as .npy bytes (any little-endian integer dtype).
  void add_npy(const std::string& request_id, std::string_view npy, int64_t start = -1,
               int64_t new_tokens = -1, int64_t prompt_tokens = -1);
  /// Tokens a chunk emitted without routes (null `routed_experts`), counted toward G.
  void add_tokens(const std::string& request_id, int64_t new_tokens, int64_t prompt_tokens = -1);
  /// Sets a request's prompt_start (vLLM's `routed_experts_prompt_start`) before its first chunk.
  void set_prompt_start(const std::string& request_id, int64_t prompt_start);
  /// One streamed response chunk: the JSON of an SSE event (a leading "data:" is dropped; "[DONE]"
  /// and blank text do nothing). Every element of `choices` is a chunk of request
  /// "<request_id or id>/<index>"; its `token_ids` (if present) count toward G,
  /// `usage.prompt_tokens` or `prompt_token_ids` give the prompt length, a top-level
  /// `routed_experts_prompt_start` (saved by the caller) sets prompt_start. Returns the requests
  /// whose chunk carried a `finish_reason`.
  std::vector<std::string> add_sse(std::string_view event);

  /// Ends `request_id` and returns its table (sequence 0 of the result): -1 rows for tokens
  /// [0, prompt_start), the routes, -1 for the last token. Throws std::invalid_argument when the
  /// request has no routes or they do not cover tokens [prompt_start, prompt + G - 1) where both
  /// are known; std::out_of_range for an unknown request.
  ImportResult finish(const std::string& request_id);
  /// Requests with chunks not yet finished, in order of their first chunk.
  std::vector<std::string> pending() const;

  struct State;  // the requests in flight (route_import_vllm_stream.cpp)

 private:
  std::shared_ptr<State> state_;
};

/// FlashInfer buffers saved as one .npy `[num_moe_layers(+MTP), N, K]` (the stacked
/// routing_replay_out of one batch, any little-endian integer dtype; int16 as written).
/// `cu_seqlens` empty: the whole batch is one sequence of N tokens. What `--format flashinfer`
/// reads.
ImportResult import_flashinfer_npy_bytes(std::string_view bytes, const std::string& source,
                                         const std::vector<int64_t>& cu_seqlens,
                                         const ImportOptions& options);

/// FlashInfer .npy files (as import_flashinfer_npy_bytes), `cu_seqlens[i]` for file i (empty
/// list, or no list at all: the file is one sequence). BackendError when a file cannot be read.
ImportResult import_flashinfer(const std::vector<std::string>& paths,
                               const std::vector<std::vector<int64_t>>& cu_seqlens,
                               const ImportOptions& options);

/// A recorded vLLM stream: one SSE event per line (`data: {...}`; blank lines, `[DONE]` and SSE
/// comment / `event:` lines are skipped), through a VllmRouteStream. One table per request, in the
/// order they finished. Every request must end with a `finish_reason` chunk; errors name
/// `source:line`. What `--format vllm-stream` reads.
ImportResult import_vllm_stream_text(std::string_view text, const std::string& source,
                                     const ImportOptions& options);
/// Recorded vLLM streams, one file each, in order.
ImportResult import_vllm_stream(const std::vector<std::string>& paths,
                                const ImportOptions& options);

/// The bytes of a .npy file (version 1.0, little-endian, C order) holding `array`, an int32 tensor
/// of any shape — e.g. one sequence's vLLM `routed_experts` `[seq_len-1, num_hidden_layers, K]`.
/// For exporting routes to tools that read vLLM's format (and for tests and the demo).
std::string encode_npy_int32(const Tensor& array);
/// The bytes of a .npy file (version 1.0, C order) of `shape` with element type `descr` ("<i2",
/// "<i8", ...) over `nbytes` bytes of little-endian `data` (the caller's, checked by nobody here).
std::string encode_npy(std::string_view descr, const std::vector<int64_t>& shape,
                       const void* data, size_t nbytes);

}  // namespace switchyard
