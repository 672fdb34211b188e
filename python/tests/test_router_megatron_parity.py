"""switchyard's router against the real Megatron-Core router (megatron-core from PyPI, run on the
CPU): the global aux-loss state over training / no_grad / eval / checkpointed steps, and the
TopKRouter options, each compared with Megatron's own code on the same logits.

Megatron's TopKRouter allocates its buffers on torch.cuda.current_device(); the fixture below
points that at the CPU (a test-only shim, there is no GPU here) and builds a one-rank gloo group
for its process-group collection. No Megatron code is copied: it is imported and called."""
import math

import pytest
import torch
import torch.utils.checkpoint as tcp

from helpers import single_rank_gloo
import switchyard as sy
import switchyard.torch as syt

megatron = pytest.importorskip("megatron.core")


def _cfg(E, K, **kw):
    return sy.RouterConfig(num_experts=E, top_k=K, **kw)


@pytest.fixture(scope="module")
def mcore(request):
    """Megatron-Core's TopKRouter factory on the CPU (one-rank gloo group)."""
    import torch.distributed as dist
    single_rank_gloo()
    # Megatron puts its router buffers on the current CUDA device; on this CPU-only machine that
    # device is the CPU (the shim is restored when the module's tests end).
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    request.addfinalizer(lambda: setattr(torch.cuda, "current_device", saved))
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    W = dist.group.WORLD
    pg = ProcessGroupCollection(tp=W, cp=W, tp_cp=W, tp_dp_cp=W, dp=W, ep=W)

    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    def make(hidden, **kw):
        # Megatron's loss logger is a process-wide object sized by the first router's layer
        # count; a fresh one per router keeps the cases independent.
        destroy_moe_metrics_tracker()
        kw.setdefault("moe_router_dtype", "fp32")
        kw.setdefault("add_bias_linear", False)
        cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                                params_dtype=torch.float32, **kw)
        r = TopKRouter(cfg, pg_collection=pg)
        r.set_layer_number(1)
        return r
    return make


def _routers(mcore, H, E, K, **sy_kw):
    """A Megatron router with global aux loss and a switchyard TopKRouter with the same weight."""
    m = mcore(H, num_moe_experts=E, moe_router_topk=K,
              moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1)
    s = syt.TopKRouter(H, _cfg(E, K, aux_loss_type="global_aux_loss", aux_loss_coeff=0.1),
                       **sy_kw)
    with torch.no_grad():
        s.weight.copy_(m.weight)
    return m, s


def _dense(router, x):
    """[T, E] routing weights of either library's router (Megatron returns them dense)."""
    out = router(x)
    if isinstance(router, syt.TopKRouter):
        probs, idx = out
        E = router.config.num_experts
        return torch.zeros(probs.numel() // probs.shape[-1], E, dtype=probs.dtype).scatter(
            1, idx.reshape(-1, idx.shape[-1]), probs.reshape(-1, probs.shape[-1]))
    return out[0]


def _step(router, x, kind):
    """One forward (+ backward where there is a graph) of `kind` on a router of either library."""
    xx = x.clone().requires_grad_(True)
    if kind == "train":
        router.train()
        probs = _dense(router, xx)
    elif kind == "no_grad":
        router.train()
        with torch.no_grad():
            router(xx)
        return
    elif kind == "eval":
        router.eval()
        router(xx)
        router.train()
        return
    else:  # checkpoint_reentrant / checkpoint_non_reentrant
        router.train()
        probs = tcp.checkpoint(lambda a: _dense(router, a), xx,
                               use_reentrant=kind == "checkpoint_reentrant")
    (probs.float() * torch.linspace(-1, 1, probs.numel()).view_as(probs)).sum().backward()


STEPS = ["train", "no_grad", "eval", "checkpoint_reentrant", "train"]


def test_global_aux_loss_state_advances_like_megatron(mcore, gen):
    """The issue's sequence: before the fix switchyard counted every forward (and both passes of a
    checkpoint: 5 steps where Megatron has 2 before the last training step). Megatron counts
    training forwards with grad: the reentrant checkpoint's recompute (its forward ran under
    no_grad), not the no_grad or eval forwards."""
    H, E, K = 16, 8, 2
    m, s = _routers(mcore, H, E, K)
    for kind in STEPS:
        x = torch.randn(6, 2, H, generator=gen)
        m.weight.grad = None
        s.weight.grad = None
        _step(m, x, kind)
        _step(s, x, kind)
        st = s.global_aux_loss_state
        assert st.steps == int(m.ga_steps), kind
        torch.testing.assert_close(st.num_tokens_per_expert.float(), m.global_tokens_per_expert,
                                   rtol=0, atol=0, msg=kind)
        if m.weight.grad is not None:
            # The aux-loss gradient (with the weights' gradient) reaches the gate the same way.
            torch.testing.assert_close(s.weight.grad, m.weight.grad, rtol=2e-5, atol=1e-7,
                                       msg=kind)
    assert s.global_aux_loss_state.steps == 3  # train, reentrant recompute, train


