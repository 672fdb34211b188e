// Test helpers: seeded randomness that says how to reproduce, and comparisons that name the
// coordinate of the first mismatch.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "switchyard/tensor.h"

namespace switchyard::testing {

/// Restores the engine's thread count on scope exit.
struct ThreadGuard {
  int saved = num_threads();
  ~ThreadGuard() { set_num_threads(saved); }
};


/// Seed for a test: SY_TEST_SEED from the environment when set, else `fallback`.
inline uint64_t test_seed(uint64_t fallback) {
  if (const char* s = std::getenv("SY_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return fallback;
}

/// A stable seed per configuration (FNV-1a of its description), so that two cases never share
/// their randomness and a case keeps it when others are added.
inline uint64_t seed_of(const std::string& description) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : description) h = (h ^ c) * 1099511628211ull;
  return h;
}

/// A message to attach to assertions: how to re-run with the same randomness (the seed, and the
/// running test's name for --gtest_filter).
inline std::string repro(uint64_t seed) {
  std::string filter;
  if (const auto* info = ::testing::UnitTest::GetInstance()->current_test_info()) {
    filter = std::string(" --gtest_filter=") + info->test_suite_name() + "." + info->name();
  }
  return "(reproduce with SY_TEST_SEED=" + std::to_string(seed) + filter + ")";
}

/// Random tensors of any float dtype, drawn from N(0, stddev) (bf16 values are rounded).
inline Tensor randn(const Shape& shape, DType dtype, std::mt19937_64& rng, double stddev = 1.0) {
  std::normal_distribution<double> nd(0.0, stddev);
  Tensor t = Tensor::empty(shape, DType::fp64);
  double* d = t.data<double>();
  for (int64_t i = 0; i < t.numel(); ++i) d[i] = nd(rng);
  if (dtype == DType::fp64) return t;
  return t.to(DType::fp32).to(dtype);
}

/// Multi-index of flat index `i` in `shape`, as "[a, b, c]".
inline std::string coord(const Shape& shape, int64_t i) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] ? i % shape[d] : 0;
    i = shape[d] ? i / shape[d] : 0;
  }
  return shape_str(idx);
}

/// |got - want| <= atol + rtol*|want| everywhere (NaN only matches NaN); names the first failure.
inline ::testing::AssertionResult all_close(const Tensor& got, const std::vector<double>& want,
                                            double atol, double rtol) {
  if (got.numel() != static_cast<int64_t>(want.size())) {
    return ::testing::AssertionFailure() << "numel " << got.numel() << " != " << want.size();
  }
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.item_as_double(i), w = want[static_cast<size_t>(i)];
    const bool ok = (std::isnan(g) && std::isnan(w)) || g == w ||
                    std::fabs(g - w) <= atol + rtol * std::fabs(w);
    if (!ok) {
      return ::testing::AssertionFailure()
             << "at " << coord(got.shape(), i) << ": got " << g << ", want " << w
             << " (|diff| " << std::fabs(g - w) << " > atol " << atol << " + rtol " << rtol
             << "*|want|)";
    }
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, double atol,
                                            double rtol) {
  if (got.shape() != want.shape()) {
    return ::testing::AssertionFailure() << "shape " << shape_str(got.shape()) << " != "
                                         << shape_str(want.shape());
  }
  return all_close(got, want.to_double_vector(), atol, rtol);
}

/// Bitwise equality of two tensors (same dtype, shape and bytes); names the first difference.
inline ::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    return ::testing::AssertionFailure() << "dtype/shape differ: " << dtype_name(a.dtype())
                                         << shape_str(a.shape()) << " vs " << dtype_name(b.dtype())
                                         << shape_str(b.shape());
  }
  const size_t es = dtype_size(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.raw());
  const auto* pb = static_cast<const unsigned char*>(b.raw());
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(pa + i * es, pb + i * es, es) != 0) {
      return ::testing::AssertionFailure() << "first difference at " << coord(a.shape(), i)
                                           << ": " << a.item_as_double(i) << " vs "
                                           << b.item_as_double(i);
    }
  }
  return ::testing::AssertionSuccess();
}

/// Expect `stmt` to throw exception type `E` whose message contains `substr`.
#define SY_EXPECT_THROW_MSG(stmt, E, substr)                                              \
  do {                                                                                    \
    try {                                                                                 \
      stmt;                                                                               \
      ADD_FAILURE() << "expected " #E " containing \"" << (substr) << "\", nothing thrown"; \
    } catch (const E& e_) {                                                               \
      EXPECT_NE(std::string(e_.what()).find(substr), std::string::npos)                   \
          << "message: " << e_.what() << "\nwanted substring: " << (substr);              \
    }                                                                                     \
  } while (0)

// A fixture with a fresh folder per test (removed after it): <tmp>/sy_<suite>_<pid>_<test>.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("sy_" + std::string(info->test_suite_name()) + "_" + std::to_string(::getpid()) + "_" +
            info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

}  // namespace switchyard::testing
