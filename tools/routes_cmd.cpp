// `switchyard routes ...`: import engine routes into route files, inspect, validate, compute load
// and drift statistics, and align files to a trainer's parallel layout.
#include <CLI/CLI.hpp>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "commands.h"
#include "route_input.h"
#include "switchyard/error.h"
#include "switchyard/route_align.h"
#include "switchyard/route_file.h"
#include "switchyard/route_import.h"
#include "switchyard/route_stats.h"
#include "switchyard/route_verl.h"

namespace {

using nlohmann::json;
using namespace switchyard;

constexpr int64_t kProgressEvery = 1000;

// Discards a command's uncommitted output when it leaves by an exception (after a successful
// commit there is nothing left to discard).
struct DiscardOnFailure {
  std::function<void()> discard;
  int uncaught = std::uncaught_exceptions();
  ~DiscardOnFailure() {
    if (std::uncaught_exceptions() > uncaught) discard();
  }
};

std::string percent(double share) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << 100.0 * share << "%";
  return os.str();
}

std::string fixed(double v, int digits = 2) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}

std::string list_str(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

json info_json(const RouteFileInfo& info) {
  return json{{"version", info.version},       {"num_experts", info.num_experts},
              {"top_k", info.top_k},           {"num_moe_layers", info.num_moe_layers},
              {"moe_layers", info.moe_layers}, {"num_hidden_layers", info.num_hidden_layers},
              {"id_width", info.id_width}};
}

// ------------------------------------------------------------------------------------------ import

struct ImportArgs {
  std::string format;
  int64_t num_experts = 0;
  int64_t first_k_dense = 0;
  std::string moe_layers;
  int64_t mtp_layers = 0;
  int64_t prompt_start = 0;
  int64_t num_layers = 0;
  int64_t top_k = 0;
  std::string zero_rows = "keep";
  std::string invalid_rows = "error";
  std::string routed_experts_dtype = "int32";  // sglang: the payload's id width
  std::vector<std::string> cu_seqlens;  // flashinfer: one list per input
  std::string output;
  int level = 1;
  bool json_out = false;
  std::vector<std::string> inputs;
};

// "0,5,12" -> {0, 5, 12}: integers only, no empty entries.
std::vector<int64_t> parse_offsets(const std::string& text) {
  std::vector<int64_t> v;
  size_t p = 0;
  while (p <= text.size()) {
    size_t q = text.find(',', p);
    if (q == std::string::npos) q = text.size();
    int64_t x = 0;
    const char* b = text.data() + p;
    const char* e = text.data() + q;
    auto [end, ec] = std::from_chars(b, e, x);
    if (b == e || ec != std::errc() || end != e) {
      throw std::invalid_argument("[routes import] --cu-seqlens '" + text +
                                  "' is not a comma-separated list of integers");
    }
    v.push_back(x);
    p = q + 1;
  }
  return v;
}

void run_import(const ImportArgs& a, std::ostream& out, std::ostream& err) {
  ImportOptions opt;
  opt.num_experts = a.num_experts;
  opt.layer_map.first_k_dense = a.first_k_dense;
  opt.layer_map.num_mtp_layers = a.mtp_layers;
  opt.prompt_start = a.prompt_start;
  if (!a.moe_layers.empty()) opt.layer_map.moe_layer_freq = parse_moe_layer_freq(a.moe_layers);
  opt.num_input_layers = a.num_layers;
  opt.top_k = a.top_k;
  if (a.invalid_rows == "none") {
    err << "[routes import] warning: --invalid-rows none is deprecated, spell it --invalid-rows "
           "native (the same meaning)\n";
  }
  opt.invalid_rows = a.invalid_rows == "error" ? ReplayRowPolicy::error : ReplayRowPolicy::native;
  opt.zero_rows = a.zero_rows == "none"    ? ZeroRowPolicy::to_none
                  : a.zero_rows == "error" ? ZeroRowPolicy::error
                                           : ZeroRowPolicy::keep;
  opt.routed_experts_dtype = a.routed_experts_dtype == "uint8"    ? DType::uint8
                             : a.routed_experts_dtype == "uint16" ? DType::uint16
                                                                  : DType::int32;
  if (a.format == "sglang" && (a.num_layers < 1 || a.top_k < 1)) {
    throw std::invalid_argument(
        "[routes import] --format sglang needs --num-layers and --top-k "
        "(SGLang's routed_experts is a flat array)");
  }
  if (!a.cu_seqlens.empty() &&
      (a.format != "flashinfer" || a.cu_seqlens.size() != a.inputs.size())) {
    throw std::invalid_argument(
        "[routes import] --cu-seqlens is for --format flashinfer, once per input (" +
        std::to_string(a.inputs.size()) + " inputs), got it " +
        std::to_string(a.cu_seqlens.size()) + " times");
  }
  std::unique_ptr<RouteFileWriter> writer;
  // A failed import publishes nothing: the partial output is removed and an existing file at
  // --output stays as it was (the writer only renames over it on close()).
  DiscardOnFailure guard{[&] {
    if (writer) writer->discard();
  }};
  ImportReport total;
  std::vector<std::string> warnings;
  int64_t next_progress = kProgressEvery;
  for (size_t i = 0; i < a.inputs.size(); ++i) {
    const std::string& path = a.inputs[i];
    ImportResult r;
    if (a.format == "vllm") {  // .npy files and JSON / JSONL HTTP responses, told apart by content
      r = import_vllm_files({path}, opt);
    } else if (a.format == "sglang") {
      r = import_sglang({path}, opt);
    } else if (a.format == "trtllm") {
      r = import_trtllm({path}, opt);
    } else if (a.format == "vllm-stream") {
      r = import_vllm_stream({path}, opt);
    } else {  // flashinfer
      std::vector<int64_t> cu;
      if (!a.cu_seqlens.empty()) cu = parse_offsets(a.cu_seqlens[i]);
      r = import_flashinfer({path}, {cu}, opt);
    }
    if (!writer && !r.sequences.empty()) {
      RouteFileInfo info;
      info.num_experts = a.num_experts;
      info.top_k = r.report.top_k;
      info.num_moe_layers = static_cast<int64_t>(r.report.moe_layers.size());
      info.moe_layers = r.report.moe_layers;
      info.num_hidden_layers = r.report.num_hidden_layers;
      // Later inputs must agree with the first one.
      opt.num_input_layers = r.report.num_input_layers;
      opt.top_k = r.report.top_k;
      writer = std::make_unique<RouteFileWriter>(a.output, info, RouteFileWriterOptions{a.level});
      total.moe_layers = r.report.moe_layers;
      total.num_input_layers = r.report.num_input_layers;
      total.top_k = r.report.top_k;
    }
    for (const RouteTable& t : r.sequences) writer->append(t);
    for (auto z : r.report.first_zero_rows) {
      if (total.first_zero_rows.size() >= 8) break;
      z[0] += total.num_sequences;
      total.first_zero_rows.push_back(z);
    }
    total.num_sequences += r.report.num_sequences;
    total.num_tokens += r.report.num_tokens;
    total.num_zero_rows += r.report.num_zero_rows;
    total.num_invalid_rows += r.report.num_invalid_rows;
    warnings.insert(warnings.end(), r.report.warnings.begin(), r.report.warnings.end());
    if (total.num_sequences >= next_progress) {
      err << "[routes import] " << total.num_sequences << " sequences, " << total.num_tokens
          << " tokens\n";
      while (next_progress <= total.num_sequences) next_progress += kProgressEvery;
    }
  }
  if (!writer) throw std::invalid_argument("[routes import] no sequences found in the inputs");
  writer->close();
  const int64_t bytes = writer->bytes_written();
  const double raw =
      4.0 * double(total.num_tokens) * double(total.moe_layers.size()) * double(total.top_k);
  if (a.json_out) {
    json zr = json::array();
    for (auto& z : total.first_zero_rows)
      zr.push_back({{"sequence", z[0]}, {"token", z[1]}, {"moe_layer", z[2]}});
    out << json{{"output", a.output},
                {"format", a.format},
                {"num_sequences", total.num_sequences},
                {"num_tokens", total.num_tokens},
                {"num_input_layers", total.num_input_layers},
                {"moe_layers", total.moe_layers},
                {"top_k", total.top_k},
                {"num_experts", a.num_experts},
                {"num_zero_rows", total.num_zero_rows},
                {"first_zero_rows", zr},
                {"num_invalid_rows", total.num_invalid_rows},
                {"warnings", warnings},
                {"bytes", bytes},
                {"ratio_vs_int32", bytes > 0 ? raw / double(bytes) : 0.0}}
               .dump(2)
        << "\n";
    return;
  }
  out << "imported " << total.num_sequences << " sequences, " << total.num_tokens << " tokens ("
      << a.format << ", " << total.num_input_layers << " input layers -> "
      << total.moe_layers.size() << " MoE layers " << list_str(total.moe_layers) << ", top_k "
      << total.top_k << ", " << a.num_experts << " experts)\n";
  out << "wrote " << a.output << ": " << bytes << " bytes (" << fixed(raw / double(bytes))
      << "x compression vs raw int32)\n";
  if (total.num_zero_rows > 0) {
    out << "all-zero rows on MoE layers: " << total.num_zero_rows << " (first:";
    for (auto& z : total.first_zero_rows)
      out << " seq " << z[0] << " token " << z[1] << " layer " << z[2] << ";";
    out << ")"
        << (opt.zero_rows == ZeroRowPolicy::to_none ? " -> stored as -1"
                                                    : " (kept; --zero-rows none stores them as -1)")
        << "\n";
  }
  if (total.num_invalid_rows > 0) {
    out << "invalid rows (repeated id, or -1 mixed with ids): " << total.num_invalid_rows
        << " -> stored as -1\n";
  }
  for (const auto& w : warnings) out << "warning: " << w << "\n";
}

// ----------------------------------------------------------------------------- inspect / validate

void run_inspect(const std::string& path, bool json_out, bool list, const RouteInputOptions& io,
                 std::ostream& out, std::ostream& err) {
  RouteInput in(path, io, "routes inspect");  // header and index; blocks are not decoded here
  const RouteFileReader& r = in.reader();
  const RouteFileInfo& info = r.info();
  int64_t tokens = 0;
  for (int64_t i = 0; i < r.num_sequences(); ++i) tokens += r.entry(i).num_tokens;
  const double raw = 4.0 * double(tokens) * double(info.num_moe_layers * info.top_k);
  if (json_out) {
    json j{{"file", path},
           {"info", info_json(info)},
           {"complete", r.complete()},
           {"status", r.status()},
           {"num_sequences", r.num_sequences()},
           {"num_tokens", tokens},
           {"bytes", r.file_size()},
           {"ratio_vs_int32", r.file_size() > 0 ? raw / double(r.file_size()) : 0.0}};
    if (list) {
      json seqs = json::array();
      for (int64_t i = 0; i < r.num_sequences(); ++i) {
        seqs.push_back({{"offset", r.entry(i).offset},
                        {"num_tokens", r.entry(i).num_tokens},
                        {"stored_bytes", r.entry(i).stored_bytes}});
      }
      j["sequences"] = seqs;
    }
    out << j.dump(2) << "\n";
    in.finish(err);
    return;
  }
  out << path << ": route file v" << info.version << ", "
      << (r.complete() ? "complete" : "INCOMPLETE: " + r.status()) << "\n";
  out << "  num_experts " << info.num_experts << ", top_k " << info.top_k << ", "
      << info.num_moe_layers << " MoE layers";
  if (!info.moe_layers.empty()) out << " (hidden layers " << list_str(info.moe_layers);
  if (info.num_hidden_layers > 0) out << " of " << info.num_hidden_layers;
  if (!info.moe_layers.empty()) out << ")";
  out << ", ids stored in " << info.id_width << " byte" << (info.id_width > 1 ? "s" : "") << "\n";
  out << "  " << r.num_sequences() << " sequences, " << tokens << " tokens, " << r.file_size()
      << " bytes (" << fixed(r.file_size() > 0 ? raw / double(r.file_size()) : 0.0)
      << "x compression vs raw int32)\n";
  if (list) {
    for (int64_t i = 0; i < r.num_sequences(); ++i) {
      out << "  sequence " << i << ": " << r.entry(i).num_tokens << " tokens, "
          << r.entry(i).stored_bytes << " bytes at offset " << r.entry(i).offset << "\n";
    }
  }
  in.finish(err);
}

void run_validate(const std::string& path, bool json_out, const RouteInputOptions& io,
                  std::ostream& out) {
  const RouteFileCheck c = verify_route_file(path, RouteDecodeOptions{io.max_decoded_bytes});
  if (json_out) {
    out << json{{"file", path},
                {"ok", c.ok},
                {"num_sequences", c.num_sequences},
                {"num_readable", c.num_readable},
                {"num_tokens", c.num_tokens},
                {"problems", c.problems}}
               .dump(2)
        << "\n";
  } else if (c.ok) {
    out << path << ": ok (" << c.num_sequences << " sequences, " << c.num_tokens << " tokens)\n";
  } else {
    out << path << ": INVALID (" << c.num_readable << " of " << c.num_sequences
        << " sequences readable)\n";
    for (const auto& p : c.problems) out << "  " << p << "\n";
  }
  if (!c.ok) throw CLI::RuntimeError(kExitBad);
}

// --------------------------------------------------------------------------------- stats / diff

void run_stats(const std::string& path, bool json_out, int64_t top, const RouteInputOptions& io,
               std::ostream& out, std::ostream& err) {
  RouteInput in(path, io, "routes stats");
  const RouteFileReader& r = in.reader();
  ExpertLoad load;
  int64_t tokens = 0, used = 0;
  for (int64_t i = 0; i < r.num_sequences(); ++i) {
    const std::optional<RouteTable> t = in.read(i);
    if (!t) continue;
    ++used;
    tokens += t->num_tokens();
    accumulate_expert_load(*t, load);
    if ((i + 1) % kProgressEvery == 0) err << "[routes stats] " << i + 1 << " sequences\n";
  }
  const RouteFileInfo& info = r.info();
  if (load.num_moe_layers == 0) {  // empty file
    load.num_experts = info.num_experts;
    load.num_moe_layers = info.num_moe_layers;
    load.num_tokens_per_expert.assign(size_t(info.num_experts * info.num_moe_layers), 0);
    load.num_assignments.assign(size_t(info.num_moe_layers), 0);
    load.num_none_rows.assign(size_t(info.num_moe_layers), 0);
  }
  json layers = json::array();
  std::ostringstream human;
  for (int64_t l = 0; l < load.num_moe_layers; ++l) {
    const auto hot = hot_experts(load, l, top);
    const int64_t hidden = info.moe_layers.empty() ? -1 : info.moe_layers[size_t(l)];
    json h = json::array();
    human << "  layer " << l;
    if (hidden >= 0) human << " (hidden " << hidden << ")";
    human << ": " << load.num_assignments[size_t(l)] << " assignments, "
          << load.num_none_rows[size_t(l)] << " rows without route, max/mean load "
          << fixed(load_imbalance(load, l)) << ", hot:";
    for (const auto& e : hot) {
      h.push_back({{"expert", e.expert}, {"count", e.count}, {"share", e.share}});
      human << " " << e.expert << " (" << percent(e.share) << ")";
    }
    human << "\n";
    std::vector<int64_t> counts(load.num_tokens_per_expert.begin() + l * load.num_experts,
                                load.num_tokens_per_expert.begin() + (l + 1) * load.num_experts);
    layers.push_back({{"layer", l},
                      {"hidden_layer", hidden},
                      {"num_assignments", load.num_assignments[size_t(l)]},
                      {"num_none_rows", load.num_none_rows[size_t(l)]},
                      {"imbalance", load_imbalance(load, l)},
                      {"hot_experts", h},
                      {"num_tokens_per_expert", counts}});
  }
  if (json_out) {
    out << json{{"file", path},
                {"info", info_json(info)},
                {"num_sequences", used},
                {"num_tokens", tokens},
                {"layers", layers}}
               .dump(2)
        << "\n";
    in.finish(err);
    return;
  }
  out << path << ": " << used << " sequences, " << tokens << " tokens, " << info.num_experts
      << " experts, top_k " << info.top_k << "\n"
      << human.str();
  in.finish(err);
}

void run_diff(const std::string& pa, const std::string& pb, bool json_out,
              const RouteInputOptions& io, std::ostream& out, std::ostream& err) {
  RouteInput ina(pa, io, "routes diff"), inb(pb, io, "routes diff");
  const RouteFileReader &a = ina.reader(), &b = inb.reader();
  const RouteFileInfo &ia = a.info(), &ib = b.info();
  if (ia.num_experts != ib.num_experts || ia.top_k != ib.top_k ||
      ia.num_moe_layers != ib.num_moe_layers) {
    throw std::invalid_argument("[routes diff] files differ in layout: " + pa +
                                " has num_experts=" + std::to_string(ia.num_experts) +
                                ", top_k=" + std::to_string(ia.top_k) + ", " +
                                std::to_string(ia.num_moe_layers) + " MoE layers; " + pb + " has " +
                                std::to_string(ib.num_experts) + ", " + std::to_string(ib.top_k) +
                                ", " + std::to_string(ib.num_moe_layers));
  }
  if (!ia.moe_layers.empty() && !ib.moe_layers.empty() && ia.moe_layers != ib.moe_layers) {
    // Same sizes but different hidden layers: layer l of one file is not layer l of the other.
    throw std::invalid_argument("[routes diff] files have different MoE layer maps: " + pa +
                                " holds hidden layers " + list_str(ia.moe_layers) + ", " + pb +
                                " holds " + list_str(ib.moe_layers));
  }
  if (ia.num_hidden_layers > 0 && ib.num_hidden_layers > 0 &&
      ia.num_hidden_layers != ib.num_hidden_layers) {
    throw std::invalid_argument("[routes diff] files come from models with different layer "
                                "counts: " + pa + " has " + std::to_string(ia.num_hidden_layers) +
                                " hidden layers, " + pb + " has " +
                                std::to_string(ib.num_hidden_layers));
  }
  // Under --salvage a cut file holds fewer sequences: the pairs both files still have are
  // compared (finish_inputs reports the rest as lost).
  if (a.num_sequences() != b.num_sequences() && !(io.salvage && (ina.damaged() || inb.damaged()))) {
    throw std::invalid_argument("[routes diff] " + pa + " holds " +
                                std::to_string(a.num_sequences()) + " sequences, " + pb +
                                " holds " + std::to_string(b.num_sequences()));
  }
  const int64_t n = std::min(a.num_sequences(), b.num_sequences());
  RouteDrift d;
  int64_t compared = 0;
  for (int64_t i = 0; i < n; ++i) {
    const std::optional<RouteTable> oa = ina.read(i), ob = inb.read(i);
    if (!oa || !ob) continue;
    const RouteTable &ta = *oa, &tb = *ob;
    ++compared;
    if (ta.num_tokens() != tb.num_tokens()) {
      throw std::invalid_argument("[routes diff] sequence " + std::to_string(i) + " has " +
                                  std::to_string(ta.num_tokens()) + " tokens in " + pa + " and " +
                                  std::to_string(tb.num_tokens()) + " in " + pb);
    }
    accumulate_route_drift(ta, tb, d);
    if ((i + 1) % kProgressEvery == 0) err << "[routes diff] " << i + 1 << " sequences\n";
  }
  if (d.layer_decisions.empty()) {
    d.layer_decisions.assign(size_t(ia.num_moe_layers), 0);
    d.layer_differing_decisions.assign(size_t(ia.num_moe_layers), 0);
  }
  std::vector<double> per_layer;
  for (int64_t l = 0; l < ia.num_moe_layers; ++l) per_layer.push_back(d.layer_mismatch(l));
  if (json_out) {
    out << json{{"a", pa},
                {"b", pb},
                {"num_sequences", compared},
                {"num_tokens", d.num_tokens},
                {"num_rows", d.num_rows},
                {"num_skipped_rows", d.num_skipped_rows},
                {"num_decisions", d.num_decisions},
                {"num_differing_decisions", d.num_differing_decisions},
                {"num_differing_rows", d.num_differing_rows},
                {"num_differing_tokens", d.num_differing_tokens},
                {"decision_mismatch", d.decision_mismatch()},
                {"token_mismatch", d.token_mismatch()},
                {"mean_differing_layers", d.mean_differing_layers()},
                {"layer_mismatch", per_layer}}
               .dump(2)
        << "\n";
    finish_inputs(err, {&ina, &inb});
    return;
  }
  out << "compared " << compared << " sequences, " << d.num_tokens << " tokens, "
      << d.num_rows << " rows (" << d.num_skipped_rows << " rows skipped: no route on a side)\n";
  out << "  router decisions that differ:   " << percent(d.decision_mismatch()) << " ("
      << d.num_differing_decisions << " of " << d.num_decisions << ")\n";
  out << "  tokens with a differing layer:  " << percent(d.token_mismatch()) << " ("
      << d.num_differing_tokens << " of " << d.num_tokens << ")\n";
  out << "  differing layers per token:     " << fixed(d.mean_differing_layers(), 3) << "\n";
  out << "  per layer:";
  for (size_t l = 0; l < per_layer.size(); ++l) out << " " << l << ":" << percent(per_layer[l]);
  out << "\n";
  finish_inputs(err, {&ina, &inb});
}

// ----------------------------------------------------------------------------------------- align

struct AlignArgs {
  std::string input, output;
  int64_t tp = 1, cp = 1, fp8_align = 0, tp_rank = 0, cp_rank = 0;
  bool sequence_parallel = false;
  int64_t pp = 1, pp_rank = 0, vpp = 1, vpp_rank = 0, first_stage_layers = 0, last_stage_layers = 0;
  int64_t num_hidden_layers = 0;
  int64_t micro_batch_size = 0;
  bool json_out = false;
  RouteInputOptions read_opts;
};

void run_align(const AlignArgs& a, std::ostream& out, std::ostream& err) {
  if (a.pp < 1 || a.vpp < 1) {
    throw std::invalid_argument("[routes align] --pp and --vpp must be >= 1, got --pp " +
                                std::to_string(a.pp) + " and --vpp " + std::to_string(a.vpp));
  }
  if (a.micro_batch_size < 0) {
    throw std::invalid_argument(
        "[routes align] --micro-batch-size must be >= 0 (0 = all sequences), got " +
        std::to_string(a.micro_batch_size));
  }
  RouteInput in(a.input, a.read_opts, "routes align");
  const RouteFileInfo& info = in.info();
  // Pipeline slice over MoE layers.
  int64_t begin = 0, end = info.num_moe_layers;
  if (a.pp > 1 || a.vpp > 1) {
    const int64_t hidden = a.num_hidden_layers > 0 ? a.num_hidden_layers : info.num_hidden_layers;
    if (info.moe_layers.empty() || hidden < 1) {
      throw std::invalid_argument(
          "[routes align] pipeline slicing needs the layer map: " + a.input +
          " does not record it; pass --num-hidden-layers (and import with a "
          "layer map)");
    }
    std::tie(begin, end) = pp_moe_layer_range(
        info.moe_layers, hidden,
        {a.pp, a.pp_rank, a.vpp, a.vpp_rank, a.first_stage_layers, a.last_stage_layers});
  }
  if (end == begin) {
    throw std::invalid_argument("[routes align] pipeline chunk (pp_rank " +
                                std::to_string(a.pp_rank) + ", vpp_rank " +
                                std::to_string(a.vpp_rank) + ") owns no MoE layer");
  }
  // Every sequence is read and verified before the output is opened.
  const std::vector<RouteTable> seqs = in.read_all();
  if (seqs.empty()) {
    if (in.damaged()) in.finish(err);  // nothing readable: say what was lost
    throw std::invalid_argument("[routes align] " + a.input + " holds no sequence");
  }
  const int64_t mbs =
      a.micro_batch_size > 0 ? a.micro_batch_size : static_cast<int64_t>(seqs.size());
  RouteFileInfo oinfo = info;
  oinfo.num_moe_layers = end - begin;
  if (!info.moe_layers.empty()) {
    oinfo.moe_layers.assign(info.moe_layers.begin() + begin, info.moe_layers.begin() + end);
  }
  RouteFileWriter w(a.output, oinfo);
  DiscardOnFailure guard{[&] { w.discard(); }};
  json batches = json::array();
  std::ostringstream human;
  int64_t mb_index = 0;
  for (const auto& mb : split_micro_batches(seqs, mbs)) {
    PackedRoutes p = pack_thd(mb, {a.tp, a.cp, a.fp8_align});
    RouteTable local = cp_zigzag_split(p.table, p.cu_seqlens_padded, a.cp, a.cp_rank);
    if (a.sequence_parallel) local = sp_split(local, a.tp, a.tp_rank);
    local = slice_layers(local, begin, end);
    w.append(local);
    batches.push_back({{"micro_batch", mb_index},
                       {"num_sequences", mb.size()},
                       {"cu_seqlens", p.cu_seqlens},
                       {"cu_seqlens_padded", p.cu_seqlens_padded},
                       {"num_local_tokens", local.num_tokens()}});
    human << "  micro-batch " << mb_index << ": " << mb.size() << " sequences, cu_seqlens_padded "
          << list_str(p.cu_seqlens_padded) << ", " << local.num_tokens() << " local tokens\n";
    ++mb_index;
    if (mb_index % kProgressEvery == 0) err << "[routes align] " << mb_index << " micro-batches\n";
  }
  w.close();
  if (a.json_out) {
    out << json{{"input", a.input},
                {"output", a.output},
                {"pack_alignment", pack_alignment({a.tp, a.cp, a.fp8_align})},
                {"moe_layer_range", {begin, end}},
                {"micro_batches", batches}}
               .dump(2)
        << "\n";
    in.finish(err);
    return;
  }
  out << "aligned " << seqs.size() << " sequences of " << a.input << " into " << mb_index
      << " micro-batches -> " << a.output << "\n";
  out << "  padding multiple " << pack_alignment({a.tp, a.cp, a.fp8_align}) << " (tp " << a.tp
      << ", cp " << a.cp << ", fp8 " << a.fp8_align << "); cp rank " << a.cp_rank;
  if (a.sequence_parallel) out << ", sp over tp rank " << a.tp_rank;
  out << "; MoE layers [" << begin << ", " << end << ")\n" << human.str();
  in.finish(err);
}

// ------------------------------------------------------------------------------------------ export

struct ExportArgs {
  std::string format;
  std::string input;
  std::string output;
  int64_t num_hidden_layers = 0;
  std::string padding_side = "left";
  int64_t seq_len = 0;
  bool json_out = false;
  RouteInputOptions read_opts;
};

// verl's batch layout: OUT.routed_experts.npy (int16 [batch, seq, num_hidden_layers, K]) and
// OUT.attention_mask.npy (int64 [batch, seq]).
void run_export(const ExportArgs& a, std::ostream& out, std::ostream& err) {
  RouteInput in(a.input, a.read_opts, "routes export");
  const RouteFileInfo& info = in.info();
  const int64_t hidden = a.num_hidden_layers > 0 ? a.num_hidden_layers : info.num_hidden_layers;
  if (info.moe_layers.empty() || hidden < 1) {
    throw std::invalid_argument(
        "[routes export] verl's layout needs the layer map: " + a.input +
        " does not record it; import with --first-k-dense or --moe-layers (and pass "
        "--num-hidden-layers if the file lacks the layer count)");
  }
  // Every sequence is read and verified before any output file is opened.
  const std::vector<RouteTable> seqs = in.read_all();
  if (seqs.empty()) {
    if (in.damaged()) in.finish(err);
    throw std::invalid_argument("[routes export] " + a.input + " holds no sequence");
  }
  VerlOptions o;
  o.num_hidden_layers = hidden;
  o.padding_side = a.padding_side == "right" ? PaddingSide::right : PaddingSide::left;
  o.seq_len = a.seq_len;
  VerlBatch v = to_verl(seqs, info.moe_layers, o);
  const Tensor& ids = v.routed_experts;  // int16, as verl holds it
  const std::vector<int64_t> shape = {ids.size(0), ids.size(1), ids.size(2), ids.size(3)};
  const std::string ids_path = a.output + ".routed_experts.npy";
  const std::string mask_path = a.output + ".attention_mask.npy";
  // Committed like a route file (PartialFile): both files are written beside their targets,
  // synced, and only then renamed over them, so a failed export (disk full, a file size limit,
  // an interrupt) leaves the previous export as it was, and its partial files are removed.
  std::optional<PartialFile> ids_file, mask_file;
  DiscardOnFailure guard{[&] {
    if (ids_file) ids_file->discard();
    if (mask_file) mask_file->discard();
  }};
  ids_file.emplace(ids_path, "routes export", "routes export");
  mask_file.emplace(mask_path, "routes export", "routes export");
  ids_file->write(encode_npy("<i2", shape, ids.raw(), ids.nbytes()));
  mask_file->write(
      encode_npy("<i8", {shape[0], shape[1]}, v.attention_mask.raw(), v.attention_mask.nbytes()));
  ids_file->sync();
  mask_file->sync();
  ids_file->publish();
  mask_file->publish();
  if (a.json_out) {
    out << json{{"input", a.input},
                {"format", a.format},
                {"routed_experts", ids_path},
                {"routed_experts_shape", shape},
                {"attention_mask", mask_path},
                {"padding_side", a.padding_side},
                {"moe_layers", info.moe_layers}}
               .dump(2)
        << "\n";
    in.finish(err);
    return;
  }
  out << "exported " << shape[0] << " sequences of " << a.input << " in verl's layout ("
      << a.padding_side << " padded)\n"
      << "  " << ids_path << ": int16 " << list_str(shape) << " (dense layers, padding and tokens "
      << "without a route are 0)\n"
      << "  " << mask_path << ": int64 " << list_str({shape[0], shape[1]}) << "\n";
  in.finish(err);
}

}  // namespace