def test_non_reentrant_checkpoint_counts_once(mcore, gen):
    """A deliberate difference: under torch.utils.checkpoint(use_reentrant=False) both the forward
    and the recompute run with grad, and Megatron counts both; switchyard counts the forward only
    (its graph carries the gradient) and the gradient equals the plain training step's."""
    H, E, K = 16, 8, 2
    m, s = _routers(mcore, H, E, K)
    _, s2 = _routers(mcore, H, E, K)
    with torch.no_grad():
        s2.weight.copy_(s.weight)
    x = torch.randn(6, 2, H, generator=gen)
    _step(m, x, "checkpoint_non_reentrant")
    _step(s, x, "checkpoint_non_reentrant")
    _step(s2, x, "train")
    assert int(m.ga_steps) == 2 and s.global_aux_loss_state.steps == 1
    torch.testing.assert_close(s.global_aux_loss_state.num_tokens_per_expert,
                               s2.global_aux_loss_state.num_tokens_per_expert, rtol=0, atol=0)
    torch.testing.assert_close(s.weight.grad, s2.weight.grad, rtol=0, atol=0)


def test_global_aux_loss_state_with_router_replay(gen):
    """RouterReplay pairs each recompute ("recompute") with its forward: a forward that counted
    makes the recompute route on a snapshot (same loss, live state unchanged); a forward under
    no_grad (reentrant checkpointing, Megatron's own recompute) leaves the count to the
    recompute."""
    H, E, K = 12, 8, 2
    cfg = _cfg(E, K, aux_loss_type="global_aux_loss", aux_loss_coeff=0.1)
    r = syt.TopKRouter(H, cfg)
    rep = sy.RouterReplay(K)
    x = torch.randn(10, H, generator=gen)
    rep.action = "record"
    with torch.no_grad():
        r(x, replay=rep)  # an old-log-prob pass in training mode: not counted
    assert r.global_aux_loss_state.steps == 0
    rep.set_target(rep.pop_recorded())
    # a non-reentrant checkpoint: its grad-enabled forward counts, its recompute does not (and
    # sees the same loss)
    rep.action = "replay_forward"
    xg = x.clone().requires_grad_(True)
    torch.utils.checkpoint.checkpoint(lambda x: r(x, replay=rep), xg, use_reentrant=False)
    loss_fwd = r.last_info.aux_loss
    assert r.global_aux_loss_state.steps == 1
    assert rep.num_pending_recompute == 1  # queued for the recompute
    rep.action = "recompute"
    r(x, replay=rep)  # the recompute (called directly: the state it sees is the point)
    assert rep.num_pending_recompute == 0
    assert r.global_aux_loss_state.steps == 1
    assert r.last_info.aux_loss == loss_fwd
    # a reentrant checkpoint's forward (no_grad, an input that requires grad), then its
    # recompute with grad: counted once, at the recompute
    rep.set_target(r(x)[1].detach())
    assert r.global_aux_loss_state.steps == 2
    rep.action = "replay_forward"
    with torch.no_grad():
        r(xg, replay=rep)
    assert r.global_aux_loss_state.steps == 2
    rep.action = "recompute"
    r(x, replay=rep)
    assert r.global_aux_loss_state.steps == 3


def test_read_only_global_aux_loss_matches_accumulating_loss(gen):
    T, E, K = 20, 8, 2
    cfg = _cfg(E, K, aux_loss_type="global_aux_loss", aux_loss_coeff=0.1)
    acc, ro = sy.GlobalAuxLossState(), sy.GlobalAuxLossState()
    z0 = torch.randn(T, E, generator=gen, dtype=torch.float64)
    syt.topk_route(z0, cfg, inputs=syt.RouteInputs(global_aux_loss_state=acc))
    syt.topk_route(z0, cfg, inputs=syt.RouteInputs(global_aux_loss_state=ro))
    z = torch.randn(T, E, generator=gen, dtype=torch.float64, requires_grad=True)
    _, _, info_ro = syt.topk_route(z, cfg,
                                   inputs=syt.RouteInputs(global_aux_loss_state=ro),
                                   options=syt.RouteOptions(accumulate_global_aux_loss=False))
    assert ro.steps == 1
    _, _, info_acc = syt.topk_route(z, cfg, inputs=syt.RouteInputs(global_aux_loss_state=acc))
    assert acc.steps == 2
    assert math.isclose(info_ro.aux_loss, info_acc.aux_loss, rel_tol=0, abs_tol=0)


