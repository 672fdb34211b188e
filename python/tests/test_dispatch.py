"""Dispatchers in one process (local communicator, ep size 1) against the pure-PyTorch reference:
received rows, weights, counts, combine, gradients (adjoint and against float64 autograd),
capacity drops, errors. The mpirun runs (np 2 and 4) are in mpi_dispatch.py."""
import pytest
import torch

import switchyard as sy
import switchyard.torch as syt
import torch_ref as ref
from helpers import expert_weights, rank_inputs

DISPATCHERS = [syt.AlltoAllDispatcher, syt.AllGatherDispatcher]


def _experts(disp, recv_x, handle, W):
    """Apply local expert i's matrix to its block of rows."""
    out = []
    off = 0
    for i, e in enumerate(disp.local_expert_ids):
        n = int(handle.num_tokens_per_expert[i])
        out.append(recv_x[off:off + n] @ W[e].to(recv_x.dtype))
        off += n
    return torch.cat(out) if out else recv_x[:0]


@pytest.mark.parametrize("cls", DISPATCHERS)
@pytest.mark.parametrize("T,H,E,K", [(0, 8, 4, 2), (1, 5, 1, 1), (7, 16, 8, 2), (64, 32, 16, 4),
                                     (33, 8, 8, 8)])
def test_dispatch_matches_reference(cls, T, H, E, K):
    x, idx, probs = rank_inputs(3, 0, T, H, E, K)
    disp = cls(num_experts=E, ep_comm=sy.dist.local())
    recv_x, recv_p, h = disp.dispatch(x, probs, idx)
    rows, ws, srank, stok, counts = ref.dispatch_rows([x], [idx], [probs], E, 1, 0)
    assert torch.equal(recv_x, rows)
    assert torch.equal(recv_p, ws)
    assert torch.equal(h.num_tokens_per_expert, counts)
    assert torch.equal(h.recv_src_token.to(torch.int64), stok)
    assert int(h.num_tokens_per_expert.sum()) == h.num_recv_tokens == rows.shape[0]


@pytest.mark.parametrize("cls", DISPATCHERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_and_gradients(cls, dtype):
    T, H, E, K = 29, 12, 8, 3
    x, idx, probs = rank_inputs(5, 0, T, H, E, K, dtype=dtype)
    W = expert_weights(5, E, H)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    disp = cls(num_experts=E, ep_comm=sy.dist.local())
    recv_x, _, h = disp.dispatch(x, probs, idx)
    y = disp.combine(_experts(disp, recv_x, h, W), h)
    assert y.dtype == dtype and y.shape == (T, H)
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(9))
    (y.float() * g).sum().backward()

    xr = x.detach().double().requires_grad_(True)
    pr = probs.detach().double().requires_grad_(True)
    yr = ref.moe_combine(xr, idx, pr, lambda e, v: v @ W[e].double())
    (yr * g.double()).sum().backward()
    # bf16: expert outputs and y are rounded to bf16 (8 bits), and column 0 holds values up to ~30.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.25)
    torch.testing.assert_close(y.double(), yr.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)
    torch.testing.assert_close(probs.grad.double(), pr.grad, **tol)


