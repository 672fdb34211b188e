// Determinism across expert-parallel sizes (registered for 1, 2, 3 and 4 ranks): a whole MoE
// routing layer, gate -> topk_route -> dispatch -> toy experts -> combine, and its backward
// combine_backward -> toy experts -> dispatch_backward + topk_route_backward -> gate backward, run
// over the world communicator, gives on every rank exactly the bits of the same layer run at EP = 1
// (local communicator) over the whole global batch: outputs, ids, weights and every per-token
// gradient row. Both dispatchers, 1 and 2 threads, and a global batch where one rank has no tokens:
// one named case each.
// (grad_weight is a reduction over each rank's own tokens, so it is compared with the gate
// backward, at 1 thread, of the EP = 1 gradient rows of those tokens.)
#include <gtest/gtest.h>

#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ep_testing.h"
#include "router_testing.h"
#include "switchyard/dispatcher.h"
#include "switchyard/gate.h"
#include "switchyard/router.h"
#include "testing.h"

namespace switchyard {
namespace {

using dist::DispatcherKind;
using testing::bitwise_equal;
using testing::repro;
using testing::rows;
using testing::test_seed;
using testing::world;

// Toy expert e: y = x * (1 + e/8) + e/16 in fp32; backward multiplies by (1 + e/8).
Tensor toy(const Tensor& in, const dist::DispatchHandle& h, bool backward) {
  const int64_t H = in.size(1), L = h.num_local_experts();
  Tensor out = Tensor::empty(in.shape(), DType::fp32);
  const float* a = in.data<float>();
  float* y = out.data<float>();
  const int64_t* off = h.expert_offsets().data<int64_t>();
  for (int64_t el = 0; el < L; ++el) {
    const int64_t e = h.rank() * L + el;
    const float s = 1.0f + float(e) / 8.0f, c = float(e) / 16.0f;
    for (int64_t r = off[el]; r < off[el + 1]; ++r)
      for (int64_t j = 0; j < H; ++j)
        y[r * H + j] = backward ? a[r * H + j] * s : a[r * H + j] * s + c;
  }
  return out;
}

struct LayerOut {
  Tensor logits, topk_idx, topk_weights, y, grad_x_dispatch, grad_logits, grad_x_gate, grad_weight;
};

LayerOut run_layer(const Tensor& x, const Tensor& gy, const Tensor& w, const RouterConfig& cfg,
                   DispatcherKind kind, dist::Dispatcher& disp) {
  LayerOut o;
  o.logits = router_gating_linear(x, w, Tensor());
  RouteResult rr = topk_route(o.logits, {}, cfg);
  o.topk_idx = rr.topk_idx;
  o.topk_weights = rr.topk_weights;
  dist::DispatchOptions opt;
  opt.num_experts = cfg.num_experts;
  opt.kind = kind;
  dist::DispatchResult d = disp.dispatch(x, rr.topk_idx, rr.topk_weights, opt);
  const Tensor Y = toy(d.recv_x, d.handle, false);
  o.y = disp.combine(Y, d.handle);
  dist::CombineGrads cg = disp.combine_backward(gy, Y, d.handle);
  o.grad_x_dispatch = disp.dispatch_backward(toy(cg.grad_expert_y, d.handle, true), d.handle);
  o.grad_logits = topk_route_backward(cg.grad_topk_weights, rr).grad_logits;
  GateGrads gg = router_gating_linear_backward(o.grad_logits, x, w, Tensor());
  o.grad_x_gate = gg.grad_x;
  o.grad_weight = gg.grad_weight;
  return o;
}

// One layer configuration (router shape, threads, dispatcher kind, whether the middle rank has no
// tokens) over the world communicator against the layer at EP = 1 over the whole global batch
// (1 thread, all_to_all, local communicator). Every rank draws 1..max_tokens + 5 * rank tokens.
class LayerTester : public testing::RouterSetup<LayerTester> {
 public:
  LayerTester() : RouterSetup(12, 3, 30) {}
  LayerTester& threads(int n) { return threads_ = n, *this; }
  LayerTester& kind(DispatcherKind k) { return kind_ = k, *this; }
  LayerTester& zero_token_rank() { return zero_token_rank_ = true, *this; }