# --------------------------------------------------------------------------------------------------
# Options, each against Megatron's own routing function on the same logits
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mu(mcore):
    from megatron.core.transformer.moe import moe_utils
    return moe_utils


def _gemm_bound(x, weight):
    """How far two fp32 gate GEMMs of the same x [*, H] and weight [E, H] can differ per logit
    (Higham: each dot product is within H·u·Σ|x_i w_i| of the exact one, u = 2^-24; twice that
    between two libraries with any summation order), plus a few ulps of the largest logit for the
    arithmetic done on them afterwards. Megatron's logits come from torch's GEMM, switchyard's from
    its own gate: values derived from the logits (quantiles, probs) are compared within this."""
    x2 = x.detach().reshape(-1, x.shape[-1]).double()
    w = weight.detach().double()
    dots = x2.abs() @ w.abs().t()
    H = x2.shape[-1]
    return float(2 * H * 2.0**-24 * dots.max() + 8 * 2.0**-24 * (x2 @ w.t()).abs().max())


def _dense_of(probs, idx, E):
    T = probs.shape[0]
    keep = idx >= 0
    out = torch.zeros(T, E, dtype=probs.dtype)
    rows = torch.arange(T).unsqueeze(1).expand_as(idx)
    out[rows[keep], idx[keep]] = probs[keep]
    return out


SCORE_CONFIGS = [
    dict(score_function="softmax"),
    dict(score_function="softmax", pre_softmax=True),
    dict(score_function="sigmoid", num_groups=4, group_topk=2),
    dict(score_function="sqrtsoftplus", topk_scaling_factor=2.5),
]


