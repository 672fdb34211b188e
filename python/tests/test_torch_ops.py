"""switchyard's operators under torch.ops.switchyard: each passes torch.library.opcheck (schema,
fake kernel, registered autograd, AOT dispatch with dynamic shapes), and the public functions of
switchyard.torch that call them trace into one graph under torch.compile(fullgraph=True) with the
same bits as in eager (the same engine kernels run in both)."""
import pytest
import torch

import switchyard.torch as syt
from switchyard import _torch_ops as ops


def _gate_samples():
    g = torch.Generator().manual_seed(33)
    out = []
    for T, H, E in ((7, 24, 8), (1, 5, 3), (0, 16, 4)):
        for dtype in (torch.float32, torch.bfloat16):
            for with_bias in (False, True):
                x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
                w = torch.randn(E, H, generator=g).to(dtype).requires_grad_()
                b = torch.randn(E, generator=g).to(dtype).requires_grad_() if with_bias else None
                out.append((x, w, b, torch.float32))
    x = torch.randn(5, 12, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(6, 12, generator=g).requires_grad_()
    out.append((x, w, None, torch.float64))
    return out


@pytest.mark.parametrize("args", _gate_samples(), ids=lambda a: (
    f"T{a[0].shape[0]}-{str(a[0].dtype)[6:]}-{'bias' if a[2] is not None else 'nobias'}"
    f"-{str(a[3])[6:]}"))
def test_router_gating_linear_passes_opcheck(args):
    torch.library.opcheck(torch.ops.switchyard.router_gating_linear.default, args)
    x, w, b, rd = args
    g = torch.randn(x.shape[0], w.shape[0], dtype=rd)
    torch.library.opcheck(torch.ops.switchyard.router_gating_linear_backward.default,
                          (g, x.detach(), w.detach(), None if b is None else b.detach(), rd))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_input_jitter_passes_opcheck(dtype):
    x = torch.randn(4, 6, dtype=torch.float64).to(dtype).requires_grad_()
    for backward in (False, True):
        torch.library.opcheck(torch.ops.switchyard.input_jitter.default, (x, 0.1, 12345, backward))


def test_every_operator_is_registered_under_the_switchyard_namespace():
    for name in ops.OPERATORS:
        op = getattr(torch.ops.switchyard, name).default
        assert op.namespace == "switchyard"
    assert set(ops.OPERATORS) == {"router_gating_linear", "router_gating_linear_backward",
                                  "input_jitter", "route_sink", "topk_route",
                                  "topk_route_backward", "permute", "permute_backward",
                                  "unpermute", "unpermute_backward"}


class _Receiver:
    def __init__(self):
        self.got = []

    def take(self, ids, batch, seq):
        self.got.append((ids, batch, seq))


def test_route_sink_passes_opcheck_and_hands_ids_out_of_a_compiled_graph():
    r = _Receiver()
    key = ops.add_route_sink(r.take)
    assert ops.route_sink_owner(key) is r
    ids = torch.tensor([[3, 1], [0, 2], [5, 4]])
    token = torch.empty(0)
    torch.library.opcheck(torch.ops.switchyard.route_sink.default, (ids, token, key, 1, 3))
    r.got.clear()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(logits):
        top = logits.topk(2, dim=-1).indices
        ops.route_sink(top, token, key, 1, logits.shape[0])
        return top + 0

    for T in (3, 5, 4):
        logits = torch.randn(T, 6)
        out = f(logits)
        got, batch, seq = r.got[-1]
        assert torch.equal(got, out) and (batch, seq) == (1, T)
    assert len(r.got) == 3
    del r  # held weakly: a collected receiver is skipped
    ops.route_sink(ids, token, key, 1, 3)
    assert ops.route_sink_owner(key) is None


def test_gate_operator_fake_kernel_gives_shapes_and_router_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(3, 5, 16, dtype=torch.bfloat16)
        w = torch.empty(8, 16, dtype=torch.bfloat16)
        y = syt.router_gating_linear(x, w, None, router_dtype=torch.float64)
    assert y.shape == (3, 5, 8) and y.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_gate_forward_and_backward_equal_eager_bitwise(dtype):
    # One graph (fullgraph), the engine's kernels inside it: the same bits as eager, gradients
    # included (the backward operator is in the compiled backward graph).
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, 32, generator=g).to(dtype)
    w = torch.randn(8, 32, generator=g).to(dtype)
    b = torch.randn(8, generator=g).to(dtype)

    def f(x, w, b):
        logits = syt.router_gating_linear(x, w, b, router_dtype=torch.float32)
        return (logits.softmax(-1) * torch.arange(8.0)).sum()

    def run(fn):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        loss = fn(xs, ws, bs)
        loss.backward()
        return loss.detach(), xs.grad, ws.grad, bs.grad

    eager = run(f)
    compiled = run(torch.compile(f, fullgraph=True, backend="aot_eager"))
    for e, c in zip(eager, compiled):
        assert e.dtype == c.dtype and torch.equal(e, c)


