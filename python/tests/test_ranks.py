"""switchyard.integrations._ranks at 2 ranks over gloo (spawned processes): counts summed with
per-rank extremes, and a disagreement raised on every rank instead of a hang."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from switchyard.integrations import _ranks


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, case, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if case == "reduce":
            out = _ranks.reduce_counts({"replayed": 3 + rank * 4, "native": 7 - rank})
            q.put((rank, "ok", out))
        elif case == "agree":
            _ranks.check_ranks_agree("step", {"step": 5, "layers": 2})
            q.put((rank, "ok", None))
        else:
            try:
                _ranks.check_ranks_agree("test routes", {"step": 5, "layers": 2 + rank})
                q.put((rank, "no error", None))
            except ValueError as e:
                q.put((rank, "error", str(e)))
    finally:
        dist.destroy_process_group()


def _run(case):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, port, case, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got


def test_reduce_counts_sums_and_keeps_each_ranks_extremes():
    for rank, status, out in _run("reduce"):
        assert status == "ok"
        assert out == {"replayed": 10, "native": 13,
                       "replayed/max_rank": 7, "replayed/min_rank": 3,
                       "native/max_rank": 7, "native/min_rank": 6}, rank


def test_check_ranks_agree_passes_when_equal():
    assert [s for _, s, _ in _run("agree")] == ["ok", "ok"]


def test_check_ranks_agree_raises_on_every_rank_naming_field_and_values():
    got = _run("disagree")
    assert [s for _, s, _ in got] == ["error", "error"]
    for _, _, msg in got:
        assert "layers differs (rank 0: 2, rank 1: 3)" in msg and "test routes" in msg


def test_single_process_returns_local_counts_and_checks_nothing():
    assert _ranks.reduce_counts({"a": 2}) == {"a": 2, "a/max_rank": 2, "a/min_rank": 2}
    assert _ranks.reduce_counts({"a": 2}, per_rank=False) == {"a": 2}
    _ranks.check_ranks_agree("x", {"a": 1})
    assert _ranks.world() == (0, 1)


@pytest.mark.parametrize("bad", [1.5, True, torch.tensor([1, 2]), torch.tensor(1.0), "3"])
def test_non_integer_count_is_named(bad):
    with pytest.raises(TypeError, match=r"counts\['x'\] must be an integer"):
        _ranks.reduce_counts({"x": bad})