@pytest.mark.parametrize("kw", SCORE_CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_bf16_logits_like_megatron_router_dtype_none(mu, gen, kw):
    """moe_router_dtype=None with bf16 activations: Megatron routes on the bf16 logits (scores in
    fp32, probs cast to bf16). Same ids, bitwise the same bf16 probs, gradients within a bf16 ulp
    (Megatron sums the per-path bf16 gradients in bf16, switchyard rounds the fp32 sum once)."""
    T, E, K = 96, 16, 4
    z = (torch.randn(T, E, generator=gen) * 2).to(torch.bfloat16)
    bias = (torch.randn(E, generator=gen) * 0.1) if kw["score_function"] != "softmax" else None
    zm = z.clone().requires_grad_(True)
    pm, mm = mu.topk_routing_with_score_function(
        zm, K, use_pre_softmax=kw.get("pre_softmax", False), num_groups=kw.get("num_groups"),
        group_topk=kw.get("group_topk"), scaling_factor=kw.get("topk_scaling_factor"),
        score_function=kw["score_function"], expert_bias=bias)
    zs = z.clone().requires_grad_(True)
    ps, idx, _ = syt.topk_route(zs, _cfg(E, K, **kw), inputs=syt.RouteInputs(expert_bias=bias))
    assert ps.dtype == torch.bfloat16 and pm.dtype == torch.bfloat16
    ms = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
    if kw["score_function"] == "softmax":
        # bf16 logits tie often (8 bits of mantissa). switchyard breaks ties to the lower expert
        # id (the contract); torch.topk's order among ties is its kernel's (SY_TEST_SEED=3 has a
        # tie at the K boundary). Rows without such a tie must match Megatron exactly; every row
        # must be the contract's selection.
        order = torch.sort(z.float(), dim=1, descending=True, stable=True)
        want = torch.zeros(T, E, dtype=torch.bool).scatter(1, order.indices[:, :K], True)
        assert torch.equal(ms, want)
        tied = order.values[:, K - 1] == order.values[:, K]
        assert torch.equal(ms[~tied], mm[~tied])
        kth = order.values[:, K - 1:K]
        assert bool((z.float()[mm] >= kth.expand(T, E)[mm]).all())  # Megatron's is a top-K too
        keep = (~tied).unsqueeze(1)
        pm = torch.where(keep, pm, _dense_of(ps, idx, E).detach())
        mm = torch.where(keep, mm, ms)
    else:  # selection on s + expert_bias (fp32): no ties
        assert torch.equal(ms, mm)
        tied = torch.zeros(T, dtype=torch.bool)
    # Both round an fp32 softmax of the same logits to bf16; the fp32 exps (torch's vectorised
    # kernel, switchyard's own) may differ by an ulp, which can move the bf16 rounding by one ulp
    # (2^-8 to 2^-7 relative): bitwise equality would depend on the CPU's torch kernel.
    torch.testing.assert_close(_dense_of(ps, idx, E), pm, rtol=2.0**-7, atol=0)
    g = torch.randn(T, E, generator=gen).to(torch.bfloat16)
    (pm.float() * g.float()).sum().backward()
    (_dense_of(ps, idx, E).float() * g.float()).sum().backward()
    assert zs.grad.dtype == torch.bfloat16
    torch.testing.assert_close(zs.grad.float()[~tied], zm.grad.float()[~tied], rtol=8e-3,
                               atol=1e-5)


def test_input_jitter_like_megatron(mcore, gen):
    """moe_input_jitter_eps: Megatron multiplies the gate input by U(1-eps, 1+eps) noise on every
    forward (its own RNG stream, so values are compared as distributions: the same support and
    mean); switchyard's noise is seeded from torch's generator (torch.manual_seed reproduces it),
    differentiable as grad * u, and never changes replayed ids."""
    H, E, K, eps = 32, 8, 2, 0.1
    m = mcore(H, num_moe_experts=E, moe_router_topk=K, moe_input_jitter_eps=eps)
    x = torch.randn(64, H, generator=gen) + 3.0  # away from 0: the ratio is the noise
    um = m.apply_input_jitter(x) / x
    torch.manual_seed(5)
    xs = x.clone().requires_grad_(True)
    us = syt.input_jitter(xs, eps)
    us.sum().backward()
    torch.manual_seed(5)
    assert torch.equal(syt.input_jitter(x, eps), us.detach())  # seeded
    ratio = us.detach() / x
    torch.testing.assert_close(xs.grad, ratio, rtol=1e-6, atol=0)  # d(x*u)/dx = u
    for u in (um, ratio):
        assert float(u.min()) >= 1 - eps - 1e-6 and float(u.max()) <= 1 + eps + 1e-6
        assert abs(float(u.mean()) - 1.0) < 4 * eps / math.sqrt(3 * u.numel())
    assert abs(float(ratio.std()) - float(um.std())) < 0.15 * float(um.std())
    # Router: jittered logits, but a replayed table is used as given.
    r = syt.TopKRouter(H, _cfg(E, K), input_jitter_eps=eps)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(64)])
    probs, got = r(x, replay=ids)
    assert torch.equal(got, ids) and r.last_info.num_replayed_rows == 64
    torch.manual_seed(9)
    p1, _ = r(x)
    torch.manual_seed(9)
    p2, _ = r(x)
    assert torch.equal(p1, p2)


LOSS_CASES = {
    "aux+seq+global": dict(types=["aux_loss", "seq_aux_loss", "global_aux_loss"],
                           coeffs=[0.01, 0.02, 0.03]),
    "seq+global sigmoid": dict(types=["seq_aux_loss", "global_aux_loss"], coeffs=[0.05, 0.01],
                               score="sigmoid"),
    "per-token aux+z": dict(types=["aux_loss"], coeffs=[0.02], z=0.01, per_token=True),
    "mtp repeated x3": dict(types=["aux_loss", "global_aux_loss"], coeffs=[0.02, 0.01], z=0.01,
                            mtp=3),
}


