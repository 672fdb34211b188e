// Devices on tensors, the allocator registry and the backend seam. In a build without CUDA every
// request for CUDA memory, a copy or a kernel throws BackendError "not built with CUDA"; in a CUDA
// build the kernels throw "has no CUDA kernel yet" and memory works where a GPU is present. A
// "CUDA" tensor here is host memory borrowed under a CUDA device: every path below must throw
// before reading it, which is what the tests check.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/allocator.h"
#include "switchyard/error.h"
#include "switchyard/gate.h"
#include "switchyard/router.h"
#include "switchyard/routing_plan.h"
#include "testing.h"

namespace sy = switchyard;
using sy::DType;
using sy::kCpu;
using sy::Tensor;

namespace {

constexpr const char* kNotBuilt = "not built with CUDA (configure with -DSWITCHYARD_CUDA=ON)";

// Host memory labelled as CUDA device `index` (never read by a correct front-end).
struct FakeCuda {
  std::vector<float> host;
  Tensor t;
  FakeCuda(const sy::Shape& shape, int index = 0) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    host.assign(static_cast<size_t>(n), 1.0f);
    t = Tensor::borrow(host.data(), shape, DType::fp32, sy::cuda_device(index));
  }
};

// GTEST_SKIP returns from the function it is in, so this is a macro, not a helper.
#define SKIP_UNLESS_CPU_ONLY_BUILD() \
  if (sy::built_with_cuda()) GTEST_SKIP() << "this build has the CUDA backend"

}  // namespace

TEST(Device, NamesFollowTorch) {
  EXPECT_EQ(sy::device_str(kCpu), "cpu");
  EXPECT_EQ(sy::device_str(sy::cuda_device()), "cuda:0");
  EXPECT_EQ(sy::device_str(sy::cuda_device(3)), "cuda:3");
  EXPECT_EQ(sy::Device{}, kCpu);
  EXPECT_NE(sy::cuda_device(0), sy::cuda_device(1));
}

TEST(Device, TensorsLiveOnTheCpuByDefault) {
  std::vector<float> buf(6, 2.0f);
  const Tensor a = Tensor::empty({2, 3}, DType::fp32);
  const Tensor b = Tensor::zeros({2, 3}, DType::bf16);
  const Tensor c = Tensor::full({2, 3}, DType::int32, 7.0);
  const Tensor d = Tensor::from_vector(buf, {2, 3});
  const Tensor e = Tensor::borrow(buf.data(), {6}, DType::fp32);
  for (const Tensor* t : {&a, &b, &c, &d, &e}) EXPECT_EQ(t->device(), kCpu);
  EXPECT_EQ(d.clone().device(), kCpu);
  EXPECT_EQ(d.to(DType::fp64).device(), kCpu);
  EXPECT_EQ(d.reshape({3, 2}).device(), kCpu);
}

TEST(Device, ToTheSameDeviceIsACopy) {
  const Tensor a = Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  const Tensor b = a.to(kCpu);
  EXPECT_NE(a.raw(), b.raw());
  EXPECT_TRUE(sy::testing::bitwise_equal(a, b));
}

TEST(Device, ZerosAreZeroOnTheCpu) {
  const Tensor z = Tensor::zeros({3, 1000}, DType::fp32);
  for (double v : z.to_double_vector()) ASSERT_EQ(v, 0.0);
}

TEST(Allocator, TheCpuAllocatorIsTheCachingHostOne) {
  sy::detail::Allocator& a = sy::detail::allocator_for(kCpu);
  EXPECT_EQ(&a, &sy::detail::host_allocator());
  const std::string name = a.name();
  if (name != "cpu (caching)") {
    EXPECT_EQ(name, "cpu");  // AddressSanitizer build: no cache
    return;
  }
  sy::release_cached_memory();
  // 3 MiB -> a 4 MiB block of a fresh 8 MiB segment (4 MiB headroom)
  { const Tensor big = Tensor::empty({3 << 20}, DType::uint8); }
  EXPECT_EQ(a.cached_bytes(), int64_t{8} << 20);
  EXPECT_EQ(sy::cached_memory_bytes(), a.cached_bytes());
  const Tensor again = Tensor::empty({3 << 20}, DType::uint8);  // served from the cache
  EXPECT_EQ(a.cached_bytes(), int64_t{4} << 20);
  sy::release_cached_memory();
}

