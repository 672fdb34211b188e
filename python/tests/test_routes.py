"""sy.routes from Python: file round trip and corruption, vLLM / SGLang import, alignment (THD
packing, context- and sequence-parallel splits, layer slices) and statistics, each against a
pure-PyTorch reading of the same rules."""
import base64
import json
import math

import numpy as np
import pytest
import torch

import switchyard as sy


def _table(gen, T, L, K, E, none_rows=()):
    if T == 0:
        return torch.zeros(0, L, K, dtype=torch.int64)
    t = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T * L)]).view(T, L, K)
    for r in none_rows:
        t[r] = -1
    return t


def test_file_round_trip(gen, tmp_path):
    E, K, L = 64, 4, 3
    tables = [_table(gen, T, L, K, E, none_rows=[T - 1] if T else []) for T in (5, 1, 0, 33)]
    path = tmp_path / "r.syr"
    n = sy.routes.write(path, tables, num_experts=E, moe_layers=[1, 2, 3])
    assert n == path.stat().st_size
    back = sy.routes.read(path)
    assert len(back) == 4 and all(b.dtype == torch.int32 for b in back)
    for a, b in zip(tables, back):
        assert torch.equal(a, b.long())
    f = sy.routes.RouteFile(path)
    assert f.complete and f.status == "ok"
    assert f.info["num_experts"] == E and f.info["moe_layers"] == [1, 2, 3]
    assert torch.equal(f[-1].long(), tables[-1])
    with pytest.raises(IndexError):
        f[4]
    assert sy.routes.verify(path)["ok"]


def test_file_corruption_and_recovery(gen, tmp_path):
    E, K, L = 16, 2, 2
    tables = [_table(gen, 20, L, K, E) for _ in range(3)]
    path = tmp_path / "r.syr"
    sy.routes.write(path, tables, num_experts=E)
    data = bytearray(path.read_bytes())
    # A flipped bit inside the last block's payload: that sequence is a DataError naming it.
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x10
    f = sy.routes.RouteFile.from_bytes(bytes(bad))
    with pytest.raises(sy.DataError):
        [f[i] for i in range(len(f))]
    assert issubclass(sy.DataError, RuntimeError)
    # A file cut mid-way (writer killed) opens in recovery with its complete sequences.
    cut = sy.routes.RouteFile.from_bytes(bytes(data[:len(data) - 40]))
    assert not cut.complete and cut.status != "ok"
    for i in range(len(cut)):
        assert torch.equal(cut[i].long(), tables[i])
    with pytest.raises(RuntimeError):
        sy.routes.RouteFile(tmp_path / "missing.syr")


def _vllm_ref(arr, moe_layers):
    """Reference import: keep MoE layers, append a -1 row for the last token."""
    t = torch.from_numpy(arr.astype(np.int64))[:, moe_layers, :]
    return torch.cat([t, torch.full((1, t.shape[1], t.shape[2]), -1, dtype=torch.int64)])


def test_import_vllm_and_sglang(gen, tmp_path):
    E, K, layers = 32, 4, 6  # first 2 dense (zeros there), 4 MoE
    seqs = []
    for i, T in enumerate((7, 12)):
        # Distinct ids per row (what a top-k produces; a repeated id is an invalid row).
        arr = torch.argsort(torch.rand(T - 1, layers, E, generator=gen), dim=-1)[..., :K]
        arr = arr.numpy().astype(np.int32)
        arr[:, :2, :] = 0
        np.save(tmp_path / f"s{i}.npy", arr)
        seqs.append(arr)
    tables, rep = sy.routes.import_vllm([tmp_path / "s0.npy", tmp_path / "s1.npy"], num_experts=E,
                                        first_k_dense=2)
    assert rep["moe_layers"] == [2, 3, 4, 5] and rep["num_sequences"] == 2
    for t, arr in zip(tables, seqs):
        assert torch.equal(t.long(), _vllm_ref(arr, [2, 3, 4, 5]))
    # SGLang: the same arrays as base64 of little-endian int32, in JSONL.
    lines = [json.dumps({"meta_info": {"routed_experts": base64.b64encode(
        a.astype("<i4").tobytes()).decode()}}) for a in seqs]
    tables2, _ = sy.routes.import_sglang_text("\n".join(lines), num_experts=E,
                                              num_input_layers=layers, top_k=K,
                                              moe_layer_freq="2x0,4x1")
    for a, b in zip(tables, tables2):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="routed_experts"):
        sy.routes.import_sglang_text('{"meta_info": {}}', num_experts=E, num_input_layers=layers,
                                     top_k=K)
    assert sy.routes.moe_layer_indices(6, first_k_dense=2) == [2, 3, 4, 5]


