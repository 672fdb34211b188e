// vLLM streamed outputs: VllmRouteStream assembles route chunks per request; recorded SSE streams.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>

#include "route_import_core.h"
#include "switchyard/error.h"

namespace switchyard {

using detail::cat;
using detail::fail_arg;
using namespace detail;  // the importers' shared room (route_import_core.h)

namespace {
constexpr const char* kOp = kImportOp;
}  // namespace

// ---- vLLM streamed chunks ----------------------------------------------------------------------

struct VllmRouteStream::State {
  struct Request {
    int64_t prompt_start = -1;   // -1: options.prompt_start (fixed by the first chunk)
    int64_t prompt_tokens = -1;  // known or inferred prompt length
    bool prompt_inferred = false;
    int64_t generated = 0;        // G: generated tokens seen
    bool generated_known = true;  // every chunk told its token count
    int64_t chunks = 0;
    int64_t rows = 0;  // route rows received (from prompt_start on)
    std::vector<RouteTable> pieces;
    ImportReport report;
  };
  ImportOptions options;
  int64_t num_input_layers = 0;  // fixed by the first chunk (or the options)
  int64_t top_k = 0;
  std::vector<int64_t> moe_layers;
  int64_t num_hidden_layers = 0;
  std::map<std::string, Request> requests;
  std::vector<std::string> order;
  std::set<std::string> finished;  // ids already finished: a later chunk for one is an error
  JsonReader json;                 // add_sse's events, its buffers reused from one to the next

  void check_open(const std::string& id) const {
    if (finished.count(id)) {
      fail_arg(kOp, "request '", id,
               "' already finished: a chunk after its finish_reason (a "
               "repeated chunk?) or a reused request id");
    }
  }

  Request& get(const std::string& id) {
    auto it = requests.find(id);
    if (it == requests.end()) {
      order.push_back(id);
      it = requests.emplace(id, Request{}).first;
    }
    return it->second;
  }
  // usage.completion_tokens (vLLM's continuous usage: cumulative per request) against the tokens
  // the chunks so far emitted: a lost or repeated chunk shows here even without routes.
  static void check_completion(const std::string& where, bool g_known, int64_t G,
                               int64_t completion_tokens) {
    if (g_known && completion_tokens >= 0 && completion_tokens != G) {
      fail_arg(kOp, where, ": usage.completion_tokens=", completion_tokens,
               " but the chunks so far ", "emitted ", G, " tokens (",
               completion_tokens > G ? "a lost chunk?" : "a repeated chunk?", ")");
    }
  }
  int64_t start_of(const Request& q) const {
    return q.prompt_start >= 0 ? q.prompt_start : options.prompt_start;
  }