// The host cache's tests: skipped under AddressSanitizer (no cache there), each starting from an
// empty cache and releasing it at the end. reserved0 / cached0: what live large tensors of other
// tests hold, if any.
class HostCache : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(a.name()) != "cpu (caching)")
      GTEST_SKIP() << "AddressSanitizer build: no cache";
    sy::release_cached_memory();
    reserved0 = a.reserved_bytes();
    cached0 = a.cached_bytes();
  }
  void TearDown() override { sy::release_cached_memory(); }
  static constexpr int64_t MiB = int64_t{1} << 20;
  sy::detail::Allocator& a = sy::detail::host_allocator();
  int64_t reserved0 = 0, cached0 = 0;
};

// A fresh segment is twice its request; the rest (headroom) is a free piece. A request takes the
// smallest free piece that holds its rounded size (best fit, the lower address among equal
// sizes), splitting off the rest: from the piece's bottom, or from its top when the block before
// the piece is in use (the room next to that block stays free for it to grow into). A freed piece
// merges with its segment's free neighbours.
TEST_F(HostCache, TakesTheSmallestFreePieceAndSplitsOffTheRest) {
  const char* seg = nullptr;
  {
    Tensor t10 = Tensor::empty({10 * MiB}, DType::uint8);  // segment [0, 20): [0, 10) used
    seg = static_cast<const char*>(t10.raw());
    EXPECT_EQ(a.reserved_bytes() - reserved0, 20 * MiB);
    EXPECT_EQ(a.cached_bytes(), 10 * MiB);
    const Tensor t6 = Tensor::empty({6 * MiB}, DType::uint8);  // top of the headroom: [14, 20)
    EXPECT_EQ(t6.raw(), seg + 14 * MiB);
    EXPECT_EQ(a.cached_bytes(), 4 * MiB);
    t10 = Tensor();  // [0, 10) merges with the free [10, 14)
    EXPECT_EQ(a.cached_bytes(), 14 * MiB);
    const Tensor t4 = Tensor::empty({3 * MiB + 1}, DType::uint8);  // n = 4: bottom of [0, 14)
    EXPECT_EQ(t4.raw(), seg);
    const Tensor t8 = Tensor::empty({8 * MiB}, DType::uint8);  // top of [4, 14): [6, 14)
    EXPECT_EQ(t8.raw(), seg + 6 * MiB);
    const Tensor t2 = Tensor::empty({2 * MiB}, DType::uint8);  // the 2 MiB left, [4, 6)
    EXPECT_EQ(t2.raw(), seg + 4 * MiB);
    EXPECT_EQ(a.cached_bytes(), 0);
    const Tensor t12 = Tensor::empty({11 * MiB}, DType::uint8);  // n = 12: none holds it, fresh
    EXPECT_EQ(a.reserved_bytes() - reserved0, (20 + 24) * MiB);
    EXPECT_EQ(a.cached_bytes(), 12 * MiB);
    const Tensor t3 = Tensor::empty({3 * MiB}, DType::uint8);  // n = 4: the smallest that holds it
    EXPECT_EQ(a.cached_bytes(), 8 * MiB);
  }
  // Every piece back and merged: whole segments again, the first served whole.
  EXPECT_EQ(a.cached_bytes(), 44 * MiB);
  {
    const Tensor t = Tensor::empty({19 * MiB}, DType::uint8);  // n = 20 MiB: the first segment
    EXPECT_EQ(t.raw(), seg);
    EXPECT_EQ(a.cached_bytes(), 24 * MiB);
  }
  sy::release_cached_memory();
  EXPECT_EQ(a.cached_bytes(), 0);
  EXPECT_EQ(a.reserved_bytes(), reserved0);
}

