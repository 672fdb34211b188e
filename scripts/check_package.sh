#!/usr/bin/env bash
# The Python package works as users install it: a wheel built from this checkout by
# scikit-build-core (the engine, the extension and the `switchyard` CLI), installed into a fresh
# venv, then imported and run from outside the checkout: `import switchyard.torch`, the README's
# Python example (examples/quickstart.py) and `switchyard --help` from the venv's PATH.
# The fresh venv sees the project venv's packages through a .pth file (torch is ~3 GB: it is not
# downloaded again), never the checkout. Builds in build-pip/ (kept, so a rerun is incremental).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${SWITCHYARD_VENV:-$(bash "$root/scripts/env.sh")}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root"
source scripts/toolchain.sh
echo "[package] building the wheel (scikit-build-core, build-pip/)"
CMAKE_BUILD_PARALLEL_LEVEL=${SY_JOBS:-2} "$venv/bin/python" -m pip wheel -q --no-deps \
  --no-build-isolation --config-settings=cmake.define.SWITCHYARD_WERROR=ON -w "$work/wheel" . \
  >"$work/wheel.log" 2>&1 || { tail -40 "$work/wheel.log"; exit 1; }
"$venv/bin/python" -m venv "$work/venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
fresh_site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" >"$fresh_site/_switchyard_project_venv.pth"
"$work/venv/bin/python" -m pip install -q --no-deps --no-index "$work"/wheel/switchyard-*.whl
cd "$work"
"$work/venv/bin/python" - <<'PY'
import os, sys
import switchyard, switchyard.torch
assert os.path.dirname(switchyard.__file__).startswith(sys.prefix), switchyard.__file__
print("[package] import switchyard.torch from", os.path.dirname(switchyard.__file__))
PY
"$work/venv/bin/python" "$root/examples/quickstart.py"
PATH="$work/venv/bin:$PATH" switchyard --help >"$work/help.txt"
grep -q "routes" "$work/help.txt"
echo "[package] wheel installs; import, README example and the CLI on PATH work"
