// What every Google Benchmark binary prints about the machine it ran on (the C++ side of
// bench/bench_machine.py): the CPU model (/proc/cpuinfo's "model name", what lscpu prints) and
// the kernel ISA in use (switchyard::cpu_isa(), SWITCHYARD_CPU_ISA), as benchmark context lines.
//
//   int main(int argc, char** argv) { ...; benchmark::Initialize(&argc, argv);
//     switchyard::bench::add_machine_context(); ... }
// or SY_BENCHMARK_MAIN() in place of BENCHMARK_MAIN().
#pragma once

#include <benchmark/benchmark.h>

#include <fstream>
#include <string>

#include "switchyard/cpu.h"

namespace switchyard::bench {

/// "model name" from /proc/cpuinfo, or "unknown".
inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        const size_t start = line.find_first_not_of(' ', colon + 1);
        return start == std::string::npos ? std::string("unknown") : line.substr(start);
      }
    }
  }
  return "unknown";
}

/// Adds the context lines `cpu_model` and `kernel_isa` (after benchmark::Initialize).
inline void add_machine_context() {
  benchmark::AddCustomContext("cpu_model", cpu_model());
  benchmark::AddCustomContext("kernel_isa", cpu_isa_name(cpu_isa()));
}

}  // namespace switchyard::bench

/// BENCHMARK_MAIN() plus the machine context.
#define SY_BENCHMARK_MAIN()                                             \
  int main(int argc, char** argv) {                                     \
    ::benchmark::Initialize(&argc, argv);                               \
    if (::benchmark::ReportUnrecognizedArguments(argc, argv)) return 1; \
    ::switchyard::bench::add_machine_context();                         \
    ::benchmark::RunSpecifiedBenchmarks();                              \
    ::benchmark::Shutdown();                                            \
    return 0;                                                           \
  }                                                                     \
  int main(int, char**)
