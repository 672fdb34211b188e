// ReplayTester: router replay for one router configuration, built fluently:
//
//   ReplayTester().score(ScoreFunction::sigmoid).groups(8, 4).capacity(1.0).TestRecordedRoutes();
//
// TestRecordedRoutes: the ids a native forward selected (before capacity), replayed on the same
// logits, reproduce ids, weights, counts, losses and grad_logits bit for bit.
// TestReplacedRows: replaying other ids on a few rows changes exactly those rows (ids as given,
// weights from the live logits against the double reference); every other row keeps its native
// weights and gradient bit for bit.
// Without .dtype() TestRecordedRoutes runs fp32 and fp64 logits; TestReplacedRows runs fp64.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ref/router_ref.h"
#include "router_tester.h"
#include "router_testing.h"
#include "switchyard/router.h"
#include "testing.h"

namespace switchyard::testing {

class ReplayTester : public RouterSetup<ReplayTester> {
 public:
  ReplayTester() : RouterSetup(64, 8, 301) {}

  ReplayTester& capacity(double factor) { return config_.capacity_factor = factor, *this; }
  ReplayTester& dtype(DType d) { return dtype_ = d, *this; }

  std::string describe(DType dt) const {
    const RouterConfig& c = config_;
    std::ostringstream os;
    describe_shape(os);
    if (c.capacity_factor) os << " capacity=" << *c.capacity_factor;
    if (c.aux_loss_type != AuxLossType::none) {
      os << " " << aux_loss_type_name(c.aux_loss_type) << "=" << c.aux_loss_coeff;
    }
    if (c.z_loss_coeff > 0) os << " z_loss=" << c.z_loss_coeff;
    os << " " << dtype_name(dt);
    return os.str();
  }

  void TestRecordedRoutes() const {
    for (DType dt :
         dtype_ ? std::vector<DType>{*dtype_} : std::vector<DType>{DType::fp32, DType::fp64}) {
      TestRecordedRoutes(dt);
    }
  }

