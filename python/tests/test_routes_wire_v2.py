"""Format version 2 of route files and the wire format (routes.encode / decode): token-delta blocks
(a match bitmap + the unmatched ids as literals, several zstd frames per block). Checked against a
reference encoder written here from the spec in src/routes/route_codec.h, with hand-built zstd frames
(raw blocks) and XXH3 checksums, so crafted payloads with valid checksums reach the decoder's own
structure checks; and version 1 messages written by the previous build (a committed fixture) still
decode, in memory and as files."""
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import switchyard as sy
import switchyard.routes as routes
from helpers import route_message as _message

xxhash = pytest.importorskip("xxhash")

FIXTURE = Path(__file__).parent / "data" / "routes_wire_v1.npz"
HAS_NONE, RANKED, DELTA = 1, 2, 4


def _width(E):
    return 1 if E <= 256 else (2 if E <= 65536 else 4)


def _correlated(g, T, M, K, E, repeat, none_share):
    """[T, M, K] ids where each (layer, slot) repeats the previous token's id with p `repeat`."""
    t = g.integers(0, E, size=(T, M, K)).astype(np.int32)
    for i in range(1, T):
        same = g.random((M, K)) < repeat
        t[i][same] = t[i - 1][same]
    t[g.random((T, M)) < none_share] = -1
    return t


def _bits(flags_bool):
    return np.packbits(np.asarray(flags_bool, dtype=np.uint8), bitorder="little").tobytes()


def _payload(t, E, perm=None):
    """Reference version 2 payload of one table: (flags, raw bytes). `perm` [M, E] (rank -> id) makes
    it a ranked block (any permutation is valid), else ids are stored as they are."""
    T, M, K = t.shape
    w = {1: np.uint8, 2: np.uint16, 4: np.uint32}[_width(E)]
    flat = t.reshape(-1)
    prev = np.concatenate([np.full(M * K, -2, np.int64), flat[:-M * K]]) if T else flat
    match = flat == prev
    stored = flat.reshape(T, M, K).astype(np.int64)
    stored[stored < 0] = -1
    if perm is not None:
        rank = np.empty_like(perm)
        for m in range(M):
            rank[m, perm[m]] = np.arange(E)
        val = np.where(stored >= 0, rank[np.arange(M)[None, :, None], np.maximum(stored, 0)], 0)
    else:
        val = np.maximum(stored, 0)
    lits = val.reshape(-1)[~match].astype(w)
    raw = (perm.astype(w).tobytes() if perm is not None else b"") + _bits(match) + lits.tobytes()
    flags = DELTA | (RANKED if perm is not None else 0)
    if (flat < 0).any():
        raw += _bits(flat < 0)
        flags |= HAS_NONE
    return flags, raw


def _zstd_raw_frames(raw, pieces=1):
    """`raw` as `pieces` zstd frames of raw (stored) blocks, each declaring its content size."""
    cuts = np.linspace(0, len(raw), pieces + 1).astype(int)
    out = b""
    for a, b in zip(cuts[:-1], cuts[1:]):
        data = raw[a:b]
        out += struct.pack("<IB", 0xFD2FB528, 0b11100000) + struct.pack("<Q", len(data))
        chunks = [data[i:i + (1 << 17)] for i in range(0, len(data), 1 << 17)] or [b""]
        for i, c in enumerate(chunks):
            h = (len(c) << 3) | int(i == len(chunks) - 1)  # raw block, last flag
            out += struct.pack("<I", h)[:3] + c
    return out


def _header(E, M, K, version=2):
    """The encoder's header, relabelled as a file of `version` (the writer writes version 4)."""
    blob = routes.encode([], E, top_k=K, num_moe_layers=M).numpy().tobytes()
    h = bytearray(blob[:struct.unpack_from("<I", blob, 12)[0]])
    struct.pack_into("<I", h, 8, version)
    struct.pack_into("<Q", h, len(h) - 8, xxhash.xxh3_64_intdigest(bytes(h[:-8])))
    return bytes(h)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), lengths=st.lists(st.integers(0, 40), max_size=4),
       M=st.integers(1, 5), K=st.integers(1, 9),
       E=st.sampled_from([1, 2, 8, 128, 255, 256, 257, 70000]),
       repeat=st.sampled_from([0.0, 0.5, 0.95, 1.0]), none_share=st.sampled_from([0.0, 0.2, 1.0]),
       level=st.sampled_from([1, 3]))
