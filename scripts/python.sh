# Sourced by the scripts: where Python 3.12 and the project's virtual environment are.
#   find_python312   prints a Python 3.12 interpreter (PATH, then pyenv), or fails saying so
#   venv_dir         prints the environment's folder for the current requirements/lock.txt
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

venv_dir() {
  local root hash
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  hash=$(sha256sum "$root/requirements/lock.txt" | cut -c1-16)
  echo "${SWITCHYARD_VENV_ROOT:-$HOME/.cache/switchyard}/venv-py312-$hash"
}
