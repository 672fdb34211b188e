"""Property-based fuzzing of the public Python API (hypothesis): shapes (0-sized included), strides
(transposed, sliced, expanded views), dtypes and values (ids out of range, -1 rows, NaN/Inf) for
switchyard.torch, switchyard.routes and the local switchyard.dist communicator.

The contract under test, for every generated call: it returns a result that matches the same call on
a contiguous copy (and, where there is one, the plain-torch reference), or it raises one of the
documented exception types (ValueError, IndexError, switchyard.BackendError / DataError) with a
message naming the op in brackets. Never a crash, never another exception type, never a different
answer for a strided input. Bounded for CI: derandomized (the same examples every run), a fixed
max_examples per property, no deadline (shared machines)."""
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import switchyard as sy
import switchyard.routes as syr
import switchyard.torch as syt

FUZZ = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ALLOWED = (ValueError, IndexError, sy.BackendError, sy.DataError)
OP = re.compile(r"\[[A-Za-z_.]+\]")


def expect_ok_or_documented_error(fn):
    """Runs fn(); returns (True, result) or (False, exception) for a documented error type with an
    op-named message. Anything else fails the property."""
    try:
        return True, fn()
    except ALLOWED as e:
        assert OP.search(str(e)), f"message does not name the op: {e!r}"
        return False, e


@st.composite
def layouts(draw, shape, dtype):
    """A tensor of `shape`/`dtype` in a random layout: contiguous, transposed back, a slice of a
    wider tensor, or an expanded (stride-0) view; values filled by the caller."""
    kind = draw(st.sampled_from(["contiguous", "sliced", "transposed", "expanded"]))
    if kind == "sliced" and len(shape) >= 1:
        wide = torch.zeros(*shape[:-1], shape[-1] + 3, dtype=dtype)
        return wide[..., 1:1 + shape[-1]]
    if kind == "transposed" and len(shape) == 2:
        return torch.zeros(shape[1], shape[0], dtype=dtype).t()
    if kind == "expanded" and len(shape) >= 1 and shape[0] > 0:
        return torch.zeros(1, *shape[1:], dtype=dtype).expand(*shape)
    return torch.zeros(*shape, dtype=dtype)


def fill_(t, values):
    """In-place fill that also works for expanded views (writes the base row)."""
    if t.stride() and 0 in t.stride():
        base = t[:1].clone()
        base.copy_(values[:1] if values.dim() else values)
        return base.expand_as(t)
    t.copy_(values)
    return t


floats = st.sampled_from([0.0, 1.0, -2.5, 1e30, -1e-30, float("nan"), float("inf"), float("-inf")])


# ---- switchyard.torch ------------------------------------------------------------------------------
@FUZZ
@given(st.data(), st.integers(0, 9), st.integers(1, 17), st.integers(1, 9),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int32]),
       st.booleans())
def test_router_gating_linear_any_layout(data, T, H, E, dtype, special):
    x = data.draw(layouts((T, H), dtype))
    w = data.draw(layouts((E, H), dtype))
    g = torch.Generator().manual_seed(T * 131 + H * 7 + E)
    if dtype.is_floating_point:
        x = fill_(x, torch.randn(T, H, generator=g).to(dtype))
        w = fill_(w, torch.randn(E, H, generator=g).to(dtype))
        if special and T > 0:
            x = x.contiguous()
            x[data.draw(st.integers(0, T - 1)), 0] = data.draw(floats)
    rd = torch.float64 if dtype == torch.float64 else torch.float32
    ok, out = expect_ok_or_documented_error(lambda: syt.router_gating_linear(x, w, router_dtype=rd))
    if ok:
        ref = x.contiguous().to(torch.float64) @ w.contiguous().to(torch.float64).t()
        assert out.shape == (T, E) and out.dtype == rd
        assert torch.isfinite(out).all()
        assert torch.allclose(out.to(torch.float64), ref, rtol=1e-5, atol=1e-5)
        again = syt.router_gating_linear(x.contiguous(), w.contiguous(), router_dtype=rd)
        assert torch.equal(out, again)  # strided input, bitwise the same answer


@FUZZ
@given(st.data(), st.integers(0, 12), st.sampled_from([1, 2, 4, 8]), st.integers(1, 8),
       st.sampled_from(["softmax", "sigmoid"]), st.booleans())
def test_topk_route_any_logits_and_replay(data, T, E, K, score, replay):
    K = min(K, E) if data.draw(st.booleans()) else K  # sometimes K > E on purpose
    logits = data.draw(layouts((T, E), torch.float32))
    g = torch.Generator().manual_seed(T * 17 + E * 3 + K)
    logits = fill_(logits, torch.randn(T, E, generator=g))
    if T and data.draw(st.booleans()):
        logits = logits.contiguous()
        logits[0, 0] = data.draw(floats)
    ids = None
    if replay:
        ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(-2, E + 1), min_size=K,
                                                       max_size=K), min_size=T, max_size=T)),
                           dtype=torch.int64).reshape(T, K)
    cfg = expect_ok_or_documented_error(
        lambda: sy.RouterConfig(num_experts=E, top_k=K, score_function=score))
    if not cfg[0]:
        return
    ok, out = expect_ok_or_documented_error(
        lambda: syt.topk_route(logits, cfg[1],
                               inputs=syt.RouteInputs(replay_idx=ids),
                               options=syt.RouteOptions(invalid_replay_rows="native")))
    if ok:
        w, idx, _ = out
        assert w.shape == (T, K) and idx.shape == (T, K)
        valid = idx >= 0
        assert ((idx < E) | ~valid).all()
        assert torch.isfinite(w).all()
        for row in idx.tolist():  # a row never repeats an expert
            got = [e for e in row if e >= 0]
            assert len(got) == len(set(got))