  void Test() const {
    dist::Communicator& c = world();
    const int64_t P = c.size(), me = c.rank(), H = 24, E = config_.num_experts;
    std::ostringstream shape;
    describe_shape(shape);
    if (zero_token_rank_) shape << " zero_token_rank";
    const uint64_t seed = test_seed(seed_ ? *seed_ : testing::seed_of(shape.str()));
    std::mt19937_64 rng(seed);
    std::vector<int64_t> off = {0};
    for (int64_t r = 0; r < P; ++r) {
      int64_t T = std::uniform_int_distribution<int64_t>(1, T_)(rng) + 5 * r;
      if (zero_token_rank_ && r == P / 2) T = 0;
      off.push_back(off.back() + T);
    }
    const int64_t N = off.back(), b = off[static_cast<size_t>(me)],
                  e = off[static_cast<size_t>(me + 1)];
    SCOPED_TRACE(shape.str() + " EP=" + std::to_string(P) + " rank=" + std::to_string(me) +
                 " T=" + std::to_string(e - b) + " threads=" + std::to_string(threads_) + " " +
                 testing::kind_name(kind_) + " " + repro(seed));
    const Tensor gx = testing::randn({N, H}, DType::fp32, rng);
    const Tensor ggy = testing::randn({N, H}, DType::fp32, rng);
    const Tensor w = testing::randn({E, H}, DType::fp32, rng, 0.3);
    const Tensor x = rows(gx, b, e), gy = rows(ggy, b, e);
    const int saved = num_threads();
    set_num_threads(1);
    dist::Dispatcher local(dist::local());
    const LayerOut ref = run_layer(gx, ggy, w, config_, DispatcherKind::all_to_all, local);
    // grad_weight is a reduction over this rank's own tokens: the gate backward of the EP = 1
    // gradient rows of those tokens.
    const Tensor mine_grad_weight =
        router_gating_linear_backward(rows(ref.grad_logits, b, e), x, w, Tensor()).grad_weight;
    set_num_threads(threads_);
    dist::Dispatcher disp(testing::world_ptr());
    const LayerOut o = run_layer(x, gy, w, config_, kind_, disp);
    set_num_threads(saved);
    EXPECT_TRUE(bitwise_equal(o.logits, rows(ref.logits, b, e))) << "logits";
    EXPECT_TRUE(bitwise_equal(o.topk_idx, rows(ref.topk_idx, b, e))) << "topk_idx";
    EXPECT_TRUE(bitwise_equal(o.topk_weights, rows(ref.topk_weights, b, e))) << "topk_weights";
    EXPECT_TRUE(bitwise_equal(o.y, rows(ref.y, b, e))) << "y";
    EXPECT_TRUE(bitwise_equal(o.grad_x_dispatch, rows(ref.grad_x_dispatch, b, e)))
        << "grad_x dispatch";
    EXPECT_TRUE(bitwise_equal(o.grad_logits, rows(ref.grad_logits, b, e))) << "grad_logits";
    EXPECT_TRUE(bitwise_equal(o.grad_x_gate, rows(ref.grad_x_gate, b, e))) << "grad_x gate";
    EXPECT_TRUE(bitwise_equal(o.grad_weight, mine_grad_weight)) << "grad_weight";
  }

 private:
  int threads_ = 1;
  DispatcherKind kind_ = DispatcherKind::all_to_all;
  bool zero_token_rank_ = false;
};

// One router configuration (a LayerTester chain) for 1 and 2 threads and both dispatchers.
#define SY_LAYER_CASES(Name, Chain)                                         \
  TEST(DeterminismMpi, Name##AllToAll1Thread) {                             \
    LayerTester() Chain.threads(1).kind(DispatcherKind::all_to_all).Test(); \
  }                                                                         \
  TEST(DeterminismMpi, Name##AllToAll2Threads) {                            \
    LayerTester() Chain.threads(2).kind(DispatcherKind::all_to_all).Test(); \
  }                                                                         \
  TEST(DeterminismMpi, Name##AllGather1Thread) {                            \
    LayerTester() Chain.threads(1).kind(DispatcherKind::all_gather).Test(); \
  }                                                                         \
  TEST(DeterminismMpi, Name##AllGather2Threads) {                           \
    LayerTester() Chain.threads(2).kind(DispatcherKind::all_gather).Test(); \
  }

SY_LAYER_CASES(SoftmaxTop3Of12MatchesEpOneBitwise, .score(ScoreFunction::softmax))
SY_LAYER_CASES(SigmoidGroupLimitedTop3Of12MatchesEpOneBitwise,
               .score(ScoreFunction::sigmoid).groups(3, 2))
SY_LAYER_CASES(SoftmaxTop3Of12WithAZeroTokenRankMatchesEpOneBitwise,
               .score(ScoreFunction::softmax).zero_token_rank())
SY_LAYER_CASES(SigmoidGroupLimitedTop3Of12WithAZeroTokenRankMatchesEpOneBitwise,
               .score(ScoreFunction::sigmoid).groups(3, 2).zero_token_rank())

}  // namespace
}  // namespace switchyard
