// The one kernel-selection point of the CPU backend. Each kernel file in src/cpu is compiled twice
// (CMake: switchyard_kernels_scalar and switchyard_kernels_avx2) with SY_ISA_NS set to `scalar` or
// `avx2`, so its definitions land in cpu::scalar or cpu::avx2. A kernel header declares its entry
// points once in a macro, for both namespaces, and (outside the kernel files) the dispatching
// inline wrappers in cpu:: that front-ends call, which pick the variant with SY_CPU_SELECT.
#pragma once

#include "switchyard/cpu.h"

namespace switchyard::cpu {

/// The active variant (switchyard::cpu_isa(), cached after the first call).
CpuIsa active_isa();

}  // namespace switchyard::cpu

/// `fn` (a name or a template-id) in the active variant's namespace, as a function pointer.
#define SY_CPU_SELECT(fn) \
  (::switchyard::cpu::active_isa() == ::switchyard::CpuIsa::avx2 ? &avx2::fn : &scalar::fn)

/// Declares the entry points listed by DECLS (a macro) in cpu::scalar and cpu::avx2.
#define SY_CPU_DECLARE_VARIANTS(DECLS) \
  namespace scalar {                   \
  DECLS                                \
  }                                    \
  namespace avx2 {                     \
  DECLS                                \
  }
