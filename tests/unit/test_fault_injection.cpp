// Fault injection on the route file (complements tests/unit/test_routes_file.cpp, which covers cuts
// at block boundaries + {0, 1, 30} bytes, every 7th prefix and single-bit flips):
//  - a writer process really killed (SIGKILL) between appends, at random moments, and in the middle
//    of a block (the child's file size limit cuts its block write short, then it is killed);
//  - truncation at EVERY byte offset within 24 bytes of every boundary (header end, every block
//    start and end, index, footer), on a closed and on an unclosed file;
//  - every byte set to 0x00 / 0xFF / its complement, and random multi-byte bursts, on a closed and
//    on an unclosed file.
// The invariant everywhere: opening either throws DataError (only for a damaged header) or gives a
// reader whose every sequence either decodes to exactly the table that was written at that index or
// throws DataError naming the block, the sequence and the byte offset; the sequences before the
// damage stay readable; verify_route_bytes reports a damaged file as not ok. Never a crash, never
// another exception, never a wrong table.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "switchyard/error.h"
#include "switchyard/route_file.h"
#include "testing.h"

namespace switchyard {
namespace {

using testing::repro;
using testing::test_seed;

constexpr int64_t kL = 3, kK = 2, kE = 40;

// Sequence i of a file, a pure function of (seed, i, tokens) so a parent can rebuild what a killed
// child wrote. Every 3rd sequence has -1 entries (the none bitmap), sequence lengths vary (0 too).
RouteTable make_table(uint64_t seed, int64_t i, int64_t tokens) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(i));
  RouteTable t = RouteTable::none(tokens, kL, kK, kE);
  int32_t* p = t.topk_idx.data<int32_t>();
  std::uniform_int_distribution<int32_t> ex(0, kE - 1);
  for (int64_t j = 0; j < t.topk_idx.numel(); ++j) p[j] = (i % 3 == 1 && j % 5 == 0) ? -1 : ex(rng);
  return t;
}

int64_t tokens_of(int64_t i) { return (i * 7) % 23; }  // 0, 7, 14, 21, 5, ...

RouteFileInfo file_info() { return RouteFileInfo{kE, kK, kL, {1, 3, 5}, 6, 0, 0}; }

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("sy_fault_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct File {
  std::string bytes;
  std::vector<RouteFileEntry> entries;  // from the closed file's index
  int64_t header_size = 0;
  int64_t blocks_end = 0;  // end of the last block (start of the index)
};

// n sequences; closed (index + footer) or as a killed writer leaves it (blocks only).
File make_file(uint64_t seed, int64_t n, bool close) {
  const std::string path = temp_path(close ? "closed.syr" : "open.syr");
  {
    RouteFileWriter w(path, file_info());
    for (int64_t i = 0; i < n; ++i) w.append(make_table(seed, i, tokens_of(i)));
    w.close();
  }
  File f;
  f.bytes = slurp(path);
  std::remove(path.c_str());
  auto r = RouteFileReader::from_bytes(f.bytes);
  EXPECT_TRUE(r.complete());
  for (int64_t i = 0; i < r.num_sequences(); ++i) f.entries.push_back(r.entry(i));
  f.header_size = f.entries.empty() ? int64_t(f.bytes.size()) : f.entries[0].offset;
  f.blocks_end = f.entries.back().offset + f.entries.back().stored_bytes;
  if (!close) f.bytes.resize(size_t(f.blocks_end));  // index and footer never written
  return f;
}

// The invariant of the file comment. `intact_before`: sequences that must be readable (the damage
// is at or after their blocks). Returns the number of sequences that decoded.
int64_t check_damaged(const std::string& bytes, uint64_t seed, int64_t intact_before,
                      const std::string& what) {
  int64_t readable = 0;
  try {
    RouteFileReader r = RouteFileReader::from_bytes(bytes);
    EXPECT_GE(r.num_sequences(), intact_before) << what << ": " << r.status();
    if (!r.complete()) {
      EXPECT_NE(r.status(), "ok") << what;
    }
    for (int64_t i = 0; i < r.num_sequences(); ++i) {
      try {
        const RouteTable t = r.read(i);
        ++readable;
        if (!route_tables_equal(t, make_table(seed, i, tokens_of(i)))) {
          ADD_FAILURE() << what << ": sequence " << i << " decodes to a WRONG table";
        }
      } catch (const DataError& e) {
        const std::string m = e.what();
        EXPECT_LT(i, r.num_sequences());
        EXPECT_GE(i, intact_before) << what << ": an intact earlier sequence fails: " << m;
        EXPECT_NE(m.find("block " + std::to_string(i)), std::string::npos) << what << ": " << m;
        EXPECT_NE(m.find("byte offset"), std::string::npos) << what << ": " << m;
      }
    }
  } catch (const DataError& e) {
    // Only a damaged header may fail the open, and the message must say so.
    const std::string m = e.what();
    EXPECT_EQ(intact_before, 0) << what << ": open failed: " << m;
    EXPECT_TRUE(m.find("header") != std::string::npos || m.find("not a route file") != std::string::npos ||
                m.find("format version") != std::string::npos)
        << what << ": " << m;
  }
  return readable;
}

