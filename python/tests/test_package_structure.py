"""The package's structure as a specification (issue 31): imports point one way (no module imports,
even lazily, one that imports it back), and no module reads or writes another module's private
names. Both read the sources with ``ast``; nothing is imported."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "switchyard"

# Private names one module still takes from another, each with its reason. Keep it tiny: a new
# entry needs the reason a public name cannot serve.
ALLOWED_PRIVATE = {
    ("switchyard.integrations.hf.patch", "_family_of"):
        "families.py is being rewritten as per-family specs (issue 32); its lookup becomes public "
        "there",
    ("switchyard.integrations.hf.patch", "_gate"):
        "families.py is being rewritten as per-family specs (issue 32); the gate becomes public "
        "there",
    ("switchyard.integrations.megatron.config", "_router_logits"):
        "switchyard.torch's gate with Megatron's router_dtype meaning; torch.py becomes the "
        "torch.library operators (issue 33), which give it a public name",
}


def _modules():
    """{dotted name: path} of every .py module of the package."""
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()
EXTENSIONS = {"switchyard._switchyard"}  # the compiled engine: imports nothing from the package


def _is_package(name):
    return MODULES[name].name == "__init__.py"


def _resolve(module, node):
    """The dotted module an ImportFrom names (relative imports resolved), or None (third party)."""
    if node.level == 0:
        return node.module if node.module and node.module.split(".")[0] == "switchyard" else None
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module):
    """[(line, imported module, names taken from it, alias bound to a module)] of every switchyard
    import in ``module``, at any depth (lazy imports inside functions included)."""
    tree = ast.parse(MODULES[module].read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "switchyard" and a.name in MODULES:
                    out.append((node.lineno, a.name, [], a.asname or a.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if target is None:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in EXTENSIONS or target in EXTENSIONS:
                    continue
                if sub in MODULES:  # `from pkg import module`
                    out.append((node.lineno, sub, [], a.asname or a.name))
                elif target in MODULES:
                    out.append((node.lineno, target, [a.name], None))
    return out


def _graph():
    return {m: {t for _, t, _, _ in _imports(m) if t != m} for m in MODULES}


def _cycles(graph):
    """Every import cycle, each as a list of modules (one rotation per cycle)."""
    found, stack, on_stack, done = [], [], set(), set()

    def visit(m):
        stack.append(m)
        on_stack.add(m)
        for t in sorted(graph.get(m, ())):
            if t in on_stack:
                cyc = stack[stack.index(t):]
                k = cyc.index(min(cyc))
                cyc = cyc[k:] + cyc[:k]
                if cyc not in found:
                    found.append(cyc)
            elif t not in done:
                visit(t)
        stack.pop()
        on_stack.discard(m)
        done.add(m)

    for m in sorted(graph):
        if m not in done:
            visit(m)
    return found


def test_the_package_has_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(
        " -> ".join(c + [c[0]]) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    # The check itself can fail: a lazy import back from b to a is a cycle.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private_attributes(module):
    """Private attribute names ``module`` defines: methods and class attributes of its classes,
    ``self._x = ...`` and ``obj._x = ...`` (a module that stashes an attribute on an object it
    does not own defines that attribute)."""
    tree = ast.parse(MODULES[module].read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and (isinstance(t.value, ast.Name) and
                                                     t.value.id in ("self", "cls")):
                    names.add(t.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_uses(module, owners):
    """[(line, private name, text)] of ``module``'s uses of another module's private names."""
    src = MODULES[module].read_text()
    tree = ast.parse(src)
    mine = _private_attributes(module)
    aliases = {}
    out = []
    for line, target, names, alias in _imports(module):
        if alias is not None:
            aliases[alias] = target
        for n in names:
            if n.startswith("_") and target != module:
                out.append((line, n, f"from {target} import {n}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or \
                node.attr.startswith("__"):
            continue
        base, name = node.value, node.attr
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and \
                base.func.id == "super":
            continue  # a subclass calling its framework parent's hook
        if isinstance(base, ast.Name) and base.id in aliases:
            target = aliases[base.id]
            if f"{target}.{name}" not in MODULES and target != module:
                out.append((node.lineno, name, ast.unparse(node)))
            continue
        if name not in mine and owners.get(name, set()) - {module}:
            out.append((node.lineno, name, f"{ast.unparse(node)} (defined by "
                                           f"{', '.join(sorted(owners[name] - {module}))})"))
    return out


def _all_private_uses():
    owners = {}
    for m in MODULES:
        for n in _private_attributes(m):
            owners.setdefault(n, set()).add(m)
    uses = []
    for m in MODULES:
        for line, name, text in _private_uses(m, owners):
            if (m, name) not in ALLOWED_PRIVATE:
                uses.append(f"{MODULES[m].relative_to(PACKAGE.parent)}:{line}: {text}")
    return uses


def test_no_module_touches_another_modules_private_names():
    uses = _all_private_uses()
    assert not uses, "private names used across modules:\n" + "\n".join(uses)


def test_the_allowed_private_uses_still_exist():
    # An entry whose use is gone is removed, so the list stays the list of what is left.
    owners = {}
    for m in MODULES:
        for n in _private_attributes(m):
            owners.setdefault(n, set()).add(m)
    seen = {(m, name) for m in MODULES for _, name, _ in _private_uses(m, owners)}
    assert not set(ALLOWED_PRIVATE) - seen, sorted(set(ALLOWED_PRIVATE) - seen)


# ---- docstrings: Google style (Args / Returns / Raises) on the public API of finished modules ----
# The modules whose public functions, classes and methods are held to it (the mkdocs API pages
# read them with docstring_style: google). A module joins the list once it is converted.
GOOGLE_STYLE_MODULES = ("switchyard.replay", "switchyard._engine",
                        "switchyard.integrations._adapter", "switchyard.integrations._versions",
                        "switchyard.integrations._ranks", "switchyard.dist",
                        "switchyard.integrations.megatron.patch",
                        "switchyard.integrations.megatron.replay",
                        "switchyard.integrations.megatron.config",
                        "switchyard.integrations.megatron.fixes",
                        "switchyard.integrations.hf.patch", "switchyard.integrations.hf.capture")


def _own_nodes(fn):
    """The nodes of ``fn``'s body, not those of the functions defined inside it (a wrapper's
    raise is the wrapper's)."""
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                 ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _returns_value(fn):
    return any(isinstance(node, ast.Return) and node.value is not None and not (
        isinstance(node.value, ast.Constant) and node.value.value is None)
        for node in _own_nodes(fn))


