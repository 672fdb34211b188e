// libFuzzer target: the route file reader over arbitrary bytes. Opening, reading every sequence and
// verifying must either succeed or throw switchyard::DataError (std::out_of_range only for an index
// past num_sequences, which this target never asks for); anything else (a crash, a sanitizer report,
// another exception) is a bug. A table that decodes must pass check_route_table.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "switchyard/error.h"
#include "switchyard/route_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace switchyard;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    RouteFileReader r = RouteFileReader::from_bytes(bytes);
    for (int64_t i = 0; i < r.num_sequences(); ++i) {
      try {
        RouteTable t = r.read(i);
        check_route_table(t, "fuzz_route_file", "decoded table");
        if (t.num_experts != r.info().num_experts || t.top_k() != r.info().top_k ||
            t.num_moe_layers() != r.info().num_moe_layers || t.num_tokens() != r.entry(i).num_tokens) {
          __builtin_trap();  // a table that disagrees with the file's header or index
        }
      } catch (const DataError&) {
      }
    }
  } catch (const DataError&) {
  }
  (void)verify_route_bytes(bytes);  // collects problems, must not throw DataError
  return 0;
}