// ----------------------------------------------------------------------------- a real killed writer

// Child: appends sequences 0.. forever (or `limit` of them), writing one byte to `ack` after each
// append returns. With `fsize_limit` > 0 the child's file size limit makes a block write fail part
// way (SIGXFSZ ignored, write returns short); the child then reports 'E' and waits to be killed.
[[noreturn]] void writer_child(const std::string& path, uint64_t seed, int ack, int64_t fsize_limit,
                               int64_t tokens_scale) {
  if (fsize_limit > 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl {};
    rl.rlim_cur = rl.rlim_max = static_cast<rlim_t>(fsize_limit);
    ::setrlimit(RLIMIT_FSIZE, &rl);
  }
  // Never destroyed: a killed process runs no destructor (which would write the index).
  RouteFileWriter* w = nullptr;
  try {
    w = new RouteFileWriter(path, file_info());
    for (int64_t i = 0;; ++i) {
      w->append(make_table(seed, i, tokens_of(i) * tokens_scale));
      const char c = 'A';
      if (::write(ack, &c, 1) != 1) ::_exit(3);
    }
  } catch (const std::exception&) {
    const char c = 'E';
    if (::write(ack, &c, 1) != 1) ::_exit(3);
  }
  for (;;) ::pause();
}

struct Killed {
  std::string bytes;
  int64_t acked = 0;
};

// Forks a writer, waits for `acks` appends (or its 'E'), plus `extra` of wall time, then SIGKILLs it.
Killed kill_writer(uint64_t seed, int64_t acks, std::chrono::microseconds extra,
                   int64_t fsize_limit, int64_t tokens_scale) {
  const std::string path = temp_path("killed.syr");
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    writer_child(path, seed, fds[1], fsize_limit, tokens_scale);
  }
  ::close(fds[1]);
  Killed k;
  char c = 0;
  while (k.acked < acks && ::read(fds[0], &c, 1) == 1 && c == 'A') ++k.acked;
  if (extra.count() > 0) std::this_thread::sleep_for(extra);
  ::kill(pid, SIGKILL);
  int st = 0;
  ::waitpid(pid, &st, 0);
  EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) << "the writer must die by SIGKILL";
  // Appends acknowledged after we stopped counting are complete blocks as well.
  while (::read(fds[0], &c, 1) == 1) k.acked += c == 'A' ? 1 : 0;
  ::close(fds[0]);
  // A killed writer never commits: what it appended is in the partial file, `path` never exists.
  EXPECT_FALSE(std::filesystem::exists(path));
  const std::string partial = RouteFileWriter::partial_path(path);
  k.bytes = slurp(partial);
  std::remove(partial.c_str());
  return k;
}

TEST(FaultInjection, WriterKilledBetweenAppendsKeepsEveryAcknowledgedSequence) {
  const uint64_t seed = test_seed(101);
  for (int64_t acks : {0, 1, 5}) {
    Killed k = kill_writer(seed, acks, std::chrono::microseconds(0), 0, 1);
    SCOPED_TRACE("acks " + std::to_string(acks) + " " + repro(seed));
    if (k.acked == 0 && k.bytes.size() < size_t(8 + 8 * 4 + 4 * kL + 8)) {  // header size
      // Killed before (or while) the constructor wrote the header: a clear DataError, no crash.
      SY_EXPECT_THROW_MSG(RouteFileReader::from_bytes(k.bytes), DataError, "truncated header");
      continue;
    }
    auto r = RouteFileReader::from_bytes(k.bytes);
    EXPECT_FALSE(r.complete());
    EXPECT_GE(r.num_sequences(), k.acked) << r.status();
    EXPECT_EQ(check_damaged(k.bytes, seed, k.acked, "killed writer"), r.num_sequences());
  }
}