def _raises(fn):
    return any(isinstance(node, ast.Raise) and node.exc is not None for node in _own_nodes(fn))


def _doc_problems(module):
    tree = ast.parse(MODULES[module].read_text())
    problems = []

    def check(fn, where, is_property=False):
        doc = ast.get_docstring(fn) or ""
        params = [a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")]
        if fn.args.vararg:
            params.append(fn.args.vararg.arg)
        if fn.args.kwarg:
            params.append(fn.args.kwarg.arg)
        if not doc:
            problems.append(f"{where}: no docstring")
            return
        if params and not is_property and "Args:" not in doc:
            problems.append(f"{where}: no Args: section for {params}")
        for p in params if "Args:" in doc else ():
            if f"{p}:" not in doc.split("Args:")[1]:
                problems.append(f"{where}: Args: does not name {p}")
        if not is_property and _returns_value(fn) and "Returns:" not in doc and \
                "Deprecated" not in doc:
            problems.append(f"{where}: returns a value but has no Returns: section")
        if not is_property and _raises(fn) and "Raises:" not in doc and "Deprecated" not in doc:
            problems.append(f"{where}: raises but has no Raises: section")

    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            check(node, f"{module}.{node.name}")
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            if not ast.get_docstring(node):
                problems.append(f"{module}.{node.name}: no docstring")
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and (
                        not item.name.startswith("_") or item.name == "__init__"):
                    deco = {ast.unparse(d) for d in item.decorator_list}
                    if item.name == "__init__" or any(d.endswith(".setter") for d in deco):
                        continue  # the class's / the property's docstring holds them
                    prop = "property" in deco
                    check(item, f"{module}.{node.name}.{item.name}", prop)
    return problems


@pytest.mark.parametrize("module", GOOGLE_STYLE_MODULES)
def test_public_api_has_google_style_docstrings(module):
    problems = _doc_problems(module)
    assert not problems, "\n".join(problems)
