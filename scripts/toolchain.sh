# Sourced by the build scripts: compile through ccache when it is installed (scripts/deps.sh
# installs it). CMake reads the launcher from these variables; CCACHE_BASEDIR makes the cache hit
# across checkouts (a fresh clone, CI's clone) and across the release, wheel and consumer builds
# of the same sources with the same flags. SWITCHYARD_CCACHE=0 turns it off.
if [ "${SWITCHYARD_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
  export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-4G}
fi
