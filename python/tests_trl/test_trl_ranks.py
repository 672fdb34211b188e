"""switchyard's TRL GRPOTrainer at 2 ranks (DDP over gloo on the CPU, launched with torchrun as a
user launches it; trl_ranks_worker.py is one rank): R3 replays exactly on every rank and replay=None
shows a mismatch on every rank, both as an observer independent of switchyard's counters sees them
(hooks on each rank's experts modules); the ranks train on different data; the logged switchyard
metrics are the observer's totals over all ranks (with the largest single rank's share) and equal
on every rank; ranks that disagree on the routes' layout (K; routes on one rank only) raise on
every rank instead of hanging; accelerate's FSDP asked for on the CPU trains with DDP (accelerate
1.15; docs/guides/trl.md)."""
import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("trl")

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = 2
LAUNCH_TIMEOUT_S = 300  # a hang (a rank waiting in a collective) fails here, not in ctest's limit
_NEAR_TIES = 0.05  # as test_trl.py: top-k flips between generation's and training's kernels
KINDS = ("old", "policy")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """[rank 0's result, rank 1's result]: {run name: what the rank saw} (see the worker)."""
    out = tmp_path_factory.mktemp("ranks")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={RANKS}", os.path.join(HERE, "trl_ranks_worker.py"), str(out)]
    # its own session: on a timeout the launcher and both ranks are killed, none left behind
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the {RANKS}-rank TRL runs did not finish in {LAUNCH_TIMEOUT_S} s (a hang?)"
                    f"\n{log[-6000:]}")
    assert proc.returncode == 0, log[-8000:]
    got = [json.load(open(out / f"rank{r}.json")) for r in range(RANKS)]
    for g in got:
        for name, run in g["runs"].items():
            assert "crash" not in run, f"rank {g['rank']}, run {name}:\n{run['crash']}"
    assert [g["rank"] for g in got] == list(range(RANKS))
    return [g["runs"] for g in got]


def _run(ranks, name):
    return [r[name] for r in ranks]


def test_every_run_is_ddp_over_the_cpu_at_two_ranks(ranks):
    for name in ("r3", "none", "generate", "disagree", "unrouted"):
        for run in _run(ranks, name):
            assert run["num_processes"] == RANKS
            assert run["distributed_type"] == "DistributedType.MULTI_CPU"
            assert run["model_wrapper"] == "DistributedDataParallel", name


def test_fsdp_asked_for_on_the_cpu_trains_with_ddp_and_replays_exactly(ranks):
    # accelerate 1.15 switches to FSDP only for accelerator devices (state.py: the MULTI_CPU
    # distributed type is not among those that take the FSDP plugin): the model is wrapped in
    # DDP. When accelerate runs FSDP on the CPU this fails: extend these runs to it.
    for run in _run(ranks, "fsdp"):
        assert run["distributed_type"] == "DistributedType.MULTI_CPU"
        assert run["model_wrapper"] == "DistributedDataParallel"
        assert run["observer"] and all(f["mismatch"] == 0 < f["compared"]
                                       for f in run["observer"])


def _check_forwards(run):
    """Every log-prob forward the records list is one the observer saw, in the same order."""
    recs, obs = run["records"], run["observer"]
    assert len(recs) == len(obs) > 0
    for rec, f in zip(recs, obs):
        assert rec["global_step"] == f["step"]
        assert (rec["kind"] == "policy") == f["grad"]
        assert rec["compared_rows"] == f["compared"]
        assert rec["world_size"] == RANKS
    return recs, obs


@pytest.mark.parametrize("name", ["r3", "generate", "fsdp"])
def test_r3_replays_exactly_on_every_rank_as_the_observer_sees(ranks, name):
    for rank, run in enumerate(_run(ranks, name)):
        recs, obs = _check_forwards(run)
        for rec, f in zip(recs, obs):
            assert f["mismatch"] == 0 < f["compared"], (rank, f)  # the rollout's ids, each row
            assert rec["used_mismatch_rows"] == 0 and rec["replayed_rows"] == f["compared"]
            assert rec["native_rows"] == f["rows"] - f["compared"]  # padding and last tokens
    if name == "r3":  # old pass and updates (num_iterations=2)
        assert {r["kind"] for r in recs} == set(KINDS)


def test_without_replay_every_rank_sees_a_mismatch(ranks):
    for rank, run in enumerate(_run(ranks, "none")):
        recs, obs = _check_forwards(run)
        for rec, f in zip(recs, obs):
            # synthetic routes the model does not pick: most rows differ, on each rank
            assert f["mismatch"] > f["compared"] // 2, (rank, f)
            # the experts received the router's own choice: the counter is what they received
            assert rec["mismatch_rows"] == rec["used_mismatch_rows"] == f["mismatch"]
            assert rec["replayed_rows"] == 0 and rec["native_rows"] == f["rows"]


