// Router replay: replayed ids are used as given with weights from the live logits, recorded routes
// replay bit for bit, invalid rows are errors (or native on request) and counted, and the
// RouterReplay queues are FIFO under recompute order.
#include <random>
#include <string>
#include <vector>

#include "ref/router_ref.h"
#include "replay_tester.h"
#include "router_testing.h"
#include "switchyard/replay.h"
#include "switchyard/router.h"
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

using sy::testing::ReplayTester;

// E 64, K 8 with scaling 1.5 and the aux and z losses; optionally DeepSeek-V3's groups 8/4.
ReplayTester base(ScoreFunction f, bool pre_softmax, bool grouped) {
  ReplayTester t;
  t.experts(64).top_k(8).score(f).pre_softmax(pre_softmax).scaling(1.5);
  t.aux_loss(AuxLossType::aux_loss, 1e-2).z_loss(1e-3);
  if (grouped) t.groups(8, 4);
  return t;
}

}  // namespace

// One suite per score function: recorded routes (301 tokens, fp32 and fp64) replay bit for bit,
// also through groups and capacity; replaced rows (50 tokens, fp64) change only themselves.
#define SY_REPLAY_CASES(Suite, f, pre)                                                   \
  TEST(Suite, RecordedRoutesReplayBitwise) { base(f, pre, false).TestRecordedRoutes(); } \
  TEST(Suite, RecordedRoutesReplayBitwiseWithGroupsAndCapacity) {                        \
    base(f, pre, true).capacity(1.0).TestRecordedRoutes();                               \
  }                                                                                      \
  TEST(Suite, ReplacedRowsChangeOnlyThemselves) {                                        \
    base(f, pre, false).tokens(50).TestReplacedRows();                                   \
  }                                                                                      \
  TEST(Suite, ReplacedRowsChangeOnlyThemselvesWithGroups) {                              \
    base(f, pre, true).tokens(50).TestReplacedRows();                                    \
  }

SY_REPLAY_CASES(ReplaySoftmax, ScoreFunction::softmax, false)
SY_REPLAY_CASES(ReplaySigmoid, ScoreFunction::sigmoid, false)
SY_REPLAY_CASES(ReplaySqrtSoftplus, ScoreFunction::sqrtsoftplus, false)
SY_REPLAY_CASES(ReplayPreSoftmax, ScoreFunction::softmax, true)

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
  o.invalid_replay_rows = sy::ReplayRowPolicy::native;
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
  std::vector<Tensor> live(3);
  auto forward = [&](int mb) {
    // The policy moved: perturbed logits, yet the recorded ids are used.
    live[mb] = logits[mb].clone();
    for (int64_t i = 0; i < live[mb].numel(); ++i) live[mb].data<float>()[i] *= -1.0f;
    sy::RouteInputs in;
    in.replay_idx = replay.replay_forward(replay.pop_recorded());
    fwd[mb] = sy::topk_route(live[mb], in, c);
    EXPECT_EQ(fwd[mb].num_replayed_rows, 5 + mb);
    EXPECT_TRUE(bitwise_equal(fwd[mb].topk_idx, recorded[mb])) << "forward mb " << mb;
  };
  auto backward = [&](int mb) {
    sy::RouteInputs in;
    in.replay_idx = replay.recompute(5 + mb);
    const auto again = sy::topk_route(live[mb], in, c);
    EXPECT_TRUE(bitwise_equal(again.topk_idx, recorded[mb])) << "recompute mb " << mb;
    EXPECT_TRUE(bitwise_equal(again.topk_weights, fwd[mb].topk_weights)) << "recompute mb " << mb;
  };
  forward(0);
  forward(1);
  EXPECT_EQ(replay.num_pending_recompute(), 2);
  backward(0);
  forward(2);
  backward(1);
  backward(2);
  EXPECT_EQ(replay.num_pending_recompute(), 0);
  EXPECT_EQ(replay.num_recorded(), 0);
}