@pytest.mark.parametrize("case", LOSS_CASES, ids=list(LOSS_CASES))
def test_losses_like_megatron_topk_router(mcore, gen, case):
    """Several load-balancing types with their coefficients (Megatron's list form),
    calculate_per_token_loss and MTP-layer scaling: the real TopKRouter and syt.TopKRouter with
    the same weight give the same ids, loss state and gate gradient over two training steps."""
    c = LOSS_CASES[case]
    H, E, K, s, b = 16, 8, 2, 6, 3
    score = c.get("score", "softmax")
    mkw = dict(num_moe_experts=E, moe_router_topk=K, moe_router_load_balancing_type=c["types"],
               moe_aux_loss_coeff=c["coeffs"], moe_router_score_function=score,
               moe_z_loss_coeff=c.get("z"), calculate_per_token_loss=c.get("per_token", False))
    skw = dict(aux_loss_type=c["types"], aux_loss_coeff=c["coeffs"], score_function=score,
               z_loss_coeff=c.get("z") or 0.0,
               calculate_per_token_loss=c.get("per_token", False))
    if c.get("mtp"):
        mkw.update(mtp_num_layers=c["mtp"], mtp_use_repeated_layer=True)
        skw.update(is_mtp_layer=True, mtp_use_repeated_layer=True, mtp_num_layers=c["mtp"])
    m = mcore(H, **mkw)
    if c.get("mtp"):
        m.is_mtp_layer = True  # the constructor argument of an MTP layer's router
    srt = syt.TopKRouter(H, _cfg(E, K, **skw))
    with torch.no_grad():
        srt.weight.copy_(m.weight)
    for step in range(2):
        x = torch.randn(s, b, H, generator=gen)
        xm, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        m.weight.grad = srt.weight.grad = None
        pm, mm = m(xm)
        ps, idx = srt(xs, seq_length=s)
        assert torch.equal(torch.zeros(s * b, E, dtype=torch.bool).scatter(1, idx.view(-1, K),
                                                                          True), mm)
        g = torch.linspace(-1, 1, s * b * E).view(s * b, E)
        (pm * g).sum().backward()
        (_dense_of(ps.view(-1, K), idx.view(-1, K), E) * g).sum().backward()
        torch.testing.assert_close(srt.weight.grad, m.weight.grad, rtol=1e-5, atol=1e-6,
                                   msg=f"step {step}")
        torch.testing.assert_close(xs.grad, xm.grad, rtol=1e-5, atol=1e-6)
        if "global_aux_loss" in c["types"]:
            assert srt.global_aux_loss_state.steps == int(m.ga_steps)


def test_force_load_balancing_and_forced_bias(gen):
    """moe_router_force_load_balancing / moe_router_force_biased (benchmarking). Megatron draws
    them from its CUDA RNG tracker (apply_random_logits raises without CUDA), so this checks the
    definition: random N(0,1) logits (balanced loads), straight-through gradient, and a per-layer
    bias reused across calls when force_biased < 0."""
    H, E, K = 16, 8, 2
    r = syt.TopKRouter(H, _cfg(E, K, force_load_balancing=True), layer_number=3)
    x = torch.randn(2048, H, generator=gen).requires_grad_(True)
    torch.manual_seed(1)
    p, idx = r(x)
    counts = r.last_info.num_tokens_per_expert.double()
    assert float((counts - counts.mean()).abs().max()) < 5 * math.sqrt(float(counts.mean()))
    p.sum().backward()  # post-softmax weights sum to 1 per row: zero gradient, but it flows
    assert x.grad is not None
    torch.manual_seed(1)
    assert torch.equal(r(x)[1], idx)  # seeded from torch's generator
    rb = syt.TopKRouter(H, _cfg(E, K, force_biased=-4.0), layer_number=3)
    loads = [rb(x)[1].flatten().bincount(minlength=E) for _ in range(2)]
    assert torch.equal(loads[0].argsort(), loads[1].argsort()) or \
        (loads[0] - loads[1]).abs().max() < 0.2 * loads[0].max()  # same bias, fresh noise
    assert loads[0].max() > 3 * loads[0].float().mean()  # clearly biased


