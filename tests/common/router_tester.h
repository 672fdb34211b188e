// RouterTester: one router configuration, built fluently (XNNPACK's tester style), checked against
// the double-precision reference (tests/ref/router_ref.h) and for the properties topk_route
// promises:
//
//   RouterTester().tokens(257).model(kDeepSeekV3).Test();          // values against the reference
//   RouterTester().tokens(1032).model(kQwen3_30B_A3B).TestInvariance();  // threads, batch
//
// Without .dtype() a test runs fp32 and fp64 logits (the two router dtypes). Every run's
// randomness is seeded from the configuration (SY_TEST_SEED overrides it) and printed with the
// configuration on failure.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "model_shapes.h"
#include "ref/router_ref.h"
#include "router_testing.h"
#include "switchyard/router.h"
#include "testing.h"

namespace switchyard::testing {

class RouterTester : public RouterSetup<RouterTester> {
 public:
  RouterTester() : RouterSetup(8, 2, 33) {}

  /// A random N(0, 0.5) fp32 expert bias (N(0, stddev) with the argument).
  RouterTester& expert_bias(bool on = true, double stddev = 0.5) {
    bias_ = on;
    bias_stddev_ = stddev;
    return *this;
  }
  RouterTester& capacity(double factor, TokenDropPolicy policy = TokenDropPolicy::probs) {
    config_.capacity_factor = factor;
    config_.token_drop_policy = policy;
    return *this;
  }
  RouterTester& pad_to_capacity(bool on = true) { return config_.pad_to_capacity = on, *this; }
  /// A random padding mask, a quarter of the tokens padded.
  RouterTester& padding_mask(bool on = true) { return mask_ = on, *this; }
  /// Tokens per sequence (seq_aux_loss).
  RouterTester& seq_length(int64_t s) { return seq_length_ = s, *this; }
  /// Logits on a 0.5 grid (many exact ties, as bf16 logits have) instead of N(0, 2).
  RouterTester& coarse_logits(bool on = true) { return coarse_ = on, *this; }
  /// Logits dtype; unset = fp32 and fp64 in turn.
  RouterTester& dtype(DType d) { return dtype_ = d, *this; }
  /// A model's router: experts, top_k, score function, groups, scaling and (random) expert bias.
  /// Its losses are left to .aux_loss() (seq_aux_loss needs a sequence layout).
  RouterTester& model(const MoeModel& m) {
    experts(m.num_experts).top_k(m.top_k).score(m.score_function);
    groups(m.num_groups, m.group_topk).scaling(m.topk_scaling_factor);
    return expert_bias(m.expert_bias);
  }

  const RouterConfig& config() const { return config_; }

  std::string describe(DType dt) const {
    const RouterConfig& c = config_;
    std::ostringstream os;
    describe_shape(os);
    if (c.capacity_factor) {
      os << " capacity=" << *c.capacity_factor << " " << token_drop_policy_name(c.token_drop_policy)
         << (c.pad_to_capacity ? " pad" : "");
    }
    if (c.aux_loss_type != AuxLossType::none) {
      os << " " << aux_loss_type_name(c.aux_loss_type) << "=" << c.aux_loss_coeff;
    }
    if (seq_length_) os << " seq_length=" << seq_length_;
    if (c.z_loss_coeff > 0) os << " z_loss=" << c.z_loss_coeff;
    if (bias_) os << " bias";
    if (mask_) os << " mask";
    if (coarse_) os << " coarse";
    os << " " << dtype_name(dt);
    return os.str();
  }

  /// topk_route against the double reference: ids and counts exactly, weights within 2e-6 (fp32)
  /// or 1e-12 (fp64), capacity, drops, row counts and the losses; counts sum to the valid slots.
  void Test() const {
    for (DType dt : dtypes()) Test(dt);
  }

  /// topk_route on 3 tokens of zero logits (no bias, mask or state) throws std::invalid_argument
  /// whose message contains `message`, before any work.
  void TestConfigError(const std::string& message) const {
    SCOPED_TRACE(describe(DType::fp32));
    RouteOptions opt;
    opt.seq_length = seq_length_;
    const Tensor z =
        Tensor::zeros({3, config_.num_experts > 0 ? config_.num_experts : 1}, DType::fp32);
    SY_EXPECT_THROW_MSG(topk_route(z, {}, config_, opt), std::invalid_argument, message);
  }

  /// The same bits for 1 and 2 threads (ids, weights, counts, losses, grad_logits), and a token
  /// routed alone (capacity and losses off) gets bitwise its ids and weights in the batch.
  void TestInvariance() const {
    for (DType dt : dtypes()) TestInvariance(dt);
  }

 private:
  std::vector<DType> dtypes() const {
    return dtype_ ? std::vector<DType>{*dtype_} : std::vector<DType>{DType::fp32, DType::fp64};
  }

  uint64_t seed_for(DType dt) const { return test_seed(seed_ ? *seed_ : seed_of(describe(dt))); }

  struct Inputs {
    Tensor logits;
    RouteInputs in;
    ref::RefRouteInputs ref;
  };

  Inputs make_inputs(DType dt, std::mt19937_64& rng) const {
    const int64_t T = T_, E = config_.num_experts;
    Inputs s;
    if (coarse_) {
      std::normal_distribution<double> nd(0.0, 1.0);
      std::vector<double> z(static_cast<size_t>(T * E));
      for (auto& v : z) v = std::round(nd(rng) * 2.0) / 2.0;
      s.logits = Tensor::from_vector(z, {T, E}).to(dt);
    } else {
      s.logits = randn({T, E}, dt, rng, 2.0);
    }
    if (bias_) {
      s.in.expert_bias = randn({E}, DType::fp32, rng, bias_stddev_);
      s.ref.bias = s.in.expert_bias.to_double_vector();
    }
    if (mask_) {
      std::bernoulli_distribution bd(0.25);
      s.ref.padded.resize(static_cast<size_t>(T));
      s.in.padding_mask = Tensor::empty({T}, DType::boolean);
      for (int64_t t = 0; t < T; ++t) {
        s.in.padding_mask.data<bool>()[t] = bd(rng);
        s.ref.padded[t] = s.in.padding_mask.data<bool>()[t];
      }
    }
    s.ref.seq_length = seq_length_;
    return s;
  }

