"""switchyard's Megatron-Core-style TopKRouter under torch.compile and torch.export: the gate,
jitter and top-k routing are torch.library operators, so a router forward traces into one graph
(0 graph breaks, fullgraph=True) with the same ids, weights and gradients as eager (the same engine
kernels run in both: ids and floats bitwise), replays a given id table, does not recompile for a
new token count once dynamic, and exports."""
import pytest
import torch
import torch._dynamo.testing

import switchyard as sy
import switchyard.torch as syt

_CONFIGS = {
    "softmax-aux": dict(num_experts=8, top_k=2, aux_loss_type="aux_loss", aux_loss_coeff=0.01,
                        z_loss_coeff=0.001),
    "sigmoid-groups": dict(num_experts=16, top_k=4, score_function="sigmoid", num_groups=4,
                           group_topk=2, topk_scaling_factor=2.5),
    "capacity": dict(num_experts=4, top_k=2, capacity_factor=1.0, token_drop_policy="position"),
}
_DTYPES = [None, torch.float32, torch.float64]


def _router(name, router_dtype, bias=False, expert_bias=False):
    torch.manual_seed(5)
    return syt.TopKRouter(24, sy.RouterConfig(**_CONFIGS[name]), router_dtype=router_dtype,
                          bias=bias, enable_expert_bias=expert_bias)


def _step(router, x, replay=None):
    w, idx = router(x, replay)
    loss = (w.float() * torch.arange(1, w.shape[-1] + 1)).sum()
    return loss, w, idx


def _grads(router, x):
    return [x.grad] + [p.grad for p in router.parameters()]


@pytest.mark.parametrize("router_dtype", _DTYPES, ids=lambda d: str(d)[6:] if d else "None")
@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_topk_router_compiles_with_fullgraph_and_matches_eager(name, router_dtype):
    eager = _router(name, router_dtype, bias=True, expert_bias=name != "capacity")
    compiled_router = _router(name, router_dtype, bias=True, expert_bias=name != "capacity")
    x = torch.randn(3, 5, 24)
    explain = torch._dynamo.explain(compiled_router)(x.clone().requires_grad_())
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled_router.local_tokens_per_expert = (
        None if compiled_router.local_tokens_per_expert is None
        else torch.zeros_like(compiled_router.local_tokens_per_expert))
    step = torch.compile(_step, fullgraph=True, backend="aot_eager")
    for T in (15, 15):
        xe = torch.randn(T, 24).requires_grad_()
        xc = xe.detach().clone().requires_grad_()
        le, we, ie = _step(eager, xe)
        lc, wc, ic = step(compiled_router, xc)
        assert torch.equal(ie, ic)
        assert torch.equal(we, wc)
        le.backward()
        lc.backward()
        for ge, gc in zip(_grads(eager, xe), _grads(compiled_router, xc)):
            assert torch.equal(ge, gc)
        assert eager.last_info.aux_loss == compiled_router.last_info.aux_loss
        assert eager.last_info.num_native_rows == compiled_router.last_info.num_native_rows == T
        assert torch.equal(eager.last_info.num_tokens_per_expert,
                           compiled_router.last_info.num_tokens_per_expert)
    if eager.local_tokens_per_expert is not None:
        assert torch.equal(eager.local_tokens_per_expert, compiled_router.local_tokens_per_expert)


def test_compiled_router_replays_an_id_table_as_eager():
    eager, compiled_router = _router("softmax-aux", None), _router("softmax-aux", None)
    step = torch.compile(_step, fullgraph=True, backend="aot_eager")
    x = torch.randn(9, 24)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(9)])
    ids[::4] = -1  # routed natively
    _, we, ie = _step(eager, x, ids)
    _, wc, ic = step(compiled_router, x, ids)
    assert torch.equal(ie, ic) and torch.equal(we, wc)
    assert torch.equal(ic[1::4][ids[1::4] >= 0].view(-1), ids[1::4][ids[1::4] >= 0].view(-1))
    assert compiled_router.last_info.num_replayed_rows == 6
    assert compiled_router.last_info.num_native_rows == 3


def test_compiled_router_does_not_recompile_for_new_token_counts():
    router = _router("softmax-aux", torch.float32)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = torch.compile(_step, fullgraph=True, backend=counter, dynamic=True)
    warm = None
    for i, T in enumerate((6, 11, 3, 17, 8, 40)):
        x = torch.randn(T, 24, requires_grad=True)
        loss, w, idx = step(router, x)
        loss.backward()
        assert idx.shape == (T, 2) and router.last_info.num_native_rows == T
        if i == 1:
            # Warm-up: the first call sees last_info None, the second a RouteInfo (one guard).
            warm = counter.frame_count
    assert warm <= 2 and counter.frame_count == warm


@pytest.mark.parametrize("router_dtype", [None, torch.float32])
def test_topk_router_exports_with_static_and_dynamic_token_counts(router_dtype):
    router = _router("sigmoid-groups", router_dtype, bias=True).eval()

    class Wrap(torch.nn.Module):
        def __init__(self, r):
            super().__init__()
            self.r = r

        def forward(self, x):
            return self.r(x)

    x = torch.randn(10, 24)
    ref_w, ref_idx = router(x)
    ep = torch.export.export(Wrap(router), (x,))
    w, idx = ep.module()(x)
    assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)
    T = torch.export.Dim("T", min=2, max=4096)
    ep = torch.export.export(Wrap(router), (x,), dynamic_shapes={"x": {0: T}})
    for n in (3, 10, 33):
        xn = torch.randn(n, 24)
        w, idx = ep.module()(xn)
        rw, ridx = router(xn)
        assert torch.equal(idx, ridx) and torch.equal(w, rw)
    names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "switchyard.topk_route.default" in names