@pytest.mark.parametrize("K", [1, 2, 4])
def test_sinkhorn_like_megatron(mcore, gen, K):
    """moe_router_load_balancing_type="sinkhorn": Megatron selects on sinkhorn(logits) while
    training (fp32; switchyard runs the same iteration in double) and on the activation in eval;
    the weights are sigmoid (K = 1) or softmax over all experts (K > 1) at the ids."""
    H, E = 16, 8
    m = mcore(H, num_moe_experts=E, moe_router_topk=K, moe_router_load_balancing_type="sinkhorn",
              moe_aux_loss_coeff=0.0)
    srt = syt.TopKRouter(H, _cfg(E, K, aux_loss_type="sinkhorn"))
    with torch.no_grad():
        srt.weight.copy_(m.weight)
        srt.weight[:, :2] += 0.05  # a skew that balancing has to undo
        m.weight.copy_(srt.weight)
    for training in (True, False):
        m.train(training)
        srt.train(training)
        x = torch.randn(48, H, generator=gen) * 4
        xm, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        pm, mm = m(xm)
        ps, idx = srt(xs)
        assert torch.equal(torch.zeros(48, E, dtype=torch.bool).scatter(1, idx, True), mm)
        plain = (x @ srt.weight.detach().t()).topk(K, dim=1).indices
        # Balancing changes choices while training, never in eval.
        assert (plain.sort(1).values != idx.sort(1).values).any() == training
        torch.testing.assert_close(_dense_of(ps, idx, E), pm, rtol=1e-6, atol=1e-7)
        g = torch.linspace(-1, 1, 48 * E).view(48, E)
        (pm * g).sum().backward()
        (_dense_of(ps, idx, E) * g).sum().backward()
        torch.testing.assert_close(xs.grad, xm.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_quantile_balancing_like_megatron(mcore, gen, score):
    """moe_router_load_balancing_type="quantile_balancing": ids from the top-k of logits - qb_beta,
    weights from the score function at them, the per-microbatch quantile accumulated only on
    training forwards with grad, and the global-batch update (Megatron's formula on one rank)."""
    H, E, K, T = 16, 8, 2, 64
    m = mcore(H, num_moe_experts=E, moe_router_topk=K, moe_aux_loss_coeff=0.0,
              moe_router_load_balancing_type="quantile_balancing", moe_router_score_function=score)
    srt = syt.TopKRouter(H, _cfg(E, K, aux_loss_type="quantile_balancing", score_function=score))
    with torch.no_grad():
        srt.weight.copy_(m.weight)
        srt.weight[:, :3] += 0.05
        m.weight.copy_(srt.weight)
        beta = torch.randn(E, generator=gen) * 0.02
        m.qb_beta.copy_(beta)
        srt.qb_beta.copy_(beta)
    accum_tol = 0.0
    for step in range(3):
        x = torch.randn(T, H, generator=gen) * 3
        accum_tol += _gemm_bound(x, srt.weight)  # each step's quantile moves with its logits
        xm, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        pm, mm = m(xm)
        ps, idx = srt(xs)
        assert torch.equal(torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True), mm)
        torch.testing.assert_close(_dense_of(ps, idx, E), pm, rtol=1e-6, atol=1e-7)
        g = torch.linspace(-1, 1, T * E).view(T, E)
        (pm * g).sum().backward()
        (_dense_of(ps, idx, E) * g).sum().backward()
        torch.testing.assert_close(xs.grad, xm.grad, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            m(x)
            srt(x)  # not accumulated (no grad)
        # The quantiles are of logits from two different GEMMs (torch's for Megatron): within the
        # GEMMs' error bound, not bitwise (they differed in the last bits on AMD Zen 4).
        torch.testing.assert_close(srt.qb_beta_accum, m.qb_beta_accum, rtol=0, atol=accum_tol)
        assert int(srt.qb_beta_count) == int(m.qb_beta_count) == step + 1
    # The update itself is compared on the same accumulated values: switchyard's arithmetic only.
    with torch.no_grad():
        srt.qb_beta_accum.copy_(m.qb_beta_accum)
    want = 0.3 * m.qb_beta + 0.7 * m.qb_beta_accum / m.qb_beta_count
    srt.update_qb_beta(ema=0.3)
    torch.testing.assert_close(srt.qb_beta, want - want.mean(), rtol=1e-6, atol=1e-7)
    assert int(srt.qb_beta_count) == 0


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad_to_capacity", [False, True])
@pytest.mark.parametrize("align", [1, 16, 32])
def test_capacity_and_padding_like_megatron(mu, gen, policy, pad_to_capacity, align):
    """moe_expert_capacity_factor + moe_token_drop_policy (get_capacity /
    apply_router_token_dropping), moe_pad_expert_input_to_capacity and
    moe_router_padding_for_quantization (the dispatcher's pad_routing_map to the quantization
    alignment): the same kept pairs and weights, and the routing plan built from the route's
    options has Megatron's per-expert row counts. Megatron pads with real tokens at probability
    0, switchyard with zero rows (token -1, weight 0): only the padding rows' sources differ."""
    T, E, K, cf = 256, 8, 2, 0.8
    z = torch.randn(T, E, generator=gen) * 2
    z[:, 0] += 1.0  # skew: expert 0 is over capacity
    pm, mm = mu.topk_routing_with_score_function(z, K, score_function="softmax")
    kept_p, kept_m = mu.apply_router_token_dropping(pm, mm, K, cf, drop_policy=policy,
                                                    pad_to_capacity=False)
    _, final_m = mu.apply_router_token_dropping(pm, mm, K, cf, drop_policy=policy,
                                                pad_to_capacity=pad_to_capacity)
    if align > 1:
        final_m = mu.pad_routing_map(final_m.clone(), align)
    cfg = _cfg(E, K, capacity_factor=cf, token_drop_policy=policy,
               pad_to_capacity=pad_to_capacity, padding_for_quantization=align > 1,
               padding_align_size=align if align > 1 else None)
    ps, idx, info = syt.topk_route(z, cfg)
    assert info.expert_capacity == mu.get_capacity(T * K, E, cf)
    assert info.num_dropped > 0
    kept_s = _dense_of(torch.ones_like(ps), idx, E).bool()
    if policy == "probs":
        assert torch.equal(kept_s, kept_m)
    else:
        # Megatron's "position" is torch.topk over a 0/1 map: which of the tied routed tokens it
        # keeps is unspecified (on the CPU it is not the first ones). switchyard keeps the first C
        # tokens of each expert (README deviation): the counts agree, the set is the definition's.
        assert torch.equal(kept_s.sum(0), kept_m.sum(0))
        C = info.expert_capacity
        want = mm & (torch.cumsum(mm.int(), dim=0) <= C)
        assert torch.equal(kept_s, want)
        kept_p = pm * want
        kept_m = want
    # fp32 softmax: switchyard's exp and torch's differ by an ulp here and there.
    torch.testing.assert_close(_dense_of(ps, idx, E), kept_p, rtol=1e-6, atol=1e-7)
    plan = syt.routing_plan(idx, ps, E, **info.routing_plan_options)
    rows = plan.expert_offsets[1:] - plan.expert_offsets[:-1]
    assert torch.equal(rows, final_m.sum(dim=0).to(torch.int64))
    assert torch.equal(plan.num_tokens_per_expert, kept_m.sum(dim=0).to(torch.int64))
    pad_rows = plan.row_token < 0
    assert int(pad_rows.sum()) == int(final_m.sum()) - int(kept_m.sum())
    assert torch.all(plan.row_weight[pad_rows] == 0)


# --------------------------------------------------------------------------------------------------
# The Megatron integration's option mapping: a TransformerConfig -> syt.TopKRouter, then the same
# ids, weights and (through the gate gradient) losses as Megatron's own router
# --------------------------------------------------------------------------------------------------
MAPPED = {
    "fp32 aux": dict(moe_router_dtype="fp32", moe_aux_loss_coeff=0.01),
    "fp64 aux+z": dict(moe_router_dtype="fp64", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.01),
    "dtype None": dict(moe_router_dtype=None, moe_aux_loss_coeff=0.02),
    "lists aux+seq+global": dict(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[0.01, 0.02, 0.03]),
    "per-token + z": dict(moe_aux_loss_coeff=0.02, moe_z_loss_coeff=0.01,
                          calculate_per_token_loss=True),
    "mtp repeated": dict(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
                         moe_aux_loss_coeff=[0.02, 0.01], mtp_num_layers=3,
                         mtp_use_repeated_layer=True, _mtp=True),
    "sigmoid groups bias": dict(moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                                moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.0,
                                moe_router_load_balancing_type="none"),
    "pre-softmax seq": dict(moe_router_pre_softmax=True,
                            moe_router_load_balancing_type="seq_aux_loss",
                            moe_aux_loss_coeff=0.05),
    "capacity probs": dict(moe_expert_capacity_factor=0.75, moe_aux_loss_coeff=0.01),
    "sinkhorn": dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0),
    "quantile balancing + ema": dict(moe_router_load_balancing_type="quantile_balancing",
                                     moe_aux_loss_coeff=0.0,
                                     moe_router_quantile_balancing_ema=0.4),
}


