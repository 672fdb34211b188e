// The one kernel-selection point of the CPU backend. Each kernel file in src/cpu is compiled three
// times (CMake: switchyard_kernels_scalar, _avx2 and _avx512) with SY_ISA_NS set to `scalar`,
// `avx2` or `avx512`, so its definitions land in cpu::scalar, cpu::avx2 or cpu::avx512. A kernel
// header declares its entry points once in a macro, for every namespace, and (outside the kernel
// files) the dispatching inline wrappers in cpu:: that front-ends call, which pick the variant
// with SY_CPU_SELECT.
#pragma once

#include "switchyard/cpu.h"

namespace switchyard::cpu {

/// The active variant (switchyard::cpu_isa(), cached after the first call).
CpuIsa active_isa();

}  // namespace switchyard::cpu

namespace switchyard::cpu {
/// One of the three variants' pointers by `isa` (SY_CPU_SELECT; used outside the kernel files).
template <class F>
inline F pick_variant(CpuIsa isa, F scalar_fn, F avx2_fn, F avx512_fn) {
  return isa == CpuIsa::avx512 ? avx512_fn : isa == CpuIsa::avx2 ? avx2_fn : scalar_fn;
}
}  // namespace switchyard::cpu

/// `fn` (a name or a template-id) in the active variant's namespace, as a function pointer.
#define SY_CPU_SELECT(fn)                                                                   \
  (::switchyard::cpu::pick_variant(::switchyard::cpu::active_isa(), &scalar::fn, &avx2::fn, \
                                   &avx512::fn))

/// Declares the entry points listed by DECLS (a macro) in cpu::scalar, cpu::avx2 and cpu::avx512.
#define SY_CPU_DECLARE_VARIANTS(DECLS) \
  namespace scalar {                   \
  DECLS                                \
  }                                    \
  namespace avx2 {                     \
  DECLS                                \
  }                                    \
  namespace avx512 {                   \
  DECLS                                \
  }
