#!/usr/bin/env bash
# Builds the documentation site strictly (mkdocs --strict: a broken link, a missing page or an
# unresolved API reference fails) into build/site, with the docs tools' own environment
# (requirements/docs.lock.txt, scripts/env.sh docs). The API reference is read from the Python
# sources by static analysis: no build tree is needed.
#   scripts/docs.sh          build
#   scripts/docs.sh serve    preview on http://127.0.0.1:8000
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=$(bash scripts/env.sh docs)
export NO_MKDOCS_2_WARNING=1
if [ "${1:-}" = serve ]; then exec "$venv/bin/mkdocs" serve; fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$venv/bin/mkdocs" build --strict >"$log" 2>&1; then
  grep -v "^INFO" "$log" | grep -v "^[[:space:]]*$" >&2
  echo "[docs] the site does not build (mkdocs --strict)" >&2
  exit 1
fi
echo "[docs] site built in build/site"
