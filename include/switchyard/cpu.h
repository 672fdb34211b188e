// CPU kernel selection. The library is built for the baseline x86-64 ISA; its hot kernels (gate,
// routing, permute/combine) are compiled three times, portable (scalar), for AVX2+FMA and for
// AVX-512 (F, VL, BW, DQ), and the variant is chosen at run time. Every variant computes every
// output with the same operations in the same order (explicit FMAs, fixed lanes and reduction
// orders), so all give bitwise the same results.
#pragma once

#include <cstdint>

namespace switchyard {

/// Kernel variants: `scalar` runs on any x86-64 CPU; `avx2` needs AVX2 and FMA; `avx512` needs
/// those plus AVX-512F/VL/BW/DQ (with the OS saving the zmm state).
enum class CpuIsa : uint8_t { scalar, avx2, avx512 };

/// Name of a variant: "scalar", "avx2" or "avx512".
const char* cpu_isa_name(CpuIsa isa);

/// Whether this CPU can run `isa` (CPUID and the OS's XSAVE state; `scalar` always).
bool cpu_supports(CpuIsa isa);

/// The variant the kernels use. Chosen at first use: the environment variable SWITCHYARD_CPU_ISA
/// (`auto`, `scalar`, `avx2` or `avx512`) when set, else the widest variant the CPU supports
/// (`avx512`, then `avx2`, then `scalar`). Throws std::invalid_argument naming the variable when
/// it holds anything else, or asks for a variant this CPU cannot run.
CpuIsa cpu_isa();

/// Overrides the choice for the whole process (e.g. to compare the paths in one run). Throws
/// std::invalid_argument when this CPU cannot run `isa`. Thread-safe; calls already running finish
/// on the variant they started with.
void set_cpu_isa(CpuIsa isa);

}  // namespace switchyard
