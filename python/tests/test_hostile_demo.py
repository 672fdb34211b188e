"""Careless and hostile arguments to ``python -m switchyard.demo`` (issue 22): every numeric option
has a range, checked by argparse before any model is built, so a value the demo cannot run with
exits 2 (usage; 1 means a check of the experiment failed) naming the option, its range and the
value, with no traceback."""
import os
import subprocess
import sys

import pytest

from switchyard import demo

INT_MAX = 2**31 - 1


@pytest.mark.hostile(tried="demo: --train-seq-len 1..4, --seed 2**80, --vocab-size 5",
                     gets="exit 2 naming the option and its range, before any model is built "
                          "(was a torch traceback, exit 1)")
@pytest.mark.parametrize("argv, message", [
    (["--train-seq-len", "4"], f"argument --train-seq-len: must be an integer in [5, {INT_MAX}], "
                               "got 4"),
    (["--seed", str(2**80)], f"argument --seed: must be an integer in [0, {2**32 - 1}], got "
                             f"{2**80}"),
    (["--vocab-size", "5"], f"argument --vocab-size: must be an integer in [40, {INT_MAX}], got 5"),
])
def test_demo_out_of_range_numbers_exit_2_naming_the_range(argv, message, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "switchyard.demo", *argv, "--out", str(out)],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists() or not os.listdir(out)  # no checkpoint, no report


@pytest.mark.hostile(tried="demo: sizes that overflow torch, a head size RoPE cannot rotate, a "
                           "temperature or learning rate that makes NaNs, 10**5 threads",
                     gets="exit 2 naming the option and its range, before any model is built")
@pytest.mark.parametrize("argv, message", [
    (["--train-seq-len", "1"], f"--train-seq-len: must be an integer in [5, {INT_MAX}], got 1"),
    (["--hidden-size", "12"], "--hidden-size: must be an integer in [8, 2147483647], a multiple "
                              "of 8, got 12"),
    (["--num-experts", str(2**40)], f"--num-experts: must be an integer in [1, {INT_MAX}]"),
    (["--max-new-tokens", "0"], f"--max-new-tokens: must be an integer in [1, {INT_MAX}], got 0"),
    (["--train-steps", "-1"], f"--train-steps: must be an integer in [0, {INT_MAX}], got -1"),
    (["--num-layers", "1"], f"--num-layers: must be an integer in [2, {INT_MAX}], got 1"),
    (["--threads", "100000"], "--threads: must be an integer in [1, 1024], got 100000"),
    (["--seed", "-1"], f"--seed: must be an integer in [0, {2**32 - 1}], got -1"),
    (["--temperature", "1e-300"], "--temperature: must be a number in [0.01, 100], got 1e-300"),
    (["--train-lr", "1e10"], "--train-lr: must be a number in (0, 1], got 1e10"),
    (["--lr", "0"], "--lr: must be a number in (0, 1], got 0"),
    (["--sync-every", "inf"], "--sync-every: must be an integer, got 'inf'"),
    (["--num-generations", "1"], f"--num-generations: must be an integer in [2, {INT_MAX}], "
                                 "got 1"),
    (["--modes", "r3,bogus"], "--modes: must be a comma-separated list of distinct modes from "
                              "bf16,fp32,r3,r2, got 'r3,bogus'"),
])
def test_demo_every_numeric_option_has_a_range(argv, message, capsys, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        demo.run(argv + ["--out", str(out)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists() or not os.listdir(out)


def test_demo_help_states_each_numeric_range():
    p = demo.build_parser()
    for action in p._actions:
        if action.option_strings and action.type not in (None, str, demo._modes):
            assert "(range " in action.help, action.option_strings
