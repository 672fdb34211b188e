"""Every engine's layout (issue 25): TensorRT-LLM arrays, FlashInfer routing_replay_out buffers,
vLLM streamed chunks (VllmRouteStream, recorded SSE) and SGLang's OpenAI-compatible sgl_ext.

Property tests (hypothesis, derandomized): route tables -> an engine's layout -> import == the
tables, over shapes, E, K, layer maps (first-k-dense, frequency lists, MTP layers), prompt starts
and -1 rows; and corrupt / truncated input -> a ValueError naming the op, never a crash: a cut
.npy never imports, a cut SGLang payload (which has no length of its own) imports only with a
warning, a stream with a chunk lost, repeated or cut off (continuous usage on) never imports, and
a flipped bit that still parses gives ids in range."""
import base64
import io
import json
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchyard import routes

PROPS = settings(derandomize=True, max_examples=40, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
OP = re.compile(r"\[(import|base64|routes\.import)\]")


# ---- generated cases ---------------------------------------------------------------------------
@st.composite
def cases(draw):
    """(E, K, layer map kwargs, hidden index of each MoE layer, num_hidden, mtp, tables): tables
    [T_i, M, K] int32 with valid rows (distinct ids) or -1 rows, last row -1 (no route)."""
    E = draw(st.integers(1, 300))
    K = draw(st.integers(1, min(E, 6)))
    M = draw(st.integers(1, 4))
    mtp = draw(st.integers(0, 1))
    if draw(st.booleans()):
        fkd = draw(st.integers(0, 3))
        lm = {"first_k_dense": fkd}
        moe = list(range(fkd, fkd + M))
        H = fkd + M
    else:
        dense_after = draw(st.lists(st.integers(0, 2), min_size=M, max_size=M))
        freq = [0] * draw(st.integers(0, 2))
        for d in dense_after:
            freq += [1] + [0] * d
        lm = {"moe_layer_freq": freq}
        moe = [i for i, f in enumerate(freq) if f]
        H = len(freq)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    tables = []
    for _ in range(draw(st.integers(1, 3))):
        T = draw(st.integers(2, 7))
        t = np.full((T, M, K), -1, dtype=np.int32)
        for r in range(T - 1):
            for m in range(M):
                if rng.random() < 0.85:
                    t[r, m] = rng.choice(E, size=K, replace=False)
        tables.append(torch.from_numpy(t))
    return E, K, lm, moe, H, mtp, tables


def expand(table, moe, H, mtp, E, K, dense=0):
    """[T-1, H + mtp, K] engine array: MoE layers from the table, dense `dense`, MTP random."""
    T, M, _ = table.shape
    a = np.full((T - 1, H + mtp, K), dense, dtype=np.int32)
    for i, h in enumerate(moe):
        a[:, h] = table[:-1, i].numpy()
    for j in range(mtp):
        a[:, H + j] = np.arange(K) % E
    return a


def npy_bytes(a):
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def b64(b):
    return base64.b64encode(b).decode()


def same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == torch.int32 and torch.equal(g, w.to(torch.int32)), (g, w)


# ---- round trips -------------------------------------------------------------------------------
@PROPS
@given(cases())
def test_vllm_and_sglang_layouts_round_trip(case):
    E, K, lm, moe, H, mtp, tables = case
    kw = dict(num_experts=E, num_mtp_layers=mtp, **lm)
    arrays = [expand(t, moe, H, mtp, E, K) for t in tables]
    got, rep = routes.import_vllm_arrays([torch.from_numpy(a) for a in arrays], **kw)
    same(got, tables)
    assert rep["moe_layers"] == moe
    resp = {"choices": [{"index": i, "routed_experts": b64(npy_bytes(a))}
                        for i, a in enumerate(arrays)]}
    same(routes.import_vllm_response(resp, **kw)[0], tables)
    lines = "\n".join(json.dumps({"meta_info": {"routed_experts": b64(a.tobytes())}})
                      for a in arrays)
    same(routes.import_sglang_text(lines, num_input_layers=H + mtp, top_k=K, **kw)[0], tables)
    chat = {"choices": [{"index": i, "sgl_ext": {"routed_experts": b64(a.tobytes())}}
                        for i, a in enumerate(arrays)]}
    same(routes.import_sglang_text(json.dumps(chat), num_input_layers=H + mtp, top_k=K, **kw)[0],
         tables)


@PROPS
@given(cases(), st.sampled_from(["int32", "int64", "int16"]))
def test_trtllm_layout_round_trips(case, dtype):
    E, K, lm, moe, H, mtp, tables = case
    if dtype == "int16" and E > 2**15:
        return
    kw = dict(num_experts=E, num_mtp_layers=mtp, **lm)
    # TensorRT-LLM: [seq_len-1, num_moe_layers(+MTP), K], no dense columns.
    arrays = [expand(t, list(range(len(moe))), len(moe), mtp, E, K).astype(dtype) for t in tables]
    got, rep = routes.import_trtllm_arrays([torch.from_numpy(a) for a in arrays], **kw)
    same(got, tables)
    assert rep["moe_layers"] == moe and rep["num_tokens"] == sum(t.shape[0] for t in tables)


@PROPS
@given(cases(), st.integers(0, 3), st.booleans())
def test_flashinfer_buffers_round_trip(case, spare, stacked):
    E, K, lm, moe, H, mtp, tables = case
    kw = dict(num_experts=E, num_mtp_layers=mtp, **lm)
    flat = torch.cat(tables)  # every row of a batch was routed: the tables' rows as they are
    N = flat.shape[0]
    cu = [0]
    for t in tables:
        cu.append(cu[-1] + t.shape[0])
    M = flat.shape[1]
    bufs = [torch.full((N + spare, K), 12345 % 32768, dtype=torch.int16) for _ in range(M + mtp)]
    for m in range(M):
        bufs[m][:N] = flat[:, m].to(torch.int16)
    for j in range(mtp):
        bufs[M + j][:N] = torch.arange(K, dtype=torch.int16) % E
    layers = torch.stack(bufs) if stacked else bufs
    got, rep = routes.import_flashinfer_replay(layers, cu, **kw)
    same(got, tables)
    assert rep["moe_layers"] == moe


@st.composite
def chunkings(draw, n):
    """Split points of n rows into pieces (first piece >= 1 row)."""
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4))))
    return [c for c in cuts if 0 < c < n]