// A long-lived block cut from a segment's headroom while the segment's first block is in use (the
// dispatcher's pack scratch, made while recv_x is alive) leaves the room next to that block free:
// the next, larger recv_x grows into it at the same address (cut from the bottom of the headroom,
// the scratch pinned recv_x at its first size and the larger one faulted a fresh segment).
TEST_F(HostCache, ALongLivedBlockInTheHeadroomLeavesTheFirstBlockRoomToGrow) {
  const void* first = nullptr;
  Tensor scratch;
  {
    const Tensor recv_x = Tensor::empty({56 * MiB}, DType::uint8);  // segment [0, 112)
    first = recv_x.raw();
    scratch = Tensor::empty({32 * MiB}, DType::uint8);  // [80, 112)
  }
  const int64_t reserved1 = a.reserved_bytes();
  EXPECT_EQ(reserved1 - reserved0, 112 * MiB);
  for (const int64_t size : {72 * MiB, 40 * MiB, 80 * MiB}) {
    const Tensor recv_x = Tensor::empty({size}, DType::uint8);
    EXPECT_EQ(recv_x.raw(), first) << size / MiB << " MiB";
    EXPECT_EQ(a.reserved_bytes(), reserved1) << size / MiB << " MiB";
  }
  scratch = Tensor();
  sy::release_cached_memory();
  EXPECT_EQ(a.reserved_bytes(), reserved0);
}

// A segment a live tensor still uses part of is kept by release_cached_memory (its free part stays
// cached) and freed once the tensor is.
TEST_F(HostCache, ReleaseKeepsAPartlyUsedSegmentUntilItIsFree) {
  { const Tensor big = Tensor::empty({16 * MiB}, DType::uint8); }  // a 32 MiB segment
  {
    const Tensor part = Tensor::empty({4 * MiB}, DType::uint8);
    EXPECT_EQ(a.cached_bytes(), 28 * MiB);
    sy::release_cached_memory();
    EXPECT_EQ(a.cached_bytes(), 28 * MiB);
    EXPECT_EQ(a.reserved_bytes() - reserved0, 32 * MiB);
  }
  EXPECT_EQ(a.cached_bytes(), 32 * MiB);
  sy::release_cached_memory();
  EXPECT_EQ(a.cached_bytes(), 0);
  EXPECT_EQ(a.reserved_bytes(), reserved0);
}

// Steps whose buffers change size within the bound (recv_x under uniform routes) run on the first
// step's memory: after it, the allocator holds the same bytes at every step.
TEST_F(HostCache, BuffersOfChangingSizeReuseTheFirstStepsBlocks) {
  const int64_t H = 2048;
  // bf16 [rows, H]: 36.3, 32.0, 35.2, 30.9, 34.4, 35.5 MiB, in size classes (eighths of the power
  // of two) 40, 36, 36, 32, 36, 36 MiB; the first step's are the largest.
  const int64_t rows[] = {9300, 8200, 9000, 7900, 8800, 9100};
  int64_t first = 0;
  for (const int64_t r : rows) {
    {
      const Tensor recv = Tensor::empty({r, H}, DType::bf16);
      const Tensor out = Tensor::empty({r, H}, DType::bf16);
      if (first == 0) first = a.reserved_bytes();
      EXPECT_EQ(a.reserved_bytes(), first) << "rows " << r;
    }
    EXPECT_EQ(a.cached_bytes(), first - reserved0) << "rows " << r;
  }
}

// Skewed routes: one rank's received rows swing by several times from step to step (a hot rank
// gets 1.8x the mean, then 0.2x). Steps after the largest one run on its memory: a step's smaller
// buffers are cut from the largest step's segments (the earlier allocator handed out only blocks
// in [n, 2n) and faulted a fresh block for every step under half the largest), and the step's
// other buffers (the rows returned to the source side, the combine output) fit beside them.
TEST_F(HostCache, SkewedStepsAfterTheLargestRunOnItsMemory) {
  const int64_t H = 2048, TK = 4096;  // fp32 rows of 8 KiB; TK rows return to the source side
  // Received rows per step (bench_dispatch skew:2 at EP 2 shrunk 8x: 1.8x, 0.2x, 1.6x, 0.3x,
  // 0.2x, 1.0x and 0.5x the mean of 4096).
  const int64_t recv_rows[] = {7373, 819, 6554, 1229, 819, 4096, 2048};
  int64_t after_first = 0;
  for (const int64_t r : recv_rows) {
    const Tensor recv_x = Tensor::empty({r, H}, DType::fp32);
    const Tensor returned = Tensor::empty({TK, H}, DType::fp32);
    const Tensor y = Tensor::empty({TK / 8, H}, DType::fp32);
    if (after_first == 0) after_first = a.reserved_bytes();
    EXPECT_EQ(a.reserved_bytes(), after_first) << "rows " << r;
  }
  EXPECT_GT(after_first, reserved0);
  sy::release_cached_memory();
  EXPECT_EQ(a.reserved_bytes(), reserved0);
}

