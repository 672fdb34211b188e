"""The main job with a real engine: ``python -m switchyard.demo --engine vllm`` on its small preset
(4 steps, modes bf16 and r3, one vLLM start). The trainer (TRL) lives in the main venv and vLLM in
this one, so the test runs the demo in the main venv's Python (this file as a script, below) with
an observer on the trainer: forward pre-hooks on every experts module record the ids the experts
receive in each trainer forward, matched to the routes vLLM returned for the same tokens (kept
from the rollout before the integration sees them). R3 must show 0 differing rows there, bf16
(no replay) differing rows on the stale generation; the demo's own report must say the same."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ARGS = ["--preset", "small", "--steps", "4", "--modes", "bf16,r3", "--threads", "1",
        "--no-progress"]


def _main_python():
    venv = subprocess.run(["bash", os.path.join(ROOT, "scripts", "env.sh")], check=True,
                          capture_output=True, text=True).stdout.strip()
    return os.path.join(venv, "bin", "python")


def _demo(args, env_extra=None, timeout=900):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([_main_python(), __file__] + args, capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_vllm")
    p = _demo(["--observe", str(out / "observer.json"), "--engine", "vllm", "--vllm-python",
               sys.executable, "--out", str(out)] + ARGS)
    with open(out / "summary.json") as f:
        summary = json.load(f)
    with open(out / "observer.json") as f:
        observer = json.load(f)
    return p, summary, observer, out


def test_demo_runs_end_to_end_with_vllm_rollouts_and_passes_its_check(run):
    p, s, _, _ = run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert s["ok"] and all(s["checks"].values())
    e = s["engine"]
    assert e["kind"] == "vllm" and e["vllm"].startswith("0.30")
    # one engine for the run: 2 generations per mode, synced on the first of each
    assert e["syncs"] == 2 and e["sequences"] == 2 * 2 * 4 * 4
    assert "[demo] vllm: starting the engine" in p.stdout


def test_r3_experts_receive_vllms_routes_with_zero_mismatch_by_an_observer(run):
    _, s, obs, _ = run
    r3 = obs["r3"]
    assert r3["unmatched_rows"] == 0
    assert r3["compared_rows"] > 0 and r3["forwards"] >= 2 + 4  # old passes + loss forwards
    assert r3["mismatch_rows"] == 0, f"{r3['mismatch_rows']} of {r3['compared_rows']} rows"
    assert s["modes"]["r3"]["final"]["router_mismatch_max"] == 0.0
    assert s["modes"]["r3"]["final"]["replayed_rows"] > 0


def test_without_replay_the_trainer_routes_differently_from_vllm_more_when_stale(run):
    _, s, obs, _ = run
    b = obs["bf16"]
    assert b["compared_rows"] > 0 and b["mismatch_rows"] > 0
    f = s["modes"]["bf16"]["final"]
    # Right after a sync only precision and kernels differ; two steps later the weights too. A
    # broken sync (vLLM computing with other weights) would make the synced share as large.
    assert 0.0 < f["router_mismatch_stale_mean"]
    assert f["router_mismatch_synced_mean"] < 0.05 < f["router_mismatch_stale_mean"]
    assert s["modes"]["bf16"]["final"]["replayed_rows"] == 0
    # R3's own router, before its replay overrides it, disagrees with vLLM's like bf16's does
    assert s["modes"]["r3"]["final"]["router_mismatch_native_stale_mean"] > 0.05


def test_report_files_name_the_engine_and_its_mismatch(run):
    _, _, _, out = run
    for name in ("report.md", "summary.json", "curves.png"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "report.md").read_text()
    assert "## Engine vs trainer (vLLM)" in md and "a real vLLM engine" in md
    assert "| r3 |" in md and "| bf16 |" in md


def test_a_missing_vllm_venv_is_a_usage_error_naming_the_command(tmp_path):
    p = _demo(["--engine", "vllm", "--out", str(tmp_path / "o")],
              {"SWITCHYARD_VENV_ROOT": str(tmp_path / "none"), "SWITCHYARD_VLLM_PYTHON": ""},
              timeout=120)
    assert p.returncode == 2
    assert "bash scripts/env.sh vllm" in p.stderr and str(tmp_path / "none") in p.stderr
    p = _demo(["--engine", "vllm", "--vllm-python", str(tmp_path / "nope"), "--out",
               str(tmp_path / "o")], timeout=120)
    assert p.returncode == 2 and "--vllm-python=" in p.stderr and "nope" in p.stderr


# ---- run as a script in the main venv: the demo with the observer ------------------------------
def _observed_main(argv):
    """``--observe PATH`` then the demo's arguments: runs switchyard.demo.run with forward hooks
    on the trainer's experts modules and writes, per mode, the rows compared with vLLM's routes
    and how many differ."""
    import numpy as np
    import torch

    from switchyard.demo import rl
    from switchyard import demo

    path = argv[argv.index("--observe") + 1]
    del argv[argv.index("--observe"):argv.index("--observe") + 2]
    stats, routes, state = {}, {}, {"mode": None}
    make_rollout_func, instrumented, run_mode = rl.make_rollout_func, rl.instrumented, rl.run_mode

    def run_mode_kept(mode, *a, **kw):
        state["mode"] = mode
        stats[mode] = dict(forwards=0, compared_rows=0, mismatch_rows=0, unmatched_rows=0)
        routes.clear()
        return run_mode(mode, *a, **kw)

    def make_rollout_func_kept(engine, *a, **kw):
        fn = make_rollout_func(engine, *a, **kw)

        def rollout_func(prompts, trainer):
            out = fn(prompts, trainer)  # before the integration pops the routes
            for p, c, r in zip(out["prompt_ids"], out["completion_ids"], out[rl.ROUTES_FIELD]):
                routes.setdefault(tuple(p) + tuple(c), []).append(np.asarray(r))
            return out
        return rollout_func

    def instrumented_observed(base, probe):
        cls = instrumented(base, probe)

        class Observed(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                seen, fwd = {}, {}
                layers = self.model.model.layers
                moe = [i for i, layer in enumerate(layers)
                       if getattr(layer.mlp, "experts", None) is not None]

                def pre_model(mod, args, kwargs):
                    seen.clear()
                    fwd["ids"] = kwargs.get("input_ids", args[0] if args else None)
                    fwd["mask"] = kwargs.get("attention_mask")

                def post_model(mod, args, kwargs, out):
                    _compare(fwd["ids"], fwd["mask"], seen, moe)

                for i in moe:
                    def hook(mod, args, kwargs, i=i):
                        idx = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
                        seen[i] = idx.detach().to(torch.int64).clone()
                    layers[i].mlp.experts.register_forward_pre_hook(hook, with_kwargs=True)
                self.model.register_forward_pre_hook(pre_model, with_kwargs=True)
                self.model.register_forward_hook(post_model, with_kwargs=True)
        return Observed

    def _compare(ids, mask, seen, moe):
        st = stats[state["mode"]]
        st["forwards"] += 1
        B, S = ids.shape
        for b in range(B):
            pos = (mask[b].bool() if mask is not None else torch.ones(S, dtype=torch.bool))
            pos = pos.nonzero().flatten()
            toks = tuple(ids[b, pos].tolist())
            cands = routes.get(toks)
            if cands is None:
                st["unmatched_rows"] += 1
                continue
            best = None
            for r in cands:  # identical samples: the closest of their routes
                bad = 0
                for i in moe:
                    got = seen[i].view(B, S, -1)[b, pos[:-1]].sort(-1).values
                    want = torch.from_numpy(r[:, i].astype(np.int64)).sort(-1).values
                    bad += int((got != want).any(-1).sum())
                best = bad if best is None else min(best, bad)
            st["mismatch_rows"] += best
            st["compared_rows"] += (len(pos) - 1) * len(moe)

    rl.run_mode, rl.make_rollout_func, rl.instrumented = (run_mode_kept, make_rollout_func_kept,
                                                           instrumented_observed)
    code = demo.main(argv)
    with open(path, "w") as f:
        json.dump(stats, f)
    return code


if __name__ == "__main__":
    if "--observe" in sys.argv:
        sys.exit(_observed_main(sys.argv[1:]))
    from switchyard.demo import main
    sys.exit(main(sys.argv[1:]))
