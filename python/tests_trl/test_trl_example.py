"""The user-facing TRL example runs and R3 holds in it (the experts receive the rollout's ids in
every forward)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")


def test_trl_grpo_r3_example_runs_and_the_experts_receive_the_rollouts_ids():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "trl_grpo_r3.py"), "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert ("largest mismatch between the experts used and the rollout's routes over 3 forwards: "
            "0 rows") in r.stdout
    assert "step 2:" in r.stdout