// A buffer that grows past its high-water mark by less than its size again (a hot rank receiving
// 471 MiB after 428 MiB) is served from the headroom of its first segment, at the same address:
// only the growth is new memory (exact-size segments faulted a whole new block).
TEST_F(HostCache, ABufferGrowingPastItsHighWaterMarkUsesItsSegmentsHeadroom) {
  const void* first = nullptr;
  int64_t reserved1 = 0;
  for (const int64_t size : {56 * MiB, 40 * MiB, 62 * MiB, 100 * MiB, 70 * MiB}) {
    const Tensor recv_x = Tensor::empty({size}, DType::uint8);
    if (!first) {
      first = recv_x.raw();
      reserved1 = a.reserved_bytes();
    }
    EXPECT_EQ(recv_x.raw(), first) << size / MiB << " MiB";
    EXPECT_EQ(a.reserved_bytes(), reserved1) << size / MiB << " MiB";
  }
  EXPECT_EQ(reserved1 - reserved0, 112 * MiB);
}

// Seeded random allocations and frees of large tensors (1-48 MiB, up to 12 alive): no two live
// blocks overlap, and once all are freed every byte is back in the cache and released.
TEST_F(HostCache, RandomAllocationsNeverOverlapAndAllMemoryComesBack) {
  std::mt19937_64 rng(20261201);
  std::uniform_int_distribution<int64_t> bytes(int64_t{1} << 20, int64_t{48} << 20);
  std::vector<Tensor> live;
  for (int op = 0; op < 3000; ++op) {
    if (live.empty() || (live.size() < 12 && rng() % 2 == 0)) {
      Tensor t = Tensor::empty({bytes(rng)}, DType::uint8);
      const auto* b = static_cast<const char*>(t.raw());
      for (const Tensor& u : live) {
        const auto* c = static_cast<const char*>(u.raw());
        ASSERT_TRUE(b + t.numel() <= c || c + u.numel() <= b)
            << "op " << op << ": [" << static_cast<const void*>(b) << ", +" << t.numel()
            << ") overlaps [" << static_cast<const void*>(c) << ", +" << u.numel() << ")";
      }
      live.push_back(std::move(t));
    } else {
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
    }
  }
  live.clear();
  EXPECT_EQ(a.cached_bytes() - cached0, a.reserved_bytes() - reserved0);
  sy::release_cached_memory();
  EXPECT_EQ(a.reserved_bytes(), reserved0);
}

// The bookkeeping the CUDA allocator shares with the host one, on host memory with the device
// policy (committed memory: no headroom for large requests, 2 MiB segments shared by small
// ones) and a budget standing in for the device's memory.
namespace {
class BudgetSegments final : public sy::detail::SegmentSource {
 public:
  explicit BudgetSegments(size_t budget) : budget_(budget) {}
  char* allocate_segment(size_t bytes) override {
    if (used_ + bytes > budget_) return nullptr;  // "out of memory"
    used_ += bytes;
    ++segments_;
    return static_cast<char*>(std::aligned_alloc(256, bytes));
  }
  void free_segment(char* p, size_t bytes) noexcept override {
    used_ -= bytes;
    --segments_;
    std::free(p);
  }
  size_t headroom(size_t size) const override {
    return sy::detail::committed_memory_headroom(size);
  }
  size_t used_ = 0, budget_;
  int segments_ = 0;
};
constexpr size_t kMiB = size_t{1} << 20;
}  // namespace

