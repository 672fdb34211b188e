// main() of the MPI test binaries: MPI_Init/MPI_Finalize around GoogleTest. Only rank 0 prints the
// usual report (and the --gtest_list_tests listing); other ranks print their failures prefixed
// with their rank. The exit code is nonzero on every rank when any rank failed.
//
// Every case is a collective: all ranks must run the same cases in the same order. So
//  - a --gtest_shuffle seed is rank 0's (a time-based seed would differ per rank);
//  - before the first case the ranks compare the ordered list of cases their filter and sharding
//    selected, and before every case its name: a difference aborts the job, naming both sides,
//    instead of leaving ranks waiting in different collectives;
//  - a watchdog per case (kCaseTimeoutSeconds) turns a hang (a rank that left a case early, e.g.
//    after a failed ASSERT, while the others wait in the case's collectives) into a message naming
//    the case and the death of the job, well inside the ctest timeout.
#include <gtest/gtest.h>
// C API only: the deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "testing.h"

namespace {

constexpr unsigned kCaseTimeoutSeconds = 60;

std::string full_name(const ::testing::TestInfo& t) {
  return std::string(t.test_suite_name()) + "." + t.name();
}

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  // (The case's name is kept here: UnitTest::current_test_info() would take the lock that gtest
  // holds while it reports a result.)
  void OnTestStart(const ::testing::TestInfo& t) override { case_ = full_name(t) + ": "; }
  void OnTestEnd(const ::testing::TestInfo&) override { case_.clear(); }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "[rank %d] %s%s:%d: Failure\n%s\n", rank_, case_.c_str(),
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
    }
  }

 private:
  int rank_;
  std::string case_;
};

// What the SIGALRM handler writes (prepared outside the handler: it may only call write()).
char g_watchdog_message[512];
size_t g_watchdog_length = 0;

void on_watchdog(int) {
  if (g_watchdog_length) (void)!::write(STDERR_FILENO, g_watchdog_message, g_watchdog_length);
  std::signal(SIGALRM, SIG_DFL);
  std::raise(SIGALRM);
}

// Keeps the ranks on the same case: compares the selected cases once per iteration and each
// case's name as it starts (both with MPI_Allgather on MPI_COMM_WORLD), arms the watchdog.
class Lockstep : public ::testing::EmptyTestEventListener {
 public:
  Lockstep(int rank, int size) : rank_(rank), size_(size) {}

  void OnTestIterationStart(const ::testing::UnitTest& u, int) override {
    std::vector<std::string> names;
    std::string all;
    for (int i = 0; i < u.total_test_suite_count(); ++i) {
      const ::testing::TestSuite& s = *u.GetTestSuite(i);
      for (int j = 0; j < s.total_test_count(); ++j) {
        const ::testing::TestInfo& t = *s.GetTestInfo(j);
        if (!t.should_run()) continue;
        names.push_back(full_name(t));
        all += names.back() + "\n";
      }
    }
    const std::string first = names.empty() ? std::string("(none)") : names.front();
    agree(switchyard::testing::seed_of(all),
          "selected " + std::to_string(names.size()) + " cases, the first " + first,
          "the ranks selected different cases (a --gtest_filter, GTEST_SHARD_INDEX or "
          "--gtest_shuffle seed that differs between ranks?)");
  }

  void OnTestStart(const ::testing::TestInfo& t) override {
    const std::string name = full_name(t);
    agree(switchyard::testing::seed_of(name), "is about to run " + name,
          "the ranks are at different cases");
    std::snprintf(g_watchdog_message, sizeof g_watchdog_message,
                  "[rank %d] %s still running after %u s: a rank is stuck in a collective "
                  "(another rank left the case early, e.g. after a failed ASSERT); aborting\n",
                  rank_, name.c_str(), kCaseTimeoutSeconds);
    g_watchdog_length = std::strlen(g_watchdog_message);
    ::alarm(kCaseTimeoutSeconds);
  }

  void OnTestEnd(const ::testing::TestInfo&) override {
    ::alarm(0);
    g_watchdog_length = 0;
  }

 private:
  // Every rank passes its hash; when they differ, every rank says what it is doing and the job
  // is aborted.
  void agree(uint64_t h, const std::string& mine, const char* why) const {
    std::vector<uint64_t> all(static_cast<size_t>(size_));
    MPI_Allgather(&h, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
    for (uint64_t o : all) {
      if (o != h) {
        std::fprintf(stderr, "[rank %d] %s: %s\n", rank_, why, mine.c_str());
        std::fflush(stderr);
        ::sleep(1);  // let the other ranks print theirs
        MPI_Abort(MPI_COMM_WORLD, 2);
      }
    }
  }

  int rank_, size_;
};

// Rank 0's report lists only its own failures: it also names every case that failed on each rank.
void print_failed_cases_on_rank0(int rank, int size) {
  std::string mine;
  const ::testing::UnitTest& u = *::testing::UnitTest::GetInstance();
  for (int i = 0; i < u.total_test_suite_count(); ++i) {
    const ::testing::TestSuite& s = *u.GetTestSuite(i);
    for (int j = 0; j < s.total_test_count(); ++j) {
      const ::testing::TestInfo& t = *s.GetTestInfo(j);
      if (t.result()->Failed()) {
        mine += ' ';
        mine += full_name(t);
      }
    }
  }
  int n = static_cast<int>(mine.size());
  std::vector<int> counts(static_cast<size_t>(size)), offsets(static_cast<size_t>(size) + 1, 0);
  MPI_Gather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  for (int r = 0; r < size; ++r) offsets[r + 1] = offsets[r] + counts[r];
  std::vector<char> all(static_cast<size_t>(offsets[size]) + 1);
  MPI_Gatherv(mine.data(), n, MPI_CHAR, all.data(), counts.data(), offsets.data(), MPI_CHAR, 0,
              MPI_COMM_WORLD);
  if (rank != 0) return;
  std::fprintf(stderr, "some rank failed\n");
  for (int r = 0; r < size; ++r) {
    if (counts[r]) {
      std::fprintf(stderr, "failed on rank %d:%.*s\n", r, counts[r], all.data() + offsets[r]);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // One shuffle order for all ranks: rank 0's seed (chosen from the clock when the flag is 0).
  int seed = GTEST_FLAG_GET(random_seed);
  if (rank == 0 && seed == 0 && GTEST_FLAG_GET(shuffle)) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count();
    seed = static_cast<int>(ms % 99999) + 1;
  }
  MPI_Bcast(&seed, 1, MPI_INT, 0, MPI_COMM_WORLD);
  GTEST_FLAG_SET(random_seed, seed);
  if (rank != 0 && GTEST_FLAG_GET(list_tests)) {
    if (!std::freopen("/dev/null", "w", stdout)) return 1;  // one listing, rank 0's
  }
  // Lockstep first, so that a case's start is printed once every rank has reached it.
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  ::testing::TestEventListener* printer = listeners.Release(listeners.default_result_printer());
  listeners.Append(new Lockstep(rank, size));
  if (rank == 0) {
    listeners.Append(printer);
  } else {
    delete printer;
    listeners.Append(new RankFailurePrinter(rank));
  }
  std::signal(SIGALRM, on_watchdog);
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (failed) print_failed_cases_on_rank0(rank, size);
  MPI_Finalize();
  return failed;
}
