// Set-coded blocks of format versions 4 (written now) and 3 (still read) (src/routes/
// route_codec_set.cpp): every id pattern round trips exactly, slot order included, in both; shapes set coding does not cover fall back to token delta;
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
#include "switchyard/cpu.h"
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
        for (PayloadCoding c : {PayloadCoding::set_delta, PayloadCoding::set_delta_v3,
                                PayloadCoding::automatic}) {
          std::vector<int32_t> out;
          const uint32_t flags = round_trip(v, s, c, out);
          if (c == PayloadCoding::set_delta) {
            ASSERT_TRUE(flags & detail::kBlockSetRows) << "seed " << seed;
          }
          if (c == PayloadCoding::set_delta_v3) {
            ASSERT_TRUE(flags & detail::kBlockSetDelta) << "seed " << seed;
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
  for (PayloadCoding coding : {PayloadCoding::set_delta, PayloadCoding::set_delta_v3}) {
  SCOPED_TRACE(coding == PayloadCoding::set_delta ? "version 4" : "version 3");
  std::mt19937_64 rng(5);
  const Shape s{60, 3, 8, 128};
  const auto v = make_table(rng, s, 0.6, 0.05, 0.02, 0.05);
  std::vector<int32_t> out;
  std::string p;
  const uint32_t flags = round_trip(v, s, coding, out, &p);
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
  const size_t head_size_at = coding == PayloadCoding::set_delta ? 5 : 1;  // u32 after the scale
  bad[head_size_at] = static_cast<char>(bad[head_size_at] + 1);
  EXPECT_NE(decode(bad, flags).find("do not fill"), std::string::npos);
  (void)decode(p, flags & ~detail::kBlockRanked);  // read as unranked: error or in-range ids
  EXPECT_NE(decode(p + std::string(1, '\0'), flags), "");
  if (coding == PayloadCoding::set_delta) {  // version 4: the cluster count is checked
    bad = p;
    bad[1] = 0;
    EXPECT_NE(decode(bad, flags).find("table clusters"), std::string::npos);
    bad[1] = 33;
    EXPECT_NE(decode(bad, flags).find("table clusters"), std::string::npos);
  }
  }
}

TEST(RouteCodecSet, WriterWritesVersion4AndSetBlocksOnlyInTheirVersions) {
  EXPECT_EQ(detail::kFormatVersion, 4u);
  EXPECT_TRUE(detail::block_flags_valid(4, detail::kBlockSetRows | detail::kBlockRanked));
  EXPECT_TRUE(detail::block_flags_valid(4, detail::kBlockSetDelta | detail::kBlockRanked));
  EXPECT_FALSE(detail::block_flags_valid(3, detail::kBlockSetRows));
  EXPECT_FALSE(detail::block_flags_valid(4, detail::kBlockSetRows | detail::kBlockSetDelta));
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
  EXPECT_EQ(got.version, 4);
  EXPECT_TRUE(route_tables_equal(back[0], t));
  const auto* p = static_cast<const char*>(blob.raw());
  const int64_t hsize = detail::get_u32(p + 12);
  EXPECT_TRUE(detail::get_u32(p + hsize + 4) & detail::kBlockSetRows);
}

// A version 3 file written by main at de0ea3a (before version 4): one sequence of 200 tokens, 2
// layers, K 8, E 16, ids from v3_fixture_ids (token 7 layer 1 all -1); block flags 11 (set-coded
// version 3, ranked, -1 bitmap).
constexpr const char* kV3FixtureHex =
    "5359524f555445530300000030000000100000000800000002000000010000000000000000000000ff35043233ebf352"
    "5359424b0b0000000000000000000000c800000000000000eb06000000000000eb06000000000000a7ffe89f0111d1c0"
    "e5e324d9d0887ee70c520100008c050000000000001072846395cbeafd75a986fbed20134c00d0feffffffffffffffff"
    "ffffffffffffffffffffffffffffffffffffffffffffffffc87f803840266006500e3c8131600138013be00444800834"
    "68c0130952600744400502c00c100101a8000b400488003ea0811454a0074e400418831ea4a0022948410af800eea042"
    "22410552200202102041007a688007d8e183133ed8c10926b0030fb08313ecc0039c60023b7c1c7cf8c008ec381c9860"
    "e1c0091f167cf8f0c10926f8f071018be0042798e0c3c2c1870526e0010becf061c102132c1c0e4cc003167c30e170b0"
    "e083093e0e9c38f8b0e08309162c30c1878f033b98608113ec60c2c18285033b0e3e7c58f0e1c382053cc0091f87c381"
    "1d070b78c082051f561c2c00a606b00680bb00f402205080cf00b0f04014daff07806e00703d4060801dc01cfc7008f9"
    "0120dc0125ff3f004c0180ea016400500148030550f03f41348c00940a09002cfa38707639121ca0b7015255b573859e"
    "fa6bf7a7db8af8fb51300d4a35425e269d4dc47d986d0a70004b90f8b81b53311ce79ed05f8dc38b58a8da392b04d7aa"
    "7be3de7dc9b2f1c06462d572140742c89c401899d59000ca4948502ee02daa282ae7eddca231f02d80d7c23447b380a0"
    "a57392cf24693498b43152b136fd78a73aa3729600c23e8c7d078385df7b9051970dfeafebe83264f4bb721c25d0115b"
    "a6e1e823e9d74c023dbc9fbe93fff879063cebc34d973ac01781f9714395fdb804a09b47971b007a8c41a4c477f6235a"
    "48f8f7b4895f4c2eac7387ea50e7316d0f05622fd5871e51ee7717a290d50931cc7098417fd35b19ade71d34acd2984e"
    "644400eb550622f6a9f82df7f93fcaeff1759f4f619a3c42be3f91fca16dfc21d6f4b321bf81c2cab04eb7c0996cab21"
    "6cd7885ac9b134c5ffb692791ca64c384bf4eddc93ceb3d34fb271aac75fe8d83286a03250b8da7505f3fac635fbdcb9"
    "f614e2e636a4cafffbaafb1dd0c918c8dc6a25f7ca8891c2c619d6dc98d620a86e0c9526795e2dd1d765e128da700576"
    "1456dd30af3603959a8b5ec2d4dc7350a4bcfe0e6f91cad4bc60693011f37eb26065d3da7007959ffe1337aaf35dac89"
    "1c17568e1c357d9bedf8523f2ee2924918e6d5687bdced07897eac6f902e7cd4e0a961195080776500ce8a7d3463201a"
    "5ef7fb3b7388279858f008eb925a03292862784dab7413a5ec6d18f4ab94e12c51acf99237ceaf776b430961d695434d"
    "ede886d58d387329329de97a50780294cdab2e36afdd686a7ab090bdf9fdb975db0b6954021c4587c6cc1ffe91a22b11"
    "ee33ed85098680fa2f5d310a44116c12c477680d453f5e94aeec99e490273c58dd4906c6c840c6e36eab489b73ffd8ed"
    "8def34799aaf342a3e0214809fb3838336ea07bf01a54b4dfadbcaeb6e9606a6400a0090d784f46ef2378e69a34de8d9"
    "9a4b1bba1dcb0e904d7d7671ac7a27780ecffb47d74750bd8eee737ed0463bd8117e22c75c57b6b418845b701ec716b2"
    "cdd5c930df226f7b6e583dc27cfe8cee49b4e8eefac4430b8c457a6e7577c984978bbbd3a65c31411b1e8c9ae3771d0a"
    "25bb30497e01aa30f232ee73de2ede4f9992e87ab732021dd64112be29e9d25b57b58c8d49a4c226f3d5a5b9f1280634"
    "c378cecd98b3b626fd34ab2c9fb77c6b85201fc50f23658a47c57a4471ea261ec31fd071ebac15074661358e35ea8e45"
    "c186cc1ad072cfa8d8ccc1497c98ab6903a1fea10825c414a53d6b2ca1418bd2f52e219bed847455d94e6bd81a3b6fc0"
    "a94ff6a4ebdb51356af15669a91e2448fc4024ebdf50174c86c3b3d2a525da13e9942f20bea0c52933b8f50b42c54546"
    "90b411c4da63a20ad5837aeaeff25a2c86f232e433edfaf25e0a956475a9484c768deaa1fcda1c63a6113905e800df84"
    "223f5b0cde2f13c478c9578ae5e2ac168d2f73061fdf21bc79f353ae3399da2f437254d9e304145c80e7c25c4d6ec202"
    "ada29258d38d72551976273ec8237457c36cfb02dc77601996f884fd2d8a742ef54e69b24030fa4dd3b3bb21742841a9"
    "e7a57280ed0f7faa834bfe017ea39a7126ec58e241a8bc0296c62520e0791a27acec4b438750052f57f4b3b1e0081b29"
    "4bb202e7f6411c245b5d1946da06144993ddbe7f872912dd35a9c877f82e5d25396759c60ac27d69a4f1fb76ff4af2ce"
    "6b92dd9d441c2e14b64c87474d45bb015796219fdd200dd48987ae5ed8a78a7f502b038f7184d98a44bb88d02bc73e6c"
    "bec4fadc79a14b10fd37d7260f722ae1fdeb1f98cfd1f01f7a01e8c7e0e3f862a783714de17b9e41851c55f8938ae638"
    "b0880af150826f4c7cd221ed0c07086ccfc304f85964fdf5288f9010f01eec27dfb0c28d573c6be17dcde4c3a009f57d"
    "9a94a444a5a5ccae463b73f392401f44d41c8c54acd3edad64bfc71dfe7c81cf4d0fceb03ab226571499e9d0d38a88f3"
    "f33944535949580000000001000000000000003000000000000000c8000000000000002307000000000000ede2998b65"
    "f8720e5307000000000000e82b78c6f58a9a0253595254454e4431";

// The ids of the fixture (the generator that wrote it, in numpy): an LCG's high bits squared,
// so low ids are popular; layer l shifts ids by 5 l; K distinct ids per row.
std::vector<int32_t> v3_fixture_ids() {
  const int64_t T = 200, L = 2, K = 8, E = 16;
  std::vector<int32_t> v(size_t(T * L * K), -1);
  uint64_t x = 1;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t l = 0; l < L; ++l) {
      int32_t* row = v.data() + (t * L + l) * K;
      int n = 0;
      while (n < K) {
        x = (x * 1103515245u + 12345u) % (uint64_t{1} << 31);
        const uint64_t u = x >> 16;
        const int32_t e = int32_t((((u * u) >> 26) % E + 5 * l) % E);
        if (std::find(row, row + n, e) == row + n) row[n++] = e;
      }
    }
  }
  std::fill_n(v.begin() + (7 * L + 1) * K, K, -1);
  return v;
}

