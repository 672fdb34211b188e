// `switchyard quickcheck`: the engine's quick check on an embedded default (the main job is
// `python -m switchyard.demo`). It plays one RL step's routing story on a
// Qwen3-30B-A3B-shaped router (H 2048, E 128, K 8) with synthetic RMS-normalised bf16 hidden states:
//
//  1. the rollout engine routes with bf16 logits (what inference stacks do by default), the trainer
//     with the engine's fp32 router, both against an fp64 reference: how far they drift;
//  2. the rollout's routes leave the engine as vLLM arrays (a dense first layer, no route for the
//     last token), are imported through a layer map, stored in a route file and read back;
//  3. the trainer replays them (R3): zero drift, weights from its live fp32 logits, gradients into
//     the gate, and activation-checkpoint recompute that reuses the same ids;
//  4. tokens are dispatched to their experts and combined (both dispatchers), checked against a
//     direct fp64 computation;
//  5. batch invariance: a token's logits alone, in the batch and on 1 or 2 threads are bitwise equal.
//
// Every number printed is measured in this run; nothing is hard-coded.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "switchyard/dispatcher.h"
#include "switchyard/dist.h"
#include "switchyard/error.h"
#include "switchyard/gate.h"
#include "switchyard/replay.h"
#include "switchyard/route_file.h"
#include "switchyard/route_import.h"
#include "switchyard/route_stats.h"
#include "switchyard/router.h"

namespace sy = switchyard;
using sy::DType;
using sy::Tensor;

namespace {

struct QuickcheckConfig {
  int64_t hidden = 2048;
  int64_t num_experts = 128;
  int64_t top_k = 8;
  int64_t num_moe_layers = 4;
  int64_t first_k_dense = 1;
  int64_t num_sequences = 8;
  int64_t seq_len = 256;
  uint64_t seed = 7;
  std::string out_dir;
  bool json = false;
};

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// RMS-normalised hidden states as a transformer layer hands them to its router: v/rms(v) scaled by
// a norm weight near 1, stored in bf16.
Tensor make_hidden(int64_t T, int64_t H, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> g(static_cast<size_t>(H));
  for (auto& v : g) v = 1.0 + 0.1 * nd(rng);
  Tensor x = Tensor::empty({T, H}, DType::bf16);
  sy::bf16* px = x.data<sy::bf16>();
  std::vector<double> v(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (auto& e : v) {
      e = nd(rng);
      ss += e * e;
    }
    const double inv_rms = 1.0 / std::sqrt(ss / static_cast<double>(H) + 1e-6);
    for (int64_t h = 0; h < H; ++h) {
      px[t * H + h] = sy::float_to_bf16(static_cast<float>(v[h] * inv_rms * g[h]));
    }
  }
  return x;
}

Tensor make_gate_weight(int64_t E, int64_t H, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, 0.02);
  Tensor w = Tensor::empty({E, H}, DType::bf16);
  sy::bf16* pw = w.data<sy::bf16>();
  for (int64_t i = 0; i < E * H; ++i) pw[i] = sy::float_to_bf16(static_cast<float>(nd(rng)));
  return w;
}

// Copies per-layer [T,K] id tables into one [T, layers, K] route table.
sy::RouteTable stack_layers(const std::vector<Tensor>& per_layer, int64_t E) {
  const int64_t L = static_cast<int64_t>(per_layer.size());
  const int64_t T = per_layer[0].size(0), K = per_layer[0].size(1);
  sy::RouteTable table{Tensor::empty({T, L, K}, DType::int32), E};
  int32_t* dst = table.topk_idx.data<int32_t>();
  for (int64_t l = 0; l < L; ++l) {
    const int32_t* src = per_layer[static_cast<size_t>(l)].data<int32_t>();
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(dst + (t * L + l) * K, src + t * K, sizeof(int32_t) * static_cast<size_t>(K));
    }
  }
  return table;
}

