"""The wire format of route data (switchyard.routes.encode / decode): a complete route file built in
memory, sent as one torch.uint8 tensor. Lossless, self-describing, checksummed; anything but an
intact message is a switchyard.DataError, never a crash or a wrong table."""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import switchyard as sy
import switchyard.routes as routes


def _tables(seed, lengths, M, K, E, none_share=0.1):
    g = np.random.default_rng(seed)
    out = []
    for n in lengths:
        t = g.integers(0, E, size=(n, M, K)).astype(np.int32)
        t[g.random((n, M)) < none_share] = -1  # -1 rows (padding, the last token, dropped)
        out.append(torch.from_numpy(t))
    return out


def _equal(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), lengths=st.lists(st.integers(0, 60), max_size=5),
       M=st.integers(1, 6), K=st.integers(1, 8),
       E=st.sampled_from([1, 2, 8, 64, 128, 256, 257, 4096, 70000]),
       none_share=st.sampled_from([0.0, 0.1, 1.0]), hidden_extra=st.integers(0, 3),
       level=st.sampled_from([1, 3]))
def test_decode_of_encode_is_the_batch_for_any_shape(seed, lengths, M, K, E, none_share,
                                                      hidden_extra, level):
    K = min(K, E)
    tables = _tables(seed, lengths, M, K, E, none_share)
    hidden = M + hidden_extra
    moe_layers = sorted(np.random.default_rng(seed).choice(hidden, M, replace=False).tolist())
    blob = routes.encode(tables, E, moe_layers=moe_layers, num_hidden_layers=hidden,
                         compression_level=level, top_k=K, num_moe_layers=M)
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    out, meta = routes.decode(blob)
    assert _equal(out, tables)
    assert meta["num_experts"] == E and meta["top_k"] == K and meta["num_moe_layers"] == M
    assert list(meta["moe_layers"]) == moe_layers and meta["num_hidden_layers"] == hidden
    assert list(meta["num_tokens"]) == list(lengths)
    assert meta["version"] >= 1


def test_wire_bytes_are_the_route_file_bytes(tmp_path):
    # One codec: the message is the file a RouteWriter writes for the same tables.
    tables = _tables(1, [5, 0, 17], 4, 2, 16)
    routes.write(tmp_path / "r.syr", tables, num_experts=16, moe_layers=[1, 2, 3, 5],
                 compression_level=3)
    blob = routes.encode(tables, 16, moe_layers=[1, 2, 3, 5], compression_level=3)
    assert bytes(blob.numpy()) == (tmp_path / "r.syr").read_bytes()
    assert _equal(routes.read(tmp_path / "r.syr"), routes.decode(blob)[0])
    assert _equal(list(routes.RouteFile.from_bytes(blob.numpy().tobytes())), tables)


def test_encoding_does_not_depend_on_the_thread_count():
    tables = _tables(2, [700, 300, 1200, 5], 8, 8, 128)
    old = sy.num_threads()
    try:
        sy.set_num_threads(1)
        one = routes.encode(tables, 128)
        sy.set_num_threads(2)
        two = routes.encode(tables, 128)
        assert torch.equal(one, two)
        assert _equal(routes.decode(two)[0], tables)
    finally:
        sy.set_num_threads(old)


def test_decode_takes_bytes_bytearray_and_memoryview():
    tables = _tables(3, [4, 9], 2, 2, 8)
    blob = routes.encode(tables, 8)
    raw = blob.numpy().tobytes()
    for data in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8)):
        assert _equal(routes.decode(data)[0], tables)


@pytest.mark.hostile(tried="decode a message with any one byte changed",
                     gets="DataError naming the corrupt header, block or index")
def test_every_corrupted_byte_is_a_data_error():
    tables = _tables(4, [6, 3], 3, 2, 8)
    blob = routes.encode(tables, 8, moe_layers=[0, 2, 3], num_hidden_layers=4)
    for i in range(blob.numel()):
        bad = blob.clone()
        bad[i] ^= 0x5A
        with pytest.raises(sy.DataError, match=r"\[route_file\] <wire>"):
            routes.decode(bad)


@pytest.mark.hostile(tried="decode a cut message, or one with bytes appended",
                     gets="DataError naming what is missing; never a partial batch")
def test_every_truncation_and_trailing_bytes_are_data_errors():
    tables = _tables(5, [6, 3], 3, 2, 8)
    blob = routes.encode(tables, 8)
    for n in range(blob.numel()):
        with pytest.raises(sy.DataError, match=r"\[route_file\] <wire>"):
            routes.decode(blob[:n].clone())
    with pytest.raises(sy.DataError, match="incomplete message"):
        routes.decode(torch.cat([blob, torch.zeros(3, dtype=torch.uint8)]))


def test_encode_and_decode_reject_bad_arguments():
    with pytest.raises(ValueError, match=r"\[routes.encode\] tables\[1\] must have .*top_k=2"):
        routes.encode([torch.zeros(2, 3, 2, dtype=torch.int32),
                       torch.zeros(2, 3, 4, dtype=torch.int32)], 8)
    with pytest.raises(ValueError, match=r"\[routes.encode\] tables\[0\]: ids must be -1 or in "
                                         r"\[0, num_experts=8\), got 8"):
        routes.encode([torch.full((2, 1, 1), 8, dtype=torch.int32)], 8)
    with pytest.raises(ValueError, match="empty batch needs top_k"):
        routes.encode([], 8)
    with pytest.raises(ValueError, match=r"\[routes.decode\] data must have dtype uint8, got int32"):
        routes.decode(torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[routes.decode\] data must be a uint8 tensor or bytes"):
        routes.decode(12)
    assert routes.decode(routes.encode([], 8, top_k=2, num_moe_layers=3))[0] == []


# ---- transports ------------------------------------------------------------------------------------
_GLOO_BATCH = dict(seed=7, lengths=[300, 0, 41, 1200], M=6, K=8, E=128)


def _gloo_worker(rank, init_file, result_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if rank == 0:
            blob = routes.encode(_tables(**_GLOO_BATCH), 128, moe_layers=list(range(6)))
            size = torch.tensor([blob.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0)
        if rank != 0:
            blob = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(blob, src=0)
        if rank == 1:
            tables, meta = routes.decode(blob)
            ok = _equal(tables, _tables(**_GLOO_BATCH)) and list(meta["moe_layers"]) == list(range(6))
            with open(os.path.join(result_dir, "rank1"), "w") as f:
                f.write("ok" if ok else "mismatch")
    finally:
        dist.destroy_process_group()


def test_gloo_broadcast_of_the_tensor_between_two_processes(tmp_path):
    mp.spawn(_gloo_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "rank1").read_text() == "ok"


def test_ray_put_and_get_of_the_tensor():
    ray = pytest.importorskip("ray")
    tables = _tables(8, [50, 7], 4, 8, 128)
    blob = routes.encode(tables, 128)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        got = ray.get(ray.put(blob))
    finally:
        ray.shutdown()
    assert _equal(routes.decode(got)[0], tables)