@pytest.mark.parametrize("dtype,router_dtype,bias", [
    (torch.float32, torch.float32, True), (torch.bfloat16, torch.float32, False),
    (torch.float64, torch.float64, True)], ids=["fp32-bias", "bf16", "fp64-bias"])
def test_eager_gate_function_equals_the_operator_bitwise(dtype, router_dtype, bias):
    # An eager call on CPU tensors takes the operator's autograd.Function twin (no dispatch
    # cost): the same kernels, so the same logits and gradients bit for bit, in the same dtypes.
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 7, 24, generator=g).to(dtype)
    w = torch.randn(8, 24, generator=g).to(torch.float32 if dtype == torch.float64 else dtype)
    b = torch.randn(8, generator=g).to(w.dtype) if bias else None
    grad = torch.randn(2, 7, 8, generator=g, dtype=torch.float64)

    def run(gate):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        bs = None if b is None else b.clone().requires_grad_()
        y = gate(xs.reshape(-1, 24), ws, bs, router_dtype).view(2, 7, 8)
        y.backward(grad.to(y.dtype))
        return y.detach(), xs.grad, ws.grad, None if bs is None else bs.grad, y.grad_fn

    eager = run(lambda *a: syt.router_gating_linear(*a[:3], router_dtype=a[3]))
    op = run(ops.router_gating_linear)
    assert "RouterGatingLinear" in type(eager[4].next_functions[0][0]).__name__
    assert "RouterGatingLinear" not in type(op[4].next_functions[0][0]).__name__
    for e, o in zip(eager[:4], op[:4]):
        assert (e is None) == (o is None)
        if e is not None:
            assert e.dtype == o.dtype and torch.equal(e, o)
    for gate in (syt.router_gating_linear, ops.router_gating_linear):  # no double backward
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = gate(xs.reshape(-1, 24), ws, b, router_dtype)
        (gx,) = torch.autograd.grad((y ** 2).sum(), xs, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice|no autograd formula"):
            gx.sum().backward()


def test_gate_under_autocast_stays_in_router_dtype_when_compiled():
    x = torch.randn(4, 16)
    w = torch.randn(8, 16)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return syt.router_gating_linear(x, w, router_dtype=torch.float32)

    y = f(x, w)
    assert y.dtype == torch.float32
    assert torch.equal(y, syt.router_gating_linear(x, w, router_dtype=torch.float32))


# --------------------------------------------------------------------------------------------------
# topk_route, permute, unpermute
# --------------------------------------------------------------------------------------------------
_ROUTE_CONFIGS = {
    "softmax": dict(num_experts=8, top_k=2),
    "sigmoid-groups": dict(num_experts=16, top_k=4, score_function="sigmoid", num_groups=4,
                           group_topk=2, topk_scaling_factor=2.5),
    "pre-softmax-aux-z": dict(num_experts=8, top_k=2, pre_softmax=True, aux_loss_type="aux_loss",
                              aux_loss_coeff=0.01, z_loss_coeff=0.001),
    "seq-aux": dict(num_experts=6, top_k=3, aux_loss_type="seq_aux_loss", aux_loss_coeff=0.1),
    "capacity": dict(num_experts=4, top_k=2, capacity_factor=0.5, pad_to_capacity=True),
    "top-k-all": dict(num_experts=4, top_k=4),
    "one-expert": dict(num_experts=1, top_k=1),
    "quantile": dict(num_experts=4, top_k=2, aux_loss_type="quantile_balancing"),
}


def _route_args(name, T, dtype, *, replay=False, mask=False, bias=False, training=True, seed=0):
    from switchyard import RouterConfig
    cfg = RouterConfig(**_ROUTE_CONFIGS[name])
    E, K = cfg.num_experts, cfg.top_k
    g = torch.Generator().manual_seed(1000 + T + seed)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    replay_idx = None
    if replay:
        replay_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) \
            if T else torch.empty(0, K, dtype=torch.int64)
        replay_idx[::3] = -1  # every third row routed natively
    padding_mask = (torch.arange(T) % 4 == 1) if mask else None
    expert_bias = torch.randn(E, generator=g) * 0.1 if bias else None
    seq = 0
    if name == "seq-aux":
        seq = 1 if T == 0 else next(s for s in (3, 2, 1) if T % s == 0)
    return (logits, ops.config_key(cfg), expert_bias, replay_idx, padding_mask, None, "error", 3,
            seq, training, 0, 0, 1.0), cfg