// One layer's [T,K] ids out of a [T, layers, K] table.
Tensor layer_ids(const sy::RouteTable& table, int64_t layer) {
  const int64_t T = table.num_tokens(), L = table.num_moe_layers(), K = table.top_k();
  Tensor ids = Tensor::empty({T, K}, DType::int32);
  const int32_t* src = table.topk_idx.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(ids.data<int32_t>() + t * K, src + (t * L + layer) * K,
                sizeof(int32_t) * static_cast<size_t>(K));
  }
  return ids;
}

// What vLLM returns for one sequence: int32 [seq_len-1, hidden_layers, K]; dense layers hold 0 and
// the last sampled token has no row.
Tensor vllm_routed_experts(const sy::RouteTable& routes, int64_t begin, int64_t seq_len,
                           int64_t first_k_dense) {
  const int64_t rows = seq_len - 1, L = routes.num_moe_layers(), K = routes.top_k();
  const int64_t layers = L + first_k_dense;
  Tensor out = Tensor::zeros({rows, layers, K}, DType::int32);
  const int32_t* src = routes.topk_idx.data<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t l = 0; l < L; ++l) {
      std::memcpy(out.data<int32_t>() + (r * layers + first_k_dense + l) * K,
                  src + ((begin + r) * L + l) * K, sizeof(int32_t) * static_cast<size_t>(K));
    }
  }
  return out;
}

double max_abs_diff(const Tensor& a, const std::vector<double>& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    m = std::max(m, std::fabs(a.item_as_double(i) - b[static_cast<size_t>(i)]));
  }
  return m;
}

double sum_sq(const Tensor& t) {
  double s = 0;
  for (int64_t i = 0; i < t.numel(); ++i) s += t.item_as_double(i) * t.item_as_double(i);
  return s;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

std::string pct(double share) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << 100.0 * share << "%";
  return os.str();
}

// State shared by the quick check's steps.
struct Quickcheck {
  const QuickcheckConfig& c;
  std::ostream& out;
  std::ostream& err;
  nlohmann::json report;
  int64_t T, H, E, K, L;
  sy::RouterConfig cfg;
  std::vector<Tensor> xs, ws, logits32;  // per MoE layer: hidden states, gate weight, fp32 logits
  sy::RouteTable rollout;                // what the rollout engine routed
  sy::RouteDrift rollout_vs_trainer;
  sy::RouteTable stored;                 // the rollout's routes after export, import and storage
  bool ok = true;

  Quickcheck(const QuickcheckConfig& config, std::ostream& o, std::ostream& e)
      : c(config), out(o), err(e), T(config.num_sequences * config.seq_len), H(config.hidden),
        E(config.num_experts), K(config.top_k), L(config.num_moe_layers) {
    cfg.num_experts = E;
    cfg.top_k = K;
  }
  void say(const std::string& s) {
    if (!c.json) out << s << "\n";
  }
  void progress(const std::string& s) { err << "[quickcheck] " << s << "\n"; }
  void check(bool passed) { ok = ok && passed; }

  void routers();
  void route_data();
  void replay();
  void dispatch();
  void batch_invariance();
};

