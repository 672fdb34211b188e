// DispatchTester: expert-parallel dispatch over the world communicator (tests/mpi, 1-4 ranks) for
// one configuration, built fluently:
//
//   DispatchTester().routes(Routes::one_rank).experts(12).top_k(3).hidden(21).dtype(DType::bf16)
//       .kind(DispatcherKind::all_gather).weights(WeightMode::skip).TestMatchesEpOne();
//
// Every rank builds the same global batch from the configuration's seed and dispatches its own
// rows; the EP = 1 results (routing plan + permute / unpermute on the whole batch, computed on
// every rank) and the double references of tests/ref are the peers. Payload columns 0 and 1 encode
// (source rank, token), so every received row's origin and destination is checked.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ep_testing.h"
#include "permute_tester.h"
#include "ref/dispatch_ref.h"
#include "switchyard/dispatcher.h"
#include "testing.h"

namespace switchyard::testing {

/// How the global batch routes: replay routes (random_routes: zero-filled padding rows, -1 rows and
/// slots, repeated ids, random ids), every slot to one expert, every slot to the last rank's
/// experts, or replay routes with no tokens on the last rank.
enum class Routes { replay, one_expert, one_rank, zero_token_rank };

inline const char* routes_name(Routes r) {
  switch (r) {
    case Routes::replay:
      return "replay";
    case Routes::one_expert:
      return "one_expert";
    case Routes::one_rank:
      return "one_rank";
    case Routes::zero_token_rank:
      return "zero_token_rank";
  }
  return "?";
}

/// The global batch of P ranks, identical on every rank: rank r has T[r] tokens, rows
/// [tok_off[r], tok_off[r + 1]) of x [N, H], idx [N, K] and w [N, K].
struct GlobalBatch {
  int64_t P, E, K, H;
  DType dtype;
  std::vector<int64_t> T, tok_off;
  Tensor x, idx, w;

  int64_t begin(int64_t r) const { return tok_off[static_cast<size_t>(r)]; }
  int64_t end(int64_t r) const { return tok_off[static_cast<size_t>(r + 1)]; }

  /// Rank r's rows of x, idx and w, copied.
  struct Rows {
    Tensor x, idx, w;
  };
  Rows of(int64_t r) const {
    return {rows(x, begin(r), end(r)), rows(idx, begin(r), end(r)), rows(w, begin(r), end(r))};
  }
};

inline GlobalBatch make_global_batch(int64_t P, int64_t E, int64_t K, int64_t H, DType dtype,
                                     Routes routes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  GlobalBatch g{P, E, K, H, dtype, {}, {0}, {}, {}, {}};
  std::uniform_int_distribution<int> tdist(0, 40);
  for (int64_t r = 0; r < P; ++r) {
    int64_t T = tdist(rng) + r * 3;  // T differs per rank
    if (routes == Routes::zero_token_rank && r == P - 1) T = 0;
    g.T.push_back(T);
    g.tok_off.push_back(g.tok_off.back() + T);
  }
  const int64_t N = g.tok_off.back();
  std::vector<double> xv(static_cast<size_t>(N * H));
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int64_t r = 0; r < P; ++r) {
    for (int64_t t = 0; t < g.T[static_cast<size_t>(r)]; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        // Columns 0 and 1 encode (source rank, token): small integers, exact in bf16.
        xv[static_cast<size_t>((g.begin(r) + t) * H + h)] = h == 0 ? r : h == 1 ? t : nd(rng);
      }
    }
  }
  g.x = Tensor::from_vector(xv, {N, H}).to(DType::fp32).to(dtype);
  // Replay routes as permute_tester.h draws them, or every slot to one expert / to the last
  // rank's experts.
  std::vector<int32_t> idx = random_routes(N, K, E, rng);
  const int64_t L = E / P;
  std::uniform_int_distribution<int64_t> last_rank_expert((P - 1) * L, P * L - 1);
  for (int32_t& v : idx) {
    if (routes == Routes::one_expert) v = static_cast<int32_t>(E / 2);
    if (routes == Routes::one_rank) v = static_cast<int32_t>(last_rank_expert(rng));
  }
  const std::vector<float> w = random_weights(N * K, rng, 0.05f);
  g.idx = Tensor::from_vector(idx, {N, K});
  g.w = Tensor::from_vector(w, {N, K});
  return g;
}