TEST(FaultInjection, WriterKilledInTheMiddleOfABlockReportsThePartialOne) {
  // The child's file size limit falls inside block `b`: its append writes part of the block and
  // fails, then the child is SIGKILLed. Every earlier sequence reads back; status names block b.
  const uint64_t seed = test_seed(102);
  const File ref = make_file(seed, 8, /*close=*/true);
  for (size_t b : {size_t{1}, size_t{4}, size_t{7}}) {
    const RouteFileEntry& e = ref.entries[b];
    for (int64_t into : {int64_t{1}, e.stored_bytes / 2, e.stored_bytes - 1}) {
      const int64_t limit = e.offset + into;
      Killed k = kill_writer(seed, 1 << 20, std::chrono::microseconds(0), limit, 1);
      SCOPED_TRACE("block " + std::to_string(b) + " cut " + std::to_string(into) + " " + repro(seed));
      ASSERT_EQ(int64_t(k.bytes.size()), limit) << "the block write must stop at the size limit";
      EXPECT_EQ(k.acked, int64_t(b));
      auto r = RouteFileReader::from_bytes(k.bytes);
      EXPECT_FALSE(r.complete());
      EXPECT_EQ(r.num_sequences(), int64_t(b));
      EXPECT_NE(r.status().find("block " + std::to_string(b) + " at byte offset " + std::to_string(e.offset)),
                std::string::npos)
          << r.status();
      EXPECT_EQ(check_damaged(k.bytes, seed, int64_t(b), "cut block"), int64_t(b));
      const RouteFileCheck c = verify_route_bytes(k.bytes);
      EXPECT_FALSE(c.ok);
      EXPECT_EQ(c.num_readable, int64_t(b));
    }
  }
}

TEST(FaultInjection, WriterKilledAtRandomMomentsNeverLosesAcknowledgedData) {
  // Big blocks (tens of KB) appended back to back, killed after a random delay: the kill lands in
  // table generation, compression or the write itself. Whatever it hits, the acknowledged
  // sequences read back exactly and at most one trailing partial block is reported.
  const uint64_t seed = test_seed(103);
  std::mt19937_64 rng(seed);
  int mid_block = 0;
  for (int trial = 0; trial < 6; ++trial) {
    const auto delay = std::chrono::microseconds(std::uniform_int_distribution<int>(0, 3000)(rng));
    Killed k = kill_writer(seed, 2, delay, 0, 400);
    SCOPED_TRACE("trial " + std::to_string(trial) + " " + repro(seed));
    auto r = RouteFileReader::from_bytes(k.bytes);
    EXPECT_FALSE(r.complete());
    ASSERT_GE(r.num_sequences(), k.acked) << r.status();
    EXPECT_LE(r.num_sequences(), k.acked + 1) << "at most the block in flight may be complete unacked";
    const int64_t end = r.num_sequences() ? r.entry(r.num_sequences() - 1).offset +
                                                r.entry(r.num_sequences() - 1).stored_bytes
                                          : int64_t(k.bytes.size());
    if (end < int64_t(k.bytes.size())) {
      ++mid_block;
      EXPECT_NE(r.status().find("block " + std::to_string(r.num_sequences())), std::string::npos)
          << r.status();
    }
    for (int64_t i = 0; i < r.num_sequences(); ++i) {
      EXPECT_TRUE(route_tables_equal(r.read(i), make_table(seed, i, tokens_of(i) * 400))) << i;
    }
  }
  ::testing::Test::RecordProperty("kills_mid_block", mid_block);
}

// --------------------------------------------------------------------------------------- truncation

