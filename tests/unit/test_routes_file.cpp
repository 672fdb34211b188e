// Route file: round trips in every id width, random access, corruption and truncation that must
// raise DataError naming what is wrong, and a writer killed mid-way.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "switchyard/error.h"
#include "switchyard/route_file.h"
#include "testing.h"

namespace switchyard {
namespace {

using testing::repro;
using testing::test_seed;

RouteTable random_table(std::mt19937_64& rng, int64_t T, int64_t L, int64_t K, int64_t E,
                        double none_share = 0.0) {
  RouteTable t = RouteTable::none(T, L, K, E);
  int32_t* p = t.topk_idx.data<int32_t>();
  std::uniform_int_distribution<int64_t> ex(0, E - 1);
  std::uniform_real_distribution<double> u(0, 1);
  for (int64_t i = 0; i < T * L * K; ++i)
    p[i] = u(rng) < none_share ? -1 : static_cast<int32_t>(ex(rng));
  return t;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("sy_routes_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct Written {
  std::string bytes;
  std::vector<RouteTable> tables;
  std::vector<RouteFileEntry> entries;
};

// Writes n random sequences. With close == false the writer runs in a child process that is
// killed (SIGKILL) right after its last append: no close(), no destructor, no flush at exit.
Written write_file(uint64_t seed, int64_t n, int64_t L, int64_t K, int64_t E, bool close = true) {
  std::mt19937_64 rng(seed);
  const std::string path = temp_path("w.syr");
  Written w;
  std::uniform_int_distribution<int64_t> len(0, 40);
  for (int64_t i = 0; i < n; ++i) {
    w.tables.push_back(random_table(rng, len(rng), L, K, E, i % 2 ? 0.1 : 0.0));
  }
  RouteFileInfo info{E, K, L, {}, 3 + 2 * L, 0, 0};
  for (int64_t l = 0; l < L; ++l) info.moe_layers.push_back(3 + 2 * l);
  const auto write_all = [&] {
    RouteFileWriter wr(path, info);
    for (const auto& t : w.tables) wr.append(t);
    if (!close) std::raise(SIGKILL);
  };
  if (close) {
    write_all();
  } else {
    const pid_t pid = ::fork();
    if (pid == 0) {
      write_all();
      ::_exit(1);  // not reached
    }
    int status = 0;
    EXPECT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "writer was not killed";
  }
  // A killed writer never commits: its sequences are in the partial file.
  const std::string written = close ? path : RouteFileWriter::partial_path(path);
  w.bytes = slurp(written);
  std::remove(written.c_str());
  if (close) {
    auto r = RouteFileReader::from_bytes(w.bytes);
    for (int64_t i = 0; i < r.num_sequences(); ++i) w.entries.push_back(r.entry(i));
  }
  return w;
}

TEST(RouteFile, RoundTripAllWidths) {
  const uint64_t seed = test_seed(11);
  for (int64_t E : {1, 2, 8, 64, 256, 257, 70000}) {
    for (int64_t K : {1, 2, 8}) {
      if (K > E) continue;
      Written w = write_file(seed + E * 10 + K, 5, 3, K, E);
      auto r = RouteFileReader::from_bytes(w.bytes);
      ASSERT_TRUE(r.complete()) << r.status();
      EXPECT_EQ(r.info().num_experts, E);
      EXPECT_EQ(r.info().id_width, E <= 256 ? 1 : (E <= 65536 ? 2 : 4));
      EXPECT_EQ(r.info().moe_layers, (std::vector<int64_t>{3, 5, 7}));
      EXPECT_EQ(r.info().num_hidden_layers, 9);
      ASSERT_EQ(r.num_sequences(), 5);
      for (int64_t i = 4; i >= 0; --i) {  // random access, backwards
        EXPECT_TRUE(route_tables_equal(r.read(i), w.tables[size_t(i)]))
            << "E=" << E << " K=" << K << " seq " << i << " " << repro(seed);
      }
    }
  }
}

TEST(RouteFile, RankedBlocksRoundTrip) {
  // Long enough sequences take the rank transform (ids per layer >= 8 x num_experts), in 1 and 2
  // byte widths, with -1 entries, skew (every token to the same experts) and a single expert.
  const uint64_t seed = test_seed(13);
  std::mt19937_64 rng(seed);
  for (int64_t E : {1, 8, 256, 300}) {
    const int64_t K = std::min<int64_t>(8, E), T = 8 * E / K + 5;
    RouteFileInfo info{E, K, 2, {}, 0, 0, 0};
    const std::string path = temp_path("ranked.syr");
    std::vector<RouteTable> tables{random_table(rng, T, 2, K, E, 0.05),
                                   random_table(rng, T, 2, K, E)};
    RouteTable skew = RouteTable::none(T, 2, K, E);
    for (int64_t i = 0; i < skew.topk_idx.numel(); ++i)
      skew.topk_idx.data<int32_t>()[i] = int32_t(i % K);
    tables.push_back(skew);
    {
      RouteFileWriter w(path, info);
      for (const auto& t : tables) w.append(t);
    }
    auto r = RouteFileReader::open(path);
    for (size_t i = 0; i < tables.size(); ++i) {
      EXPECT_TRUE(route_tables_equal(r.read(int64_t(i)), tables[i]))
          << "E=" << E << " seq " << i << " " << repro(seed);
    }
    std::remove(path.c_str());
  }
}

TEST(RouteFile, OnDiskAndEmptyFile) {
  const std::string path = temp_path("disk.syr");
  RouteFileInfo info;
  info.num_experts = 16;
  info.top_k = 2;
  info.num_moe_layers = 4;
  { RouteFileWriter w(path, info); }
  auto r0 = RouteFileReader::open(path);
  EXPECT_TRUE(r0.complete());
  EXPECT_EQ(r0.num_sequences(), 0);
  std::mt19937_64 rng(test_seed(5));
  RouteTable a = random_table(rng, 1031, 4, 2, 16, 0.05), b = RouteTable::none(1, 4, 2, 16);
  {
    RouteFileWriter w(path, info);
    w.append(a);
    w.append(b);
    EXPECT_EQ(w.num_sequences(), 2);
  }
  auto r = RouteFileReader::open(path);
  EXPECT_TRUE(route_tables_equal(r.read(0), a));
  EXPECT_TRUE(route_tables_equal(r.read(1), b));
  EXPECT_THROW(r.read(2), std::out_of_range);
  EXPECT_TRUE(verify_route_file(path).ok);
  std::remove(path.c_str());
  EXPECT_THROW(RouteFileReader::open(path), BackendError);
}

TEST(RouteFile, WriterRejectsBadInput) {
  const std::string path = temp_path("bad.syr");
  RouteFileInfo info{8, 2, 3, {}, 0, 0, 0};
  SY_EXPECT_THROW_MSG(RouteFileWriter(path, RouteFileInfo{0, 2, 3, {}, 0, 0, 0}),
                      std::invalid_argument, "[route_file] num_experts must be in [1, ");
  SY_EXPECT_THROW_MSG(RouteFileWriter(path, RouteFileInfo{8, 2, 3, {1, 2}, 0, 0, 0}),
                      std::invalid_argument, "moe_layers must be empty or have num_moe_layers=3");
  SY_EXPECT_THROW_MSG(RouteFileWriter(path, RouteFileInfo{8, 2, 3, {1, 1, 2}, 0, 0, 0}),
                      std::invalid_argument, "moe_layers must be ascending hidden-layer indices");
  // A device: the commit would rename over it, so it is refused before anything is written
  // (write failures themselves are covered by test_fault_injection's RLIMIT_FSIZE child).
  if (std::filesystem::exists("/dev/full")) {
    SY_EXPECT_THROW_MSG(RouteFileWriter("/dev/full", info), std::invalid_argument,
                        "path must be a regular file or not exist, got /dev/full");
  }
  SY_EXPECT_THROW_MSG(RouteFileWriter("/nonexistent-dir/x.syr", info), BackendError,
                      "open(/nonexistent-dir/x.syr.partial)");
  RouteFileWriter w(path, info);
  SY_EXPECT_THROW_MSG(
      w.append(RouteTable::none(2, 4, 2, 8)), std::invalid_argument,
      "num_moe_layers=3, top_k=2 like the file, got num_experts=8, num_moe_layers=4");
  RouteTable t = RouteTable::none(2, 3, 2, 8);
  t.topk_idx.data<int32_t>()[7] = 8;
  SY_EXPECT_THROW_MSG(w.append(t), std::invalid_argument,
                      "ids must be -1 or in [0, num_experts=8), got 8 at token 1, layer 0, slot 1");
  w.close();
  std::remove(path.c_str());
}

TEST(RouteFile, TruncationAtEveryBlockBoundaryKeepsEarlierSequences) {
  Written w = write_file(test_seed(21), 6, 2, 4, 32);
  ASSERT_EQ(w.entries.size(), 6u);
  for (size_t cut = 0; cut <= w.entries.size(); ++cut) {
    const int64_t end = cut < w.entries.size()
                            ? w.entries[cut].offset
                            : w.entries.back().offset + w.entries.back().stored_bytes;
    for (int64_t extra : {int64_t{0}, int64_t{1}, int64_t{30}}) {
      const std::string bytes = w.bytes.substr(0, size_t(end + extra));
      auto r = RouteFileReader::from_bytes(bytes);
      EXPECT_FALSE(r.complete());
      EXPECT_NE(r.status().find("recovered by scanning"), std::string::npos) << r.status();
      ASSERT_EQ(r.num_sequences(), int64_t(cut)) << "cut " << cut << " extra " << extra;
      for (size_t i = 0; i < cut; ++i)
        EXPECT_TRUE(route_tables_equal(r.read(int64_t(i)), w.tables[i]));
      const RouteFileCheck c = verify_route_bytes(bytes);
      EXPECT_FALSE(c.ok);
      EXPECT_EQ(c.num_readable, int64_t(cut));
    }
  }
  // Truncated inside the header.
  SY_EXPECT_THROW_MSG(RouteFileReader::from_bytes(w.bytes.substr(0, 20)), DataError,
                      "truncated header");
  SY_EXPECT_THROW_MSG(RouteFileReader::from_bytes(""), DataError, "truncated header");
  // Every prefix: never a crash, never a wrong table.
  for (size_t n = 0; n < w.bytes.size(); n += 7) {
    try {
      auto r = RouteFileReader::from_bytes(w.bytes.substr(0, n));
      for (int64_t i = 0; i < r.num_sequences(); ++i) {
        EXPECT_TRUE(route_tables_equal(r.read(i), w.tables[size_t(i)]));
      }
    } catch (const DataError&) {
    }
  }
}

TEST(RouteFile, KilledWriterLeavesCompletedSequences) {
  Written w = write_file(test_seed(31), 4, 3, 2, 64, /*close=*/false);
  auto r = RouteFileReader::from_bytes(w.bytes);
  EXPECT_FALSE(r.complete());
  EXPECT_NE(r.status().find("no index footer"), std::string::npos) << r.status();
  ASSERT_EQ(r.num_sequences(), 4);
  for (int64_t i = 0; i < 4; ++i) EXPECT_TRUE(route_tables_equal(r.read(i), w.tables[size_t(i)]));
  // Killed in the middle of the last block.
  auto r2 = RouteFileReader::from_bytes(w.bytes.substr(0, w.bytes.size() - 3));
  EXPECT_EQ(r2.num_sequences(), 3);
  EXPECT_NE(r2.status().find("block 3 at byte offset"), std::string::npos) << r2.status();
}

TEST(RouteFile, FlippedBytesAreDataErrorsNamingTheBlock) {
  Written w = write_file(test_seed(41), 4, 2, 4, 32);
  int64_t caught = 0;
  for (size_t pos = 0; pos < w.bytes.size(); ++pos) {
    std::string bad = w.bytes;
    bad[pos] = static_cast<char>(bad[pos] ^ 0x10);
    // Which block (if any) holds the flipped byte.
    int64_t block = -1;
    for (size_t b = 0; b < w.entries.size(); ++b) {
      if (int64_t(pos) >= w.entries[b].offset &&
          int64_t(pos) < w.entries[b].offset + w.entries[b].stored_bytes) {
        block = int64_t(b);
      }
    }
    try {
      auto r = RouteFileReader::from_bytes(bad);
      for (int64_t i = 0; i < r.num_sequences(); ++i) {
        try {
          RouteTable t = r.read(i);
          EXPECT_TRUE(route_tables_equal(t, w.tables[size_t(i)])) << "wrong table, flip at " << pos;
        } catch (const DataError& e) {
          ++caught;
          EXPECT_EQ(i, block) << e.what();
          EXPECT_NE(std::string(e.what()).find("block " + std::to_string(i)), std::string::npos);
          EXPECT_NE(std::string(e.what()).find("byte offset"), std::string::npos);
        }
      }
      if (block < 0 && r.num_sequences() == 4) continue;
      EXPECT_FALSE(verify_route_bytes(bad).ok) << "flip at " << pos << " went unnoticed";
    } catch (const DataError& e) {
      ++caught;
      EXPECT_LT(pos, 60u) << "only a corrupt header may fail open: " << e.what();
    }
  }
  EXPECT_GT(caught, 0);
  // Every flip is noticed by verify.
  for (size_t pos = 0; pos < w.bytes.size(); pos += 3) {
    std::string bad = w.bytes;
    bad[pos] = static_cast<char>(bad[pos] ^ 0x01);
    EXPECT_FALSE(verify_route_bytes(bad).ok) << "flip at " << pos;
  }
}

TEST(RouteFile, NotARouteFile) {
  SY_EXPECT_THROW_MSG(RouteFileReader::from_bytes(std::string(100, 'x')), DataError,
                      "not a route file (bad magic at byte offset 0)");
}

}  // namespace
}  // namespace switchyard
