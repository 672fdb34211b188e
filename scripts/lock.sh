#!/usr/bin/env bash
# Re-pins requirements/lock.txt: a throwaway venv, `pip install -r requirements/requirements.in`,
# `pip freeze`. Run it when requirements.in changes; commit the new lock (scripts/env.sh then builds
# a new environment, keyed by the lock's hash).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/python.sh"
py=$(find_python312)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q --upgrade pip
"$tmp/venv/bin/pip" install --no-binary mpi4py -r "$root/requirements/requirements.in"
{ echo "# Pinned by scripts/lock.sh from requirements/requirements.in (Python 3.12, $(date +%F))."
  echo "# scripts/env.sh installs exactly this into a venv keyed by this file's hash."
  "$tmp/venv/bin/pip" freeze --exclude pip; } >"$root/requirements/lock.txt"
echo "[lock] wrote requirements/lock.txt"