  void Test(DType dt) const {
    const uint64_t seed = seed_for(dt);
    SCOPED_TRACE(describe(dt) + " " + repro(seed));
    std::mt19937_64 rng(seed);
    const int64_t T = T_, E = config_.num_experts, K = config_.top_k;
    Inputs s = make_inputs(dt, rng);
    RouteOptions opt;
    opt.seq_length = seq_length_;
    GlobalAuxLossState state;
    s.in.global_aux_loss_state = &state;

    const RouteResult r = topk_route(s.logits, s.in, config_, opt);
    const ref::RefRoute want = ref::route(s.logits.to_double_vector(), T, config_, s.ref);

    ASSERT_EQ(r.topk_idx.shape(), (Shape{T, K}));
    ASSERT_EQ(r.topk_weights.dtype(), dt);
    EXPECT_TRUE(all_close(r.topk_idx, std::vector<double>(want.idx.begin(), want.idx.end()), 0, 0));
    const double tol = dt == DType::fp64 ? 1e-12 : 2e-6;
    EXPECT_TRUE(all_close(r.topk_weights, want.w, tol, tol));
    EXPECT_TRUE(all_close(r.num_tokens_per_expert,
                          std::vector<double>(want.counts.begin(), want.counts.end()), 0, 0));
    EXPECT_EQ(r.num_dropped, want.num_dropped);
    EXPECT_EQ(r.expert_capacity, want.capacity);
    EXPECT_EQ(r.num_replayed_rows, 0);
    EXPECT_EQ(r.num_native_rows, want.native);
    EXPECT_EQ(r.num_padded_rows, want.padded);
    EXPECT_NEAR(r.aux_loss, want.aux_loss, 1e-6 * std::fabs(want.aux_loss) + 1e-12);
    EXPECT_NEAR(r.z_loss, want.z_loss,
                (dt == DType::fp64 ? 1e-11 : 1e-5) * std::fabs(want.z_loss) + 1e-12);
    int64_t valid = 0, counted = 0;
    for (int64_t i = 0; i < T * K; ++i) valid += r.topk_idx.data<int32_t>()[i] >= 0;
    for (int64_t e = 0; e < E; ++e) counted += r.num_tokens_per_expert.data<int64_t>()[e];
    EXPECT_EQ(valid, counted) << "counts must sum to the valid slots";
  }

  void TestInvariance(DType dt) const {
    const uint64_t seed = seed_for(dt);
    SCOPED_TRACE(describe(dt) + " " + repro(seed));
    std::mt19937_64 rng(seed);
    const int64_t T = T_, E = config_.num_experts, K = config_.top_k;
    Inputs s = make_inputs(dt, rng);
    RouteOptions opt;
    opt.seq_length = seq_length_;
    const Tensor gw = Tensor::full({T, K}, dt, 0.3);
    const ThreadGuard guard;
    set_num_threads(1);
    const RouteResult r1 = topk_route(s.logits, s.in, config_, opt);
    const RouteGrads g1 = topk_route_backward(gw, r1);
    set_num_threads(2);
    const RouteResult r2 = topk_route(s.logits, s.in, config_, opt);
    const RouteGrads g2 = topk_route_backward(gw, r2);
    EXPECT_TRUE(bitwise_equal(r1.topk_idx, r2.topk_idx));
    EXPECT_TRUE(bitwise_equal(r1.topk_weights, r2.topk_weights));
    EXPECT_TRUE(bitwise_equal(r1.num_tokens_per_expert, r2.num_tokens_per_expert));
    EXPECT_EQ(r1.aux_loss, r2.aux_loss);
    EXPECT_EQ(r1.z_loss, r2.z_loss);
    EXPECT_TRUE(bitwise_equal(g1.grad_logits, g2.grad_logits));
    // Batch invariance holds without capacity (which couples tokens) and losses.
    RouterConfig alone = config_;
    alone.capacity_factor.reset();
    alone.pad_to_capacity = false;
    alone.aux_loss_type = AuxLossType::none;
    RouteInputs in = s.in;
    in.padding_mask = Tensor();
    const RouteResult batch = topk_route(s.logits, in, alone);
    for (int64_t t : {int64_t{0}, T / 2, T - 1}) {
      const Tensor one =
          Tensor::borrow(static_cast<char*>(s.logits.raw()) + t * E * dtype_size(dt), {1, E}, dt);
      const RouteResult r = topk_route(one, in, alone);
      for (int64_t k = 0; k < K; ++k) {
        EXPECT_EQ(r.topk_idx.data<int32_t>()[k], batch.topk_idx.data<int32_t>()[t * K + k])
            << "token " << t << " slot " << k;
        EXPECT_EQ(r.topk_weights.item_as_double(k), batch.topk_weights.item_as_double(t * K + k))
            << "token " << t << " slot " << k;
      }
    }
  }

  bool bias_ = false;
  double bias_stddev_ = 0.5;
  bool mask_ = false;
  bool coarse_ = false;
  int64_t seq_length_ = 0;
  std::optional<DType> dtype_;
};

}  // namespace switchyard::testing
