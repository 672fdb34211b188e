// Hostile use of the route file API (issue 22): one RouteFileWriter shared by threads, close() or
// abort() racing an append, and paths with an embedded NUL byte or no characters at all. Every test
// here failed on the branch point 179bd1c.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "switchyard/route_file.h"
#include "switchyard/route_import.h"
#include "testing.h"

namespace switchyard {
namespace {

namespace fs = std::filesystem;
using testing::repro;
using testing::test_seed;

constexpr int64_t kE = 64, kL = 4, kK = 2;

class HostileRoutes : public switchyard::testing::TempDirTest {
};

RouteFileInfo info() { return RouteFileInfo{kE, kK, kL, {}, 0, 0, 0}; }

// Table `s`: valid top-2 rows, its first token's rows carry s so that no two tables are equal.
RouteTable table(int64_t s, int64_t tokens, std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens * kL * kK));
  std::uniform_int_distribution<int32_t> expert(0, kE - 1), step(1, kE - 1);
  for (size_t r = 0; r < ids.size(); r += 2) {
    ids[r] = expert(rng);
    ids[r + 1] = (ids[r] + step(rng)) % kE;
  }
  ids[0] = static_cast<int32_t>(s % kE);
  ids[1] = static_cast<int32_t>((s + 1) % kE);
  ids[2] = static_cast<int32_t>(s / kE);
  ids[3] = static_cast<int32_t>(s / kE + 1);
  RouteTable t;
  t.num_experts = kE;
  t.topk_idx = Tensor::from_vector(ids, {tokens, kL, kK});
  return t;
}

