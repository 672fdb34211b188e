// Router replay: replayed ids are used as given with weights from the live logits, recorded routes
// replay bit for bit, invalid rows are errors (or native on request) and counted, and the
// RouterReplay queues are FIFO under recompute order.
#include <random>
#include <string>
#include <vector>

#include "ref/router_ref.h"
#include "switchyard/replay.h"
#include "switchyard/router.h"
#include "router_testing.h"
#include "testing.h"

namespace sy = switchyard;
using switchyard::testing::router_config;
using sy::AuxLossType;
using sy::DType;
using sy::RouterConfig;
using sy::ScoreFunction;
using sy::Tensor;
using sy::testing::all_close;
using sy::testing::bitwise_equal;

namespace {

std::vector<RouterConfig> configs() {
  std::vector<RouterConfig> v;
  for (int f = 0; f < 4; ++f) {
    RouterConfig c = router_config(64, 8, f == 3 ? ScoreFunction::softmax : static_cast<ScoreFunction>(f));
    c.pre_softmax = f == 3;
    c.topk_scaling_factor = 1.5;
    c.aux_loss_type = AuxLossType::aux_loss;
    c.aux_loss_coeff = 1e-2;
    c.z_loss_coeff = 1e-3;
    v.push_back(c);
    c.num_groups = 8;
    c.group_topk = 4;
    c.capacity_factor = 1.0;
    v.push_back(c);
  }
  return v;
}

}  // namespace

TEST(Replay, RecordedRoutesReplayBitwise) {
  std::mt19937_64 rng(sy::testing::test_seed(201));
  for (DType dt : {DType::fp32, DType::fp64}) {
    for (const RouterConfig& c : configs()) {
      SCOPED_TRACE(std::string(sy::score_function_name(c.score_function)) +
                   (c.pre_softmax ? " pre" : "") + " groups=" + std::to_string(c.num_groups));
      Tensor z = sy::testing::randn({301, 64}, dt, rng);
      Tensor gw = sy::testing::randn({301, 8}, dt, rng);
      sy::RouteInputs native_in;
      native_in.expert_bias = sy::testing::randn({64}, DType::fp32, rng, 0.1);
      const auto native = sy::topk_route(z, native_in, c);
      sy::RouteInputs in = native_in;
      RouterConfig nocap = c;  // the ids before capacity drops: the same route without capacity
      nocap.capacity_factor.reset();
      in.replay_idx = sy::topk_route(z, native_in, nocap).topk_idx.clone();
      const auto replayed = sy::topk_route(z, in, c);
      EXPECT_EQ(replayed.num_replayed_rows, 301);
      EXPECT_EQ(replayed.num_native_rows, 0);
      EXPECT_EQ(native.num_replayed_rows, 0);
      EXPECT_EQ(native.num_native_rows, 301);
      EXPECT_TRUE(bitwise_equal(replayed.topk_idx, native.topk_idx));
      EXPECT_TRUE(bitwise_equal(replayed.topk_weights, native.topk_weights));
      EXPECT_TRUE(bitwise_equal(replayed.num_tokens_per_expert, native.num_tokens_per_expert));
      EXPECT_EQ(replayed.aux_loss, native.aux_loss);
      EXPECT_EQ(replayed.z_loss, native.z_loss);
      const auto g1 = sy::topk_route_backward(gw, native);
      const auto g2 = sy::topk_route_backward(gw, replayed);
      EXPECT_TRUE(bitwise_equal(g1.grad_logits, g2.grad_logits));
    }
  }
}