TEST(SegmentCache, DevicePolicyLargeBlocksGetExactSegmentsThatAreReused) {
  BudgetSegments src(64 * kMiB);
  sy::detail::SegmentCache c(src, SIZE_MAX);
  char* a = c.allocate(4 * kMiB);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(c.reserved_bytes(), 4 * kMiB) << "no headroom for committed memory";
  EXPECT_EQ(c.cached_bytes(), 0u);
  EXPECT_TRUE(c.deallocate(a));
  EXPECT_FALSE(c.deallocate(a)) << "a block freed twice is refused";
  EXPECT_EQ(c.cached_bytes(), 4 * kMiB) << "kept for the next step";
  EXPECT_EQ(c.allocate(4 * kMiB), a) << "the same block again, no new segment";
  EXPECT_EQ(src.segments_, 1);
  char* b = c.allocate(6 * kMiB);  // does not fit the free room: a second segment
  EXPECT_EQ(src.segments_, 2);
  EXPECT_TRUE(c.deallocate(a));
  EXPECT_TRUE(c.deallocate(b));
  c.trim(0);
  EXPECT_EQ(src.segments_, 0);
  EXPECT_EQ(src.used_, 0u);
  EXPECT_EQ(c.reserved_bytes(), 0u);
}

TEST(SegmentCache, DevicePolicySmallBlocksShareTwoMiBSegments) {
  BudgetSegments src(64 * kMiB);
  sy::detail::SegmentCache c(src, SIZE_MAX);
  const size_t s = sy::detail::size_class(1000, 512);
  EXPECT_EQ(s, 1024u);
  char* p[3];
  for (char*& q : p) q = c.allocate(s);
  EXPECT_EQ(src.segments_, 1) << "three small tensors, one cudaMalloc";
  EXPECT_EQ(c.reserved_bytes(), 2 * kMiB);
  const char* lo = std::min({p[0], p[1], p[2]});
  const char* hi = std::max({p[0], p[1], p[2]});
  EXPECT_LE(static_cast<size_t>(hi + s - lo), 2 * kMiB) << "all three in the one segment";
  EXPECT_TRUE(p[0] != p[1] && p[1] != p[2] && p[0] != p[2]);
  for (char* q : p) EXPECT_TRUE(c.deallocate(q));
  EXPECT_EQ(c.cached_bytes(), 2 * kMiB) << "merged back into one free segment";
  c.trim(0);
  EXPECT_EQ(src.segments_, 0);
}

// Out of device memory: the cache returns its wholly free segments to the source and retries
// once; when that is not enough it returns nullptr and the blocks in use stay as they were.
TEST(SegmentCache, OutOfMemoryReturnsTheFreeSegmentsAndRetries) {
  BudgetSegments src(8 * kMiB);
  sy::detail::SegmentCache c(src, SIZE_MAX);
  char* a = c.allocate(4 * kMiB);
  char* b = c.allocate(4 * kMiB);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  std::memset(b, 0x5a, 4 * kMiB);
  ASSERT_TRUE(c.deallocate(a));
  EXPECT_EQ(c.allocate(6 * kMiB), nullptr) << "4 MiB in use + 6 MiB > 8 MiB even after the trim";
  EXPECT_EQ(src.segments_, 1) << "a's free segment went back to the source";
  EXPECT_EQ(c.reserved_bytes(), 4 * kMiB);
  EXPECT_EQ(static_cast<unsigned char>(b[4 * kMiB - 1]), 0x5au) << "b untouched";
  ASSERT_TRUE(c.deallocate(b));
  char* d = c.allocate(6 * kMiB);  // b's free segment is too small: returned, then a fresh one
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(src.segments_, 1);
  EXPECT_EQ(c.reserved_bytes(), 6 * kMiB);
  ASSERT_TRUE(c.deallocate(d));
  c.trim(0);
  EXPECT_EQ(src.used_, 0u);
}

TEST(CpuOnlyBuild, ReportsNoCuda) {
  SKIP_UNLESS_CPU_ONLY_BUILD();
  EXPECT_FALSE(sy::built_with_cuda());
  EXPECT_EQ(sy::cuda_device_count(), 0);
}

