#include "cpu/isa.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace switchyard {

namespace {

constexpr uint8_t kUnset = 0xff;
std::atomic<uint8_t> g_isa{kUnset};  // the process-wide kernel choice (a CPU property, not state)

CpuIsa choose_from_environment() {
  const char* env = std::getenv("SWITCHYARD_CPU_ISA");
  const std::string v = env ? env : "";
  if (v.empty() || v == "auto") {
    return cpu_supports(CpuIsa::avx2) ? CpuIsa::avx2 : CpuIsa::scalar;
  }
  CpuIsa isa;
  if (v == "scalar") {
    isa = CpuIsa::scalar;
  } else if (v == "avx2") {
    isa = CpuIsa::avx2;
  } else {
    throw std::invalid_argument(
        "[cpu_isa] SWITCHYARD_CPU_ISA must be auto, scalar or avx2, got '" + v + "'");
  }
  if (!cpu_supports(isa)) {
    throw std::invalid_argument("[cpu_isa] SWITCHYARD_CPU_ISA=" + v +
                                " but this CPU lacks AVX2/FMA; use scalar or auto");
  }
  return isa;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) { return isa == CpuIsa::avx2 ? "avx2" : "scalar"; }

bool cpu_supports(CpuIsa isa) {
  if (isa == CpuIsa::scalar) return true;
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

CpuIsa cpu_isa() {
  uint8_t v = g_isa.load(std::memory_order_acquire);
  if (v == kUnset) {
    const CpuIsa chosen = choose_from_environment();
    uint8_t expected = kUnset;
    g_isa.compare_exchange_strong(expected, static_cast<uint8_t>(chosen));
    v = g_isa.load(std::memory_order_acquire);
  }
  return static_cast<CpuIsa>(v);
}

void set_cpu_isa(CpuIsa isa) {
  if (isa != CpuIsa::scalar && isa != CpuIsa::avx2) {
    throw std::invalid_argument("[set_cpu_isa] isa must be scalar or avx2, got " +
                                std::to_string(static_cast<int>(isa)));
  }
  if (!cpu_supports(isa)) {
    throw std::invalid_argument(std::string("[set_cpu_isa] this CPU cannot run isa=") +
                                cpu_isa_name(isa) + " (needs AVX2 and FMA)");
  }
  g_isa.store(static_cast<uint8_t>(isa), std::memory_order_release);
}

namespace cpu {

CpuIsa active_isa() { return cpu_isa(); }

}  // namespace cpu

}  // namespace switchyard