// 1. Three routers on the same tokens: bf16 logits (rollout engine), fp32 (trainer), fp64.
void Quickcheck::routers() {
  std::mt19937_64 rng(c.seed);
  std::vector<Tensor> rollout_ids, trainer_ids, ref_ids;
  double gate_ms = 0;
  for (int64_t l = 0; l < L; ++l) {
    progress("layer " + std::to_string(l) + ": gate and routing (bf16 / fp32 / fp64 logits)");
    xs.push_back(make_hidden(T, H, rng));
    ws.push_back(make_gate_weight(E, H, rng));
    auto t0 = Clock::now();
    Tensor z32 = sy::router_gating_linear(xs.back(), ws.back(), Tensor(), {DType::fp32});
    gate_ms += ms_since(t0);
    Tensor z64 = sy::router_gating_linear(xs.back(), ws.back(), Tensor(), {DType::fp64});
    Tensor z16 = z32.to(DType::bf16).to(DType::fp32);  // an inference engine's bf16 gate output
    rollout_ids.push_back(sy::topk_route(z16, {}, cfg).topk_idx);
    trainer_ids.push_back(sy::topk_route(z32, {}, cfg).topk_idx);
    ref_ids.push_back(sy::topk_route(z64, {}, cfg).topk_idx);
    logits32.push_back(z32);
  }
  rollout = stack_layers(rollout_ids, E);
  const sy::RouteTable trainer = stack_layers(trainer_ids, E);
  const sy::RouteTable reference = stack_layers(ref_ids, E);
  rollout_vs_trainer = sy::route_drift(rollout, trainer);
  const sy::RouteDrift d_bf = sy::route_drift(reference, rollout);
  const sy::RouteDrift d_fp = sy::route_drift(reference, trainer);
  const sy::RouteDrift& d_rt = rollout_vs_trainer;
  const double gflops = 2.0 * static_cast<double>(T * H * E * L) / (gate_ms * 1e6);
  say("\n1. Router precision (share of router decisions / tokens with any differing layer)");
  say("   bf16 logits (rollout) vs fp64 : " + pct(d_bf.decision_mismatch()) + " / " +
      pct(d_bf.token_mismatch()));
  say("   fp32 logits (trainer) vs fp64 : " + pct(d_fp.decision_mismatch()) + " / " +
      pct(d_fp.token_mismatch()));
  say("   rollout vs trainer            : " + pct(d_rt.decision_mismatch()) + " / " +
      pct(d_rt.token_mismatch()) + "  <- what breaks the policy-gradient ratio");
  std::ostringstream os;
  os << "   fp32 gate: " << std::fixed << std::setprecision(1) << gate_ms << " ms for " << L
     << " layers (" << gflops << " GFLOP/s, " << sy::num_threads() << " threads)";
  say(os.str());
  report["precision"] = {
      {"bf16_vs_fp64", {{"decisions", d_bf.decision_mismatch()}, {"tokens", d_bf.token_mismatch()}}},
      {"fp32_vs_fp64", {{"decisions", d_fp.decision_mismatch()}, {"tokens", d_fp.token_mismatch()}}},
      {"rollout_vs_trainer",
       {{"decisions", d_rt.decision_mismatch()},
        {"tokens", d_rt.token_mismatch()},
        {"mean_differing_layers", d_rt.mean_differing_layers()}}},
      {"gate_ms", gate_ms},
      {"gate_gflops", gflops}};
}