std::string bytes_of(const RouteTable& t) {
  return std::string(static_cast<const char*>(t.topk_idx.raw()), t.topk_idx.nbytes()) + "/" +
         std::to_string(t.num_tokens());
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST_F(HostileRoutes, WriterSharedByThreadsStoresEveryTableOnce) {
  const uint64_t seed = test_seed(2201);
  SCOPED_TRACE(repro(seed));
  std::mt19937_64 rng(seed);
  constexpr int kThreads = 4, kPerThread = 24;
  std::vector<RouteTable> tables;
  std::uniform_int_distribution<int64_t> len(1, 800);
  for (int s = 0; s < kThreads * kPerThread; ++s) tables.push_back(table(s, len(rng), rng));
  std::map<std::string, int> want;
  for (const auto& t : tables) ++want[bytes_of(t)];
  for (int round = 0; round < 6; ++round) {  // a race shows in some rounds only
    SCOPED_TRACE("round " + std::to_string(round));
    const std::string path = p("shared" + std::to_string(round) + ".syr");
    RouteFileWriter w(path, info(), RouteFileWriterOptions{3});
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    std::vector<std::string> errors(kThreads);
    for (int th = 0; th < kThreads; ++th) {
      threads.emplace_back([&, th] {
        ++ready;
        while (ready.load() < kThreads) {
        }
        try {
          for (int i = th; i < static_cast<int>(tables.size()); i += kThreads) w.append(tables[i]);
        } catch (const std::exception& e) {
          errors[th] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& e : errors) EXPECT_EQ(e, "");
    EXPECT_EQ(w.num_sequences(), static_cast<int64_t>(tables.size()));
    w.close();
    const RouteFileCheck c = verify_route_file(path);
    ASSERT_TRUE(c.ok) << (c.problems.empty() ? "" : c.problems[0]);
    std::map<std::string, int> got;
    RouteFileReader r = RouteFileReader::open(path);
    ASSERT_EQ(r.num_sequences(), static_cast<int64_t>(tables.size()));
    for (int64_t i = 0; i < r.num_sequences(); ++i) ++got[bytes_of(r.read(i))];
    EXPECT_TRUE(got == want) << "every appended table exactly once, nothing else";
  }
}

// close() / abort() from one thread while another appends: the appends that returned are exactly
// what the file holds, later ones are refused as "closed", the committed file verifies.
TEST_F(HostileRoutes, CloseOrAbortRacingAnAppendKeepsWhatReturned) {
  const uint64_t seed = test_seed(2201);
  SCOPED_TRACE(repro(seed));
  for (const bool commit : {true, false}) {
    SCOPED_TRACE(commit ? "close" : "abort");
    std::mt19937_64 rng(seed);
    std::vector<RouteTable> tables;
    for (int s = 0; s < 64; ++s) tables.push_back(table(s, 1 + s * 7 % 300, rng));
    const std::string path = p(commit ? "closed.syr" : "aborted.syr");
    RouteFileWriter w(path, info(), RouteFileWriterOptions{3});
    std::vector<int> done;
    std::string refused;
    std::atomic<bool> started{false};
    std::thread appender([&] {
      for (int round = 0; round < 200; ++round) {
        for (int i = 0; i < static_cast<int>(tables.size()); ++i) {
          try {
            w.append(tables[i]);
          } catch (const std::invalid_argument& e) {
            refused = e.what();
            return;
          }
          done.push_back(i);
          started = true;
        }
      }
    });
    while (!started.load()) {
    }
    if (commit) {
      w.close();
    } else {
      w.abort();
    }
    appender.join();
    EXPECT_NE(refused.find("is closed"), std::string::npos) << refused;
    const std::string stored = commit ? path : RouteFileWriter::partial_path(path);
    if (commit) {
      const RouteFileCheck c = verify_route_file(stored);
      EXPECT_TRUE(c.ok) << (c.problems.empty() ? "" : c.problems[0]);
    }
    RouteFileReader r = RouteFileReader::open(stored);
    EXPECT_EQ(r.complete(), commit) << r.status();
    ASSERT_EQ(r.num_sequences(), static_cast<int64_t>(done.size()));
    for (size_t i = 0; i < done.size(); ++i) {
      ASSERT_TRUE(route_tables_equal(r.read(static_cast<int64_t>(i)), tables[done[i]])) << i;
    }
  }
}

// A std::string may hold a NUL; the OS reads a C path up to it, so "dir/model\0.syr" used to
// name (and truncate, then overwrite) "dir/model".
TEST_F(HostileRoutes, PathWithANulByteIsRefusedAndTouchesNoOtherFile) {
  const std::string victim = p("model");
  std::ofstream(victim) << "an unrelated file that must survive\n";
  const std::string nul = victim + std::string(1, '\0') + ".syr";
  SY_EXPECT_THROW_MSG(RouteFileWriter(nul, info()), std::invalid_argument,
                      "[route_file] path holds an embedded null byte at offset");
  SY_EXPECT_THROW_MSG(RouteFileReader::open(nul), std::invalid_argument,
                      "[route_file] path holds an embedded null byte");
  SY_EXPECT_THROW_MSG(verify_route_file(nul), std::invalid_argument, "embedded null byte");
  ImportOptions o;
  o.num_experts = kE;
  SY_EXPECT_THROW_MSG(import_vllm_files({nul}, o), std::invalid_argument,
                      "[import] path holds an embedded null byte");
  o.num_input_layers = kL;
  o.top_k = kK;
  SY_EXPECT_THROW_MSG(import_sglang({nul}, o), std::invalid_argument, "embedded null byte");
  EXPECT_EQ(slurp(victim), "an unrelated file that must survive\n");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator{}), 1);
}

TEST_F(HostileRoutes, EmptyPathIsRefusedByReaderVerifyAndImport) {
  SY_EXPECT_THROW_MSG(RouteFileWriter("", info()), std::invalid_argument,
                      "[route_file] path must not be empty");
  SY_EXPECT_THROW_MSG(RouteFileReader::open(""), std::invalid_argument,
                      "[route_file] path must not be empty");
  SY_EXPECT_THROW_MSG(verify_route_file(""), std::invalid_argument, "path must not be empty");
  ImportOptions o;
  o.num_experts = kE;
  SY_EXPECT_THROW_MSG(import_vllm_files({""}, o), std::invalid_argument,
                      "[import] path must not be empty");
}

}  // namespace
}  // namespace switchyard