TEST(Replay, DifferentRoutesChangeExactlyThoseRows) {
  std::mt19937_64 rng(sy::testing::test_seed(211));
  for (const RouterConfig& c0 : configs()) {
    RouterConfig c = c0;
    c.capacity_factor.reset();  // capacity couples rows; checked separately
    SCOPED_TRACE(std::string(sy::score_function_name(c.score_function)) +
                 (c.pre_softmax ? " pre" : ""));
    const int64_t T = 50, E = 64, K = 8;
    Tensor z = sy::testing::randn({T, E}, DType::fp64, rng);
    Tensor gw = sy::testing::randn({T, K}, DType::fp64, rng);
    Tensor ids = Tensor::full({T, K}, DType::int32, -1);
    const std::vector<int64_t> changed = {3, 17, 49};
    for (int64_t t : changed) {
      // Experts outside the native choice (and outside the best groups): the last K ids.
      for (int64_t k = 0; k < K; ++k)
        ids.data<int32_t>()[t * K + k] = static_cast<int32_t>(E - 1 - 2 * k);
    }
    sy::RouteInputs in;
    in.replay_idx = ids;
    in.expert_bias = Tensor::full({E}, DType::fp32, 0.0);
    for (int64_t k = 0; k < K; ++k) in.expert_bias.data<float>()[E - 1 - 2 * k] = -100.0f;
    sy::RouteInputs native_in = in;
    native_in.replay_idx = Tensor();
    const auto native = sy::topk_route(z, native_in, c);
    const auto r = sy::topk_route(z, in, c);
    EXPECT_EQ(r.num_replayed_rows, 3);
    EXPECT_EQ(r.num_native_rows, T - 3);
    const auto gn = sy::topk_route_backward(gw, native).grad_logits;
    const auto gr = sy::topk_route_backward(gw, r).grad_logits;
    // Reference weights for replayed rows from the live logits.
    sy::ref::RefRouteInputs rin;
    rin.replay = std::vector<int32_t>(ids.data<int32_t>(), ids.data<int32_t>() + T * K);
    rin.bias = in.expert_bias.to_double_vector();
    const auto want = sy::ref::route(z.to_double_vector(), T, c, rin);
    EXPECT_TRUE(all_close(r.topk_idx, std::vector<double>(want.idx.begin(), want.idx.end()), 0, 0));
    EXPECT_TRUE(all_close(r.topk_weights, want.w, 1e-13, 1e-12));
    for (int64_t t = 0; t < T; ++t) {
      const bool is_changed = t == 3 || t == 17 || t == 49;
      bool same_w = true, same_g = true;
      for (int64_t k = 0; k < K; ++k) {
        same_w = same_w && r.topk_weights.data<double>()[t * K + k] ==
                               native.topk_weights.data<double>()[t * K + k];
        if (is_changed) {
          EXPECT_EQ(r.topk_idx.data<int32_t>()[t * K + k], E - 1 - 2 * k) << "token " << t;
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        same_g = same_g && gr.data<double>()[t * E + e] == gn.data<double>()[t * E + e];
      }
      // Unchanged rows: bitwise the native weights; their gradients too, except through the
      // aux loss, whose counts (a batch statistic) are the same because aux counts ignore replay.
      if (!is_changed) {
        EXPECT_TRUE(same_w) << "token " << t;
        EXPECT_TRUE(same_g) << "token " << t;
      } else {
        EXPECT_FALSE(same_g) << "token " << t;
      }
    }
  }
}

TEST(Replay, CapacityStillAppliesToReplayedRows) {
  // Every token replays expert 0 first: capacity C = ceil(8*2/4*0.5) = 2 keeps two of them.
  const int64_t T = 8, E = 4, K = 2;
  std::mt19937_64 rng(sy::testing::test_seed(221));
  Tensor z = sy::testing::randn({T, E}, DType::fp32, rng);
  Tensor ids = Tensor::empty({T, K}, DType::int32);
  for (int64_t t = 0; t < T; ++t) {
    ids.data<int32_t>()[t * K] = 0;
    ids.data<int32_t>()[t * K + 1] = static_cast<int32_t>(1 + t % 3);
  }
  RouterConfig c = router_config(E, K);
  c.capacity_factor = 0.5;
  c.token_drop_policy = sy::TokenDropPolicy::position;
  sy::RouteInputs in;
  in.replay_idx = ids;
  const auto r = sy::topk_route(z, in, c);
  EXPECT_EQ(r.num_replayed_rows, T);
  EXPECT_EQ(r.num_tokens_per_expert.data<int64_t>()[0], 2);
  EXPECT_EQ(r.topk_idx.data<int32_t>()[0], 0);
  EXPECT_EQ(r.topk_idx.data<int32_t>()[1 * K], 0);
  EXPECT_EQ(r.topk_idx.data<int32_t>()[2 * K], -1);
}

TEST(Replay, InvalidRowsAreErrorsByDefault) {
  const int64_t T = 20, E = 16, K = 4;
  Tensor z = Tensor::zeros({T, E}, DType::fp32);
  RouterConfig c = router_config(E, K);
  sy::RouteOptions o;
  o.layer = 3;
  auto with_row = [&](std::vector<int32_t> row) {
    Tensor ids = Tensor::full({T, K}, DType::int32, -1);
    for (int64_t k = 0; k < K; ++k) ids.data<int32_t>()[17 * K + k] = row[k];
    return ids;
  };
  sy::RouteInputs in;
  in.replay_idx = with_row({5, 5, 9, 2});
  SY_EXPECT_THROW_MSG(sy::topk_route(z, in, c, o), std::invalid_argument,
                      "[replay] layer 3, token 17: topk_idx row [5, 5, 9, 2] repeats expert 5");
  in.replay_idx = with_row({5, -1, 9, 2});
  SY_EXPECT_THROW_MSG(
      sy::topk_route(z, in, c, o), std::invalid_argument,
      "[replay] layer 3, token 17: topk_idx row [5, -1, 9, 2] mixes -1 and expert ids");
  in.replay_idx = with_row({5, 16, 9, 2});
  SY_EXPECT_THROW_MSG(
      sy::topk_route(z, in, c, o), std::invalid_argument,
      "[replay] layer 3, token 17: topk_idx row [5, 16, 9, 2] names expert 16 outside [0, 16)");
  in.replay_idx = with_row({5, -2, 9, 2});
  SY_EXPECT_THROW_MSG(
      sy::topk_route(z, in, c, o), std::invalid_argument,
      "[replay] layer 3, token 17: topk_idx row [5, -2, 9, 2] names expert -2 outside [0, 16)");
  in.replay_idx = with_row({0, 0, 0, 0});  // a zero-filled pad row that reached the router
  SY_EXPECT_THROW_MSG(sy::topk_route(z, in, c), std::invalid_argument,
                      "[replay] token 17: topk_idx row [0, 0, 0, 0] repeats expert 0");
  // A padded token's row is not checked (it is not routed).
  in.padding_mask = Tensor::zeros({T}, DType::boolean);
  in.padding_mask.data<bool>()[17] = true;
  const auto r = sy::topk_route(z, in, c);
  EXPECT_EQ(r.num_padded_rows, 1);
  EXPECT_EQ(r.num_native_rows, T - 1);
}

TEST(Replay, InvalidRowsRouteNativelyOnRequestAndAreCounted) {
  const int64_t T = 6, E = 8, K = 2;
  std::mt19937_64 rng(sy::testing::test_seed(231));
  Tensor z = sy::testing::randn({T, E}, DType::fp64, rng);
  RouterConfig c = router_config(E, K, ScoreFunction::sigmoid);
  Tensor ids = Tensor::from_vector<int32_t>({1, 2, 3, 3, -1, 4, -1, -1, 9, 0, 7, 6}, {T, K});
  sy::RouteInputs in;
  in.replay_idx = ids;
  sy::RouteOptions o;
  o.invalid_replay_rows = sy::InvalidReplayRows::native;
  const auto r = sy::topk_route(z, in, c, o);
  const auto native = sy::topk_route(z, {}, c);
  EXPECT_EQ(r.num_replayed_rows, 2);  // rows 0 and 5
  EXPECT_EQ(r.num_native_rows, 4);    // rows 1, 2, 4 (invalid) and 3 (all -1)
  EXPECT_EQ(r.num_invalid_replay_rows, 3);
  for (int64_t t : {1, 2, 3, 4}) {
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(r.topk_idx.data<int32_t>()[t * K + k], native.topk_idx.data<int32_t>()[t * K + k]);
      EXPECT_EQ(r.topk_weights.data<double>()[t * K + k],
                native.topk_weights.data<double>()[t * K + k]);
    }
  }
  EXPECT_EQ(r.topk_idx.data<int32_t>()[0], 1);
  EXPECT_EQ(r.topk_idx.data<int32_t>()[5 * K + 1], 6);
  // Replayed sigmoid weights: s[idx] / sum s[idx].
  const double s7 = sy::ref::sigmoid(z.data<double>()[5 * E + 7]);
  const double s6 = sy::ref::sigmoid(z.data<double>()[5 * E + 6]);
  EXPECT_NEAR(r.topk_weights.data<double>()[5 * K], s7 / (s7 + s6), 1e-15);
}