def test_import_vllm_arrays_in_memory_is_the_file_import(gen, tmp_path):
    E, K, layers = 200, 3, 5  # E > 127: uint8 ids (vLLM >= 0.22 narrows by expert count)
    arrs = [torch.randint(0, E, (T - 1, layers, K), generator=gen).to(torch.int32)
            for T in (4, 9)]
    for a in arrs:
        a[:, 0] = 0  # dense first layer
    for i, a in enumerate(arrs):
        np.save(tmp_path / f"a{i}.npy", a.numpy())
    ref, ref_rep = sy.routes.import_vllm([tmp_path / "a0.npy", tmp_path / "a1.npy"],
                                         num_experts=E, first_k_dense=1)
    for variant in (arrs, [a.to(torch.int64) for a in arrs], [a.to(torch.uint8) for a in arrs],
                    [a.to(torch.int16) for a in arrs], [a.numpy() for a in arrs]):
        got, rep = sy.routes.import_vllm_arrays(variant, num_experts=E, first_k_dense=1)
        assert rep["moe_layers"] == ref_rep["moe_layers"] == [1, 2, 3, 4]
        assert rep["sources"] == ["arrays[0]", "arrays[1]"]
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    with pytest.raises(ValueError, match=r"\[import\] arrays\[0\]: expected a 3-D array "
                                         r"\[seq_len-1, num_layers, top_k\], got 2 dimensions"):
        sy.routes.import_vllm_arrays([arrs[0][:, 0]], num_experts=E)
    with pytest.raises(ValueError, match=r"arrays\[1\] \(sequence 1\): expert id 200 at token 0"):
        bad = arrs[1].clone()
        bad[0, 2, 1] = E
        sy.routes.import_vllm_arrays([arrs[0], bad], num_experts=E)