_ROUTE_CASES = [
    ("softmax", 7, torch.float32, {}), ("softmax", 0, torch.float32, {}),
    ("softmax", 1, torch.bfloat16, {}), ("softmax", 12, torch.float64, {"replay": True}),
    ("sigmoid-groups", 9, torch.float32, {"bias": True}),
    ("pre-softmax-aux-z", 10, torch.float32, {"mask": True}),
    ("pre-softmax-aux-z", 10, torch.float32, {"training": False}),
    ("seq-aux", 12, torch.float32, {"replay": True}),
    ("capacity", 11, torch.float32, {}), ("top-k-all", 5, torch.bfloat16, {"mask": True}),
    ("one-expert", 3, torch.float32, {}), ("quantile", 8, torch.float32, {}),
]


@pytest.mark.parametrize("case", _ROUTE_CASES, ids=lambda c: f"{c[0]}-T{c[1]}-{str(c[2])[6:]}-"
                         + "-".join(k for k, v in c[3].items() if v is not False) +
                         ("eval" if c[3].get("training") is False else ""))
def test_topk_route_passes_opcheck(case):
    name, T, dtype, kw = case
    args, _ = _route_args(name, T, dtype, **kw)
    torch.library.opcheck(torch.ops.switchyard.topk_route.default, args)
    w = ops.topk_route(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])[0]
    g = torch.randn(w.shape, dtype=torch.float64).to(w.dtype)
    torch.library.opcheck(torch.ops.switchyard.topk_route_backward.default,
                          (g, args[0].detach()) + args[1:])


