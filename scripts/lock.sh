#!/usr/bin/env bash
# Re-pins an environment's lock: a throwaway venv, `pip install -r <in>`, `pip freeze`.
#   scripts/lock.sh         requirements/requirements.in -> requirements/lock.txt (the main venv)
#   scripts/lock.sh NAME    requirements/NAME.in -> requirements/NAME.lock.txt (a side environment);
#                           then requirements/NAME.nodeps.in, if present, with --no-deps: packages
#                           whose declared pins are wrong for us (each line says why)
# Run it when an .in file changes and commit the new lock (scripts/env.sh then builds a new
# environment, keyed by the lock's hash).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/python.sh"
name=${1:-}
if [ -z "$name" ]; then in="$root/requirements/requirements.in"; out="$root/requirements/lock.txt"
else in="$root/requirements/$name.in"; out="$root/requirements/$name.lock.txt"; fi
[ -f "$in" ] || { echo "[lock] ${in#$root/} does not exist" >&2; exit 1; }
py=$(find_python312)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q --upgrade pip
"$tmp/venv/bin/pip" install --no-binary mpi4py -r "$in"
if [ -n "$name" ] && [ -f "$root/requirements/$name.nodeps.in" ]; then
  "$tmp/venv/bin/pip" install --no-deps -r "$root/requirements/$name.nodeps.in"
fi
{ echo "# Pinned by scripts/lock.sh${name:+ $name} from ${in#$root/} (Python 3.12, $(date +%F))."
  echo "# scripts/env.sh${name:+ $name} installs exactly this into a venv keyed by this file's hash."
  "$tmp/venv/bin/pip" freeze --exclude pip; } >"$out"
echo "[lock] wrote ${out#$root/}"
