// Determinism across expert-parallel sizes (registered for 1, 2, 3 and 4 ranks): a whole MoE routing
// layer, gate -> topk_route -> dispatch -> toy experts -> combine, and its backward
// combine_backward -> toy experts -> dispatch_backward + topk_route_backward -> gate backward, run
// over the world communicator, gives on every rank exactly the bits of the same layer run at EP = 1
// (local communicator) over the whole global batch: outputs, ids, weights and every per-token
// gradient row. Both dispatchers, 1 and 2 threads, and a global batch where one rank has no tokens.
// (grad_weight is a reduction over each rank's own tokens, so it is compared with an EP=1 run over
// the same tokens.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <random>

#include "switchyard/dispatcher.h"
#include "switchyard/gate.h"
#include "switchyard/router.h"
#include "testing.h"

namespace switchyard {
namespace {

using dist::DispatcherKind;
using testing::bitwise_equal;
using testing::repro;
using testing::test_seed;

std::shared_ptr<dist::Communicator> world() {
  static std::shared_ptr<dist::Communicator> c = dist::world();
  return c;
}

Tensor rows(const Tensor& t, int64_t b, int64_t e) {
  const int64_t W = t.numel() / std::max<int64_t>(t.size(0), 1);
  Tensor out = Tensor::empty({e - b, t.size(1)}, t.dtype());
  const size_t es = dtype_size(t.dtype());
  std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + size_t(b * W) * es, size_t((e - b) * W) * es);
  return out;
}

// Toy expert e: y = x * (1 + e/8) + e/16 in fp32; backward multiplies by (1 + e/8).
Tensor toy(const Tensor& in, const dist::DispatchHandle& h, bool backward) {
  const int64_t H = in.size(1), L = h.num_local_experts;
  Tensor out = Tensor::empty(in.shape(), DType::fp32);
  const float* a = in.data<float>();
  float* y = out.data<float>();
  const int64_t* off = h.expert_offsets.data<int64_t>();
  for (int64_t el = 0; el < L; ++el) {
    const int64_t e = h.rank * L + el;
    const float s = 1.0f + float(e) / 8.0f, c = float(e) / 16.0f;
    for (int64_t r = off[el]; r < off[el + 1]; ++r)
      for (int64_t j = 0; j < H; ++j) y[r * H + j] = backward ? a[r * H + j] * s : a[r * H + j] * s + c;
  }
  return out;
}

struct LayerOut {
  Tensor logits, topk_idx, topk_weights, y, grad_x_dispatch, grad_logits, grad_x_gate, grad_weight;
};

LayerOut run_layer(const Tensor& x, const Tensor& gy, const Tensor& w, const RouterConfig& cfg,
                   DispatcherKind kind, dist::Communicator& comm) {
  LayerOut o;
  o.logits = router_gating_linear(x, w, Tensor());
  RouteResult rr = topk_route(o.logits, {}, cfg);
  o.topk_idx = rr.topk_idx;
  o.topk_weights = rr.topk_weights;
  dist::DispatchOptions opt;
  opt.num_experts = cfg.num_experts;
  opt.kind = kind;
  dist::DispatchResult d = dist::dispatch(x, rr.topk_idx, rr.topk_weights, opt, comm);
  const Tensor Y = toy(d.recv_x, d.handle, false);
  o.y = dist::combine(Y, d.handle, {}, comm);
  dist::CombineGrads cg = dist::combine_backward(gy, Y, d.handle, {}, comm);
  o.grad_x_dispatch = dist::dispatch_backward(toy(cg.grad_expert_y, d.handle, true), d.handle, comm);
  o.grad_logits = topk_route_backward(cg.grad_topk_weights, rr).grad_logits;
  GateGrads gg = router_gating_linear_backward(o.grad_logits, x, w, Tensor());
  o.grad_x_gate = gg.grad_x;
  o.grad_weight = gg.grad_weight;
  return o;
}

void check_ep_invariance(bool zero_token_rank, uint64_t seed) {
  dist::Communicator& c = *world();
  const int64_t P = c.size(), me = c.rank(), H = 24, E = 12;
  std::mt19937_64 rng(seed);
  std::vector<int64_t> off = {0};
  for (int64_t r = 0; r < P; ++r) {
    int64_t T = std::uniform_int_distribution<int64_t>(1, 30)(rng) + 5 * r;
    if (zero_token_rank && r == P / 2) T = 0;
    off.push_back(off.back() + T);
  }
  const int64_t N = off.back();
  const Tensor gx = testing::randn({N, H}, DType::fp32, rng);
  const Tensor ggy = testing::randn({N, H}, DType::fp32, rng);
  const Tensor w = testing::randn({E, H}, DType::fp32, rng, 0.3);
  const Tensor x = rows(gx, off[me], off[me + 1]), gy = rows(ggy, off[me], off[me + 1]);
  std::vector<RouterConfig> cfgs(2);
  cfgs[0].num_experts = E;
  cfgs[0].top_k = 3;
  cfgs[1] = cfgs[0];
  cfgs[1].score_function = ScoreFunction::sigmoid;
  cfgs[1].num_groups = 3;
  cfgs[1].group_topk = 2;
  const int saved = num_threads();
  for (const RouterConfig& cfg : cfgs) {
    set_num_threads(1);
    auto local = dist::local();
    const LayerOut ref = run_layer(gx, ggy, w, cfg, DispatcherKind::all_to_all, *local);
    const LayerOut mine_ref = run_layer(x, gy, w, cfg, DispatcherKind::all_to_all, *local);
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      for (DispatcherKind kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
        const std::string ctx = "EP " + std::to_string(P) + " rank " + std::to_string(me) + " threads " +
                                std::to_string(threads) + (kind == DispatcherKind::all_gather ? " all_gather" : " all_to_all") +
                                " " + score_function_name(cfg.score_function) + " T " +
                                std::to_string(off[me + 1] - off[me]) + " " + repro(seed);
        const LayerOut o = run_layer(x, gy, w, cfg, kind, c);
        const int64_t b = off[me], e = off[me + 1];
        EXPECT_TRUE(bitwise_equal(o.logits, rows(ref.logits, b, e))) << "logits " << ctx;
        EXPECT_TRUE(bitwise_equal(o.topk_idx, rows(ref.topk_idx, b, e))) << "topk_idx " << ctx;
        EXPECT_TRUE(bitwise_equal(o.topk_weights, rows(ref.topk_weights, b, e))) << "topk_weights " << ctx;
        EXPECT_TRUE(bitwise_equal(o.y, rows(ref.y, b, e))) << "y " << ctx;
        EXPECT_TRUE(bitwise_equal(o.grad_x_dispatch, rows(ref.grad_x_dispatch, b, e))) << "grad_x dispatch " << ctx;
        EXPECT_TRUE(bitwise_equal(o.grad_logits, rows(ref.grad_logits, b, e))) << "grad_logits " << ctx;
        EXPECT_TRUE(bitwise_equal(o.grad_x_gate, rows(ref.grad_x_gate, b, e))) << "grad_x gate " << ctx;
        EXPECT_TRUE(bitwise_equal(o.grad_weight, mine_ref.grad_weight)) << "grad_weight " << ctx;
      }
    }
  }
  set_num_threads(saved);
}

TEST(DeterminismMpi, LayerMatchesEpOneBitwise) {
  ::alarm(120);  // a hang fails the test within the ctest timeout
  check_ep_invariance(false, test_seed(8001));
  ::alarm(0);
}

TEST(DeterminismMpi, LayerWithAZeroTokenRankMatchesEpOneBitwise) {
  ::alarm(120);
  check_ep_invariance(true, test_seed(8002));
  ::alarm(0);
}

}  // namespace
}  // namespace switchyard
