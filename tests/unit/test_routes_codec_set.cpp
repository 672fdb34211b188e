// Format version 3's set-coded blocks (src/routes/route_codec_set.cpp): every id pattern round
// trips exactly, slot order included; shapes set coding does not cover fall back to token delta;
// corrupt payloads are errors (or some in-range table), never reads outside the payload (the
// payload is copied into an exactly sized buffer, so ASan in the sanitizer build sees any).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "routes/route_codec.h"
#include "switchyard/route_file.h"

namespace {

using namespace switchyard;
using detail::PayloadCoding;

struct Shape {
  int64_t T, L, K, E;
};

// Zipf-like ids per layer, each (layer, slot) repeating the previous token's id with probability
// `repeat`, rows shuffled (a top-k's slot order is not sorted), -1 rows and entries and repeated
// ids within a row with the given shares.
std::vector<int32_t> make_table(std::mt19937_64& rng, Shape s, double repeat, double none_rows,
                                double none_ids, double dup_rows) {
  std::vector<int32_t> v(size_t(s.T * s.L * s.K));
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<double> cdf(size_t(s.E));
  double acc = 0;
  for (int64_t r = 0; r < s.E; ++r) cdf[size_t(r)] = (acc += 1.0 / std::pow(double(r + 1), 1.1));
  const auto draw = [&] {
    const double x = u(rng) * acc;
    return int32_t(
        std::min<int64_t>(std::lower_bound(cdf.begin(), cdf.end(), x) - cdf.begin(), s.E - 1));
  };
  for (int64_t t = 0; t < s.T; ++t) {
    for (int64_t l = 0; l < s.L; ++l) {
      int32_t* row = v.data() + (t * s.L + l) * s.K;
      const int32_t* prev = t > 0 ? row - s.L * s.K : nullptr;
      for (int64_t k = 0; k < s.K; ++k) {
        if (prev && u(rng) < repeat) {
          row[k] = prev[k];
          continue;
        }
        // distinct from the row so far when the experts allow it
        int32_t id = draw();
        for (int tries = 0; tries < 64 && std::find(row, row + k, id) != row + k; ++tries)
          id = draw();
        row[k] = id;
      }
      if (u(rng) < dup_rows && s.K > 1) row[s.K - 1] = row[0];
      for (int64_t k = 0; k < s.K; ++k) {
        if (u(rng) < none_ids) row[k] = -1;
      }
      if (u(rng) < none_rows) std::fill(row, row + s.K, -1);
    }
  }
  return v;
}

// encode_payload then decode_payload from an exactly sized copy (plus the slack the token-delta
// decoder may read); returns the flags.
uint32_t round_trip(const std::vector<int32_t>& v, Shape s, PayloadCoding coding,
                    std::vector<int32_t>& out, std::string* payload = nullptr) {
  std::string raw;
  detail::PayloadPieces pc;
  const uint32_t flags = detail::encode_payload(v.data(), s.T, s.L, s.K, s.E, raw, pc, coding);
  EXPECT_NE(flags, detail::kBadIds);
  if (!detail::block_is_set_coded(flags)) return flags;  // token delta: route_file's tests
  EXPECT_TRUE(pc.stored);
  std::unique_ptr<char[]> buf(new char[raw.size()]);
  std::memcpy(buf.get(), raw.data(), raw.size());
  out.assign(v.size(), 7);
  const std::string err =
      detail::decode_payload(buf.get(), int64_t(raw.size()), s.T, s.L, s.K, s.E, flags, out.data());
  EXPECT_EQ(err, "");
  if (payload) *payload = raw;
  return flags;
}

TEST(RouteCodecSet, EveryIdPatternRoundTripsExactlySlotOrderIncluded) {
  const Shape shapes[] = {{1, 1, 1, 1},      {1, 3, 8, 128},    {7, 2, 2, 2},     {33, 4, 8, 8},
                          {1031, 3, 8, 128}, {200, 2, 8, 256},  {100, 2, 6, 300}, {64, 2, 9, 64},
                          {50, 2, 16, 4096}, {300, 1, 1, 1000}, {40, 3, 16, 16},  {20, 2, 4, 65}};
  const double repeats[] = {0.0, 0.6, 1.0};
  int n = 0;
  for (const Shape& s : shapes) {
    for (double repeat : repeats) {
      for (int variant = 0; variant < 4; ++variant) {
        const uint64_t seed = 1000 + uint64_t(n++);
        std::mt19937_64 rng(seed);
        const double none_rows = variant == 1 ? 0.2 : (variant == 3 ? 1.0 : 0.0);
        const double none_ids = variant == 2 ? 0.1 : 0.0;
        const double dups = variant == 2 ? 0.2 : 0.0;
        const auto v = make_table(rng, s, repeat, none_rows, none_ids, dups);
        for (PayloadCoding c : {PayloadCoding::set_delta, PayloadCoding::automatic}) {
          std::vector<int32_t> out;
          const uint32_t flags = round_trip(v, s, c, out);
          if (c == PayloadCoding::set_delta) {
            ASSERT_TRUE(detail::block_is_set_coded(flags)) << "seed " << seed;
          }
          if (detail::block_is_set_coded(flags)) {
            ASSERT_EQ(out, v) << "seed " << seed << " T " << s.T << " L " << s.L << " K " << s.K
                              << " E " << s.E << " repeat " << repeat << " variant " << variant;
          }
        }
      }
    }
  }
}

TEST(RouteCodecSet, EveryRowEscapedLeavesTheHighMaskTableUnusedAndStillDecodes) {
  // K > 8 with no mask row at all (every row repeats an id: escaped raw): the high mask table is
  // empty, and the decoder must not ask for it (found by a sanitizer run of random tables).
  for (int64_t K : {9, 16}) {
    const Shape s{5, 2, K, 64};
    std::vector<int32_t> v(size_t(s.T * s.L * s.K));
    for (size_t i = 0; i < v.size(); ++i) v[i] = int32_t((i * 7) % 5);  // repeats in every row
    std::vector<int32_t> out;
    ASSERT_TRUE(detail::block_is_set_coded(round_trip(v, s, PayloadCoding::set_delta, out)));
    EXPECT_EQ(out, v) << "K " << K;
  }
}

TEST(RouteCodecSet, ShapesOutsideSetCodingFallBackToTokenDelta) {
  std::mt19937_64 rng(7);
  for (Shape s : {Shape{50, 2, 17, 64}, Shape{50, 2, 8, 5000}, Shape{0, 2, 8, 128}}) {
    const auto v = make_table(rng, s, 0.5, 0.0, 0.0, 0.0);
    std::vector<int32_t> out;
    const uint32_t flags = round_trip(v, s, PayloadCoding::set_delta, out);
    EXPECT_TRUE(flags & detail::kBlockTokenDelta) << s.K << " " << s.E;
    EXPECT_FALSE(detail::block_is_set_coded(flags));
  }
}

TEST(RouteCodecSet, OutOfRangeIdsAreRefused) {
  std::vector<int32_t> v(2 * 8, 3);
  v[11] = 128;
  std::string raw;
  detail::PayloadPieces pc;
  EXPECT_EQ(detail::encode_payload(v.data(), 2, 1, 8, 128, raw, pc, PayloadCoding::set_delta),
            detail::kBadIds);
  v[11] = -2;
  EXPECT_EQ(detail::encode_payload(v.data(), 2, 1, 8, 128, raw, pc, PayloadCoding::set_delta),
            detail::kBadIds);
}

TEST(RouteCodecSet, PopularityOrderedRowsPayLittleForTheirOrder) {
  // The same sets in a top-k's order (most popular first) and shuffled: the order costs bits only
  // when it carries information (log2(8!)/8 = 1.9 bits/id for a random order).
  std::mt19937_64 rng(11);
  const Shape s{2000, 4, 8, 128};
  auto v = make_table(rng, s, 0.0, 0.0, 0.0, 0.0);
  std::vector<int32_t> sorted = v;
  std::vector<int64_t> count(size_t(s.L * s.E), 0);
  for (int64_t i = 0; i < int64_t(v.size()); ++i)
    ++count[size_t((i / s.K) % s.L * s.E + v[size_t(i)])];
  for (int64_t r = 0; r < s.T * s.L; ++r) {
    const int64_t l = r % s.L;
    std::sort(sorted.begin() + r * s.K, sorted.begin() + (r + 1) * s.K, [&](int32_t a, int32_t b) {
      const int64_t ca = count[size_t(l * s.E + a)], cb = count[size_t(l * s.E + b)];
      return ca != cb ? ca > cb : a < b;
    });
  }
  std::vector<int32_t> out;
  std::string p_sorted, p_random;
  round_trip(sorted, s, PayloadCoding::set_delta, out, &p_sorted);
  EXPECT_EQ(out, sorted);
  round_trip(v, s, PayloadCoding::set_delta, out, &p_random);
  EXPECT_EQ(out, v);
  const double ids = double(v.size());
  EXPECT_GT(8.0 * double(p_random.size()) / ids - 8.0 * double(p_sorted.size()) / ids, 1.5);
}

// Any coding (set or token delta) through encode_payload / decode_payload: the token-delta raw
// payload is the concatenation of the pieces the writer compresses, plus the decoder's slack.
std::vector<int32_t> any_round_trip(const std::vector<int32_t>& v, Shape s, PayloadCoding coding,
                                    uint32_t* flags_out = nullptr) {
  std::string out;
  detail::PayloadPieces pc;
  const uint32_t flags = detail::encode_payload(v.data(), s.T, s.L, s.K, s.E, out, pc, coding);
  EXPECT_NE(flags, detail::kBadIds);
  std::string raw = out;
  if (!pc.stored) {
    raw = out.substr(0, size_t(pc.lit_offset + pc.lit_size)) +
          out.substr(size_t(pc.none_offset), size_t(pc.none_size));
  }
  std::unique_ptr<char[]> buf(new char[raw.size() + size_t(detail::kPayloadSlack)]());
  std::memcpy(buf.get(), raw.data(), raw.size());
  std::vector<int32_t> back(v.size(), 7);
  EXPECT_EQ(detail::decode_payload(buf.get(), int64_t(raw.size()), s.T, s.L, s.K, s.E, flags,
                                   back.data()),
            "");
  if (flags_out) *flags_out = flags;
  return back;
}

// K distinct experts per row drawn by Zipf weight (exponent `zipf_s`) over a per-layer random
// permutation, slots in popularity order (a top-k's order), no token-to-token correlation.
std::vector<int32_t> topk_rows(std::mt19937_64& rng, Shape s, double zipf_s) {
  std::vector<int32_t> v(size_t(s.T * s.L * s.K));
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<double> cdf(size_t(s.E));
  double acc = 0;
  for (int64_t r = 0; r < s.E; ++r) cdf[size_t(r)] = (acc += std::pow(double(r + 1), -zipf_s));
  std::vector<std::vector<int32_t>> perm(size_t(s.L), std::vector<int32_t>(size_t(s.E)));
  for (auto& p : perm) {
    std::iota(p.begin(), p.end(), 0);
    std::shuffle(p.begin(), p.end(), rng);
  }
  std::vector<int64_t> ranks;
  for (int64_t t = 0; t < s.T; ++t) {
    for (int64_t l = 0; l < s.L; ++l) {
      ranks.clear();
      while (int64_t(ranks.size()) < s.K) {
        const int64_t r = std::min<int64_t>(
            std::lower_bound(cdf.begin(), cdf.end(), u(rng) * acc) - cdf.begin(), s.E - 1);
        if (std::find(ranks.begin(), ranks.end(), r) == ranks.end()) ranks.push_back(r);
      }
      std::sort(ranks.begin(), ranks.end());
      for (int64_t k = 0; k < s.K; ++k)
        v[size_t((t * s.L + l) * s.K + k)] = perm[size_t(l)][size_t(ranks[size_t(k)])];
    }
  }
  return v;
}

TEST(RouteCodecSet, EveryTopKAndExpertCountRoundTripsDegenerateTablesIncluded) {
  // Every K set coding covers and two it does not; E from 1 to 65536; tables of one repeated id,
  // all -1, padding rows around routed ones, and top-k rows in popularity order.
  int n = 0;
  for (int64_t K = 1; K <= 18; K = K < 16 ? K + 1 : K + 2) {
    for (int64_t E : {int64_t(1), int64_t(2), K, int64_t(64), int64_t(4096), int64_t(65536)}) {
      for (int64_t T : {1, 2, 300}) {
        for (int kind = 0; kind < 4; ++kind) {
          const uint64_t seed = 5000 + uint64_t(n++);
          std::mt19937_64 rng(seed);
          const Shape s{T, 2, K, E};
          std::vector<int32_t> v(size_t(s.T * s.L * s.K), 0);  // kind 0: every id 0
          if (kind == 1) std::fill(v.begin(), v.end(), -1);
          if (kind >= 2 && E >= K) v = topk_rows(rng, s, 1.0);
          if (kind == 3) {  // padding: the first and last quarter of the tokens unrouted
            const int64_t row = s.L * s.K, pad = (T + 3) / 4;
            std::fill(v.begin(), v.begin() + pad * row, -1);
            std::fill(v.end() - pad * row, v.end(), -1);
          }
          for (PayloadCoding c : {PayloadCoding::set_delta, PayloadCoding::automatic}) {
            uint32_t flags = 0;
            EXPECT_EQ(any_round_trip(v, s, c, &flags), v)
                << "seed " << seed << " T " << T << " K " << K << " E " << E << " kind " << kind;
            if (c == PayloadCoding::set_delta) {
              EXPECT_EQ(detail::block_is_set_coded(flags), K <= 16 && E <= 4096)
                  << "K " << K << " E " << E;
            }
          }
        }
      }
    }
  }
}

TEST(RouteCodecSet, UncorrelatedTopKRowsCodeWithin1_2xOfTheSetBoundAndRepeatsUseTheMask) {
  // The bound, from the maths: each layer's order-0 entropy of its ids less log2(K!)/K bits per
  // id (a top-k set carries no information in its order when the slots follow popularity).
  std::mt19937_64 rng(21);
  const Shape s{1024, 4, 8, 128};
  const auto v = topk_rows(rng, s, 1.0);
  std::vector<double> count(size_t(s.L * s.E), 0.0);
  for (size_t i = 0; i < v.size(); ++i) count[size_t(int64_t(i) / s.K % s.L * s.E + v[i])] += 1;
  double bits = 0;
  for (double c : count) {
    if (c > 0) bits -= c * std::log2(c / double(s.T * s.K));
  }
  double log2_kfact = 0;
  for (int64_t k = 2; k <= s.K; ++k) log2_kfact += std::log2(double(k));
  const double ids = double(v.size()), bound = bits / ids - log2_kfact / double(s.K);
  std::vector<int32_t> out;
  std::string p;
  const uint32_t flags = round_trip(v, s, PayloadCoding::automatic, out, &p);
  ASSERT_TRUE(detail::block_is_set_coded(flags));
  ASSERT_EQ(out, v);
  const double got = 8.0 * double(p.size()) / ids;
  EXPECT_LT(got, 1.2 * bound) << "bits per id " << got << ", bound " << bound;
  // The same rows with each token repeating the previous one's row half the time: the match mask
  // pays there (forced set coding; the writer would pick token delta): 0.6x the size here.
  std::vector<int32_t> w = v;
  std::uniform_real_distribution<double> u(0, 1);
  const int64_t row = s.L * s.K;
  for (int64_t t = 1; t < s.T; ++t) {
    for (int64_t l = 0; l < s.L; ++l) {
      if (u(rng) < 0.5) {
        std::copy_n(w.begin() + (t - 1) * row + l * s.K, s.K, w.begin() + t * row + l * s.K);
      }
    }
  }
  std::string q;
  round_trip(w, s, PayloadCoding::set_delta, out, &q);
  ASSERT_EQ(out, w);
  EXPECT_LT(double(q.size()), 0.7 * double(p.size())) << q.size() << " vs " << p.size();
}

TEST(RouteCodecSet, CorruptPayloadsAreErrorsOrInRangeTables) {
  std::mt19937_64 rng(5);
  const Shape s{60, 3, 8, 128};
  const auto v = make_table(rng, s, 0.6, 0.05, 0.02, 0.05);
  std::vector<int32_t> out;
  std::string p;
  const uint32_t flags = round_trip(v, s, PayloadCoding::set_delta, out, &p);
  ASSERT_TRUE(detail::block_is_set_coded(flags));
  ASSERT_EQ(out, v);
  const auto decode = [&](const std::string& bad, uint32_t f) {
    std::unique_ptr<char[]> buf(new char[std::max<size_t>(bad.size(), 1)]);
    std::memcpy(buf.get(), bad.data(), bad.size());
    std::vector<int32_t> o(v.size(), 0);
    const std::string err =
        detail::decode_payload(buf.get(), int64_t(bad.size()), s.T, s.L, s.K, s.E, f, o.data());
    if (err.empty()) {
      for (int32_t id : o) EXPECT_TRUE(id >= -1 && id < s.E);
    }
    return err;
  };
  // Every cut is an error (the sizes no longer fill the payload).
  for (size_t n = 0; n < p.size(); n += 1 + n / 16) {
    EXPECT_NE(decode(p.substr(0, n), flags), "") << "cut at " << n;
  }
  // Flipped bits anywhere: an error or an in-range table.
  int errors = 0;
  for (size_t i = 0; i < p.size() * 8; i += 3) {
    std::string bad = p;
    bad[i / 8] = static_cast<char>(bad[i / 8] ^ (1 << (i % 8)));
    errors += decode(bad, flags) != "";
  }
  EXPECT_GT(errors, int(p.size() * 8 / 3) / 2);  // the end-state and stream checks catch most
  // Specific structure errors name what is wrong.
  std::string bad = p;
  bad[0] = 11;
  EXPECT_NE(decode(bad, flags).find("scale 11 bits"), std::string::npos);
  bad = p;
  bad[1] = static_cast<char>(bad[1] + 1);
  EXPECT_NE(decode(bad, flags).find("do not fill"), std::string::npos);
  (void)decode(p, flags & ~detail::kBlockRanked);  // read as unranked: error or in-range ids
  EXPECT_NE(decode(p + std::string(1, '\0'), flags), "");
}

TEST(RouteCodecSet, WriterWritesVersion3AndSetBlocksOnlyInVersion3Files) {
  EXPECT_EQ(detail::kFormatVersion, 3u);
  EXPECT_TRUE(detail::block_flags_valid(3, detail::kBlockSetDelta | detail::kBlockRanked));
  EXPECT_TRUE(detail::block_flags_valid(3, detail::kBlockTokenDelta));
  EXPECT_FALSE(detail::block_flags_valid(2, detail::kBlockSetDelta));
  EXPECT_FALSE(detail::block_flags_valid(3, detail::kBlockSetDelta | detail::kBlockTokenDelta));
  EXPECT_FALSE(detail::block_flags_valid(3, 0));
  EXPECT_TRUE(detail::block_flags_valid(1, detail::kBlockRanked | detail::kBlockHasNone));
  // Through the file format: a large table is set-coded and reads back.
  std::mt19937_64 rng(3);
  const Shape s{1500, 4, 8, 128};
  const auto v = make_table(rng, s, 0.0, 0.01, 0.0, 0.0);  // uncorrelated: set-coded
  RouteTable t;
  t.num_experts = s.E;
  t.topk_idx = Tensor::empty({s.T, s.L, s.K}, DType::int32);
  std::memcpy(t.topk_idx.raw(), v.data(), v.size() * 4);
  RouteFileInfo info;
  info.num_experts = s.E;
  info.top_k = s.K;
  info.num_moe_layers = s.L;
  const Tensor blob = encode_route_file({t}, info, {});
  RouteFileInfo got;
  const auto back = decode_route_file(
      std::string_view(static_cast<const char*>(blob.raw()), size_t(blob.nbytes())), &got, {});
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(got.version, 3);
  EXPECT_TRUE(route_tables_equal(back[0], t));
  const auto* p = static_cast<const char*>(blob.raw());
  const int64_t hsize = detail::get_u32(p + 12);
  EXPECT_TRUE(detail::get_u32(p + hsize + 4) & detail::kBlockSetDelta);
}

}  // namespace