  void TestReplacedRows() const {
    const DType dt = dtype_.value_or(DType::fp64);
    const uint64_t seed = test_seed(seed_ ? *seed_ : seed_of("replaced " + describe(dt)));
    SCOPED_TRACE(describe(dt) + " " + repro(seed));
    ASSERT_FALSE(config_.capacity_factor) << "capacity couples rows; not a property of replay";
    const int64_t T = T_, E = config_.num_experts, K = config_.top_k;
    ASSERT_GE(E, 2 * K) << "the replaced rows use ids E-1, E-3, ...";
    std::mt19937_64 rng(seed);
    const Tensor z = randn({T, E}, dt, rng);
    const Tensor gw = randn({T, K}, dt, rng);
    // Rows 3, 17 and T-1 replay experts outside the native choice (and outside the best groups):
    // the bias keeps them out of every native selection.
    const std::vector<int64_t> changed = {3, 17, T - 1};
    Tensor ids = Tensor::full({T, K}, DType::int32, -1);
    RouteInputs in;
    in.expert_bias = Tensor::full({E}, DType::fp32, 0.0);
    for (int64_t k = 0; k < K; ++k) in.expert_bias.data<float>()[E - 1 - 2 * k] = -100.0f;
    for (int64_t t : changed) {
      for (int64_t k = 0; k < K; ++k) {
        ids.data<int32_t>()[t * K + k] = static_cast<int32_t>(E - 1 - 2 * k);
      }
    }
    RouteInputs native_in = in;
    in.replay_idx = ids;
    const RouteResult native = topk_route(z, native_in, config_);
    const RouteResult r = topk_route(z, in, config_);
    EXPECT_EQ(r.num_replayed_rows, static_cast<int64_t>(changed.size()));
    EXPECT_EQ(r.num_native_rows, T - static_cast<int64_t>(changed.size()));
    const Tensor gn = topk_route_backward(gw, native).grad_logits;
    const Tensor gr = topk_route_backward(gw, r).grad_logits;
    ref::RefRouteInputs rin;
    rin.replay = std::vector<int32_t>(ids.data<int32_t>(), ids.data<int32_t>() + T * K);
    rin.bias = in.expert_bias.to_double_vector();
    const ref::RefRoute want = ref::route(z.to_double_vector(), T, config_, rin);
    EXPECT_TRUE(all_close(r.topk_idx, std::vector<double>(want.idx.begin(), want.idx.end()), 0, 0));
    const double tol = dt == DType::fp64 ? 1e-12 : 2e-6;
    EXPECT_TRUE(all_close(r.topk_weights, want.w, tol, tol));
    for (int64_t t = 0; t < T; ++t) {
      const bool is_changed = std::find(changed.begin(), changed.end(), t) != changed.end();
      bool same_w = true, same_g = true;
      for (int64_t k = 0; k < K; ++k) {
        same_w = same_w && r.topk_weights.item_as_double(t * K + k) ==
                               native.topk_weights.item_as_double(t * K + k);
        if (is_changed) {
          EXPECT_EQ(r.topk_idx.data<int32_t>()[t * K + k], E - 1 - 2 * k) << "token " << t;
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        same_g = same_g && gr.item_as_double(t * E + e) == gn.item_as_double(t * E + e);
      }
      // Unchanged rows: bitwise the native weights; their gradients too, also through the aux
      // loss, whose counts ignore replay.
      if (!is_changed) {
        EXPECT_TRUE(same_w) << "token " << t;
        EXPECT_TRUE(same_g) << "token " << t;
      } else {
        EXPECT_FALSE(same_g) << "token " << t;
      }
    }
  }

 private:
  void TestRecordedRoutes(DType dt) const {
    const uint64_t seed = test_seed(seed_ ? *seed_ : seed_of("recorded " + describe(dt)));
    SCOPED_TRACE(describe(dt) + " " + repro(seed));
    const int64_t T = T_, E = config_.num_experts, K = config_.top_k;
    std::mt19937_64 rng(seed);
    const Tensor z = randn({T, E}, dt, rng);
    const Tensor gw = randn({T, K}, dt, rng);
    RouteInputs native_in;
    native_in.expert_bias = randn({E}, DType::fp32, rng, 0.1);
    const RouteResult native = topk_route(z, native_in, config_);
    RouteInputs in = native_in;
    in.replay_idx = selected_before_capacity(z, native_in);
    const RouteResult replayed = topk_route(z, in, config_);
    EXPECT_EQ(replayed.num_replayed_rows, T);
    EXPECT_EQ(replayed.num_native_rows, 0);
    EXPECT_EQ(native.num_replayed_rows, 0);
    EXPECT_EQ(native.num_native_rows, T);
    EXPECT_TRUE(bitwise_equal(replayed.topk_idx, native.topk_idx));
    EXPECT_TRUE(bitwise_equal(replayed.topk_weights, native.topk_weights));
    EXPECT_TRUE(bitwise_equal(replayed.num_tokens_per_expert, native.num_tokens_per_expert));
    EXPECT_EQ(replayed.aux_loss, native.aux_loss);
    EXPECT_EQ(replayed.z_loss, native.z_loss);
    const RouteGrads g1 = topk_route_backward(gw, native);
    const RouteGrads g2 = topk_route_backward(gw, replayed);
    EXPECT_TRUE(bitwise_equal(g1.grad_logits, g2.grad_logits));
  }

  /// The ids a native forward chooses before capacity drops (what a rollout records): the same
  /// route without capacity (selection is per token).
  Tensor selected_before_capacity(const Tensor& logits, const RouteInputs& in) const {
    RouterConfig no_capacity = config_;
    no_capacity.capacity_factor.reset();
    no_capacity.pad_to_capacity = false;
    return topk_route(logits, in, no_capacity).topk_idx.clone();
  }

  std::optional<DType> dtype_;
};

}  // namespace switchyard::testing
