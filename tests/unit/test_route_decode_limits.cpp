// Decode limits of route files and messages (issue 35 item 5): every size a header declares is
// checked against the bytes present and against RouteDecodeOptions::max_decoded_bytes before
// anything is allocated. A 460-byte message (tests/common/route_bomb.h: every token repeats the
// first, so the payload is one match bit per id, stored as zstd RLE blocks) declares an 8M-token
// table of 256 MiB; it used to be allocated and decoded. Memory is checked in a forked child whose
// address space may grow by 64 MiB only (RLIMIT_AS): an allocation of the declared size fails
// there with std::bad_alloc instead of the DataError the limit gives.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <new>
#include <random>

#include "route_bomb.h"
#include "switchyard/error.h"
#include "switchyard/route_file.h"
#include "testing.h"

namespace {

using switchyard::DataError;
using switchyard::RouteDecodeOptions;
using switchyard::RouteFileReader;
using switchyard::testing::bomb_message;

constexpr int kCaught = 0, kBadAlloc = 3, kDecoded = 4, kOther = 5;

// ASan reserves terabytes of address space for its shadow memory and aborts when an mmap fails:
// RLIMIT_AS does not work under it, so the sanitizer build runs the child without the cap (the
// error is still checked; the release build checks the memory).
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

// Runs `body` in a forked child whose address space may grow by `headroom` bytes from what it
// has now; returns the child's exit code (128 + signal when it died).
int with_memory_cap(int64_t headroom, const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    long pages = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    const rlim_t cap = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) +
                       static_cast<rlim_t>(headroom);
    const rlimit rl{cap, cap};
    if (!kAddressSanitizer && (pages == 0 || ::setrlimit(RLIMIT_AS, &rl) != 0)) ::_exit(99);
    int code = kOther;
    try {
      code = body();
    } catch (const DataError&) {
      code = kCaught;
    } catch (const std::bad_alloc&) {
      code = kBadAlloc;
    } catch (...) {
      code = kOther;
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no DataError";
  return {};
}

TEST(RouteDecodeLimits, A460ByteMessageDeclaring256MiBIsRefusedBeforeAllocating) {
  const std::string bomb = bomb_message(int64_t{8} << 20);
  ASSERT_LT(bomb.size(), 476u);
  // 64 MiB of headroom: decoding the declared 256 MiB table cannot fit.
  EXPECT_EQ(with_memory_cap(int64_t{64} << 20,
                            [&] {
                              (void)switchyard::decode_route_file(bomb);
                              return kDecoded;
                            }),
            kCaught);
  const std::string msg = message_of([&] { (void)switchyard::decode_route_file(bomb); });
  EXPECT_NE(msg.find("8388608 tokens x 2 layers x top_k 4 (268435456 bytes of int32 ids)"),
            std::string::npos) << msg;
  EXPECT_NE(msg.find("a message of " + std::to_string(bomb.size()) + " bytes"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("more than max_decoded_bytes=67108864 (the default: the larger of 67108864 "
                     "bytes and 1024 x the " + std::to_string(bomb.size()) + " bytes present)"),
            std::string::npos) << msg;
  EXPECT_NE(msg.find("raise the limit (C++ RouteDecodeOptions::max_decoded_bytes, Python "
                     "max_decoded_bytes=, CLI --max-decoded-bytes)"),
            std::string::npos) << msg;
}

TEST(RouteDecodeLimits, ManySmallBombsInOneMessageAreRefusedAsAWhole) {
  // 300 blocks of 1M tokens (33 MiB each, under the 64 MiB limit one by one) in ~42 KB: 9.9 GB in
  // all, refused before the first block is decompressed.
  const std::string bomb = bomb_message(int64_t{1} << 20, 300);
  ASSERT_LT(bomb.size(), 45000u);
  EXPECT_EQ(with_memory_cap(int64_t{64} << 20,
                            [&] {
                              (void)switchyard::decode_route_file(bomb);
                              return kDecoded;
                            }),
            kCaught);
  const std::string msg = message_of([&] { (void)switchyard::decode_route_file(bomb); });
  EXPECT_NE(msg.find("[route_file] <wire>: blocks 0..1 of 300 declare 2097152 tokens"),
            std::string::npos) << msg;
  EXPECT_NE(msg.find("more than max_decoded_bytes="), std::string::npos) << msg;
}

TEST(RouteDecodeLimits, TheFileReaderChecksEachSequenceAgainstTheLimit) {
  const std::string bomb = bomb_message(int64_t{8} << 20);
  const RouteFileReader r = RouteFileReader::from_bytes(bomb);  // opening reads no block
  ASSERT_EQ(r.num_sequences(), 1);
  EXPECT_EQ(with_memory_cap(int64_t{64} << 20,
                            [&] {
                              (void)r.read(0);
                              return kDecoded;
                            }),
            kCaught);
  const std::string msg = message_of([&] { (void)r.read(0); });
  EXPECT_NE(msg.find("[route_file] <memory>: block 0 (sequence 0) at byte offset 48: declares "
                     "8388608 tokens x 2 layers x top_k 4 (268435456 bytes of int32 ids) and a "
                     "payload of 8388616 bytes: 276824072 bytes decoded from"),
            std::string::npos) << msg;
  // On disk, through verify: one problem, nothing readable.
  const std::string path = ::testing::TempDir() + "sy_bomb_" + std::to_string(::getpid()) + ".syr";
  std::ofstream(path, std::ios::binary) << bomb;
  const switchyard::RouteFileCheck c = switchyard::verify_route_file(path);
  std::remove(path.c_str());
  EXPECT_FALSE(c.ok);
  EXPECT_EQ(c.num_readable, 0);
  ASSERT_EQ(c.problems.size(), 1u);
  EXPECT_NE(c.problems[0].find("more than max_decoded_bytes=67108864"), std::string::npos)
      << c.problems[0];
}

TEST(RouteDecodeLimits, ARaisedLimitDecodesTheSameMessageExactly) {
  // 2M tokens: 64 MiB of ids + 2 MiB of payload, just past the default limit.
  const int64_t T = int64_t{2} << 20;
  const std::string bomb = bomb_message(T);
  EXPECT_NE(message_of([&] { (void)switchyard::decode_route_file(bomb); })
                .find("more than max_decoded_bytes=67108864"),
            std::string::npos);
  const int64_t need = T * 8 * 4 + T;  // table + payload (bitmap + 8 literals, rounded up)
  EXPECT_NE(message_of([&] {
              (void)switchyard::decode_route_file(bomb, nullptr, RouteDecodeOptions{need});
            }).find("more than max_decoded_bytes=" + std::to_string(need) + "; if the data"),
            std::string::npos);
  switchyard::RouteFileInfo info;
  const auto tables =
      switchyard::decode_route_file(bomb, &info, RouteDecodeOptions{need + 8});
  ASSERT_EQ(tables.size(), 1u);
  ASSERT_EQ(tables[0].num_tokens(), T);
  const int32_t* p = tables[0].topk_idx.data<int32_t>();
  int64_t wrong = 0;
  for (int64_t i = 0; i < T * 8; ++i) wrong += p[i] != static_cast<int32_t>(i % 8);
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(info.num_experts, 8);
}

TEST(RouteDecodeLimits, RealRoutesDecodeUnderTheDefaultLimit) {
  // Random routes (no repeats across tokens): ~20x or less between table and message.
  std::mt19937_64 rng(35);
  std::vector<switchyard::RouteTable> in;
  for (int64_t T : {1, 7, 1031, 4096}) {
    switchyard::RouteTable t;
    t.num_experts = 128;
    t.topk_idx = switchyard::Tensor::empty({T, 4, 8}, switchyard::DType::int32);
    int32_t* p = t.topk_idx.data<int32_t>();
    for (int64_t r = 0; r < T * 4; ++r) {
      for (int64_t k = 0; k < 8; ++k) p[r * 8 + k] = static_cast<int32_t>((r * 7 + k * 16 + rng() % 16) % 128);
    }
    in.push_back(t);
  }
  switchyard::RouteFileInfo info;
  info.num_experts = 128;
  info.top_k = 8;
  info.num_moe_layers = 4;
  const switchyard::Tensor msg = switchyard::encode_route_file(in, info);
  const auto out = switchyard::decode_route_file(
      std::string_view(static_cast<const char*>(msg.raw()), size_t(msg.nbytes())));
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) EXPECT_TRUE(switchyard::route_tables_equal(out[i], in[i]));
}

TEST(RouteDecodeLimits, ANegativeLimitIsAnArgumentError) {
  const std::string bomb = bomb_message(8);
  try {
    (void)switchyard::decode_route_file(bomb, nullptr, RouteDecodeOptions{-1});
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "[route_file] max_decoded_bytes must be > 0 (or 0 for the default limit), got -1");
  }
  EXPECT_THROW((void)RouteFileReader::from_bytes(bomb, RouteDecodeOptions{-5}),
               std::invalid_argument);
  // A small message of the same kind decodes under the default limit.
  EXPECT_EQ(switchyard::decode_route_file(bomb).at(0).num_tokens(), 8);
}

}  // namespace
