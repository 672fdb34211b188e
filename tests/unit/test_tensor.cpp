#include <cmath>
#include <cstring>
#include <limits>

#include "testing.h"

namespace sy = switchyard;
using sy::DType;
using sy::Tensor;

namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Reference bf16 rounding written from the definition: pick the nearer of the two bf16 neighbours
// (in double), ties to the one with an even last bit.
uint16_t ref_round(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double dlo = from_bits(static_cast<uint32_t>(lo) << 16);
  double dhi = from_bits(static_cast<uint32_t>(hi) << 16);
  // Past the largest finite bf16 the next value up is 2^128 with an unbounded exponent; IEEE
  // rounding picks Inf exactly when that neighbour would win.
  if (std::isinf(dhi)) dhi = std::copysign(std::ldexp(1.0, 128), dhi);
  const double x = f;
  const double elo = std::fabs(x - dlo), ehi = std::fabs(dhi - x);
  if (elo < ehi) return lo;
  if (ehi < elo) return hi;
  return (lo & 1) ? hi : lo;
}

}  // namespace

TEST(Bf16, RoundsToNearestEvenOnSampledBits) {
  std::mt19937_64 rng(sy::testing::test_seed(1));
  std::uniform_int_distribution<uint32_t> d;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = d(rng);
    if ((u & 0x7f800000u) == 0x7f800000u) continue;  // Inf/NaN checked separately
    const float f = from_bits(u);
    ASSERT_EQ(sy::float_to_bf16(f).bits, ref_round(f)) << "input bits 0x" << std::hex << u;
  }
}

TEST(Bf16, ExactTiesGoToEven) {
  // 1 + 2^-8 lies exactly between bf16 1.0 and 1 + 2^-7: ties to even -> 1.0.
  EXPECT_EQ(sy::float_to_bf16(1.0f + std::ldexp(1.0f, -8)).bits, sy::float_to_bf16(1.0f).bits);
  // 1 + 3*2^-8 lies between 1+2^-7 (odd) and 1+2^-6 (even): -> 1+2^-6.
  EXPECT_EQ(sy::bf16_to_float(sy::float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))),
            1.0f + std::ldexp(1.0f, -6));
}

TEST(Bf16, NaNStaysNaNAndInfStaysInf) {
  const float nans[] = {std::numeric_limits<float>::quiet_NaN(), from_bits(0x7f800001u),
                        from_bits(0xff80ffffu), from_bits(0x7fffffffu)};
  for (float n : nans) EXPECT_TRUE(std::isnan(sy::bf16_to_float(sy::float_to_bf16(n))));
  EXPECT_TRUE(std::signbit(sy::bf16_to_float(sy::float_to_bf16(from_bits(0xff800001u)))));
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(sy::bf16_to_float(sy::float_to_bf16(inf)), inf);
  EXPECT_EQ(sy::bf16_to_float(sy::float_to_bf16(-inf)), -inf);
  EXPECT_EQ(sy::bf16_to_float(sy::float_to_bf16(std::numeric_limits<float>::max())), inf);
}

TEST(Bf16, Fp64RoundsOnceNotThroughFp32) {
  // 1 + 2^-8 + 2^-30 is just above the midpoint of bf16 1.0 and 1 + 2^-7: one rounding gives
  // 1 + 2^-7; rounding through fp32 first would land on the midpoint and tie to 1.0.
  const double v = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);
  EXPECT_EQ(sy::bf16_to_float(sy::double_to_bf16(v)), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(sy::bf16_to_float(sy::double_to_bf16(-v)), -(1.0f + std::ldexp(1.0f, -7)));
  Tensor t = Tensor::from_vector<double>({v, 1.0 + std::ldexp(1.0, -8)}, {2});
  Tensor b = t.to(DType::bf16);
  EXPECT_EQ(sy::bf16_to_float(b.data<sy::bf16>()[0]), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(sy::bf16_to_float(b.data<sy::bf16>()[1]), 1.0f);  // an exact tie goes to even
  EXPECT_TRUE(std::isnan(sy::bf16_to_float(sy::double_to_bf16(std::nan("")))));
  EXPECT_TRUE(std::isinf(sy::bf16_to_float(sy::double_to_bf16(1e300))));
}

TEST(Bf16, RoundTripOfBf16ValuesIsExact) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    if ((b & 0x7f80u) == 0x7f80u && (b & 0x7fu)) continue;  // NaN payloads
    sy::bf16 v{static_cast<uint16_t>(b)};
    ASSERT_EQ(sy::float_to_bf16(sy::bf16_to_float(v)).bits, b);
  }
}

