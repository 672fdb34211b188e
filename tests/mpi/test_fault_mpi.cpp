// Fault injection over MPI (registered for 1, 2, 3 and 4 ranks), beyond tests/mpi/test_dispatch.cpp
// (which covers an id out of range, a hidden size / dtype / weights shape differing on one rank, a
// bad combine input on one rank, E not divisible by EP, and skewed / empty ranks in dispatch):
// bad input on ONE rank in the other collective calls (options that differ between ranks, the
// backwards' gradients) must make every rank raise the same std::invalid_argument, without a hang
// (mpi_main.cpp arms a watchdog per case well inside the ctest timeout), and the communicator must
// still work afterwards. Plus: every rank with zero tokens, a rank whose routes are all -1. One
// named case per check and dispatcher kind.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

#include "ep_testing.h"
#include "switchyard/dispatcher.h"
#include "switchyard/error.h"
#include "testing.h"

namespace switchyard {
namespace {

using dist::DispatcherKind;
using testing::fresh_dispatcher;
using testing::world;

// A small good dispatch: T tokens, K 2, ids spread over all experts.
dist::DispatchResult good_dispatch(int64_t T, int64_t E, DispatcherKind kind) {
  dist::Communicator& c = world();
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < T; ++t) {
    idx.push_back(int32_t((t + c.rank()) % E));
    idx.push_back(int32_t((t * 5 + 1) % E));
  }
  dist::DispatchOptions opt;
  opt.num_experts = E;
  opt.kind = kind;
  return fresh_dispatcher().dispatch(Tensor::full({T, 8}, DType::fp32, 1.0),
                                     Tensor::from_vector(idx, {T, 2}),
                                     Tensor::full({T, 2}, DType::fp32, 0.5), opt);
}

// The communicator still works: a good round trip of ones gives 0.5 + 0.5 = 1 per token (a
// repeated id is one pair of weight 1), for both dispatchers.
void expect_still_in_step() {
  for (DispatcherKind kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
    const dist::DispatchResult d = good_dispatch(5, 12, kind);
    const Tensor y = fresh_dispatcher().combine(d.recv_x, d.handle);
    for (int64_t t = 0; t < 5; ++t) EXPECT_EQ(y.item_as_double(t * 8), 1.0) << "token " << t;
  }
}

#define SY_NEEDS_SEVERAL_RANKS()                               \
  do {                                                         \
    if (world().size() == 1) GTEST_SKIP() << "needs 2+ ranks"; \
  } while (0)

// One case body `Name(DispatcherKind)`, registered for both dispatchers.
#define SY_FAULT_BOTH_KINDS(Name)                                      \
  TEST(FaultMpi, Name##AllToAll) { Name(DispatcherKind::all_to_all); } \
  TEST(FaultMpi, Name##AllGather) { Name(DispatcherKind::all_gather); }

std::string last_rank() { return std::to_string(world().size() - 1); }
bool on_last_rank() { return world().rank() == world().size() - 1; }

// Found by this test (MPI_ERR_TRUNCATE: the header had kHeader + num_experts entries per rank);
// fixed by the dispatch engineer's two-phase header exchange.
void NumExpertsDifferingOnOneRankRaisesEverywhere(DispatcherKind kind) {
  SY_NEEDS_SEVERAL_RANKS();
  // 12 and 24 are both divisible by every EP size 1..4, so only the cross-rank check can see it.
  const int64_t E = on_last_rank() ? 24 : 12;
  SY_EXPECT_THROW_MSG(good_dispatch(4, E, kind), std::invalid_argument,
                      "[dispatch] num_experts must be the same on every rank, got 12 on rank 0 "
                      "and 24 on rank " +
                          last_rank());
  expect_still_in_step();
}
SY_FAULT_BOTH_KINDS(NumExpertsDifferingOnOneRankRaisesEverywhere)

TEST(FaultMpi, DispatcherKindDifferingOnOneRankRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  const DispatcherKind kind =
      on_last_rank() ? DispatcherKind::all_gather : DispatcherKind::all_to_all;
  SY_EXPECT_THROW_MSG(good_dispatch(4, 12, kind), std::invalid_argument,
                      "[dispatch] options.kind must be the same on every rank");
  expect_still_in_step();
}

TEST(FaultMpi, TopKDifferingOnOneRankRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  const int64_t K = on_last_rank() ? 3 : 2;
  dist::DispatchOptions opt;
  opt.num_experts = 12;
  SY_EXPECT_THROW_MSG(
      fresh_dispatcher().dispatch(Tensor::zeros({3, 8}, DType::fp32),
                                  Tensor::zeros({3, K}, DType::int32),
                                  Tensor::zeros({3, K}, DType::fp32), opt),
      std::invalid_argument,
      "[dispatch] topk_idx must have the same top_k on every rank, got top_k=2 on rank 0 and "
      "top_k=3 on rank " +
          last_rank());
  expect_still_in_step();
}

// Bad gradients on the last rank in the backwards (after a good dispatch of 6 tokens, H 8).
void CombineBackwardGradWrongHiddenOnOneRankRaisesEverywhere(DispatcherKind kind) {
  const dist::DispatchResult d = good_dispatch(6, 12, kind);
  const Tensor gy = Tensor::zeros({6, on_last_rank() ? 7 : 8}, DType::fp32);
  SY_EXPECT_THROW_MSG(fresh_dispatcher().combine_backward(gy, d.recv_x, d.handle),
                      std::invalid_argument,
                      "[combine_backward] on rank " + last_rank() + ": [combine_backward] grad_y");
  expect_still_in_step();
}
SY_FAULT_BOTH_KINDS(CombineBackwardGradWrongHiddenOnOneRankRaisesEverywhere)

void CombineBackwardGradBf16OnOneRankRaisesEverywhere(DispatcherKind kind) {
  // Caught by the local check (expert_y and grad_y must share a dtype) on the last rank, raised
  // on every rank.
  SY_NEEDS_SEVERAL_RANKS();
  const dist::DispatchResult d = good_dispatch(6, 12, kind);
  const Tensor gy = Tensor::zeros({6, 8}, on_last_rank() ? DType::bf16 : DType::fp32);
  SY_EXPECT_THROW_MSG(fresh_dispatcher().combine_backward(gy, d.recv_x, d.handle),
                      std::invalid_argument,
                      "[combine_backward] on rank " + last_rank() +
                          ": [combine_backward] expert_y must have grad_y's dtype bf16, got fp32");
  expect_still_in_step();
}
SY_FAULT_BOTH_KINDS(CombineBackwardGradBf16OnOneRankRaisesEverywhere)

void DispatchBackwardGradExtraRowOnOneRankRaisesEverywhere(DispatcherKind kind) {
  const dist::DispatchResult d = good_dispatch(6, 12, kind);
  const Tensor g =
      Tensor::zeros({d.handle.num_recv_tokens() + (on_last_rank() ? 1 : 0), 8}, DType::fp32);
  SY_EXPECT_THROW_MSG(
      fresh_dispatcher().dispatch_backward(g, d.handle), std::invalid_argument,
      "[dispatch_backward] on rank " + last_rank() + ": [dispatch_backward] grad_recv_x");
  expect_still_in_step();
}
SY_FAULT_BOTH_KINDS(DispatchBackwardGradExtraRowOnOneRankRaisesEverywhere)

void CombineWeightModeDifferingOnOneRankRaisesEverywhere(DispatcherKind kind) {
  SY_NEEDS_SEVERAL_RANKS();
  const dist::DispatchResult d = good_dispatch(6, 12, kind);
  const WeightMode weights = on_last_rank() ? WeightMode::skip : WeightMode::apply;
  SY_EXPECT_THROW_MSG(fresh_dispatcher().combine(d.recv_x, d.handle, weights),
                      std::invalid_argument, "weights must be the same on every rank");
  expect_still_in_step();
}
SY_FAULT_BOTH_KINDS(CombineWeightModeDifferingOnOneRankRaisesEverywhere)

void EveryRankWithZeroTokens(DispatcherKind kind) {
  dist::Dispatcher disp = fresh_dispatcher();
  dist::DispatchOptions opt;
  opt.num_experts = 12;
  opt.kind = kind;
  const dist::DispatchResult d =
      disp.dispatch(Tensor::zeros({0, 8}, DType::bf16), Tensor::zeros({0, 2}, DType::int32),
                    Tensor::zeros({0, 2}, DType::fp32), opt);
  EXPECT_EQ(d.handle.num_recv_tokens(), 0);
  EXPECT_EQ(d.recv_x.shape(), (Shape{0, 8}));
  const Tensor y = disp.combine(d.recv_x, d.handle);
  EXPECT_EQ(y.shape(), (Shape{0, 8}));
  const dist::CombineGrads g =
      disp.combine_backward(Tensor::zeros({0, 8}, DType::bf16), d.recv_x, d.handle);
  EXPECT_EQ(g.grad_topk_weights.shape(), (Shape{0, 2}));
  EXPECT_EQ(disp.dispatch_backward(g.grad_expert_y, d.handle).shape(), (Shape{0, 8}));
  expect_still_in_step();
}
SY_FAULT_BOTH_KINDS(EveryRankWithZeroTokens)

// A rank whose tokens are all unrouted (every slot -1: padding, dropped) sends nothing and gets
// zeros back; the others are unaffected.
void AllMinusOneRoutesOnOneRank(DispatcherKind kind) {
  dist::DispatchOptions opt;
  opt.num_experts = 12;
  opt.kind = kind;
  const bool empty = on_last_rank();
  const std::vector<int32_t> idx =
      empty ? std::vector<int32_t>(8, -1) : std::vector<int32_t>{0, 11, 5, 6, 1, 2, 3, 4};
  const dist::DispatchResult d = fresh_dispatcher().dispatch(
      Tensor::full({4, 8}, DType::fp32, 2.0), Tensor::from_vector(idx, {4, 2}),
      Tensor::full({4, 2}, DType::fp32, 0.25), opt);
  const Tensor y = fresh_dispatcher().combine(d.recv_x, d.handle);
  for (int64_t t = 0; t < 4; ++t) {
    EXPECT_EQ(y.item_as_double(t * 8 + 3), empty ? 0.0 : 1.0) << "token " << t;
  }
  expect_still_in_step();
}
SY_FAULT_BOTH_KINDS(AllMinusOneRoutesOnOneRank)

// Issue 13: a bad handle on one rank used to throw before the agreement (the others hung in
// combine's exchange); now it is agreed like every other argument error.
TEST(FaultMpi, BadHandleOnOneRankInCombineRaisesEverywhere) {
  const dist::DispatchResult d = good_dispatch(5, 12, DispatcherKind::all_to_all);
  const dist::DispatchHandle bad;  // never dispatched
  SY_EXPECT_THROW_MSG(fresh_dispatcher().combine(d.recv_x, on_last_rank() ? bad : d.handle),
                      std::invalid_argument,
                      "[combine] on rank " + last_rank() +
                          ": [combine] handle must come from dispatch on this communicator");
  expect_still_in_step();
}

TEST(FaultMpi, BadHandleOnOneRankInCombineBackwardRaisesEverywhere) {
  const dist::DispatchResult d = good_dispatch(5, 12, DispatcherKind::all_to_all);
  const dist::DispatchHandle bad;  // never dispatched
  SY_EXPECT_THROW_MSG(
      fresh_dispatcher().combine_backward(Tensor::zeros({5, 8}, DType::fp32), d.recv_x,
                                          on_last_rank() ? bad : d.handle),
      std::invalid_argument, "[combine_backward] on rank " + last_rank());
  expect_still_in_step();
}

// A caller's own check that failed on one rank (a binding, an adapter) joins the collective's
// agreement through fail_collective: every rank raises that rank's message.
TEST(FaultMpi, FailCollectiveOnOneRankInDispatchRaisesEverywhere) {
  const std::string want = "[dispatch] on rank " + last_rank() + ": adapter says no";
  if (on_last_rank()) {
    SY_EXPECT_THROW_MSG(
        dist::fail_collective(dist::CollectiveOp::dispatch, "adapter says no", world()),
        std::invalid_argument, want);
  } else {
    SY_EXPECT_THROW_MSG(good_dispatch(4, 12, DispatcherKind::all_to_all), std::invalid_argument,
                        want);
  }
  expect_still_in_step();
}

TEST(FaultMpi, FailCollectiveOnOneRankInCombineRaisesEverywhere) {
  const dist::DispatchResult d = good_dispatch(5, 12, DispatcherKind::all_gather);
  const std::string want = "[combine] on rank " + last_rank() + ": not a handle";
  if (on_last_rank()) {
    SY_EXPECT_THROW_MSG(dist::fail_collective(dist::CollectiveOp::combine, "not a handle", world()),
                        std::invalid_argument, want);
  } else {
    SY_EXPECT_THROW_MSG(fresh_dispatcher().combine(d.recv_x, d.handle), std::invalid_argument,
                        want);
  }
  expect_still_in_step();
}

// SWITCHYARD_COLLECTIVE_TIMEOUT: rank 0 enters a barrier the others reach only after the
// deadline; rank 0 gets a BackendError naming the call instead of waiting forever, and its
// communicator refuses further use. (The late barrier then completes the stuck one, so the job
// ends cleanly; a barrier moves no buffers that could outlive the call.)
TEST(FaultMpi, CollectiveTimeoutTurnsAStuckCollectiveIntoAnError) {
  SY_NEEDS_SEVERAL_RANKS();
  // Each rank reads its own value: 0.5 s on rank 0 (the one left waiting), a generous 120 s on
  // the others, so a loaded machine (ASan, 4 ranks on 2 cores) cannot time out the late barrier.
  const bool waiting = world().rank() == 0;
  ::setenv("SWITCHYARD_COLLECTIVE_TIMEOUT", waiting ? "0.5" : "120", 1);
  std::shared_ptr<dist::Communicator> c = dist::world();  // reads the variable
  ::unsetenv("SWITCHYARD_COLLECTIVE_TIMEOUT");
  if (waiting) {
    SY_EXPECT_THROW_MSG(
        c->barrier(), BackendError,
        "MPI_Ibarrier did not complete within 0.5 s (SWITCHYARD_COLLECTIVE_TIMEOUT) "
        "on rank 0");
    SY_EXPECT_THROW_MSG(c->barrier(), BackendError, "is unusable: MPI_Ibarrier timed out earlier");
  } else {
    ::usleep(1500 * 1000);
    c->barrier();
  }
  world().barrier();
}

TEST(FaultMpi, CollectiveTimeoutMustBeANumber) {
  ::setenv("SWITCHYARD_COLLECTIVE_TIMEOUT", "soon", 1);
  SY_EXPECT_THROW_MSG(dist::world(), BackendError,
                      "SWITCHYARD_COLLECTIVE_TIMEOUT must be a number of seconds >= 0");
  ::unsetenv("SWITCHYARD_COLLECTIVE_TIMEOUT");
}

}  // namespace
}  // namespace switchyard