def test_pack_and_context_parallel(gen):
    E, K, L = 8, 2, 2
    tables = [_table(gen, T, L, K, E) for T in (5, 9, 1)]
    tp, cp = 2, 2
    packed, cu, cu_pad = sy.routes.pack_thd(tables, tp_size=tp, cp_size=cp, num_experts=E)
    align = 2 * tp * cp
    # Reference: each sequence padded with -1 rows to a multiple of 2*tp*cp.
    ref_parts, ref_cu, ref_pad = [], [0], [0]
    for t in tables:
        p = math.ceil(t.shape[0] / align) * align
        ref_parts.append(torch.cat([t, torch.full((p - t.shape[0], L, K), -1, dtype=torch.int64)]))
        ref_cu.append(ref_cu[-1] + t.shape[0])
        ref_pad.append(ref_pad[-1] + p)
    assert torch.equal(packed.long(), torch.cat(ref_parts)) and cu == ref_cu and cu_pad == ref_pad
    for a, b in zip(sy.routes.unpack_thd(packed, cu, cu_pad, num_experts=E), tables):
        assert torch.equal(a.long(), b)
    # Zigzag: each sequence cut in 2*cp chunks, rank r keeps chunks r and 2*cp-1-r.
    pieces = []
    for r in range(cp):
        piece = sy.routes.cp_zigzag_split(packed, cu_pad, cp, r, num_experts=E)
        want = []
        for s in range(len(tables)):
            chunks = ref_parts[s].chunk(2 * cp)
            want += [chunks[r], chunks[2 * cp - 1 - r]]
        assert torch.equal(piece.long(), torch.cat(want))
        pieces.append(piece)
    assert torch.equal(sy.routes.cp_zigzag_gather(pieces, cu_pad, num_experts=E), packed)
    sp = [sy.routes.sp_split(packed, tp, r, num_experts=E) for r in range(tp)]
    assert torch.equal(sp[1].long(), packed.long()[packed.shape[0] // 2:])
    assert torch.equal(sy.routes.sp_gather(sp), packed)


def test_layers_padding_and_stats(gen):
    E, K, L, T = 8, 2, 4, 10
    t = _table(gen, T, L, K, E, none_rows=[9])
    assert torch.equal(sy.routes.slice_layers(t, 1, 3).long(), t[:, 1:3])
    assert torch.equal(sy.routes.concat_layers([t[:, :1], t[:, 1:]]).long(), t)
    ids = torch.stack([t, t])  # [batch 2, seq, L, K]
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, :3] = False  # left padded
    rows = sy.routes.drop_padding(ids, mask, num_experts=E)
    assert torch.equal(rows[0].long(), t) and torch.equal(rows[1].long(), t[3:])
    # Drift against a copy with some decisions changed, compared as sets per row.
    b = t.clone()
    b[0, 0] = torch.tensor([(int(t[0, 0, 0]) + 1) % E, int(t[0, 0, 1])]).roll(1)
    b[4, 2] = b[4, 2].flip(0)  # same set: not a difference
    d = sy.routes.drift(t, b, num_experts=E)
    ref_dec = ref_rows = 0
    ref_tok = set()
    for tok in range(T):
        for l in range(L):
            A, B = set(t[tok, l].tolist()) - {-1}, set(b[tok, l].tolist()) - {-1}
            if A and B:
                diff = len(A - B)
                ref_dec += diff
                ref_rows += diff > 0
                if diff:
                    ref_tok.add(tok)
    assert d["num_differing_decisions"] == ref_dec and d["num_differing_rows"] == ref_rows
    assert d["num_differing_tokens"] == len(ref_tok) and d["num_skipped_rows"] == L
    assert math.isclose(d["token_mismatch"], len(ref_tok) / (T - 1))
    counts, none_rows, imbalance = sy.routes.expert_load(t, num_experts=E)
    for l in range(L):
        v = t[:, l][t[:, l] >= 0]
        assert torch.equal(counts[l], torch.bincount(v, minlength=E))
    assert none_rows == [1] * L


def test_route_errors():
    with pytest.raises(ValueError, match="tables"):
        sy.routes.pack_thd([torch.zeros(3, 2, 2, dtype=torch.float32)])
    with pytest.raises(ValueError):
        sy.routes.write("/tmp/never.syr", [torch.full((2, 1, 2), 9)], num_experts=4)


def _row_mismatch_reference(ref, tables, mask):
    """The definition in torch (the TRL adapter's metric before the engine pass): rows whose
    reference slots are all >= 0, on kept tokens, compared as sorted rows."""
    ref = ref.long()
    valid = (ref >= 0).all(-1)
    if mask is not None:
        valid &= (torch.as_tensor(mask) != 0)[..., None]
    want = ref.sort(-1).values
    return int(valid.sum()), [int(((t.long().sort(-1).values != want).any(-1) & valid).sum())
                              for t in tables]


@pytest.mark.parametrize("seed", range(6))
def test_row_mismatch_counts_the_rows_whose_expert_multisets_differ(seed):
    # routes.row_mismatch against the definition in torch: reordered rows equal, repeated ids
    # compare as multisets, a reference row with any negative id is not compared, masked tokens
    # are not compared, ids outside int32 saturate (never equal a router's id), every id dtype.
    g = torch.Generator().manual_seed(seed)
    B, S, L, K, E = 3, 11, 4, [1, 2, 8][seed % 3], 16
    ref = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S * L)]).view(
        B, S, L, K)
    same = ref.clone()
    flip = torch.rand(B, S, L, generator=g) < 0.3
    same[flip] = same[flip].flip(-1)  # the same sets in another order
    other = same.clone()
    change = torch.rand(B, S, L, K, generator=g) < 0.1
    other[change] = torch.randint(0, E, (int(change.sum()),), generator=g)  # repeats possible
    ref = ref.long()
    ref[torch.rand(B, S, L, K, generator=g) < 0.05] = -1
    ref[0, 0, 0, 0] = -7
    ref[1, 2, 3, 0] = 2**40  # outside int32: compared, differs from every table
    mask = torch.rand(B, S, generator=g) < 0.8
    for dtype in (torch.int32, torch.uint8, torch.int16):
        tables = [same.to(dtype), other.to(dtype)]
        for m in (None, mask, mask.long()):
            got = sy.routes.row_mismatch(ref, tables, m)
            assert got == _row_mismatch_reference(ref, tables, m), (dtype, m)
    compared, differing = sy.routes.row_mismatch(ref.clamp(-1, 2**31 - 1).to(torch.int32), [ref],
                                           mask)
    assert differing == [0] and compared == _row_mismatch_reference(ref, [ref], mask)[0]
    assert sy.routes.row_mismatch(ref.view(-1, L, K), [same.view(-1, L, K)]) == \
        _row_mismatch_reference(ref, [same], None)