void register_routes_commands(CLI::App& app, std::ostream& out, std::ostream& err) {
  CLI::App* routes =
      app.add_subcommand("routes", "Route data: import, inspect, validate, stats, diff, align");
  routes->require_subcommand(1);

  // Layer counts that 0 leaves to the file or to an even split must not be negative: align and
  // export took a negative one as given (--first-stage-layers -1 sized the pipeline stages from
  // it). 65536: the route file's layer limit.
  const CLI::Range layer_count(int64_t{0}, int64_t{65536});

  auto ia = std::make_shared<ImportArgs>();
  CLI::App* imp = routes->add_subcommand(
      "import", "Import vLLM .npy / HTTP JSON or SGLang JSON/JSONL routes into a route file");
  imp->add_option("--format", ia->format, "Input format")
      ->required()
      ->check(CLI::IsMember({"vllm", "sglang", "trtllm", "flashinfer", "vllm-stream"}));
  imp->add_option("--num-experts", ia->num_experts, "Experts per MoE layer (E)")->required();
  auto* fkd =
      imp->add_option("--first-k-dense", ia->first_k_dense, "The first N hidden layers are dense");
  auto* ml = imp->add_option(
      "--moe-layers", ia->moe_layers,
      "Per hidden layer 0 (dense) or 1 (MoE), comma-separated, NxV repeats (3x0,45x1)");
  fkd->excludes(ml);
  imp->add_option("--mtp-layers", ia->mtp_layers, "Trailing MTP layers in the input, left out");
  imp->add_option("--prompt-start", ia->prompt_start,
                  "Tokens before the first returned route (vLLM: the request's "
                  "routed_experts_prompt_start; SGLang: routed_experts_start_len where meta_info "
                  "lacks it); they get -1 rows");
  // Given, each must be >= 1 (left out, 0: vllm reads them from the arrays); an explicit 0 was
  // taken as "left out" and the import went on.
  imp->add_option("--num-layers", ia->num_layers,
                  "Layers per token in the input (hidden + MTP); required for sglang, checked "
                  "against the arrays for vllm")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  imp->add_option("--top-k", ia->top_k,
                  "K; required for sglang, checked against the arrays for vllm")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  imp->add_option("--zero-rows", ia->zero_rows,
                  "All-zero rows on MoE layers: keep, none (store -1) or error")
      ->check(CLI::IsMember({"keep", "none", "error"}));
  imp->add_option("--invalid-rows", ia->invalid_rows,
                  "Rows that repeat an id or mix -1 with ids: error, or native (store -1: replay "
                  "routes them natively); none is a deprecated spelling of native")
      ->check(CLI::IsMember({"error", "native", "none"}));
  imp->add_option("--routed-experts-dtype", ia->routed_experts_dtype,
                  "sglang: the payload's id width, int32 (SGLang today), uint8 or uint16 "
                  "(proposed in sgl-project/sglang#31219)")
      ->check(CLI::IsMember({"int32", "uint8", "uint16"}));
  imp->add_option("--cu-seqlens", ia->cu_seqlens,
                  "flashinfer: token offsets of the sequences in the batch (0,5,12), once per "
                  "input; left out, each input is one sequence");
  imp->add_option("--level", ia->level, "zstd level (1-19)");
  imp->add_option("-o,--output", ia->output, "Route file to write")->required();
  imp->add_flag("--json", ia->json_out, "Machine-readable output");
  imp->add_option("inputs", ia->inputs, "Input files (vllm: .npy per sequence or JSON/JSONL responses; sglang: JSON/JSONL)")
      ->required()
      ->check(CLI::ExistingFile);
  imp->callback([ia, &out, &err] { run_guarded(err, [&] { run_import(*ia, out, err); }); });

  struct FileArgs {
    std::string path;
    bool json_out = false;
    bool list = false;
    int64_t top = 5;
    RouteInputOptions read_opts;
  };
  auto fa = std::make_shared<FileArgs>();
  CLI::App* ins =
      routes->add_subcommand("inspect", "Header, sequence count and size of a route file");
  ins->add_option("file", fa->path)->required();
  ins->add_flag("--json", fa->json_out, "Machine-readable output");
  ins->add_flag("--list", fa->list, "List every sequence");
  add_route_input_options(ins, fa->read_opts);
  ins->callback([fa, &out, &err] {
    run_guarded(err, [&] { run_inspect(fa->path, fa->json_out, fa->list, fa->read_opts, out, err); });
  });

  auto va = std::make_shared<FileArgs>();
  CLI::App* val =
      routes->add_subcommand("validate", "Decode every block; exit 0 only for an intact file");
  val->add_option("file", va->path)->required();
  val->add_flag("--json", va->json_out, "Machine-readable output");
  val->add_option("--max-decoded-bytes", va->read_opts.max_decoded_bytes, kMaxDecodedBytesHelp)
      ->check(kMaxDecodedBytesRange);
  val->callback([va, &out, &err] {
    run_guarded(err, [&] { run_validate(va->path, va->json_out, va->read_opts, out); });
  });

  auto sa = std::make_shared<FileArgs>();
  CLI::App* st = routes->add_subcommand("stats", "Expert load per layer and hot experts");
  st->add_option("file", sa->path)->required();
  st->add_option("--top", sa->top, "Hot experts to show per layer");
  st->add_flag("--json", sa->json_out, "Machine-readable output");
  add_route_input_options(st, sa->read_opts);
  st->callback([sa, &out, &err] {
    run_guarded(err, [&] { run_stats(sa->path, sa->json_out, sa->top, sa->read_opts, out, err); });
  });

  struct DiffArgs {
    std::string a, b;
    bool json_out = false;
    RouteInputOptions read_opts;
  };
  auto da = std::make_shared<DiffArgs>();
  CLI::App* df = routes->add_subcommand("diff", "Drift between two route files of the same tokens");
  df->add_option("a", da->a)->required();
  df->add_option("b", da->b)->required();
  df->add_flag("--json", da->json_out, "Machine-readable output");
  add_route_input_options(df, da->read_opts);
  df->callback([da, &out, &err] {
    run_guarded(err, [&] { run_diff(da->a, da->b, da->json_out, da->read_opts, out, err); });
  });

  auto aa = std::make_shared<AlignArgs>();
  CLI::App* al =
      routes->add_subcommand("align", "Pack, pad and split a route file for one trainer rank");
  al->add_option("file", aa->input)->required();
  al->add_option("-o,--output", aa->output, "Route file to write (one record per micro-batch)")
      ->required();
  al->add_option("--tp", aa->tp, "Tensor-parallel size");
  al->add_option("--cp", aa->cp, "Context-parallel size (zigzag split)");
  al->add_option("--cp-rank", aa->cp_rank, "Context-parallel rank to keep");
  al->add_flag("--sequence-parallel", aa->sequence_parallel, "Split tokens over TP ranks");
  al->add_option("--tp-rank", aa->tp_rank,
                 "Tensor-parallel rank to keep (with --sequence-parallel)");
  al->add_option("--fp8-align", aa->fp8_align, "Extra padding multiple for FP8 (16 or 128)");
  al->add_option("--pp", aa->pp, "Pipeline-parallel size");
  al->add_option("--pp-rank", aa->pp_rank, "Pipeline rank");
  al->add_option("--vpp", aa->vpp, "Virtual pipeline stages per rank");
  al->add_option("--vpp-rank", aa->vpp_rank, "Virtual pipeline stage");
  al->add_option("--first-stage-layers", aa->first_stage_layers,
                 "Hidden layers of the first stage (uneven)")
      ->check(layer_count);
  al->add_option("--last-stage-layers", aa->last_stage_layers,
                 "Hidden layers of the last stage (uneven)")
      ->check(layer_count);
  al->add_option("--num-hidden-layers", aa->num_hidden_layers,
                 "Override the file's hidden layer count")
      ->check(layer_count);
  al->add_option("--micro-batch-size", aa->micro_batch_size,
                 "Sequences per micro-batch (default: all)");
  al->add_flag("--json", aa->json_out, "Machine-readable output");
  add_route_input_options(al, aa->read_opts);
  al->callback([aa, &out, &err] { run_guarded(err, [&] { run_align(*aa, out, err); }); });

  auto ea = std::make_shared<ExportArgs>();
  CLI::App* ex = routes->add_subcommand(
      "export", "Write a route file in a trainer's batch layout (verl: int16 routed_experts + mask)");
  ex->add_option("--format", ea->format, "Output layout")
      ->required()
      ->check(CLI::IsMember({"verl"}));
  ex->add_option("file", ea->input)->required();
  ex->add_option("-o,--output", ea->output,
                 "Output prefix: writes OUT.routed_experts.npy and OUT.attention_mask.npy")
      ->required();
  ex->add_option("--num-hidden-layers", ea->num_hidden_layers,
                 "Override the file's hidden layer count")
      ->check(layer_count);
  ex->add_option("--padding-side", ea->padding_side, "left (verl's default) or right")
      ->check(CLI::IsMember({"left", "right"}));
  ex->add_option("--seq-len", ea->seq_len, "Columns of the batch (default: the longest sequence)");
  ex->add_flag("--json", ea->json_out, "Machine-readable output");
  add_route_input_options(ex, ea->read_opts);
  ex->callback([ea, &out, &err] { run_guarded(err, [&] { run_export(*ea, out, err); }); });
}
