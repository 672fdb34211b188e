"""topk_route and TopKRouter against the pure-PyTorch reference (float64): ids, weights,
gradients (torch autograd of the reference, gradcheck, finite differences of the losses), score
functions, groups, scaling, expert bias, capacity, padding, auxiliary losses, autocast, errors."""
import math

import pytest
import torch

import switchyard as sy
import switchyard.torch as syt
import torch_ref as ref

CONFIGS = [
    dict(score_function="softmax"),
    dict(score_function="softmax", pre_softmax=True),
    dict(score_function="sigmoid"),
    dict(score_function="sqrtsoftplus", topk_scaling_factor=2.5),
    dict(score_function="sigmoid", num_groups=4, group_topk=2),
    dict(score_function="softmax", num_groups=8, group_topk=4, topk_scaling_factor=0.5),
]


def _cfg(E, K, **kw):
    return sy.RouterConfig(num_experts=E, top_k=K, **kw)


def _check(logits, E, K, kw, rtol=1e-5, **extra):
    cfg = _cfg(E, K, **kw)
    lg = logits.detach().clone().requires_grad_(True)
    probs, idx, info = syt.topk_route(
        lg, cfg, syt.RouteInputs(**{k: v for k, v in extra.items()
                                    if k in ("expert_bias", "replay_idx", "padding_mask")}),
        syt.RouteOptions(**{k: v for k, v in extra.items()
                            if k in ("invalid_replay_rows", "seq_length")}))
    lr = logits.detach().double().requires_grad_(True)
    pr, ir, aux, zl, rinfo = ref.topk_route(lr, E, K, **kw, **extra)
    assert probs.dtype == logits.dtype and idx.dtype == torch.int64
    assert torch.equal(idx, ir), (idx, ir)
    torch.testing.assert_close(probs.double(), pr.detach(), rtol=rtol, atol=rtol)
    assert torch.equal(info.num_tokens_per_expert, rinfo["num_tokens_per_expert"])
    assert info.num_dropped == rinfo["num_dropped"]
    assert (info.num_replayed_rows, info.num_native_rows, info.num_padded_rows,
            info.num_invalid_replay_rows) == (rinfo["replayed"], rinfo["native"], rinfo["padded"],
                                              rinfo["invalid"])
    assert math.isclose(info.aux_loss, float(aux), rel_tol=1e-5, abs_tol=1e-9)
    assert math.isclose(info.z_loss, float(zl), rel_tol=1e-5, abs_tol=1e-9)
    g = torch.randn(probs.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (probs.double() * g).sum().backward()
    ((pr * g).sum() + aux + zl).backward()
    torch.testing.assert_close(lg.grad.double(), lr.grad, rtol=rtol * 10, atol=rtol * 10)
    return probs, idx, info


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("T,E,K", [(0, 8, 2), (1, 8, 1), (7, 16, 4), (130, 32, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_route_matches_reference(gen, kw, T, E, K, dtype):
    if kw.get("num_groups") and (E % kw["num_groups"] or K > kw["group_topk"] * E // kw["num_groups"]
                                 or K < kw["group_topk"] or K % kw["group_topk"]):
        pytest.skip("group config does not fit this shape")
    logits = torch.randn(T, E, generator=gen, dtype=dtype) * 2
    _check(logits, E, K, kw, rtol=1e-5 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_expert_bias_selection_only(gen, score_function):
    T, E, K = 40, 16, 4
    logits = torch.randn(T, E, generator=gen)
    bias = torch.randn(E, generator=gen)
    probs, idx, _ = _check(logits, E, K, dict(score_function=score_function), expert_bias=bias)
    native = syt.topk_route(logits, _cfg(E, K, score_function=score_function))[1]
    assert not torch.equal(idx, native)  # the bias changed the selection


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity(gen, policy):
    T, E, K = 64, 8, 2
    logits = torch.randn(T, E, generator=gen)
    logits[:, 0] += 3  # an over-full expert
    _, idx, info = _check(logits, E, K, dict(capacity_factor=1.0, token_drop_policy=policy))
    assert info.num_dropped > 0 and info.expert_capacity == math.ceil(T * K / E)
    assert int((idx == 0).sum()) == info.expert_capacity


def test_padding_mask(gen):
    T, E, K = 12, 8, 2
    logits = torch.randn(T, E, generator=gen)
    mask = torch.zeros(T, dtype=torch.bool)
    mask[[0, 5, 11]] = True
    _, idx, info = _check(logits, E, K, dict(aux_loss_type="aux_loss", aux_loss_coeff=0.1,
                                             z_loss_coeff=0.01), padding_mask=mask)
    assert info.num_padded_rows == 3 and bool((idx[mask] == -1).all())


@pytest.mark.parametrize("kw", [
    dict(aux_loss_type="aux_loss", aux_loss_coeff=0.01),
    dict(aux_loss_type="aux_loss", aux_loss_coeff=0.1, z_loss_coeff=0.001,
         score_function="sigmoid"),
    dict(z_loss_coeff=0.01, pre_softmax=True),
    dict(aux_loss_type="seq_aux_loss", aux_loss_coeff=0.1, score_function="sqrtsoftplus"),
], ids=["aux", "aux+z-sigmoid", "z-pre", "seq-sqrtsoftplus"])
def test_losses_values_and_gradients(gen, kw):
    T, E, K = 48, 16, 4
    logits = torch.randn(T, E, generator=gen, dtype=torch.float64)
    extra = dict(seq_length=12) if kw.get("aux_loss_type") == "seq_aux_loss" else {}
    _, _, info = _check(logits, E, K, kw, rtol=1e-10, **extra)
    assert info.aux_loss > 0 or info.z_loss > 0


def test_loss_gradient_finite_differences(gen):
    # L(z) = <g, probs(z)> + aux_loss(z) + z_loss(z) with the engine's own values: its backward must
    # be the derivative of what it reports (Megatron adds the losses' gradients to the logits').
    T, E, K = 10, 8, 2
    cfg = _cfg(E, K, score_function="sigmoid", aux_loss_type="aux_loss", aux_loss_coeff=0.3,
               z_loss_coeff=0.05)
    z0 = torch.randn(T, E, generator=gen, dtype=torch.float64)
    g = torch.randn(T, K, generator=gen, dtype=torch.float64)

    def L(z):
        p, _, info = syt.topk_route(z, cfg)
        return float((p * g).sum()) + info.aux_loss + info.z_loss

    z = z0.clone().requires_grad_(True)
    p, _, _ = syt.topk_route(z, cfg)
    (p * g).sum().backward()
    h = 1e-6
    for (t, e) in [(0, 0), (3, 5), (9, 7), (4, 2)]:
        zp, zm = z0.clone(), z0.clone()
        zp[t, e] += h
        zm[t, e] -= h
        fd = (L(zp) - L(zm)) / (2 * h)
        assert abs(fd - float(z.grad[t, e])) < 1e-6, (t, e, fd, float(z.grad[t, e]))


def test_aux_loss_grad_scale(gen):
    T, E, K = 16, 8, 2
    cfg = _cfg(E, K, aux_loss_type="aux_loss", aux_loss_coeff=0.5)
    z = torch.randn(T, E, generator=gen, dtype=torch.float64)
    grads = []
    for scale in (1.0, 0.0, 2.0):
        zz = z.clone().requires_grad_(True)
        p, _, _ = syt.topk_route(zz, cfg, options=syt.RouteOptions(aux_loss_grad_scale=scale))
        (p * 0).sum().backward()  # probs unused: only the aux loss reaches the logits
        grads.append(zz.grad)
    assert float(grads[0].abs().sum()) > 0 and float(grads[1].abs().sum()) == 0
    torch.testing.assert_close(grads[2], 2 * grads[0])


def test_global_aux_loss_accumulates(gen):
    T, E, K = 20, 8, 2
    cfg = _cfg(E, K, aux_loss_type="global_aux_loss", aux_loss_coeff=0.1)
    state = sy.GlobalAuxLossState()
    counts = {}
    for step in range(3):
        z = torch.randn(T, E, generator=gen, dtype=torch.float64)
        _, _, info = syt.topk_route(z, cfg, inputs=syt.RouteInputs(global_aux_loss_state=state))
        _, _, aux, _, _ = ref.topk_route(z, E, K, aux_loss_type="global_aux_loss",
                                         aux_loss_coeff=0.1, global_counts=counts)
        assert math.isclose(info.aux_loss, float(aux), rel_tol=1e-10)
    assert state.steps == 3
    torch.testing.assert_close(state.num_tokens_per_expert, counts["sum"])
    state.reset()
    assert state.steps == 0
    with pytest.raises(ValueError, match="global_aux_loss"):
        syt.topk_route(torch.randn(4, E), cfg)


def test_gradcheck_fp64(gen):
    for kw in CONFIGS:
        cfg = _cfg(16, 4, **kw)
        z = torch.randn(6, 16, generator=gen, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda z: syt.topk_route(z, cfg)[0], (z,)), kw


def test_gradcheck_through_gate_fp64(gen):
    cfg = _cfg(8, 2, score_function="sigmoid", topk_scaling_factor=1.5)
    x = torch.randn(5, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 12, generator=gen)
    assert torch.autograd.gradcheck(
        lambda x: syt.topk_route(syt.router_gating_linear(x, w, router_dtype=torch.float64),
                                 cfg)[0], (x,))


def test_autocast_router(gen):
    cfg = _cfg(16, 4)
    router = syt.TopKRouter(hidden_size=32, config=cfg)
    x = torch.randn(24, 32, generator=gen, requires_grad=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        probs, idx = router(x)
    assert probs.dtype == torch.float32
    want_p, want_i, *_ = ref.topk_route(ref.gating_linear(x.detach(), router.weight.detach()),
                                        16, 4)
    assert torch.equal(idx, want_i)
    torch.testing.assert_close(probs.double(), want_p, rtol=1e-5, atol=1e-5)
    probs.sum().backward()
    assert x.grad.dtype == torch.float32 and router.weight.grad.dtype == torch.float32


def test_topk_router_module(gen):
    E, K, H = 16, 4, 24
    cfg = _cfg(E, K, score_function="sigmoid", aux_loss_type="aux_loss", aux_loss_coeff=0.01)
    router = syt.TopKRouter(hidden_size=H, config=cfg, router_dtype=torch.float32, bias=True,
                            enable_expert_bias=True)
    with torch.no_grad():
        router.bias.normal_(generator=gen)
    assert [n for n, _ in router.named_parameters()] == ["weight", "bias"]
    x = torch.randn(3, 10, H, generator=gen)  # [s, b, h]
    probs, idx = router(x)
    assert probs.shape == (3, 10, K) and idx.shape == (3, 10, K)
    logits = ref.gating_linear(x.reshape(-1, H), router.weight.detach(), router.bias.detach())
    _, want_i, aux, _, _ = ref.topk_route(logits, E, K, score_function="sigmoid",
                                          aux_loss_type="aux_loss", aux_loss_coeff=0.01)
    assert torch.equal(idx.reshape(-1, K), want_i)
    assert math.isclose(router.last_info.aux_loss, float(aux), rel_tol=1e-4)
    before = router.expert_bias.clone()
    router.update_expert_bias(1e-3)
    c = router.last_info.num_tokens_per_expert.double()
    torch.testing.assert_close(router.expert_bias - before,
                               (1e-3 * torch.sign(c.mean() - c)).float())


def test_errors():
    cfg = _cfg(8, 2)
    with pytest.raises(ValueError, match=r"logits"):
        syt.topk_route(torch.randn(4, 8).to(torch.float16), cfg)
    with pytest.raises(ValueError, match=r"logits"):
        syt.topk_route(torch.randn(4, 7), cfg)
    with pytest.raises(ValueError, match=r"config"):
        syt.topk_route(torch.randn(4, 8), dict(num_experts=8))
    with pytest.raises(ValueError, match=r"top_k|topk"):
        sy.RouterConfig(num_experts=8, top_k=0)
    with pytest.raises(ValueError, match=r"score_function"):
        sy.RouterConfig(num_experts=8, top_k=2, score_function="relu")
    with pytest.raises(ValueError, match=r"expert_bias"):
        syt.topk_route(torch.randn(4, 8), cfg, inputs=syt.RouteInputs(expert_bias=torch.randn(7)))
    bad = torch.randn(4, 8)
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match=r"token 1, expert 3"):
        syt.topk_route(bad, cfg)
    cfg_seq = _cfg(8, 2, aux_loss_type="seq_aux_loss", aux_loss_coeff=0.1)
    with pytest.raises(ValueError, match=r"seq_length"):
        syt.topk_route(torch.randn(6, 8), cfg_seq, options=syt.RouteOptions(seq_length=4))


@pytest.mark.parametrize("pad_to_capacity,align", [(False, 1), (True, 1), (False, 8), (True, 8)])
def test_single_process_moe_with_capacity_padding(gen, pad_to_capacity, align):
    """pad_to_capacity and padding_for_quantization end to end on one process: route, the plan
    from the route's options, permute (padded expert blocks, zero padding rows), one GEMM per
    expert block, unpermute; output and gradients (x, expert weights, logits through the routing
    weights) against the same MoE written in float64 torch."""
    T, H, E, K = 96, 8, 4, 2
    z = torch.randn(T, E, generator=gen, dtype=torch.float32)
    z[:, 0] += 1.0  # over capacity
    x = torch.randn(T, H, generator=gen)
    W = torch.randn(E, H, H, generator=gen) * 0.3
    cfg = _cfg(E, K, capacity_factor=1.0, pad_to_capacity=pad_to_capacity,
               padding_for_quantization=align > 1, padding_align_size=align if align > 1 else None)
    zs, xs, Ws = (t.clone().requires_grad_(True) for t in (z, x, W))
    w, idx, info = syt.topk_route(zs, cfg)
    assert info.num_dropped > 0
    plan = syt.routing_plan(idx, w, E, **info.routing_plan_options)
    rows = (plan.expert_offsets[1:] - plan.expert_offsets[:-1]).tolist()
    C = info.expert_capacity
    for e, n in enumerate(rows):
        kept = int(plan.num_tokens_per_expert[e])
        want = C if pad_to_capacity else kept
        assert n == -(-want // align) * align, (e, n, want)
    px = syt.permute(xs, plan)
    assert torch.all(px[plan.row_token < 0] == 0)
    off = plan.expert_offsets.tolist()
    out = torch.cat([px[off[e]:off[e + 1]] @ Ws[e] for e in range(E)])
    y = syt.unpermute(out, plan, w)
    # float64 reference: y_t = sum over kept slots of w_tk * x_t W_e
    zd, xd, Wd = (t.double().requires_grad_(True) for t in (z, x, W))
    wd, idd, _ = syt.topk_route(zd, cfg)
    assert torch.equal(idd, idx)
    yd = torch.zeros(T, H, dtype=torch.float64)
    for k in range(K):
        keep = idd[:, k] >= 0
        e = idd[:, k].clamp(min=0)
        yd = yd + torch.where(keep[:, None], wd[:, k:k + 1] * torch.einsum("th,thg->tg", xd,
                                                                           Wd[e]), 0.0)
    torch.testing.assert_close(y.double(), yd, rtol=1e-5, atol=1e-6)
    g = torch.randn(T, H, generator=gen)
    (y * g).sum().backward()
    (yd * g.double()).sum().backward()
    for got, want in ((xs.grad, xd.grad), (Ws.grad, Wd.grad), (zs.grad, zd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_routing_plan_errors():
    idx = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"\[routing_plan\] pad_to_capacity needs a capacity"):
        syt.routing_plan(idx, None, 4, pad_to_capacity=True)
    with pytest.raises(ValueError, match=r"\[routing_plan\] capacity_factor must be None"):
        syt.routing_plan(idx, None, 4, capacity_factor=-1.0)
    with pytest.raises(ValueError, match=r"\[routing_plan\] topk_idx must hold ids in \[0, "
                                         r"num_experts=2\) or -1, got topk_idx\[1, 1\]=2"):
        syt.routing_plan(idx, None, 2)
    with pytest.raises(ValueError, match=r"\[routing_plan\] token_drop_policy must be 'probs' or "
                                         r"'position', got 'first'"):
        syt.routing_plan(idx, None, 4, token_drop_policy="first")
    with pytest.raises(ValueError, match=r"\[permute\] plan must come from syt.routing_plan"):
        syt.permute(torch.zeros(2, 3), "plan")


def test_padding_for_fp8_is_the_alias_of_padding_for_quantization(gen):
    a = _cfg(8, 2, padding_for_fp8=True, padding_align_size=32)
    b = _cfg(8, 2, padding_for_quantization=True, padding_align_size=32)
    assert a.padding_for_quantization and a.padding_align_size == 32
    assert repr(a) == repr(b)
    z = torch.randn(40, 8, generator=gen)
    _, _, ia = syt.topk_route(z, a)
    assert ia.expert_alignment == 32 and ia.routing_plan_options["expert_alignment"] == 32
    with pytest.raises(ValueError, match=r"\[route\] padding_align_size must be >= 1 with "
                                         r"padding_for_quantization, got padding_align_size=0"):
        _cfg(8, 2, padding_for_quantization=True, padding_align_size=0)
