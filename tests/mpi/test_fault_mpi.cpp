// Fault injection over MPI (registered for 1, 2, 3 and 4 ranks), beyond tests/mpi/test_dispatch.cpp
// (which covers an id out of range, a hidden size / dtype / weights shape differing on one rank, a
// bad combine input on one rank, E not divisible by EP, and skewed / empty ranks in dispatch):
// bad input on ONE rank in the other collective calls (options that differ between ranks, the
// backwards' gradients) must make every rank raise the same std::invalid_argument, without a hang
// (each test arms a watchdog alarm well inside the ctest timeout), and the communicator must still
// work afterwards. Plus: every rank with zero tokens.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

#include "switchyard/dispatcher.h"
#include "switchyard/error.h"
#include "testing.h"

namespace switchyard {
namespace {

using dist::DispatcherKind;

std::shared_ptr<dist::Communicator> world() {
  static std::shared_ptr<dist::Communicator> c = dist::world();
  return c;
}

struct Watchdog {
  Watchdog() { ::alarm(60); }
  ~Watchdog() { ::alarm(0); }
};

// A small good dispatch: T tokens, K 2, ids spread over all experts.
dist::DispatchResult good_dispatch(int64_t T, int64_t E, DispatcherKind kind, dist::Communicator& c) {
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < T; ++t) {
    idx.push_back(int32_t((t + c.rank()) % E));
    idx.push_back(int32_t((t * 5 + 1) % E));
  }
  dist::DispatchOptions opt;
  opt.num_experts = E;
  opt.kind = kind;
  return dist::dispatch(Tensor::full({T, 8}, DType::fp32, 1.0), Tensor::from_vector(idx, {T, 2}),
                        Tensor::full({T, 2}, DType::fp32, 0.5), opt, c);
}

// The communicator still works: a good round trip of ones gives 0.5 + 0.5 = 1 per token (a repeated
// id is one pair of weight 1).
void expect_still_in_step(dist::Communicator& c) {
  for (DispatcherKind kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
    dist::DispatchResult d = good_dispatch(5, 12, kind, c);
    Tensor y = dist::combine(d.recv_x, d.handle, {}, c);
    for (int64_t t = 0; t < 5; ++t) EXPECT_EQ(y.item_as_double(t * 8), 1.0) << "token " << t;
  }
}

// Found by this test (MPI_ERR_TRUNCATE: the header had kHeader + num_experts entries per rank);
// fixed by the dispatch engineer's two-phase header exchange.
TEST(FaultMpi, NumExpertsDifferingOnOneRankRaisesEverywhere) {
  Watchdog wd;
  dist::Communicator& c = *world();
  const int64_t P = c.size();
  if (P == 1) GTEST_SKIP() << "needs 2+ ranks";
  for (DispatcherKind kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
    // 12 and 24 are both divisible by every EP size 1..4, so only the cross-rank check can see it.
    const int64_t E = c.rank() == P - 1 ? 24 : 12;
    SY_EXPECT_THROW_MSG(good_dispatch(4, E, kind, c), std::invalid_argument,
                        "[dispatch] num_experts must be the same on every rank, got 12 on rank 0 and 24 on rank " +
                            std::to_string(P - 1));
  }
  expect_still_in_step(c);
}

TEST(FaultMpi, DispatcherKindDifferingOnOneRankRaisesEverywhere) {
  Watchdog wd;
  dist::Communicator& c = *world();
  const int64_t P = c.size();
  if (P == 1) GTEST_SKIP() << "needs 2+ ranks";
  const DispatcherKind kind = c.rank() == P - 1 ? DispatcherKind::all_gather : DispatcherKind::all_to_all;
  SY_EXPECT_THROW_MSG(good_dispatch(4, 12, kind, c), std::invalid_argument,
                      "[dispatch] options.kind must be the same on every rank");
  expect_still_in_step(c);
}

TEST(FaultMpi, TopKDifferingOnOneRankRaisesEverywhere) {
  Watchdog wd;
  dist::Communicator& c = *world();
  const int64_t P = c.size();
  if (P == 1) GTEST_SKIP() << "needs 2+ ranks";
  const int64_t K = c.rank() == P - 1 ? 3 : 2;
  dist::DispatchOptions opt;
  opt.num_experts = 12;
  SY_EXPECT_THROW_MSG(dist::dispatch(Tensor::zeros({3, 8}, DType::fp32), Tensor::zeros({3, K}, DType::int32),
                                     Tensor::zeros({3, K}, DType::fp32), opt, c),
                      std::invalid_argument,
                      "[dispatch] topk_idx must have the same top_k on every rank, got top_k=2 on rank 0 and "
                      "top_k=3 on rank " + std::to_string(P - 1));
  expect_still_in_step(c);
}

TEST(FaultMpi, BadGradientOnOneRankInTheBackwardsRaisesEverywhere) {
  Watchdog wd;
  dist::Communicator& c = *world();
  const int64_t P = c.size(), me = c.rank();
  const std::string last = std::to_string(P - 1);
  for (DispatcherKind kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
    dist::DispatchResult d = good_dispatch(6, 12, kind, c);
    const dist::DispatchHandle& h = d.handle;
    const Tensor Y = d.recv_x;
    // combine_backward: grad_y with a wrong hidden size on the last rank.
    const Tensor gy = Tensor::zeros({6, me == P - 1 ? 7 : 8}, DType::fp32);
    SY_EXPECT_THROW_MSG(dist::combine_backward(gy, Y, h, {}, c), std::invalid_argument,
                        "[combine_backward] on rank " + last + ": [combine_backward] grad_y");
    // combine_backward: a bf16 grad_y on the last rank only (dtype must agree).
    if (P > 1) {
      const Tensor gyd = Tensor::zeros({6, 8}, me == P - 1 ? DType::bf16 : DType::fp32);
      // Caught by the local check (expert_y and grad_y must share a dtype) on the last rank,
      // raised on every rank.
      SY_EXPECT_THROW_MSG(dist::combine_backward(gyd, Y, h, {}, c), std::invalid_argument,
                          "[combine_backward] on rank " + last +
                              ": [combine_backward] expert_y must have grad_y's dtype bf16, got fp32");
    }
    // dispatch_backward: one row too many on the last rank.
    const Tensor g = Tensor::zeros({h.num_recv_tokens + (me == P - 1 ? 1 : 0), 8}, DType::fp32);
    SY_EXPECT_THROW_MSG(dist::dispatch_backward(g, h, c), std::invalid_argument,
                        "[dispatch_backward] on rank " + last + ": [dispatch_backward] grad_recv_x");
    // combine with WeightMode differing on one rank.
    if (P > 1) {
      UnpermuteOptions uo;
      uo.weights = me == P - 1 ? WeightMode::skip : WeightMode::apply;
      SY_EXPECT_THROW_MSG(dist::combine(Y, h, uo, c), std::invalid_argument,
                          "options.weights must be the same on every rank");
    }
  }
  expect_still_in_step(c);
}

TEST(FaultMpi, EveryRankWithZeroTokens) {
  Watchdog wd;
  dist::Communicator& c = *world();
  for (DispatcherKind kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
    dist::DispatchOptions opt;
    opt.num_experts = 12;
    opt.kind = kind;
    dist::DispatchResult d = dist::dispatch(Tensor::zeros({0, 8}, DType::bf16), Tensor::zeros({0, 2}, DType::int32),
                                            Tensor::zeros({0, 2}, DType::fp32), opt, c);
    EXPECT_EQ(d.handle.num_recv_tokens, 0);
    EXPECT_EQ(d.recv_x.shape(), (Shape{0, 8}));
    Tensor y = dist::combine(d.recv_x, d.handle, {}, c);
    EXPECT_EQ(y.shape(), (Shape{0, 8}));
    dist::CombineGrads g = dist::combine_backward(Tensor::zeros({0, 8}, DType::bf16), d.recv_x, d.handle, {}, c);
    EXPECT_EQ(g.grad_topk_weights.shape(), (Shape{0, 2}));
    EXPECT_EQ(dist::dispatch_backward(g.grad_expert_y, d.handle, c).shape(), (Shape{0, 8}));
  }
  expect_still_in_step(c);
}

TEST(FaultMpi, AllMinusOneRoutesOnOneRank) {
  // A rank whose tokens are all unrouted (every slot -1: padding, dropped) sends nothing and gets
  // zeros back; the others are unaffected.
  Watchdog wd;
  dist::Communicator& c = *world();
  const int64_t P = c.size(), me = c.rank();
  dist::DispatchOptions opt;
  opt.num_experts = 12;
  const bool empty = me == P - 1;
  std::vector<int32_t> idx = empty ? std::vector<int32_t>(8, -1) : std::vector<int32_t>{0, 11, 5, 6, 1, 2, 3, 4};
  dist::DispatchResult d = dist::dispatch(Tensor::full({4, 8}, DType::fp32, 2.0), Tensor::from_vector(idx, {4, 2}),
                                          Tensor::full({4, 2}, DType::fp32, 0.25), opt, c);
  Tensor y = dist::combine(d.recv_x, d.handle, {}, c);
  for (int64_t t = 0; t < 4; ++t) EXPECT_EQ(y.item_as_double(t * 8 + 3), empty ? 0.0 : 1.0) << "token " << t;
  expect_still_in_step(c);
}


// Issue 13: a bad handle on one rank used to throw before the agreement (the others hung in
// combine's exchange); now it is agreed like every other argument error.
TEST(FaultMpi, BadHandleOnOneRankRaisesEverywhere) {
  Watchdog wd;
  dist::Communicator& c = *world();
  const int64_t P = c.size(), me = c.rank();
  dist::DispatchResult d = good_dispatch(5, 12, DispatcherKind::all_to_all, c);
  const dist::DispatchHandle bad;  // never dispatched
  const dist::DispatchHandle& h = me == P - 1 ? bad : d.handle;
  SY_EXPECT_THROW_MSG(dist::combine(d.recv_x, h, {}, c), std::invalid_argument,
                      "[combine] on rank " + std::to_string(P - 1) +
                          ": [combine] handle must come from dispatch on this communicator");
  SY_EXPECT_THROW_MSG(
      dist::combine_backward(Tensor::zeros({5, 8}, DType::fp32), d.recv_x, h, {}, c),
      std::invalid_argument, "[combine_backward] on rank " + std::to_string(P - 1));
  expect_still_in_step(c);
}

// A caller's own check that failed on one rank (a binding, an adapter) joins the collective's
// agreement through fail_collective: every rank raises that rank's message.
TEST(FaultMpi, FailCollectiveOnOneRankRaisesEverywhere) {
  Watchdog wd;
  dist::Communicator& c = *world();
  const int64_t P = c.size(), me = c.rank();
  const std::string want = "[dispatch] on rank " + std::to_string(P - 1) + ": adapter says no";
  if (me == P - 1) {
    SY_EXPECT_THROW_MSG(dist::fail_collective(dist::CollectiveOp::dispatch, "adapter says no", c),
                        std::invalid_argument, want);
  } else {
    SY_EXPECT_THROW_MSG(good_dispatch(4, 12, DispatcherKind::all_to_all, c), std::invalid_argument,
                        want);
  }
  dist::DispatchResult d = good_dispatch(5, 12, DispatcherKind::all_gather, c);
  const std::string cwant = "[combine] on rank " + std::to_string(P - 1) + ": not a handle";
  if (me == P - 1) {
    SY_EXPECT_THROW_MSG(dist::fail_collective(dist::CollectiveOp::combine, "not a handle", c),
                        std::invalid_argument, cwant);
  } else {
    SY_EXPECT_THROW_MSG(dist::combine(d.recv_x, d.handle, {}, c), std::invalid_argument, cwant);
  }
  expect_still_in_step(c);
}

// SWITCHYARD_COLLECTIVE_TIMEOUT: rank 0 enters a barrier the others reach only after the
// deadline; rank 0 gets a BackendError naming the call instead of waiting forever, and its
// communicator refuses further use. (The late barrier then completes the stuck one, so the job
// ends cleanly; a barrier moves no buffers that could outlive the call.)
TEST(FaultMpi, CollectiveTimeoutTurnsAStuckCollectiveIntoAnError) {
  Watchdog wd;
  if (world()->size() == 1) GTEST_SKIP() << "needs 2+ ranks";
  // Each rank reads its own value: 0.5 s on rank 0 (the one left waiting), a generous 120 s on
  // the others, so a loaded machine (ASan, 4 ranks on 2 cores) cannot time out the late barrier.
  const bool waiting = world()->rank() == 0;
  ::setenv("SWITCHYARD_COLLECTIVE_TIMEOUT", waiting ? "0.5" : "120", 1);
  std::shared_ptr<dist::Communicator> c = dist::world();  // reads the variable
  ::unsetenv("SWITCHYARD_COLLECTIVE_TIMEOUT");
  if (waiting) {
    SY_EXPECT_THROW_MSG(c->barrier(), BackendError,
                        "MPI_Ibarrier did not complete within 0.5 s (SWITCHYARD_COLLECTIVE_TIMEOUT) "
                        "on rank 0");
    SY_EXPECT_THROW_MSG(c->barrier(), BackendError, "is unusable: MPI_Ibarrier timed out earlier");
  } else {
    ::usleep(1500 * 1000);
    c->barrier();
  }
  world()->barrier();
}

TEST(FaultMpi, CollectiveTimeoutMustBeANumber) {
  ::setenv("SWITCHYARD_COLLECTIVE_TIMEOUT", "soon", 1);
  SY_EXPECT_THROW_MSG(dist::world(), BackendError,
                      "SWITCHYARD_COLLECTIVE_TIMEOUT must be a number of seconds >= 0");
  ::unsetenv("SWITCHYARD_COLLECTIVE_TIMEOUT");
}

}  // namespace
}  // namespace switchyard