TEST(Replay, QueueErrors) {
  SY_EXPECT_THROW_MSG(sy::RouterReplay({.layer = 1, .top_k = 0}), std::invalid_argument,
                      "[replay] layer 1: top_k must be >= 1, got top_k=0");
  sy::RouterReplay replay({.layer = 4, .top_k = 2});
  SY_EXPECT_THROW_MSG(replay.pop_recorded(), std::out_of_range,
                      "[replay.pop_recorded] layer 4: no recorded table is queued");
  SY_EXPECT_THROW_MSG(replay.recompute(3), std::out_of_range,
                      "[replay.recompute] layer 4: no forward table is queued");
  SY_EXPECT_THROW_MSG(replay.record(Tensor::zeros({3, 3}, DType::int32)), std::invalid_argument,
                      "[replay.record] topk_idx must have shape [*, 2], got [3, 3]");
  SY_EXPECT_THROW_MSG(replay.replay_forward(Tensor::zeros({3, 2}, DType::int64)),
                      std::invalid_argument,
                      "[replay.replay_forward] topk_idx must have dtype int32, got int64");
  // The queued copy is independent of the caller's buffer.
  Tensor ids = Tensor::from_vector<int32_t>({0, 1, 2, 3, 4, 5}, {3, 2});
  replay.replay_forward(ids);
  ids.data<int32_t>()[0] = 7;
  SY_EXPECT_THROW_MSG(replay.recompute(4), std::invalid_argument,
                      "[replay.recompute] layer 4: num_tokens must match the oldest queued "
                      "forward table (3 rows), got num_tokens=4");
  EXPECT_EQ(replay.num_pending_recompute(), 1);  // still queued after the mismatch
  const Tensor back = replay.recompute(3);
  EXPECT_EQ(back.data<int32_t>()[0], 0);
  replay.record(ids);
  replay.clear();
  EXPECT_EQ(replay.num_recorded(), 0);
}

// copy.deepcopy of a model holding replays (TRL's reference model): the clone has the same
// queues, and neither object's queues or tables change through the other.
TEST(Replay, CloneIsIndependent) {
  sy::RouterReplay replay({.layer = 3, .top_k = 2});
  replay.record(Tensor::from_vector<int32_t>({0, 1, 2, 3}, {2, 2}));
  replay.replay_forward(Tensor::from_vector<int32_t>({4, 5}, {1, 2}));
  sy::RouterReplay twin = replay.clone();
  EXPECT_EQ(twin.layer(), 3);
  EXPECT_EQ(twin.num_recorded(), 1);
  EXPECT_EQ(twin.num_pending_recompute(), 1);
  Tensor mine = replay.pop_recorded();
  mine.data<int32_t>()[0] = 7;  // the popped table is the caller's: the clone's is another buffer
  EXPECT_EQ(twin.peek_recorded().data<int32_t>()[0], 0);
  replay.clear();
  EXPECT_EQ(twin.num_recorded(), 1);
  EXPECT_EQ(twin.recompute(1).data<int32_t>()[1], 5);
  EXPECT_EQ(twin.num_pending_recompute(), 0);
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
      sy::topk_route(logits, {.replay_idx = replay.recompute(T)}, cfg, {.layer = 3});
  EXPECT_TRUE(bitwise_equal(again.topk_weights, r.topk_weights));
  const sy::RouteGrads g = sy::topk_route_backward(Tensor::full({T, 8}, DType::fp32, 1.0), again);
  EXPECT_EQ(g.grad_logits.shape(), (sy::Shape{T, 128}));
  replay.record(sy::topk_route(logits, {}, cfg).topk_idx);
  const sy::RouteResult upd =
      sy::topk_route(logits, {.replay_idx = replay.replay_forward(replay.pop_recorded())}, cfg);
  EXPECT_EQ(upd.num_replayed_rows, T);
  EXPECT_TRUE(bitwise_equal(upd.topk_weights, sy::topk_route(logits, {}, cfg).topk_weights));
}