// 2. The rollout's routes leave the engine as vLLM arrays, are imported and stored.
void Quickcheck::route_data() {
  namespace fs = std::filesystem;
  progress("exporting vLLM arrays, importing, writing the route file");
  const fs::path dir =
      c.out_dir.empty() ? fs::temp_directory_path() / "switchyard-quickcheck" : fs::path(c.out_dir);
  fs::create_directories(dir);
  std::vector<std::string> npys;
  int64_t raw_bytes = 0;
  for (int64_t s = 0; s < c.num_sequences; ++s) {
    const fs::path p = dir / ("seq" + std::to_string(s) + ".npy");
    const std::string bytes = sy::encode_npy_int32(
        vllm_routed_experts(rollout, s * c.seq_len, c.seq_len, c.first_k_dense));
    std::ofstream f(p, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f) throw sy::BackendError("[quickcheck] cannot write " + p.string());
    raw_bytes += static_cast<int64_t>(bytes.size());
    npys.push_back(p.string());
  }
  sy::ImportOptions iopt;
  iopt.num_experts = E;
  iopt.layer_map.first_k_dense = c.first_k_dense;
  const sy::ImportResult imported = sy::import_vllm(npys, iopt);
  const fs::path route_path = dir / "routes.syr";
  {
    sy::RouteFileInfo info;
    info.num_experts = E;
    info.top_k = K;
    info.num_moe_layers = L;
    info.moe_layers = imported.report.moe_layers;
    info.num_hidden_layers = L + c.first_k_dense;
    sy::RouteFileWriter writer(route_path.string(), info);
    for (const auto& seq : imported.sequences) writer.append(seq);
    writer.close();
  }
  const sy::RouteFileCheck verified = sy::verify_route_file(route_path.string());
  sy::RouteFileReader reader = sy::RouteFileReader::open(route_path.string());
  std::vector<sy::RouteTable> sequences;
  for (int64_t s = 0; s < reader.num_sequences(); ++s) sequences.push_back(reader.read(s));
  bool roundtrip = sequences.size() == imported.sequences.size();
  for (size_t s = 0; roundtrip && s < sequences.size(); ++s) {
    roundtrip = sy::route_tables_equal(sequences[s], imported.sequences[s]);
  }
  stored = sy::RouteTable{Tensor::empty({T, L, K}, DType::int32), E};
  int64_t row = 0;
  for (const auto& s : sequences) {
    std::memcpy(stored.topk_idx.data<int32_t>() + row * L * K, s.topk_idx.data<int32_t>(),
                s.topk_idx.nbytes());
    row += s.num_tokens();
  }
  check(verified.ok && roundtrip && row == T);
  std::string layers;
  for (auto m : imported.report.moe_layers) layers += (layers.empty() ? "" : ",") + std::to_string(m);
  const int64_t file_bytes = reader.file_size();
  say("\n2. Route data (R3): " + std::to_string(c.num_sequences) + " vLLM arrays [seq_len-1, " +
      std::to_string(L + c.first_k_dense) + " layers, K] -> MoE layers {" + layers + "} -> " +
      route_path.string());
  std::ostringstream os;
  os << "   npy int32 " << raw_bytes << " B -> route file " << file_bytes << " B (" << std::fixed
     << std::setprecision(1) << static_cast<double>(raw_bytes) / static_cast<double>(file_bytes)
     << "x smaller), " << (verified.ok ? "verified intact" : "NOT intact") << ", read back "
     << (roundtrip ? "identical" : "DIFFERENT")
     << "; all-zero MoE rows flagged: " << imported.report.num_zero_rows;
  say(os.str());
  report["route_file"] = {{"path", route_path.string()},  {"npy_bytes", raw_bytes},
                          {"file_bytes", file_bytes},     {"intact", verified.ok},
                          {"roundtrip_identical", roundtrip},
                          {"zero_rows", imported.report.num_zero_rows}};
}

