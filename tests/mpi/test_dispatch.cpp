// Expert-parallel dispatch over MPI, registered for 1, 2, 3 and 4 ranks. Every rank builds the
// whole global batch from a seed and computes the EP=1 result locally (routing plan +
// permute/unpermute on the concatenated batch), so each registration proves bitwise EP-invariance.
// Payload rows encode (source rank, token) so every received row's origin and destination is
// checked.
#include <gtest/gtest.h>
// C API only: the deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <random>

#include "ref/dispatch_ref.h"
#include "switchyard/dispatcher.h"
#include "testing.h"

namespace switchyard {
namespace {

using dist::DispatcherKind;
using testing::bitwise_equal;
using testing::repro;
using testing::test_seed;

enum class Routes { replay, one_expert, one_rank, zero_token_rank };

const char* routes_name(Routes r) {
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

std::shared_ptr<dist::Communicator> comm() {
  static std::shared_ptr<dist::Communicator> c = dist::world();
  return c;
}

// The global batch of P ranks, identical on every rank.
struct Global {
  int64_t P, E, K, H;
  DType dtype;
  std::vector<int64_t> T, tok_off;
  Tensor x, idx, w;  // concatenated over ranks: [sum T, H], [sum T, K], [sum T, K]
};

Global make_global(int64_t P, int64_t E, int64_t K, int64_t H, DType dtype, Routes routes,
                   uint64_t seed) {
  std::mt19937_64 rng(seed);
  Global g{P, E, K, H, dtype, {}, {0}, {}, {}, {}};
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
    for (int64_t t = 0; t < g.T[r]; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        // Columns 0 and 1 encode (source rank, token): small integers, exact in bf16.
        xv[static_cast<size_t>((g.tok_off[r] + t) * H + h)] = h == 0 ? r : h == 1 ? t : nd(rng);
      }
    }
  }
  g.x = Tensor::from_vector(xv, {N, H}).to(DType::fp32).to(dtype);
  std::vector<int32_t> idx(static_cast<size_t>(N * K));
  std::vector<float> w(static_cast<size_t>(N * K));
  std::uniform_int_distribution<int> ex(0, static_cast<int>(E - 1)), kind(0, 7), kk(0, 3);
  std::uniform_real_distribution<float> wd(0.05f, 1.0f);
  const int64_t L = E / P;
  for (int64_t n = 0; n < N; ++n) {
    const int c = kind(rng);
    for (int64_t k = 0; k < K; ++k) {
      int32_t v = ex(rng);
      switch (routes) {
        case Routes::one_expert:
          v = static_cast<int32_t>(E / 2);
          break;
        case Routes::one_rank:
          v = static_cast<int32_t>((P - 1) * L + (ex(rng) % L));
          break;
        default:
          if (c == 0) v = 0;                   // zero-filled replay padding row
          if (c == 1) v = -1;                  // no route
          if (c == 2 && kk(rng) == 0) v = -1;  // dropped slot
          if (c == 3 && k > 0 && kk(rng) < 2)
            v = idx[static_cast<size_t>(n * K + k - 1)];  // repeat
      }
      idx[static_cast<size_t>(n * K + k)] = v;
      w[static_cast<size_t>(n * K + k)] = wd(rng);
    }
  }
  g.idx = Tensor::from_vector(idx, {N, K});
  g.w = Tensor::from_vector(w, {N, K});
  return g;
}

// Rows [begin, end) of a 2-D tensor, copied.
Tensor rows(const Tensor& t, int64_t begin, int64_t end) {
  const int64_t cols = t.dim() == 2 ? t.size(1) : 1;
  Shape s = t.shape();
  s[0] = end - begin;
  Tensor out = Tensor::empty(s, t.dtype());
  const size_t rb = static_cast<size_t>(cols) * dtype_size(t.dtype());
  if (end > begin) {
    std::memcpy(out.raw(), static_cast<const unsigned char*>(t.raw()) + begin * rb,
                static_cast<size_t>(end - begin) * rb);
  }
  return out;
}

// A deterministic row-wise "expert": Y[i] = x[i] * (1 + e/8) + e/4 in fp32, stored in x's dtype.
Tensor expert_fn(const Tensor& x, const std::vector<int64_t>& expert_of_row) {
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

struct Checked {
  Tensor recv_x, y, grad_x, grad_expert_y, grad_w;
};

// Dispatch rank `me`'s slice of `g` with `kind`, run the whole forward/backward and check every
// output bitwise against the EP=1 computation on the global batch.
Checked run_and_check(const Global& g, DispatcherKind kind, WeightMode mode, uint64_t seed) {
  dist::Communicator& c = *comm();
  const int64_t P = c.size(), me = c.rank(), E = g.E, L = E / P, H = g.H, K = g.K;
  const std::string ctx =
      std::string(kind == DispatcherKind::all_to_all ? "all_to_all" : "all_gather") +
      " EP=" + std::to_string(P) + " rank=" + std::to_string(me) + " " + dtype_name(g.dtype) + " " +
      repro(seed);
  // EP = 1, locally, on the global batch.
  RoutingPlan gp = build_routing_plan(g.idx, g.w, E);
  Tensor gperm = permute(g.x, gp);
  const int32_t* gre = gp.row_expert.data<int32_t>();
  std::vector<int64_t> gexp(gre, gre + gp.num_rows);
  Tensor gY = expert_fn(gperm, gexp);
  const UnpermuteOptions uo{mode};
  Tensor gy = unpermute(gY, gp, uo);
  std::mt19937_64 rng(seed + 1);
  const int64_t N = g.tok_off.back();
  Tensor ggrad = testing::randn({N, H}, g.dtype, rng);
  UnpermuteGrads gg = unpermute_backward(ggrad, gY, gp, uo);
  Tensor ggx = permute_backward(gg.grad_permuted, gp);

  // This rank's slice, dispatched.
  const int64_t b = g.tok_off[me], e_ = g.tok_off[me + 1];
  dist::DispatchOptions opt;
  opt.num_experts = E;
  opt.kind = kind;
  dist::DispatchResult d =
      dist::dispatch(rows(g.x, b, e_), rows(g.idx, b, e_), rows(g.w, b, e_), opt, c);
  const dist::DispatchHandle& h = d.handle;
  Checked out;
  out.recv_x = d.recv_x;
  const int64_t* goff = gp.expert_offsets.data<int64_t>();
  const int64_t r0 = goff[me * L], r1 = goff[(me + 1) * L];
  EXPECT_EQ(h.num_recv_tokens, r1 - r0) << ctx;
  EXPECT_TRUE(bitwise_equal(d.recv_x, rows(gperm, r0, r1))) << ctx;
  EXPECT_TRUE(
      bitwise_equal(d.recv_topk_weights,
                    rows(gp.row_weight.reshape({gp.num_rows, 1}), r0, r1).reshape({r1 - r0})))
      << ctx;
  for (int64_t el = 0; el < L; ++el) {
    EXPECT_EQ(h.num_tokens_per_expert.data<int64_t>()[el],
              gp.num_tokens_per_expert.data<int64_t>()[me * L + el])
        << ctx;
  }
  // Every row came from the (rank, token) its payload says, and that token routes to this expert.
  const int64_t* grt = gp.row_token.data<int64_t>();
  const int32_t* gidx = g.idx.data<int32_t>();
  std::vector<int64_t> expert_of_row(static_cast<size_t>(h.num_recv_tokens));
  for (int64_t i = 0; i < h.num_recv_tokens; ++i) {
    const int64_t s = h.recv_src_rank.data<int32_t>()[i], t = h.recv_src_token.data<int64_t>()[i];
    EXPECT_EQ(d.recv_x.item_as_double(i * H + 0), s) << "row " << i << " " << ctx;
    EXPECT_EQ(d.recv_x.item_as_double(i * H + 1), t) << "row " << i << " " << ctx;
    EXPECT_EQ(g.tok_off[s] + t, grt[r0 + i]) << "row " << i << " " << ctx;
    const int64_t e = gre[r0 + i];
    EXPECT_EQ(e / L, me) << ctx;
    bool routed = false;
    for (int64_t k = 0; k < K; ++k) routed = routed || gidx[(g.tok_off[s] + t) * K + k] == e;
    EXPECT_TRUE(routed) << "row " << i << " " << ctx;
    expert_of_row[static_cast<size_t>(i)] = e;
  }
  // Experts run locally; combine back; compare bitwise with EP = 1.
  Tensor Y = expert_fn(d.recv_x, expert_of_row);
  out.y = dist::combine(Y, h, uo, c);
  EXPECT_TRUE(bitwise_equal(out.y, rows(gy, b, e_))) << "combine " << ctx;
  dist::CombineGrads cg = dist::combine_backward(rows(ggrad, b, e_), Y, h, uo, c);
  out.grad_expert_y = cg.grad_expert_y;
  out.grad_w = cg.grad_topk_weights;
  EXPECT_TRUE(bitwise_equal(cg.grad_expert_y, rows(gg.grad_permuted, r0, r1)))
      << "combine_backward " << ctx;
  EXPECT_TRUE(bitwise_equal(cg.grad_topk_weights, rows(gg.grad_topk_weights, b, e_)))
      << "grad_topk_weights " << ctx;
  out.grad_x = dist::dispatch_backward(cg.grad_expert_y, h, c);
  EXPECT_TRUE(bitwise_equal(out.grad_x, rows(ggx, b, e_))) << "dispatch_backward " << ctx;
  return out;
}

void check_both_dispatchers(const Global& g, uint64_t seed) {
  for (WeightMode mode : {WeightMode::apply, WeightMode::skip}) {
    Checked a = run_and_check(g, DispatcherKind::all_to_all, mode, seed);
    Checked b = run_and_check(g, DispatcherKind::all_gather, mode, seed);
    EXPECT_TRUE(bitwise_equal(a.recv_x, b.recv_x));
    EXPECT_TRUE(bitwise_equal(a.y, b.y));
    EXPECT_TRUE(bitwise_equal(a.grad_x, b.grad_x));
    EXPECT_TRUE(bitwise_equal(a.grad_w, b.grad_w));
  }
}

TEST(Dispatch, ReplayRoutesMatchEpOneBitwise) {
  // The regression: zero-filled padding rows [0,0,...,0], repeated ids and -1 rows.
  const int64_t P = comm()->size();
  for (DType dt : {DType::fp32, DType::bf16}) {
    for (int64_t E : {12, 24}) {
      const uint64_t seed = test_seed(1000 + E);
      check_both_dispatchers(make_global(P, E, 4, 37, dt, Routes::replay, seed), seed);
    }
  }
  const uint64_t seed = test_seed(2000);
  check_both_dispatchers(make_global(P, 12, 12, 19, DType::fp32, Routes::replay, seed),
                         seed);  // K = E
}

TEST(Dispatch, SkewedAndEmptyRanks) {
  const int64_t P = comm()->size();
  for (Routes r : {Routes::one_expert, Routes::one_rank, Routes::zero_token_rank}) {
    SCOPED_TRACE(routes_name(r));
    const uint64_t seed = test_seed(3000 + static_cast<int>(r));
    check_both_dispatchers(make_global(P, 12, 3, 21, DType::bf16, r, seed), seed);
  }
}

TEST(Dispatch, CombineMatchesDoubleReference) {
  // Not only EP-invariant but right: combine against the definition in double.
  const int64_t P = comm()->size();
  const uint64_t seed = test_seed(4000);
  Global g = make_global(P, 12, 4, 16, DType::fp32, Routes::replay, seed);
  Checked a = run_and_check(g, DispatcherKind::all_to_all, WeightMode::apply, seed);
  const int64_t me = comm()->rank(), b = g.tok_off[me], T = g.T[me];
  std::vector<int32_t> idx(g.idx.data<int32_t>() + b * g.K, g.idx.data<int32_t>() + (b + T) * g.K);
  std::vector<float> w(g.w.data<float>() + b * g.K, g.w.data<float>() + (b + T) * g.K);
  auto pairs = ref::token_pairs(idx, w, T, g.K);
  // Expert output of (token, e) in double: x * (1 + e/8) + e/4.
  auto xv = rows(g.x, b, b + T).to_double_vector();
  std::vector<double> want(static_cast<size_t>(T * g.H), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (const auto& p : pairs[static_cast<size_t>(t)])
      for (int64_t h = 0; h < g.H; ++h)
        want[t * g.H + h] += p.weight * (xv[t * g.H + h] * (1.0 + p.expert / 8.0) + p.expert / 4.0);
  EXPECT_TRUE(testing::all_close(a.y, want, 1e-5, 1e-5)) << repro(seed);
}

// Sum over ranks of a local double.
double global_sum(double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return v;
}

double local_dot(const Tensor& a, const Tensor& b) {
  auto va = a.to_double_vector(), vb = b.to_double_vector();
  double s = 0;
  for (size_t i = 0; i < va.size(); ++i) s += va[i] * vb[i];
  return s;
}

TEST(Dispatch, AdjointIdentitiesAcrossRanks) {
  // <dispatch(x), Y> = <x, dispatch_backward(Y)> and <combine(Y), g> = <Y, combine_backward(g)>,
  // each side summed over all ranks, for both dispatchers.
  dist::Communicator& c = *comm();
  const int64_t P = c.size(), me = c.rank();
  const uint64_t seed = test_seed(6000);
  Global g = make_global(P, 12, 4, 23, DType::fp32, Routes::replay, seed);
  const int64_t b = g.tok_off[me], e_ = g.tok_off[me + 1];
  for (auto kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
    dist::DispatchOptions opt;
    opt.num_experts = 12;
    opt.kind = kind;
    dist::DispatchResult d =
        dist::dispatch(rows(g.x, b, e_), rows(g.idx, b, e_), rows(g.w, b, e_), opt, c);
    std::mt19937_64 rng(seed + 100 + static_cast<uint64_t>(me));
    Tensor Y = testing::randn({d.handle.num_recv_tokens, g.H}, DType::fp32, rng);
    Tensor gy = testing::randn({e_ - b, g.H}, DType::fp32, rng);
    const double l1 = global_sum(local_dot(d.recv_x, Y));
    const double r1 =
        global_sum(local_dot(rows(g.x, b, e_), dist::dispatch_backward(Y, d.handle, c)));
    EXPECT_NEAR(l1, r1, 1e-4 * (1 + std::fabs(l1))) << repro(seed);
    const double l2 = global_sum(local_dot(dist::combine(Y, d.handle, {}, c), gy));
    const double r2 =
        global_sum(local_dot(Y, dist::combine_backward(gy, Y, d.handle, {}, c).grad_expert_y));
    EXPECT_NEAR(l2, r2, 1e-4 * (1 + std::fabs(l2))) << repro(seed);
  }
}

TEST(Dispatch, WeightsBackwardIsTheAdjointOfTheReceivedWeights) {
  // recv_topk_weights[row] is the sum of its slots' weights, so for any g:
  // sum_rows g[row] * recv_w[row] = sum_{t,k} dispatch_weights_backward(g)[t,k] * w[t,k],
  // each side summed over all ranks; merged repeated ids get the row's gradient in every slot.
  dist::Communicator& c = *comm();
  const int64_t P = c.size(), me = c.rank();
  const uint64_t seed = test_seed(6100);
  Global g = make_global(P, 12, 4, 5, DType::fp32, Routes::replay, seed);
  const int64_t b = g.tok_off[me], e_ = g.tok_off[me + 1];
  for (auto kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
    dist::DispatchOptions opt;
    opt.num_experts = 12;
    opt.kind = kind;
    const Tensor w = rows(g.w, b, e_);
    dist::DispatchResult d = dist::dispatch(rows(g.x, b, e_), rows(g.idx, b, e_), w, opt, c);
    std::mt19937_64 rng(seed + 200 + static_cast<uint64_t>(me));
    Tensor gr = testing::randn({d.handle.num_recv_tokens}, DType::fp32, rng);
    const Tensor gw = dist::dispatch_weights_backward(gr, d.handle, c);
    ASSERT_EQ(gw.shape(), (Shape{e_ - b, g.K}));
    const double lhs = global_sum(local_dot(d.recv_topk_weights, gr));
    const double rhs = global_sum(local_dot(w, gw));
    EXPECT_NEAR(lhs, rhs, 1e-4 * (1 + std::fabs(lhs))) << repro(seed);
    const Tensor my_idx = rows(g.idx, b, e_);
    const int32_t* idx = my_idx.data<int32_t>();
    for (int64_t i = 0; i < gw.numel(); ++i) {
      if (idx[i] < 0) {
        EXPECT_EQ(gw.data<float>()[i], 0.0f) << "slot " << i << " " << repro(seed);
      }
    }
  }
  // A wrong length on one rank raises the same error on every rank.
  dist::DispatchOptions opt;
  opt.num_experts = 12;
  dist::DispatchResult d =
      dist::dispatch(rows(g.x, b, e_), rows(g.idx, b, e_), rows(g.w, b, e_), opt, c);
  Tensor bad = Tensor::zeros({d.handle.num_recv_tokens + (me == P - 1 ? 1 : 0)}, DType::fp32);
  SY_EXPECT_THROW_MSG(dist::dispatch_weights_backward(bad, d.handle, c), std::invalid_argument,
                      "[dispatch_weights_backward] on rank " + std::to_string(P - 1) +
                          ": [dispatch_weights_backward] grad_recv_topk_weights must have shape");
}

TEST(Dispatch, IdOutOfRangeOnOneRankRaisesEverywhere) {
  dist::Communicator& c = *comm();
  const int64_t P = c.size(), me = c.rank();
  const uint64_t seed = test_seed(5000);
  Global g = make_global(P, 12, 4, 8, DType::fp32, Routes::replay, seed);
  for (DispatcherKind kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
    const int64_t T = 3;
    std::vector<int32_t> idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    if (me == P - 1) idx[6] = 12;  // only the last rank is wrong
    dist::DispatchOptions opt;
    opt.num_experts = 12;
    opt.kind = kind;
    SY_EXPECT_THROW_MSG(
        dist::dispatch(Tensor::zeros({T, 8}, DType::fp32), Tensor::from_vector(idx, {T, 4}),
                       Tensor::full({T, 4}, DType::fp32, 0.25), opt, c),
        std::invalid_argument,
        "[dispatch] on rank " + std::to_string(P - 1) +
            ": [routing_plan] topk_idx must hold ids in [0, num_experts=12) or -1, got "
            "topk_idx[1, 2]=12");
  }
  // The communicator is still in step: a good dispatch works afterwards.
  check_both_dispatchers(g, seed);
}

TEST(Dispatch, WrongHiddenOrDtypeOnOneRankRaisesEverywhere) {
  dist::Communicator& c = *comm();
  const int64_t P = c.size(), me = c.rank();
  dist::DispatchOptions opt;
  opt.num_experts = 12;
  const int64_t H = (P > 1 && me == 1) ? 9 : 8;
  auto idx = Tensor::zeros({2, 2}, DType::int32);
  auto w = Tensor::full({2, 2}, DType::fp32, 0.5);
  if (P > 1) {
    SY_EXPECT_THROW_MSG(
        dist::dispatch(Tensor::zeros({2, H}, DType::fp32), idx, w, opt, c), std::invalid_argument,
        "[dispatch] x must have the same hidden size on every rank, got hidden=8 on "
        "rank 0 and hidden=9 on rank 1");
    const DType dt = me == P - 1 ? DType::bf16 : DType::fp32;
    SY_EXPECT_THROW_MSG(dist::dispatch(Tensor::zeros({2, 8}, dt), idx, w, opt, c),
                        std::invalid_argument, "x must have the same dtype on every rank");
  }
  if (P > 1) {
    // Options that must agree: num_experts and the dispatcher kind differ on the last rank.
    dist::DispatchOptions other = opt;
    if (me == P - 1) other.num_experts = 24;
    SY_EXPECT_THROW_MSG(dist::dispatch(Tensor::zeros({2, 8}, DType::fp32), idx, w, other, c),
                        std::invalid_argument,
                        "[dispatch] num_experts must be the same on every rank, got 12 on rank 0 "
                        "and 24 on rank " +
                            std::to_string(P - 1));
    dist::DispatchOptions kind = opt;
    if (me == P - 1) kind.kind = DispatcherKind::all_gather;
    SY_EXPECT_THROW_MSG(dist::dispatch(Tensor::zeros({2, 8}, DType::fp32), idx, w, kind, c),
                        std::invalid_argument, "options.kind must be the same on every rank");
  }
  // A bad local shape on the last rank only (weights not matching topk_idx).
  auto bad_w = me == P - 1 ? Tensor::zeros({2, 3}, DType::fp32) : w;
  SY_EXPECT_THROW_MSG(dist::dispatch(Tensor::zeros({2, 8}, DType::fp32), idx, bad_w, opt, c),
                      std::invalid_argument,
                      "[dispatch] on rank " + std::to_string(P - 1) + ": [dispatch] topk_weights");
  // combine with a wrong hidden size on the last rank only.
  dist::DispatchResult d = dist::dispatch(Tensor::zeros({2, 8}, DType::fp32), idx, w, opt, c);
  const int64_t HY = me == P - 1 ? 7 : 8;
  SY_EXPECT_THROW_MSG(
      dist::combine(Tensor::zeros({d.handle.num_recv_tokens, HY}, DType::fp32), d.handle, {}, c),
      std::invalid_argument, "[combine] on rank " + std::to_string(P - 1) + ": [combine] expert_y");
  Tensor y =
      dist::combine(Tensor::zeros({d.handle.num_recv_tokens, 8}, DType::fp32), d.handle, {}, c);
  EXPECT_EQ(y.shape(), (Shape{2, 8}));
}

TEST(Dispatch, BadHandleOnOneRankRaisesEverywhere) {
  // A handle that is not from dispatch on this communicator, or one from a different dispatch
  // than the other ranks', on one rank only: every rank raises the same error (none waits in an
  // exchange whose sizes the ranks disagree on), and the communicator stays in step.
  dist::Communicator& c = *comm();
  const int64_t P = c.size(), me = c.rank();
  dist::Dispatcher disp(comm());
  const uint64_t seed = test_seed(7000);
  Global g1 = make_global(P, 12, 4, 8, DType::fp32, Routes::replay, seed);
  Global g2 = make_global(P, 12, 4, 8, DType::fp32, Routes::one_rank, seed + 1);
  dist::DispatchOptions opt;
  opt.num_experts = 12;
  auto slice = [&](const Global& g) {
    const int64_t b = g.tok_off[me], e = g.tok_off[me + 1];
    return disp.dispatch(rows(g.x, b, e), rows(g.idx, b, e), rows(g.w, b, e), opt);
  };
  dist::DispatchResult d1 = slice(g1), d2 = slice(g2);
  const bool odd = me == P - 1;
  const std::string last = std::to_string(P - 1);
  // A default handle (never returned by dispatch) on the last rank.
  const dist::DispatchHandle empty;
  const dist::DispatchHandle& h = odd ? empty : d1.handle;
  const Tensor Y = odd ? Tensor::zeros({0, 8}, DType::fp32) : d1.recv_x;
  SY_EXPECT_THROW_MSG(disp.combine(Y, h), std::invalid_argument,
                      "[combine] on rank " + last +
                          ": [combine] handle must come from dispatch on this communicator");
  SY_EXPECT_THROW_MSG(disp.dispatch_backward(Y, h), std::invalid_argument,
                      "[dispatch_backward] on rank " + last + ": [dispatch_backward] handle");
  SY_EXPECT_THROW_MSG(disp.combine_backward(Tensor::zeros({g1.T[me], 8}, DType::fp32), Y, h),
                      std::invalid_argument,
                      "[combine_backward] on rank " + last + ": [combine_backward] handle");
  SY_EXPECT_THROW_MSG(
      disp.dispatch_weights_backward(Tensor::zeros({Y.size(0)}, DType::fp32), h),
      std::invalid_argument,
      "[dispatch_weights_backward] on rank " + last + ": [dispatch_weights_backward] handle");
  if (P > 1) {
    // The second step's handle on the last rank, the first step's elsewhere: each is valid
    // locally (its own shapes), but the layouts differ between ranks.
    const dist::DispatchResult& mine = odd ? d2 : d1;
    SY_EXPECT_THROW_MSG(disp.combine(mine.recv_x, mine.handle), std::invalid_argument,
                        "[combine] handle must come from the same dispatch call on every rank, "
                        "got handles of different dispatches on rank 0 and rank " +
                            last);
    SY_EXPECT_THROW_MSG(
        disp.combine_backward(Tensor::zeros({mine.handle.num_tokens, 8}, DType::fp32), mine.recv_x,
                              mine.handle),
        std::invalid_argument, "[combine_backward] handle must come from the same dispatch call");
  }
  // Still in step: both handles work when every rank passes the same one.
  for (const dist::DispatchResult* d : {&d1, &d2}) {
    Tensor y = disp.combine(d->recv_x, d->handle, {WeightMode::skip});
    EXPECT_EQ(y.size(0), d->handle.num_tokens);
  }
}

TEST(Dispatch, DispatcherObjectReusesItsScratch) {
  // A kept Dispatcher gives the free functions' bits, and its scratch stops growing once it has
  // seen the largest step (steady state: no fresh buffers).
  dist::Communicator& c = *comm();
  const int64_t P = c.size(), me = c.rank();
  dist::Dispatcher disp(comm());
  const uint64_t seed = test_seed(7100);
  Global g = make_global(P, 12, 4, 16, DType::bf16, Routes::replay, seed);
  const int64_t b = g.tok_off[me], e = g.tok_off[me + 1];
  for (auto kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
    dist::DispatchOptions opt;
    opt.num_experts = 12;
    opt.kind = kind;
    int64_t scratch = -1;
    for (int step = 0; step < 3; ++step) {
      dist::DispatchResult d =
          disp.dispatch(rows(g.x, b, e), rows(g.idx, b, e), rows(g.w, b, e), opt);
      dist::DispatchResult f =
          dist::dispatch(rows(g.x, b, e), rows(g.idx, b, e), rows(g.w, b, e), opt, c);
      EXPECT_TRUE(bitwise_equal(d.recv_x, f.recv_x)) << repro(seed);
      Tensor y = disp.combine(d.recv_x, d.handle);
      EXPECT_TRUE(bitwise_equal(y, dist::combine(f.recv_x, f.handle, {}, c))) << repro(seed);
      dist::CombineGrads cg = disp.combine_backward(y, d.recv_x, d.handle);
      dist::CombineGrads fg = dist::combine_backward(y, f.recv_x, f.handle, {}, c);
      EXPECT_TRUE(bitwise_equal(cg.grad_expert_y, fg.grad_expert_y)) << repro(seed);
      EXPECT_TRUE(bitwise_equal(cg.grad_topk_weights, fg.grad_topk_weights)) << repro(seed);
      if (step > 0) {
        EXPECT_EQ(disp.scratch_bytes(), scratch) << "step " << step;
      }
      scratch = disp.scratch_bytes();
    }
  }
}

TEST(Dispatch, RejectsExpertsNotDivisibleByEpUpFront) {
  dist::Communicator& c = *comm();
  const int64_t P = c.size();
  dist::DispatchOptions opt;
  opt.num_experts = P == 1 ? 0 : 2 * P + 1;
  SY_EXPECT_THROW_MSG(
      dist::dispatch(Tensor::zeros({1, 4}, DType::fp32), Tensor::zeros({1, 1}, DType::int32),
                     Tensor::zeros({1, 1}, DType::fp32), opt, c),
      std::invalid_argument,
      P == 1 ? std::string("num_experts must be >= 1")
             : "[dispatch] num_experts must be divisible by the expert-parallel size " +
                   std::to_string(P) + ", got num_experts=" + std::to_string(2 * P + 1));
  if (P > 1) {
    // Only the last rank has a bad num_experts: every rank raises, none waits forever.
    dist::DispatchOptions one = opt;
    one.num_experts = c.rank() == P - 1 ? 2 * P + 1 : 2 * P;
    SY_EXPECT_THROW_MSG(
        dist::dispatch(Tensor::zeros({1, 4}, DType::fp32), Tensor::zeros({1, 1}, DType::int32),
                       Tensor::zeros({1, 1}, DType::fp32), one, c),
        std::invalid_argument,
        "[dispatch] on rank " + std::to_string(P - 1) +
            ": [dispatch] num_experts must be divisible by the expert-parallel size");
  }
  if (P > 1) {
    // Padding options that differ on one rank are rejected everywhere, before any payload.
    dist::DispatchOptions pad;
    pad.num_experts = 4 * P;
    pad.plan.expert_alignment = c.rank() == P - 1 ? 8 : 4;
    SY_EXPECT_THROW_MSG(
        dist::dispatch(Tensor::zeros({1, 4}, DType::fp32), Tensor::zeros({1, 1}, DType::int32),
                       Tensor::zeros({1, 1}, DType::fp32), pad, c),
        std::invalid_argument,
        "[dispatch] options.plan padding must be the same on every rank, got expert_alignment=4 "
        "pad_to_capacity=false on rank 0 and expert_alignment=8");
  }
}

// The rows of `t` [R, ...] whose received row is real (source rank >= 0), in order.
Tensor real_rows(const Tensor& t, const dist::DispatchHandle& h) {
  const int32_t* src = h.recv_src_rank.data<int32_t>();
  std::vector<int64_t> keep;
  for (int64_t i = 0; i < h.num_recv_tokens; ++i) {
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

struct PadCase {
  const char* name;
  int64_t alignment;
  int64_t capacity;  // explicit expert_capacity, -1 = none
  bool pad_to_capacity;
};

TEST(Dispatch, PaddingAddsZeroRowsThatCombineAndTheBackwardsIgnore) {
  // Megatron-Core's FP8/FP4 routing-map padding (expert_alignment) and drop-and-pad
  // (pad_to_capacity): each source's block of every expert is padded; the padding rows are zero
  // rows with weight 0 and source -1, the counts are Megatron's, and every result on real rows is
  // bitwise the unpadded path's.
  dist::Communicator& c = *comm();
  const int64_t P = c.size(), me = c.rank(), E = 12, L = E / P, H = 10, K = 4;
  dist::Dispatcher disp(comm());
  for (const PadCase& pc :
       {PadCase{"align4", 4, -1, false}, PadCase{"align16", 16, -1, false},
        PadCase{"capacity3_pad", 1, 3, true}, PadCase{"capacity5_pad_align4", 4, 5, true}}) {
    for (DType dt : {DType::fp32, DType::bf16}) {
      for (auto kind : {DispatcherKind::all_to_all, DispatcherKind::all_gather}) {
        const uint64_t seed = test_seed(8000);
        const Global g = make_global(P, E, K, H, dt, Routes::replay, seed);
        const std::string ctx =
            std::string(pc.name) + " " + dtype_name(dt) +
            (kind == DispatcherKind::all_to_all ? " all_to_all" : " all_gather") +
            " EP=" + std::to_string(P) + " " + repro(seed);
        dist::DispatchOptions plain;
        plain.num_experts = E;
        plain.kind = kind;
        plain.plan.expert_capacity = pc.capacity;
        plain.plan.token_drop_policy = TokenDropPolicy::position;
        dist::DispatchOptions padded = plain;
        padded.plan.expert_alignment = pc.alignment;
        padded.plan.pad_to_capacity = pc.pad_to_capacity;
        const int64_t b = g.tok_off[me], e_ = g.tok_off[me + 1];
        const Tensor x = rows(g.x, b, e_), idx = rows(g.idx, b, e_), w = rows(g.w, b, e_);
        dist::DispatchResult u = disp.dispatch(x, idx, w, plain);
        dist::DispatchResult d = disp.dispatch(x, idx, w, padded);
        const dist::DispatchHandle& h = d.handle;

        // The layout: local expert el's block is, for each source s, s's padded block of that
        // expert as permute lays it out (real rows, then zero rows).
        std::vector<Tensor> want_x, want_w;
        std::vector<int64_t> want_src;
        for (int64_t el = 0; el < L; ++el) {
          const int64_t e = me * L + el;
          int64_t n_rows = 0, n_real = 0;
          for (int64_t s = 0; s < P; ++s) {
            const int64_t sb = g.tok_off[s], se = g.tok_off[s + 1];
            RoutingPlan ps =
                build_routing_plan(rows(g.idx, sb, se), rows(g.w, sb, se), E, padded.plan);
            const Tensor perm = permute(rows(g.x, sb, se), ps);
            const int64_t* off = ps.expert_offsets.data<int64_t>();
            const int64_t n = ps.num_tokens_per_expert.data<int64_t>()[e];
            EXPECT_EQ(off[e + 1] - off[e],
                      ref::padded_block_rows(n, pc.alignment, pc.capacity, pc.pad_to_capacity))
                << ctx;
            want_x.push_back(rows(perm, off[e], off[e + 1]));
            want_w.push_back(rows(ps.row_weight.reshape({ps.num_rows, 1}), off[e], off[e + 1]));
            for (int64_t r = off[e]; r < off[e + 1]; ++r)
              want_src.push_back(ps.row_token.data<int64_t>()[r] < 0 ? -1 : s);
            n_rows += off[e + 1] - off[e];
            n_real += n;
          }
          EXPECT_EQ(h.num_tokens_per_expert.data<int64_t>()[el], n_rows) << ctx;
          EXPECT_EQ(h.num_tokens_per_expert.data<int64_t>()[el] % pc.alignment, 0) << ctx;
          EXPECT_EQ(h.num_unpadded_tokens_per_expert.data<int64_t>()[el], n_real) << ctx;
          EXPECT_EQ(h.num_unpadded_tokens_per_expert.data<int64_t>()[el],
                    u.handle.num_tokens_per_expert.data<int64_t>()[el])
              << ctx;
        }
        ASSERT_EQ(static_cast<int64_t>(want_src.size()), h.num_recv_tokens) << ctx;
        int64_t at = 0;
        for (size_t i = 0; i < want_x.size(); ++i) {
          const int64_t n = want_x[i].size(0);
          EXPECT_TRUE(bitwise_equal(rows(d.recv_x, at, at + n), want_x[i]))
              << ctx << " block " << i;
          EXPECT_TRUE(bitwise_equal(
              rows(d.recv_topk_weights.reshape({h.num_recv_tokens, 1}), at, at + n), want_w[i]))
              << ctx << " block " << i;
          at += n;
        }
        for (int64_t i = 0; i < h.num_recv_tokens; ++i) {
          EXPECT_EQ(h.recv_src_rank.data<int32_t>()[i], want_src[static_cast<size_t>(i)])
              << ctx << " row " << i;
        }
        // Real rows are the unpadded dispatch's, bit for bit.
        EXPECT_TRUE(bitwise_equal(real_rows(d.recv_x, h), u.recv_x)) << ctx;
        EXPECT_TRUE(bitwise_equal(real_rows(h.recv_src_token.reshape({h.num_recv_tokens, 1}), h),
                                  u.handle.recv_src_token.reshape({u.handle.num_recv_tokens, 1})))
            << ctx;

        // Experts that give padding rows non-zero outputs: combine and the backwards must not
        // read them. Every result equals the unpadded path's bitwise.
        std::vector<int64_t> expert_of_row(static_cast<size_t>(h.num_recv_tokens));
        const int64_t* eo = h.expert_offsets.data<int64_t>();
        for (int64_t el = 0; el < L; ++el)
          for (int64_t i = eo[el]; i < eo[el + 1]; ++i)
            expert_of_row[static_cast<size_t>(i)] = me * L + el;
        std::vector<int64_t> u_expert(static_cast<size_t>(u.handle.num_recv_tokens));
        const int64_t* uo = u.handle.expert_offsets.data<int64_t>();
        for (int64_t el = 0; el < L; ++el)
          for (int64_t i = uo[el]; i < uo[el + 1]; ++i)
            u_expert[static_cast<size_t>(i)] = me * L + el;
        const Tensor Y = expert_fn(d.recv_x, expert_of_row), UY = expert_fn(u.recv_x, u_expert);
        for (WeightMode mode : {WeightMode::apply, WeightMode::skip}) {
          const Tensor y = disp.combine(Y, h, {mode});
          EXPECT_TRUE(bitwise_equal(y, disp.combine(UY, u.handle, {mode}))) << ctx;
          std::mt19937_64 rng(seed + 9 + static_cast<uint64_t>(me));
          const Tensor gy = testing::randn({e_ - b, H}, dt, rng);
          dist::CombineGrads cg = disp.combine_backward(gy, Y, h, {mode});
          dist::CombineGrads ug = disp.combine_backward(gy, UY, u.handle, {mode});
          EXPECT_TRUE(bitwise_equal(cg.grad_topk_weights, ug.grad_topk_weights)) << ctx;
          EXPECT_TRUE(bitwise_equal(real_rows(cg.grad_expert_y, h), ug.grad_expert_y)) << ctx;
          const auto ge = cg.grad_expert_y.to_double_vector();
          for (int64_t i = 0; i < h.num_recv_tokens; ++i) {
            if (h.recv_src_rank.data<int32_t>()[i] >= 0) continue;
            for (int64_t q = 0; q < H; ++q)
              EXPECT_EQ(ge[static_cast<size_t>(i * H + q)], 0.0) << ctx << " padding row " << i;
          }
          EXPECT_TRUE(bitwise_equal(disp.dispatch_backward(cg.grad_expert_y, h),
                                    disp.dispatch_backward(ug.grad_expert_y, u.handle)))
              << ctx;
        }
        const Tensor gr = Tensor::full({h.num_recv_tokens}, DType::fp32, 0.5);
        const Tensor ugr = Tensor::full({u.handle.num_recv_tokens}, DType::fp32, 0.5);
        EXPECT_TRUE(bitwise_equal(disp.dispatch_weights_backward(gr, h),
                                  disp.dispatch_weights_backward(ugr, u.handle)))
            << ctx;
      }
    }
  }
}

TEST(Dispatch, PaddedCombineMatchesDoubleReference) {
  // With alignment padding (no capacity: every pair kept), combine is the definition in double.
  dist::Communicator& c = *comm();
  const int64_t P = c.size(), me = c.rank();
  const uint64_t seed = test_seed(8100);
  Global g = make_global(P, 12, 4, 16, DType::fp32, Routes::replay, seed);
  dist::DispatchOptions opt;
  opt.num_experts = 12;
  opt.plan.expert_alignment = 8;
  const int64_t b = g.tok_off[me], T = g.T[me];
  dist::DispatchResult d =
      dist::dispatch(rows(g.x, b, b + T), rows(g.idx, b, b + T), rows(g.w, b, b + T), opt, c);
  std::vector<int64_t> expert_of_row(static_cast<size_t>(d.handle.num_recv_tokens));
  const int64_t* eo = d.handle.expert_offsets.data<int64_t>();
  const int64_t L = 12 / P;
  for (int64_t el = 0; el < L; ++el)
    for (int64_t i = eo[el]; i < eo[el + 1]; ++i)
      expert_of_row[static_cast<size_t>(i)] = me * L + el;
  const Tensor y = dist::combine(expert_fn(d.recv_x, expert_of_row), d.handle, {}, c);
  std::vector<int32_t> idx(g.idx.data<int32_t>() + b * g.K, g.idx.data<int32_t>() + (b + T) * g.K);
  std::vector<float> w(g.w.data<float>() + b * g.K, g.w.data<float>() + (b + T) * g.K);
  auto pairs = ref::token_pairs(idx, w, T, g.K);
  auto xv = rows(g.x, b, b + T).to_double_vector();
  std::vector<double> want(static_cast<size_t>(T * g.H), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (const auto& p : pairs[static_cast<size_t>(t)])
      for (int64_t q = 0; q < g.H; ++q)
        want[t * g.H + q] += p.weight * (xv[t * g.H + q] * (1.0 + p.expert / 8.0) + p.expert / 4.0);
  EXPECT_TRUE(testing::all_close(y, want, 1e-5, 1e-5)) << repro(seed);
  for (int64_t el = 0; el < L; ++el)
    EXPECT_EQ(d.handle.num_tokens_per_expert.data<int64_t>()[el] % 8, 0);
}

TEST(Communicator, CollectivesMoveTheRightBytes) {
  dist::Communicator& c = *comm();
  const int64_t P = c.size(), me = c.rank();
  EXPECT_EQ(c.name(), "mpi");
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  EXPECT_EQ(P, world);
  // alltoallv: rank s sends (s + r) values "1000*s + r" to rank r.
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
  // allgatherv with a zero-length rank.
  std::vector<int64_t> counts(P);
  for (int64_t r = 0; r < P; ++r) counts[r] = r % 2 ? 0 : r + 1;
  std::vector<double> mine(static_cast<size_t>(counts[me]), static_cast<double>(me));
  std::vector<double> all(static_cast<size_t>(P * P + 1));
  c.allgatherv(mine.data(), counts[me], all.data(), counts, sizeof(double));
  i = 0;
  for (int64_t r = 0; r < P; ++r)
    for (int64_t j = 0; j < counts[r]; ++j) EXPECT_EQ(all[i++], r);
  int64_t v[2] = {me, -me};
  c.allreduce_max(v, 2);
  EXPECT_EQ(v[0], P - 1);
  EXPECT_EQ(v[1], 0);
  c.barrier();
  // exchange_blocks: to every peer r (self included) two blocks, of 1 and r+1 rows (plus an empty
  // one in between, skipped on both sides); row value = 1000 * sender + 10 * row + r.
  {
    std::vector<int64_t> sendv, recvv;
    std::vector<dist::Communicator::Block> sb, rbk;
    for (int64_t r = 0; r < P; ++r) {
      for (int64_t n : {int64_t{1}, int64_t{0}, r + 1}) {
        sb.push_back({static_cast<int>(r), static_cast<int64_t>(sendv.size()), n});
        for (int64_t j = 0; j < n; ++j)
          sendv.push_back(1000 * me + 10 * static_cast<int64_t>(sendv.size()) + r);
      }
    }
    // Receive from each peer s: blocks of 1, 0 and me+1 rows, stored in reverse peer order.
    int64_t pos = 0;
    for (int64_t s2 = P - 1; s2 >= 0; --s2) {
      for (int64_t n : {int64_t{1}, int64_t{0}, me + 1}) {
        rbk.push_back({static_cast<int>(s2), pos, n});
        pos += n;
      }
    }
    recvv.assign(static_cast<size_t>(pos), -1);
    c.exchange_blocks(sendv.data(), sb, recvv.data(), rbk, sizeof(int64_t));
    // Sender s2 laid out its rows for peer r at offset sum_{q<r}(1 + q + 1); check every value.
    for (size_t bi = 0; bi < rbk.size(); ++bi) {
      const auto& b = rbk[bi];
      int64_t base = 0;
      for (int64_t q = 0; q < me; ++q) base += 2 + q;
      const int64_t first = bi % 3 == 0 ? base : base + 1;  // the 1-row block, then the me+1 block
      for (int64_t j = 0; j < b.rows; ++j) {
        EXPECT_EQ(recvv[static_cast<size_t>(b.offset + j)], 1000 * b.peer + 10 * (first + j) + me)
            << "from " << b.peer << " block of " << b.rows;
      }
    }
    // Two planes in one round (rows as above, and the same blocks of int32 "metadata" = -value,
    // into their own buffer): each plane lands as if exchanged alone.
    std::vector<int32_t> meta(sendv.size()), got_meta(static_cast<size_t>(pos), 0);
    for (size_t i = 0; i < sendv.size(); ++i) meta[i] = -static_cast<int32_t>(sendv[i]);
    std::vector<int64_t> again(static_cast<size_t>(pos), -1);
    const dist::Communicator::Plane planes[2] = {
        {sendv.data(), &sb, again.data(), &rbk, sizeof(int64_t)},
        {meta.data(), &sb, got_meta.data(), &rbk, sizeof(int32_t)}};
    c.exchange_planes(planes, 2);
    EXPECT_EQ(again, recvv);
    for (int64_t i = 0; i < pos; ++i) {
      EXPECT_EQ(got_meta[static_cast<size_t>(i)], -recvv[static_cast<size_t>(i)]) << "row " << i;
    }
  }
  // The local communicator is size 1 and copies.
  auto l = dist::local();
  EXPECT_EQ(l->size(), 1);
  std::vector<int64_t> one = {7, 8};
  EXPECT_EQ(l->allgather(one), one);
  // A second world communicator is an independent duplicate.
  auto c2 = dist::world();
  EXPECT_EQ(c2->rank(), me);
}

}  // namespace
}  // namespace switchyard
