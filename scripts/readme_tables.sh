#!/usr/bin/env bash
# Regenerates the tables that the docs take from the tests, and splices them into every file that
# marks their place (<!-- table:NAME --> ... <!-- /table:NAME -->): README.md and the pages under
# docs/ and notes/ (the tables live in docs/reliability.md; the README keeps none of them).
#   bad-inputs-cpp     tests/unit/test_bad_inputs.cpp          (SY_BAD_INPUT_TABLE)
#   bad-inputs-cli     tests/unit/test_cli_bad_inputs.cpp      (SY_BAD_INPUT_TABLE_CLI)
#   bad-inputs-python  python/tests/test_bad_inputs.py         (SY_BAD_INPUT_TABLE_PY)
#   hostile            every python test marked `hostile`      (SY_HOSTILE_TABLE)
# Each table is written by the tests that assert its rows, from the messages they really got.
# Usage: scripts/readme_tables.sh [--check]   (--check: fail, showing the diff, where a file differs
# from what the tests give now; the test command runs it so the docs cannot drift from the code).
# Needs a built tree (scripts/build.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${SWITCHYARD_VENV:-$(bash scripts/env.sh)}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
SY_BAD_INPUT_TABLE=$out/bad-inputs-cpp.md build/tests/test_bad_inputs >/dev/null
SY_BAD_INPUT_TABLE_CLI=$out/bad-inputs-cli.md build/tests/test_cli_bad_inputs >/dev/null
py() {
  env PYTHONPATH="$root/build/python" OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 \
      OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" >"$out/pytest.log" 2>&1 ||
    { tail -30 "$out/pytest.log"; echo "[readme_tables] the tests that write the tables failed"; exit 1; }
}
SY_BAD_INPUT_TABLE_PY=$out/bad-inputs-python.md py python/tests/test_bad_inputs.py
SY_HOSTILE_TABLE=$out/hostile.md py -m hostile python/tests python/tests_trl
"$venv/bin/python" - "$out" "$@" <<'PY'
import difflib, pathlib, re, sys
out, check = pathlib.Path(sys.argv[1]), "--check" in sys.argv[2:]
tables = {p.stem: p.read_text().rstrip("\n") for p in out.glob("*.md")}
bad = 0
docs = [pathlib.Path("README.md"), *sorted(pathlib.Path("docs").rglob("*.md")),
        *sorted(pathlib.Path("notes").rglob("*.md"))]
for doc in docs:
    text = doc.read_text()
    if "<!-- table:" not in text:
        continue
    def put(m):
        name = m.group(1)
        if name not in tables:
            sys.exit(f"[readme_tables] {doc}: no test writes the table '{name}'")
        return f"<!-- table:{name} -->\n{tables[name]}\n<!-- /table:{name} -->"
    new = re.sub(r"<!-- table:([\w-]+) -->\n.*?<!-- /table:\1 -->", put, text, flags=re.S)
    if new == text:
        continue
    if check:
        bad += 1
        sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                   str(doc), str(doc) + " (from the tests)", n=0))
    else:
        doc.write_text(new)
        print(f"[readme_tables] updated {doc}")
if bad:
    sys.exit("[readme_tables] the tables above differ from what the tests give: run "
             "bash scripts/readme_tables.sh and commit the result")
PY