@pytest.mark.parametrize("case", _ROUTE_CASES, ids=lambda c: f"{c[0]}-T{c[1]}-{str(c[2])[6:]}")
def test_topk_route_operator_equals_the_engine_autograd_path(case):
    """The operator path of syt.topk_route against the engine's stateful autograd.Function (its
    saved RouteResult): ids, counts and row kinds bitwise, weights and logits' gradient bitwise
    (the same engine kernels, and the backward routes the same inputs again)."""
    name, T, dtype, kw = case
    args, cfg = _route_args(name, T, dtype, **kw)
    logits, _, bias, replay_idx, mask, _, _, layer, seq, training = args[:10]
    inputs = syt.RouteInputs(expert_bias=bias, replay_idx=replay_idx, padding_mask=mask)
    opts = syt.RouteOptions(layer=layer, seq_length=seq or None, training=training,
                            aux_loss_grad_scale=0.5)
    x1 = logits.detach().clone().requires_grad_()
    w1, i1, info1 = syt._topk_route(x1, cfg, inputs, opts, None, operator=True)
    box = []
    x2 = logits.detach().clone().requires_grad_()
    w2, i2 = syt._TopKRoute.apply(x2, cfg, bias, replay_idx, mask, None, "error", layer, seq, 0.5,
                                  False, (0, 0, training, None, None), None, box)
    info2 = syt.RouteInfo(box[0])
    assert torch.equal(i1, i2) and i1.dtype == torch.int64
    assert torch.equal(w1, w2) and w1.dtype == dtype
    assert torch.equal(info1.num_tokens_per_expert, info2.num_tokens_per_expert)
    for k in ("aux_loss", "aux_loss_parts", "z_loss", "expert_capacity", "pad_to_capacity",
              "expert_alignment", "num_dropped", "num_replayed_rows", "num_native_rows",
              "num_padded_rows", "num_invalid_replay_rows"):
        assert getattr(info1, k) == getattr(info2, k), k
    if T:
        g = torch.randn(w1.shape, generator=torch.Generator().manual_seed(T)).to(dtype)
        (w1 * g).sum().backward()
        (w2 * g).sum().backward()
        assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize("operator", [True, False], ids=["operator", "eager-function"])
def test_topk_route_backward_uses_the_forwards_expert_bias_after_an_in_place_update(operator):
    from switchyard import RouterConfig
    cfg = RouterConfig(num_experts=8, top_k=2)
    logits = torch.randn(6, 8, requires_grad=True)
    bias = torch.zeros(8)

    def route():
        return syt._topk_route(logits, cfg, syt.RouteInputs(expert_bias=bias), None, None,
                               operator=operator)
    w, _, _ = route()
    w.sum().backward()
    ref = logits.grad.clone()
    logits.grad = None
    w, _, _ = route()
    bias.add_(torch.linspace(-5, 5, 8))  # would change the selection if the backward read it
    w.sum().backward()
    assert torch.equal(logits.grad, ref)


def test_topk_route_operator_names_a_bad_config_string():
    with pytest.raises(ValueError, match=r"\[topk_route\] config must be"):
        ops.topk_route(torch.randn(2, 4), "not json", None, None, None, None, "error", -1, 0,
                       True, 0, 0, 1.0)


def _plan_case(T, E, K, dup=False, **plan_kw):
    g = torch.Generator().manual_seed(7 * T + E + K)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.int64)
    if T:
        idx[1::4] = -1  # masked rows
        if dup and K > 1:
            idx[::3, 1] = idx[::3, 0]  # an expert repeated within a row: one merged pair
    w = torch.rand(T, K, generator=g)
    plan = syt.routing_plan(idx, w, E, **plan_kw)
    return idx, w, plan


_PLAN_CASES = [(7, 4, 2, False, {}), (0, 3, 1, False, {}), (1, 1, 1, False, {}),
               (9, 8, 3, True, {}), (12, 4, 2, False, {"expert_alignment": 4}),
               (10, 4, 2, True, {"capacity_factor": 0.5, "pad_to_capacity": True})]