/// A deterministic row-wise "expert": Y[i] = x[i] * (1 + e/8) + e/4 in fp32, stored in x's dtype.
inline Tensor expert_fn(const Tensor& x, const std::vector<int64_t>& expert_of_row) {
  Tensor out = Tensor::empty(x.shape(), DType::fp32);
  auto xv = x.to_double_vector();
  float* o = out.data<float>();
  const int64_t H = x.size(1);
  for (int64_t i = 0; i < x.size(0); ++i) {
    const float e = static_cast<float>(expert_of_row[static_cast<size_t>(i)]);
    for (int64_t h = 0; h < H; ++h) {
      o[i * H + h] =
          static_cast<float>(xv[static_cast<size_t>(i * H + h)]) * (1.0f + e / 8.0f) + e / 4.0f;
    }
  }
  return out.to(x.dtype());
}

/// The global expert of every received row (padding rows included), from the handle's offsets.
inline std::vector<int64_t> received_experts(const dist::DispatchHandle& h) {
  std::vector<int64_t> out(static_cast<size_t>(h.num_recv_tokens()));
  const int64_t* off = h.expert_offsets().data<int64_t>();
  const int64_t L = h.num_local_experts();
  for (int64_t el = 0; el < L; ++el)
    for (int64_t i = off[el]; i < off[el + 1]; ++i) out[static_cast<size_t>(i)] = h.rank() * L + el;
  return out;
}

/// The rows of `t` [R, ...] whose received row is real (source rank >= 0), in order.
inline Tensor real_rows(const Tensor& t, const dist::DispatchHandle& h) {
  const int32_t* src = h.recv_src_rank().data<int32_t>();
  std::vector<int64_t> keep;
  for (int64_t i = 0; i < h.num_recv_tokens(); ++i) {
    if (src[i] >= 0) keep.push_back(i);
  }
  const int64_t n = static_cast<int64_t>(keep.size());
  Shape shape = t.shape();
  shape[0] = n;
  Tensor out = Tensor::empty(shape, t.dtype());
  const size_t rb = t.nbytes() / static_cast<size_t>(std::max<int64_t>(t.size(0), 1));
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(static_cast<unsigned char*>(out.raw()) + i * rb,
                static_cast<const unsigned char*>(t.raw()) + keep[static_cast<size_t>(i)] * rb, rb);
  }
  return out;
}

class DispatchTester {
 public:
  DispatchTester& routes(Routes r) { return routes_ = r, *this; }
  DispatchTester& experts(int64_t E) { return E_ = E, *this; }
  DispatchTester& top_k(int64_t K) { return K_ = K, *this; }
  DispatchTester& hidden(int64_t H) { return H_ = H, *this; }
  DispatchTester& dtype(DType dt) { return dtype_ = dt, *this; }
  DispatchTester& kind(dist::DispatcherKind k) { return kind_ = k, *this; }
  DispatchTester& weights(WeightMode m) { return mode_ = m, *this; }
  /// Megatron-Core's routing-map padding: every source's block of every expert rounded up to a
  /// multiple of `alignment`; with `capacity` >= 0 tokens past it are dropped (by position), and
  /// `pad_to_capacity` pads every block to the capacity.
  DispatchTester& padding(int64_t alignment, int64_t capacity = -1, bool pad_to_capacity = false) {
    alignment_ = alignment;
    capacity_ = capacity;
    pad_to_capacity_ = pad_to_capacity;
    return *this;
  }
  DispatchTester& seed(uint64_t s) { return seed_ = s, *this; }

  /// "replay E=12 K=4 H=16 fp32 all_to_all apply[ align=4 capacity=3 pad_to_capacity] EP=2".
  std::string describe() const {
    return batch_description() + " " + kind_name(kind_) + " " +
           (mode_ == WeightMode::apply ? "apply" : "skip");
  }

  /// dispatch, the experts, combine and the three backwards on this rank's rows, each output
  /// bitwise the EP = 1 computation's rows; every received row comes from the (rank, token) its
  /// payload names, and that token routes to the row's expert, which is this rank's. Both kinds
  /// see the same batch, so their two cases also prove that all_gather and all_to_all agree
  /// bitwise.
  void TestMatchesEpOne() const {
    const uint64_t seed = seed_for("ep_one");
    SCOPED_TRACE(context(seed));
    run_and_check(batch(seed), kind_, seed);
  }