TEST(Replay, QueueIsFifoUnderRecomputeOrder) {
  sy::RouterReplay replay({.layer = 2, .top_k = 2});
  RouterConfig c = router_config(8, 2);
  std::mt19937_64 rng(sy::testing::test_seed(241));
  // R2: the old-log-prob pass records micro-batches 0, 1, 2 natively.
  std::vector<Tensor> logits, recorded;
  for (int mb = 0; mb < 3; ++mb) {
    logits.push_back(sy::testing::randn({5 + mb, 8}, DType::fp32, rng));
    const auto r = sy::topk_route(logits.back(), {}, c);
    replay.record(r.topk_idx);
    recorded.push_back(r.topk_idx.clone());
  }
  EXPECT_EQ(replay.num_recorded(), 3);
  // Update pass, 1F1B-like order: F0 F1 B0 F2 B1 B2, with recompute inside each backward.
  std::vector<sy::RouteResult> fwd(3);
  std::vector<Tensor> live_logits(3);
  auto forward = [&](int mb) {
    // The policy moved: perturbed logits, yet the recorded ids are used.
    Tensor live = logits[mb].clone();
    for (int64_t i = 0; i < live.numel(); ++i) live.data<float>()[i] *= -1.0f;
    live_logits[mb] = live;
    sy::RouteInputs in;
    in.replay_idx = replay.replay_forward(replay.pop_recorded());
    fwd[mb] = sy::topk_route(live, in, c);
    EXPECT_EQ(fwd[mb].num_replayed_rows, 5 + mb);
    EXPECT_TRUE(bitwise_equal(fwd[mb].topk_idx, recorded[mb])) << "forward mb " << mb;
  };
  auto backward = [&](int mb) {
    sy::RouteInputs in;
    in.replay_idx = replay.replay_backward(5 + mb);
    const auto again = sy::topk_route(live_logits[mb], in, c);
    EXPECT_TRUE(bitwise_equal(again.topk_idx, recorded[mb])) << "recompute mb " << mb;
    EXPECT_TRUE(bitwise_equal(again.topk_weights, fwd[mb].topk_weights)) << "recompute mb " << mb;
  };
  forward(0);
  forward(1);
  EXPECT_EQ(replay.num_pending_backward(), 2);
  backward(0);
  forward(2);
  backward(1);
  backward(2);
  EXPECT_EQ(replay.num_pending_backward(), 0);
  EXPECT_EQ(replay.num_recorded(), 0);
}

