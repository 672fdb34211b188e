"""Hostile use of the route toolkit from Python (issue 22): one RouteWriter shared by threads, paths
with an embedded NUL byte, and int64 ids past int32 given to the entry points that narrowed them
unchecked. Every test here failed on the branch point 179bd1c."""
import collections
import os
import threading

import pytest
import torch

import switchyard as sy
import switchyard.routes as syr

E, L, K = 64, 4, 2


def _tables(gen, n, max_tokens=600):
    """n distinct tables of valid top-2 rows (table s carries s in its first token's rows)."""
    out = []
    for s in range(n):
        T = 2 + int(torch.randint(0, max_tokens, (1,), generator=gen))
        first = torch.randint(0, E, (T, L), generator=gen)
        second = (first + 1 + torch.randint(0, E - 1, (T, L), generator=gen)) % E
        t = torch.stack([first, second], dim=2).to(torch.int32)
        t[0, 0] = torch.tensor([s % E, (s + 1) % E])
        t[0, 1] = torch.tensor([s // E, s // E + 1])
        out.append(t)
    return out


def _key(t):
    return (tuple(t.shape), t.contiguous().numpy().tobytes())


# ---- one writer, several threads -----------------------------------------------------------------
@pytest.mark.hostile(tried="one RouteWriter shared by 4 threads appending at once",
                     gets="appends serialised: every table stored exactly once, the file verifies")
def test_route_writer_shared_by_threads_stores_every_table_once(tmp_path, gen):
    tables = _tables(gen, 96)
    want = collections.Counter(_key(t) for t in tables)
    for rep in range(8):  # a race shows in some rounds only
        path = tmp_path / f"shared{rep}.syr"
        w = syr.RouteWriter(path, E, K, L, compression_level=3)
        errors = []
        start = threading.Barrier(4)

        def worker(mine):
            start.wait()
            try:
                for t in mine:
                    w.append(t)
            except BaseException as e:  # noqa: BLE001 -- reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(tables[i::4],)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert w.num_sequences == len(tables)
        w.close()
        check = syr.verify(path)
        assert check["ok"], check["problems"]
        assert check["num_sequences"] == len(tables)
        assert collections.Counter(_key(t) for t in syr.read(path)) == want, f"round {rep}"


@pytest.mark.hostile(tried="close() from one thread while another keeps appending",
                     gets="the file verifies and holds exactly the appends that returned; later "
                          "appends raise ValueError (writer closed)")
@pytest.mark.parametrize("stop", ["close", "abort"])
def test_route_writer_closed_while_another_thread_appends(tmp_path, gen, stop):
    tables = _tables(gen, 64, max_tokens=300)
    path = tmp_path / "raced.syr"
    w = syr.RouteWriter(path, E, K, L, compression_level=3)
    done, failure = [], []
    started = threading.Event()

    def appender():
        for t in tables * 50:
            try:
                w.append(t)
            except ValueError as e:
                failure.append(str(e))
                return
            done.append(t)
            started.set()

    th = threading.Thread(target=appender)
    th.start()
    started.wait()
    getattr(w, stop)()
    th.join()
    assert failure and "is closed" in failure[0], failure
    stored = path if stop == "close" else syr.RouteWriter.partial_path(path)
    f = syr.RouteFile(stored)
    assert f.complete == (stop == "close"), f.status
    if stop == "close":
        assert syr.verify(path)["ok"]
    assert [_key(t) for t in f] == [_key(t) for t in done]


# ---- NUL bytes and empty paths -------------------------------------------------------------------
def _path_calls(p):
    t = torch.zeros(3, L, K, dtype=torch.int32)
    t[:, :, 1] = 1
    return {
        "write": lambda: syr.write(p, [t], num_experts=E),
        "RouteWriter": lambda: syr.RouteWriter(p, E, K, L),
        "RouteFile": lambda: syr.RouteFile(p),
        "read": lambda: syr.read(p),
        "verify": lambda: syr.verify(p),
        "import_vllm": lambda: syr.import_vllm([p], num_experts=E),
        "import_sglang": lambda: syr.import_sglang([p], num_experts=E, num_input_layers=L,
                                                  top_k=K),
    }


@pytest.mark.hostile(tried="a path with an embedded NUL ('dir/model\\x00.syr') to write, read, "
                           "RouteWriter, RouteFile, verify, import_*",
                     gets="ValueError naming the path and the NUL; the file 'dir/model' it used to "
                          "overwrite or read is untouched")
def test_a_path_with_a_nul_byte_is_refused_and_touches_no_other_file(tmp_path):
    victim = tmp_path / "model"
    victim.write_bytes(b"an unrelated file that must survive\n")
    for name, call in _path_calls(str(victim) + "\x00.syr").items():
        with pytest.raises(ValueError, match="embedded null byte"):
            call()
        assert victim.read_bytes() == b"an unrelated file that must survive\n", name
    assert sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.hostile(tried="an empty path to write, read, RouteWriter, RouteFile, verify, "
                           "import_*", gets="ValueError: path must not be empty")
def test_an_empty_path_is_refused_by_every_entry_point():
    for name, call in _path_calls("").items():
        with pytest.raises(ValueError, match="path must not be empty"):
            call()


# ---- int64 ids past int32 ------------------------------------------------------------------------
BIG = [2**32 + 5, 2**32 - 1, 2**31, -2**31 - 1]  # int32 casts: 5, -1, -2^31, 2^31 - 1


def _verl_batch():
    ids = torch.zeros(2, 5, 3, K, dtype=torch.int64)  # [batch, seq, hidden layers, K]
    ids[..., 0], ids[..., 1] = 1, 2
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[1, :2] = 0
    return ids, mask


@pytest.mark.hostile(tried="routes.from_verl / routes.drop_padding with int64 ids 2^32+5, 2^32-1",
                     gets="ValueError naming the value and where it is (used to be read as "
                          "expert 5, or -1)")
@pytest.mark.parametrize("big", BIG)
def test_from_verl_and_drop_padding_name_an_id_outside_int32(big):
    ids, mask = _verl_batch()
    ids[0, 3, 1, 0] = big
    with pytest.raises(ValueError, match=rf"\[routes.from_verl\] routed_experts holds {big} at "
                                         r"\[0, 3, 1, 0\], outside int32"):
        syr.from_verl(ids, mask, num_experts=8)
    with pytest.raises(ValueError, match=rf"\[routes.drop_padding\] topk_idx holds {big} at "
                                         r"\[0, 3, 1, 0\], outside int32"):
        syr.drop_padding(ids, mask, num_experts=8)
    # In range, int64 and int16 (verl's dtype) give what int32 gives.
    ids[0, 3, 1, 0] = 3
    want, _ = syr.from_verl(ids.to(torch.int32), mask, num_experts=8)
    for dt in (torch.int64, torch.int16):
        got, _ = syr.from_verl(ids.to(dt), mask, num_experts=8)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.hostile(tried="hf Patch.targets_from_tables with an int64 id 2^32+5 or 2^32-1",
                     gets="ValueError naming the table, value and position (used to replay "
                          "expert 5, or route natively)")
@pytest.mark.parametrize("big", BIG[:2])
def test_hf_targets_from_tables_names_an_id_outside_int32(big):
    pytest.importorskip("transformers")
    import switchyard.integrations.hf as syhf
    from hf_models import build
    p = syhf.patch(build("qwen3_moe"))
    try:
        good = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dtype=torch.int64)
        bad = good.clone()
        bad[1, 0, 1] = big
        with pytest.raises(ValueError, match=rf"\[hf.targets_from_tables\] tables\[1\] holds "
                                             rf"{big} at \[1, 0, 1\], outside int32"):
            p.targets_from_tables([good, bad])
        assert torch.equal(p.targets_from_tables([good, good]),
                           torch.stack([good, good]).to(torch.int32))
    finally:
        p.unpatch()


@pytest.mark.hostile(tried="megatron.set_replay_targets with an int64 id 2^32+5 or 2^32-1",
                     gets="ValueError naming the layer, value and position (used to replay "
                          "expert 5, or route natively)")
@pytest.mark.parametrize("big", BIG[:2])
def test_megatron_set_replay_targets_names_an_id_outside_int32(big):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core.transformer.moe.router import TopKRouter
    import switchyard.integrations.megatron as sym

    # A TopKRouter shell with the attributes the replay reads, its state as attach_replay makes it
    # (attach_replay itself needs apply(), which patches Megatron for a whole process).
    r = TopKRouter.__new__(TopKRouter)
    torch.nn.Module.__init__(r)
    r.config = type("Cfg", (), {"num_moe_experts": 8, "moe_router_topk": 2})()
    r.layer_number = 3
    rep = sy.RouterReplay(top_k=2, layer=3, num_experts=8)
    from switchyard.integrations.megatron.replay import _RouterState
    r._sy = _RouterState(3, r, rep, "used", 64)
    r._sy.driver = sy.replay.ReplayDriver({3: rep})
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int64)
    sym.set_replay_targets(r, {3: ids})
    assert torch.equal(rep.pop_next_target().ids, ids.to(torch.int32))
    ids[2, 1] = big
    with pytest.raises(ValueError, match=rf"\[replay\] layer 3, replay ids "
                                         rf"holds {big} at \[2, 1\], outside int32"):
        sym.set_replay_targets(r, {3: ids})
    assert rep.num_targets == 0


# ---- negative stage sizes ------------------------------------------------------------------------
@pytest.mark.hostile(tried="routes.pp_moe_layer_range(first_stage_layers=-1), or "
                           "last_stage_layers=-2",
                     gets="ValueError naming both sizes (a negative size alone was read as an even "
                          "split)")
@pytest.mark.parametrize("first,last", [(-1, 0), (0, -2), (-1, -1), (2, -1)])
def test_pp_moe_layer_range_refuses_a_negative_stage_size(first, last):
    with pytest.raises(ValueError, match=rf"\[pp_moe_layer_range\] first_stage_layers and "
                                         rf"last_stage_layers must be >= 0 \(0 = even split\), "
                                         rf"got {first} and {last}"):
        syr.pp_moe_layer_range([1, 2, 3], 4, pp_size=2, pp_rank=1, first_stage_layers=first,
                               last_stage_layers=last)
