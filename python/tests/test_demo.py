"""switchyard.demo end to end on its small configuration: the expected outcome (R3 has exactly zero
router mismatch against the rollout and the lowest KL; the fp32 router has a mismatch no higher than the
bf16 one; the R3 update reaches the routers), the files it writes and the keys of summary.json."""
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from switchyard import demo  # noqa: E402
from switchyard import routes as syr  # noqa: E402

ARGS = ["--preset", "small", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    code, summary = demo.run(ARGS + ["--out", str(out)])
    return code, summary, out


def test_demo_expected_outcome_holds_and_exit_code_says_so(demo_run):
    code, s, _ = demo_run
    m = s["modes"]
    print({k: (v["router_mismatch"], v["k3_kl"]) for k, v in m.items()})
    assert m["r3"]["router_mismatch"] == 0.0 and m["r3"]["token_mismatch"] == 0.0
    assert m["r3"]["compared_decisions"] > 0 and m["r3"]["replayed_rows"] > 0
    assert all(m["r3"]["k3_kl"] < m[k]["k3_kl"] for k in ("bf16", "fp32", "r2"))
    # <=, not <: how much the fp32 router removes depends on the CPU's torch bf16 kernels (equal
    # with ATEN_CPU_CAPABILITY=default); that it never adds mismatch does not.
    assert m["fp32"]["router_mismatch"] <= m["bf16"]["router_mismatch"]
    # The trainer really differs from the rollout: the bf16 router disagrees somewhere.
    assert m["bf16"]["router_mismatch"] > 0.0 and m["bf16"]["k3_kl"] > 0.0
    assert s["r3_update"]["router_grad_norm"] > 0.0
    assert s["ok"] is True and all(s["checks"].values()) and code == 0


def test_demo_summary_keys_are_plain_fractions_and_counts(demo_run):
    _, s, out = demo_run
    with open(out / "summary.json") as f:
        on_disk = json.load(f)
    for mode in ("bf16", "fp32", "r2", "r3"):
        v = on_disk["modes"][mode]
        for key in ("router_mismatch", "token_mismatch", "ratio_outside_clip"):
            assert isinstance(v[key], float) and 0.0 <= v[key] <= 1.0, (mode, key, v[key])
        assert isinstance(v["k3_kl"], float) and v["k3_kl"] >= 0.0
        for key in ("replayed_rows", "native_rows"):
            assert isinstance(v[key], int) and v[key] >= 0
        assert len(v["layer_mismatch"]) == len(on_disk["model"]["moe_layers"])
    # Replay counts: bf16/fp32 route every row natively; R3 replays all but the rows without a
    # rollout route (each sequence's last token and the pack alignment padding).
    n_rows = on_disk["modes"]["bf16"]["native_rows"]
    assert on_disk["modes"]["bf16"]["replayed_rows"] == 0
    assert on_disk["modes"]["r3"]["replayed_rows"] + on_disk["modes"]["r3"]["native_rows"] == \
        n_rows
    seqs = on_disk["rollout"]["num_sequences"]
    padding = sum(on_disk["trainer"]["micro_batch_tokens"]) - \
        sum(len(t) for t in syr.read(out / "rollout.syr"))
    assert on_disk["modes"]["r3"]["native_rows"] == \
        (seqs + padding) * len(on_disk["model"]["moe_layers"])
    assert on_disk["modes"]["r2"]["step_drift_replayed"] == 0.0
    assert on_disk["modes"]["r2"]["old_pass_equals_bf16"] is True


def test_demo_writes_report_charts_route_file_and_checkpoint(demo_run):
    _, s, out = demo_run
    for name in ("report.md", "summary.json", "mismatch_per_layer.png", "kl_per_mode.png",
                 "expert_load.png", "rollout.syr"):
        assert (out / name).stat().st_size > 0, name
    for name in ("mismatch_per_layer.png", "kl_per_mode.png", "expert_load.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "R3" in (out / "report.md").read_text()
    f = syr.RouteFile(out / "rollout.syr")
    assert f.complete and len(f) == s["rollout"]["num_sequences"]
    assert f.info["moe_layers"] == s["model"]["moe_layers"]
    assert os.path.exists(s["train"]["checkpoint"])
    # Trained routers are peaked: below the uniform entropy and below the initialisation's.
    e = s["routing_entropy"]
    assert e["trained_mean"] < e["init_mean"] < e["uniform"] + 1e-6


def test_demo_rerun_reuses_the_cached_checkpoint(demo_run):
    _, first, out = demo_run
    code, again = demo.run(ARGS + ["--out", str(out)])
    assert again["train"]["cached"] is True and first["train"]["cached"] is False
    assert code == 0
    # Seeded end to end: the rerun measures the same numbers.
    for mode in ("bf16", "fp32", "r2", "r3"):
        assert again["modes"][mode]["router_mismatch"] == first["modes"][mode]["router_mismatch"]
        assert again["modes"][mode]["k3_kl"] == first["modes"][mode]["k3_kl"]


def test_engine_pass_teacher_forced_reproduces_the_rollout_bitwise(demo_run):
    """The engine is deterministic: forcing the sampled tokens through the same batches gives the
    same routes and log-probs bit for bit (what makes the fp32-router engine pass comparable)."""
    _, s, out = demo_run
    from switchyard.demo import model as dm
    from switchyard.demo import rollout as ro
    mcfg, tcfg, rcfg, _ = demo._resolve(demo.build_parser().parse_args(ARGS))
    model, corpus, info = dm.train_or_load(mcfg, tcfg, str(out), progress=False,
                                           log=lambda *a: None)
    assert info["cached"] is True
    model = model.to(torch.bfloat16)
    small = ro.RolloutConfig(num_prompts=4, group_size=2, batch_size=8, max_new_tokens=12)
    a, arr_a, _ = ro.engine_pass(model, corpus, small, progress=False)
    b, arr_b, _ = ro.engine_pass(model, corpus, small, forced=a, progress=False)
    for x, y, ra, rb in zip(a, b, arr_a, arr_b):
        assert x.tokens == y.tokens
        assert torch.equal(x.rollout_logprobs, y.rollout_logprobs)
        assert torch.equal(ra, rb)
        assert ra.shape == (len(x.tokens) - 1, mcfg.num_layers, mcfg.top_k)
        assert bool((ra[:, 0] == 0).all())  # dense layer 0 holds 0 in vLLM's shape


def test_demo_help_explains_every_option():
    p = demo.build_parser()
    for action in p._actions:
        assert action.help, action.option_strings
    r = subprocess.run([sys.executable, "-m", "switchyard.demo", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    for opt in ("--out", "--preset", "--seed", "--micro-batch-tokens", "--update-lr"):
        assert opt in r.stdout


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "-3"], "argument --num-prompts: must be an integer in [1, 2147483647], "
                              "got -3"),
    (["--top-k", "x"], "argument --top-k: must be an integer, got 'x'"),
    (["--temperature", "nan"], "argument --temperature: must be a number in [0.01, 100], got nan"),
    (["--out", "/proc/switchyard-no-such-dir"], "--out '/proc/switchyard-no-such-dir': cannot "
                                                "create the output folder"),
    (["--top-k", "40"], "--top-k must be <= --num-experts=32, got 40"),
    (["--hidden-size", "30"], "argument --hidden-size: must be an integer in [8, 2147483647], a "
                              "multiple of 8, got 30"),
])
def test_bad_arguments_exit_2_naming_the_value_before_any_work(argv, message, capsys, tmp_path):
    from switchyard.demo import run
    if "--out" not in argv:
        argv = argv + ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        run(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "summary.json").exists()