TEST(CpuOnlyBuild, CudaStorageIsNotBuilt) {
  SKIP_UNLESS_CPU_ONLY_BUILD();
  SY_EXPECT_THROW_MSG(Tensor::empty({2, 3}, DType::fp32, sy::cuda_device()), sy::BackendError,
                      std::string("[tensor.empty] device cuda:0: ") + kNotBuilt);
  SY_EXPECT_THROW_MSG(Tensor::zeros({2}, DType::fp32, sy::cuda_device(1)), sy::BackendError,
                      std::string("[tensor.zeros] device cuda:1: ") + kNotBuilt);
  SY_EXPECT_THROW_MSG(Tensor::full({2}, DType::fp32, 1.0, sy::cuda_device()), sy::BackendError,
                      std::string("[tensor.to] device cuda:0: ") + kNotBuilt);
  SY_EXPECT_THROW_MSG(Tensor::from_vector(std::vector<int32_t>{1, 2}, {2}, sy::cuda_device()),
                      sy::BackendError, std::string("[tensor.to] device cuda:0: ") + kNotBuilt);
  SY_EXPECT_THROW_MSG(Tensor::zeros({2}, DType::fp32).to(sy::cuda_device(2)), sy::BackendError,
                      std::string("[tensor.to] device cuda:2: ") + kNotBuilt);
  SY_EXPECT_THROW_MSG(sy::detail::allocator_for(sy::cuda_device(), "probe"), sy::BackendError,
                      std::string("[probe] device cuda:0: ") + kNotBuilt);
}

TEST(CpuOnlyBuild, CopiesOfACudaTensorAreNotBuilt) {
  SKIP_UNLESS_CPU_ONLY_BUILD();
  FakeCuda x({2, 3});
  SY_EXPECT_THROW_MSG(x.t.clone(), sy::BackendError,
                      std::string("[tensor.clone] device cuda:0: ") + kNotBuilt);
  SY_EXPECT_THROW_MSG(x.t.to(kCpu), sy::BackendError,
                      std::string("[tensor.to] device cuda:0: ") + kNotBuilt);
}

TEST(Device, HostOnlyOperationsNameTheOpAndTheDevice) {
  FakeCuda x({2, 3}, 1);
  SY_EXPECT_THROW_MSG(x.t.item_as_double(0), std::invalid_argument,
                      "[tensor.item_as_double] needs a CPU tensor, got one on cuda:1");
  SY_EXPECT_THROW_MSG(x.t.to_double_vector(), std::invalid_argument,
                      "[tensor.to_double_vector] needs a CPU tensor, got one on cuda:1");
  SY_EXPECT_THROW_MSG(x.t.to(DType::fp64), std::invalid_argument,
                      "[tensor.to] needs a CPU tensor, got one on cuda:1");
  EXPECT_EQ(x.t.reshape({3, 2}).device(), sy::cuda_device(1));  // metadata only: fine anywhere
}

TEST(Device, BorrowRejectsANegativeDeviceIndex) {
  float v = 0.0f;
  SY_EXPECT_THROW_MSG(Tensor::borrow(&v, {1}, DType::fp32, sy::Device{sy::DeviceKind::cuda, -1}),
                      std::invalid_argument, "[tensor] borrow: device index must be >= 0");
}

TEST(Device, OpsRejectTensorsOnAnotherDevice) {
  const Tensor x = Tensor::zeros({4, 8}, DType::fp32);
  FakeCuda w({3, 8});
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x, w.t, Tensor(), sy::GateOptions{}),
                      std::invalid_argument,
                      "[router_gating_linear] weight must be on cpu, got cuda:0");
  const Tensor logits = Tensor::zeros({4, 8}, DType::fp32);
  std::vector<uint8_t> mask(4, 0);
  sy::RouteInputs inputs;
  inputs.padding_mask = Tensor::borrow(mask.data(), {4}, DType::boolean, sy::cuda_device());
  sy::RouterConfig config;
  config.num_experts = 8;
  config.top_k = 2;
  SY_EXPECT_THROW_MSG(sy::topk_route(logits, inputs, config, sy::RouteOptions{}),
                      std::invalid_argument, "[route] padding_mask must be on cpu, got cuda:0");
}

