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

# A side environment shares most pins with the main venv (torch and its CUDA wheels are ~3 GB):
# every package pinned at the same version in both locks is hard-linked from the main venv's
# site-packages (its RECORD lists the files), so pip then fetches only what differs. Skipped, and pip
# installs everything, when the main venv is absent or on another file system.
seed_from_main() {
  local venv=$1 lock=$2 main
  main=$(venv_dir)
  [ -f "$main/.complete" ] || return 0
  "$venv/bin/python" - "$main" "$venv" "$lock" "$root/requirements/lock.txt" <<'PY' >&2 || true
import importlib.metadata as md, os, pathlib, re, sys, sysconfig
main, venv, lock, main_lock = map(pathlib.Path, sys.argv[1:])
def pins(p):
    return {re.sub(r"[-_.]+", "-", l.split("==")[0]).lower(): l.split("==")[1].strip()
            for l in p.read_text().splitlines() if "==" in l and not l.startswith("#")}
ours, theirs = pins(lock), pins(main_lock)
sp = lambda root: pathlib.Path(sysconfig.get_paths(vars={"base": str(root), "platbase": str(root)})["purelib"])
src, dst = sp(main), sp(venv)
linked = 0
for dist in md.distributions(path=[str(src)]):
    name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
    if ours.get(name) != dist.version or theirs.get(name) != dist.version or not dist.files:
        continue
    try:
        for f in dist.files:
            rel = pathlib.Path(f)
            if rel.parts and rel.parts[0] == "..":   # console scripts in bin/: pip is not needed for them
                continue
            a, b = src / rel, dst / rel
            if a.is_file() and not b.exists():
                b.parent.mkdir(parents=True, exist_ok=True)
                os.link(a, b)
        linked += 1
    except OSError as e:                              # another file system: pip installs the rest
        print(f"[env] not seeding from the main venv ({e})")
        break
print(f"[env] {linked} packages hard-linked from the main venv (same pins); pip fetches the rest")
PY
}
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
    seed_from_main "$venv" "$lock"
    "$venv/bin/python" -m pip install -q --no-deps -r "$lock" >&2
  fi
  cp "$lock" "$venv/.complete"
  echo "[env] ready in $(( $(date +%s) - start )) s" >&2
fi
echo "$venv"