// 3. The trainer replays the stored routes (R3), recomputes under activation checkpointing and
// sends gradients into the gate.
void Quickcheck::replay() {
  progress("replaying (R3) with recompute and backward");
  std::vector<Tensor> replayed_ids;
  int64_t n_replayed = 0, n_native = 0;
  bool recompute_equal = true;
  double grad_w_sq = 0, grad_x_sq = 0;
  std::mt19937_64 grng(c.seed + 1);
  for (int64_t l = 0; l < L; ++l) {
    const size_t li = static_cast<size_t>(l);
    sy::RouterReplay replay({l, K});
    sy::RouteInputs in;
    in.replay_idx = replay.replay_forward(layer_ids(stored, l));
    sy::RouteOptions ro;
    ro.layer = l;
    const sy::RouteResult fwd = sy::topk_route(logits32[li], in, cfg, ro);
    n_replayed += fwd.num_replayed_rows;
    n_native += fwd.num_native_rows;
    replayed_ids.push_back(fwd.topk_idx);
    // Activation-checkpoint recompute inside backward: the same ids come back from the queue.
    sy::RouteInputs rin;
    rin.replay_idx = replay.recompute(T);
    const sy::RouteResult re = sy::topk_route(logits32[li], rin, cfg, ro);
    recompute_equal = recompute_equal && same_bytes(re.topk_idx, fwd.topk_idx) &&
                      same_bytes(re.topk_weights, fwd.topk_weights);
    // Gradients reach the gate through the weights recomputed at the replayed ids.
    Tensor g = Tensor::empty({T, K}, DType::fp32);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = nd(grng);
    const sy::RouteGrads rg = sy::topk_route_backward(g, re);
    const sy::GateGrads gg =
        sy::router_gating_linear_backward(rg.grad_logits, xs[li], ws[li], Tensor(), {DType::fp32});
    grad_w_sq += sum_sq(gg.grad_weight);
    grad_x_sq += sum_sq(gg.grad_x);
  }
  // Compared where the route file has a route: the last token of each sequence has none and was
  // routed natively, so it is skipped as a -1 row.
  const sy::RouteDrift d = sy::route_drift(stored, stack_layers(replayed_ids, E));
  const sy::RouteDrift& before = rollout_vs_trainer;
  check(d.num_differing_decisions == 0 && recompute_equal && grad_w_sq > 0 &&
        n_native == c.num_sequences * L);
  say("\n3. Router replay in the trainer (R3)");
  say("   rows replayed " + std::to_string(n_replayed) + ", routed natively " +
      std::to_string(n_native) + " (the last token of each sequence has no rollout route)");
  say("   stored rollout routes vs replayed trainer: " + pct(d.decision_mismatch()) + " / " +
      pct(d.token_mismatch()) + " (was " + pct(before.decision_mismatch()) + " / " +
      pct(before.token_mismatch()) + ")");
  std::ostringstream os;
  os << "   recompute reused the same ids and weights: " << (recompute_equal ? "yes" : "NO")
     << "; |grad W_gate| = " << std::scientific << std::setprecision(3) << std::sqrt(grad_w_sq)
     << ", |grad x| = " << std::sqrt(grad_x_sq);
  say(os.str());
  report["replay"] = {{"rows_replayed", n_replayed},
                      {"rows_native", n_native},
                      {"decision_mismatch", d.decision_mismatch()},
                      {"token_mismatch", d.token_mismatch()},
                      {"recompute_identical", recompute_equal},
                      {"grad_weight_norm", std::sqrt(grad_w_sq)},
                      {"grad_x_norm", std::sqrt(grad_x_sq)}};
}