@pytest.mark.parametrize("case", MAPPED, ids=list(MAPPED))
def test_megatron_integration_maps_router_options(mcore, gen, case):
    from switchyard.integrations import megatron as sym
    mkw = dict(MAPPED[case])
    mtp = mkw.pop("_mtp", False)
    H, E, K, s, b = 16, 8, 2, 8, 4
    m = mcore(H, num_moe_experts=E, moe_router_topk=K, **mkw)
    if mtp:
        m.is_mtp_layer = True  # the constructor argument of an MTP layer's router
    with torch.no_grad():
        m.weight[:, :2] += 0.05  # a skew, so capacity and balancing have work to do
        if m.expert_bias is not None:
            m.expert_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    srt = sym.topk_router(m)
    cfg = srt.config
    assert cfg.num_experts == E and cfg.top_k == K
    assert srt.router_dtype == {None: None, "fp32": torch.float32,
                                "fp64": torch.float64}[m.config.moe_router_dtype]
    assert cfg.is_mtp_layer == mtp
    accum_tol = 0.0
    for step in range(2):
        x = torch.randn(s, b, H, generator=gen) * 2
        accum_tol += _gemm_bound(x, m.weight)
        xm, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        pm, mm = m(xm)
        ps, idx = srt(xs, seq_length=s)
        ps, idx = ps.reshape(-1, K), idx.reshape(-1, K)
        assert torch.equal(_dense_of(torch.ones_like(ps), idx, E).bool(), mm), f"step {step}"
        # fp32 tolerance for fp64 too: Megatron's moe_router_dtype='fp64' computes its scores in
        # fp32 (README deviation: switchyard's fp64 router computes them in fp64).
        torch.testing.assert_close(_dense_of(ps, idx, E).to(pm.dtype), pm, rtol=1e-6, atol=1e-7)
        g = torch.linspace(-1, 1, s * b * E).view(s * b, E)
        (pm.float() * g).sum().backward()
        (_dense_of(ps, idx, E).float() * g).sum().backward()
        torch.testing.assert_close(xs.grad, xm.grad, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        if m.ga_steps is not None:
            assert srt.global_aux_loss_state.steps == int(m.ga_steps)
        if m.expert_bias is not None:
            torch.testing.assert_close(srt.local_tokens_per_expert,
                                       m.local_tokens_per_expert.double(), rtol=0, atol=0)
    if getattr(m, "qb_beta", None) is not None:
        from megatron.core.distributed.finalize_model_grads import _update_router_qb_beta
        # Quantiles of logits from two GEMMs (torch's for Megatron): within the GEMMs' bound.
        torch.testing.assert_close(srt.qb_beta_accum, m.qb_beta_accum, rtol=0, atol=accum_tol)
        with torch.no_grad():  # the update, on the same accumulated values
            srt.qb_beta_accum.copy_(m.qb_beta_accum)
        _update_router_qb_beta([m], m.config)
        srt.update_qb_beta(m.config.moe_router_quantile_balancing_ema)
        torch.testing.assert_close(srt.qb_beta, m.qb_beta, rtol=1e-6, atol=1e-7)


def test_megatron_integration_maps_module_and_benchmark_options(mcore):
    """Options whose effect cannot be compared value by value on the CPU: input jitter (Megatron's
    own RNG stream), forced load balancing / bias (Megatron draws them from its CUDA RNG
    tracker), and the dispatcher-side padding (checked against Megatron's
    apply_router_token_dropping / pad_routing_map in test_capacity_and_padding_like_megatron):
    the mapping carries each of them under its Megatron name."""
    from switchyard.integrations import megatron as sym
    m = mcore(16, num_moe_experts=8, moe_router_topk=2, moe_input_jitter_eps=0.05,
              moe_router_force_load_balancing=True, moe_router_force_biased=-2.0,
              moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True,
              moe_token_drop_policy="position", moe_aux_loss_coeff=0.01)
    srt = sym.topk_router(m)
    assert srt.input_jitter_eps == 0.05
    c = srt.config
    assert c.force_load_balancing and c.force_biased == -2.0
    assert c.capacity_factor == 1.5 and c.pad_to_capacity and c.token_drop_policy == "position"
    # moe_router_padding_for_quantization needs fp8/fp4 in Megatron's config (and Transformer
    # Engine to run); the mapping reads Megatron's own get_align_size_for_quantization.
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
    for fp8_recipe, fp4, want in (("delayed", None, 16), ("mxfp8", None, 32), (None, "nvfp4", 128)):
        # A plain copy of the config's fields (TransformerConfig's own checks would want TE).
        cfg = type("C", (), dict(vars(m.config)))()
        cfg.fp8 = "e4m3" if fp8_recipe else None
        cfg.fp8_recipe = fp8_recipe
        cfg.fp4 = fp4
        cfg.fp4_recipe = fp4
        cfg.moe_router_padding_for_quantization = False
        cfg.moe_router_padding_for_fp8 = True  # the older alias turns it on too
        assert get_align_size_for_quantization(cfg) == want
        rc = sym.router_config(cfg)
        assert rc.padding_for_quantization and rc.padding_align_size == want
