// Fuzz target: the route file reader. Any input must either open and decode, or raise
// switchyard::DataError; any other exception, crash, leak or UB is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "switchyard/error.h"
#include "switchyard/route_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    switchyard::RouteFileReader r = switchyard::RouteFileReader::from_bytes(bytes);
    for (int64_t i = 0; i < r.num_sequences(); ++i) {
      try {
        switchyard::RouteTable t = r.read(i);
        // A decoded table is always in range (check_route_table throws otherwise).
        switchyard::check_route_table(t, "fuzz", "table");
      } catch (const switchyard::DataError&) {
      }
    }
  } catch (const switchyard::DataError&) {
  }
  (void)switchyard::verify_route_bytes(bytes);
  return 0;
}
