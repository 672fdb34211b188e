// Every `switchyard routes` command that reads a route file verifies what it reads (issue 35
// item 4): on a cut or corrupted file, inspect / stats / diff / align / export exit 1 with a
// message naming the file and the damaged record and write no output (align and export used to
// write 2 of 3 sequences and exit 0, while validate called the file INVALID). --salvage keeps the
// readable sequences, says how many it recovered and what was lost, and still exits 1. Run
// in-process through the real program (run_cli), as a user runs it.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli_testing.h"
#include "route_bomb.h"
#include "switchyard/route_file.h"
#include "testing.h"

namespace {

namespace fs = std::filesystem;
using switchyard::RouteFileReader;
using switchyard::testing::CliRun;
using switchyard::testing::run;

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

class CliVerifiedReads : public switchyard::testing::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    // 3 sequences, E 8, K 2, MoE layers 1..3 of 4 hidden layers (export needs the layer map).
    switchyard::RouteFileInfo info{8, 2, 3, {1, 2, 3}, 4, 0, 0};
    {
      switchyard::RouteFileWriter w(p("in.syr"), info);
      for (int s = 0; s < 3; ++s) {
        const int64_t T = 5 + s;
        std::vector<int32_t> ids;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t l = 0; l < 3; ++l)
            for (int64_t k = 0; k < 2; ++k) ids.push_back(static_cast<int32_t>((t + l + s + 4 * k) % 8));
        switchyard::RouteTable tab;
        tab.num_experts = 8;
        tab.topk_idx = switchyard::Tensor::from_vector(ids, {T, 3, 2});
        w.append(tab);
      }
    }
    const std::string bytes = slurp(p("in.syr"));
    const RouteFileReader r = RouteFileReader::open(p("in.syr"));
    block2_ = r.entry(2).offset;
    end2_ = r.entry(2).offset + r.entry(2).stored_bytes;
    // Cut inside the last block's payload (a copy that stopped early, a full disk).
    std::ofstream(p("cut.syr"), std::ios::binary) << bytes.substr(0, size_t(end2_ - 3));
    // Every block whole, the index and footer gone (a writer killed before close()).
    std::ofstream(p("noindex.syr"), std::ios::binary) << bytes.substr(0, size_t(end2_));
    // One flipped byte in block 1's payload, the index intact.
    std::string flipped = bytes;
    flipped[size_t(r.entry(1).offset + 60)] ^= 0x20;
    std::ofstream(p("flipped.syr"), std::ios::binary) << flipped;
  }
  // Every file in the directory (to see that nothing was written, no .partial left either).
  std::vector<std::string> listing() const {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(dir_)) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  }
  // The reading commands on `file`, each with `extra` appended.
  std::vector<std::vector<std::string>> commands(const std::string& file,
                                                 const std::vector<std::string>& extra) const {
    std::vector<std::vector<std::string>> v = {
        {"routes", "inspect", p(file)},
        {"routes", "stats", p(file)},
        {"routes", "diff", p(file), p("in.syr")},
        {"routes", "align", p(file), "-o", p("out.syr"), "--tp", "2"},
        {"routes", "export", "--format", "verl", p(file), "-o", p("out")},
    };
    for (auto& c : v) c.insert(c.end(), extra.begin(), extra.end());
    return v;
  }
  const std::vector<std::string> inputs_ = {"cut.syr", "flipped.syr", "in.syr", "noindex.syr"};
  int64_t block2_ = 0, end2_ = 0;
};

std::string shown(const std::vector<std::string>& args) {
  std::string s = "switchyard";
  for (const auto& a : args) s += " " + a;
  return s;
}

TEST_F(CliVerifiedReads, EveryReadingCommandRefusesACutFileAndWritesNothing) {
  for (const auto& args : commands("cut.syr", {})) {
    SCOPED_TRACE(shown(args));
    const CliRun r = run(args);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_NE(r.err.find("error: [" + args[0] + " " + args[1] + "] " + p("cut.syr") +
                         " is damaged (2 sequences readable before the damage)"),
              std::string::npos) << r.err;
    EXPECT_NE(r.err.find("block 2 at byte offset " + std::to_string(block2_) +
                         ": truncated block"),
              std::string::npos) << r.err;
    EXPECT_NE(r.err.find("rerun with --salvage"), std::string::npos) << r.err;
    EXPECT_EQ(listing(), inputs_);  // no output, no .partial
  }
}

TEST_F(CliVerifiedReads, AFileWithoutItsIndexIsRefusedToo) {
  for (const auto& args : commands("noindex.syr", {})) {
    SCOPED_TRACE(shown(args));
    const CliRun r = run(args);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_NE(r.err.find(p("noindex.syr") + " is damaged (3 sequences readable before the "
                         "damage): no index footer"),
              std::string::npos) << r.err;
    EXPECT_EQ(listing(), inputs_);
  }
}

