// Settings agreement of the comm-taking router APIs (registered for 1, 2, 3 and 4 ranks; issue
// 22): topk_route with loss communicators, update_expert_bias and update_qb_beta with a
// communicator must agree on the sizes and options their reductions depend on before reducing.
// A setting that differs on the last rank (num_experts, top_k, the sequence count of
// seq_aux_loss, a loss type, a communicator given on one rank only) must make EVERY rank throw the
// same std::invalid_argument naming the setting and both values; before, one rank failed with
// MPI_ERR_TRUNCATE and another returned a wrong loss, or every rank waited forever (mpi_main.cpp
// arms a watchdog per case). The communicators must still work afterwards.
#include <gtest/gtest.h>

#include <string>

#include "ep_testing.h"
#include "switchyard/router.h"
#include "testing.h"

namespace switchyard {
namespace {

using testing::world;

#define SY_NEEDS_SEVERAL_RANKS()                               \
  do {                                                         \
    if (world().size() == 1) GTEST_SKIP() << "needs 2+ ranks"; \
  } while (0)

bool on_last_rank() { return world().rank() == world().size() - 1; }
std::string last_rank() { return std::to_string(world().size() - 1); }

RouterConfig aux_config(int64_t E, int64_t K, AuxLossType type) {
  RouterConfig c;
  c.num_experts = E;
  c.top_k = K;
  c.aux_loss_type = type;
  c.aux_loss_coeff = 0.01;
  return c;
}

Tensor logits_of(int64_t T, int64_t E) {
  Tensor z = Tensor::empty({T, E}, DType::fp32);
  for (int64_t i = 0; i < T * E; ++i) z.data<float>()[i] = 0.01f * static_cast<float>(i % 37);
  return z;
}

// Routes with `config` (and seq_length) over `comms`; expects every rank to throw `want`.
void expect_route_disagreement(const RouterConfig& config, int64_t T, int64_t seq_length,
                               RouteComms comms, const std::string& want) {
  GlobalAuxLossState state;
  RouteInputs in;
  in.global_aux_loss_state = &state;
  RouteOptions opt;
  opt.seq_length = seq_length;
  SY_EXPECT_THROW_MSG(topk_route(logits_of(T, config.num_experts), in, config, opt, comms),
                      std::invalid_argument, want);
  EXPECT_FALSE(state.num_tokens_per_expert.defined()) << "the state changed before the agreement";
}

// Still in step: a good collective route on the same communicators.
void expect_route_still_in_step(RouteComms comms) {
  GlobalAuxLossState state;
  RouteInputs in;
  in.global_aux_loss_state = &state;
  const RouterConfig c = aux_config(8, 2, AuxLossType::global_aux_loss);
  EXPECT_NO_THROW(topk_route(logits_of(6, 8), in, c, {}, comms));
  EXPECT_EQ(state.steps, 1);
}

TEST(AgreeMpi, RouteNumExpertsDifferingOnOneRankRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  const RouteComms comms{&world(), nullptr};
  expect_route_disagreement(
      aux_config(on_last_rank() ? 16 : 8, 2, AuxLossType::aux_loss), 6, 0, comms,
      "[route] loss_comm ranks disagree: num_experts=8 on rank 0, 16 on rank " + last_rank());
  expect_route_still_in_step(comms);
}

TEST(AgreeMpi, RouteTopKDifferingOnOneRankRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  const RouteComms comms{&world(), &world()};
  expect_route_disagreement(
      aux_config(8, on_last_rank() ? 3 : 2, AuxLossType::aux_loss), 6, 0, comms,
      "[route] loss_comm ranks disagree: top_k=2 on rank 0, 3 on rank " + last_rank());
  expect_route_still_in_step(comms);
}

TEST(AgreeMpi, RouteSequenceCountDifferingOnOneRankRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  const RouteComms comms{&world(), nullptr};
  // 12 tokens in sequences of 6 (2 sequences) here, of 4 (3 sequences) on the last rank.
  expect_route_disagreement(aux_config(8, 2, AuxLossType::seq_aux_loss), 12, on_last_rank() ? 4 : 6,
                            comms,
                            "[route] loss_comm ranks disagree: num_sequences (num_tokens / "
                            "seq_length)=2 on rank 0, 3 on rank " +
                                last_rank());
  expect_route_still_in_step(comms);
}

TEST(AgreeMpi, RouteAuxLossOnOneRankOnlyRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  const RouteComms comms{&world(), nullptr};
  RouterConfig c = aux_config(8, 2, AuxLossType::aux_loss);
  if (on_last_rank()) c.aux_loss_type = AuxLossType::none;
  expect_route_disagreement(
      c, 6, 0, comms,
      "[route] loss_comm ranks disagree: aux_loss=true on rank 0, false on rank " + last_rank());
  expect_route_still_in_step(comms);
}

TEST(AgreeMpi, RouteGlobalAuxLossAgainstAuxLossRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  const RouteComms comms{&world(), &world()};
  const RouterConfig c =
      aux_config(8, 2, on_last_rank() ? AuxLossType::aux_loss : AuxLossType::global_aux_loss);
  expect_route_disagreement(
      c, 6, 0, comms,
      "[route] loss_comm ranks disagree: aux_loss=false on rank 0, true on rank " + last_rank());
  expect_route_still_in_step(comms);
}

TEST(AgreeMpi, RouteGlobalCommOnOneRankOnlyRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  // The loss group is the world; only the last rank names a separate global_aux_loss group (a
  // size-1 one of its own, which it alone exchanges on after the loss group).
  auto own = dist::local();
  const RouteComms comms{&world(), on_last_rank() ? own.get() : nullptr};
  expect_route_disagreement(aux_config(8, 2, AuxLossType::global_aux_loss), 6, 0, comms,
                            "[route] loss_comm ranks disagree: global_aux_loss_comm given=false "
                            "on rank 0, true on rank " +
                                last_rank());
  expect_route_still_in_step({&world(), nullptr});
}

TEST(AgreeMpi, RouteLocalErrorIsTheSameErrorOnEveryRank) {
  SY_NEEDS_SEVERAL_RANKS();
  const RouteComms comms{&world(), &world()};
  // The last rank's seq_length does not divide its tokens: its own check fails, and every rank
  // throws that message, naming the rank.
  expect_route_disagreement(aux_config(8, 2, AuxLossType::seq_aux_loss), 12, on_last_rank() ? 5 : 6,
                            comms,
                            "[route] on rank " + last_rank() +
                                ": [route] seq_aux_loss needs seq_length >= 1 dividing "
                                "num_tokens=12, got seq_length=5");
  expect_route_still_in_step(comms);
}

TEST(AgreeMpi, ExpertBiasNumExpertsDifferingOnOneRankRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  const int64_t E = on_last_rank() ? 16 : 8;
  SY_EXPECT_THROW_MSG(update_expert_bias(Tensor::zeros({E}, DType::fp32),
                                         Tensor::zeros({E}, DType::int64), 1e-3, world()),
                      std::invalid_argument,
                      "[update_expert_bias] comm ranks disagree: num_experts=8 on rank 0, 16 on "
                      "rank " +
                          last_rank());
  EXPECT_NO_THROW(update_expert_bias(Tensor::zeros({8}, DType::fp32),
                                     Tensor::zeros({8}, DType::int64), 1e-3, world()));
}

TEST(AgreeMpi, QbBetaNumExpertsDifferingOnOneRankRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  const int64_t E = on_last_rank() ? 16 : 8;
  SY_EXPECT_THROW_MSG(
      update_qb_beta(Tensor::zeros({E}, DType::fp32), Tensor::zeros({E}, DType::fp32), 1, 0.5,
                     world()),
      std::invalid_argument,
      "[update_qb_beta] comm ranks disagree: num_experts=8 on rank 0, 16 on rank " + last_rank());
  EXPECT_NO_THROW(update_qb_beta(Tensor::zeros({8}, DType::fp32), Tensor::zeros({8}, DType::fp32),
                                 1, 0.5, world()));
}

// A caller's own check failing on the last rank (a binding conversion) joins the agreement in
// place of the call: every rank throws that message, naming the rank.
TEST(AgreeMpi, FailRouterCollectiveOnOneRankRaisesEverywhere) {
  SY_NEEDS_SEVERAL_RANKS();
  const RouteComms comms{&world(), &world()};
  const std::string want = "[route] on rank " + last_rank() + ": [topk_route] logits: bad";
  if (on_last_rank()) {
    SY_EXPECT_THROW_MSG(
        fail_router_collective(RouterCollective::topk_route, "[topk_route] logits: bad", comms),
        std::invalid_argument, want);
  } else {
    expect_route_disagreement(aux_config(8, 2, AuxLossType::global_aux_loss), 6, 0, comms, want);
  }
  expect_route_still_in_step(comms);
  const Tensor b = Tensor::zeros({8}, DType::fp32), c = Tensor::zeros({8}, DType::int64);
  const std::string want_bias = "[update_expert_bias] on rank " + last_rank() + ": bad counts";
  if (on_last_rank()) {
    SY_EXPECT_THROW_MSG(fail_router_collective(RouterCollective::update_expert_bias, "bad counts",
                                               {&world(), nullptr}),
                        std::invalid_argument, want_bias);
  } else {
    SY_EXPECT_THROW_MSG(update_expert_bias(b, c, 1e-3, world()), std::invalid_argument, want_bias);
  }
  EXPECT_NO_THROW(update_expert_bias(b, c, 1e-3, world()));
}

// One rank: every setting agrees with itself; a collective route behaves like the local one.
TEST(AgreeMpi, OneRankRouteOverCommsEqualsLocalRoute) {
  const RouterConfig c = aux_config(8, 2, AuxLossType::aux_loss);
  const Tensor z = logits_of(6, 8);
  if (world().size() != 1) GTEST_SKIP() << "one rank only";
  const RouteResult a = topk_route(z, {}, c, {});
  const RouteResult b = topk_route(z, {}, c, {}, RouteComms{&world(), nullptr});
  EXPECT_EQ(a.aux_loss, b.aux_loss);
}

}  // namespace
}  // namespace switchyard