TEST(FaultInjection, TruncationAtEveryByteAroundEveryBoundary) {
  const uint64_t seed = test_seed(104);
  for (bool closed : {true, false}) {
    const File f = make_file(seed, 7, closed);
    std::vector<int64_t> bounds = {0, f.header_size, f.blocks_end, int64_t(f.bytes.size())};
    for (const auto& e : f.entries) {
      bounds.push_back(e.offset);
      bounds.push_back(e.offset + 56);  // end of the block header
    }
    if (closed) bounds.push_back(int64_t(f.bytes.size()) - 24);  // footer
    std::vector<int64_t> cuts;
    for (int64_t b : bounds)
      for (int64_t d = -24; d <= 24; ++d)
        if (b + d >= 0 && b + d < int64_t(f.bytes.size())) cuts.push_back(b + d);
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (int64_t cut : cuts) {
      const std::string what = std::string(closed ? "closed" : "unclosed") + " file cut at " +
                               std::to_string(cut) + " " + repro(seed);
      const std::string bytes = f.bytes.substr(0, size_t(cut));
      // Sequences whose block lies entirely before the cut.
      int64_t complete = 0;
      for (const auto& e : f.entries) complete += e.offset + e.stored_bytes <= cut ? 1 : 0;
      if (cut < f.header_size) {
        try {
          (void)RouteFileReader::from_bytes(bytes);
          ADD_FAILURE() << what << ": a cut header must not open";
        } catch (const DataError& e) {
          EXPECT_NE(std::string(e.what()).find("header"), std::string::npos) << what << ": " << e.what();
          EXPECT_NE(std::string(e.what()).find("<memory>"), std::string::npos) << what << ": " << e.what();
        }
        continue;
      }
      auto r = RouteFileReader::from_bytes(bytes);
      EXPECT_FALSE(r.complete()) << what;
      EXPECT_EQ(r.num_sequences(), complete) << what << ": " << r.status();
      EXPECT_NE(r.status().find("recovered by scanning"), std::string::npos) << what << ": " << r.status();
      EXPECT_EQ(check_damaged(bytes, seed, complete, what), complete);
      EXPECT_FALSE(verify_route_bytes(bytes).ok) << what;
    }
  }
}

// ------------------------------------------------------------------------------------ flipped bytes

// Which sequence's block holds byte `pos` (-1: header, index or footer).
int64_t block_of(const File& f, int64_t pos) {
  for (size_t b = 0; b < f.entries.size(); ++b)
    if (pos >= f.entries[b].offset && pos < f.entries[b].offset + f.entries[b].stored_bytes) return int64_t(b);
  return -1;
}

TEST(FaultInjection, EveryByteSetToZeroOnesOrComplementIsCaught) {
  const uint64_t seed = test_seed(105);
  for (bool closed : {true, false}) {
    const File f = make_file(seed, 5, closed);
    for (int mode = 0; mode < 3; ++mode) {
      int64_t unnoticed = 0;
      for (int64_t pos = 0; pos < int64_t(f.bytes.size()); ++pos) {
        std::string bad = f.bytes;
        const char old = bad[size_t(pos)];
        bad[size_t(pos)] = mode == 0 ? char(0) : mode == 1 ? char(0xff) : char(~old);
        if (bad[size_t(pos)] == old) continue;  // no change
        const int64_t b = block_of(f, pos);
        const std::string what = std::string(closed ? "closed" : "unclosed") + " mode " +
                                 std::to_string(mode) + " byte " + std::to_string(pos) + " " + repro(seed);
        // Sequences before the damaged block must stay readable (a header byte: none promised).
        const int64_t intact = pos < f.header_size ? 0 : b >= 0 ? b : int64_t(f.entries.size());
        check_damaged(bad, seed, intact, what);
        if (verify_route_bytes(bad).ok) ++unnoticed;
      }
      // A closed file's blocks are also listed by the index, so every change must be noticed; an
      // unclosed file is never ok in the first place.
      EXPECT_EQ(unnoticed, 0) << (closed ? "closed" : "unclosed") << " mode " << mode;
    }
  }
}

TEST(FaultInjection, RandomMultiByteBurstsAreCaught) {
  const uint64_t seed = test_seed(106);
  std::mt19937_64 rng(seed);
  for (bool closed : {true, false}) {
    const File f = make_file(seed, 6, closed);
    const int64_t n = int64_t(f.bytes.size());
    for (int trial = 0; trial < 400; ++trial) {
      std::string bad = f.bytes;
      const int64_t len = std::uniform_int_distribution<int64_t>(2, 16)(rng);
      const int64_t pos = std::uniform_int_distribution<int64_t>(0, n - len)(rng);
      for (int64_t j = pos; j < pos + len; ++j) bad[size_t(j)] = char(rng());
      if (bad == f.bytes) continue;
      const int64_t b = block_of(f, pos);
      const int64_t intact = pos < f.header_size ? 0 : b >= 0 ? b : int64_t(f.entries.size());
      const std::string what = "burst of " + std::to_string(len) + " at " + std::to_string(pos) + " " + repro(seed);
      check_damaged(bad, seed, intact, what);
      EXPECT_FALSE(verify_route_bytes(bad).ok) << what;
    }
  }
}

}  // namespace
}  // namespace switchyard
