# Shared fixtures: a seeded generator that says how to reproduce a failure, and the `hostile`
# marker whose rows make the README's table of careless/hostile uses (generated from the tests
# that passed, never written by hand).
import os

import pytest
import torch


@pytest.fixture
def gen(request):
    seed = int(os.environ.get("SY_TEST_SEED", "1234"))
    g = torch.Generator().manual_seed(seed)
    request.node.user_properties.append(("reproduce", f"SY_TEST_SEED={seed}"))
    return g


def pytest_configure(config):
    torch.set_num_threads(1)
    config.addinivalue_line(
        "markers", "hostile(tried, gets): a careless or hostile use and what switchyard does with "
        "it; with SY_HOSTILE_TABLE=<file> the passing ones are written as a Markdown table")
    config._sy_hostile_rows = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.passed:
        item.config._sy_hostile_rows.extend(
            (m.kwargs["tried"], m.kwargs["gets"], item.nodeid) for m in item.iter_markers("hostile"))


def pytest_sessionfinish(session):
    out = os.environ.get("SY_HOSTILE_TABLE")
    rows = getattr(session.config, "_sy_hostile_rows", [])
    if out and rows:
        # One row per (tried, gets): a parametrised test's cases share their marker.
        tests = {}
        for tried, gets, nodeid in rows:
            test = nodeid.split("/")[-1].split("[")[0]
            tests.setdefault((tried, gets), set()).add(test)
        lines = ["| what was tried | what it gets | test |", "|---|---|---|"]
        for (tried, gets), names in sorted(tests.items(), key=lambda kv: min(kv[1])):
            cell = ", ".join(f"`{n}`" for n in sorted(names))
            lines.append(f"| {tried} | {gets} | {cell} |")
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
