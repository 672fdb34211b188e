"""Route data at RL scale: the batch functions take verl's and vLLM's dtypes as they come (no
widening copy), check every id in the engine on the way, and give the same tables and the same
first error on any thread count (switchyard.set_num_threads)."""
import numpy as np
import pytest
import torch

import switchyard as sy
import switchyard.routes as routes

E, K, H = 64, 8, 6  # hidden layer 0 dense (first_k_dense=1)


def _verl(seed=0, B=9, S=1200):
    """[B, S, H, K] int16, left-padded prompts, right-padded responses, last token 0: > 1 MB, so
    the engine runs it on its threads."""
    g = np.random.default_rng(seed)
    ids = np.zeros((B, S, H, K), dtype=np.int16)
    mask = np.zeros((B, S), dtype=np.int64)
    for b in range(B):
        lo, n = int(g.integers(0, S // 3)), int(g.integers(1, S // 2))
        mask[b, lo:lo + n] = 1
        rows = np.argsort(g.random((n, H - 1, E)), axis=-1)[..., :K]
        ids[b, lo:lo + n, 1:] = rows
        ids[b, lo + n - 1] = 0
    return torch.from_numpy(ids), torch.from_numpy(mask)


def _reference(ids, mask):
    out = []
    for b in range(ids.shape[0]):
        t = ids[b][mask[b].bool()][:, 1:].to(torch.int32)
        t[(t == 0).all(-1)] = -1
        out.append(t)
    return out


@pytest.fixture
def threads():
    old = sy.num_threads()
    yield lambda n: sy.set_num_threads(n)
    sy.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int32, torch.int64])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_from_verl_reads_every_dtype_in_one_call_on_any_thread_count(dtype, n_threads, threads):
    threads(n_threads)
    ids, mask = _verl()
    tables, rep = routes.from_verl(ids.to(dtype), mask.bool(), num_experts=E, first_k_dense=1)
    ref = _reference(ids, mask)
    assert all(torch.equal(a, b) for a, b in zip(tables, ref)) and len(tables) == len(ref)
    assert rep["num_zero_rows"] == ids.shape[0] * (H - 1)
    assert rep["num_tokens"] == int(mask.sum())
    assert [tuple(z) for z in rep["first_zero_rows"]][:1] == [(0, int(mask[0].sum()) - 1, 0)]


@pytest.mark.hostile(tried="from_verl on a batch with bad ids in several sequences, 2 threads",
                     gets="ValueError naming the first bad sequence, token and position")
def test_from_verl_names_the_first_bad_sequence_whatever_the_threads(threads):
    threads(2)
    ids, mask = _verl(1)
    for b in (6, 3):
        s = int(mask[b].nonzero()[0])
        ids[b, s, 2, 1] = 99
    with pytest.raises(ValueError, match=r"\[from_verl\] routed_experts\[3\] \(sequence 3, "
                                         r"position \d+\): expert id 99 at token 0, hidden layer 2"):
        routes.from_verl(ids, mask, num_experts=E, first_k_dense=1)
    ids, mask = _verl(2)
    s = int(mask[4].nonzero()[0])
    ids[4, s, 3, 5] = ids[4, s, 3, 0]
    with pytest.raises(ValueError, match=r"routed_experts\[4\] .* repeats expert"):
        routes.from_verl(ids, mask, num_experts=E, first_k_dense=1)
    tables, rep = routes.from_verl(ids, mask, num_experts=E, first_k_dense=1,
                                   invalid_rows="native")
    assert rep["num_invalid_rows"] == 1 and bool((tables[4][0, 2] == -1).all())


def test_to_verl_returns_verls_int16_and_inverts_from_verl(threads):
    threads(2)
    ids, mask = _verl(3)
    tables, rep = routes.from_verl(ids, mask, num_experts=E, first_k_dense=1)
    back, back_mask = routes.to_verl(tables, rep["moe_layers"], H, attention_mask=mask,
                                     num_experts=E)
    assert back.dtype == torch.int16 and torch.equal(back, ids)
    assert torch.equal(back_mask, mask)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_import_vllm_arrays_reads_int16_as_is_and_matches_int32(dtype, threads):
    threads(2)
    ids, mask = _verl(4)
    arrays = [ids[b][mask[b].bool()][:-1] for b in range(ids.shape[0])]
    want, rep_w = routes.import_vllm_arrays([a.to(torch.int32) for a in arrays], E,
                                            first_k_dense=1)
    got, rep_g = routes.import_vllm_arrays([a.to(dtype) for a in arrays], E, first_k_dense=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert rep_g["num_tokens"] == rep_w["num_tokens"]


def test_import_vllm_arrays_names_the_first_bad_sequence_on_threads(threads):
    threads(2)
    ids, mask = _verl(5)
    arrays = [ids[b][mask[b].bool()][:-1].clone() for b in range(ids.shape[0])]
    arrays[5][0, 1, 0] = 200
    arrays[2][0, 1, 0] = 100
    with pytest.raises(ValueError, match=r"\[import\] arrays\[2\] \(sequence 2\): expert id 100"):
        routes.import_vllm_arrays(arrays, E, first_k_dense=1)


@pytest.mark.hostile(tried="drop_padding with num_experts=64 over a batch holding id 70",
                     gets="ValueError naming batch, position, layer and slot of the id")
def test_drop_padding_checks_ids_against_num_experts():
    ids, mask = _verl(6)
    s = int(mask[2].nonzero()[1])
    ids[2, s, 4, 3] = 70
    with pytest.raises(ValueError, match=r"\[drop_padding\] topk_idx: ids must be -1 or in "
                                         rf"\[0, num_experts=64\), got 70 at batch 2, position {s}, "
                                         r"layer 4, slot 3"):
        routes.drop_padding(ids, mask, num_experts=E)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_pack_and_splits_copy_and_check_in_one_pass(n_threads, threads):
    threads(n_threads)
    ids, mask = _verl(7)
    tables, _ = routes.from_verl(ids, mask, num_experts=E, first_k_dense=1)
    packed, cu, cu_pad = routes.pack_thd(tables, tp_size=2, cp_size=2, num_experts=E)
    for i, t in enumerate(tables):
        assert torch.equal(packed[cu_pad[i]:cu_pad[i] + t.shape[0]], t)
        assert bool((packed[cu_pad[i] + t.shape[0]:cu_pad[i + 1]] == -1).all())
    pieces = [routes.cp_zigzag_split(packed, cu_pad, 2, r, num_experts=E) for r in range(2)]
    assert torch.equal(routes.cp_zigzag_gather(pieces, cu_pad, num_experts=E), packed)
    halves = [routes.sp_split(packed, 2, r, num_experts=E) for r in range(2)]
    assert torch.equal(torch.cat(halves), packed)
    bad = [t.clone() for t in tables]
    bad[1][0, 0, 0] = E
    with pytest.raises(ValueError, match=r"\[pack_thd\] sequences\[1\]: ids must be -1 or in"):
        routes.pack_thd(bad, tp_size=2, num_experts=E)
    # A split checks the rows it copies: the last row is in sp rank 1's and cp rank 0's piece.
    worse = packed.clone()
    worse[-1, 0, 0] = -2
    with pytest.raises(ValueError, match=r"\[sp_split\] table: ids must be -1 or in .* got -2"):
        routes.sp_split(worse, 2, 1, num_experts=E)
    with pytest.raises(ValueError, match=r"\[cp_zigzag_split\] packed: ids must be -1 or in"):
        routes.cp_zigzag_split(worse, cu_pad, 2, 0, num_experts=E)
