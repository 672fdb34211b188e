"""Hostile input from Python (issue 13): borrowed non-contiguous tensors stay alive for the call,
route files are never lost or mislabelled by a failing writer, and a replay forward that fails
validation leaves its queues as they were. Every test here failed on the branch point 9cdafeb."""
import os

import pytest
import torch

import switchyard as sy
import switchyard.routes as syr
import switchyard.torch as syt


def _wide(gen, T=64, L=3, K=2, E=8):
    """A [T, L, K+2] table whose middle columns t[:, :, 1:K+1] are a valid non-contiguous view."""
    t = torch.randint(0, E, (T, L, K + 2), generator=gen, dtype=torch.int32)
    return t


# ---- borrowed tensors: the contiguous copy of a slice lives for the whole call -------------------
def test_write_of_a_non_contiguous_slice_round_trips(tmp_path, gen):
    tables = [_wide(gen, T)[:, :, 1:3] for T in (5, 40, 1)]
    assert not tables[0].is_contiguous()
    path = tmp_path / "s.syr"
    syr.write(path, tables, num_experts=8)
    back = syr.read(path)
    for got, want in zip(back, tables):
        assert torch.equal(got, want.contiguous())


def test_pack_thd_of_slices_equals_pack_thd_of_copies(gen):
    tables = [_wide(gen, T)[:, :, 1:3] for T in (7, 33, 2)]
    got = syr.pack_thd(tables, tp_size=2, cp_size=2, num_experts=8)
    want = syr.pack_thd([t.contiguous() for t in tables], tp_size=2, cp_size=2, num_experts=8)
    assert torch.equal(got[0], want[0])
    assert got[1] == want[1] and got[2] == want[2]


def test_table_functions_of_slices_equal_those_of_copies(gen):
    a = _wide(gen, 50)[:, :, 1:3]
    b = _wide(gen, 50)[:, :, 1:3]
    ca, cb = a.contiguous(), b.contiguous()
    assert syr.drift(a, b, num_experts=8) == syr.drift(ca, cb, num_experts=8)
    assert syr.drift([a], [b], num_experts=8) == syr.drift([ca], [cb], num_experts=8)
    la, lb = syr.expert_load([a, b], num_experts=8), syr.expert_load([ca, cb], num_experts=8)
    assert torch.equal(la[0], lb[0]) and la[1:] == lb[1:]
    assert torch.equal(syr.slice_layers(a, 1, 3, num_experts=8),
                       syr.slice_layers(ca, 1, 3, num_experts=8))
    assert torch.equal(syr.concat_tokens([a, b], num_experts=8),
                       syr.concat_tokens([ca, cb], num_experts=8))
    assert torch.equal(syr.concat_layers([a, b], num_experts=8),
                       syr.concat_layers([ca, cb], num_experts=8))
    assert torch.equal(syr.sp_split(a, 2, 1, num_experts=8), syr.sp_split(ca, 2, 1, num_experts=8))
    assert torch.equal(syr.sp_gather([a, b], num_experts=8),
                       syr.sp_gather([ca, cb], num_experts=8))
    packed, cu, cu_pad = syr.pack_thd([ca], tp_size=1, cp_size=2, num_experts=8)
    wide_packed = torch.cat([packed, packed], dim=2)[:, :, 1:3]  # non-contiguous, same ids shape
    ref = torch.cat([packed, packed], dim=2)[:, :, 1:3].contiguous()
    for r in range(2):
        assert torch.equal(syr.cp_zigzag_split(wide_packed, cu_pad, 2, r, num_experts=8),
                           syr.cp_zigzag_split(ref, cu_pad, 2, r, num_experts=8))
    assert [torch.equal(x, y) for x, y in zip(
        syr.unpack_thd(wide_packed, cu, cu_pad, num_experts=8),
        syr.unpack_thd(ref, cu, cu_pad, num_experts=8))] == [True]


# ---- route files: atomic commit, abort on exception, one writer per path ------------------------
def _bytes(p):
    with open(p, "rb") as f:
        return f.read()


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_exception_inside_route_writer_keeps_the_previous_file(tmp_path, exc):
    path = tmp_path / "r.syr"
    old = torch.full((3, 1, 2), 1, dtype=torch.int32)
    syr.write(path, [old], num_experts=8)
    before = _bytes(path)
    with pytest.raises(exc):
        with syr.RouteWriter(path, num_experts=8, top_k=2, num_moe_layers=1) as w:
            w.append(torch.full((5, 1, 2), 2, dtype=torch.int32))
            assert _bytes(path) == before  # opening and appending never touch the path
            raise exc()
    assert _bytes(path) == before
    part = syr.RouteFile(syr.RouteWriter.partial_path(path))
    assert not part.complete and len(part) == 1  # kept for recovery, marked incomplete
    assert torch.equal(part[0], torch.full((5, 1, 2), 2, dtype=torch.int32))


def test_failed_write_leaves_nothing_behind(tmp_path):
    path = tmp_path / "r.syr"
    with pytest.raises(ValueError):
        syr.write(path, [torch.zeros(2, 1, 2, dtype=torch.int32),
                         torch.full((2, 1, 2), 9, dtype=torch.int32)], num_experts=4)
    assert not path.exists()
    assert not os.path.exists(syr.RouteWriter.partial_path(path))


