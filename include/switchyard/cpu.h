// CPU kernel selection. The library is built for the baseline x86-64 ISA; its hot kernels (gate,
// routing, permute/combine) are compiled twice, once portable (scalar) and once for AVX2+FMA, and
// the variant is chosen at run time. Both variants compute every output with the same operations in
// the same order (explicit FMAs, fixed lanes), so they give bitwise the same results.
#pragma once

#include <cstdint>

namespace switchyard {

/// Kernel variants: `scalar` runs on any x86-64 CPU; `avx2` needs AVX2 and FMA.
enum class CpuIsa : uint8_t { scalar, avx2 };

/// Name of a variant: "scalar" or "avx2".
const char* cpu_isa_name(CpuIsa isa);

/// Whether this CPU can run `isa` (CPUID; `scalar` always).
bool cpu_supports(CpuIsa isa);

/// The variant the kernels use. Chosen at first use: the environment variable SWITCHYARD_CPU_ISA
/// (`auto`, `scalar` or `avx2`) when set, else `avx2` when the CPU supports it, else `scalar`.
/// Throws std::invalid_argument naming the variable when it holds anything else, or asks for a
/// variant this CPU cannot run.
CpuIsa cpu_isa();

/// Overrides the choice for the whole process (e.g. to compare both paths in one run). Throws
/// std::invalid_argument when this CPU cannot run `isa`. Thread-safe; calls already running finish
/// on the variant they started with.
void set_cpu_isa(CpuIsa isa);

}  // namespace switchyard
