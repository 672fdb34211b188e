# Sourced by the scripts: where Python 3.12 and the project's virtual environment are.
#   find_python312   prints a Python 3.12 interpreter (PATH, then pyenv), or fails saying so
#   venv_dir [NAME]  prints the environment's folder for requirements/lock.txt, or for a named
#                    side environment's requirements/NAME.lock.txt (e.g. `verl`, `docs`)
#   lock_file [NAME] prints the lock file of that environment
# The environment lives outside the checkout, keyed by the lock file's hash, so fresh clones and CI
# reuse it: ${SWITCHYARD_VENV_ROOT:-~/.cache/switchyard}/venv-py312-<hash>.
find_python312() {
  local c
  for c in "${SWITCHYARD_PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
           /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  echo "[env] Python 3.12 not found (looked on PATH and in ~/.pyenv/versions/3.12*); set SWITCHYARD_PYTHON" >&2
  return 1
}

lock_file() {
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [ -z "${1:-}" ]; then echo "$root/requirements/lock.txt"; return 0; fi
  if [ ! -f "$root/requirements/$1.lock.txt" ]; then
    echo "[env] no environment named '$1': requirements/$1.lock.txt does not exist" >&2
    return 1
  fi
  echo "$root/requirements/$1.lock.txt"
}

venv_dir() {
  local lock hash
  lock=$(lock_file "${1:-}") || return 1
  hash=$(sha256sum "$lock" | cut -c1-16)
  echo "${SWITCHYARD_VENV_ROOT:-$HOME/.cache/switchyard}/venv-py312-${1:+$1-}$hash"
}
