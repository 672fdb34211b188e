#!/usr/bin/env bash
# Makes (once) and checks one of the project's Python environments, then prints its folder on stdout.
#   scripts/env.sh          the main venv: exactly requirements/lock.txt (mpi4py built from source
#                           against Debian's Open MPI, so scripts/deps.sh runs first)
#   scripts/env.sh NAME     a side environment (e.g. `verl`, `docs`): exactly requirements/NAME.lock.txt,
#                           a complete `pip freeze` installed with --no-deps, so a peer whose declared
#                           pins conflict with ours (verl) still gets the versions the lock records
# Each venv is keyed by its lock's hash and reused by every clone; a half-made one (no .complete
# marker: an interrupted install) is removed and made again. Concurrent callers wait on a lock file.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/python.sh"
name=${1:-}
lock=$(lock_file "$name")
venv=$(venv_dir "$name")
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  py=$(find_python312)
  rm -rf "$venv"
  echo "[env] creating $venv from ${lock#$root/} (first run on this machine: a few minutes)" >&2
  start=$(date +%s)
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  if [ -z "$name" ]; then
    "$venv/bin/python" -m pip install -q --no-binary mpi4py -r "$lock" >&2
  else
    "$venv/bin/python" -m pip install -q --no-deps -r "$lock" >&2
  fi
  cp "$lock" "$venv/.complete"
  echo "[env] ready in $(( $(date +%s) - start )) s" >&2
fi
echo "$venv"