@PROPS
@given(cases(), st.data())
def test_vllm_stream_chunks_round_trip(case, data):
    E, K, lm, moe, H, mtp, tables = case
    kw = dict(num_experts=E, num_mtp_layers=mtp, **lm)
    stream = routes.VllmRouteStream(**kw)
    sse = []
    want = {}
    for i, t in enumerate(tables):
        a = expand(t, moe, H, mtp, E, K)
        rows = a.shape[0]
        start = data.draw(st.integers(0, rows - 1), label="prompt_start")
        P = data.draw(st.integers(start + 1, rows), label="prompt_tokens")  # routes: P + G - 1
        G = rows + 1 - P
        want_t = t.clone()
        want_t[:start] = -1
        want[f"r{i}/0"] = want_t
        # Delta chunks: the prefill piece covers [start, P), then one row per generated token,
        # coalesced at random split points.
        bounds = [start, P] + [P + c for c in data.draw(chunkings(G - 1), label="cuts")] + [rows]
        bounds = sorted(set(bounds))
        stream.set_prompt_start(f"r{i}/0", start)
        for j, (b, e) in enumerate(zip(bounds, bounds[1:])):
            new_tokens = (e + 1 - P) if j == 0 else (e - b)
            last = e == rows
            stream.add(f"r{i}/0", torch.from_numpy(a[b:e]), None, new_tokens,
                       P if j == 0 else None)
            sse.append({"request_id": f"r{i}", "routed_experts_prompt_start": start,
                        "choices": [{"index": 0, "token_ids": [1] * new_tokens,
                                     "routed_experts": b64(npy_bytes(a[b:e])),
                                     "finish_reason": "stop" if last else None}],
                        **({"usage": {"prompt_tokens": P}} if j == 0 else {})})
    for key, t in want.items():
        got, rep = stream.finish(key)
        same([got], [t])
    assert stream.pending() == []
    text = "\n".join("data: " + json.dumps(c) for c in sse) + "\ndata: [DONE]\n"
    got, rep = routes.import_vllm_response(text, **kw)
    same(got, list(want.values()))


