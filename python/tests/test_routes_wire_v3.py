"""Formats version 3 and 4 of route files and the wire format: set-coded blocks (flag 8, version 3;
flag 16, version 4, what the writer now writes: a match-mask symbol per row, the unmatched ids as a
set of ranks plus their slot order, rANS-coded, stored without zstd). decode(encode(x)) == x for any table, slot order included; a set-coded payload with
valid checksums but damaged bytes is a DataError or some in-range table; a version 2 file may not
carry set-coded blocks."""
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import switchyard as sy
import switchyard.routes as routes
from helpers import route_message as _message

xxhash = pytest.importorskip("xxhash")

SET = 8 | 16  # version 3 or version 4 set coding


def _zipf_rows(g, T, M, K, E, none_rows=0.0, none_ids=0.0, dup_rows=0.0):
    """[T, M, K] Zipf-like ids, uncorrelated between tokens (so the writer picks set coding once the
    block is large enough), rows in shuffled slot order, with -1 rows, -1 entries and repeats."""
    p = 1.0 / np.arange(1, E + 1) ** 1.1
    p /= p.sum()
    t = np.empty((T, M, K), np.int32)
    for m in range(M):
        perm = g.permutation(E)
        for i in range(T):
            t[i, m] = perm[g.choice(E, size=K, replace=K > E, p=p)]
    if dup_rows and K > 1:
        d = g.random((T, M)) < dup_rows
        t[d, K - 1] = t[d, 0]
    t[g.random((T, M, K)) < none_ids] = -1
    t[g.random((T, M)) < none_rows] = -1
    return t


def _blocks(blob):
    """(offset, flags, tokens, raw_size, comp) of every block of a message."""
    b = blob.numpy().tobytes() if isinstance(blob, torch.Tensor) else blob
    ix = struct.unpack_from("<Q", b, len(b) - 24)[0]
    n = struct.unpack_from("<Q", b, ix + 8)[0]
    out = []
    for i in range(n):
        off = struct.unpack_from("<Q", b, ix + 16 + 24 * i)[0]
        _, flags, _, tokens, raw_size, comp, _ = struct.unpack_from("<IIQQQQQ", b, off)
        out.append((off, flags, tokens, raw_size, b[off + 56:off + 56 + comp]))
    return out


def _header(blob, version=None):
    b = blob.numpy().tobytes()
    h = bytearray(b[:struct.unpack_from("<I", b, 12)[0]])
    if version is not None:
        struct.pack_into("<I", h, 8, version)
        struct.pack_into("<Q", h, len(h) - 8, xxhash.xxh3_64_intdigest(bytes(h[:-8])))
    return bytes(h)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), lengths=st.lists(st.integers(0, 300), max_size=3),
       M=st.integers(1, 3), K=st.sampled_from([1, 2, 3, 8, 9, 16, 17]),
       E=st.sampled_from([1, 2, 8, 64, 300, 4096, 5000, 70000]),
       none_rows=st.sampled_from([0.0, 0.2, 1.0]), none_ids=st.sampled_from([0.0, 0.05]),
       dup_rows=st.sampled_from([0.0, 0.2]))
def test_set_coded_round_trip_for_any_table(seed, lengths, M, K, E, none_rows, none_ids, dup_rows):
    K = min(K, E) if dup_rows == 0.0 else K
    g = np.random.default_rng(seed)
    tables = [_zipf_rows(g, n, M, K, E, none_rows, none_ids, dup_rows) for n in lengths]
    blob = routes.encode([torch.from_numpy(t) for t in tables], E, top_k=K, num_moe_layers=M)
    out, meta = routes.decode(blob)
    assert meta["version"] == 4
    assert len(out) == len(tables)
    for a, b in zip(out, tables):
        assert np.array_equal(a.numpy(), b), f"seed {seed}"


def test_uncorrelated_large_blocks_are_set_coded_and_smaller_than_token_delta_would_be():
    g = np.random.default_rng(0)
    t = _zipf_rows(g, 2000, 4, 8, 128)
    blob = routes.encode([torch.from_numpy(t)], 128)
    (_, flags, _, raw_size, comp), = _blocks(blob)
    assert flags & SET and raw_size == len(comp)
    out, _ = routes.decode(blob)
    assert np.array_equal(out[0].numpy(), t)
    # Correlated tokens (every id repeats the previous token's) stay token-delta blocks.
    c = np.repeat(t[:1], 2000, axis=0)
    (_, flags2, _, _, _), = _blocks(routes.encode([torch.from_numpy(c)], 128))
    assert not flags2 & SET


def _set_message():
    g = np.random.default_rng(1)
    t = _zipf_rows(g, 300, 2, 8, 32, none_rows=0.05, dup_rows=0.05)
    blob = routes.encode([torch.from_numpy(t)], 32)
    (_, flags, tokens, raw_size, comp), = _blocks(blob)
    assert flags & SET
    return blob, t, flags, tokens, comp


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flips=st.lists(st.integers(0, 10**6), min_size=1, max_size=4), cut=st.integers(-3, 3))
def test_any_mutated_set_payload_decodes_or_is_a_data_error(flips, cut):
    blob, t, flags, tokens, comp = _set_message()
    b = bytearray(comp)
    for f in flips:
        b[f % len(b)] ^= 1 << (f % 8)
    b = bytes(b[:len(b) + cut]) if cut < 0 else bytes(b) + bytes(cut)
    msg = _message(_header(blob), [(flags, tokens, len(b), b)])
    try:
        out, _ = routes.decode(msg)
    except sy.DataError as e:
        assert "block 0" in str(e)
    else:
        assert out[0].shape == t.shape and int(out[0].min()) >= -1 and int(out[0].max()) < 32


def test_set_coded_payload_errors_name_the_problem():
    blob, t, flags, tokens, comp = _set_message()
    # stored size must equal the payload size
    with pytest.raises(sy.DataError, match="set-coded payload of .* stored in"):
        routes.decode(_message(_header(blob), [(flags, tokens, len(comp) + 1, comp)]))
    bad = bytes([11]) + comp[1:]
    with pytest.raises(sy.DataError, match="scale 11 bits"):
        routes.decode(_message(_header(blob), [(flags, tokens, len(bad), bad)]))
    # a version 2 file may not carry set-coded blocks
    with pytest.raises(sy.DataError, match=f"unknown block flags {flags} for format version 2"):
        routes.decode(_message(_header(blob, 2), [(flags, tokens, len(comp), comp)]))
    # intact: the table
    out, meta = routes.decode(_message(_header(blob), [(flags, tokens, len(comp), comp)]))
    assert meta["version"] == 4 and np.array_equal(out[0].numpy(), t)