TEST_F(CliVerifiedReads, ACorruptBlockInsideAnIntactFileNamesTheSequence) {
  // inspect reads the header and index only: the file is complete there.
  for (const auto& args : commands("flipped.syr", {})) {
    if (args[1] == "inspect") continue;
    SCOPED_TRACE(shown(args));
    const CliRun r = run(args);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_NE(r.err.find(p("flipped.syr") + ": sequence 1 cannot be read: [route_file] " +
                         p("flipped.syr") + ": block 1 (sequence 1)"),
              std::string::npos) << r.err;
    EXPECT_NE(r.err.find("payload checksum mismatch"), std::string::npos) << r.err;
    EXPECT_EQ(listing(), inputs_);
  }
}

TEST_F(CliVerifiedReads, SalvageWritesTheReadableSequencesSaysWhatWasLostAndExits1) {
  // align: one micro-batch of the 2 readable sequences, committed and valid.
  CliRun r = run({"routes", "align", p("cut.syr"), "-o", p("out.syr"), "--salvage"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.out.find("aligned 2 sequences"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("[routes align] salvaged " + p("cut.syr") +
                       ": recovered 2 of the 2 sequences found, lost 0 damaged, and the file is "
                       "incomplete"),
            std::string::npos) << r.err;
  EXPECT_NE(r.err.find("unreadable bytes follow byte offset " + std::to_string(block2_) +
                       " (a cut block or a damaged index: how many sequences they held is "
                       "unknown)"),
            std::string::npos) << r.err;
  EXPECT_TRUE(switchyard::verify_route_file(p("out.syr")).ok);
  EXPECT_FALSE(fs::exists(p("out.syr.partial")));

  // export: the sequences around the corrupt one.
  r = run({"routes", "export", "--format", "verl", p("flipped.syr"), "-o", p("out"), "--salvage"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.out.find("exported 2 sequences"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("recovered 2 of the 3 sequences found, lost 1 damaged\n  lost sequence 1: "
                       "[route_file] " + p("flipped.syr") + ": block 1 (sequence 1)"),
            std::string::npos) << r.err;
  EXPECT_NE(slurp(p("out.routed_experts.npy")).find("'shape': (2, 7, 4, 2)"), std::string::npos);
  EXPECT_TRUE(fs::exists(p("out.attention_mask.npy")));

  // stats and diff report on what was read, then exit 1.
  r = run({"routes", "stats", p("noindex.syr"), "--salvage"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.out.find(p("noindex.syr") + ": 3 sequences"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("it ends after sequence 2 without its index (sequences written after it, "
                       "if any, are lost)"),
            std::string::npos) << r.err;
  r = run({"routes", "diff", p("cut.syr"), p("in.syr"), "--salvage"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.out.find("compared 2 sequences"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("router decisions that differ:   0.00%"), std::string::npos) << r.out;
}

TEST_F(CliVerifiedReads, IntactFilesStillExit0AndSalvageChangesNothingForThem) {
  for (const auto& args : commands("in.syr", {"--salvage"})) {
    SCOPED_TRACE(shown(args));
    const CliRun r = run(args);
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.err.find("salvaged"), std::string::npos) << r.err;
  }
}

TEST_F(CliVerifiedReads, ADecodeBombIsRefusedUnlessTheLimitIsRaised) {
  // 2M tokens in ~130 bytes of payload: 66 MiB decoded, over the default 64 MiB.
  std::ofstream(p("bomb.syr"), std::ios::binary) << switchyard::testing::bomb_message(int64_t{2} << 20);
  CliRun r = run({"routes", "stats", p("bomb.syr")});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("sequence 0 cannot be read: [route_file] " + p("bomb.syr") +
                       ": block 0 (sequence 0) at byte offset 48: declares 2097152 tokens"),
            std::string::npos) << r.err;
  EXPECT_NE(r.err.find("more than max_decoded_bytes=67108864"), std::string::npos) << r.err;
  r = run({"routes", "validate", p("bomb.syr")});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("more than max_decoded_bytes=67108864"), std::string::npos) << r.out;
  r = run({"routes", "stats", p("bomb.syr"), "--max-decoded-bytes", "100000000"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("1 sequences, 2097152 tokens"), std::string::npos) << r.out;
  r = run({"routes", "validate", p("bomb.syr"), "--max-decoded-bytes", "100000000"});
  EXPECT_EQ(r.code, 0) << r.out;
}

}  // namespace
