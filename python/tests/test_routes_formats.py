"""Route data from the newest engines and verl's batch layout: vLLM >= 0.22 HTTP responses
(choices[i].routed_experts = base64 of .npy bytes, uint8 for <= 256 experts else uint16,
routed_experts_prompt_start), SGLang's meta_info.routed_experts_start_len, and
switchyard.routes.to_verl, the inverse of from_verl."""
import base64
import io
import json

import numpy as np
import pytest
import torch

from switchyard import routes

# Byte-exact fixtures, as the engines put them on the wire (vLLM: np.save + base64; SGLang: raw
# little-endian int32 + base64). Two tokens routed, 2 layers (layer 0 dense, so 0), K = 2.
VLLM_U8 = ("k05VTVBZAQB2AHsnZGVzY3InOiAnfHUxJywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDIsIDIs"
           "IDIpLCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAoAAAMB"
           "AAACBQ==")
VLLM_U8_ROWS = [[[0, 0], [3, 1]], [[0, 0], [2, 5]]]
VLLM_U16 = ("k05VTVBZAQB2AHsnZGVzY3InOiAnPHUyJywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDEsIDIs"
            "IDIpLCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAoAAAAA"
            "KwEHAA==")
VLLM_U16_ROWS = [[[0, 0], [299, 7]]]
SGLANG_I32 = "AAAAAAAAAAADAAAAAQAAAAAAAAAAAAAAAgAAAAUAAAA="


def npy_b64(a):
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def expected_table(rows, start=0):
    """[start + len(rows) + 1, 1, K]: -1 before start, the MoE layer (index 1), -1 last."""
    K = len(rows[0][0])
    t = [[[-1] * K]] * start + [[r[1]] for r in rows] + [[[-1] * K]]
    return torch.tensor(t, dtype=torch.int32)


def test_fixtures_are_what_numpy_and_sglang_write():
    assert npy_b64(np.array(VLLM_U8_ROWS, dtype=np.uint8)) == VLLM_U8
    assert npy_b64(np.array(VLLM_U16_ROWS, dtype=np.uint16)) == VLLM_U16
    assert base64.b64encode(np.array(VLLM_U8_ROWS, dtype="<i4").tobytes()).decode() == SGLANG_I32


def test_vllm_completion_response_uint8():
    resp = {"id": "cmpl-1", "object": "text_completion",
            "choices": [{"index": 0, "text": "hi", "token_ids": [7, 8], "routed_experts": VLLM_U8}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    tables, rep = routes.import_vllm_response(resp, num_experts=8, first_k_dense=1)
    assert len(tables) == 1 and torch.equal(tables[0], expected_table(VLLM_U8_ROWS))
    assert rep["moe_layers"] == [1] and rep["num_tokens"] == 3 and rep["warnings"] == []
    assert rep["sources"] == ["<text> choices[0].routed_experts"]


def test_vllm_chat_response_uint16_with_saved_prompt_start():
    resp = {"object": "chat.completion", "routed_experts_prompt_start": 3,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                         "routed_experts": VLLM_U16}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1}}
    tables, rep = routes.import_vllm_response(json.dumps(resp), num_experts=300, first_k_dense=1)
    assert torch.equal(tables[0], expected_table(VLLM_U16_ROWS, start=3))
    assert rep["num_tokens"] == 5 and rep["warnings"] == []  # 3 + 1 routed + the last = 4 + 1


def test_vllm_prompt_start_option_and_record_override_and_n_choices():
    rng = np.random.default_rng(7)
    a = np.stack([rng.permutation(16)[:2] for _ in range(6)]).reshape(3, 2, 2).astype(np.uint8)
    a[:, 0] = 0
    rec = {"choices": [{"routed_experts": npy_b64(a)}, {"routed_experts": npy_b64(a[:1])}]}
    tables, rep = routes.import_vllm_response([rec], 16, first_k_dense=1, prompt_start=2)
    assert [t.shape[0] for t in tables] == [6, 4]
    assert torch.equal(tables[0], expected_table(a.tolist(), start=2))
    assert rep["first_zero_rows"] == [] and rep["num_sequences"] == 2
    rec["sampling_params"] = {"routed_experts_prompt_start": 0}
    tables, _ = routes.import_vllm_response(rec, 16, first_k_dense=1, prompt_start=2)
    assert [t.shape[0] for t in tables] == [4, 2]