def test_token_delta_round_trip_for_any_shape_and_correlation(seed, lengths, M, K, E, repeat,
                                                             none_share, level):
    # Covers both kernels (one-byte ids with whole bytes of match bits per token, and the rest),
    # every id width, all-match and no-match tokens, and -1 entries inside repeated runs.
    K = min(K, E)
    g = np.random.default_rng(seed)
    tables = [torch.from_numpy(_correlated(g, n, M, K, E, repeat, none_share)) for n in lengths]
    blob = routes.encode(tables, E, compression_level=level, top_k=K, num_moe_layers=M)
    out, meta = routes.decode(blob)
    assert meta["version"] == 4  # the writer's version: token-delta or set-coded blocks
    assert len(out) == len(tables) and all(torch.equal(a, b) for a, b in zip(out, tables))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), T=st.integers(0, 30), M=st.integers(1, 4),
       K=st.sampled_from([1, 2, 3, 4, 8]), E=st.sampled_from([4, 128, 256, 300]),
       repeat=st.sampled_from([0.0, 0.6, 1.0]), ranked=st.booleans(),
       pieces=st.integers(1, 3))
def test_the_reference_encoding_of_the_spec_decodes_to_the_table(seed, T, M, K, E, repeat, ranked,
                                                                 pieces):
    # The spec (route_codec.h) is the format: a payload built from it, with any permutation and
    # split into any number of frames, decodes to its table.
    K = min(K, E)
    g = np.random.default_rng(seed)
    t = _correlated(g, T, M, K, E, repeat, 0.1)
    perm = np.stack([g.permutation(E) for _ in range(M)]) if ranked else None
    flags, raw = _payload(t, E, perm)
    msg = _message(_header(E, M, K), [(flags, T, len(raw), _zstd_raw_frames(raw, pieces))])
    out, meta = routes.decode(msg)
    assert meta["version"] == 2 and len(out) == 1 and np.array_equal(out[0].numpy(), t)


def _crafted(raw, flags, T, E, M, K):
    return _message(_header(E, M, K), [(flags, T, len(raw), _zstd_raw_frames(raw))])


@pytest.mark.hostile(tried="decode a checksummed message whose token-delta payload breaks the "
                           "spec (match bit on the first token, literal count, rank >= E, perm)",
                     gets="DataError naming the block and what is wrong; never a crash")
def test_crafted_token_delta_payloads_with_valid_checksums_are_data_errors():
    E, M, K, T = 8, 2, 4, 3
    g = np.random.default_rng(0)
    t = _correlated(g, T, M, K, E, 0.5, 0.0)
    t[1] = t[0]  # token 1 matches token 0 everywhere: 8 match bits, 8 fewer literals
    perm = np.stack([g.permutation(E) for _ in range(M)])
    flags, raw = _payload(t, E, perm)
    assert np.array_equal(routes.decode(_crafted(raw, flags, T, E, M, K))[0][0].numpy(), t)
    nb = (T * M * K + 7) // 8
    head = M * E
    cases = {
        # a match bit on the first token (nothing to copy from)
        "no previous token": raw[:head] + bytes([raw[head] | 1]) + raw[head + 1:],
        # a perm that repeats an expert
        "permutation is invalid": bytes([raw[1]]) + raw[1:],
        # a literal >= num_experts
        "num_experts": raw[:head + nb] + bytes([E]) + raw[head + nb + 1:],
        # one literal short / long for the match bits
        "literals for": raw[:-1],
        "unmatched": raw + bytes([0]),
    }
    for why, bad in cases.items():
        with pytest.raises(sy.DataError, match=r"\[route_file\] <wire>: block 0"):
            routes.decode(_crafted(bad, flags, T, E, M, K))
    # A version 1 file may not carry version 2 blocks.
    v1 = bytearray(_header(E, M, K))
    struct.pack_into("<I", v1, 8, 1)
    struct.pack_into("<Q", v1, len(v1) - 8, xxhash.xxh3_64_intdigest(bytes(v1[:-8])))
    msg = _message(bytes(v1), [(flags, T, len(raw), _zstd_raw_frames(raw))])
    with pytest.raises(sy.DataError, match="unknown block flags 6 for format version 1"):
        routes.decode(msg)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), flips=st.lists(st.integers(0, 10**6), min_size=1, max_size=4),
       cut=st.integers(-3, 3))
