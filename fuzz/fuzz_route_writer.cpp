// Fuzz target: the route file writer's commit protocol. The input is a script: byte 0 picks
// num_experts / top_k / layers, then each op byte is append (tokens and ids from the next bytes,
// ids may be out of range), close, abort, discard, or an exception thrown inside the writer's
// scope. After every script the invariants of route_file.h must hold, else __builtin_trap():
//   - until close() the file at the path is byte-for-byte the previous one (or absent);
//   - after close() it opens complete and holds exactly the sequences whose append succeeded;
//   - after abort() or an exception, <path>.partial opens in recovery with exactly those;
//   - after discard() there is no partial file.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "switchyard/error.h"
#include "switchyard/route_file.h"

namespace {

namespace fs = std::filesystem;
using namespace switchyard;

fs::path g_dir;
void cleanup() {
  std::error_code ec;
  fs::remove_all(g_dir, ec);
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void require(bool ok) {
  if (!ok) __builtin_trap();
}

bool same(const std::vector<RouteTable>& want, const RouteFileReader& r) {
  if (r.num_sequences() != static_cast<int64_t>(want.size())) return false;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!route_tables_equal(r.read(static_cast<int64_t>(i)), want[i])) return false;
  }
  return true;
}

struct Unwind {};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_dir = fs::temp_directory_path() / ("sy_fuzz_writer_" + std::to_string(::getpid()));
  fs::create_directories(g_dir);
  std::atexit(cleanup);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const fs::path path = g_dir / "w.syr";
  const std::string partial = RouteFileWriter::partial_path(path.string());
  const int64_t E = 1 + data[0] % 40 * 8, K = 1 + (data[0] >> 3) % 3, L = 1 + (data[0] >> 5) % 3;
  RouteFileInfo info{E, K, L, {}, 0, 0, 0};
  const bool had_old = fs::exists(path);
  const std::string old = had_old ? slurp(path) : std::string();
  std::vector<RouteTable> appended;
  enum class End { none, closed, aborted, discarded } end = End::none;
  size_t i = 1;
  try {
    RouteFileWriter w(path.string(), info);
    while (i < size && end == End::none) {
      const uint8_t op = data[i++];
      switch (op % 8) {
        case 0:
          w.close();
          end = End::closed;
          break;
        case 1:
          w.abort();
          end = End::aborted;
          break;
        case 2:
          w.discard();
          end = End::discarded;
          break;
        case 3:
          throw Unwind{};  // the destructor runs while unwinding: must abort, never commit
        default: {
          const int64_t T = i < size ? data[i++] % 9 : 0;
          RouteTable t = RouteTable::none(T, L, K, E);
          int32_t* p = t.topk_idx.data<int32_t>();
          for (int64_t j = 0; j < t.topk_idx.numel(); ++j) {
            const uint8_t b = i < size ? data[i++] : 0;
            p[j] = b == 255 ? static_cast<int32_t>(E) : static_cast<int32_t>(b % (E + 1)) - 1;
          }
          try {
            w.append(t);
            appended.push_back(t);
          } catch (const std::invalid_argument&) {
            // an id out of range: rejected, nothing written
          }
          // Not committed yet: the path is exactly as before.
          require(fs::exists(path) == had_old && (!had_old || slurp(path) == old));
          break;
        }
      }
    }
    if (end == End::none) {
      w.close();  // the script ran out: an explicit commit
      end = End::closed;
    }
  } catch (const Unwind&) {
    end = End::aborted;
  }
  if (end == End::closed) {
    RouteFileReader r = RouteFileReader::open(path.string());
    require(r.complete() && same(appended, r));
    require(!fs::exists(partial));
  } else {
    require(fs::exists(path) == had_old && (!had_old || slurp(path) == old));
    if (end == End::aborted) {
      RouteFileReader r = RouteFileReader::open(partial);
      require(!r.complete() && same(appended, r));
    } else {
      require(!fs::exists(partial));
    }
  }
  return 0;
}