// The front-ends reach a CUDA tensor's kernels through the seam, which names the op and kernel.
TEST(Device, FrontEndsOnCudaTensorsStopAtTheBackend) {
  const std::string tail = sy::built_with_cuda() ? " has no CUDA kernel yet (device cuda:0)"
                                                 : std::string(" on cuda:0: ") + kNotBuilt;
  FakeCuda x({4, 8}), w({3, 8});
  // The gate's first device step (a value check, the output's allocation or the kernel, in the
  // order the front-end chooses) stops it: a BackendError about cuda:0 before any host read.
  SY_EXPECT_THROW_MSG(sy::router_gating_linear(x.t, w.t, Tensor(), sy::GateOptions{}),
                      sy::BackendError, "cuda:0");
  sy::RouterConfig config;
  config.num_experts = 8;
  config.top_k = 2;
  SY_EXPECT_THROW_MSG(sy::topk_route(x.t, sy::RouteInputs{}, config, sy::RouteOptions{}),
                      sy::BackendError, "[route] first_non_finite" + tail);
  std::vector<int32_t> ids(8, 0);
  const Tensor idx = Tensor::borrow(ids.data(), {4, 2}, DType::int32, sy::cuda_device());
  SY_EXPECT_THROW_MSG(sy::build_routing_plan(idx, Tensor(), 8, sy::RoutingPlanOptions{}),
                      sy::BackendError, "[routing_plan] first_id_out_of_range" + tail);
}

// Every entry point of the seam selects by the context's device: CPU runs, CUDA stops there.
TEST(BackendSeam, EveryEntryPointSelectsByDevice) {
  namespace be = sy::backend;
  const be::Context cuda{sy::cuda_device(), nullptr, "probe"};
  const std::string tail = sy::built_with_cuda() ? " has no CUDA kernel yet (device cuda:0)"
                                                 : std::string(" on cuda:0: ") + kNotBuilt;
  float f[4] = {0, 0, 0, 0};
  int32_t ids[4] = {0, 0, 0, 0};
  int64_t rows[4] = {0, 0, 0, 0};
  uint8_t kinds[4] = {0, 0, 0, 0};
  be::RouteKernelParams p;
  const std::vector<std::pair<const char*, std::function<void()>>> calls = {
      {"gate_forward",
       [&] {
         be::gate_forward(cuda, f, DType::fp32, f, DType::fp32, nullptr, DType::fp32, f,
                          DType::fp32, 1, 1, 1);
       }},
      {"gate_backward",
       [&] {
         be::gate_backward(cuda, f, f, DType::fp32, f, DType::fp32, f, f, nullptr, DType::fp32, 1,
                           1, 1);
       }},
      {"route_forward",
       [&] {
         be::route_forward<float>(cuda, f, nullptr, kinds, nullptr, p, ids, f, nullptr, nullptr,
                                  nullptr);
       }},
      {"apply_capacity",
       [&] {
         be::apply_capacity<float>(cuda, ids, f, 1, 1, 1, -1, sy::TokenDropPolicy::probs, ids, f,
                                   rows);
       }},
      {"route_backward",
       [&] { be::route_backward<float>(cuda, f, ids, ids, kinds, nullptr, p, nullptr, 0.0, f); }},
      {"gather_rows", [&] { be::gather_rows(cuda, f, rows, 1, 4, f); }},
      {"combine_rows", [&] { be::combine_rows<float>(cuda, f, nullptr, rows, rows, 1, 1, f); }},
      {"gather_scale_rows", [&] { be::gather_scale_rows<float>(cuda, f, nullptr, rows, 1, 1, f); }},
      {"row_dots", [&] { be::row_dots<float>(cuda, f, f, rows, 1, 1, f); }},
      {"first_non_finite", [&] { be::first_non_finite(cuda, f, DType::fp32, 4); }},
      {"first_id_out_of_range", [&] { be::first_id_out_of_range(cuda, ids, 4, 0, 1); }},
      {"classify_replay_rows",
       [&] { be::classify_replay_rows(cuda, ids, nullptr, 1, 1, 1, kinds); }},
      {"build_routing_plan",
       [&] {
         be::build_routing_plan(cuda, ids, f, 1, 1, 1, -1, sy::TokenDropPolicy::probs, 1, false);
       }},
      {"cast_values", [&] { be::cast_values<float>(cuda, f, DType::fp32, 1, f); }},
      {"sinkhorn_rows",
       [&] { be::sinkhorn_rows<float>(cuda, f, nullptr, kinds, 1, 1, 1, 1e-4, ids, kinds); }},
      {"quantile_balancing_rows",
       [&] {
         be::quantile_balancing_rows(cuda, f, f, nullptr, kinds, 1, 1, 1, ids, kinds, nullptr);
       }},
      {"rows_to_slots", [&] { be::rows_to_slots(cuda, f, rows, 1, f); }},
  };
  for (const auto& [kernel, call] : calls) {
    SCOPED_TRACE(kernel);
    SY_EXPECT_THROW_MSG(call(), sy::BackendError, std::string("[probe] ") + kernel + tail);
  }
  // The CPU context runs the CPU kernels.
  const be::Context host{kCpu, nullptr, "probe"};
  f[2] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(be::first_non_finite(host, f, DType::fp32, 4), 2);
  ids[3] = 5;
  EXPECT_EQ(be::first_id_out_of_range(host, ids, 4, 0, 5), 3);
  EXPECT_EQ(be::first_id_out_of_range(host, ids, 4, 0, 6), 4);
}

