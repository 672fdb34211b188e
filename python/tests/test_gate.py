"""router_gating_linear: values against the float64 reference, gradients (dtypes, gradcheck),
torch.autocast, batch invariance, errors."""
import pytest
import torch

import switchyard.torch as syt
import torch_ref as ref


def _inputs(gen, T, H, E, x_dtype, w_dtype, bias_dtype=None):
    x = torch.randn(T, H, generator=gen).to(x_dtype)
    w = (torch.randn(E, H, generator=gen) / H**0.5).to(w_dtype)
    b = torch.randn(E, generator=gen).to(bias_dtype) if bias_dtype is not None else None
    return x, w, b


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("T,H,E", [(0, 16, 4), (1, 7, 1), (7, 33, 8), (129, 64, 64)])
def test_forward_matches_reference(gen, x_dtype, w_dtype, with_bias, T, H, E):
    x, w, b = _inputs(gen, T, H, E, x_dtype, w_dtype, torch.float32 if with_bias else None)
    out = syt.router_gating_linear(x, w, b, router_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (T, E)
    want = ref.gating_linear(x, w, b)
    # fp32 accumulation of exact bf16/fp32 products over H terms.
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5 * H**0.5)


def test_fp64_router_dtype(gen):
    x, w, b = _inputs(gen, 9, 40, 6, torch.float64, torch.float32, torch.float64)
    out = syt.router_gating_linear(x, w, b, router_dtype=torch.float64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref.gating_linear(x, w, b), rtol=1e-12, atol=1e-12)


def test_leading_dims_kept(gen):
    x = torch.randn(5, 3, 16, generator=gen)  # [seq, batch, hidden] as Megatron passes it
    w = torch.randn(8, 16, generator=gen)
    out = syt.router_gating_linear(x, w)
    assert out.shape == (5, 3, 8)
    torch.testing.assert_close(out.double(), ref.gating_linear(x, w), rtol=1e-5, atol=1e-5)


def test_bias_is_applied_in_forward(gen):
    x, w, b = _inputs(gen, 4, 8, 3, torch.float32, torch.float32, torch.float32)
    with_b = syt.router_gating_linear(x, w, b)
    without = syt.router_gating_linear(x, w)
    torch.testing.assert_close(with_b - without, b.expand(4, 3), rtol=0, atol=1e-6)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float32)])
def test_backward_dtypes_and_values(gen, x_dtype, w_dtype):
    T, H, E = 23, 48, 16
    x, w, b = _inputs(gen, T, H, E, x_dtype, w_dtype, torch.float32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    b.requires_grad_(True)
    out = syt.router_gating_linear(x, w, b)
    g = torch.randn(T, E, generator=gen)
    out.backward(g)
    assert x.grad.dtype == x_dtype and w.grad.dtype == w_dtype and b.grad.dtype == torch.float32
    gd = g.double()
    want_x = gd @ w.detach().double()
    want_w = gd.t() @ x.detach().double()
    tol = dict(rtol=1e-2, atol=1e-2) if torch.bfloat16 in (x_dtype, w_dtype) else dict(
        rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), want_x, **(tol if x_dtype == torch.bfloat16 else
                                                         dict(rtol=1e-5, atol=1e-5)))
    torch.testing.assert_close(w.grad.double(), want_w, **(tol if w_dtype == torch.bfloat16 else
                                                         dict(rtol=1e-5, atol=1e-5)))
    torch.testing.assert_close(b.grad.double(), gd.sum(0), rtol=1e-5, atol=1e-5)
    # bf16 grads are the fp32-accumulated value rounded once (nearest even).
    if x_dtype == torch.bfloat16:
        torch.testing.assert_close(x.grad, want_x.float().to(torch.bfloat16), rtol=1e-2, atol=1e-2)


def test_gradcheck_fp64(gen):
    # router_dtype fp64 with x and bias in fp64. The engine keeps the gate weight in bf16/fp32
    # (Megatron-Core's router weight is fp32), so the weight enters as an fp32 constant here and
    # grad_weight is checked against the float64 reference in test_backward_dtypes_and_values.
    x = torch.randn(6, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 10, generator=gen, dtype=torch.float32)
    b = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, b: syt.router_gating_linear(x, w, b, router_dtype=torch.float64), (x, b))
    wd = w.double().requires_grad_(True)
    out = syt.router_gating_linear(x, w.requires_grad_(True), b, router_dtype=torch.float64)
    g = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    out.backward(g)
    (ref.gating_linear(x.detach(), wd, b.detach()) * g).sum().backward()
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-6, atol=1e-6)


def test_autocast_keeps_fp32(gen):
    x, w, b = _inputs(gen, 17, 32, 8, torch.float32, torch.float32, torch.float32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = syt.router_gating_linear(x, w, b)
        # Peer under autocast: a plain linear is cast to bf16.
        assert torch.nn.functional.linear(x, w, b).dtype == torch.bfloat16
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref.gating_linear(x.detach(), w.detach(), b),
                               rtol=1e-5, atol=1e-5)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = syt.router_gating_linear(x, w, b)
        loss = (out * out).sum()
    loss.backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    gd = 2 * ref.gating_linear(x.detach(), w.detach(), b)
    torch.testing.assert_close(x.grad.double(), gd @ w.detach().double(), rtol=1e-4, atol=1e-4)


def test_batch_invariance(gen):
    x, w, b = _inputs(gen, 64, 96, 32, torch.bfloat16, torch.bfloat16, torch.float32)
    full = syt.router_gating_linear(x, w, b)
    for lo, hi in [(0, 1), (5, 6), (13, 40), (63, 64)]:
        part = syt.router_gating_linear(x[lo:hi], w, b)
        assert torch.equal(part, full[lo:hi]), (lo, hi)


def test_non_contiguous_input(gen):
    x = torch.randn(16, 10, generator=gen).t()  # [10, 16], not contiguous
    w = torch.randn(4, 16, generator=gen)
    out = syt.router_gating_linear(x, w)
    torch.testing.assert_close(out.double(), ref.gating_linear(x, w), rtol=1e-5, atol=1e-5)


def test_errors():
    x = torch.randn(4, 8)
    w = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"router_gating_linear.*weight"):
        syt.router_gating_linear(x, torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"router_gating_linear.*weight"):
        syt.router_gating_linear(x, w.to(torch.int32))
    with pytest.raises(ValueError, match=r"router_gating_linear.*bias"):
        syt.router_gating_linear(x, w, torch.randn(4))
    with pytest.raises(ValueError, match=r"router_dtype"):
        syt.router_gating_linear(x, w, router_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be a torch.Tensor"):
        syt.router_gating_linear(x.numpy(), w)
    bad = x.clone()
    bad[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"token 2"):
        syt.router_gating_linear(bad, w)