def test_the_ranks_trained_on_different_data(ranks):
    for name in ("r3", "none", "generate"):
        seqs = [{tuple(s) for s in run["seqs"]} for run in _run(ranks, name)]
        assert all(seqs) and seqs[0] != seqs[1], name
        assert len(seqs[0] & seqs[1]) < min(map(len, seqs)), name


def _observed_metrics(ranks, name, replay):
    """{(step logged, metric): value} the observer's counts give, summed over the ranks the way
    the trainer reduces them, per forward, averaged per logged step as TRL averages a metric."""
    per_rank = [run["observer"] for run in _run(ranks, name)]
    assert len({len(obs) for obs in per_rank}) == 1
    acc = {}
    for fs in zip(*per_rank):  # the same forward on every rank
        assert len({(f["step"], f["grad"]) for f in fs}) == 1
        kind = "policy" if fs[0]["grad"] else "old"  # no reference model in these runs
        key = (fs[0]["step"] + 1, f"switchyard/{kind}/")  # logged at the end of the step
        m, c = sum(f["mismatch"] for f in fs), sum(f["compared"] for f in fs)
        replayed = c if replay else 0
        vals = {"replayed_rows": replayed, "native_rows": sum(f["rows"] for f in fs) - replayed}
        if replay is None:  # the experts received the router's own choice: its mismatch
            vals["router_mismatch"] = m / c
            vals["router_mismatch/max_rank"] = max(f["mismatch"] / f["compared"] for f in fs)
        for k, v in vals.items():
            acc.setdefault((key[0], key[1] + k), []).append(v)
    return {k: sum(v) / len(v) for k, v in acc.items()}


@pytest.mark.parametrize("name,replay", [("none", None), ("r3", "R3"), ("generate", "R3")])
def test_logged_metrics_are_the_observers_totals_over_all_ranks(ranks, name, replay):
    want = _observed_metrics(ranks, name, replay)
    logs = [{(h["step"], k): v for h in run["log_history"] for k, v in h.items()
             if k.startswith("switchyard/")} for run in _run(ranks, name)]
    assert logs[0] == logs[1]  # every rank logs the same (reduced) values
    logged = logs[0]
    assert want and set(want) <= set(logged)
    for key, v in want.items():
        tol = 1e-9 if key[1].endswith("/max_rank") else 1e-12
        assert logged[key] == pytest.approx(v, abs=tol), key
    if name == "none":  # one rank's share differs from the average: the max shows it
        assert any(logged[k] > logged[(k[0], k[1][:-len("/max_rank")])]
                   for k in logged if k[1].endswith("/max_rank"))
    if name == "generate":  # the rollout's routes are the router's own choice on these weights
        assert all(v <= _NEAR_TIES for (_, k), v in logged.items()
                   if k.endswith("router_mismatch"))


@pytest.mark.parametrize("name", ["r3", "none", "generate"])
def test_each_record_carries_the_counts_of_all_ranks(ranks, name):
    runs = _run(ranks, name)
    for i, rec0 in enumerate(runs[0]["records"]):
        recs = [run["records"][i] for run in runs]
        assert recs[0]["ranks"] == recs[1]["ranks"]
        tot = recs[0]["ranks"]
        for n in ("mismatch_rows", "compared_rows", "replayed_rows", "native_rows"):
            vals = [r[n] for r in recs]
            assert (tot[n], tot[n + "/max_rank"], tot[n + "/min_rank"]) == (
                sum(vals), max(vals), min(vals))


@pytest.mark.hostile(tried="TRL at 2 ranks: rank 1's model routes to 3 experts, rank 0's to 2",
                     gets="the same ValueError on both ranks naming top_k and each rank's value, "
                          "no hang")
def test_ranks_that_disagree_on_the_routes_raise_on_every_rank(ranks):
    runs = _run(ranks, "disagree")
    for run in runs:
        assert "top_k differs (rank 0: 2, rank 1: 3)" in run["error"]
        assert "the routes of the policy log-prob forward [trl.GRPOTrainer]" in run["error"]
        assert run["records"] == []  # raised before any forward was replayed


@pytest.mark.hostile(tried="TRL at 2 ranks, replay=None: rank 1's rollout engine returns no "
                           "routes, rank 0's does",
                     gets="the same ValueError on both ranks naming rollout_routes, no hang")
def test_routes_on_one_rank_only_raise_on_every_rank(ranks):
    for run in _run(ranks, "unrouted"):
        assert "rollout_routes differs (rank 0: 1, rank 1: 0)" in run["error"]
        assert run["records"] == []