@FUZZ
@given(st.data(), st.integers(0, 10), st.integers(1, 9), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 3), st.sampled_from([torch.float32, torch.bfloat16]))
def test_local_dispatch_combine_round_trip(data, T, H, E, K, dtype):
    d = data.draw(st.sampled_from([syt.AlltoAllDispatcher, syt.AllGatherDispatcher]))(
        num_experts=E, ep_comm=sy.dist.local())
    g = torch.Generator().manual_seed(T * 5 + H + E * 11 + K)
    x = fill_(data.draw(layouts((T, H), dtype)), torch.randn(T, H, generator=g).to(dtype))
    idx = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, E), min_size=K, max_size=K),
                                          min_size=T, max_size=T)), dtype=torch.int64)
    idx = idx.reshape(T, K)
    p = fill_(data.draw(layouts((T, K), torch.float32)), torch.rand(T, K, generator=g))
    if T and data.draw(st.booleans()):
        p = p.contiguous()
        p[0, 0] = data.draw(floats)
    ok, out = expect_ok_or_documented_error(lambda: d.dispatch(x, p, idx))
    if not ok:
        return
    rx, rp, h = out
    y = d.combine(rx, h)
    # Reference in double: y_t = sum over distinct valid ids e of (sum of p at e) * x_t.
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        seen = {}
        for k in range(K):
            e = int(idx[t, k])
            if 0 <= e < E:
                seen[e] = seen.get(e, 0.0) + float(p[t, k])
        ref[t] = sum(seen.values()) * x[t].to(torch.float64) if seen else 0.0
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(y.to(torch.float64), ref, rtol=tol, atol=tol)


# ---- switchyard.routes -----------------------------------------------------------------------------
@st.composite
def tables(draw, L, K, E, max_T=20):
    T = draw(st.integers(0, max_T))
    t = draw(layouts((T, L, K), draw(st.sampled_from([torch.int32, torch.int64]))))
    ids = torch.tensor(draw(st.lists(st.integers(-1, E - 1), min_size=T * L * K,
                                     max_size=T * L * K)), dtype=t.dtype).reshape(T, L, K)
    return fill_(t, ids)


@st.composite
def ids_like(draw, a, lo, hi):
    """An int32 tensor of ``a``'s shape in any layout, every id drawn from [lo, hi]."""
    b = draw(layouts(tuple(a.shape), torch.int32))
    return fill_(b, torch.tensor(draw(st.lists(st.integers(lo, hi), min_size=a.numel(),
                                               max_size=a.numel())),
                                 dtype=torch.int32).reshape(a.shape))


@FUZZ
@given(st.data(), st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 8, 300]))
def test_routes_write_read_round_trip_any_layout(tmp_path_factory, data, L, K, E):
    ts = data.draw(st.lists(tables(L, K, E), min_size=1, max_size=4))
    path = tmp_path_factory.mktemp("fuzz") / "r.syr"
    syr.write(path, ts, num_experts=E)
    back = syr.read(path)
    assert len(back) == len(ts)
    for a, b in zip(back, ts):
        assert torch.equal(a, b.contiguous().to(torch.int32))


@FUZZ
@given(st.data(), st.integers(1, 3), st.integers(1, 2), st.integers(1, 4), st.integers(1, 3),
       st.sampled_from([0, 16]))
def test_pack_unpack_and_cp_split_any_layout(data, L, K, tp, cp, fp8):
    E = 8
    ts = data.draw(st.lists(tables(L, K, E), min_size=1, max_size=4))
    ok, out = expect_ok_or_documented_error(
        lambda: syr.pack_thd(ts, tp_size=tp, cp_size=cp, fp8_align=fp8, num_experts=E))
    if not ok:
        return
    packed, cu, cu_pad = out
    ref = syr.pack_thd([t.contiguous() for t in ts], tp_size=tp, cp_size=cp, fp8_align=fp8,
                       num_experts=E)
    assert torch.equal(packed, ref[0]) and cu == ref[1] and cu_pad == ref[2]
    for a, b in zip(syr.unpack_thd(packed, cu, cu_pad, num_experts=E), ts):
        assert torch.equal(a, b.contiguous().to(torch.int32))
    pieces = [syr.cp_zigzag_split(packed, cu_pad, cp, r, num_experts=E) for r in range(cp)]
    assert torch.equal(syr.cp_zigzag_gather(pieces, cu_pad, num_experts=E), packed)