def test_row_mismatch_with_a_k_per_layer_compares_each_layers_own_slots():
    # HunYuan's per-layer moe_topk: tables as wide as the largest K hold -1 past a smaller
    # layer's own K; with top_ks those rows are compared over their own slots (without, a row
    # holding a -1 is not a route and is skipped).
    g = torch.Generator().manual_seed(9)
    T, L, K, E = 40, 3, 4, 12
    ks = [2, 4, 3]
    ref = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * L)]).view(T, L, K)
    tab = ref.clone()
    change = torch.rand(T, L, generator=g) < 0.3
    tab[change, 0] = (tab[change, 0] + 1) % E  # may collide with another slot: a repeat
    for m, k in enumerate(ks):
        ref[:, m, k:] = -1
        tab[:, m, k:] = -1
    got = sy.routes.row_mismatch(ref, [tab], top_ks=ks)
    compared, differing = 0, 0
    for m, k in enumerate(ks):
        c, (d,) = _row_mismatch_reference(ref[:, m:m + 1, :k], [tab[:, m:m + 1, :k]], None)
        compared, differing = compared + c, differing + d
    assert got == (compared, [differing]) and compared == T * L and differing > 0
    # without top_ks the layers with a smaller K are not compared
    assert sy.routes.row_mismatch(ref, [tab])[0] == T
    with pytest.raises(ValueError, match=r"\[row_mismatch\] top_ks\[0\] must be in \[1, K=4\], "
                                         r"got 0"):
        sy.routes.row_mismatch(ref, [tab], top_ks=[0, 4, 3])


def test_row_mismatch_refuses_shapes_and_dtypes_naming_the_argument():
    ref = torch.zeros(2, 3, 4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\[row_mismatch\] tables\[1\] must have the "
                                         r"reference's shape \[2, 3, 4, 2\], got \[6, 4, 2\]"):
        sy.routes.row_mismatch(ref, [ref, ref.view(6, 4, 2)])
    with pytest.raises(ValueError, match=r"\[row_mismatch\] token_mask must have the "
                                         r"reference's leading dimensions \[2, 3\], got \[6\]"):
        sy.routes.row_mismatch(ref, [ref], torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[row_mismatch\] tables\[0\] must have an integer "
                                         r"dtype"):
        sy.routes.row_mismatch(ref, [ref.float()])
    with pytest.raises(ValueError, match=r"\[row_mismatch\] reference must be \[\.\.\., L, K\]"):
        sy.routes.row_mismatch(torch.zeros(3, dtype=torch.int32), [])
    with pytest.raises(ValueError, match=r"\[row_mismatch\] tables must be a list"):
        sy.routes.row_mismatch(ref, ref)