def test_second_route_writer_on_one_path_is_a_clear_error(tmp_path):
    path = tmp_path / "r.syr"
    with syr.RouteWriter(path, num_experts=8, top_k=2, num_moe_layers=1) as w:
        w.append(torch.zeros(2, 1, 2, dtype=torch.int32))
        with pytest.raises(sy.BackendError, match="is being written by another RouteFileWriter"):
            syr.RouteWriter(path, num_experts=8, top_k=2, num_moe_layers=1)
        w.append(torch.ones(3, 1, 2, dtype=torch.int32))
    f = syr.RouteFile(path)
    assert f.complete and [t.shape[0] for t in f] == [2, 3]


# ---- replay: a forward that fails validation consumes nothing -----------------------------------
def test_failed_replay_forward_keeps_the_queue(gen):
    E, K, H = 8, 2, 16
    router = syt.TopKRouter(H, sy.RouterConfig(num_experts=E, top_k=K))
    replay = sy.RouterReplay(top_k=K, layer=0)
    mb0 = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    mb1 = torch.tensor([[7, 6], [5, 4]], dtype=torch.int32)
    replay.record(mb0)
    replay.record(mb1)
    replay.action = "replay_forward"
    # The forwards of a reentrant checkpoint (no_grad, an input that requires grad): each queues
    # its ids for the recompute once it succeeded.
    with pytest.raises(ValueError), torch.no_grad():  # 5 tokens for a 3-row table
        router(torch.randn(5, H, generator=gen).requires_grad_(), replay=replay)
    assert (replay.num_recorded, replay.num_pending_recompute) == (2, 0)
    with torch.no_grad():
        _, ids = router(torch.randn(3, H, generator=gen).requires_grad_(), replay=replay)
    assert torch.equal(ids.to(torch.int32), mb0)  # the retry replays micro-batch 0, not 1
    assert (replay.num_recorded, replay.num_pending_recompute) == (1, 1)
    replay.action = "recompute"
    with pytest.raises(ValueError):
        router(torch.randn(4, H, generator=gen), replay=replay)
    assert replay.num_pending_recompute == 1
    _, ids = router(torch.randn(3, H, generator=gen), replay=replay)
    assert torch.equal(ids.to(torch.int32), mb0)
    # R3 target with an id outside [0, E): rejected, still queued, nothing pending.
    replay.action = "replay_forward"
    replay.clear()
    replay.set_target(torch.tensor([[0, 9], [1, 2]]))
    with pytest.raises(ValueError, match="outside"):
        router(torch.randn(2, H, generator=gen), replay=replay)
    assert (replay.num_targets, replay.num_pending_recompute) == (1, 0)


# ---- silent wrong results and crashes ------------------------------------------------------------
@pytest.mark.parametrize("cf", [0, 0.0, -1.0, float("nan"), float("inf")])
def test_dispatcher_rejects_capacity_factor_that_is_not_positive(cf):
    with pytest.raises(ValueError, match="capacity_factor must be None"):
        syt.AlltoAllDispatcher(num_experts=4, capacity_factor=cf)


def test_dispatch_and_combine_reject_non_finite_values(gen):
    d = syt.AlltoAllDispatcher(num_experts=4)
    idx = torch.tensor([[0, 1], [2, 3]])
    p = torch.rand(2, 2, generator=gen)
    x = torch.randn(2, 8, generator=gen)
    bad_x = x.clone()
    bad_x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="x has a non-finite value nan at token 1, hidden 3"):
        d.dispatch(bad_x, p, idx)
    bad_p = p.clone()
    bad_p[0, 1] = float("inf")
    with pytest.raises(ValueError, match="topk_weights has a non-finite value inf at token 0"):
        d.dispatch(x, bad_p, idx)
    rx, _, h = d.dispatch(x, p, idx)
    rx = rx.clone()
    rx[2, 0] = float("-inf")
    with pytest.raises(ValueError, match="expert_y has a non-finite value -inf at row 2"):
        d.combine(rx, h)


def test_set_num_threads_is_bounded():
    before = sy.num_threads()
    with pytest.raises(ValueError, match="n must be <= "):
        sy.set_num_threads(100000)
    assert sy.num_threads() == before


def test_import_never_stores_a_row_that_repeats_an_id(tmp_path):
    np = pytest.importorskip("numpy")
    np.save(tmp_path / "d.npy", np.array([[[1, 2]], [[3, 3]]], dtype=np.int32))
    with pytest.raises(ValueError, match=r"row \[3, 3\] at token 1, hidden layer 0 repeats"):
        syr.import_vllm([tmp_path / "d.npy"], num_experts=8)
    tables, rep = syr.import_vllm([tmp_path / "d.npy"], num_experts=8, invalid_rows="native")
    assert rep["num_invalid_rows"] == 1
    assert tables[0][1].tolist() == [[-1, -1]]


def test_threads_sharing_one_dispatcher_get_right_answers_or_a_clear_error(gen):
    # Two threads hammer one dispatcher (one communicator, one workspace). Every call either
    # returns the right combine output or raises the documented RuntimeError; never a wrong y.
    import threading
    d = syt.AlltoAllDispatcher(num_experts=8)
    xs = [torch.randn(256, 512, generator=gen) for _ in range(2)]
    idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(256)])
    w = torch.rand(256, 2, generator=gen)
    want = [x * w.sum(1, keepdim=True) for x in xs]
    wrong, errors = [], []

    def work(i):
        for _ in range(60):
            try:
                rx, _, h = d.dispatch(xs[i], w, idx)
                y = d.combine(rx, h)
            except RuntimeError as e:
                assert "is in use by another thread" in str(e), e
                errors.append(e)
                continue
            if not torch.allclose(y, want[i], rtol=1e-5, atol=1e-5):
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, f"{len(wrong)} wrong combine outputs ({len(errors)} clear errors)"
