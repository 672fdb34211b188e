#!/usr/bin/env bash
# A vector compilation of the kernels (avx2, avx512) must not define code the rest of the library
# could link to: every function it defines lives in switchyard::cpu::<isa> (or has internal
# linkage). A weak symbol outside it (an inline or template function from a header, e.g. a std::
# algorithm helper) could be picked by the linker for the portable code too, and crash a CPU
# without that ISA.
# Usage: check_kernel_symbols.sh ISA OBJECT... (ctest passes each variant's kernel objects).
set -euo pipefail
isa=$1
shift
bad=$(nm -C --defined-only "$@" | awk '$2 ~ /^[WVTu]$/' | grep -v "switchyard::cpu::${isa}::" |
      grep -v 'DW.ref.__gxx_personality_v0' || true)
if [ -n "$bad" ]; then
  echo "${isa} kernel objects define symbols outside switchyard::cpu::${isa}:"
  echo "$bad"
  exit 1
fi
echo "${isa} kernel objects: every defined symbol is in switchyard::cpu::${isa}"