@pytest.mark.parametrize("case", _PLAN_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-K{c[2]}" +
                         ("-dup" if c[3] else "") + "".join(f"-{k}" for k in c[4]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_and_unpermute_pass_opcheck(case, dtype):
    T, E, K, dup, kw = case
    idx, w, plan = _plan_case(T, E, K, dup, **kw)
    rows = syt._plan_rows(plan)
    x = torch.randn(T, 5).to(dtype).requires_grad_()
    torch.library.opcheck(torch.ops.switchyard.permute.default, (x,) + rows)
    torch.library.opcheck(torch.ops.switchyard.permute_backward.default,
                          (torch.randn(plan.num_rows, 5).to(dtype),) + rows)
    p = torch.randn(plan.num_rows, 5).to(dtype).requires_grad_()
    for weights in (w.clone().requires_grad_(), None):
        torch.library.opcheck(torch.ops.switchyard.unpermute.default, (p, weights) + rows)
    for apply in (True, False):
        torch.library.opcheck(torch.ops.switchyard.unpermute_backward.default,
                              (torch.randn(T, 5).to(dtype), p.detach()) + rows + (apply,))


@pytest.mark.parametrize("case", _PLAN_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-K{c[2]}")
def test_permute_operators_equal_the_plan_kernels_and_their_backward(case):
    """syt.permute / unpermute (operators over the plan's row maps) against the bindings over the
    RoutingPlan object: forward and every gradient bitwise (the same kernels)."""
    from switchyard import _switchyard as C
    T, E, K, dup, kw = case
    idx, w, plan = _plan_case(T, E, K, dup, **kw)
    x = torch.randn(T, 6, requires_grad=True)
    y = syt.permute(x, plan)
    assert torch.equal(y, C.permute(x.detach(), plan))
    gy = torch.randn_like(y)
    y.backward(gy)
    assert torch.equal(x.grad, C.permute_backward(gy, plan))
    p = torch.randn(plan.num_rows, 6, requires_grad=True)
    wt = w.clone().requires_grad_()
    out = syt.unpermute(p, plan, wt)
    assert torch.equal(out, C.unpermute(p.detach(), plan, True))
    go = torch.randn_like(out)
    out.backward(go)
    gp, gw = C.unpermute_backward(go, p.detach(), plan, True)
    assert torch.equal(p.grad, gp) and torch.equal(wt.grad, gw)


def test_permute_operator_rejects_row_maps_that_index_out_of_bounds():
    idx, w, plan = _plan_case(5, 4, 2)
    rows = list(syt._plan_rows(plan))
    rows[0] = rows[0].clone()
    rows[0][0] = 5  # token 5 of 5
    with pytest.raises(ValueError, match=r"\[permute\] row_token must hold values in \[-1, 5\), "
                       r"got 5 at flat index 0"):
        ops.permute(torch.randn(5, 3), *rows)
    rows = list(syt._plan_rows(plan))
    rows[3] = rows[3].clone()
    rows[3][-1] += 1
    with pytest.raises(ValueError, match=r"\[unpermute\] token_offsets must start at 0"):
        ops.unpermute(torch.randn(plan.num_rows, 3), None, *rows)


def test_a_small_moe_of_the_operators_compiles_with_fullgraph_and_matches_eager():
    """Gate, top-k routing and unpermute of a plan's rows trace into one graph (0 breaks) with the
    same bits as eager, forward and backward."""
    from switchyard import RouterConfig
    cfg = RouterConfig(num_experts=8, top_k=2, aux_loss_type="aux_loss", aux_loss_coeff=0.01)
    key = ops.config_key(cfg)

    def f(x, weight):
        logits = syt.router_gating_linear(x, weight)
        w, idx, counts, stats, _ = ops.topk_route(logits, key, None, None, None, None, "error",
                                                  -1, 0, True, 0, 0, 1.0)
        return (w * x[:, :2]).sum() + stats[0], idx, counts

    x = torch.randn(9, 16, requires_grad=True)
    weight = torch.randn(8, 16, requires_grad=True)
    ref = f(x, weight)
    ref[0].backward()
    gx, gw = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    explain = torch._dynamo.explain(f)(x, weight)
    assert explain.graph_break_count == 0
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, weight)
    got[0].backward()
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    assert torch.equal(got[0], ref[0])
    assert torch.equal(x.grad, gx) and torch.equal(weight.grad, gw)
