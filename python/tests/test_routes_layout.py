"""switchyard.routes' batch-layout helpers (issue 23): add_padding (route tables -> padded batch
targets, the inverse of drop_padding) and routed_experts (the ids of every fed token -> vLLM's
routed_experts per sequence), the one implementation the HF adapter's targets_from_* and
Capture.routed_experts call. Integers only, compared exactly."""
import pytest
import torch

import switchyard as sy

L, K = 3, 2


def _table(n, start):
    """[n, L, K] int32 with distinct, recognisable values start, start + 1, ..."""
    return torch.arange(start, start + n * L * K, dtype=torch.int32).view(n, L, K)


# ---- add_padding ----------------------------------------------------------------------------------
def test_add_padding_places_rows_at_the_masks_real_positions():
    tables = [_table(3, 0), _table(5, 100), _table(1, 200)]
    mask = torch.tensor([[0, 0, 1, 1, 1, 0],    # left and right padding
                         [1, 1, 1, 1, 1, 0],    # right padding
                         [0, 0, 0, 0, 0, 1]])   # left padding
    out = sy.routes.add_padding(tables, mask)
    assert out.dtype == torch.int32 and list(out.shape) == [3, 6, L, K]
    expected = torch.full((3, 6, L, K), -1, dtype=torch.int32)
    expected[0, 2:5] = tables[0]
    expected[1, :5] = tables[1]
    expected[2, 5] = tables[2][0]
    assert torch.equal(out, expected)
    # drop_padding is its inverse.
    back = sy.routes.drop_padding(out, mask, num_experts=300)
    assert all(torch.equal(b, t) for b, t in zip(back, tables))


def test_add_padding_with_an_inner_gap_in_the_mask():
    t = _table(3, 7)
    out = sy.routes.add_padding([t], torch.tensor([[1, 0, 1, 0, 1]]))
    assert torch.equal(out[0, [0, 2, 4]], t)
    assert bool((out[0, [1, 3]] == -1).all())


@pytest.mark.parametrize("side", ["left", "right"])
def test_add_padding_by_padding_side(side):
    tables = [_table(2, 0), _table(4, 50)]
    out = sy.routes.add_padding(tables, padding_side=side, seq_len=5)
    assert out.dtype == torch.int32 and list(out.shape) == [2, 5, L, K]
    for b, t in enumerate(tables):
        n = t.shape[0]
        real = slice(5 - n, 5) if side == "left" else slice(0, n)
        pad = slice(0, 5 - n) if side == "left" else slice(n, 5)
        assert torch.equal(out[b, real], t)
        assert bool((out[b, pad] == -1).all())
    # seq_len None: the longest table.
    assert list(sy.routes.add_padding(tables, padding_side=side).shape) == [2, 4, L, K]


def test_add_padding_of_equal_lengths_stacks_them():
    tables = [_table(3, 0), _table(3, 30).to(torch.int64)]
    out = sy.routes.add_padding(tables)
    assert out.dtype == torch.int32 and torch.equal(out, torch.stack([tables[0],
                                                                      tables[1].int()]))


@pytest.mark.parametrize("call,match", [
    (lambda: sy.routes.add_padding([_table(3, 0)], torch.tensor([[1, 1, 0, 0]])),
     r"\[routes.add_padding\] sequence 0: the attention mask has 2 real tokens, the routes 3"),
    (lambda: sy.routes.add_padding([_table(3, 0)], torch.ones(2, 3)),
     r"attention_mask must be \[1, S\], got \[2, 3\]"),
    (lambda: sy.routes.add_padding([_table(3, 0), _table(2, 0)]),
     r"sequences of different lengths \[2, 3\] .* need an attention_mask"),
    (lambda: sy.routes.add_padding([_table(3, 0), torch.zeros(3, L, K + 1, dtype=torch.int32)]),
     r"tables\[1\] of shape \[3, 3, 3\]"),
    (lambda: sy.routes.add_padding([_table(3, 0)], padding_side="left", seq_len=2),
     r"seq_len=2 is shorter than the longest table \(3 rows\)"),
    (lambda: sy.routes.add_padding([_table(3, 0)], padding_side="middle"),
     r"padding_side must be None, 'left' or 'right', got 'middle'"),
    (lambda: sy.routes.add_padding([_table(3, 0)], torch.ones(1, 3), padding_side="left"),
     r"the mask places the rows: padding_side and seq_len must be None"),
    (lambda: sy.routes.add_padding([]), r"at least one table"),
    (lambda: sy.routes.add_padding([torch.full((1, L, K), 2**32 + 5)]),
     r"\[routes.add_padding\] tables\[0\] holds 4294967301 at \[0, 0, 0\], outside int32"),
])
def test_add_padding_refuses_what_it_cannot_place(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- routed_experts -------------------------------------------------------------------------------
def _fed(B, S, H=4):
    """[B, S, H, K] ids of fed tokens, dense layer 0 holding 0 as a capture does."""
    ids = torch.arange(B * S * H * K, dtype=torch.int32).view(B, S, H, K) % 97 + 1
    ids[:, :, 0] = 0
    return ids


def test_routed_experts_without_a_mask_is_every_fed_row():
    ids = _fed(2, 5)
    out = sy.routes.routed_experts(ids)
    assert len(out) == 2 and all(torch.equal(o, ids[b]) for b, o in enumerate(out))
    assert out[0].dtype == torch.int32


def test_routed_experts_over_generated_sequences():
    # S = 5 fed tokens, S + 1 = 6 generated positions. Row 0: left padding, the final token real
    # (never fed: every real fed row is routed). Row 1: ended early (EOS fed at column 3, padding
    # after): its last real token was fed, and vLLM does not route a sequence's last token.
    ids = _fed(2, 5)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 0, 0]])
    out = sy.routes.routed_experts(ids, mask)
    assert torch.equal(out[0], ids[0, 1:5])
    assert torch.equal(out[1], ids[1, 0:3])