TEST(Tensor, ShapesSizesAndDtypes) {
  Tensor t = Tensor::zeros({3, 4}, DType::fp32);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.numel(), 12);
  EXPECT_EQ(t.dim(), 2);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
  EXPECT_FALSE(Tensor().defined());
  Tensor e = Tensor::empty({0, 5}, DType::int32);
  EXPECT_TRUE(e.defined());
  EXPECT_EQ(e.numel(), 0);
  for (DType d : {DType::bf16, DType::fp32, DType::fp64, DType::int32, DType::int64, DType::uint8,
                  DType::boolean}) {
    Tensor f = Tensor::full({2, 2}, d, 1.0);
    EXPECT_EQ(f.item_as_double(3), 1.0) << sy::dtype_name(d);
  }
}

TEST(Tensor, BorrowSharesCallerMemory) {
  float buf[6] = {1, 2, 3, 4, 5, 6};
  Tensor t = Tensor::borrow(buf, {2, 3}, DType::fp32);
  EXPECT_FALSE(t.owns_storage());
  t.data<float>()[4] = 50;
  EXPECT_EQ(buf[4], 50);
  Tensor c = t.clone();
  c.data<float>()[0] = -1;
  EXPECT_EQ(buf[0], 1);
  Tensor r = t.reshape({3, 2});
  EXPECT_EQ(r.data<float>(), buf);
}

TEST(Tensor, ConversionsRoundTrip) {
  Tensor a = Tensor::from_vector<float>({1.5f, -2.25f, 3.0f, 1e-3f}, {4});
  Tensor b = a.to(DType::bf16).to(DType::fp32);
  EXPECT_EQ(b.data<float>()[0], 1.5f);
  EXPECT_EQ(b.data<float>()[1], -2.25f);
  EXPECT_EQ(b.data<float>()[3], sy::bf16_to_float(sy::float_to_bf16(1e-3f)));
  Tensor i = a.to(DType::int64);
  EXPECT_EQ(i.data<int64_t>()[1], -2);
}

TEST(Tensor, ErrorsNameTheProblem) {
  Tensor t = Tensor::zeros({2, 3}, DType::fp32);
  SY_EXPECT_THROW_MSG(t.data<double>(), std::invalid_argument, "data<fp64>() on a tensor of dtype fp32");
  SY_EXPECT_THROW_MSG(t.reshape({4}), std::invalid_argument, "cannot view shape [2, 3] as [4]");
  SY_EXPECT_THROW_MSG(t.size(2), std::invalid_argument, "size(2) out of range");
  SY_EXPECT_THROW_MSG(Tensor::zeros({-1}, DType::fp32), std::invalid_argument, "negative size");
  SY_EXPECT_THROW_MSG(Tensor::borrow(nullptr, {3}, DType::fp32), std::invalid_argument,
                      "null data");
  SY_EXPECT_THROW_MSG(sy::set_num_threads(0), std::invalid_argument, "n must be >= 1, got n=0");
}

TEST(Tensor, LargeStorageIsReusedAfterFree) {
  sy::release_cached_memory();
  EXPECT_EQ(sy::cached_memory_bytes(), 0);
  const void* first = nullptr;
  {
    Tensor big = Tensor::empty({3 << 20}, DType::uint8);  // 3 MiB -> a 4 MiB block
    first = big.raw();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
  }
#if defined(__SANITIZE_ADDRESS__)
  // The cache is off under AddressSanitizer so that every use after free is seen.
  EXPECT_EQ(sy::cached_memory_bytes(), 0);
#else
  EXPECT_EQ(sy::cached_memory_bytes(), 8 << 20);  // its 8 MiB segment (4 MiB headroom)
  {
    Tensor again = Tensor::empty({(3 << 20) + 5}, DType::uint8);  // same rounded size
    EXPECT_EQ(again.raw(), first);
    EXPECT_EQ(sy::cached_memory_bytes(), 4 << 20);
    Tensor other = Tensor::empty({9 << 20}, DType::uint8);  // 10 MiB: a fresh 20 MiB segment
    EXPECT_NE(other.raw(), first);
    EXPECT_EQ(sy::cached_memory_bytes(), (4 << 20) + (10 << 20));
  }
  EXPECT_EQ(sy::cached_memory_bytes(), (8 << 20) + (20 << 20));
#endif
  sy::release_cached_memory();
  EXPECT_EQ(sy::cached_memory_bytes(), 0);
  // Small tensors never enter the cache.
  { Tensor small = Tensor::zeros({100}, DType::fp32); }
  EXPECT_EQ(sy::cached_memory_bytes(), 0);
}