@pytest.mark.parametrize("cls", DISPATCHERS)
def test_apply_probs_false(cls):
    T, H, E, K = 20, 8, 4, 2
    x, idx, probs = rank_inputs(6, 0, T, H, E, K)
    W = expert_weights(6, E, H)
    probs.requires_grad_(True)
    disp = cls(num_experts=E)
    recv_x, recv_p, h = disp.dispatch(x, probs, idx)
    y1 = disp.combine(_experts(disp, recv_x, h, W) * recv_p[:, None], h, apply_weights=False)
    y1.sum().backward()
    g1 = probs.grad.clone()
    probs.grad = None
    recv_x, recv_p, h = disp.dispatch(x, probs, idx)
    y2 = disp.combine(_experts(disp, recv_x, h, W), h)
    y2.sum().backward()
    torch.testing.assert_close(y1, y2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(probs.grad, g1, rtol=1e-5, atol=1e-5)


def test_dispatchers_bitwise_equal():
    T, H, E, K = 50, 16, 8, 4
    x, idx, probs = rank_inputs(8, 0, T, H, E, K)
    W = expert_weights(8, E, H)
    ys = []
    for cls in DISPATCHERS:
        disp = cls(num_experts=E)
        recv_x, _, h = disp.dispatch(x, probs, idx)
        ys.append(disp.combine(_experts(disp, recv_x, h, W), h))
    assert torch.equal(ys[0], ys[1])


def test_adjoint_dispatch_combine():
    # <dispatch(x), r> = <x, dispatch_backward(r)> and the same for combine, through autograd.
    T, H, E, K = 31, 6, 8, 3
    x, idx, probs = rank_inputs(10, 0, T, H, E, K)
    x = x.double().float().requires_grad_(True)
    disp = syt.AlltoAllDispatcher(num_experts=E)
    recv_x, _, h = disp.dispatch(x, probs, idx)
    r = torch.randn_like(recv_x)
    (gx,) = torch.autograd.grad((recv_x * r).sum(), x)
    lhs = (recv_x.double() * r.double()).sum()
    rhs = (x.detach().double() * gx.double()).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-5)

    e_out = torch.randn(h.num_recv_tokens, H, requires_grad=True)
    y = disp.combine(e_out, h)
    s = torch.randn(T, H)
    (ge,) = torch.autograd.grad((y * s).sum(), e_out)
    torch.testing.assert_close((y.double() * s.double()).sum(),
                               (e_out.detach().double() * ge.double()).sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops(policy):
    T, H, E, K = 40, 4, 4, 2
    x, idx, probs = rank_inputs(12, 0, T, H, E, K, skew=True)
    disp = syt.AlltoAllDispatcher(num_experts=E, capacity_factor=1.0, token_drop_policy=policy)
    recv_x, recv_p, h = disp.dispatch(x, probs, idx)
    keep = ref.capacity_keep(idx, probs, E, 1.0, policy)
    rows, ws, _, _, counts = ref.dispatch_rows([x], [idx], [probs], E, 1, 0, keep=[keep])
    assert h.num_dropped > 0
    assert torch.equal(h.num_tokens_per_expert, counts)
    assert torch.equal(recv_x, rows)
    assert torch.equal(recv_p, ws)
    W = expert_weights(12, E, H)
    y = disp.combine(_experts(disp, recv_x, h, W), h)
    yr = ref.moe_combine(x, idx, probs, lambda e, v: v @ W[e].double(), keep=keep)
    torch.testing.assert_close(y.double(), yr, rtol=1e-5, atol=1e-5)


def test_errors():
    x, idx, probs = rank_inputs(1, 0, 8, 4, 4, 2)
    with pytest.raises(ValueError, match="num_experts"):
        syt.AlltoAllDispatcher(num_experts=0)
    with pytest.raises(ValueError, match="token_drop_policy"):
        syt.AlltoAllDispatcher(num_experts=4, token_drop_policy="random")
    with pytest.raises(ValueError, match="ep_comm"):
        syt.AlltoAllDispatcher(num_experts=4, ep_comm="world")
    # Padding options are checked when the dispatcher is made, before any collective.
    for bad_alignment in (0, -16, 2.5, True):
        with pytest.raises(ValueError, match=rf"expert_alignment=.*{bad_alignment!r}"):
            syt.AlltoAllDispatcher(num_experts=4, expert_alignment=bad_alignment)
    with pytest.raises(ValueError, match="pad_to_capacity needs capacity_factor"):
        syt.AllGatherDispatcher(num_experts=4, pad_to_capacity=True)
    disp = syt.AlltoAllDispatcher(num_experts=4)
    bad = idx.clone()
    bad[5, 1] = 4
    with pytest.raises(ValueError, match=r"topk_idx\[5, 1\]=4"):
        disp.dispatch(x, probs, bad)
    with pytest.raises(ValueError, match=r"topk_idx"):
        disp.dispatch(x, probs, idx.float())
    with pytest.raises(ValueError, match=r"topk_weights"):
        disp.dispatch(x, probs.to(torch.bfloat16), idx)
    with pytest.raises(ValueError, match=r"x"):
        disp.dispatch(x.double(), probs, idx)
    with pytest.raises(ValueError, match=r"handle"):
        disp.combine(x, None)


@pytest.mark.parametrize("cls", DISPATCHERS)
@pytest.mark.parametrize("opts", [dict(expert_alignment=16),
                                  dict(capacity_factor=1.0, pad_to_capacity=True),
                                  dict(capacity_factor=1.0, pad_to_capacity=True,
                                       expert_alignment=8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_for_quantization_and_capacity(cls, opts, dtype):
    # Megatron-Core's moe_router_padding_for_quantization / moe_pad_expert_input_to_capacity:
    # every local expert's block is padded (counts as Megatron's), the padding rows are zero rows
    # with weight 0 and source -1, and y and every gradient equal the unpadded path's bitwise.
    T, H, E, K = 37, 8, 8, 2
    x, idx, probs = rank_inputs(14, 0, T, H, E, K, dtype=dtype, skew=True)
    W = expert_weights(14, E, H)
    plain = cls(num_experts=E, capacity_factor=opts.get("capacity_factor"),
                token_drop_policy="position")
    padded = cls(num_experts=E, token_drop_policy="position", **opts)
    results = []
    for disp in (plain, padded):
        xg = x.clone().requires_grad_(True)
        pg = probs.clone().requires_grad_(True)
        recv_x, recv_p, h = disp.dispatch(xg, pg, idx)
        # Row-wise experts (a GEMM's bits may depend on its row count) that give padding rows
        # non-zero outputs (a bias): combine must ignore them.
        scale = torch.repeat_interleave(W[:, 0, 0].abs() + 0.5, h.num_tokens_per_expert)
        y = disp.combine(recv_x * scale[:, None].to(dtype) + 1.0, h)
        (y.float() * torch.linspace(-1, 1, T * H).reshape(T, H)).sum().backward()
        results.append((recv_x, recv_p, h, y, xg.grad, pg.grad))
    (ux, up, uh, uy, ugx, ugp), (px, pp, ph, py, pgx, pgp) = results
    align = opts.get("expert_alignment", 1)
    assert torch.all(ph.num_tokens_per_expert % align == 0)
    assert torch.equal(ph.num_unpadded_tokens_per_expert, uh.num_tokens_per_expert)
    if opts.get("pad_to_capacity"):
        capacity = max(ph.num_tokens_per_expert.tolist())
        assert all(n == capacity for n in ph.num_tokens_per_expert.tolist())
    assert int(ph.num_tokens_per_expert.sum()) == ph.num_recv_tokens == px.shape[0]
    real = ph.recv_src_rank >= 0
    assert int(real.sum()) == ux.shape[0] < px.shape[0]
    assert torch.equal(px[real], ux) and torch.equal(pp[real], up)
    assert torch.count_nonzero(px[~real]) == 0 and torch.count_nonzero(pp[~real]) == 0
    assert torch.all(ph.recv_src_token[~real] == -1)
    assert torch.equal(py, uy) and torch.equal(pgx, ugx) and torch.equal(pgp, ugp)