@FUZZ
@given(st.data(), st.integers(1, 3), st.integers(1, 3))
def test_drift_and_load_of_strided_equal_contiguous(data, L, K):
    E = 8
    a = data.draw(tables(L, K, E))
    b = data.draw(ids_like(a, -1, E - 1))
    ok, d = expect_ok_or_documented_error(lambda: syr.drift(a, b, num_experts=E))
    if ok:
        assert d == syr.drift(a.contiguous(), b.contiguous(), num_experts=E)
        assert 0.0 <= d["decision_mismatch"] <= 1.0
    la = syr.expert_load([a, b], num_experts=E)
    lb = syr.expert_load([a.contiguous(), b.contiguous()], num_experts=E)
    assert torch.equal(la[0], lb[0]) and la[1:] == lb[1:]


@FUZZ
@given(st.binary(min_size=0, max_size=400))
def test_route_file_from_arbitrary_bytes(blob):
    ok, f = expect_ok_or_documented_error(lambda: syr.RouteFile.from_bytes(blob))
    if ok:
        for i in range(len(f)):
            expect_ok_or_documented_error(lambda: f[i])


@FUZZ
@given(st.text(max_size=40))
def test_parse_moe_layer_freq_any_text(text):
    ok, v = expect_ok_or_documented_error(lambda: syr.parse_moe_layer_freq(text))
    if ok:
        assert all(x in (0, 1) for x in v)


@FUZZ
@given(st.integers(-3, 3000))
def test_set_num_threads_any_int(n):
    before = sy.num_threads()
    ok, _ = expect_ok_or_documented_error(lambda: sy.set_num_threads(n))
    sy.set_num_threads(before)
    assert ok == (1 <= n <= 1024)



@FUZZ
@given(st.integers(1, 9), st.lists(st.tuples(st.sampled_from(["record", "pop", "fwd", "bwd"]),
                                             st.integers(0, 4)), max_size=12))
def test_router_replay_queues_match_a_fifo_model(K, ops):
    # The engine queues against two Python deques: same tables out, same errors, nothing consumed
    # by a call that fails.
    import collections
    r = sy.RouterReplay(top_k=K, layer=2)
    recorded, pending = collections.deque(), collections.deque()
    for n, (op, T) in enumerate(ops):
        t = torch.arange(T * K, dtype=torch.int32).reshape(T, K) + n
        if op == "record":
            r.record(t)
            recorded.append(t)
        elif op == "pop":
            ok, got = expect_ok_or_documented_error(r.pop_recorded)
            assert ok == bool(recorded)
            if ok:
                assert torch.equal(got, recorded.popleft())
        elif op == "fwd":
            got = r.replay_forward(t)
            assert torch.equal(got, t)
            pending.append(t)
        else:
            ok, got = expect_ok_or_documented_error(lambda: r.recompute(T))
            assert ok == (bool(pending) and pending[0].shape[0] == T)
            if ok:
                assert torch.equal(got, pending.popleft())
        assert (r.num_recorded, r.num_pending_recompute) == (len(recorded), len(pending))


@FUZZ
@given(st.data(), st.integers(1, 16), st.sampled_from([torch.float32, torch.float64, torch.int64]))
def test_update_expert_bias_any_values(data, E, cdtype):
    bias = torch.tensor(data.draw(st.lists(floats, min_size=E, max_size=E)), dtype=torch.float32)
    counts = torch.tensor(data.draw(st.lists(st.integers(0, 1000), min_size=E, max_size=E)),
                          dtype=cdtype)
    rate = data.draw(st.sampled_from([0.0, 1e-3, float("nan")]))
    ok, out = expect_ok_or_documented_error(lambda: syt.update_expert_bias(bias, counts, rate))
    if ok:
        assert out.shape == (E,)
        mean = counts.to(torch.float64).mean()
        ref = bias.to(torch.float64) + rate * torch.sign(mean - counts.to(torch.float64))
        finite = torch.isfinite(ref)
        assert torch.allclose(out.to(torch.float64)[finite], ref[finite], rtol=1e-6, atol=1e-6)


@FUZZ
@given(st.data(), st.integers(1, 3), st.integers(1, 4))
def test_row_mismatch_of_strided_equals_contiguous_and_the_sorted_rows(data, L, K):
    # routes.row_mismatch on views (transposed, sliced, expanded) and any ids: the contiguous
    # copy's counts, which are the sorted-row definition's (rows whose reference slots are all
    # >= 0, on kept tokens).
    E = 6
    a = data.draw(tables(L, K, E))
    b = data.draw(ids_like(a, -2, E))
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=a.shape[0],
                                           max_size=a.shape[0])), dtype=torch.bool)
    ok, got = expect_ok_or_documented_error(lambda: syr.row_mismatch(b, [a], mask))
    assert ok, got
    assert got == syr.row_mismatch(b.contiguous(), [a.contiguous()], mask)
    valid = (b >= 0).all(-1) & mask[:, None]
    differ = (a.long().sort(-1).values != b.long().sort(-1).values).any(-1) & valid
    assert got == (int(valid.sum()), [int(differ.sum())])
