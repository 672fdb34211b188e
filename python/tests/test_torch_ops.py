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
                                  "input_jitter", "route_sink"}


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