TEST(BackendSeam, ReplayRowsAreClassifiedInSlotOrder) {
  namespace be = sy::backend;
  // E = 4, K = 2: replayed, all -1 (native), mixes, out of range, repeat, padded.
  const std::vector<int32_t> replay = {1, 2, -1, -1, 3, -1, 0, 4, 2, 2, 0, 1};
  const bool pad[6] = {false, false, false, false, false, true};
  uint8_t kind[6];
  const be::ReplayRowSummary s =
      be::classify_replay_rows(be::Context{}, replay.data(), pad, 6, 2, 4, kind);
  EXPECT_EQ(s.num_padded, 1);
  EXPECT_EQ(s.num_replayed, 1);
  EXPECT_EQ(s.num_native, 4);
  EXPECT_EQ(s.num_invalid, 3);
  EXPECT_EQ(s.first_invalid_row, 2);
  EXPECT_EQ(s.first_problem, be::ReplayRowProblem::mixes_none_and_ids);
  const std::vector<uint8_t> want = {be::kRowReplayed, be::kRowNative, be::kRowNative,
                                     be::kRowNative,   be::kRowNative, be::kRowPadded};
  EXPECT_EQ(std::vector<uint8_t>(kind, kind + 6), want);
  // The first problem of rows 3 and 4 alone.
  const be::ReplayRowSummary r3 =
      be::classify_replay_rows(be::Context{}, replay.data() + 6, nullptr, 1, 2, 4, kind);
  EXPECT_EQ(r3.first_problem, be::ReplayRowProblem::id_out_of_range);
  EXPECT_EQ(r3.first_problem_id, 4);
  const be::ReplayRowSummary r4 =
      be::classify_replay_rows(be::Context{}, replay.data() + 8, nullptr, 1, 2, 4, kind);
  EXPECT_EQ(r4.first_problem, be::ReplayRowProblem::repeated_id);
  EXPECT_EQ(r4.first_problem_id, 2);
}

TEST(CudaBuild, MemoryRoundTripsThroughTheDevice) {
  if (!sy::built_with_cuda()) GTEST_SKIP() << "built without CUDA";
  if (sy::cuda_device_count() == 0) {
    // No GPU (or no driver): allocation fails with the runtime call and its error named.
    SY_EXPECT_THROW_MSG(Tensor::empty({4}, DType::fp32, sy::cuda_device()), sy::BackendError,
                        "[tensor.empty] ");
    SY_EXPECT_THROW_MSG(Tensor::empty({4}, DType::fp32, sy::cuda_device()), sy::BackendError,
                        " on cuda:0 failed: cudaError");
    GTEST_SKIP() << "no CUDA device: allocation error checked, round trip not run";
  }
  const Tensor h = Tensor::from_vector(std::vector<float>{1, -2, 3.5f, 4, 5, 6}, {2, 3});
  const Tensor d = h.to(sy::cuda_device());
  EXPECT_EQ(d.device(), sy::cuda_device());
  EXPECT_EQ(std::string(sy::detail::allocator_for(d.device()).name()), "cuda (caching)");
  const Tensor back = d.clone().to(kCpu);
  EXPECT_TRUE(sy::testing::bitwise_equal(back, h));
  const Tensor z = Tensor::zeros({2, 3}, DType::fp32, sy::cuda_device()).to(kCpu);
  for (double v : z.to_double_vector()) EXPECT_EQ(v, 0.0);
  const Tensor f = Tensor::full({3}, DType::int32, 7, sy::cuda_device()).to(kCpu);
  EXPECT_EQ(f.to_double_vector(), (std::vector<double>{7, 7, 7}));
}