@pytest.mark.hostile(tried="routes.routed_experts(ids, mask) with a [B, S] mask over a generate() "
                           "capture's fed tokens, a sequence real at the last fed column",
                     gets="that sequence keeps every fed row (its final token was generated, never "
                          "fed); used to drop its last fed row, a real route")
def test_routed_experts_over_fed_tokens_keeps_a_sequence_that_goes_on():
    # Row 0 is real at the last fed column: its final (generated) token was never fed, so its
    # last fed row is a real route. Row 1 ended early: its last real token (fed) has no route.
    ids = _fed(2, 4)
    mask = torch.tensor([[1, 1, 1, 1],
                         [0, 1, 1, 0]])
    out = sy.routes.routed_experts(ids, mask)
    assert torch.equal(out[0], ids[0, 0:4])
    assert torch.equal(out[1], ids[1, 1:2])
    # the same as the mask over the generated sequences, whose final column row 0 reaches
    gen = torch.tensor([[1, 1, 1, 1, 1],
                        [0, 1, 1, 0, 0]])
    assert all(torch.equal(a, b) for a, b in zip(out, sy.routes.routed_experts(ids, gen)))


def test_routed_experts_of_plain_forwards_drops_each_last_token():
    # final_token_fed=True (a capture of forwards over whole sequences): every sequence fed its
    # last token, which vLLM never routes.
    ids = _fed(2, 4)
    mask = torch.tensor([[1, 1, 1, 1],
                         [0, 1, 1, 0]])
    out = sy.routes.routed_experts(ids, mask, final_token_fed=True)
    assert torch.equal(out[0], ids[0, 0:3])
    assert torch.equal(out[1], ids[1, 1:2])


def test_routed_experts_then_the_vllm_importer_then_add_padding_round_trip():
    """routed_experts -> import_vllm_arrays -> add_padding gives the fed ids back at the MoE
    layers, -1 at padding and at each sequence's last token (which has no route)."""
    B, S, H = 2, 5, 4
    ids = _fed(B, S, H) % 8  # experts 0..7
    ids[:, :, 1:, 1] = (ids[:, :, 1:, 0] + 1) % 8  # distinct ids per row
    ids[:, :, 0] = 0
    mask = torch.tensor([[0, 1, 1, 1, 1, 1],
                         [1, 1, 1, 0, 0, 0]])
    arrays = sy.routes.routed_experts(ids, mask)
    tables, rep = sy.routes.import_vllm_arrays(arrays, 8, first_k_dense=1)
    assert rep["moe_layers"] == [1, 2, 3]
    out = sy.routes.add_padding(tables, mask)  # the trainer feeds the whole sequences
    expected = torch.full((B, S + 1, H - 1, K), -1, dtype=torch.int32)
    expected[0, 1:5] = ids[0, 1:5, 1:]  # the final token (position 5) has no route
    expected[1, 0:2] = ids[1, 0:2, 1:]  # token 2 is the sequence's last: no route
    assert torch.equal(out, expected)


@pytest.mark.parametrize("call,match", [
    (lambda: sy.routes.routed_experts(_fed(2, 5), torch.ones(2, 7)),
     r"\[routes.routed_experts\] attention_mask must be \[2, 6\] \(generated sequences\) or "
     r"\[2, 5\] \(fed tokens\), got \[2, 7\]"),
    (lambda: sy.routes.routed_experts(_fed(2, 5)[0]), r"ids must be \[B, S, num_hidden_layers"),
    (lambda: sy.routes.routed_experts(_fed(1, 2).float()), r"ids must have dtype"),
])
def test_routed_experts_refuses_shapes_it_cannot_read(call, match):
    with pytest.raises(ValueError, match=match):
        call()