# ---- corrupt and truncated input ---------------------------------------------------------------
def import_or_error(fn):
    try:
        return fn(), None
    except ValueError as e:
        assert OP.search(str(e)), f"message does not name the op: {e!r}"
        return None, e


@PROPS
@given(cases(), st.data())
def test_corrupt_or_truncated_engine_payloads_raise_or_say_so(case, data):
    E, K, lm, moe, H, mtp, tables = case
    kw = dict(num_experts=E, num_mtp_layers=mtp, **lm)
    t = tables[0]
    a = expand(t, moe, H, mtp, E, K)
    which = data.draw(st.sampled_from(["npy", "trtllm", "sglang", "stream"]), label="format")
    if which in ("npy", "trtllm"):
        arr = a if which == "npy" else expand(t, list(range(len(moe))), len(moe), mtp, E, K)
        raw = bytearray(npy_bytes(arr))
        cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
        mode = data.draw(st.sampled_from(["truncate", "flip"]), label="mode")
        if mode == "truncate":
            raw = raw[:cut]
        else:
            raw[cut] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        import tempfile
        with tempfile.NamedTemporaryFile(suffix=".npy") as f:
            f.write(bytes(raw))
            f.flush()
            imp = routes.import_vllm if which == "npy" else routes.import_trtllm
            res, err = import_or_error(lambda: imp([f.name], **kw))
        if mode == "truncate" and cut == 0 and which == "npy":
            assert res is not None and res[0] == []  # vllm sniffs content: empty JSONL, no record
        elif mode == "truncate":
            assert err is not None  # a strict prefix of a .npy file never imports
        elif res is not None:  # a flipped bit that still parses: ids valid, shape as declared
            for g in res[0]:
                assert int(g.min()) >= -1 and int(g.max()) < E
    elif which == "sglang":
        payload = b64(a.tobytes())
        P = a.shape[0]
        cut = data.draw(st.integers(0, len(payload) - 1), label="cut")
        rec = {"meta_info": {"routed_experts": payload[:cut], "prompt_tokens": P,
                             "completion_tokens": 1}}
        res, err = import_or_error(lambda: routes.import_sglang_text(
            json.dumps(rec), num_input_layers=H + mtp, top_k=K, **kw))
        if res is not None:  # decoded to whole rows: fewer tokens, and the report says so
            assert res[0][0].shape[0] < t.shape[0] and res[1]["warnings"]
    else:
        P = max(1, a.shape[0] - 1)
        chunks = [a[:P]] + [a[r:r + 1] for r in range(P, a.shape[0])]
        lines = []
        for j, c in enumerate(chunks):  # with continuous usage (stream_options), as R3 clients run
            lines.append("data: " + json.dumps({
                "request_id": "q", "choices": [{"index": 0, "token_ids": [1],
                                                "routed_experts": b64(npy_bytes(c)),
                                                "finish_reason": "stop" if j + 1 == len(chunks)
                                                else None}],
                "usage": {"prompt_tokens": P, "completion_tokens": j + 1}}))
        drop = data.draw(st.integers(0, len(lines) - 1), label="drop")
        mode = data.draw(st.sampled_from(["drop", "truncate", "repeat"]), label="mode")
        if mode == "drop":
            kept = lines[:drop] + lines[drop + 1:]
        elif mode == "truncate":
            kept = lines[:drop]
        else:
            kept = lines[:drop + 1] + [lines[drop]] + lines[drop + 1:]
        res, err = import_or_error(lambda: routes.import_vllm_response("\n".join(kept) + "\n", **kw))
        if kept == lines:
            same(res[0], [t])
        elif kept:
            assert err is not None, (mode, drop, len(lines))
        else:
            assert res is not None and res[0] == []  # nothing recorded, nothing imported


# ---- examples and hostile uses -----------------------------------------------------------------
@pytest.mark.hostile(tried="a vLLM stream chunk that repeats the earlier routes (cumulative)",
                     gets="ValueError naming the request, the chunk and 'an overlap'")