def test_any_mutated_token_delta_payload_decodes_or_is_a_data_error(seed, flips, cut):
    # Checksums valid, payload bytes flipped or its size off by a few: the decoder's own checks
    # (not the checksums) must stop it: a DataError or some valid table, never a crash.
    g = np.random.default_rng(seed)
    E, M, K, T = 128, 3, 8, 20
    t = _correlated(g, T, M, K, E, 0.7, 0.1)
    flags, raw = _payload(t, E, np.stack([g.permutation(E) for _ in range(M)]))
    b = bytearray(raw)
    for f in flips:
        b[f % len(b)] ^= 1 << (f % 8)
    b = bytes(b[:len(b) + cut]) if cut < 0 else bytes(b) + bytes(cut)
    try:
        out, _ = routes.decode(_crafted(b, flags, T, E, M, K))
    except sy.DataError as e:
        assert "block 0" in str(e)
    else:
        assert out[0].shape == (T, M, K) and int(out[0].min()) >= -1 and int(out[0].max()) < E


def _fixture():
    fx = np.load(FIXTURE)
    for name in ("e128", "e300"):
        keys = sorted((k for k in fx.files if k.startswith(name + "_t")),
                      key=lambda k: int(k.split("_t")[1]))
        yield name, fx[name + "_blob"], int(fx[name + "_E"]), [fx[k].astype(np.int32) for k in keys]


def test_version_1_messages_of_the_previous_build_still_decode(tmp_path):
    # The fixture was written by routes.encode before version 2 (ranked layer-major blocks, short
    # unranked ones, -1 entries, one- and two-byte ids): in memory, from bytes and as a file.
    for name, blob, E, tables in _fixture():
        out, meta = routes.decode(torch.from_numpy(blob))
        assert meta["version"] == 1 and meta["num_experts"] == E
        assert [o.numpy().tolist() for o in out] == [t.tolist() for t in tables]
        path = tmp_path / f"{name}.syr"
        path.write_bytes(blob.tobytes())
        assert [o.numpy().tolist() for o in routes.read(path)] == [t.tolist() for t in tables]
        assert routes.verify(path)["ok"]
        # Re-encoding writes version 4, and the same tables.
        again, meta2 = routes.decode(routes.encode([torch.from_numpy(t) for t in tables], E))
        assert meta2["version"] == 4 and all(np.array_equal(a.numpy(), b)
                                             for a, b in zip(again, tables))


def test_version_1_message_with_a_corrupt_byte_is_still_a_data_error():
    name, blob, E, tables = next(_fixture())
    for i in range(0, blob.size, 97):
        bad = blob.copy()
        bad[i] ^= 0x21
        with pytest.raises(sy.DataError, match=r"\[route_file\] <wire>"):
            routes.decode(torch.from_numpy(bad))


def test_encoding_is_the_same_for_any_thread_count_with_correlated_routes():
    g = np.random.default_rng(3)
    tables = [torch.from_numpy(_correlated(g, n, 48, 8, 128, 0.7, 0.01)) for n in (900, 40, 2000)]
    old = sy.num_threads()
    try:
        blobs = []
        for n in (1, 2):
            sy.set_num_threads(n)
            blobs.append(routes.encode(tables, 128))
        assert torch.equal(blobs[0], blobs[1])
        out, _ = routes.decode(blobs[1])
        assert all(torch.equal(a, b) for a, b in zip(out, tables))
    finally:
        sy.set_num_threads(old)
