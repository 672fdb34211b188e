#include "cpu/isa.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace switchyard {

namespace {

constexpr uint8_t kUnset = 0xff;
std::atomic<uint8_t> g_isa{kUnset};  // the process-wide kernel choice (a CPU property, not state)

// What a variant needs, for the messages.
const char* needs(CpuIsa isa) {
  return isa == CpuIsa::avx512 ? "AVX-512F/VL/BW/DQ, AVX2 and FMA" : "AVX2 and FMA";
}

CpuIsa widest_supported() {
  if (cpu_supports(CpuIsa::avx512)) return CpuIsa::avx512;
  if (cpu_supports(CpuIsa::avx2)) return CpuIsa::avx2;
  return CpuIsa::scalar;
}

CpuIsa choose_from_environment() {
  const char* env = std::getenv("SWITCHYARD_CPU_ISA");
  const std::string v = env ? env : "";
  if (v.empty() || v == "auto") return widest_supported();
  CpuIsa isa;
  if (v == "scalar") {
    isa = CpuIsa::scalar;
  } else if (v == "avx2") {
    isa = CpuIsa::avx2;
  } else if (v == "avx512") {
    isa = CpuIsa::avx512;
  } else {
    throw std::invalid_argument(
        "[cpu_isa] SWITCHYARD_CPU_ISA must be auto, scalar, avx2 or avx512, got '" + v + "'");
  }
  if (!cpu_supports(isa)) {
    throw std::invalid_argument("[cpu_isa] SWITCHYARD_CPU_ISA=" + v + " but this CPU lacks " +
                                needs(isa) + "; use " + cpu_isa_name(widest_supported()) +
                                " or auto");
  }
  return isa;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx512:
      return "avx512";
    case CpuIsa::avx2:
      return "avx2";
    default:
      return "scalar";
  }
}

bool cpu_supports(CpuIsa isa) {
  if (isa == CpuIsa::scalar) return true;
#if defined(__x86_64__) || defined(__i386__)
  // libgcc's CPUID probe also checks XGETBV: a feature whose register state the OS does not save
  // reads as absent.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == CpuIsa::avx2) return avx2;
  if (isa == CpuIsa::avx512) {
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  }
#endif
  return false;
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
  if (isa != CpuIsa::scalar && isa != CpuIsa::avx2 && isa != CpuIsa::avx512) {
    throw std::invalid_argument("[set_cpu_isa] isa must be scalar, avx2 or avx512, got " +
                                std::to_string(static_cast<int>(isa)));
  }
  if (!cpu_supports(isa)) {
    throw std::invalid_argument(std::string("[set_cpu_isa] this CPU cannot run isa=") +
                                cpu_isa_name(isa) + " (needs " + needs(isa) + ")");
  }
  g_isa.store(static_cast<uint8_t>(isa), std::memory_order_release);
}

namespace cpu {

CpuIsa active_isa() { return cpu_isa(); }

}  // namespace cpu

}  // namespace switchyard
