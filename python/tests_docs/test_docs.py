"""The documentation as a test: every ```python block of the README and the guides runs, and no
Markdown file of the repository links outside it (or to a file that is not there).

A block that cannot run here (it needs GPUs, a server or a trainer's model) is marked by the line
``<!-- no-run: why -->`` right before it; the reason is required. Each block runs in its own
interpreter, in a temporary directory, with the environment's PYTHONPATH (build/python under ctest).
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(?P<pre>(?:^[^\n]*\n){0,1})^```python\n(?P<code>.*?)^```", re.S | re.M)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<why>[^>]*?)\s*-->")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|"
                  r"!\[[^\]]*\]\(\s*<?(?P<image>[^)\s>]+)>?\s*\)")
SKIP_DIRS = {".git", "node_modules", "site"}


def doc_pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]


def code_blocks():
    out = []
    for page in doc_pages():
        text = page.read_text()
        for i, m in enumerate(BLOCK.finditer(text)):
            line = text.count("\n", 0, m.start("code"))
            no_run = NO_RUN.search(m.group("pre") or "")
            name = f"{page.relative_to(ROOT)}:{line}"
            marks = []
            if no_run:
                marks = [pytest.mark.skip(reason=f"no-run: {no_run.group('why')}")]
            out.append(pytest.param(m.group("code"), name, id=name, marks=marks))
    return out


def markdown_files():
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = pathlib.Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames
                       if d not in SKIP_DIRS and not (rel == pathlib.Path(".") and
                                                      (d.startswith("build") or d == "fuzz-out"))]
        files += [pathlib.Path(dirpath) / f for f in filenames if f.endswith(".md")]
    return sorted(files)


def links(text):
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    for m in LINK.finditer(text):
        yield m.group("target") or m.group("image")


def test_no_markdown_file_links_outside_the_repository():
    bad = []
    for md in markdown_files():
        for target in links(md.read_text(errors="replace")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # a URL (http:, mailto:) or an anchor of the same page
            path = target.split("#", 1)[0]
            dest = (ROOT / path.lstrip("/")) if path.startswith("/") else (md.parent / path)
            dest = pathlib.Path(os.path.normpath(dest))
            where = f"{md.relative_to(ROOT)}: ({target})"
            if ROOT != dest and ROOT not in dest.parents:
                bad.append(f"{where} leaves the repository")
            elif not dest.exists():
                bad.append(f"{where} does not exist")
    assert not bad, "broken or outside links:\n" + "\n".join(bad)


def test_the_link_check_sees_a_link_outside_the_repository():
    assert list(links("see [the contract](../shared/DESIGN.md) and `[not](a/link)`")) == \
        ["../shared/DESIGN.md"]


def test_every_no_run_mark_gives_a_reason():
    for page in doc_pages():
        for m in re.finditer(r"<!--\s*no-run\b[^>]*-->", page.read_text()):
            assert NO_RUN.fullmatch(m.group(0)) and NO_RUN.fullmatch(m.group(0)).group("why"), \
                f"{page.relative_to(ROOT)}: {m.group(0)} gives no reason"


@pytest.mark.parametrize("code,name", code_blocks())
def test_code_block_runs(code, name, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in
                                        env.get("PYTHONPATH", "").split(os.pathsep) if p)
    script = tmp_path / "block.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