def test_vllm_bare_field_jsonl_and_files(tmp_path):
    t, _ = routes.import_vllm_response(VLLM_U8, 8, first_k_dense=1)
    assert torch.equal(t[0], expected_table(VLLM_U8_ROWS))
    lines = "\n".join(json.dumps({"choices": [{"routed_experts": s}]}) for s in (VLLM_U8, VLLM_U8))
    (tmp_path / "r.jsonl").write_text(lines + "\n")
    np.save(tmp_path / "s.npy", np.array(VLLM_U8_ROWS, dtype=np.uint8))
    tables, rep = routes.import_vllm([tmp_path / "r.jsonl", tmp_path / "s.npy"], 8, first_k_dense=1)
    assert len(tables) == 3 and all(torch.equal(x, expected_table(VLLM_U8_ROWS)) for x in tables)
    assert rep["sources"][0].endswith("r.jsonl:1 choices[0].routed_experts")
    assert rep["sources"][2].endswith("s.npy")


def test_vllm_zero_rows_shift_with_prompt_start():
    a = np.array([[[0, 0], [0, 0]], [[0, 0], [1, 2]]], dtype=np.uint8)  # token 0 all-zero
    _, rep = routes.import_vllm_response(npy_b64(a), 8, first_k_dense=1, prompt_start=5)
    assert rep["num_zero_rows"] == 1 and rep["first_zero_rows"] == [[0, 5, 0]]


def test_vllm_errors_name_record_choice_and_field():
    with pytest.raises(ValueError, match=r"<text>: choices\[1\]\.routed_experts is missing or null"):
        routes.import_vllm_response({"choices": [{"routed_experts": VLLM_U8},
                                                 {"routed_experts": None}]}, 8, first_k_dense=1)
    with pytest.raises(ValueError, match=r"choices\[0\]\.routed_experts must be a base64 string"):
        routes.import_vllm_response({"choices": [{"routed_experts": [[1, 2]]}]}, 8)
    with pytest.raises(ValueError, match=r"choices\[0\]\.routed_experts: \[base64\] invalid"):
        routes.import_vllm_response({"choices": [{"routed_experts": "k05VTV*A"}]}, 8)
    with pytest.raises(ValueError, match=r"no choices array"):
        routes.import_vllm_response({"meta_info": {}}, 8)
    with pytest.raises(ValueError, match=r"routed_experts_prompt_start=4 is not inside the prompt "
                                         r"\(usage.prompt_tokens=4\)"):
        routes.import_vllm_response({"routed_experts_prompt_start": 4, "usage": {"prompt_tokens": 4},
                                     "choices": [{"routed_experts": VLLM_U8}]}, 8, first_k_dense=1)
    with pytest.raises(ValueError, match=r"routed_experts_prompt_start must be an integer in "
                                         r"\[0, 2\^24\], got -1"):
        routes.import_vllm_response({"routed_experts_prompt_start": -1,
                                     "choices": [{"routed_experts": VLLM_U8}]}, 8)
    with pytest.raises(ValueError, match=r"prompt_start must be in \[0, 2\^24\], got 16777217"):
        routes.import_vllm_response(VLLM_U8, 8, first_k_dense=1, prompt_start=(1 << 24) + 1)
    with pytest.raises(ValueError, match=r"expert id 5 at token 1, hidden layer 1, slot 1 is outside"):
        routes.import_vllm_response(VLLM_U8, 4, first_k_dense=1)


def test_vllm_warnings_for_width_and_length():
    _, rep = routes.import_vllm_response(VLLM_U8, 300, first_k_dense=1)
    assert "uint8 ids but num_experts=300" in rep["warnings"][0]
    _, rep = routes.import_vllm_response(VLLM_U16, 256 + 44, first_k_dense=1)
    assert rep["warnings"] == []
    _, rep = routes.import_vllm_response(
        {"choices": [{"routed_experts": VLLM_U8}], "usage": {"prompt_tokens": 5,
                                                               "completion_tokens": 2}},
        8, first_k_dense=1)
    assert "usage.prompt_tokens + completion_tokens = 7 but routed_experts with prompt_start 0 " \
           "covers 3 tokens" in rep["warnings"][0]


def test_sglang_start_len():
    rec = {"text": "x", "meta_info": {"routed_experts": SGLANG_I32, "routed_experts_start_len": 2,
                                      "prompt_tokens": 3, "completion_tokens": 2}}
    tables, rep = routes.import_sglang_text(json.dumps(rec), 8, num_input_layers=2, top_k=2,
                                            first_k_dense=1)
    assert torch.equal(tables[0], expected_table(VLLM_U8_ROWS, start=2))
    assert rep["num_tokens"] == 5 and rep["warnings"] == []
    del rec["meta_info"]["routed_experts_start_len"]
    tables, _ = routes.import_sglang_text(json.dumps(rec), 8, 2, 2, first_k_dense=1, start_len=1)
    assert torch.equal(tables[0], expected_table(VLLM_U8_ROWS, start=1))
    rec["meta_info"]["routed_experts_start_len"] = 4
    with pytest.raises(ValueError, match=r"<text>: meta_info.routed_experts_start_len=4 is past the "
                                         r"prompt \(prompt_tokens=3\)"):
        routes.import_sglang_text(json.dumps(rec), 8, 2, 2, first_k_dense=1)
    rec["meta_info"]["routed_experts_start_len"] = "2"
    with pytest.raises(ValueError, match=r"meta_info.routed_experts_start_len must be an integer"):
        routes.import_sglang_text(json.dumps(rec), 8, 2, 2, first_k_dense=1)


