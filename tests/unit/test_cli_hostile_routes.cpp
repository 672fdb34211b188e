// `switchyard routes export` is atomic (issue 22): an export that fails part-way (a file size
// limit, a read-only directory) leaves the previous export byte for byte and no partial files. The
// export used to truncate and rewrite OUT.routed_experts.npy and OUT.attention_mask.npy in place,
// so a failure destroyed the previous export and left a cut file beside an old mask. Every test
// here failed on the branch point 179bd1c.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli_testing.h"
#include "testing.h"
#include "switchyard/route_file.h"

namespace {

namespace fs = std::filesystem;
using switchyard::testing::CliRun;
using switchyard::testing::run;

class CliExportAtomic : public switchyard::testing::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    fs::create_directories(dir_ / "out");
    // 2 hidden layers, layer 1 MoE, K 1: the ids file (4 bytes a token) is smaller than the mask
    // (8 bytes a token), so a limit between their sizes fails the second file after the first
    // was written whole.
    switchyard::RouteFileInfo info{8, 1, 1, {1}, 2, 0, 0};
    switchyard::RouteFileWriter w(p("in.syr"), info);
    for (int s = 0; s < 3; ++s) w.append(switchyard::RouteTable::none(40 + s, 1, 1, 8));
    w.close();
  }
  std::string out(const std::string& name) const { return (dir_ / "out" / name).string(); }
  static std::string slurp(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::ostringstream s;
    s << f.rdbuf();
    return s.str();
  }
  std::vector<std::string> export_args() const {
    return {"routes", "export", "--format", "verl", p("in.syr"), "-o", out("batch")};
  }
  // The previous export: arbitrary bytes, to be found unchanged.
  void old_export() const {
    std::ofstream(out("batch.routed_experts.npy"), std::ios::binary) << "previous ids";
    std::ofstream(out("batch.attention_mask.npy"), std::ios::binary) << "previous mask";
  }
  void expect_old_export() const {
    EXPECT_EQ(slurp(out("batch.routed_experts.npy")), "previous ids");
    EXPECT_EQ(slurp(out("batch.attention_mask.npy")), "previous mask");
  }
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_ / "out")) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }
  // Runs the export in a child process whose files may not grow past `limit` bytes; SIGXFSZ
  // ignored (as the `switchyard` program does: the write fails with EFBIG) or left to kill it.
  // Returns the exit code, or 128 + the signal that ended it.
  int export_with_file_size_limit(rlim_t limit, bool ignore_sigxfsz) const {
    const std::vector<std::string> args = export_args();
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::signal(SIGXFSZ, ignore_sigxfsz ? SIG_IGN : SIG_DFL);
      const rlimit rl{limit, limit};
      if (::setrlimit(RLIMIT_FSIZE, &rl) != 0) ::_exit(99);
      std::ostringstream o, e;
      ::_exit(run_cli(args, o, e));
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

TEST_F(CliExportAtomic, ExportPastAFileSizeLimitLeavesThePreviousExport) {
  const CliRun ok = run({"routes", "export", "--format", "verl", p("in.syr"), "-o", p("sizes")});
  ASSERT_EQ(ok.code, 0) << ok.err;
  const auto ids_size = fs::file_size(p("sizes.routed_experts.npy"));
  const auto mask_size = fs::file_size(p("sizes.attention_mask.npy"));
  ASSERT_LT(ids_size, mask_size);
  // 100 bytes: the first file fails; the midpoint: the first is written whole, the second fails.
  for (const rlim_t limit : {rlim_t{100}, static_cast<rlim_t>((ids_size + mask_size) / 2)}) {
    SCOPED_TRACE("limit " + std::to_string(limit));
    old_export();
    EXPECT_EQ(export_with_file_size_limit(limit, /*ignore_sigxfsz=*/true), 2);
    expect_old_export();
    EXPECT_EQ(listing(),
              (std::vector<std::string>{"batch.attention_mask.npy", "batch.routed_experts.npy"}))
        << "no partial file is left";
    // Killed by SIGXFSZ mid-write (as by Ctrl-C): the previous export is still whole.
    EXPECT_EQ(export_with_file_size_limit(limit, /*ignore_sigxfsz=*/false), 128 + SIGXFSZ);
    expect_old_export();
  }
  // The next export replaces the previous one and whatever partial files a killed one left.
  const CliRun again = run(export_args());
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(slurp(out("batch.routed_experts.npy")), slurp(p("sizes.routed_experts.npy")));
  EXPECT_EQ(slurp(out("batch.attention_mask.npy")), slurp(p("sizes.attention_mask.npy")));
  EXPECT_EQ(listing(),
            (std::vector<std::string>{"batch.attention_mask.npy", "batch.routed_experts.npy"}));
}

// The second file cannot be created (a directory stands where it would be written): nothing of
// the export may have replaced the first file.
TEST_F(CliExportAtomic, ExportThatCannotCreateItsSecondFileLeavesThePreviousExport) {
  old_export();
  fs::create_directories(out("batch.attention_mask.npy.partial"));
  const CliRun r = run(export_args());
  EXPECT_EQ(r.code, 2) << r.err;
  expect_old_export();
  EXPECT_FALSE(fs::exists(out("batch.routed_experts.npy.partial")));
}

}  // namespace
