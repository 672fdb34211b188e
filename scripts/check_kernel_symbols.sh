#!/usr/bin/env bash
# The AVX2 compilation of the kernels must not define code the rest of the library could link to:
# every function it defines lives in switchyard::cpu::avx2 (or has internal linkage). A weak
# symbol outside it (an inline or template function from a header, e.g. a std:: algorithm helper)
# could be picked by the linker for the portable code too, and crash a CPU without AVX2.
# Usage: check_kernel_symbols.sh OBJECT... (ctest passes the AVX2 kernel objects).
set -euo pipefail
bad=$(nm -C --defined-only "$@" | awk '$2 ~ /^[WVTu]$/' | grep -v 'switchyard::cpu::avx2::' |
      grep -v 'DW.ref.__gxx_personality_v0' || true)
if [ -n "$bad" ]; then
  echo "AVX2 kernel objects define symbols outside switchyard::cpu::avx2:"
  echo "$bad"
  exit 1
fi
echo "AVX2 kernel objects: every defined symbol is in switchyard::cpu::avx2"