# ---- verl's batch layout -------------------------------------------------------------------------
def random_tables(gen, lengths, M, K, E):
    out = []
    for T in lengths:
        t = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T * M)])
        t = t.reshape(T, M, K).to(torch.int32)
        t[-1] = -1  # the last sampled token has no route
        out.append(t)
    return out


def test_to_verl_layout_left_and_right():
    gen = torch.Generator().manual_seed(3)
    tables = random_tables(gen, [3, 5], M=2, K=2, E=8)
    moe_layers, H = [1, 3], 4
    for side in ("left", "right"):
        ids, mask = routes.to_verl(tables, moe_layers, H, padding_side=side, seq_len=6)
        assert ids.dtype == torch.int16 and list(ids.shape) == [2, 6, 4, 2]
        assert mask.dtype == torch.int64
        want = torch.zeros(2, 6, 4, 2, dtype=torch.int16)
        want_mask = torch.zeros(2, 6, dtype=torch.int64)
        for b, t in enumerate(tables):
            first = 6 - t.shape[0] if side == "left" else 0
            for r in range(t.shape[0]):
                want_mask[b, first + r] = 1
                for m, h in enumerate(moe_layers):
                    if t[r, m, 0] >= 0:
                        want[b, first + r, h] = t[r, m].to(torch.int16)
        assert torch.equal(ids, want) and torch.equal(mask, want_mask)


def test_to_verl_is_the_inverse_of_from_verl():
    gen = torch.Generator().manual_seed(11)
    tables = random_tables(gen, [4, 1, 7], M=3, K=4, E=40)
    tables[0][1, 2] = -1  # a row without a route in the middle
    moe_layers, H = [1, 2, 4], 6
    freq = [1 if h in moe_layers else 0 for h in range(H)]
    for side in ("left", "right"):
        ids, mask = routes.to_verl(tables, moe_layers, H, padding_side=side, seq_len=9)
        back, rep = routes.from_verl(ids, mask, num_experts=40, moe_layer_freq=freq)
        assert rep["moe_layers"] == moe_layers
        assert all(torch.equal(a, b) for a, b in zip(back, tables))
    # With a given mask (any pattern), the tables land at its real positions.
    m = torch.zeros(3, 9, dtype=torch.bool)
    for b, t in enumerate(tables):
        m[b, torch.randperm(9, generator=gen)[:t.shape[0]].sort().values] = True
    ids, mask = routes.to_verl(tables, moe_layers, H, attention_mask=m)
    assert torch.equal(mask, m.to(torch.int64))
    back, _ = routes.from_verl(ids, m, num_experts=40, moe_layer_freq=freq)
    assert all(torch.equal(a, b) for a, b in zip(back, tables))


def test_to_verl_errors():
    gen = torch.Generator().manual_seed(5)
    tables = random_tables(gen, [3], M=2, K=2, E=8)
    with pytest.raises(ValueError, match=r"\[to_verl\] seq_len=2 is shorter than the longest table "
                                         r"\(3 tokens\)"):
        routes.to_verl(tables, [0, 1], 2, seq_len=2)
    with pytest.raises(ValueError, match=r"moe_layers must be strictly increasing"):
        routes.to_verl(tables, [1, 1], 2)
    with pytest.raises(ValueError, match=r"tables\[0\] has 2 MoE layers, moe_layers names 1"):
        routes.to_verl(tables, [1], 2)
    with pytest.raises(ValueError, match=r"padding_side must be 'left' or 'right', got 'top'"):
        routes.to_verl(tables, [0, 1], 2, padding_side="top")
    bad = tables[0].clone()
    bad[0, 1, 0] = -1
    with pytest.raises(ValueError, match=r"tables\[0\]: row at token 0, MoE layer 1 mixes -1"):
        routes.to_verl([bad], [0, 1], 2)
    with pytest.raises(ValueError, match=r"attention_mask row 0 has 2 real tokens, tables\[0\] has 3"):
        routes.to_verl(tables, [0, 1], 2, attention_mask=torch.tensor([[1, 1, 0, 0]]))
    with pytest.raises(ValueError, match=r"num_experts must be <= 32768, got 40000"):
        routes.to_verl(tables, [0, 1], 2, num_experts=40000)
