// Alignment to the trainer's layout and back, against token-by-token references; drift and load
// statistics on hand-computed examples and against a set-based reference.
#include <gtest/gtest.h>

#include <random>

#include "ref/routes_ref.h"
#include "switchyard/route_align.h"
#include "switchyard/route_stats.h"
#include "testing.h"

namespace switchyard {
namespace {

using testing::repro;
using testing::test_seed;

RouteTable random_table(std::mt19937_64& rng, int64_t T, int64_t L, int64_t K, int64_t E) {
  RouteTable t = RouteTable::none(T, L, K, E);
  std::uniform_int_distribution<int64_t> ex(0, E - 1);
  int32_t* p = t.topk_idx.data<int32_t>();
  for (int64_t i = 0; i < T * L * K; ++i) p[i] = static_cast<int32_t>(ex(rng));
  return t;
}

std::vector<RouteTable> random_seqs(std::mt19937_64& rng, int64_t n, int64_t L, int64_t K,
                                    int64_t E) {
  std::uniform_int_distribution<int64_t> len(0, 37);
  std::vector<RouteTable> s;
  for (int64_t i = 0; i < n; ++i) s.push_back(random_table(rng, i == 0 ? 1 : len(rng), L, K, E));
  return s;
}

TEST(RouteAlign, DropPaddingLeftAndRight) {
  // batch 2, seq 4, 1 layer, K 1: row 0 right padded, row 1 left padded.
  std::vector<int32_t> v{1, 2, 3, -1, 0, 0, 4, 5};
  Tensor idx = Tensor::from_vector(v, {2, 4, 1, 1});
  for (DType mt : {DType::boolean, DType::uint8, DType::int32, DType::int64}) {
    Tensor mask = Tensor::from_vector(std::vector<double>{1, 1, 1, 0, 0, 0, 1, 1}, {2, 4}).to(mt);
    auto seqs = drop_padding(idx, mask, 8);
    ASSERT_EQ(seqs.size(), 2u);
    EXPECT_EQ(seqs[0].topk_idx.to_double_vector(), (std::vector<double>{1, 2, 3}));
    EXPECT_EQ(seqs[1].topk_idx.to_double_vector(), (std::vector<double>{4, 5}));
    EXPECT_EQ(seqs[1].topk_idx.shape(), (Shape{2, 1, 1}));
  }
  SY_EXPECT_THROW_MSG(drop_padding(idx, Tensor::zeros({2, 3}, DType::uint8), 8),
                      std::invalid_argument, "[drop_padding] attention_mask");
  SY_EXPECT_THROW_MSG(drop_padding(idx, Tensor::zeros({2, 4}, DType::fp32), 8),
                      std::invalid_argument, "[drop_padding] attention_mask");
}

TEST(RouteAlign, PackAlignmentRules) {
  EXPECT_EQ(pack_alignment({1, 1, 0}), 1);
  EXPECT_EQ(pack_alignment({4, 1, 0}), 4);
  EXPECT_EQ(pack_alignment({2, 2, 0}), 8);
  EXPECT_EQ(pack_alignment({2, 3, 16}), 48);
  EXPECT_EQ(pack_alignment({3, 1, 128}), 384);
  SY_EXPECT_THROW_MSG(pack_alignment({0, 1, 0}), std::invalid_argument,
                      "[pack_thd] tp_size must be >= 1, got 0");
}

TEST(RouteAlign, PackUnpackAgainstReference) {
  const uint64_t seed = test_seed(101);
  std::mt19937_64 rng(seed);
  const int64_t L = 3, K = 2, E = 16;
  for (PackOptions o :
       {PackOptions{1, 1, 0}, PackOptions{2, 1, 0}, PackOptions{2, 2, 0}, PackOptions{1, 3, 16}}) {
    auto seqs = random_seqs(rng, 5, L, K, E);
    PackedRoutes p = pack_thd(seqs, o);
    const int64_t m = pack_alignment(o);
    std::vector<int64_t> rows;
    RouteTable all = concat_tokens(seqs);
    int64_t start = 0;
    for (const auto& s : seqs) {
      const int64_t pl = ref::padded_len(s.num_tokens(), m);
      for (int64_t j = 0; j < pl; ++j) rows.push_back(j < s.num_tokens() ? start + j : -1);
      start += s.num_tokens();
    }
    EXPECT_TRUE(route_tables_equal(p.table, ref::gather_rows(all, rows, L, K, E))) << repro(seed);
    EXPECT_EQ(p.cu_seqlens_padded.back(), int64_t(rows.size()));
    auto back = unpack_thd(p);
    ASSERT_EQ(back.size(), seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) EXPECT_TRUE(route_tables_equal(back[i], seqs[i]));
  }
  SY_EXPECT_THROW_MSG(pack_thd({RouteTable::none(2, 3, 2, 8), RouteTable::none(2, 4, 2, 8)}, {}),
                      std::invalid_argument, "[pack_thd] sequences[1] must match sequences[0]");
}

TEST(RouteAlign, ZigzagAndSequenceParallelAgainstReference) {
  const uint64_t seed = test_seed(202);
  std::mt19937_64 rng(seed);
  const int64_t L = 2, K = 2, E = 8;
  for (int64_t cp : {1, 2, 3}) {
    for (int64_t tp : {1, 2}) {
      auto seqs = random_seqs(rng, 4, L, K, E);
      PackedRoutes p = pack_thd(seqs, {tp, cp, 0});
      std::vector<int64_t> lens;
      for (size_t i = 0; i + 1 < p.cu_seqlens_padded.size(); ++i)
        lens.push_back(p.cu_seqlens_padded[i + 1] - p.cu_seqlens_padded[i]);
      std::vector<RouteTable> pieces;
      for (int64_t r = 0; r < cp; ++r) {
        RouteTable mine = cp_zigzag_split(p.table, p.cu_seqlens_padded, cp, r);
        EXPECT_TRUE(route_tables_equal(
            mine, ref::gather_rows(p.table, ref::zigzag_rows(lens, cp, r), L, K, E)))
            << "cp " << cp << " rank " << r << " " << repro(seed);
        // Sequence parallel on top: each TP rank holds a contiguous 1/tp of the CP piece.
        std::vector<RouteTable> sp;
        for (int64_t t = 0; t < tp; ++t) {
          sp.push_back(sp_split(mine, tp, t));
          std::vector<int64_t> rows;
          for (int64_t j = 0; j < mine.num_tokens() / tp; ++j)
            rows.push_back(t * (mine.num_tokens() / tp) + j);
          EXPECT_TRUE(route_tables_equal(sp.back(), ref::gather_rows(mine, rows, L, K, E)));
        }
        EXPECT_TRUE(route_tables_equal(sp_gather(sp), mine));
        pieces.push_back(mine);
      }
      EXPECT_TRUE(route_tables_equal(cp_zigzag_gather(pieces, p.cu_seqlens_padded), p.table));
    }
  }
  RouteTable t = RouteTable::none(6, 1, 1, 4);
  SY_EXPECT_THROW_MSG(
      cp_zigzag_split(t, {0, 6}, 2, 0), std::invalid_argument,
      "[cp_zigzag_split] sequence 0 has padded length 6, not a multiple of 2*cp_size=4");
  SY_EXPECT_THROW_MSG(sp_split(t, 4, 0), std::invalid_argument,
                      "[sp_split] num_tokens must be a multiple of tp_size=4, got 6");
  SY_EXPECT_THROW_MSG(cp_zigzag_split(t, {0, 4}, 1, 0), std::invalid_argument,
                      "must end at the table's 6 tokens");
}

TEST(RouteAlign, PipelineLayerRangesCountMoeLayersOnly) {
  // 8 hidden layers, first 2 dense (MoE layers are hidden 2..7).
  const std::vector<int64_t> moe{2, 3, 4, 5, 6, 7};
  EXPECT_EQ(pp_moe_layer_range(moe, 8, {2, 0, 1, 0, 0, 0}), (std::pair<int64_t, int64_t>{0, 2}));
  EXPECT_EQ(pp_moe_layer_range(moe, 8, {2, 1, 1, 0, 0, 0}), (std::pair<int64_t, int64_t>{2, 6}));
  // Virtual pipeline: 4 chunks of 2 hidden layers; chunk = vpp_rank * pp + pp_rank.
  EXPECT_EQ(pp_moe_layer_range(moe, 8, {2, 0, 2, 0, 0, 0}), (std::pair<int64_t, int64_t>{0, 0}));
  EXPECT_EQ(pp_moe_layer_range(moe, 8, {2, 1, 2, 0, 0, 0}), (std::pair<int64_t, int64_t>{0, 2}));
  EXPECT_EQ(pp_moe_layer_range(moe, 8, {2, 0, 2, 1, 0, 0}), (std::pair<int64_t, int64_t>{2, 4}));
  EXPECT_EQ(pp_moe_layer_range(moe, 8, {2, 1, 2, 1, 0, 0}), (std::pair<int64_t, int64_t>{4, 6}));
  // Uneven: first stage 2 layers, the rest split over 3 stages of 2.
  EXPECT_EQ(pp_moe_layer_range(moe, 8, {4, 0, 1, 0, 2, 0}), (std::pair<int64_t, int64_t>{0, 0}));
  EXPECT_EQ(pp_moe_layer_range(moe, 8, {4, 3, 1, 0, 2, 0}), (std::pair<int64_t, int64_t>{4, 6}));
  EXPECT_EQ(pp_moe_layer_range(moe, 8, {3, 2, 1, 0, 1, 3}), (std::pair<int64_t, int64_t>{3, 6}));
  EXPECT_EQ(pp_moe_layer_range(moe, 8, {3, 1, 1, 0, 1, 3}), (std::pair<int64_t, int64_t>{0, 3}));
  SY_EXPECT_THROW_MSG(pp_moe_layer_range(moe, 8, {3, 0, 1, 0, 0, 0}), std::invalid_argument,
                      "num_hidden_layers=8 must be divisible by pp_size*vpp_size=3");
  // Slices concatenate back to the table.
  std::mt19937_64 rng(test_seed(303));
  RouteTable t = random_table(rng, 7, 6, 2, 8);
  std::vector<RouteTable> parts;
  for (int64_t r = 0; r < 2; ++r) {
    auto [b, e] = pp_moe_layer_range(moe, 8, {2, r, 1, 0, 0, 0});
    parts.push_back(slice_layers(t, b, e));
    for (int64_t tok = 0; tok < 7; ++tok)
      for (int64_t l = b; l < e; ++l)
        for (int64_t k = 0; k < 2; ++k)
          ASSERT_EQ(ref::at(parts.back(), tok, l - b, k), ref::at(t, tok, l, k));
  }
  EXPECT_TRUE(route_tables_equal(concat_layers(parts), t));
}

TEST(RouteAlign, RecordedR2PassGathersBack) {
  // Full trainer layout: micro-batches of 2 sequences, packed for tp=2, cp=2; each (cp, tp) rank
  // records its own piece on each of 2 pipeline stages; gathering gives the sequences back.
  const uint64_t seed = test_seed(404);
  std::mt19937_64 rng(seed);
  const int64_t L = 4, K = 2, E = 8, tp = 2, cp = 2;
  const std::vector<int64_t> moe{0, 1, 2, 3};
  auto seqs = random_seqs(rng, 5, L, K, E);
  auto mbs = split_micro_batches(seqs, 2);
  ASSERT_EQ(mbs.size(), 3u);
  EXPECT_EQ(mbs[2].size(), 1u);
  std::vector<RouteTable> gathered;
  for (const auto& mb : mbs) {
    PackedRoutes p = pack_thd(mb, {tp, cp, 0});
    std::vector<RouteTable> cp_pieces;
    for (int64_t c = 0; c < cp; ++c) {
      RouteTable local = cp_zigzag_split(p.table, p.cu_seqlens_padded, cp, c);
      std::vector<RouteTable> tp_pieces;
      for (int64_t t = 0; t < tp; ++t) {
        RouteTable sp = sp_split(local, tp, t);
        std::vector<RouteTable> stages;
        for (int64_t s = 0; s < 2; ++s) {
          auto [b, e] = pp_moe_layer_range(moe, 4, {2, s, 1, 0, 0, 0});
          stages.push_back(slice_layers(sp, b, e));  // what rank (s, c, t) records
        }
        tp_pieces.push_back(concat_layers(stages));
      }
      cp_pieces.push_back(sp_gather(tp_pieces));
    }
    PackedRoutes back{cp_zigzag_gather(cp_pieces, p.cu_seqlens_padded), p.cu_seqlens,
                      p.cu_seqlens_padded};
    for (auto& s : unpack_thd(back)) gathered.push_back(std::move(s));
  }
  ASSERT_EQ(gathered.size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i)
    EXPECT_TRUE(route_tables_equal(gathered[i], seqs[i])) << repro(seed);
}

TEST(RouteStats, DriftHandComputed) {
  // 3 tokens, 2 layers, K 2.
  // token 0: layer 0 same set in another order, layer 1 one of two differs.
  // token 1: identical.  token 2: layer 0 is -1 in B (skipped), layer 1 both differ.
  RouteTable a = RouteTable::none(3, 2, 2, 8), b = RouteTable::none(3, 2, 2, 8);
  const std::vector<int32_t> va{1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4};
  const std::vector<int32_t> vb{2, 1, 3, 5, 5, 6, 7, 0, -1, -1, 6, 7};
  std::copy(va.begin(), va.end(), a.topk_idx.data<int32_t>());
  std::copy(vb.begin(), vb.end(), b.topk_idx.data<int32_t>());
  RouteDrift d = route_drift(a, b);
  EXPECT_EQ(d.num_tokens, 3);
  EXPECT_EQ(d.num_rows, 5);
  EXPECT_EQ(d.num_skipped_rows, 1);
  EXPECT_EQ(d.num_decisions, 10);
  EXPECT_EQ(d.num_differing_decisions, 3);
  EXPECT_EQ(d.num_differing_rows, 2);
  EXPECT_EQ(d.num_differing_tokens, 2);
  EXPECT_DOUBLE_EQ(d.decision_mismatch(), 0.3);
  EXPECT_DOUBLE_EQ(d.token_mismatch(), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(d.mean_differing_layers(), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(d.layer_mismatch(0), 0.0);
  EXPECT_DOUBLE_EQ(d.layer_mismatch(1), 3.0 / 6.0);
  SY_EXPECT_THROW_MSG(route_drift(a, RouteTable::none(2, 2, 2, 8)), std::invalid_argument,
                      "[route_drift] a and b must have the same shape");
}

TEST(RouteStats, DriftAgainstSetReference) {
  const uint64_t seed = test_seed(505);
  std::mt19937_64 rng(seed);
  for (int64_t E : {2, 8, 64}) {
    RouteTable a = random_table(rng, 50, 3, 2, E),
               b = a.topk_idx.defined() ? RouteTable{a.topk_idx.clone(), E} : a;
    std::uniform_real_distribution<double> u(0, 1);
    std::uniform_int_distribution<int64_t> ex(-1, E - 1);
    int32_t* pb = b.topk_idx.data<int32_t>();
    for (int64_t i = 0; i < b.topk_idx.numel(); ++i)
      if (u(rng) < 0.2) pb[i] = int32_t(ex(rng));
    const RouteDrift d = route_drift(a, b);
    const ref::DriftRef r = ref::drift(a, b);
    EXPECT_EQ(d.num_decisions, r.decisions) << repro(seed);
    EXPECT_EQ(d.num_differing_decisions, r.differing_decisions);
    EXPECT_EQ(d.num_tokens, r.tokens);
    EXPECT_EQ(d.num_differing_tokens, r.differing_tokens);
    EXPECT_EQ(d.num_differing_rows, r.differing_rows);
    EXPECT_EQ(route_drift(a, a).num_differing_decisions, 0);
  }
}

TEST(RouteStats, RowMismatchHandComputed) {
  // 3 tokens, 2 layers, K 2; tables[0] and tables[1] against the reference.
  // token 0: layer 0 same set reordered in table 0, another expert in table 1; layer 1 has a -1
  //          in the reference (not compared).  token 1: identical, then a repeated id (a multiset:
  //          {5, 5} differs from {5, 6}).  token 2: masked out (not compared).
  const std::vector<int32_t> ref{1, 2, 3, -1, 4, 9, 5, 6, 7, 0, 1, 2};
  const std::vector<int32_t> t0{2, 1, 3, 4, 4, 9, 5, 5, 0, 7, 8, 8};
  const std::vector<int32_t> t1{1, 3, -1, -1, 9, 4, 6, 5, 7, 1, 1, 2};
  Tensor r = Tensor::from_vector(ref, {3, 2, 2}), a = Tensor::from_vector(t0, {3, 2, 2}),
         b = Tensor::from_vector(t1, {3, 2, 2});
  Tensor mask = Tensor::from_vector(std::vector<uint8_t>{1, 1, 0}, {3});
  RowMismatch m = row_mismatch(r, mask, {a, b});
  EXPECT_EQ(m.num_compared_rows, 3);
  EXPECT_EQ(m.num_differing_rows, (std::vector<int64_t>{1, 1}));
  m = row_mismatch(r, Tensor(), {a, b});  // no mask: token 2's rows compared too
  EXPECT_EQ(m.num_compared_rows, 5);
  EXPECT_EQ(m.num_differing_rows, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(row_mismatch(r, Tensor(), {}).num_compared_rows, 5);
  // Layer 0 routes to 1 expert (its slot 1 is not part of its rows), layer 1 to 2.
  m = row_mismatch(r, mask, {a, b}, {1, 2});
  EXPECT_EQ(m.num_compared_rows, 3);
  EXPECT_EQ(m.num_differing_rows, (std::vector<int64_t>{2, 1}));
  SY_EXPECT_THROW_MSG(row_mismatch(r, mask, {a}, {1}), std::invalid_argument,
                      "[row_mismatch] top_ks must hold one K per layer (2), got 1");
  SY_EXPECT_THROW_MSG(row_mismatch(r, mask, {a}, {1, 3}), std::invalid_argument,
                      "[row_mismatch] top_ks[1] must be in [1, K=2], got 3");
  SY_EXPECT_THROW_MSG(row_mismatch(r, Tensor(), {Tensor::from_vector(t0, {6, 2})}),
                      std::invalid_argument, "[row_mismatch] tables[0]");
  SY_EXPECT_THROW_MSG(row_mismatch(r, Tensor::from_vector(std::vector<uint8_t>{1, 1}, {2}), {a}),
                      std::invalid_argument, "[row_mismatch] token_mask");
}

TEST(RouteStats, ExpertLoadAndHotExperts) {
  RouteTable t = RouteTable::none(4, 2, 2, 4);
  const std::vector<int32_t> v{0, 1, 2, 3, 0, 2, 2, 3, 0, 3, -1, -1, -1, -1, -1, -1};
  std::copy(v.begin(), v.end(), t.topk_idx.data<int32_t>());
  ExpertLoad load = expert_load(t);
  EXPECT_EQ(load.num_assignments, (std::vector<int64_t>{6, 4}));
  EXPECT_EQ(load.num_none_rows, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(load.count(0, 0), 3);
  EXPECT_EQ(load.count(0, 1), 1);
  EXPECT_EQ(load.count(0, 2), 1);
  EXPECT_EQ(load.count(0, 3), 1);
  EXPECT_EQ(load.count(1, 2), 2);
  EXPECT_EQ(load.count(1, 3), 2);
  auto hot = hot_experts(load, 0, 2);
  ASSERT_EQ(hot.size(), 2u);
  EXPECT_EQ(hot[0].expert, 0);
  EXPECT_DOUBLE_EQ(hot[0].share, 0.5);
  EXPECT_EQ(hot[1].expert, 1);  // tie broken by lower id
  EXPECT_DOUBLE_EQ(load_imbalance(load, 0), 3.0 * 4 / 6);
  EXPECT_DOUBLE_EQ(load_imbalance(load, 1), 2.0 * 4 / 4);
  accumulate_expert_load(t, load);
  EXPECT_EQ(load.count(0, 0), 6);
  SY_EXPECT_THROW_MSG(accumulate_expert_load(RouteTable::none(1, 3, 2, 4), load),
                      std::invalid_argument,
                      "[expert_load] table must have num_experts=4 and num_moe_layers=2");
}

}  // namespace
}  // namespace switchyard
