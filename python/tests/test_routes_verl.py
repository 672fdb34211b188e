"""The rollout data path: verl's routed_experts batch tensor and in-memory vLLM/SGLang arrays ->
per-layer replay targets (switchyard.routes.from_verl, import_vllm_arrays, layer_targets)."""
import numpy as np
import pytest
import torch

import switchyard.routes as routes

E, K, L = 8, 2, 4  # hidden layers 0..3; layer 0 dense (first_k_dense=1)


def _verl_batch(seed=3):
    """verl's layout: [batch, seq, num_hidden_layers, K] int16, left-padded, zero-filled."""
    g = torch.Generator().manual_seed(seed)
    B, S = 3, 7
    ids = torch.zeros(B, S, L, K, dtype=torch.int16)
    mask = torch.zeros(B, S, dtype=torch.int64)
    lengths = [5, 7, 3]
    for b, n in enumerate(lengths):
        mask[b, S - n:] = 1
        for s in range(S - n, S - 1):  # the last real token was never routed: zeros
            for layer in range(1, L):
                ids[b, s, layer] = torch.randperm(E, generator=g)[:K].to(torch.int16)
    return ids, mask, lengths


def _reference(ids, mask):
    """Plain loops: keep masked-in tokens, MoE layers 1..3, all-zero rows -> -1."""
    out = []
    for b in range(ids.shape[0]):
        rows = []
        for s in range(ids.shape[1]):
            if not mask[b, s]:
                continue
            row = []
            for layer in range(1, L):
                r = [int(v) for v in ids[b, s, layer]]
                row.append([-1] * K if all(v == 0 for v in r) else r)
            rows.append(row)
        out.append(torch.tensor(rows, dtype=torch.int32))
    return out


def test_from_verl_drops_padding_maps_layers_and_turns_zero_rows_into_none():
    ids, mask, lengths = _verl_batch()
    tables, report = routes.from_verl(ids, mask, num_experts=E, first_k_dense=1)
    ref = _reference(ids, mask)
    assert len(tables) == len(ref)
    for t, r, n in zip(tables, ref, lengths):
        assert t.dtype == torch.int32 and t.shape == (n, L - 1, K)
        assert torch.equal(t, r)
        assert bool((t[-1] == -1).all())  # the last sampled token: no route
    assert list(report["moe_layers"]) == [1, 2, 3]
    assert report["num_zero_rows"] == len(lengths) * (L - 1)
    assert report["num_tokens"] == sum(lengths)


def test_from_verl_zero_rows_keep_and_error():
    ids, mask, _ = _verl_batch()
    kept, _ = routes.from_verl(ids, mask, num_experts=E, first_k_dense=1, zero_rows="keep")
    assert bool((kept[0][-1] == 0).all())
    with pytest.raises(ValueError, match="all-zero row"):
        routes.from_verl(ids, mask, num_experts=E, first_k_dense=1, zero_rows="error")


def test_from_verl_rejects_wrong_rank_and_reports_a_wrong_layer_map():
    ids, mask, _ = _verl_batch()
    with pytest.raises(ValueError, match=r"\[routes.from_verl\] routed_experts must be"):
        routes.from_verl(ids[0], mask, num_experts=E)
    # Layer 1 holds real ids: calling layers 0..1 dense is reported as a likely wrong layer map.
    _, report = routes.from_verl(ids, mask, num_experts=E, first_k_dense=2)
    assert any("is the layer map right?" in w for w in report["warnings"]), report["warnings"]
    assert list(report["moe_layers"]) == [2, 3]


def test_import_vllm_arrays_equals_the_file_importer(tmp_path):
    g = np.random.default_rng(5)
    # Distinct ids per row, as a top-k gives them (a repeated id is an invalid row, issue 13).
    arrays = [np.argsort(g.random((n, L, E)), axis=-1)[..., :K].astype(np.int32) for n in (4, 9)]
    arrays[0][:, 0] = 0  # dense layer
    arrays[1][:, 0] = 0
    arrays[1][3, 2] = 0  # a zero-filled row on a MoE layer
    paths = []
    for i, a in enumerate(arrays):
        paths.append(tmp_path / f"s{i}.npy")
        np.save(paths[-1], a)
    got, rep = routes.import_vllm_arrays([torch.from_numpy(a) for a in arrays], E,
                                         first_k_dense=1, zero_rows="to_none")
    want, rep_f = routes.import_vllm(paths, E, first_k_dense=1, zero_rows="to_none")
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert rep["num_zero_rows"] == rep_f["num_zero_rows"] == 1
    assert [tuple(r) for r in rep["first_zero_rows"]] == [(1, 3, 1)]
    assert rep["first_zero_rows"] == rep_f["first_zero_rows"]


def test_layer_targets_after_thd_packing_key_by_layer_number():
    ids, mask, lengths = _verl_batch()
    tables, report = routes.from_verl(ids, mask, num_experts=E, first_k_dense=1)
    packed, cu, cu_padded = routes.pack_thd(tables, tp_size=2, num_experts=E)
    # Megatron's layer_number is 1-based: hidden layer h is layer h + 1; MTP keys get nothing.
    targets = routes.layer_targets(packed, report["moe_layers"], keys=[2, 3, 4, ("mtp", 1)])
    assert sorted(targets) == [2, 3, 4]
    for key, col in ((2, 0), (3, 1), (4, 2)):
        assert torch.equal(targets[key], packed[:, col, :])
        assert targets[key].shape == (int(cu_padded[-1]), K)
    # Alignment padding is -1 (routed natively), real tokens keep their routes.
    seq0 = targets[2][: lengths[0]]
    assert torch.equal(seq0, tables[0][:, 0, :])
    with pytest.raises(ValueError, match=r"layer 1 \(hidden layer 0\) is not a MoE layer"):
        routes.layer_targets(packed, report["moe_layers"], keys=[1])


def test_layer_targets_for_a_pipeline_stage():
    # Stage 1 of 2 over hidden layers 0..3 (MoE 1..3) owns hidden layers 2..3: its routers are
    # layers 3 and 4; pp_moe_layer_range slices the same columns the keys pick.
    ids, mask, _ = _verl_batch()
    tables, report = routes.from_verl(ids, mask, num_experts=E, first_k_dense=1)
    moe = list(report["moe_layers"])
    begin, end = routes.pp_moe_layer_range(moe, L, pp_size=2, pp_rank=1)
    piece = routes.slice_layers(tables[1], begin, end, num_experts=E)
    targets = routes.layer_targets(tables[1], moe, keys=[3, 4])
    assert torch.equal(torch.stack([targets[3], targets[4]], dim=1), piece)


def test_layer_targets_bshd_batch_first_rows_go_to_sequence_first_order():
    # Two sequences of 3 tokens, batch-first: row b*3 + s. The router sees token s*2 + b.
    table = torch.arange(6 * 1 * K, dtype=torch.int32).reshape(6, 1, K) % E
    targets = routes.layer_targets(table, [0], keys=[1], batch_size=2)
    for b in range(2):
        for s in range(3):
            assert torch.equal(targets[1][s * 2 + b], table[b * 3 + s, 0])
    with pytest.raises(ValueError, match="batch_size must divide the 6 rows"):
        routes.layer_targets(table, [0], keys=[1], batch_size=4)