TEST(RouteCodecSet, AVersion3FileWrittenBeforeVersion4StillReads) {
  const std::string hex = kV3FixtureHex;
  std::string blob(hex.size() / 2, '\0');
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = char(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  EXPECT_EQ(detail::get_u32(blob.data() + 8), 3u);
  const int64_t hsize = detail::get_u32(blob.data() + 12);
  EXPECT_EQ(detail::get_u32(blob.data() + hsize + 4),
            detail::kBlockSetDelta | detail::kBlockRanked | detail::kBlockHasNone);
  RouteFileInfo got;
  const auto back = decode_route_file(blob, &got, {});
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(got.version, 3);
  const auto want = v3_fixture_ids();
  ASSERT_EQ(back[0].topk_idx.numel(), int64_t(want.size()));
  EXPECT_TRUE(std::equal(want.begin(), want.end(), back[0].topk_idx.data<int32_t>()));
}

// The hot passes are built for the baseline ISA and for AVX2 (picked by cpu_isa()): both write the
// same bytes and read each other's. Rows in id order (the table's popularity order, so mostly rank
// order) exercise the AVX2 rows' in-order step, shuffled ones their sort and Lehmer digits.
TEST(RouteCodecSet, BaselineAndAvx2PathsWriteTheSameBytes) {
  if (!cpu_supports(CpuIsa::avx2)) GTEST_SKIP() << "this CPU has no AVX2 (only one path to run)";
  const CpuIsa was = cpu_isa();
  const Shape shapes[] = {{1031, 3, 8, 128}, {300, 2, 16, 300}, {200, 2, 6, 64}, {50, 2, 9, 4096},
                          {400, 3, 1, 16},   {400, 2, 4, 300},  {300, 2, 8, 4096},
                          // every K of the AVX2 row's order-symbol weights (groups per K)
                          {200, 2, 2, 16},   {200, 2, 3, 64},   {200, 2, 5, 300},
                          {200, 2, 7, 128}};
  int n = 0;
  for (const Shape& s : shapes) {
    for (const auto& [repeat, in_order] : {std::pair{0.0, 0.0}, {0.6, 0.0}, {0.0, 0.8}, {0.3, 0.8}}) {
      std::mt19937_64 rng(77 + uint64_t(n++));
      auto v = make_table(rng, s, repeat, 0.05, 0.02, 0.05);
      std::uniform_real_distribution<double> u(0, 1);
      for (int64_t r = 0; r < s.T * s.L; ++r) {
        if (u(rng) < in_order) std::sort(v.begin() + r * s.K, v.begin() + (r + 1) * s.K);
      }
      std::string p[2];
      uint32_t flags[2];
      std::vector<int32_t> out;
      for (int i = 0; i < 2; ++i) {
        set_cpu_isa(i == 0 ? CpuIsa::scalar : CpuIsa::avx2);
        flags[i] = round_trip(v, s, PayloadCoding::set_delta, out, &p[i]);
        ASSERT_TRUE(flags[i] & detail::kBlockSetRows);
        ASSERT_EQ(out, v);
      }
      EXPECT_EQ(flags[0], flags[1]);
      EXPECT_EQ(p[0], p[1]) << "K " << s.K << " E " << s.E << " repeat " << repeat
                            << " in order " << in_order;
      set_cpu_isa(CpuIsa::scalar);  // the scalar decoder reads the AVX2 encoder's bytes
      std::vector<int32_t> o(v.size());
      EXPECT_EQ(detail::decode_payload(p[1].data(), int64_t(p[1].size()), s.T, s.L, s.K, s.E,
                                       flags[1], o.data()),
                "");
      EXPECT_EQ(o, v);
    }
  }
  set_cpu_isa(was);
}

// Version 4 shares one pair of tables among layers whose rank statistics agree: the same skew in
// every layer is one cluster; a near-uniform layer among skewed ones gets its own.
TEST(RouteCodecSet, LayersWithTheSameStatisticsShareTheirTables) {
  const Shape s{2000, 4, 8, 128};
  std::mt19937_64 rng(9);
  auto v = make_table(rng, s, 0.0, 0.0, 0.0, 0.0);
  std::vector<int32_t> out;
  std::string p;
  ASSERT_TRUE(round_trip(v, s, PayloadCoding::set_delta, out, &p) & detail::kBlockSetRows);
  ASSERT_EQ(out, v);
  EXPECT_EQ(detail::get_u32(p.data() + 1), 1u);
  // Layer 2 uniform: 8 distinct ids drawn evenly.
  std::uniform_int_distribution<int32_t> any(0, int32_t(s.E - 1));
  for (int64_t t = 0; t < s.T; ++t) {
    int32_t* row = v.data() + (t * s.L + 2) * s.K;
    for (int64_t k = 0; k < s.K; ++k) {
      int32_t id = any(rng);
      while (std::find(row, row + k, id) != row + k) id = any(rng);
      row[k] = id;
    }
  }
  ASSERT_TRUE(round_trip(v, s, PayloadCoding::set_delta, out, &p) & detail::kBlockSetRows);
  ASSERT_EQ(out, v);
  EXPECT_EQ(detail::get_u32(p.data() + 1), 2u);
}

}  // namespace