// 4. Tokens go to toy experts (expert e scales its rows by 1 + e/E) through both dispatchers and
// come back weighted; checked against a direct fp64 computation.
void Quickcheck::dispatch() {
  progress("dispatch and combine (all-to-all and all-gather)");
  sy::RouteInputs in;
  in.replay_idx = layer_ids(stored, 0);
  const sy::RouteResult r0 = sy::topk_route(logits32[0], in, cfg);
  const Tensor x0 = xs[0].to(DType::fp32);
  auto comm = sy::dist::local();
  sy::dist::Dispatcher disp(comm);  // kept across steps: its scratch is reused
  Tensor y_by_kind[2];
  double dispatch_ms = 0;
  int64_t recv_rows = 0;
  double first_ms = 0;
  // Each dispatcher runs twice: the first step of a process pays the page faults of its fresh
  // buffers, the second is what every later training step sees (the dispatcher's scratch and
  // freed large tensors are reused).
  for (int step = 0; step < 4; ++step) {
    const int kind = step / 2;
    sy::dist::DispatchOptions dopt;
    dopt.num_experts = E;
    dopt.kind = kind == 0 ? sy::dist::DispatcherKind::all_to_all : sy::dist::DispatcherKind::all_gather;
    auto t0 = Clock::now();
    sy::dist::DispatchResult d = disp.dispatch(x0, r0.topk_idx, r0.topk_weights, dopt);
    Tensor& expert_y = d.recv_x;  // the toy experts work in place
    const int64_t* off = d.handle.expert_offsets().data<int64_t>();
    float* py = expert_y.data<float>();
    for (int64_t e = 0; e < d.handle.num_local_experts(); ++e) {
      const float s = 1.0f + static_cast<float>(e) / static_cast<float>(E);
      for (int64_t i = off[e] * H; i < off[e + 1] * H; ++i) py[i] *= s;
    }
    y_by_kind[kind] = disp.combine(expert_y, d.handle);
    if (step == 0) first_ms = ms_since(t0);
    if (step == 1) {
      dispatch_ms = ms_since(t0);
      recv_rows = d.handle.num_recv_tokens();
    }
  }
  std::vector<double> y_ref(static_cast<size_t>(T * H), 0.0);
  const int32_t* idx = r0.topk_idx.data<int32_t>();
  const float* w = r0.topk_weights.data<float>();
  const float* px = x0.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[t * K + k];
      if (e < 0) continue;
      const double s = 1.0 + static_cast<double>(e) / static_cast<double>(E);
      for (int64_t h = 0; h < H; ++h) y_ref[t * H + h] += w[t * K + k] * s * px[t * H + h];
    }
  }
  const double y_err = max_abs_diff(y_by_kind[0], y_ref);
  const bool kinds_equal = same_bytes(y_by_kind[0], y_by_kind[1]);
  check(kinds_equal && y_err < 1e-4);
  std::ostringstream os;
  os << "\n4. Expert-parallel dispatch (" << comm->name() << " communicator, EP=" << comm->size()
     << "): " << recv_rows << " (token, expert) rows from " << T
     << " tokens, dispatch+experts+combine " << std::fixed << std::setprecision(1) << dispatch_ms
     << " ms per step (first step " << first_ms << " ms)\n"
     << "   combine vs fp64 reference: max |diff| " << std::scientific << std::setprecision(2)
     << y_err << "; all-to-all and all-gather bitwise equal: " << (kinds_equal ? "yes" : "NO");
  say(os.str());
  report["dispatch"] = {{"rows", recv_rows},
                        {"ms", dispatch_ms},
                        {"first_step_ms", first_ms},
                        {"max_abs_err_vs_fp64", y_err},
                        {"dispatchers_bitwise_equal", kinds_equal}};
}

// 5. A token's logits alone, inside the batch and on one thread are bitwise the same.
void Quickcheck::batch_invariance() {
  progress("batch invariance");
  const int64_t probe = std::min<int64_t>(T - 1, 5);
  Tensor alone_x = Tensor::empty({1, H}, DType::bf16);
  std::memcpy(alone_x.raw(), xs[0].data<sy::bf16>() + probe * H, sizeof(sy::bf16) * H);
  const Tensor alone = sy::router_gating_linear(alone_x, ws[0], Tensor(), {DType::fp32});
  const int threads = sy::num_threads();
  sy::set_num_threads(1);
  const Tensor one_thread = sy::router_gating_linear(xs[0], ws[0], Tensor(), {DType::fp32});
  sy::set_num_threads(threads);
  const bool inv_alone =
      std::memcmp(alone.raw(), logits32[0].data<float>() + probe * E, sizeof(float) * E) == 0;
  const bool inv_threads = same_bytes(one_thread, logits32[0]);
  check(inv_alone && inv_threads);
  say("\n5. Batch invariance: token " + std::to_string(probe) + " alone vs in a batch of " +
      std::to_string(T) + ": " + (inv_alone ? "bitwise equal" : "DIFFERENT") + "; 1 vs " +
      std::to_string(threads) + " threads: " + (inv_threads ? "bitwise equal" : "DIFFERENT"));
  report["batch_invariance"] = {{"alone_vs_batch", inv_alone}, {"threads", inv_threads}};
}