  /// combine(experts(dispatch(x))) against its definition in double, sum_k w[t,k] * f_e(x[t]),
  /// within 1e-5 (padding without capacity: every pair kept); every expert block is a multiple of
  /// the alignment.
  void TestCombineMatchesDoubleReference() const {
    const uint64_t seed = seed_for("combine_double");
    SCOPED_TRACE(context(seed));
    const GlobalBatch g = batch(seed);
    dist::Dispatcher disp(world_ptr());
    const int64_t me = world().rank(), b = g.begin(me), T = g.T[static_cast<size_t>(me)];
    const GlobalBatch::Rows mine = g.of(me);
    const dist::DispatchResult d = disp.dispatch(mine.x, mine.idx, mine.w, options());
    const Tensor y = disp.combine(expert_fn(d.recv_x, received_experts(d.handle)), d.handle, mode_);
    std::vector<int32_t> idx(g.idx.data<int32_t>() + b * g.K,
                             g.idx.data<int32_t>() + (b + T) * g.K);
    std::vector<float> w(g.w.data<float>() + b * g.K, g.w.data<float>() + (b + T) * g.K);
    const auto pairs = ref::token_pairs(idx, w, T, g.K);
    const auto xv = mine.x.to_double_vector();
    std::vector<double> want(static_cast<size_t>(T * g.H), 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (const auto& p : pairs[static_cast<size_t>(t)])
        for (int64_t q = 0; q < g.H; ++q)
          want[static_cast<size_t>(t * g.H + q)] +=
              (mode_ == WeightMode::apply ? p.weight : 1.0) *
              (xv[static_cast<size_t>(t * g.H + q)] * (1.0 + p.expert / 8.0) + p.expert / 4.0);
    EXPECT_TRUE(all_close(y, want, 1e-5, 1e-5));
    for (int64_t el = 0; el < d.handle.num_local_experts(); ++el)
      EXPECT_EQ(d.handle.num_tokens_per_expert().data<int64_t>()[el] % alignment_, 0);
  }

  /// <dispatch(x), Y> = <x, dispatch_backward(Y)> and <combine(Y), g> = <Y, combine_backward(g)>,
  /// each side summed over all ranks.
  void TestAdjoints() const {
    const uint64_t seed = seed_for("adjoints");
    SCOPED_TRACE(context(seed));
    const GlobalBatch g = batch(seed);
    dist::Dispatcher disp(world_ptr());
    const int64_t me = world().rank(), b = g.begin(me), e = g.end(me);
    const GlobalBatch::Rows mine = g.of(me);
    const dist::DispatchResult d = disp.dispatch(mine.x, mine.idx, mine.w, options());
    std::mt19937_64 rng(seed + 100 + static_cast<uint64_t>(me));
    const Tensor Y = randn({d.handle.num_recv_tokens(), g.H}, g.dtype, rng);
    const Tensor gy = randn({e - b, g.H}, g.dtype, rng);
    const double l1 = sum_over_ranks(local_dot(d.recv_x, Y));
    const double r1 = sum_over_ranks(local_dot(mine.x, disp.dispatch_backward(Y, d.handle)));
    EXPECT_NEAR(l1, r1, 1e-4 * (1 + std::fabs(l1)));
    const double l2 = sum_over_ranks(local_dot(disp.combine(Y, d.handle, mode_), gy));
    const double r2 =
        sum_over_ranks(local_dot(Y, disp.combine_backward(gy, Y, d.handle, mode_).grad_expert_y));
    EXPECT_NEAR(l2, r2, 1e-4 * (1 + std::fabs(l2)));
  }

  /// recv_topk_weights[row] is the sum of its slots' weights, so for any g:
  /// sum_rows g[row] * recv_w[row] = sum_{t,k} dispatch_weights_backward(g)[t,k] * w[t,k], each
  /// side summed over all ranks; merged repeated ids get the row's gradient in every slot, -1
  /// slots get 0.
  void TestWeightsBackwardAdjoint() const {
    const uint64_t seed = seed_for("weights_backward");
    SCOPED_TRACE(context(seed));
    const GlobalBatch g = batch(seed);
    dist::Dispatcher disp(world_ptr());
    const int64_t me = world().rank(), b = g.begin(me), e = g.end(me);
    const GlobalBatch::Rows mine = g.of(me);
    const Tensor &w = mine.w, &my_idx = mine.idx;
    const dist::DispatchResult d = disp.dispatch(mine.x, my_idx, w, options());
    std::mt19937_64 rng(seed + 200 + static_cast<uint64_t>(me));
    const Tensor gr = randn({d.handle.num_recv_tokens()}, DType::fp32, rng);
    const Tensor gw = disp.dispatch_weights_backward(gr, d.handle);
    EXPECT_EQ(gw.shape(), (Shape{e - b, g.K}));
    const double lhs = sum_over_ranks(local_dot(d.recv_topk_weights, gr));
    const double rhs = sum_over_ranks(local_dot(w, gw));
    EXPECT_NEAR(lhs, rhs, 1e-4 * (1 + std::fabs(lhs)));
    const int32_t* idx = my_idx.data<int32_t>();
    for (int64_t i = 0; i < std::min(gw.numel(), my_idx.numel()); ++i) {
      if (idx[i] < 0) {
        EXPECT_EQ(gw.data<float>()[i], 0.0f) << "slot " << i;
      }
    }
  }

  /// A kept Dispatcher gives the bits of a fresh Dispatcher per call over three steps, and its
  /// scratch stops growing once it has seen the largest step (steady state: no fresh buffers).
  void TestDispatcherReusesItsScratch() const {
    const uint64_t seed = seed_for("scratch");
    SCOPED_TRACE(context(seed));
    const GlobalBatch g = batch(seed);
    dist::Dispatcher disp(world_ptr());
    const GlobalBatch::Rows mine = g.of(world().rank());
    const dist::DispatchOptions opt = options();
    int64_t scratch = -1;
    for (int step = 0; step < 3; ++step) {
      const dist::DispatchResult d = disp.dispatch(mine.x, mine.idx, mine.w, opt);
      const dist::DispatchResult f = fresh_dispatcher().dispatch(mine.x, mine.idx, mine.w, opt);
      EXPECT_TRUE(bitwise_equal(d.recv_x, f.recv_x)) << "step " << step;
      const Tensor y = disp.combine(d.recv_x, d.handle, mode_);
      EXPECT_TRUE(bitwise_equal(y, fresh_dispatcher().combine(f.recv_x, f.handle, mode_)))
          << "step " << step;
      const dist::CombineGrads cg = disp.combine_backward(y, d.recv_x, d.handle, mode_);
      const dist::CombineGrads fg =
          fresh_dispatcher().combine_backward(y, f.recv_x, f.handle, mode_);
      EXPECT_TRUE(bitwise_equal(cg.grad_expert_y, fg.grad_expert_y)) << "step " << step;
      EXPECT_TRUE(bitwise_equal(cg.grad_topk_weights, fg.grad_topk_weights)) << "step " << step;
      if (step > 0) {
        EXPECT_EQ(disp.scratch_bytes(), scratch) << "step " << step;
      }
      scratch = disp.scratch_bytes();
    }
  }

  /// With the configured padding: each source's block of every local expert is that source's
  /// padded block as permute lays it out (real rows, then zero rows of weight 0 and source -1),
  /// the counts are Megatron's (padded and unpadded), the real rows are the unpadded dispatch's;
  /// with experts that give padding rows non-zero outputs, combine and the backwards give the
  /// unpadded path's bits, and the gradient of every padding row is zero.
  void TestPaddingMatchesUnpadded() const {
    const uint64_t seed = seed_for("padding");
    SCOPED_TRACE(context(seed));
    const GlobalBatch g = batch(seed);
    dist::Communicator& c = world();
    dist::Dispatcher disp(world_ptr());
    const int64_t P = c.size(), me = c.rank(), E = g.E, L = E / P, H = g.H;
    dist::DispatchOptions plain = options();
    plain.plan.expert_alignment = 1;
    plain.plan.pad_to_capacity = false;
    const dist::DispatchOptions padded = options();
    const GlobalBatch::Rows mine = g.of(me);
    const dist::DispatchResult u = disp.dispatch(mine.x, mine.idx, mine.w, plain);
    const dist::DispatchResult d = disp.dispatch(mine.x, mine.idx, mine.w, padded);
    const dist::DispatchHandle& h = d.handle;

    // The layout: local expert el's block is, for each source s, s's padded block of that
    // expert as permute lays it out (real rows, then zero rows).
    std::vector<RoutingPlan> plans;
    std::vector<Tensor> perms;
    for (int64_t s = 0; s < P; ++s) {
      const GlobalBatch::Rows theirs = g.of(s);
      plans.push_back(build_routing_plan(theirs.idx, theirs.w, E, padded.plan));
      perms.push_back(permute(theirs.x, plans.back()));
    }
    std::vector<Tensor> want_x, want_w;
    std::vector<int64_t> want_src;
    for (int64_t el = 0; el < L; ++el) {
      const int64_t e = me * L + el;
      int64_t n_rows = 0, n_real = 0;
      for (int64_t s = 0; s < P; ++s) {
        const RoutingPlan& ps = plans[static_cast<size_t>(s)];
        const Tensor& perm = perms[static_cast<size_t>(s)];
        const int64_t* off = ps.expert_offsets.data<int64_t>();
        const int64_t n = ps.num_tokens_per_expert.data<int64_t>()[e];
        EXPECT_EQ(off[e + 1] - off[e],
                  ref::padded_block_rows(n, alignment_, capacity_, pad_to_capacity_))
            << "source " << s << " expert " << e;
        want_x.push_back(rows(perm, off[e], off[e + 1]));
        want_w.push_back(rows(ps.row_weight.reshape({ps.num_rows, 1}), off[e], off[e + 1]));
        for (int64_t r = off[e]; r < off[e + 1]; ++r)
          want_src.push_back(ps.row_token.data<int64_t>()[r] < 0 ? -1 : s);
        n_rows += off[e + 1] - off[e];
        n_real += n;
      }
      EXPECT_EQ(h.num_tokens_per_expert().data<int64_t>()[el], n_rows);
      EXPECT_EQ(h.num_tokens_per_expert().data<int64_t>()[el] % alignment_, 0);
      EXPECT_EQ(h.num_unpadded_tokens_per_expert().data<int64_t>()[el], n_real);
      EXPECT_EQ(h.num_unpadded_tokens_per_expert().data<int64_t>()[el],
                u.handle.num_tokens_per_expert().data<int64_t>()[el]);
    }
    // A wrong row count is reported, and the layout checks below are skipped (they would read
    // past the received rows); the collectives after them still run on every rank.
    const bool layout_ok = static_cast<int64_t>(want_src.size()) == h.num_recv_tokens();
    EXPECT_TRUE(layout_ok) << "want " << want_src.size() << " received rows, got "
                           << h.num_recv_tokens();
    if (layout_ok) {
      int64_t at = 0;
      for (size_t i = 0; i < want_x.size(); ++i) {
        const int64_t n = want_x[i].size(0);
        EXPECT_TRUE(bitwise_equal(rows(d.recv_x, at, at + n), want_x[i])) << "block " << i;
        EXPECT_TRUE(bitwise_equal(
            rows(d.recv_topk_weights.reshape({h.num_recv_tokens(), 1}), at, at + n), want_w[i]))
            << "block " << i;
        at += n;
      }
      for (int64_t i = 0; i < h.num_recv_tokens(); ++i) {
        EXPECT_EQ(h.recv_src_rank().data<int32_t>()[i], want_src[static_cast<size_t>(i)])
            << "row " << i;
      }
    }
    // Real rows are the unpadded dispatch's, bit for bit.
    EXPECT_TRUE(bitwise_equal(real_rows(d.recv_x, h), u.recv_x));
    EXPECT_TRUE(bitwise_equal(real_rows(h.recv_src_token().reshape({h.num_recv_tokens(), 1}), h),
                              u.handle.recv_src_token().reshape({u.handle.num_recv_tokens(), 1})));

    // Experts that give padding rows non-zero outputs: combine and the backwards must not read
    // them. Every result equals the unpadded path's bitwise.
    const Tensor Y = expert_fn(d.recv_x, received_experts(h));
    const Tensor UY = expert_fn(u.recv_x, received_experts(u.handle));
    const Tensor y = disp.combine(Y, h, mode_);
    EXPECT_TRUE(bitwise_equal(y, disp.combine(UY, u.handle, mode_)));
    std::mt19937_64 rng(seed + 9 + static_cast<uint64_t>(me));
    const Tensor gy = randn({g.end(me) - g.begin(me), H}, g.dtype, rng);
    const dist::CombineGrads cg = disp.combine_backward(gy, Y, h, mode_);
    const dist::CombineGrads ug = disp.combine_backward(gy, UY, u.handle, mode_);
    EXPECT_TRUE(bitwise_equal(cg.grad_topk_weights, ug.grad_topk_weights));
    EXPECT_TRUE(bitwise_equal(real_rows(cg.grad_expert_y, h), ug.grad_expert_y));
    const auto ge = cg.grad_expert_y.to_double_vector();
    for (int64_t i = 0; i < h.num_recv_tokens(); ++i) {
      if (h.recv_src_rank().data<int32_t>()[i] >= 0) continue;
      for (int64_t q = 0; q < H; ++q)
        EXPECT_EQ(ge[static_cast<size_t>(i * H + q)], 0.0) << "padding row " << i;
    }
    EXPECT_TRUE(bitwise_equal(disp.dispatch_backward(cg.grad_expert_y, h),
                              disp.dispatch_backward(ug.grad_expert_y, u.handle)));
    const Tensor gr = Tensor::full({h.num_recv_tokens()}, DType::fp32, 0.5);
    const Tensor ugr = Tensor::full({u.handle.num_recv_tokens()}, DType::fp32, 0.5);
    EXPECT_TRUE(bitwise_equal(disp.dispatch_weights_backward(gr, h),
                              disp.dispatch_weights_backward(ugr, u.handle)));
  }

 private:
  // The global batch's description: the same on every rank, and the same for both dispatchers
  // and both weight modes, so that their cases of one configuration see the same batch.
  std::string batch_description() const {
    std::string s = std::string(routes_name(routes_)) + " E=" + std::to_string(E_) +
                    " K=" + std::to_string(K_) + " H=" + std::to_string(H_) + " " +
                    dtype_name(dtype_);
    if (alignment_ != 1) s += " align=" + std::to_string(alignment_);
    if (capacity_ >= 0) s += " capacity=" + std::to_string(capacity_);
    if (pad_to_capacity_) s += " pad_to_capacity";
    return s + " EP=" + std::to_string(world().size());
  }
  uint64_t seed_for(const char* what) const {
    return test_seed(seed_ ? *seed_ : seed_of(std::string(what) + " " + batch_description()));
  }
  std::string context(uint64_t seed) const {
    return describe() + " rank=" + std::to_string(world().rank()) + " " + repro(seed);
  }
  GlobalBatch batch(uint64_t seed) const {
    return make_global_batch(world().size(), E_, K_, H_, dtype_, routes_, seed);
  }
  dist::DispatchOptions options() const {
    dist::DispatchOptions opt;
    opt.num_experts = E_;
    opt.kind = kind_;
    opt.plan.expert_alignment = alignment_;
    opt.plan.expert_capacity = capacity_;
    opt.plan.pad_to_capacity = pad_to_capacity_;
    opt.plan.token_drop_policy = TokenDropPolicy::position;
    return opt;
  }

  // Dispatch this rank's rows of `g` with `kind`, run the whole forward/backward and check every
  // output bitwise against the EP = 1 computation on the global batch.
  void run_and_check(const GlobalBatch& g, dist::DispatcherKind kind, uint64_t seed) const {
    dist::Communicator& c = world();
    dist::Dispatcher disp(world_ptr());
    const int64_t P = c.size(), me = c.rank(), E = g.E, L = E / P, H = g.H, K = g.K;
    SCOPED_TRACE(kind_name(kind));
    // EP = 1, locally, on the global batch.
    const RoutingPlan gp = build_routing_plan(g.idx, g.w, E);
    const Tensor gperm = permute(g.x, gp);
    const int32_t* gre = gp.row_expert.data<int32_t>();
    const std::vector<int64_t> gexp(gre, gre + gp.num_rows);
    const Tensor gY = expert_fn(gperm, gexp);
    const UnpermuteOptions uo{mode_};
    const Tensor gy = unpermute(gY, gp, uo);
    std::mt19937_64 rng(seed + 1);
    const int64_t N = g.tok_off.back();
    const Tensor ggrad = randn({N, H}, g.dtype, rng);
    const UnpermuteGrads gg = unpermute_backward(ggrad, gY, gp, uo);
    const Tensor ggx = permute_backward(gg.grad_permuted, gp);

    // This rank's rows, dispatched.
    const int64_t b = g.begin(me), e_ = g.end(me);
    dist::DispatchOptions opt;
    opt.num_experts = E;
    opt.kind = kind;
    const GlobalBatch::Rows mine = g.of(me);
    const dist::DispatchResult d = disp.dispatch(mine.x, mine.idx, mine.w, opt);
    const dist::DispatchHandle& h = d.handle;
    const int64_t* goff = gp.expert_offsets.data<int64_t>();
    const int64_t r0 = goff[me * L], r1 = goff[(me + 1) * L];
    EXPECT_EQ(h.num_recv_tokens(), r1 - r0);
    EXPECT_TRUE(bitwise_equal(d.recv_x, rows(gperm, r0, r1)));
    EXPECT_TRUE(
        bitwise_equal(d.recv_topk_weights,
                      rows(gp.row_weight.reshape({gp.num_rows, 1}), r0, r1).reshape({r1 - r0})));
    for (int64_t el = 0; el < L; ++el) {
      EXPECT_EQ(h.num_tokens_per_expert().data<int64_t>()[el],
                gp.num_tokens_per_expert.data<int64_t>()[me * L + el])
          << "local expert " << el;
    }
    // Every row came from the (rank, token) its payload says, and that token routes to this
    // rank's expert.
    const int64_t* grt = gp.row_token.data<int64_t>();
    const int32_t* gidx = g.idx.data<int32_t>();
    std::vector<int64_t> expert_of_row(static_cast<size_t>(h.num_recv_tokens()));
    for (int64_t i = 0; i < h.num_recv_tokens() && r0 + i < r1; ++i) {
      const int64_t s = h.recv_src_rank().data<int32_t>()[i],
                    t = h.recv_src_token().data<int64_t>()[i];
      EXPECT_EQ(d.recv_x.item_as_double(i * H + 0), s) << "row " << i;
      EXPECT_EQ(d.recv_x.item_as_double(i * H + 1), t) << "row " << i;
      EXPECT_EQ(g.begin(s) + t, grt[r0 + i]) << "row " << i;
      const int64_t e = gre[r0 + i];
      EXPECT_EQ(e / L, me) << "row " << i;
      bool routed = false;
      for (int64_t k = 0; k < K; ++k) routed = routed || gidx[(g.begin(s) + t) * K + k] == e;
      EXPECT_TRUE(routed) << "row " << i;
      expert_of_row[static_cast<size_t>(i)] = e;
    }
    // Experts run locally; combine back; compare bitwise with EP = 1.
    const Tensor Y = expert_fn(d.recv_x, expert_of_row);
    EXPECT_TRUE(bitwise_equal(disp.combine(Y, h, mode_), rows(gy, b, e_))) << "combine";
    const dist::CombineGrads cg = disp.combine_backward(rows(ggrad, b, e_), Y, h, mode_);
    EXPECT_TRUE(bitwise_equal(cg.grad_expert_y, rows(gg.grad_permuted, r0, r1)))
        << "combine_backward";
    EXPECT_TRUE(bitwise_equal(cg.grad_topk_weights, rows(gg.grad_topk_weights, b, e_)))
        << "grad_topk_weights";
    EXPECT_TRUE(bitwise_equal(disp.dispatch_backward(cg.grad_expert_y, h), rows(ggx, b, e_)))
        << "dispatch_backward";
  }

  Routes routes_ = Routes::replay;
  int64_t E_ = 12, K_ = 4, H_ = 16;
  DType dtype_ = DType::fp32;
  dist::DispatcherKind kind_ = dist::DispatcherKind::all_to_all;
  WeightMode mode_ = WeightMode::apply;
  int64_t alignment_ = 1, capacity_ = -1;
  bool pad_to_capacity_ = false;
  std::optional<uint64_t> seed_;
};

}  // namespace switchyard::testing