TEST(Replay, QueueErrors) {
  SY_EXPECT_THROW_MSG(sy::RouterReplay({.layer = 1, .top_k = 0}), std::invalid_argument,
                      "[replay] layer 1: top_k must be >= 1, got top_k=0");
  sy::RouterReplay replay({.layer = 4, .top_k = 2});
  SY_EXPECT_THROW_MSG(replay.pop_recorded(), std::out_of_range,
                      "[replay.pop_recorded] layer 4: no recorded table is queued");
  SY_EXPECT_THROW_MSG(replay.replay_backward(3), std::out_of_range,
                      "[replay.replay_backward] layer 4: no forward table is queued");
  SY_EXPECT_THROW_MSG(replay.record(Tensor::zeros({3, 3}, DType::int32)), std::invalid_argument,
                      "[replay.record] topk_idx must have shape [*, 2], got [3, 3]");
  SY_EXPECT_THROW_MSG(replay.replay_forward(Tensor::zeros({3, 2}, DType::int64)),
                      std::invalid_argument,
                      "[replay.replay_forward] topk_idx must have dtype int32, got int64");
  // The queued copy is independent of the caller's buffer.
  Tensor ids = Tensor::from_vector<int32_t>({0, 1, 2, 3, 4, 5}, {3, 2});
  replay.replay_forward(ids);
  ids.data<int32_t>()[0] = 7;
  SY_EXPECT_THROW_MSG(replay.replay_backward(4), std::invalid_argument,
                      "[replay.replay_backward] layer 4: num_tokens must match the oldest queued "
                      "forward table (3 rows), got num_tokens=4");
  EXPECT_EQ(replay.num_pending_backward(), 1);  // still queued after the mismatch
  const Tensor back = replay.replay_backward(3);
  EXPECT_EQ(back.data<int32_t>()[0], 0);
  replay.record(ids);
  replay.clear();
  EXPECT_EQ(replay.num_recorded(), 0);
}

