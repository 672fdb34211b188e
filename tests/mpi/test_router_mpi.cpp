// Cross-rank loss statistics of topk_route (registered for 1, 2, 3 and 4 ranks): with the world
// communicator as Megatron's tp_cp and tp_dp_cp groups, a global batch split unevenly over the
// ranks gives on every rank bitwise the ids, weights and gradient rows of one process routing the
// whole batch, the same global aux-loss state, and per-rank aux losses that add up to the one
// process's loss (even and uneven splits, fp64 and fp32 logits: one named case each). A bad
// argument on one rank makes every rank throw.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ep_testing.h"
#include "switchyard/router.h"
#include "testing.h"

namespace switchyard {
namespace {

using testing::bitwise_equal;
using testing::rows;
using testing::sum_over_ranks;
using testing::test_seed;
using testing::world;

enum class Split { uneven, even };

// Rank r's token range of T: even, or uneven (rank r gets about (r+1) shares; the last rank may be
// empty when T is small).
std::pair<int64_t, int64_t> split_rows(int64_t T, int rank, int size, Split split) {
  if (split == Split::even) return {T * rank / size, T * (rank + 1) / size};
  const int64_t shares = int64_t(size) * (size + 1) / 2;
  int64_t b = 0;
  for (int r = 0; r < rank; ++r) b += T * (r + 1) / shares;
  const int64_t len = rank == size - 1 ? T - b : T * (rank + 1) / shares;
  return {b, b + len};
}

// One split of the global batch and one logits dtype: two steps of sigmoid top-2 of 16 with
// aux_loss and global_aux_loss (and, on even splits, the z-loss) over the world communicator.
void expect_loss_statistics_match_one_process(Split split, DType dt) {
  auto& w = world();
  const bool even = split == Split::even;
  const int64_t E = 16, K = 2;
  const int64_t T = even ? 12 * w.size() : 53;
  std::mt19937_64 rng(test_seed(1441));
  const Tensor z = testing::randn({T, E}, dt, rng, 1.5);
  const Tensor gw = testing::randn({T, K}, dt, rng);
  RouterConfig c;
  c.num_experts = E;
  c.top_k = K;
  c.score_function = ScoreFunction::sigmoid;
  c.aux_loss_types = {AuxLossType::aux_loss, AuxLossType::global_aux_loss};
  c.aux_loss_coeffs = {0.3, 0.2};
  if (even) c.z_loss_coeff = 0.1;  // Megatron's z-loss is a per-rank mean: equal splits only
  GlobalAuxLossState g1, gp;
  RouteInputs in1, inp;
  in1.global_aux_loss_state = &g1;
  inp.global_aux_loss_state = &gp;
  const auto [b, e] = split_rows(T, w.rank(), w.size(), split);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const RouteResult one = topk_route(z, in1, c);
    const RouteResult part = topk_route(rows(z, b, e), inp, c, {}, RouteComms{&w, &w});
    EXPECT_TRUE(bitwise_equal(part.topk_idx, rows(one.topk_idx, b, e)));
    EXPECT_TRUE(bitwise_equal(part.topk_weights, rows(one.topk_weights, b, e)));
    EXPECT_TRUE(bitwise_equal(gp.num_tokens_per_expert, g1.num_tokens_per_expert));
    EXPECT_EQ(gp.steps, g1.steps);
    const double total = sum_over_ranks(part.aux_loss);
    EXPECT_NEAR(total, one.aux_loss, 1e-12 * one.aux_loss + (dt == DType::fp32 ? 1e-9 : 0));
    if (even) {
      EXPECT_NEAR(sum_over_ranks(part.z_loss), one.z_loss, 1e-6 * one.z_loss);
    }
    const Tensor g_one = topk_route_backward(gw, one).grad_logits;
    const Tensor g_part = topk_route_backward(rows(gw, b, e), part).grad_logits;
    if (!even) {
      EXPECT_TRUE(bitwise_equal(g_part, rows(g_one, b, e)));
    } else {  // the z-loss coefficient is coeff / size over local means: equal up to rounding
      EXPECT_TRUE(testing::all_close(g_part, rows(g_one, b, e).to_double_vector(), 1e-12,
                                     dt == DType::fp32 ? 1e-5 : 1e-12));
    }
  }
}

#define SY_LOSS_STATISTICS_CASES(Name, Split)                                                   \
  TEST(RouterMpi, Name##Fp64) { expect_loss_statistics_match_one_process(Split, DType::fp64); } \
  TEST(RouterMpi, Name##Fp32) { expect_loss_statistics_match_one_process(Split, DType::fp32); }

SY_LOSS_STATISTICS_CASES(LossStatisticsOverAnUnevenSplitMatchOneProcess, Split::uneven)
SY_LOSS_STATISTICS_CASES(LossStatisticsAndZLossOverAnEvenSplitMatchOneProcess, Split::even)

TEST(RouterMpi, BadArgumentOnOneRankThrowsOnEveryRank) {
  auto& w = world();
  const int64_t E = 8, K = 2;
  RouterConfig c;
  c.num_experts = E;
  c.top_k = K;
  c.aux_loss_type = AuxLossType::aux_loss;
  c.aux_loss_coeff = 0.1;
  Tensor z = Tensor::zeros({5, E}, DType::fp32);
  if (w.rank() == 0) z.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  try {
    topk_route(z, {}, c, {}, RouteComms{&w, nullptr});
    ADD_FAILURE() << "no error on rank " << w.rank();
  } catch (const std::invalid_argument& e) {
    // The same error on every rank: the failing rank's, naming it (one rank: its own error).
    const std::string msg = e.what();
    EXPECT_NE(msg.find(std::string(w.size() > 1 ? "[route] on rank 0: " : "") +
                       "[route] logits must be finite"),
              std::string::npos)
        << msg;
  }
  // The communicator is still usable afterwards (no rank left inside a collective).
  EXPECT_NO_THROW(topk_route(Tensor::zeros({5, E}, DType::fp32), {}, c, {}, RouteComms{&w, &w}));
}

// Expert-bias update with the counts summed over the ranks (Megatron's tp_dp_cp all-reduce):
// every rank gets the bias of one update on the summed counts.
TEST(RouterMpi, ExpertBiasUpdateSumsCountsOverRanks) {
  auto& w = world();
  const int64_t E = 8;
  Tensor bias = Tensor::zeros({E}, DType::fp32);
  for (int64_t e = 0; e < E; ++e) bias.data<float>()[e] = 0.01f * static_cast<float>(e);
  auto counts_of = [&](int r) {
    Tensor c = Tensor::empty({E}, DType::int64);
    for (int64_t e = 0; e < E; ++e) c.data<int64_t>()[e] = (e * 7 + r * 5) % 11 + (e == r ? 9 : 0);
    return c;
  };
  Tensor total = Tensor::zeros({E}, DType::int64);
  for (int r = 0; r < w.size(); ++r) {
    const Tensor c = counts_of(r);
    for (int64_t e = 0; e < E; ++e) total.data<int64_t>()[e] += c.data<int64_t>()[e];
  }
  const Tensor got = update_expert_bias(bias, counts_of(w.rank()), 1e-3, w);
  EXPECT_TRUE(bitwise_equal(got, update_expert_bias(bias, total, 1e-3)));
  SY_EXPECT_THROW_MSG(
      update_expert_bias(bias, w.rank() == 0 ? Tensor::zeros({E + 1}, DType::int64) : total, 1e-3,
                         w),
      std::invalid_argument,
      std::string(w.size() > 1 ? "[update_expert_bias] on rank 0: " : "") +
          "[update_expert_bias] num_tokens_per_expert");
}

}  // namespace
}  // namespace switchyard