def test_stream_chunk_repeating_earlier_routes_is_an_overlap():
    s = routes.VllmRouteStream(num_experts=8)
    a = np.array([[[1, 2]], [[3, 4]], [[5, 6]]], dtype=np.int32)
    s.add("r", a[:2], new_tokens=1, prompt_tokens=2)
    with pytest.raises(ValueError, match=r"request 'r' chunk 1: routes now end at token 5 .* an "
                                         r"overlap"):
        s.add("r", a, new_tokens=1)
    s.add("r", a[2:], new_tokens=1)  # the failed chunk changed nothing
    t, rep = s.finish("r")
    assert t.tolist() == [[[1, 2]], [[3, 4]], [[5, 6]], [[-1, -1]]]


@pytest.mark.hostile(tried="a vLLM stream chunk with a different layer count than the first",
                     gets="ValueError naming the request, the chunk and both shapes")
def test_stream_chunk_with_another_layer_count():
    s = routes.VllmRouteStream(num_experts=8)
    s.add("r", np.zeros((2, 2, 1), dtype=np.int32))
    with pytest.raises(ValueError, match=r"request 'r' chunk 1: \[1, 3, 1\] routes, but the "
                                         r"stream's chunks have 2 layers and top_k 1"):
        s.add("r", np.zeros((1, 3, 1), dtype=np.int32))


@pytest.mark.hostile(tried="a recorded vLLM stream cut before its finish_reason chunk",
                     gets="ValueError: the request never finished, the stream is truncated")
def test_truncated_recorded_stream():
    chunk = {"request_id": "q", "choices": [{"index": 0, "token_ids": [1],
             "routed_experts": b64(npy_bytes(np.zeros((2, 1, 1), np.int32))),
             "finish_reason": None}]}
    with pytest.raises(ValueError, match=r"request 'q/0' \(and 0 more\) never got a chunk with "
                                         r"finish_reason: the stream is truncated"):
        routes.import_vllm_response("data: " + json.dumps(chunk) + "\n", num_experts=4)


def test_stream_chunks_as_vllm_sends_them_and_add_chunk_returns_finished_tables():
    s = routes.VllmRouteStream(num_experts=8, first_k_dense=1)
    a = np.array([[[0], [3]], [[0], [5]], [[0], [7]]], dtype=np.uint8)  # vLLM >= 0.22: uint8
    assert s.add_chunk({"request_id": "g", "choices": [{"index": 0, "token_ids": [9],
                        "routed_experts": b64(npy_bytes(a[:2])), "finish_reason": None}],
                        "usage": {"prompt_tokens": 2}}) == {}
    done = s.add_chunk("data: " + json.dumps({"request_id": "g", "choices": [
        {"index": 0, "token_ids": [9], "routed_experts": b64(npy_bytes(a[2:])),
         "finish_reason": "length"}]}))
    (table, rep), = done.values()
    assert list(done) == ["g/0"] and table.tolist() == [[[3]], [[5]], [[7]], [[-1]]]
    assert rep["moe_layers"] == [1] and s.add_chunk("data: [DONE]") == {}


@pytest.mark.hostile(tried="FlashInfer cu_seqlens that run past the replay buffers",
                     gets="ValueError naming cu_seqlens' end and the buffers' rows")
def test_flashinfer_cu_seqlens_past_the_buffers():
    bufs = [torch.zeros(4, 2, dtype=torch.int16)]
    with pytest.raises(ValueError, match=r"cu_seqlens ends at 6 but the buffers hold 4 rows"):
        routes.import_flashinfer_replay(bufs, [0, 6], num_experts=8)


@pytest.mark.hostile(tried="TensorRT-LLM routes imported with a layer map of another model",
                     gets="ValueError: the input's MoE layer count against the map's")
def test_trtllm_with_a_layer_map_that_does_not_fit():
    a = torch.zeros(3, 4, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"the input has 4 MoE layers .* the layer map has 2"):
        routes.import_trtllm_arrays([a], num_experts=8, moe_layer_freq="1,0,1")


def test_trtllm_files_and_flashinfer_error_names_the_token():
    with pytest.raises(ValueError, match=r"flashinfer \(batch rows 1\.\.2\) "
                                         r"\(sequence 1\): expert id 9 at token 0, MoE layer 0"):
        routes.import_flashinfer_replay([torch.tensor([[1], [9]], dtype=torch.int16)], [0, 1, 2],
                                        num_experts=8)
