"""switchyard.demo (the main job) end to end on its small preset: TRL's GRPOTrainer in each router
mode with rollouts from the stale bf16 engine; R3 has exactly zero router mismatch against the
rollout on every step, and that check fails when replay is off. Its own ctest entry
(python_demo): TRL runs take tens of seconds, too long for the main Python suite."""
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("matplotlib")

from switchyard import demo  # noqa: E402

torch.set_num_threads(1)

ARGS = ["--preset", "small", "--threads", "1", "--no-progress"]


MODES = ["bf16", "fp32", "r3", "r2"]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("demo")


@pytest.fixture(scope="module")
def demo_run(out_dir):
    code, summary = demo.run(ARGS + ["--out", str(out_dir), "--modes", ",".join(MODES)])
    return code, summary, out_dir


def test_demo_trains_every_mode_with_a_stale_engine_and_passes_its_check(demo_run):
    code, s, _ = demo_run
    cfg = s["config"]["grpo"]
    gens = -(-cfg["steps"] // cfg["num_iterations"])
    for mode in MODES:
        m = s["modes"][mode]
        assert len(m["generations"]) == gens and gens >= 2, mode
        assert [st["step"] for st in m["steps"]] == list(range(1, cfg["steps"] + 1)), mode
        rewards = [st["reward"] for st in m["steps"] if "reward" in st]
        assert len(rewards) == gens and all(0.0 <= r <= 1.0 for r in rewards), mode
        # The engine is synced on the first generation and every sync_every-th after it: the
        # others are sampled by weights num_iterations optimizer steps old.
        assert [g["staleness"] for g in m["generations"]] == [
            0 if i % cfg["sync_every"] == 0 else
            cfg["num_iterations"] * (i % cfg["sync_every"]) for i in range(gens)], mode
        assert [p["step"] for p in m["policy"]] == list(range(1, cfg["steps"] + 1)), mode
        for g in m["generations"]:
            assert g["compared_rows"] > 0 and g["mismatch_rows"] <= g["compared_rows"]
            assert 0.0 <= g["router_mismatch"] <= 1.0 and g["train_rollout_k3_kl"] >= 0.0
    for mode in ("bf16", "fp32"):
        g = s["modes"][mode]["generations"]
        # The engine's numerics differ from the trainer's and it goes stale: its routes differ.
        assert any(x["router_mismatch"] > 0.0 for x in g), mode
        assert all(x["replayed_rows"] == 0 and x["native_rows"] > 0 for x in g), mode
    r3 = s["modes"]["r3"]
    assert all(x["mismatch_rows"] == 0 and x["replayed_rows"] > 0
               for x in r3["generations"] + r3["policy"])
    # R2 replays the old pass's routes in the updates: its loss forwards route like its old pass.
    r2 = s["modes"]["r2"]
    assert all(p["replayed_rows"] > 0 for p in r2["policy"])
    assert all(g["replayed_rows"] == 0 for g in r2["generations"])
    assert s["ok"] is True and code == 0


def test_demo_writes_curves_report_and_summary(demo_run):
    _, s, out = demo_run
    for name in ("report.md", "summary.json", "curves.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "summary.json") as f:
        on_disk = json.load(f)
    assert list(on_disk["modes"]) == MODES
    for mode in MODES:
        fin = on_disk["modes"][mode]["final"]
        for key in ("reward_first", "reward_last", "router_mismatch_mean",
                    "train_rollout_k3_kl_mean", "rollout_ratio_outside_clip_mean",
                    "trl_clip_ratio_mean"):
            assert isinstance(fin[key], float), (mode, key)
        assert isinstance(fin["replayed_rows"], int)
        assert on_disk["modes"][mode]["seconds_per_step"] > 0
    text = (out / "report.md").read_text()
    assert "within noise" in text and "curves.png" in text
    assert os.path.exists(s["pretrain"]["checkpoint"])


def test_demo_r3_check_fails_when_routes_are_not_replayed(demo_run):
    """The check that fails the run can fail: R3 on TRL's plain trainer (nothing replayed)."""
    _, _, out = demo_run
    code, s = demo.run(ARGS + ["--out", str(out), "--modes", "r3", "--steps", "4"],
                       _disable_replay=True)
    g = s["modes"]["r3"]["generations"] + s["modes"]["r3"]["policy"]
    assert all(x["replayed_rows"] == 0 for x in g)
    assert any(x["mismatch_rows"] > 0 for x in g)
    assert s["pretrain"]["cached"] is True  # the module's first run trained it
    assert s["ok"] is False and code == 1
    assert list(s["checks"].values()) == [False]
    assert "FAIL" in (out / "report.md").read_text()


def test_demo_help_explains_every_option():
    p = demo.build_parser()
    for action in p._actions:
        assert action.help, action.option_strings
    r = subprocess.run([sys.executable, "-m", "switchyard.demo", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    for opt in ("--out", "--preset", "--seed", "--steps", "--modes", "--sync-every",
                "--num-iterations", "--no-progress"):
        assert opt in r.stdout


@pytest.mark.parametrize("argv, message", [
    (["--prompts-per-step", "-3"], "argument --prompts-per-step: must be an integer in [1, "
                                   "2147483647], got -3"),
    (["--top-k", "x"], "argument --top-k: must be an integer, got 'x'"),
    (["--temperature", "nan"], "argument --temperature: must be a number in [0.01, 100], got nan"),
    (["--out", "/proc/switchyard-no-such-dir"], "--out '/proc/switchyard-no-such-dir': cannot "
                                                "create the output folder"),
    (["--top-k", "40"], "--top-k must be <= --num-experts=32, got 40"),
    (["--modes", "r3,r3"], "--modes: must be a comma-separated list of distinct modes"),
])
def test_bad_arguments_exit_2_naming_the_value_before_any_work(argv, message, capsys, tmp_path):
    if "--out" not in argv:
        argv = argv + ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        demo.run(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "summary.json").exists()