int run_quickcheck(const QuickcheckConfig& c, std::ostream& out, std::ostream& err) {
  {
    // The output folder is checked before any work (a clear error, not an exception minutes in).
    namespace fs = std::filesystem;
    const fs::path dir =
        c.out_dir.empty() ? fs::temp_directory_path() / "switchyard-quickcheck" : fs::path(c.out_dir);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec || !fs::is_directory(dir)) {
      throw sy::BackendError("[quickcheck] --out " + dir.string() + ": cannot create the folder (" +
                             (ec ? ec.message() : std::string("not a directory")) + ")");
    }
  }
  Quickcheck d(c, out, err);
  d.report["config"] = {{"hidden", d.H},
                        {"num_experts", d.E},
                        {"top_k", d.K},
                        {"num_moe_layers", d.L},
                        {"first_k_dense", c.first_k_dense},
                        {"num_sequences", c.num_sequences},
                        {"seq_len", c.seq_len},
                        {"num_tokens", d.T},
                        {"seed", c.seed},
                        {"threads", sy::num_threads()}};
  d.say("switchyard quickcheck: " + std::to_string(d.T) + " tokens (" +
        std::to_string(c.num_sequences) + " sequences x " + std::to_string(c.seq_len) +
        "), router H=" + std::to_string(d.H) + " E=" + std::to_string(d.E) +
        " K=" + std::to_string(d.K) + ", " + std::to_string(d.L) + " MoE layers after " +
        std::to_string(c.first_k_dense) + " dense, seed " + std::to_string(c.seed));
  d.routers();
  d.route_data();
  d.replay();
  d.dispatch();
  d.batch_invariance();
  d.report["ok"] = d.ok;
  if (c.json) {
    out << d.report.dump(2) << "\n";
  } else {
    d.say(std::string("\n") + (d.ok ? "quickcheck: all checks passed" : "quickcheck: A CHECK FAILED"));
  }
  return d.ok ? 0 : 1;
}

}  // namespace

void register_quickcheck_command(CLI::App& app, std::ostream& out, std::ostream& err) {
  auto c = std::make_shared<QuickcheckConfig>();
  // The old name: one line saying where each job went (docs/deprecations.md), exit code 2.
  CLI::App* old = app.add_subcommand("demo", "renamed: see `switchyard quickcheck`");
  old->allow_extras();
  old->group("");  // not listed in --help
  old->callback([&err] {
    err << "error: `switchyard demo` was renamed `switchyard quickcheck` (the engine's quick "
           "check); the main job is `python -m switchyard.demo`\n";
    throw CLI::RuntimeError(kExitUsage);
  });
  CLI::App* cmd = app.add_subcommand(
      "quickcheck",
      "Routing drift, route import/storage, replay, dispatch and batch invariance on a "
      "Qwen3-30B-A3B-shaped router (embedded default)");
  cmd->add_option("--hidden", c->hidden, "hidden size H")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--experts", c->num_experts, "number of experts E")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  cmd->add_option("--top-k", c->top_k, "experts per token K")->check(CLI::Range(int64_t{1}, int64_t{4096}));
  cmd->add_option("--layers", c->num_moe_layers, "MoE layers")->check(CLI::Range(int64_t{1}, int64_t{512}));
  cmd->add_option("--first-k-dense", c->first_k_dense, "dense layers before the first MoE layer")
      ->check(CLI::Range(int64_t{0}, int64_t{512}));
  cmd->add_option("--sequences", c->num_sequences, "sequences")->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  cmd->add_option("--seq-len", c->seq_len, "tokens per sequence (>= 2)")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  cmd->add_option("--seed", c->seed, "random seed");
  cmd->add_option("--out", c->out_dir, "folder for the exported arrays and the route file")
      ->capture_default_str();
  cmd->add_flag("--json", c->json, "machine-readable report on stdout");
  cmd->callback([c, &out, &err] {
    if (c->top_k > c->num_experts) {
      throw CLI::ValidationError("--top-k", "must be <= --experts (" +
                                              std::to_string(c->num_experts) + "), got " +
                                              std::to_string(c->top_k));
    }
    run_guarded(err, [&] {
      if (run_quickcheck(*c, out, err) != 0) throw CLI::RuntimeError(kExitBad);
    });
  });
}
