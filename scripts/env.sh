#!/usr/bin/env bash
# Makes (once) and checks the project's Python environment, then prints its folder on stdout.
# A venv from Python 3.12 with exactly requirements/lock.txt (mpi4py built from source against
# Debian's Open MPI, so scripts/deps.sh runs first). Keyed by the lock's hash and reused by every
# clone; a half-made one (no .complete marker: an interrupted install) is removed and made again.
# Concurrent callers wait on a lock file instead of installing twice.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/python.sh"
venv=$(venv_dir)
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  py=$(find_python312)
  rm -rf "$venv"
  echo "[env] creating $venv from requirements/lock.txt (first run on this machine: a few minutes)" >&2
  start=$(date +%s)
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q --no-binary mpi4py -r "$root/requirements/lock.txt" >&2
  cp "$root/requirements/lock.txt" "$venv/.complete"
  echo "[env] ready in $(( $(date +%s) - start )) s" >&2
fi
echo "$venv"