// The one row rule: classify_replay_rows, the same for topk_route and every adapter.
TEST(Replay, ClassifyRowsNamesEveryKindAndCountsPairs) {
  const int64_t E = 8, K = 3;
  //                                 replayed   all -1       mixed        repeated   out of range
  Tensor ids = Tensor::from_vector<int32_t>(
      {1, 2, 3, -1, -1, -1, 4, -1, -1, 5, 5, 2, 1, 9, 1, 7, 3, 7}, {6, K});
  const auto n = sy::classify_replay_rows(ids, E, sy::ReplayRowPolicy::native, 2);
  const std::vector<uint8_t> want = {1, 0, 3, 3, 3, 3};
  for (int64_t t = 0; t < 6; ++t) EXPECT_EQ(n.kind.data<uint8_t>()[t], want[t]) << t;
  EXPECT_EQ(n.num_replayed, 1);
  EXPECT_EQ(n.num_native, 5);
  EXPECT_EQ(n.num_invalid, 4);
  EXPECT_EQ(n.num_pairs, 3);
  // merge: a row whose only fault is a repeated id is merged; an out-of-range id wins over a
  // repeat ([1, 9, 1] names 9), so it stays an error.
  SY_EXPECT_THROW_MSG(
      sy::classify_replay_rows(ids, E, sy::ReplayRowPolicy::merge, 2), std::invalid_argument,
      "[replay] layer 2, token 2: topk_idx row [4, -1, -1] mixes -1 and expert ids");
  Tensor rep = Tensor::from_vector<int32_t>({5, 5, 2, 7, 3, 7, 4, 4, 4, 0, 1, 2}, {4, K});
  const auto m = sy::classify_replay_rows(rep, E, sy::ReplayRowPolicy::merge);
  EXPECT_EQ(m.num_merged, 3);
  EXPECT_EQ(m.num_replayed, 4);
  EXPECT_EQ(m.num_pairs, 2 + 2 + 1 + 3);
  EXPECT_EQ(m.kind.data<uint8_t>()[2], 4);
  SY_EXPECT_THROW_MSG(sy::classify_replay_rows(rep, E), std::invalid_argument,
                      "[replay] token 0: topk_idx row [5, 5, 2] repeats expert 5");
  Tensor oor = Tensor::from_vector<int32_t>({1, 9, 1}, {1, K});
  SY_EXPECT_THROW_MSG(sy::classify_replay_rows(oor, E, sy::ReplayRowPolicy::merge),
                      std::invalid_argument, "names expert 9 outside [0, 8)");
}

TEST(Replay, TopkRouteMergeKeepsRepeatedSlotsWithTheirWeights) {
  RouterConfig c = router_config(4, 2, ScoreFunction::softmax);
  std::mt19937_64 rng(sy::testing::test_seed(5));
  const Tensor z = sy::testing::randn({2, 4}, DType::fp64, rng);
  sy::RouteInputs in;
  in.replay_idx = Tensor::from_vector<int32_t>({1, 1, 0, 2}, {2, 2});
  sy::RouteOptions o;
  o.invalid_replay_rows = sy::ReplayRowPolicy::merge;
  const auto r = sy::topk_route(z, in, c, o);
  EXPECT_EQ(r.num_replayed_rows, 2);
  EXPECT_EQ(r.num_invalid_replay_rows, 0);
  EXPECT_EQ(r.topk_idx.data<int32_t>()[0], 1);
  EXPECT_EQ(r.topk_idx.data<int32_t>()[1], 1);
  // softmax over the K selected logits: two equal slots of 1/2 each (their sum is 1).
  EXPECT_NEAR(r.topk_weights.data<double>()[0], 0.5, 1e-15);
  EXPECT_NEAR(r.topk_weights.data<double>()[1], 0.5, 1e-15);
}
