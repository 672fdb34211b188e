#!/usr/bin/env bash
# Installs what switchyard needs from Debian 12's packages, only when something is missing.
# Python packages come from PyPI into the project's venv (scripts/env.sh), not from Debian.
set -euo pipefail
PKGS=(g++ cmake make pkg-config
      libgtest-dev libgmock-dev libbenchmark-dev
      libopenblas-dev libopenmpi-dev openmpi-bin
      libzstd-dev libxxhash-dev nlohmann-json3-dev libsimdjson-dev libcli11-dev
      clang libomp-dev libclang-rt-14-dev ccache)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[deps] installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "[deps] all Debian packages present"
fi
