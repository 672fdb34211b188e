// Hostile input (issue 13): route data never lost or mislabelled, declared sizes bounded before
// allocating, the CLI never aborting, validation that changes nothing before it passes. Each test
// names the class of bug it pins; every one of them failed on the branch point 9cdafeb.
#if defined(__GNUC__) && !defined(__clang__)
// The replaced global operator new/delete below pair malloc with free; gcc's inliner sees a
// `new` expression meet `free` and warns, although the pairing is the standard's replacement rule.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <new>
#include <random>
#include <stdexcept>

#include "cli_testing.h"
#include "switchyard/dispatcher.h"
#include "switchyard/dist.h"
#include "switchyard/error.h"
#include "switchyard/replay.h"
#include "switchyard/route_import.h"
#include "switchyard/routing_plan.h"
#include "switchyard/route_file.h"
#include "switchyard/router.h"
#include "testing.h"

// The largest single operator-new request of this process, so a test can check that a crafted
// file is rejected before the reader allocates what it declares (not a timing, an exact bound).
namespace {
std::atomic<size_t> g_largest_new{0};
}  // namespace

void* operator new(size_t n) {
  size_t seen = g_largest_new.load(std::memory_order_relaxed);
  while (n > seen && !g_largest_new.compare_exchange_weak(seen, n)) {
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
// The nothrow form too: its default calls operator new(size_t), but AddressSanitizer intercepts
// it with its own allocator, so an object a library allocates with new (std::nothrow) (simdjson's
// parser implementation, inside libsimdjson.so) would reach the free() below tagged "operator
// new": an alloc-dealloc mismatch of this test's making, not the library's.
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace switchyard {
namespace {

namespace fs = std::filesystem;
using testing::repro;
using testing::test_seed;

class Hostile : public switchyard::testing::TempDirTest {
};

RouteFileInfo info3() { return RouteFileInfo{8, 2, 3, {1, 2, 3}, 4, 0, 0}; }

RouteTable table(uint64_t seed, int64_t T) {
  std::mt19937_64 rng(seed);
  RouteTable t = RouteTable::none(T, 3, 2, 8);
  int32_t* p = t.topk_idx.data<int32_t>();
  for (int64_t i = 0; i < t.topk_idx.numel(); ++i) p[i] = static_cast<int32_t>(rng() % 8);
  return t;
}

void write_file(const std::string& path, const std::vector<RouteTable>& ts) {
  RouteFileWriter w(path, info3());
  for (const auto& t : ts) w.append(t);
  w.close();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// ---------------------------------------------------------------- route data: atomic commit

TEST_F(Hostile, WriterLeavesAnExistingFileUntouchedUntilClose) {
  const RouteTable a = table(test_seed(1), 5), b = table(test_seed(2), 7);
  write_file(p("r.syr"), {a});
  const std::string before = slurp(p("r.syr"));
  {
    RouteFileWriter w(p("r.syr"), info3());
    EXPECT_EQ(slurp(p("r.syr")), before) << "opening a writer must not truncate the file";
    w.append(b);
    EXPECT_EQ(slurp(p("r.syr")), before) << "appends go to the partial file";
    w.close();
  }
  RouteFileReader r = RouteFileReader::open(p("r.syr"));
  ASSERT_TRUE(r.complete());
  ASSERT_EQ(r.num_sequences(), 1);
  EXPECT_TRUE(route_tables_equal(r.read(0), b));
  EXPECT_FALSE(fs::exists(RouteFileWriter::partial_path(p("r.syr"))));
}

TEST_F(Hostile, ExceptionInsideWriterScopeNeverPublishesAPartialFile) {
  const RouteTable a = table(test_seed(3), 4), b = table(test_seed(4), 6);
  write_file(p("r.syr"), {a});
  const std::string before = slurp(p("r.syr"));
  try {
    RouteFileWriter w(p("r.syr"), info3());
    w.append(b);
    throw std::runtime_error("the job failed half way");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(slurp(p("r.syr")), before) << "the previous file must stay as it was";
  // The appended sequence survives in the partial file, which reads as incomplete.
  RouteFileReader part = RouteFileReader::open(RouteFileWriter::partial_path(p("r.syr")));
  EXPECT_FALSE(part.complete());
  ASSERT_EQ(part.num_sequences(), 1);
  EXPECT_TRUE(route_tables_equal(part.read(0), b));
  // No previous file: nothing appears at the path at all.
  try {
    RouteFileWriter w(p("new.syr"), info3());
    w.append(a);
    throw std::runtime_error("again");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(fs::exists(p("new.syr")));
}

TEST_F(Hostile, SecondWriterOnOnePathIsAClearError) {
  RouteFileWriter w1(p("r.syr"), info3());
  w1.append(table(1, 3));
  SY_EXPECT_THROW_MSG(RouteFileWriter(p("r.syr"), info3()), BackendError,
                      "is being written by another RouteFileWriter");
  w1.append(table(2, 3));
  w1.close();
  RouteFileReader r = RouteFileReader::open(p("r.syr"));
  EXPECT_TRUE(r.complete());
  EXPECT_EQ(r.num_sequences(), 2) << "the first writer's data must all be there";
  RouteFileWriter w2(p("r.syr"), info3());  // free again after the commit
  w2.discard();
  EXPECT_EQ(RouteFileReader::open(p("r.syr")).num_sequences(), 2);
  EXPECT_FALSE(fs::exists(RouteFileWriter::partial_path(p("r.syr"))));
}

TEST_F(Hostile, WriterRefusesAPathThatIsNotARegularFile) {
  SY_EXPECT_THROW_MSG(RouteFileWriter(dir_.string(), info3()), std::invalid_argument,
                      "path must be a regular file or not exist");
  EXPECT_TRUE(fs::is_directory(dir_));
}

// ---------------------------------------------------------------- declared sizes

// A one-block file whose block header (checksums valid) declares `tokens` tokens and a zstd frame
// of 17 bytes that declares the matching payload size.
std::string crafted_file(int64_t tokens) {
  RouteFileInfo info{8, 1, 1, {}, 0, 0, 0};
  const std::string path = (fs::temp_directory_path() /
                            ("sy_hostile_craft_" + std::to_string(::getpid()) + ".syr"))
                               .string();
  {
    RouteFileWriter w(path, info);
    w.append(RouteTable::none(1, 1, 1, 8));
    w.close();
  }
  std::string f = slurp(path);
  fs::remove(path);
  const int64_t off = RouteFileReader::from_bytes(f).entry(0).offset;
  f.resize(size_t(off));  // header only; the crafted block follows (no index: recovery scan)
  // Version 2 token-delta block: match bits, then 1 byte per id, no -1 bitmap, not ranked.
  const uint64_t raw = uint64_t(tokens) + (uint64_t(tokens) + 7) / 8;
  std::string frame;
  auto put = [&](std::string& s, uint64_t v, int n) {
    for (int i = 0; i < n; ++i) s += char((v >> (8 * i)) & 0xff);
  };
  put(frame, 0xFD2FB528u, 4);  // zstd magic
  frame += char(0xE0);         // single segment, 8-byte content size
  put(frame, raw, 8);
  put(frame, 1u | (1u << 1) | (1024u << 3), 3);  // last block, RLE, 1024 bytes
  frame += char(0);
  std::string b;
  put(b, 0x4b425953u, 4);  // block magic
  put(b, 4, 4);            // flags: kBlockTokenDelta
  put(b, 0, 8);            // sequence 0
  put(b, uint64_t(tokens), 8);
  put(b, raw, 8);
  put(b, frame.size(), 8);
  put(b, XXH3_64bits(frame.data(), frame.size()), 8);
  put(b, XXH3_64bits(b.data(), b.size()), 8);
  return f + b + frame;
}

TEST(HostileSizes, CraftedFileDeclaringBillionsOfTokensIsADataErrorWithoutAllocating) {
  for (int64_t tokens : {int64_t{3} << 30, int64_t{1} << 28}) {
    SCOPED_TRACE("declared tokens " + std::to_string(tokens));
    const std::string bytes = crafted_file(tokens);
    g_largest_new = 0;
    const RouteFileCheck c = verify_route_bytes(bytes);
    EXPECT_FALSE(c.ok);
    ASSERT_FALSE(c.problems.empty());
    const std::string all = c.problems[0];
    EXPECT_TRUE(all.find("declares") != std::string::npos ||
                all.find("cannot come from") != std::string::npos)
        << all;
    EXPECT_LT(g_largest_new.load(), size_t{1} << 20)
        << "the reader allocated what a 17-byte frame declares";
  }
}

// ---------------------------------------------------------------- the CLI: no data lost, no abort

using testing::CliRun;
using testing::run;

TEST_F(Hostile, FailedAlignWithOutputEqualToInputKeepsTheInput) {
  write_file(p("in.syr"), {table(5, 4), table(6, 9)});
  const std::string before = slurp(p("in.syr"));
  // --tp-rank 5 of --tp 2 fails inside the loop, after the output was opened.
  const CliRun r = run({"routes", "align", p("in.syr"), "-o", p("in.syr"), "--tp", "2",
                        "--sequence-parallel", "--tp-rank", "5"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(slurp(p("in.syr")), before) << "a failed command must leave its -o file untouched";
  EXPECT_TRUE(verify_route_file(p("in.syr")).ok);
  EXPECT_FALSE(fs::exists(RouteFileWriter::partial_path(p("in.syr"))));
  // The same command that succeeds replaces it in one step.
  const CliRun ok = run({"routes", "align", p("in.syr"), "-o", p("in.syr"), "--tp", "2"});
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_TRUE(verify_route_file(p("in.syr")).ok);
}

std::string npy(int64_t rows) {
  std::string h = "{'descr': '<i4', 'fortran_order': False, 'shape': (" + std::to_string(rows) +
                  ", 4, 2), }";
  while ((10 + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += char(h.size());
  out += '\0';
  out += h;
  for (int64_t i = 0; i < rows * 8; ++i) {
    const int32_t v = int32_t(i % 8);
    out.append(reinterpret_cast<const char*>(&v), 4);
  }
  return out;
}

TEST_F(Hostile, FailedMultiFileImportLeavesNoFileMarkedComplete) {
  std::ofstream(p("a.npy"), std::ios::binary) << npy(3);
  std::ofstream(p("b.npy"), std::ios::binary) << npy(5);
  std::ofstream(p("bad.npy"), std::ios::binary) << "not an npy file";
  // No previous output: nothing may appear.
  CliRun r = run({"routes", "import", "--format", "vllm", "--num-experts", "8", "-o", p("o.syr"),
                  p("a.npy"), p("b.npy"), p("bad.npy")});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(fs::exists(p("o.syr"))) << "a failed import must not leave a file marked complete";
  EXPECT_FALSE(fs::exists(RouteFileWriter::partial_path(p("o.syr"))));
  // A previous output stays as it was.
  write_file(p("o.syr"), {table(7, 2)});
  const std::string before = slurp(p("o.syr"));
  r = run({"routes", "import", "--format", "vllm", "--num-experts", "8", "-o", p("o.syr"),
           p("a.npy"), p("bad.npy")});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(slurp(p("o.syr")), before);
}

TEST_F(Hostile, CliTurnsEveryExceptionIntoAnExitCode) {
  // A --out that cannot be created (a file in the way): a message and exit 2, before any work.
  std::ofstream(p("file")) << "x";
  CliRun r = run({"quickcheck", "--hidden", "16", "--experts", "4", "--top-k", "2", "--layers", "1",
                  "--sequences", "1", "--seq-len", "4", "--out", p("file") + "/sub"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("[quickcheck] --out"), std::string::npos) << r.err;
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ASan aborts on allocations past its maximum instead of throwing bad_alloc";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "ASan aborts on allocations past its maximum instead of throwing bad_alloc";
#endif
#endif
  // Sizes inside --help's ranges that no machine can hold: 2^36 tokens x 2^20 hidden.
  r = run({"quickcheck", "--hidden", "1048576", "--sequences", "65536", "--seq-len", "1048576",
           "--out", p("quickcheck")});
  EXPECT_TRUE(r.code == 1 || r.code == 2) << r.code << " " << r.err;
  EXPECT_NE(r.err.find("error:"), std::string::npos) << r.err;
}

TEST_F(Hostile, CliOldDemoNamePointsAtQuickcheckAndTheMainJob) {
  // `switchyard demo` was the engine's quick check; the main job is the Python demo.
  CliRun r = run({"demo", "--hidden", "16"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err,
            "error: `switchyard demo` was renamed `switchyard quickcheck` (the engine's quick "
            "check); the main job is `python -m switchyard.demo`\n");
  EXPECT_TRUE(r.out.empty()) << r.out;
}

// ---------------------------------------------------------------- replay: no mutation on failure

TEST(HostileReplay, FailedReplayForwardConsumesNothing) {
  // The queue protocol: peek, route, take only once routing succeeded.
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.top_k = 2;
  RouterReplay replay({.layer = 3, .top_k = 2});
  const Tensor mb0 = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 1, 2}, {3, 2});
  const Tensor mb1 = Tensor::from_vector(std::vector<int32_t>{3, 2, 1, 0}, {2, 2});
  replay.record(mb0);
  replay.record(mb1);
  std::mt19937_64 rng(test_seed(9));
  const Tensor good = testing::randn({3, 4}, DType::fp32, rng);
  const Tensor wrong_t = testing::randn({5, 4}, DType::fp32, rng);
  // Logits of the wrong micro-batch (5 tokens for a 3-row table): rejected, queues unchanged.
  EXPECT_THROW(topk_route(wrong_t, {.replay_idx = replay.peek_recorded()}, cfg),
               std::invalid_argument);
  EXPECT_EQ(replay.num_recorded(), 2);
  EXPECT_EQ(replay.num_pending_recompute(), 0);
  // The corrected retry replays micro-batch 0, not 1.
  const RouteResult r = topk_route(good, {.replay_idx = replay.peek_recorded()}, cfg);
  replay.replay_forward(replay.pop_recorded());
  EXPECT_TRUE(testing::bitwise_equal(r.topk_idx, mb0)) << repro(test_seed(9));
  EXPECT_EQ(replay.num_recorded(), 1);
  EXPECT_EQ(replay.num_pending_recompute(), 1);
  // Recompute with the wrong T: rejected and still queued; then the right one.
  EXPECT_THROW(replay.peek_recompute(5), std::invalid_argument);
  EXPECT_EQ(replay.num_pending_recompute(), 1);
  EXPECT_TRUE(testing::bitwise_equal(
      topk_route(good, {.replay_idx = replay.peek_recompute(3)}, cfg).topk_idx, mb0));
  replay.recompute(3);
  EXPECT_EQ(replay.num_pending_recompute(), 0);
  // R3 with a bad id: the classifier rejects it before anything is queued.
  const Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 9, 1, 2, 2, 3}, {3, 2});
  EXPECT_THROW(classify_replay_rows(bad, 4), std::invalid_argument);
  EXPECT_EQ(replay.num_pending_recompute(), 0);
}


// ---------------------------------------------------------------- silent wrong results

TEST(HostileDispatch, NonFiniteValuesAreRejectedBeforeAnyExchange) {
  dist::Dispatcher disp(dist::local());
  dist::DispatchOptions o;
  o.num_experts = 4;
  const Tensor idx = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 1, -1}, {3, 2});
  Tensor w = Tensor::from_vector(std::vector<float>{0.5f, 0.5f, 0.7f, 0.3f, 1.0f, 0.0f}, {3, 2});
  Tensor x = Tensor::zeros({3, 4}, DType::fp32);
  x.data<float>()[6] = std::numeric_limits<float>::quiet_NaN();
  SY_EXPECT_THROW_MSG(disp.dispatch(x, idx, w, o), std::invalid_argument,
                      "x has a non-finite value nan at token 1, hidden 2");
  x.data<float>()[6] = 0.0f;
  w.data<float>()[3] = std::numeric_limits<float>::infinity();
  SY_EXPECT_THROW_MSG(disp.dispatch(x, idx, w, o), std::invalid_argument,
                      "topk_weights has a non-finite value inf at token 1, slot 1");
  w.data<float>()[3] = 0.3f;
  dist::DispatchResult r = disp.dispatch(x, idx, w, o);
  Tensor y = r.recv_x.clone();
  y.data<float>()[1] = -std::numeric_limits<float>::infinity();
  SY_EXPECT_THROW_MSG(disp.combine(y, r.handle), std::invalid_argument,
                      "expert_y has a non-finite value -inf at row 0, hidden 1");
}

TEST(HostileDispatch, NegativeCapacityFactorIsAnError) {
  const Tensor idx = Tensor::from_vector(std::vector<int32_t>{0, 1}, {1, 2});
  RoutingPlanOptions o;
  o.capacity_factor = -1.0;
  SY_EXPECT_THROW_MSG(build_routing_plan(idx, Tensor(), 4, o), std::invalid_argument,
                      "capacity_factor must be finite and >= 0");
  o.capacity_factor = 1e300;  // clamped to T*K: keeps every pair, no overflow
  EXPECT_EQ(build_routing_plan(idx, Tensor(), 4, o).num_dropped, 0);
}

TEST(HostileDispatch, ConcurrentUseOfOneCommunicatorIsAClearError) {
  dist::Dispatcher disp(dist::local());
  dist::DispatchOptions o;
  o.num_experts = 2;
  const Tensor idx = Tensor::from_vector(std::vector<int32_t>{0, 1}, {1, 2});
  const Tensor w = Tensor::from_vector(std::vector<float>{0.5f, 0.5f}, {1, 2});
  const Tensor x = Tensor::zeros({1, 4}, DType::fp32);
  dist::DispatchResult r = disp.dispatch(x, idx, w, o);
  {
    // What another thread inside combine looks like to this one.
    const dist::Communicator::Exclusive other(disp.comm(), "combine");
    SY_EXPECT_THROW_MSG(disp.dispatch(x, idx, w, o), std::logic_error,
                        "is in use by another thread (combine)");
    SY_EXPECT_THROW_MSG(disp.combine(r.recv_x, r.handle), std::logic_error,
                        "[combine] the local communicator (rank 0 of 1) is in use");
  }
  EXPECT_NO_THROW(disp.combine(r.recv_x, r.handle));  // released again
}

TEST(HostileThreads, SetNumThreadsIsBounded) {
  const int before = num_threads();
  SY_EXPECT_THROW_MSG(set_num_threads(100000), std::invalid_argument,
                      "[set_num_threads] n must be <= ");
  EXPECT_EQ(num_threads(), before);
}

TEST(HostileImport, RowsThatRepeatAnIdAreNeverStoredAsValid) {
  // [2 tokens, 1 layer, K 2]: token 1 repeats expert 3 (not all-zero: a real invalid row).
  const Tensor a = Tensor::from_vector(std::vector<int32_t>{1, 2, 3, 3}, {2, 1, 2});
  const std::string npy = encode_npy_int32(a);
  ImportOptions o;
  o.num_experts = 8;
  SY_EXPECT_THROW_MSG(import_vllm_npy_bytes(npy, "x.npy", o), std::invalid_argument,
                      "[import] x.npy (sequence 0): row [3, 3] at token 1, hidden layer 0 repeats "
                      "expert 3");
  o.invalid_rows = ReplayRowPolicy::native;
  const ImportResult r = import_vllm_npy_bytes(npy, "x.npy", o);
  EXPECT_EQ(r.report.num_invalid_rows, 1);
  const int32_t* t = r.sequences.at(0).topk_idx.data<int32_t>();
  EXPECT_EQ(std::vector<int32_t>(t, t + 4), (std::vector<int32_t>{1, 2, -1, -1}));
}

}  // namespace
}  // namespace switchyard
