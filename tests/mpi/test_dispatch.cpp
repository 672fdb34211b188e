// Expert-parallel dispatch over MPI, registered for 1, 2, 3 and 4 ranks: one named case per
// configuration (dispatcher kind x dtype x routes x weight mode x padding), through
// DispatchTester (tests/common/dispatch_tester.h). Every rank builds the whole global batch from
// the configuration's seed and computes the EP = 1 result locally, so each registration proves
// bitwise EP-invariance; payload rows encode (source rank, token) so every received row's origin
// and destination is checked. Then bad input on one rank (every rank raises the same error and
// stays in step) and the communicator's collectives.
#include <gtest/gtest.h>
// C API only: the deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include "dispatch_tester.h"
#include "ep_testing.h"
#include "switchyard/dispatcher.h"
#include "testing.h"

namespace switchyard {
namespace {

using dist::DispatcherKind;
using testing::DispatchTester;
using testing::fresh_dispatcher;
using testing::Routes;
using testing::test_seed;
using testing::world;

constexpr DispatcherKind kAllToAll = DispatcherKind::all_to_all;
constexpr DispatcherKind kAllGather = DispatcherKind::all_gather;

// One configuration (a DispatchTester chain) against EP = 1 for both dispatchers and both weight
// modes. All four see the same global batch (its seed does not depend on the kind or the mode), so
// the two dispatchers also agree bitwise.
#define SY_EP_ONE_CASES(Name, Chain)                                                       \
  TEST(DispatchAllToAllVsEpOne, Name##ApplyWeights) {                                      \
    DispatchTester() Chain.kind(kAllToAll).weights(WeightMode::apply).TestMatchesEpOne();  \
  }                                                                                        \
  TEST(DispatchAllToAllVsEpOne, Name##SkipWeights) {                                       \
    DispatchTester() Chain.kind(kAllToAll).weights(WeightMode::skip).TestMatchesEpOne();   \
  }                                                                                        \
  TEST(DispatchAllGatherVsEpOne, Name##ApplyWeights) {                                     \
    DispatchTester() Chain.kind(kAllGather).weights(WeightMode::apply).TestMatchesEpOne(); \
  }                                                                                        \
  TEST(DispatchAllGatherVsEpOne, Name##SkipWeights) {                                      \
    DispatchTester() Chain.kind(kAllGather).weights(WeightMode::skip).TestMatchesEpOne();  \
  }

// Replay routes: zero-filled padding rows [0, 0, ..., 0], repeated ids, -1 rows and slots.
SY_EP_ONE_CASES(ReplayTop4Of12Fp32, .experts(12).top_k(4).hidden(37).dtype(DType::fp32))
SY_EP_ONE_CASES(ReplayTop4Of24Fp32, .experts(24).top_k(4).hidden(37).dtype(DType::fp32))
SY_EP_ONE_CASES(ReplayTop4Of12Bf16, .experts(12).top_k(4).hidden(37).dtype(DType::bf16))
SY_EP_ONE_CASES(ReplayTop4Of24Bf16, .experts(24).top_k(4).hidden(37).dtype(DType::bf16))
SY_EP_ONE_CASES(ReplayTop12Of12Fp32, .experts(12).top_k(12).hidden(19).dtype(DType::fp32))
// Skewed and empty ranks.
SY_EP_ONE_CASES(EveryTokenToOneExpertTop3Of12Bf16,
                .routes(Routes::one_expert).experts(12).top_k(3).hidden(21).dtype(DType::bf16))
SY_EP_ONE_CASES(EveryTokenToTheLastRankTop3Of12Bf16,
                .routes(Routes::one_rank).experts(12).top_k(3).hidden(21).dtype(DType::bf16))
SY_EP_ONE_CASES(LastRankWithoutTokensTop3Of12Bf16,
                .routes(Routes::zero_token_rank).experts(12).top_k(3).hidden(21).dtype(DType::bf16))

// One DispatchTester method on one configuration, for both dispatchers.
#define SY_BOTH_KINDS(Suite, Name, Chain, Method)                                  \
  TEST(Suite, Name##AllToAll) { DispatchTester() Chain.kind(kAllToAll).Method(); } \
  TEST(Suite, Name##AllGather) { DispatchTester() Chain.kind(kAllGather).Method(); }

// Not only EP-invariant but right: combine against its definition in double.
SY_BOTH_KINDS(DispatchCombineVsDouble, Top4Of12Fp32, .experts(12).top_k(4).hidden(16),
              TestCombineMatchesDoubleReference)
SY_BOTH_KINDS(DispatchCombineVsDouble, Top4Of12Fp32Align8,
              .experts(12).top_k(4).hidden(16).padding(8), TestCombineMatchesDoubleReference)
SY_BOTH_KINDS(DispatchAdjoints, Top4Of12Fp32, .experts(12).top_k(4).hidden(23), TestAdjoints)
SY_BOTH_KINDS(DispatchWeightsBackward, AdjointOfTheReceivedWeightsTop4Of12Fp32,
              .experts(12).top_k(4).hidden(5), TestWeightsBackwardAdjoint)
SY_BOTH_KINDS(DispatcherObject, ReusesItsScratchTop4Of12Bf16,
              .experts(12).top_k(4).hidden(16).dtype(DType::bf16), TestDispatcherReusesItsScratch)

// Megatron-Core's FP8/FP4 routing-map padding (expert_alignment) and drop-and-pad
// (pad_to_capacity): padding rows are zero rows with weight 0 and source -1, the counts are
// Megatron's, and every result on real rows is bitwise the unpadded path's. One padding, both
// dtypes, both dispatchers, both weight modes.
#define SY_PADDING_CASE(Suite, Name, Kind, Dt, Mode, Padding) \
  TEST(Suite, Name) {                                         \
    DispatchTester()                                          \
        .experts(12)                                          \
        .top_k(4)                                             \
        .hidden(10)                                           \
        .dtype(Dt)                                            \
        .kind(Kind)                                           \
        .weights(Mode)                                        \
        .Padding.TestPaddingMatchesUnpadded();                \
  }
#define SY_PADDING_MODES(Suite, Name, Kind, Dt, Padding)                           \
  SY_PADDING_CASE(Suite, Name##ApplyWeights, Kind, Dt, WeightMode::apply, Padding) \
  SY_PADDING_CASE(Suite, Name##SkipWeights, Kind, Dt, WeightMode::skip, Padding)
#define SY_PADDING_CASES(Name, Padding)                                                    \
  SY_PADDING_MODES(DispatchPaddingAllToAll, Name##Fp32, kAllToAll, DType::fp32, Padding)   \
  SY_PADDING_MODES(DispatchPaddingAllToAll, Name##Bf16, kAllToAll, DType::bf16, Padding)   \
  SY_PADDING_MODES(DispatchPaddingAllGather, Name##Fp32, kAllGather, DType::fp32, Padding) \
  SY_PADDING_MODES(DispatchPaddingAllGather, Name##Bf16, kAllGather, DType::bf16, Padding)

SY_PADDING_CASES(Align4, padding(4))
SY_PADDING_CASES(Align16, padding(16))
SY_PADDING_CASES(Capacity3PadToCapacity, padding(1, 3, true))
SY_PADDING_CASES(Capacity5PadToCapacityAlign4, padding(4, 5, true))

// ---- Bad input on one rank: every rank raises the same std::invalid_argument (none waits in an
// exchange whose sizes the ranks disagree on) and the communicator stays in step.

#define SY_NEEDS_SEVERAL_RANKS()                               \
  do {                                                         \
    if (world().size() == 1) GTEST_SKIP() << "needs 2+ ranks"; \
  } while (0)

// A good dispatch works afterwards: both dispatchers, both weight modes, against EP = 1.
void expect_still_in_step() {
  for (DispatcherKind kind : {kAllToAll, kAllGather}) {
    for (WeightMode mode : {WeightMode::apply, WeightMode::skip}) {
      DispatchTester().hidden(8).kind(kind).weights(mode).TestMatchesEpOne();
    }
  }
}

std::string last_rank() { return std::to_string(world().size() - 1); }
bool on_last_rank() { return world().rank() == world().size() - 1; }

dist::DispatchOptions experts12(DispatcherKind kind = kAllToAll) {
  dist::DispatchOptions opt;
  opt.num_experts = 12;
  opt.kind = kind;
  return opt;
}

void expect_id_out_of_range_on_last_rank_raises_everywhere(DispatcherKind kind) {
  const int64_t T = 3;
  std::vector<int32_t> idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  if (on_last_rank()) idx[6] = 12;  // only the last rank is wrong
  SY_EXPECT_THROW_MSG(
      fresh_dispatcher().dispatch(Tensor::zeros({T, 8}, DType::fp32),
                                  Tensor::from_vector(idx, {T, 4}),
                                  Tensor::full({T, 4}, DType::fp32, 0.25), experts12(kind)),
      std::invalid_argument,
      "[dispatch] on rank " + last_rank() +
          ": [routing_plan] topk_idx must hold ids in [0, num_experts=12) or -1, got "
          "topk_idx[1, 2]=12");
  expect_still_in_step();
}
TEST(DispatchRejectsOnEveryRank, IdOutOfRangeOnLastRankAllToAll) {
  expect_id_out_of_range_on_last_rank_raises_everywhere(kAllToAll);
}
TEST(DispatchRejectsOnEveryRank, IdOutOfRangeOnLastRankAllGather) {
  expect_id_out_of_range_on_last_rank_raises_everywhere(kAllGather);
}

const Tensor& two_tokens_idx() {
  static const Tensor t = Tensor::zeros({2, 2}, DType::int32);
  return t;
}
const Tensor& two_tokens_w() {
  static const Tensor t = Tensor::full({2, 2}, DType::fp32, 0.5);
  return t;
}

TEST(DispatchRejectsOnEveryRank, HiddenSizeDifferingOnRank1) {
  SY_NEEDS_SEVERAL_RANKS();
  const int64_t H = world().rank() == 1 ? 9 : 8;
  SY_EXPECT_THROW_MSG(fresh_dispatcher().dispatch(Tensor::zeros({2, H}, DType::fp32),
                                                  two_tokens_idx(), two_tokens_w(), experts12()),
                      std::invalid_argument,
                      "[dispatch] x must have the same hidden size on every rank, got hidden=8 on "
                      "rank 0 and hidden=9 on rank 1");
}

TEST(DispatchRejectsOnEveryRank, DtypeDifferingOnLastRank) {
  SY_NEEDS_SEVERAL_RANKS();
  const DType dt = on_last_rank() ? DType::bf16 : DType::fp32;
  SY_EXPECT_THROW_MSG(fresh_dispatcher().dispatch(Tensor::zeros({2, 8}, dt), two_tokens_idx(),
                                                  two_tokens_w(), experts12()),
                      std::invalid_argument, "x must have the same dtype on every rank");
}

TEST(DispatchRejectsOnEveryRank, NumExpertsDifferingOnLastRank) {
  SY_NEEDS_SEVERAL_RANKS();
  dist::DispatchOptions other = experts12();
  if (on_last_rank()) other.num_experts = 24;
  SY_EXPECT_THROW_MSG(fresh_dispatcher().dispatch(Tensor::zeros({2, 8}, DType::fp32),
                                                  two_tokens_idx(), two_tokens_w(), other),
                      std::invalid_argument,
                      "[dispatch] num_experts must be the same on every rank, got 12 on rank 0 "
                      "and 24 on rank " +
                          last_rank());
}

TEST(DispatchRejectsOnEveryRank, KindDifferingOnLastRank) {
  SY_NEEDS_SEVERAL_RANKS();
  const dist::DispatchOptions kind = experts12(on_last_rank() ? kAllGather : kAllToAll);
  SY_EXPECT_THROW_MSG(fresh_dispatcher().dispatch(Tensor::zeros({2, 8}, DType::fp32),
                                                  two_tokens_idx(), two_tokens_w(), kind),
                      std::invalid_argument, "options.kind must be the same on every rank");
}

TEST(DispatchRejectsOnEveryRank, WeightsShapeNotTopkIdxsOnLastRank) {
  const Tensor bad_w = on_last_rank() ? Tensor::zeros({2, 3}, DType::fp32) : two_tokens_w();
  SY_EXPECT_THROW_MSG(fresh_dispatcher().dispatch(Tensor::zeros({2, 8}, DType::fp32),
                                                  two_tokens_idx(), bad_w, experts12()),
                      std::invalid_argument,
                      "[dispatch] on rank " + last_rank() + ": [dispatch] topk_weights");
}

TEST(DispatchRejectsOnEveryRank, CombineHiddenSizeWrongOnLastRank) {
  const dist::DispatchResult d = fresh_dispatcher().dispatch(
      Tensor::zeros({2, 8}, DType::fp32), two_tokens_idx(), two_tokens_w(), experts12());
  const int64_t HY = on_last_rank() ? 7 : 8;
  SY_EXPECT_THROW_MSG(fresh_dispatcher().combine(
                          Tensor::zeros({d.handle.num_recv_tokens(), HY}, DType::fp32), d.handle),
                      std::invalid_argument,
                      "[combine] on rank " + last_rank() + ": [combine] expert_y");
  // The handle still works.
  const Tensor y = fresh_dispatcher().combine(
      Tensor::zeros({d.handle.num_recv_tokens(), 8}, DType::fp32), d.handle);
  EXPECT_EQ(y.shape(), (Shape{2, 8}));
}

TEST(DispatchRejectsOnEveryRank, WeightsBackwardLengthWrongOnLastRank) {
  const testing::GlobalBatch g = testing::make_global_batch(world().size(), 12, 4, 5, DType::fp32,
                                                            Routes::replay, test_seed(6100));
  const testing::GlobalBatch::Rows mine = g.of(world().rank());
  const dist::DispatchResult d = fresh_dispatcher().dispatch(mine.x, mine.idx, mine.w, experts12());
  const Tensor bad =
      Tensor::zeros({d.handle.num_recv_tokens() + (on_last_rank() ? 1 : 0)}, DType::fp32);
  SY_EXPECT_THROW_MSG(fresh_dispatcher().dispatch_weights_backward(bad, d.handle),
                      std::invalid_argument,
                      "[dispatch_weights_backward] on rank " + last_rank() +
                          ": [dispatch_weights_backward] grad_recv_topk_weights must have shape");
}

void expect_dispatch_raises(const dist::DispatchOptions& opt, const std::string& want) {
  SY_EXPECT_THROW_MSG(fresh_dispatcher().dispatch(Tensor::zeros({1, 4}, DType::fp32),
                                                  Tensor::zeros({1, 1}, DType::int32),
                                                  Tensor::zeros({1, 1}, DType::fp32), opt),
                      std::invalid_argument, want);
}

TEST(DispatchRejectsOnEveryRank, ExpertsNotDivisibleByEpUpFront) {
  const int64_t P = world().size();
  dist::DispatchOptions opt;
  opt.num_experts = P == 1 ? 0 : 2 * P + 1;
  expect_dispatch_raises(
      opt, P == 1 ? std::string("num_experts must be >= 1")
                  : "[dispatch] num_experts must be divisible by the expert-parallel size " +
                        std::to_string(P) + ", got num_experts=" + std::to_string(2 * P + 1));
}

TEST(DispatchRejectsOnEveryRank, ExpertsNotDivisibleByEpOnLastRank) {
  SY_NEEDS_SEVERAL_RANKS();
  const int64_t P = world().size();
  dist::DispatchOptions one;
  one.num_experts = on_last_rank() ? 2 * P + 1 : 2 * P;
  expect_dispatch_raises(one, "[dispatch] on rank " + last_rank() +
                                  ": [dispatch] num_experts must be divisible by the "
                                  "expert-parallel size");
}

TEST(DispatchRejectsOnEveryRank, PaddingDifferingOnLastRank) {
  // Rejected everywhere, before any payload.
  SY_NEEDS_SEVERAL_RANKS();
  dist::DispatchOptions pad;
  pad.num_experts = 4 * world().size();
  pad.plan.expert_alignment = on_last_rank() ? 8 : 4;
  expect_dispatch_raises(pad,
                         "[dispatch] options.plan padding must be the same on every rank, got "
                         "expert_alignment=4 pad_to_capacity=false on rank 0 and "
                         "expert_alignment=8");
}

// A handle that is not from dispatch on this communicator, or one from a different dispatch than
// the other ranks', on the last rank only. Two steps' handles on every rank; afterwards both work
// when every rank passes the same one.
class DispatchBadHandle : public ::testing::Test {
 protected:
  DispatchBadHandle()
      : disp_(testing::world_ptr()),
        g1_(testing::make_global_batch(world().size(), 12, 4, 8, DType::fp32, Routes::replay,
                                       test_seed(7000))),
        g2_(testing::make_global_batch(world().size(), 12, 4, 8, DType::fp32, Routes::one_rank,
                                       test_seed(7000) + 1)),
        d1_(step(g1_)),
        d2_(step(g2_)) {}

  void TearDown() override {
    for (const dist::DispatchResult* d : {&d1_, &d2_}) {
      const Tensor y = disp_.combine(d->recv_x, d->handle, WeightMode::skip);
      EXPECT_EQ(y.size(0), d->handle.num_tokens());
    }
  }

  dist::DispatchResult step(const testing::GlobalBatch& g) {
    const testing::GlobalBatch::Rows mine = g.of(world().rank());
    return disp_.dispatch(mine.x, mine.idx, mine.w, experts12());
  }
  // A default handle (never returned by dispatch) on the last rank, d1's elsewhere.
  const dist::DispatchHandle& never_dispatched_on_last() const {
    return on_last_rank() ? empty_ : d1_.handle;
  }
  Tensor expert_y() const {
    return on_last_rank() ? Tensor::zeros({0, 8}, DType::fp32) : d1_.recv_x;
  }
  // The second step's result on the last rank, the first step's elsewhere: each handle is valid
  // locally (its own shapes), but the layouts differ between ranks.
  const dist::DispatchResult& other_step_on_last() const { return on_last_rank() ? d2_ : d1_; }

  dist::Dispatcher disp_;
  const testing::GlobalBatch g1_, g2_;
  const dist::DispatchResult d1_, d2_;
  const dist::DispatchHandle empty_;
};

TEST_F(DispatchBadHandle, NeverDispatchedOnLastRankInCombine) {
  SY_EXPECT_THROW_MSG(disp_.combine(expert_y(), never_dispatched_on_last()), std::invalid_argument,
                      "[combine] on rank " + last_rank() +
                          ": [combine] handle must come from dispatch on this communicator");
}

TEST_F(DispatchBadHandle, NeverDispatchedOnLastRankInDispatchBackward) {
  SY_EXPECT_THROW_MSG(
      disp_.dispatch_backward(expert_y(), never_dispatched_on_last()), std::invalid_argument,
      "[dispatch_backward] on rank " + last_rank() + ": [dispatch_backward] handle");
}

TEST_F(DispatchBadHandle, NeverDispatchedOnLastRankInCombineBackward) {
  SY_EXPECT_THROW_MSG(
      disp_.combine_backward(
          Tensor::zeros({g1_.T[static_cast<size_t>(world().rank())], 8}, DType::fp32), expert_y(),
          never_dispatched_on_last()),
      std::invalid_argument,
      "[combine_backward] on rank " + last_rank() + ": [combine_backward] handle");
}

TEST_F(DispatchBadHandle, NeverDispatchedOnLastRankInDispatchWeightsBackward) {
  SY_EXPECT_THROW_MSG(
      disp_.dispatch_weights_backward(Tensor::zeros({expert_y().size(0)}, DType::fp32),
                                      never_dispatched_on_last()),
      std::invalid_argument,
      "[dispatch_weights_backward] on rank " + last_rank() +
          ": [dispatch_weights_backward] handle");
}

TEST_F(DispatchBadHandle, OtherStepsHandleOnLastRankInCombine) {
  SY_NEEDS_SEVERAL_RANKS();
  const dist::DispatchResult& mine = other_step_on_last();
  SY_EXPECT_THROW_MSG(disp_.combine(mine.recv_x, mine.handle), std::invalid_argument,
                      "[combine] handle must come from the same dispatch call on every rank, "
                      "got handles of different dispatches on rank 0 and rank " +
                          last_rank());
}

TEST_F(DispatchBadHandle, OtherStepsHandleOnLastRankInCombineBackward) {
  SY_NEEDS_SEVERAL_RANKS();
  const dist::DispatchResult& mine = other_step_on_last();
  SY_EXPECT_THROW_MSG(
      disp_.combine_backward(Tensor::zeros({mine.handle.num_tokens(), 8}, DType::fp32), mine.recv_x,
                             mine.handle),
      std::invalid_argument, "[combine_backward] handle must come from the same dispatch call");
}

// ---- The communicator's collectives move the right bytes.

TEST(Communicator, IsMpiOverTheWholeWorld) {
  EXPECT_EQ(world().name(), "mpi");
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(world().size(), size);
}

TEST(Communicator, AlltoallvSendsEveryPeerItsCount) {
  // Rank s sends (s + r) values "1000*s + r" to rank r.
  dist::Communicator& c = world();
  const int64_t P = c.size(), me = c.rank();
  std::vector<int64_t> send_counts(P), recv_counts(P);
  std::vector<int32_t> send;
  for (int64_t r = 0; r < P; ++r) {
    send_counts[r] = me + r;
    recv_counts[r] = r + me;
    for (int64_t j = 0; j < me + r; ++j) send.push_back(static_cast<int32_t>(1000 * me + r));
  }
  std::vector<int32_t> recv(static_cast<size_t>(P * me + P * (P - 1) / 2) + 1);
  c.alltoallv(send.data(), send_counts, recv.data(), recv_counts, sizeof(int32_t));
  size_t i = 0;
  for (int64_t s = 0; s < P; ++s)
    for (int64_t j = 0; j < s + me; ++j) EXPECT_EQ(recv[i++], 1000 * s + me);
}

TEST(Communicator, AllgathervWithAZeroLengthRank) {
  dist::Communicator& c = world();
  const int64_t P = c.size(), me = c.rank();
  std::vector<int64_t> counts(P);
  for (int64_t r = 0; r < P; ++r) counts[r] = r % 2 ? 0 : r + 1;
  std::vector<double> mine(static_cast<size_t>(counts[me]), static_cast<double>(me));
  std::vector<double> all(static_cast<size_t>(P * P + 1));
  c.allgatherv(mine.data(), counts[me], all.data(), counts, sizeof(double));
  size_t i = 0;
  for (int64_t r = 0; r < P; ++r)
    for (int64_t j = 0; j < counts[r]; ++j) EXPECT_EQ(all[i++], r);
}

TEST(Communicator, AllreduceMaxAndBarrier) {
  dist::Communicator& c = world();
  int64_t v[2] = {c.rank(), -c.rank()};
  c.allreduce_max(v, 2);
  EXPECT_EQ(v[0], c.size() - 1);
  EXPECT_EQ(v[1], 0);
  c.barrier();
}

// exchange_blocks: to every peer r (self included) three blocks, of 1, 0 and r+1 rows (the empty
// one is skipped on both sides); row value = 1000 * sender + 10 * row + r. Received from each peer
// s: blocks of 1, 0 and me+1 rows, stored in reverse peer order.
struct Blocks {
  std::vector<int64_t> send;
  std::vector<dist::Communicator::Block> send_blocks, recv_blocks;
  int64_t recv_rows = 0;

  Blocks() {
    const int64_t P = world().size(), me = world().rank();
    for (int64_t r = 0; r < P; ++r) {
      for (int64_t n : {int64_t{1}, int64_t{0}, r + 1}) {
        send_blocks.push_back({static_cast<int>(r), static_cast<int64_t>(send.size()), n});
        for (int64_t j = 0; j < n; ++j)
          send.push_back(1000 * me + 10 * static_cast<int64_t>(send.size()) + r);
      }
    }
    for (int64_t s = P - 1; s >= 0; --s) {
      for (int64_t n : {int64_t{1}, int64_t{0}, me + 1}) {
        recv_blocks.push_back({static_cast<int>(s), recv_rows, n});
        recv_rows += n;
      }
    }
  }
  std::vector<int64_t> exchange() const {
    std::vector<int64_t> recv(static_cast<size_t>(recv_rows), -1);
    world().exchange_blocks(send.data(), send_blocks, recv.data(), recv_blocks, sizeof(int64_t));
    return recv;
  }
};

TEST(Communicator, ExchangeBlocksLandsEveryRowInItsBlock) {
  const Blocks bl;
  const std::vector<int64_t> recv = bl.exchange();
  const int64_t me = world().rank();
  // Sender s laid out its rows for peer r at offset sum_{q<r}(1 + q + 1); check every value.
  for (size_t bi = 0; bi < bl.recv_blocks.size(); ++bi) {
    const auto& b = bl.recv_blocks[bi];
    int64_t base = 0;
    for (int64_t q = 0; q < me; ++q) base += 2 + q;
    const int64_t first = bi % 3 == 0 ? base : base + 1;  // the 1-row block, then the me+1 block
    for (int64_t j = 0; j < b.rows; ++j) {
      EXPECT_EQ(recv[static_cast<size_t>(b.offset + j)], 1000 * b.peer + 10 * (first + j) + me)
          << "from " << b.peer << " block of " << b.rows;
    }
  }
}

TEST(Communicator, ExchangePlanesLandAsIfExchangedAlone) {
  // Two planes in one round (the rows above, and the same blocks of int32 "metadata" = -value,
  // into their own buffer).
  const Blocks bl;
  const std::vector<int64_t> alone = bl.exchange();
  std::vector<int32_t> meta(bl.send.size()), got_meta(static_cast<size_t>(bl.recv_rows), 0);
  for (size_t i = 0; i < bl.send.size(); ++i) meta[i] = -static_cast<int32_t>(bl.send[i]);
  std::vector<int64_t> again(static_cast<size_t>(bl.recv_rows), -1);
  const dist::Communicator::Plane planes[2] = {
      {bl.send.data(), &bl.send_blocks, again.data(), &bl.recv_blocks, sizeof(int64_t)},
      {meta.data(), &bl.send_blocks, got_meta.data(), &bl.recv_blocks, sizeof(int32_t)}};
  world().exchange_planes(planes, 2);
  EXPECT_EQ(again, alone);
  for (int64_t i = 0; i < bl.recv_rows; ++i) {
    EXPECT_EQ(got_meta[static_cast<size_t>(i)], -alone[static_cast<size_t>(i)]) << "row " << i;
  }
}

TEST(Communicator, LocalIsSizeOneAndCopies) {
  auto l = dist::local();
  EXPECT_EQ(l->size(), 1);
  const std::vector<int64_t> one = {7, 8};
  EXPECT_EQ(l->allgather(one), one);
}

TEST(Communicator, SecondWorldIsAnIndependentDuplicate) {
  auto c2 = dist::world();
  EXPECT_EQ(c2->rank(), world().rank());
  EXPECT_EQ(c2->size(), world().size());
}

}  // namespace
}  // namespace switchyard