TEST(Replay, EmptyBatch) {
  RouterConfig c = router_config(4, 2);
  sy::RouteInputs in;
  in.replay_idx = Tensor::zeros({0, 2}, DType::int32);
  const auto r = sy::topk_route(Tensor::zeros({0, 4}, DType::fp32), in, c);
  EXPECT_EQ(r.num_replayed_rows + r.num_native_rows + r.num_padded_rows, 0);
  EXPECT_EQ(r.topk_idx.numel(), 0);
  const auto g = sy::topk_route_backward(Tensor::zeros({0, 2}, DType::fp32), r);
  EXPECT_EQ(g.grad_logits.shape(), (sy::Shape{0, 4}));
}

TEST(Replay, ReadmeFlowWithDesignatedInitialisers) {
  // The notes/routing.md example, compiled under -Wall -Wextra -Werror.
  const int64_t T = 16;
  std::mt19937_64 rng(sy::testing::test_seed(251));
  Tensor logits = sy::testing::randn({T, 128}, DType::fp32, rng);
  RouterConfig cfg;
  cfg.num_experts = 128;
  cfg.top_k = 8;
  cfg.aux_loss_type = AuxLossType::aux_loss;
  cfg.aux_loss_coeff = 1e-3;
  cfg.z_loss_coeff = 1e-3;
  sy::RouterReplay replay({.layer = 3, .top_k = 8});
  Tensor rollout_ids =
      sy::topk_route(sy::testing::randn({T, 128}, DType::fp32, rng), {}, cfg).topk_idx;
  sy::RouteInputs in{.replay_idx = replay.replay_forward(rollout_ids)};
  const sy::RouteResult r = sy::topk_route(logits, in, cfg, {.layer = 3});
  EXPECT_EQ(r.num_replayed_rows, T);
  EXPECT_TRUE(bitwise_equal(r.topk_idx, rollout_ids));
  const sy::RouteResult again =
      sy::topk_route(logits, {.replay_idx = replay.replay_backward(T)}, cfg, {.layer = 3});
  EXPECT_TRUE(bitwise_equal(again.topk_weights, r.topk_weights));
  const sy::RouteGrads g =
      sy::topk_route_backward(Tensor::full({T, 8}, DType::fp32, 1.0), again);
  EXPECT_EQ(g.grad_logits.shape(), (sy::Shape{T, 128}));
  replay.record(sy::topk_route(logits, {}, cfg).topk_idx);
  const sy::RouteResult upd =
      sy::topk_route(logits, {.replay_idx = replay.replay_forward(replay.pop_recorded())}, cfg);
  EXPECT_EQ(upd.num_replayed_rows, T);
  EXPECT_TRUE(bitwise_equal(upd.topk_weights, sy::topk_route(logits, {}, cfg).topk_weights));
}