  // Validates one chunk fully, then (only then) appends it.
  void add(const std::string& id, const char* data, Elem elem, int64_t rows, int64_t layers,
           int64_t K, int64_t start, int64_t new_tokens, int64_t prompt_tokens,
           int64_t completion_tokens = -1) {
    check_open(id);
    auto found = requests.find(id);
    const Request empty;
    const Request& q = found == requests.end() ? empty : found->second;
    const std::string where = cat("request '", id, "' chunk ", q.chunks);
    if (new_tokens < -1 || prompt_tokens < -1 || start < -1) {
      fail_arg(kOp, where,
               ": start, new_tokens and prompt_tokens must be >= 0 (or -1: unknown), "
               "got ",
               start, ", ", new_tokens, ", ", prompt_tokens);
    }
    const int64_t first = start_of(q);
    const int64_t pos = first + q.rows;  // the next token without a route
    if (start >= 0 && start != pos) {
      fail_arg(kOp, where, ": routes start at token ", start, " but the request's routes so far ",
               "end at token ", pos,
               start > pos ? cat(": a gap, tokens ", pos, "..", start - 1, " have no chunk")
                           : cat(": an overlap, tokens ", start, "..", pos - 1,
                                 " already came (a cumulative chunk?)"));
    }
    if (num_input_layers > 0 && (layers != num_input_layers || K != top_k)) {
      fail_arg(kOp, where, ": [", rows, ", ", layers, ", ", K, "] routes, but the stream's ",
               "chunks have ", num_input_layers, " layers and top_k ", top_k);
    }
    ImportOptions o = options;
    ImportResult part;
    ArrayLayout lay;
    lay.last_token_row = false;
    lay.token_offset = pos;
    import_array(data, elem, rows, layers, K, where, o, part, lay);
    // Token positions: after this chunk the routes must cover [first, prompt + G - 1).
    int64_t prompt = prompt_tokens >= 0 ? prompt_tokens : q.prompt_tokens;
    const bool g_known = q.generated_known && new_tokens >= 0;
    const int64_t G = q.generated + std::max<int64_t>(new_tokens, 0);
    check_completion(where, g_known, G, completion_tokens);
    const int64_t end = pos + rows;
    bool inferred = q.prompt_inferred && prompt_tokens < 0;
    if (prompt >= 0 && prompt_tokens >= 0 && q.prompt_tokens >= 0 && prompt != q.prompt_tokens &&
        !q.prompt_inferred) {
      fail_arg(kOp, where, ": prompt_tokens=", prompt_tokens, " differs from the request's ",
               q.prompt_tokens);
    }
    if (g_known && rows > 0) {
      if (prompt < 0) {  // the first routed chunk fixes the prompt length
        prompt = end + 1 - G;
        inferred = true;
        if (prompt <= first && G > 0) {
          fail_arg(kOp, where, ": ", end - first, " route rows from token ", first, " for ", G,
                   " generated tokens leave no prompt token");
        }
      } else if (end != prompt + G - 1) {
        fail_arg(kOp, where, ": routes now end at token ", end, " but ",
                 inferred ? "the prompt inferred from the first chunk (" : "the prompt (", prompt,
                 " tokens) and ", G, " generated tokens need routes up to token ", prompt + G - 1,
                 end < prompt + G - 1 ? ": a gap (a chunk without its routes?)"
                                      : ": an overlap (a chunk repeating earlier routes?)");
      }
    }
    // Commit.
    if (num_input_layers == 0) {
      num_input_layers = layers;
      top_k = K;
      moe_layers = part.report.moe_layers;
      num_hidden_layers = part.report.num_hidden_layers;
    }
    Request& w = get(id);
    if (w.prompt_start < 0) w.prompt_start = first;
    w.prompt_tokens = prompt;
    w.prompt_inferred = inferred;
    w.generated = G;
    w.generated_known = g_known;
    ++w.chunks;
    w.rows += rows;
    ImportReport& a = w.report;
    const ImportReport& b = part.report;
    for (auto z : b.first_zero_rows)
      if (a.first_zero_rows.size() < kMaxReportedZeroRows) a.first_zero_rows.push_back(z);
    a.num_zero_rows += b.num_zero_rows;
    a.num_invalid_rows += b.num_invalid_rows;
    a.warnings.insert(a.warnings.end(), b.warnings.begin(), b.warnings.end());
    w.pieces.push_back(std::move(part.sequences[0]));
  }
};

VllmRouteStream::VllmRouteStream(const ImportOptions& options) : state_(std::make_shared<State>()) {
  check_import_options(options);
  if (options.prompt_start < 0 || options.prompt_start > kMaxStart)
    fail_arg(kOp, "prompt_start must be in [0, 2^24], got ", options.prompt_start);
  state_->options = options;
}

void VllmRouteStream::add(const std::string& request_id, const Tensor& routes, int64_t start,
                          int64_t new_tokens, int64_t prompt_tokens) {
  const std::string where = cat("request '", request_id, "'");
  if (routes.dim() != 3) {
    fail_arg(kOp, where, ": a chunk's routes must be 3-D [rows, layers, top_k], got ", routes.dim(),
             " dimensions");
  }
  state_->add(request_id, static_cast<const char*>(routes.raw()), tensor_elem(routes, where),
              routes.size(0), routes.size(1), routes.size(2), start, new_tokens, prompt_tokens);
}

void VllmRouteStream::add_npy(const std::string& request_id, std::string_view npy, int64_t start,
                              int64_t new_tokens, int64_t prompt_tokens) {
  const Npy3 a = parse_npy3(npy, cat("request '", request_id, "'"));
  state_->add(request_id, a.data, a.elem, a.shape[0], a.shape[1], a.shape[2], start, new_tokens,
              prompt_tokens);
}

void VllmRouteStream::add_tokens(const std::string& request_id, int64_t new_tokens,
                                 int64_t prompt_tokens) {
  if (new_tokens < 0 || prompt_tokens < -1) {
    fail_arg(kOp, "request '", request_id,
             "': new_tokens must be >= 0 and prompt_tokens >= -1, got ", new_tokens, " and ",
             prompt_tokens);
  }
  state_->check_open(request_id);
  State::Request& q = state_->get(request_id);
  q.generated += new_tokens;
  if (prompt_tokens >= 0 && q.prompt_tokens < 0) q.prompt_tokens = prompt_tokens;
  ++q.chunks;
}

void VllmRouteStream::set_prompt_start(const std::string& request_id, int64_t prompt_start) {
  if (prompt_start < 0 || prompt_start > kMaxStart) {
    fail_arg(kOp, "request '", request_id, "': prompt_start must be in [0, 2^24], got ",
             prompt_start);
  }
  auto it = state_->requests.find(request_id);
  if (it != state_->requests.end() && it->second.rows > 0 &&
      state_->start_of(it->second) != prompt_start) {
    fail_arg(kOp, "request '", request_id, "': prompt_start=", prompt_start,
             " comes after routes that started at token ", state_->start_of(it->second));
  }
  state_->get(request_id).prompt_start = prompt_start;
}

std::vector<std::string> VllmRouteStream::add_sse(std::string_view event) {
  using nlohmann::json;
  size_t b = event.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  event = event.substr(b);
  if (event.substr(0, 5) == "data:") event = event.substr(5);
  b = event.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  event = event.substr(b);
  const size_t e = event.find_last_not_of(" \t\r\n");
  event = event.substr(0, e + 1);
  if (event == "[DONE]") return {};
  json j;
  if (!state_->json.parse(event, j) || !j.is_object())
    fail_arg(kOp, "stream chunk: not a JSON object: ", std::string(event.substr(0, 80)));
  std::string id;
  for (const char* k : {"request_id", "id"})
    if (id.empty() && j.contains(k) && j[k].is_string()) id = j[k].get<std::string>();
  if (id.empty()) fail_arg(kOp, "stream chunk: no request_id / id string");
  if (!j.contains("choices") || !j["choices"].is_array())
    fail_arg(kOp, "stream chunk of '", id, "': no choices array");
  const json& choices = j["choices"];
  const json& usage = j.contains("usage") && j["usage"].is_object() ? j["usage"] : json();
  int64_t prompt = loose_count(usage, "prompt_tokens");
  if (prompt < 0 && j.contains("prompt_token_ids") && j["prompt_token_ids"].is_array())
    prompt = static_cast<int64_t>(j["prompt_token_ids"].size());
  const int64_t start =
      json_count(j, "routed_experts_prompt_start", -1, id, "routed_experts_prompt_start");
  // Cumulative per choice: only meaningful when the chunk carries one choice.
  const int64_t completion = choices.size() == 1 ? loose_count(usage, "completion_tokens") : -1;
  // Validate every choice before any changes state: decode first, then add.
  struct Piece {
    std::string key;
    std::string npy;
    bool has_routes = false;
    int64_t tokens = -1;
    bool finished = false;
  };
  std::vector<Piece> pieces;
  for (size_t c = 0; c < choices.size(); ++c) {
    const json& ch = choices[c];
    if (!ch.is_object())
      fail_arg(kOp, "stream chunk of '", id, "': choices[", c, "] is not an object");
    Piece p;
    const int64_t index = loose_count(ch, "index");
    p.key = cat(id, "/", index >= 0 ? index : static_cast<int64_t>(c));
    if (ch.contains("token_ids") && ch["token_ids"].is_array())
      p.tokens = static_cast<int64_t>(ch["token_ids"].size());
    p.finished = ch.contains("finish_reason") && !ch["finish_reason"].is_null();
    if (ch.contains("routed_experts") && !ch["routed_experts"].is_null()) {
      if (!ch["routed_experts"].is_string()) {
        fail_arg(kOp, "request '", p.key,
                 "': routed_experts must be a base64 string of .npy bytes, "
                 "got JSON ",
                 ch["routed_experts"].type_name());
      }
      try {
        p.npy = base64_decode(ch["routed_experts"].get_ref<const std::string&>());
      } catch (const std::invalid_argument& ex) {
        fail_arg(kOp, "request '", p.key, "' chunk: routed_experts: ", ex.what());
      }
      p.has_routes = true;
    }
    pieces.push_back(std::move(p));
  }
  std::vector<std::string> finished;
  for (Piece& p : pieces) {
    state_->check_open(p.key);
    if (start >= 0) set_prompt_start(p.key, start);
    auto it = state_->requests.find(p.key);
    const std::string where =
        cat("request '", p.key, "' chunk ", it == state_->requests.end() ? 0 : it->second.chunks);
    if (p.has_routes) {
      const Npy3 a = parse_npy3(p.npy, where);
      state_->add(p.key, a.data, a.elem, a.shape[0], a.shape[1], a.shape[2], -1, p.tokens, prompt,
                  completion);
    } else if (p.tokens >= 0) {
      const bool known = it == state_->requests.end() || it->second.generated_known;
      State::check_completion(where, known,
                              (it == state_->requests.end() ? 0 : it->second.generated) + p.tokens,
                              completion);
      add_tokens(p.key, p.tokens, prompt);
    } else {
      state_->get(p.key);
    }
    if (p.tokens < 0) state_->get(p.key).generated_known = false;
    if (p.finished) finished.push_back(p.key);
  }
  return finished;
}

ImportResult VllmRouteStream::finish(const std::string& request_id) {
  auto it = state_->requests.find(request_id);
  if (it == state_->requests.end())
    throw std::out_of_range(cat("[import] stream has no request '", request_id, "'"));
  const State::Request& q = it->second;
  const int64_t first = state_->start_of(q);
  if (q.rows == 0) {
    fail_arg(kOp, "request '", request_id, "': no routes arrived in its ", q.chunks,
             " chunks (the server needs --enable-return-routed-experts)");
  }
  if (q.generated_known && q.prompt_tokens >= 0 &&
      first + q.rows != q.prompt_tokens + q.generated - 1) {
    fail_arg(kOp, "request '", request_id, "': routes cover tokens ", first, "..",
             first + q.rows - 1, " but ", q.prompt_tokens, " prompt and ", q.generated,
             " generated tokens need routes up to token ", q.prompt_tokens + q.generated - 2,
             " (the stream is truncated?)");
  }
  const int64_t M = q.pieces[0].num_moe_layers(), K = q.pieces[0].top_k();
  const int64_t T = first + q.rows + 1;
  if (static_cast<double>(T) * double(M) * double(K) > double(int64_t{1} << 31))
    fail_arg(kOp, "request '", request_id, "': ", T, " rows of ", M, "x", K,
             " ids is more than 2^31 ids");
  RouteTable t = RouteTable::none(T, M, K, state_->options.num_experts);
  int32_t* dst = t.topk_idx.data<int32_t>() + first * M * K;
  for (const RouteTable& p : q.pieces) {
    const size_t n = static_cast<size_t>(p.num_tokens() * M * K);
    if (n) std::memcpy(dst, p.topk_idx.data<int32_t>(), n * sizeof(int32_t));
    dst += n;
  }
  ImportResult r;
  r.report = q.report;
  for (auto& z : r.report.first_zero_rows) z[0] = 0;
  r.report.num_sequences = 1;
  r.report.num_tokens = T;
  r.report.num_input_layers = state_->num_input_layers;
  r.report.num_hidden_layers = state_->num_hidden_layers;
  r.report.top_k = state_->top_k;
  r.report.moe_layers = state_->moe_layers;
  r.sequences.push_back(std::move(t));
  r.sources.push_back(cat("request '", request_id, "'"));
  state_->finished.insert(request_id);
  state_->requests.erase(it);
  state_->order.erase(std::find(state_->order.begin(), state_->order.end(), request_id));
  return r;
}

std::vector<std::string> VllmRouteStream::pending() const { return state_->order; }

ImportResult import_vllm_stream_text(std::string_view text, const std::string& source,
                                     const ImportOptions& options) {
  VllmRouteStream stream(options);
  ImportResult all;
  size_t pos = 0, line = 0;
  std::string where;
  try {
    while (pos < text.size()) {
      size_t end = text.find('\n', pos);
      if (end == std::string_view::npos) end = text.size();
      ++line;
      std::string_view l = text.substr(pos, end - pos);
      pos = end + 1;
      const size_t b = l.find_first_not_of(" \t\r");
      if (b == std::string_view::npos) continue;
      l = l.substr(b);
      if (l[0] == ':' || l.substr(0, 6) == "event:" || l.substr(0, 3) == "id:" ||
          l.substr(0, 6) == "retry:")
        continue;
      where = cat(source, ":", line);
      for (const std::string& id : stream.add_sse(l)) merge_import(all, stream.finish(id), where);
    }
  } catch (const std::invalid_argument& e) {
    fail_arg(kOp, where, ": ", strip_import_prefix(e));
  }
  const std::vector<std::string> open = stream.pending();
  if (!open.empty()) {
    fail_arg(kOp, source, ": request '", open[0], "' (and ", open.size() - 1, " more) never got a ",
             "chunk with finish_reason: the stream is truncated");
  }
  for (std::string& s : all.sources) s = cat(source, " ", s);
  return all;
}

ImportResult import_vllm_stream(const std::vector<std::string>& paths,
                                const ImportOptions& options) {
  return import_text_files(paths, options, &import_vllm_stream_text);
}

}  // namespace switchyard
