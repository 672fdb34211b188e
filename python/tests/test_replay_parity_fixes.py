"""Replay and router parity fixes of issue 23, each against the real megatron-core (PyPI) on the
CPU: merged replay rows' gradients (against a float64 reference from the maths), eval mode and
no_grad forwards (no loss, no loss state), the MTP z-loss log value, sinkhorn with a padding
mask, and moe_router_dtype=None on both of the Megatron integration's paths.

Megatron's TopKRouter is built by test_router_megatron_parity's `mcore` fixture (a one-rank gloo
group, router buffers on the CPU); no Megatron code is copied, it is imported and called."""
import math
import os
import sys

import pytest
import torch

import switchyard as sy
import switchyard.torch as syt

megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_router_megatron_parity import _gemm_bound, mcore  # noqa: E402,F401 (a fixture)

U32 = 2.0**-24  # unit roundoff of fp32


def _cfg(E, K, **kw):
    return sy.RouterConfig(num_experts=E, top_k=K, **kw)


# --------------------------------------------------------------------------------------------------
# 1. repeated_ids="merge": the backward is the derivative of the summed weight
# --------------------------------------------------------------------------------------------------
MERGE_SCORES = {
    "softmax": dict(),
    "pre-softmax": dict(moe_router_pre_softmax=True),
    "sigmoid+bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none"),
    "sqrtsoftplus x2.5": dict(moe_router_score_function="sqrtsoftplus",
                              moe_router_topk_scaling_factor=2.5),
}


def _slot_weights64(z, ids, kw):
    """float64 routing weights [T, K] of the slots `ids` [T, K] from logits z [T, E], written from
    Megatron's definitions (the bias only selects; it never enters a weight)."""
    score = kw.get("moe_router_score_function", "softmax")
    if score == "softmax" and kw.get("moe_router_pre_softmax"):
        w = torch.softmax(z, dim=-1).gather(1, ids)
    elif score == "softmax":
        w = torch.softmax(z.gather(1, ids), dim=-1)
    else:
        s = torch.sigmoid(z) if score == "sigmoid" else torch.nn.functional.softplus(z).sqrt()
        s = s.gather(1, ids)
        w = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    return w * (kw.get("moe_router_topk_scaling_factor") or 1.0)


def _dense64(z, ids, kw):
    """[T, E] float64: each slot's weight added at its expert (a repeated id sums its slots)."""
    return torch.zeros_like(z).scatter_add(1, ids, _slot_weights64(z, ids, kw))


def _merge_ids(T, E, K, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    ids[0] = torch.tensor([5, 5, 2])   # partially repeated rows
    ids[1] = torch.tensor([7, 3, 7])
    ids[2] = torch.tensor([4, 9, 4])
    ids[3] = torch.tensor([0, 0, 0])   # a zero-filled padding row: weight constantly the whole
    ids[4] = -1                        # routed natively
    ids[7] = -1
    return ids


@pytest.mark.hostile(tried="Megatron replay with invalid_replay_rows='merge' and rows like [5, 5, 2], "
                           "then backward",
                     gets="input and router-weight gradients of the summed weight (float64 "
                          "reference), not multiplied by the multiplicity")
@pytest.mark.parametrize("engine", [None, "cpu"])
@pytest.mark.parametrize("score", MERGE_SCORES, ids=list(MERGE_SCORES))
def test_merged_replay_rows_backward_is_the_derivative_of_the_summed_weight(mcore, gen, score,
                                                                           engine):
    from switchyard.integrations import megatron as sym
    H, E, K, T = 16, 12, 3, 10
    kw = MERGE_SCORES[score]
    m = mcore(H, num_moe_experts=E, moe_router_topk=K, **kw)
    with torch.no_grad():
        m.weight.normal_(0.0, 0.3, generator=gen)
        if m.expert_bias is not None:
            m.expert_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    ids = _merge_ids(T, E, K, gen)
    x = torch.randn(T, 1, H, generator=gen)
    G = torch.randn(T, E, generator=gen)  # dL/dprobs
    with sym.patched(engine=engine):
        sym.attach_replay(m, invalid_replay_rows="merge")
        sym.set_replay_targets(m, {1: ids})
        sym.set_replay_action(m, "replay_forward")
        xm = x.clone().requires_grad_(True)
        m.weight.grad = None
        probs, routing_map = m(xm)
        (probs * G).sum().backward()
        counts = sym.replay_counts(m)[1]
        sym.detach_replay(m)
    assert (counts.replayed, counts.merged, counts.native) == (8, 4, 2)
    native = (ids < 0).all(dim=1)
    # The ids used: replayed rows as given, native rows Megatron's own (its top-k of the map).
    order = torch.where(routing_map, torch.arange(E), E).sort(dim=1).values[:, :K]
    used = torch.where(native[:, None], order, ids)
    assert torch.equal(routing_map, torch.zeros(T, E, dtype=torch.bool).scatter(1, used, True))

    # float64 reference from the maths, checked itself against central finite differences.
    x64, w64 = x.reshape(T, H).double(), m.weight.detach().double()
    z64 = (x64 @ w64.t()).requires_grad_(True)
    (_dense64(z64, used, kw) * G.double()).sum().backward()
    gz = z64.grad
    h = 1e-6
    fd = torch.empty_like(gz)
    with torch.no_grad():
        for i in range(T):
            for e in range(E):
                zp, zm = z64.detach().clone(), z64.detach().clone()
                zp[i, e] += h
                zm[i, e] -= h
                fd[i, e] = ((_dense64(zp, used, kw) - _dense64(zm, used, kw)) * G.double()).sum()
    torch.testing.assert_close(gz, fd / (2 * h), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(probs.detach().double(), _dense64(z64.detach(), used, kw),
                               rtol=0, atol=1e-5)
    grad_x64, grad_w64 = gz @ w64, gz.t() @ x64

    # Tolerance from the computation: the fp32 gate's logits are within b of the exact ones, the
    # weights are smooth (|second derivative| <= 4 per unit of logit, times the scaling factor),
    # so dL/dlogits moves by at most sf * |G|max * (8 b + 64 u); the fp32 backward GEMMs add
    # their own n * u * sum|a||b|.
    sf = kw.get("moe_router_topk_scaling_factor") or 1.0
    b = _gemm_bound(x, m.weight)
    eps_g = sf * float(G.abs().max()) * (8 * b + 64 * U32)
    tol_x = eps_g * w64.abs().sum(0) + E * U32 * (gz.abs() @ w64.abs())
    tol_w = eps_g * x64.abs().sum(0) + T * U32 * (gz.abs().t() @ x64.abs())
    err_x = (xm.grad.reshape(T, H).double() - grad_x64).abs()
    err_w = (m.weight.grad.double() - grad_w64).abs()
    assert bool((err_x <= tol_x).all()), f"input grad off by {float(err_x.max()):.3g}"
    assert bool((err_w <= tol_w).all()), f"router weight grad off by {float(err_w.max()):.3g}"


# --------------------------------------------------------------------------------------------------
# 2. eval mode: no loss, no loss gradient, no loss-state change (as Megatron's `self.training`)
# --------------------------------------------------------------------------------------------------
EVAL_CASES = {
    "aux+seq+global+z": dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss",
                                                             "global_aux_loss"],
                             moe_aux_loss_coeff=[0.01, 0.02, 0.03], moe_z_loss_coeff=0.01),
    "sinkhorn+z": dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0,
                       moe_z_loss_coeff=0.01),
    "quantile balancing+z": dict(moe_router_load_balancing_type="quantile_balancing",
                                 moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.01),
    "sigmoid bias+aux": dict(moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.02,
                             moe_z_loss_coeff=0.01),
}


def _dense_of(probs, idx, E):
    return torch.zeros(probs.shape[0], E, dtype=probs.dtype).scatter(1, idx, probs)


def _loss_state(r):
    """The loss state of either library's router, as comparable numbers."""
    st = {}
    if isinstance(r, syt.TopKRouter):
        g = r.global_aux_loss_state
        if g is not None:
            st["steps"] = g.steps
            st["global counts"] = g.num_tokens_per_expert.tolist() if g.steps else None
        if r.qb_beta is not None:
            st["qb"] = (r.qb_beta_accum.tolist(), int(r.qb_beta_count))
        if r.local_tokens_per_expert is not None:
            st["bias counts"] = r.local_tokens_per_expert.tolist()
        return st
    if r.ga_steps is not None:
        st["steps"] = int(r.ga_steps)
        st["global counts"] = r.global_tokens_per_expert.tolist() if int(r.ga_steps) else None
    if getattr(r, "qb_beta", None) is not None:
        st["qb"] = (r.qb_beta_accum.tolist(), int(r.qb_beta_count))
    if r.local_tokens_per_expert is not None:
        st["bias counts"] = r.local_tokens_per_expert.double().tolist()
    return st


@pytest.mark.hostile(tried="syt.TopKRouter(...).eval() (or RouteOptions(training=False)) with "
                           "grad enabled, aux/z losses configured",
                     gets="no aux or z loss: values 0, no loss gradient, no loss state change; "
                          "expert-bias counts as Megatron's eval")
@pytest.mark.parametrize("case", EVAL_CASES, ids=list(EVAL_CASES))
def test_eval_router_applies_no_loss_like_megatron(mcore, gen, case):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from switchyard.integrations import megatron as sym
    H, E, K, s, b = 16, 8, 2, 8, 4
    m = mcore(H, num_moe_experts=E, moe_router_topk=K, **EVAL_CASES[case])
    with torch.no_grad():
        m.weight[:, :2] += 0.05
        if m.expert_bias is not None:
            m.expert_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    srt = sym.topk_router(m)
    m.eval()
    srt.eval()
    before_m, before_s = _loss_state(m), _loss_state(srt)
    x = torch.randn(s, b, H, generator=gen) * 2
    for g_scale in (0.0, 1.0):  # (p * 0).sum(): only a loss could reach x; then a real gradient
        xm, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        pm, mm = m(xm)
        ps, idx = srt(xs, seq_length=s)
        ps, idx = ps.reshape(-1, K), idx.reshape(-1, K)
        assert torch.equal(torch.zeros(s * b, E, dtype=torch.bool).scatter(1, idx, True), mm)
        g = g_scale * torch.linspace(-1, 1, s * b * E).view(s * b, E)
        (pm * g).sum().backward()
        (_dense_of(ps, idx, E) * g).sum().backward()
        if g_scale == 0.0:
            assert float(xm.grad.abs().max()) == 0.0  # Megatron: no loss in eval
            assert float(xs.grad.abs().max()) == 0.0
        else:
            torch.testing.assert_close(xs.grad, xm.grad, rtol=1e-5, atol=1e-6)
        info = srt.last_info
        assert info.aux_loss == 0.0 and info.z_loss == 0.0
        assert info.qb_beta_local is None
    assert not get_moe_metrics_tracker().metrics  # Megatron logged nothing either
    after_m, after_s = _loss_state(m), _loss_state(srt)
    for key in ("steps", "global counts", "qb"):
        assert after_m.get(key) == before_m.get(key), key
        assert after_s.get(key) == before_s.get(key), key
    # Megatron's _apply_expert_bias counts every forward with grad enabled, eval included.
    assert after_s.get("bias counts") == after_m.get("bias counts")
    if "bias counts" in after_m:
        assert sum(after_m["bias counts"]) == 2 * s * b * K


@pytest.mark.parametrize("case", EVAL_CASES, ids=list(EVAL_CASES))
def test_eval_topk_route_computes_no_loss(gen, case):
    """topk_route(options=RouteOptions(training=False)), the engine's eval path: the weights'
    gradient alone (as a route without losses), loss values 0, the global aux-loss state
    untouched, even when asked to accumulate."""
    kw = EVAL_CASES[case]
    lb = kw.get("moe_router_load_balancing_type", "aux_loss")
    E, K, T = 8, 2, 32
    extra = dict(aux_loss_type=lb if lb != "none" else None,
                 z_loss_coeff=kw.get("moe_z_loss_coeff") or 0.0,
                 score_function=kw.get("moe_router_score_function", "softmax"))
    if isinstance(lb, list):
        extra["aux_loss_coeff"] = kw["moe_aux_loss_coeff"]
    elif lb not in ("sinkhorn", "quantile_balancing"):
        extra["aux_loss_coeff"] = kw["moe_aux_loss_coeff"]
    cfg = _cfg(E, K, **extra)
    # The same router without losses (sinkhorn and quantile balancing select, they are no loss).
    plain = _cfg(E, K, score_function=extra["score_function"],
                 aux_loss_type=lb if lb in ("sinkhorn", "quantile_balancing") else None)
    state = sy.GlobalAuxLossState()
    z = torch.randn(T, E, generator=gen, dtype=torch.float64)
    g = torch.randn(T, K, generator=gen, dtype=torch.float64)
    grads = []
    for c, inputs, options in (
            (cfg, syt.RouteInputs(global_aux_loss_state=state),
             syt.RouteOptions(training=False, seq_length=8, accumulate_global_aux_loss=True)),
            (plain, None, syt.RouteOptions(training=False))):
        zz = z.clone().requires_grad_(True)
        w, idx, info = syt.topk_route(zz, c, inputs, options)
        (w * g).sum().backward()
        grads.append(zz.grad)
        assert info.aux_loss == 0.0 and info.z_loss == 0.0
    assert state.steps == 0
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# 3. topk_route under torch.no_grad: the global aux-loss state follows Megatron's rule by default
# --------------------------------------------------------------------------------------------------
@pytest.mark.hostile(tried="syt.topk_route(..., RouteInputs(global_aux_loss_state=s)) under "
                           "torch.no_grad()",
                     gets="the state is left alone (Megatron counts only training forwards "
                          "with grad); accumulate_global_aux_loss=True still counts")
def test_topk_route_under_no_grad_leaves_global_aux_loss_state_like_megatron(mcore, gen):
    H, E, K = 16, 8, 2
    m = mcore(H, num_moe_experts=E, moe_router_topk=K,
              moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1)
    cfg = _cfg(E, K, aux_loss_type="global_aux_loss", aux_loss_coeff=0.1)
    state = sy.GlobalAuxLossState()
    x = torch.randn(12, 1, H, generator=gen)
    with torch.no_grad():
        m(x)
        logits = m.gating(x).view(-1, E)
        _, _, info = syt.topk_route(logits, cfg,
                                    inputs=syt.RouteInputs(global_aux_loss_state=state))
    assert int(m.ga_steps) == 0 and state.steps == 0
    assert info.aux_loss > 0  # read-only: the loss of the state plus this batch
    with torch.no_grad():  # the explicit choice stays available
        syt.topk_route(logits, cfg,
                       inputs=syt.RouteInputs(global_aux_loss_state=state),
                       options=syt.RouteOptions(accumulate_global_aux_loss=True))
    assert state.steps == 1
    m(x)  # a training forward with grad: both count it
    syt.topk_route(logits.clone().requires_grad_(True), cfg,
                   inputs=syt.RouteInputs(global_aux_loss_state=state))
    assert int(m.ga_steps) == 1 and state.steps == 2
    syt.topk_route(logits, cfg,
                   inputs=syt.RouteInputs(global_aux_loss_state=state),
                   options=syt.RouteOptions(training=False))  # eval: never
    assert state.steps == 2


# --------------------------------------------------------------------------------------------------
# 4. A repeated MTP layer: every loss value is Megatron's logged value (its share per call)
# --------------------------------------------------------------------------------------------------
@pytest.mark.hostile(tried="read RouteInfo.z_loss of a repeated MTP layer (mtp_num_layers=3) as "
                           "the per-layer log",
                     gets="Megatron's logged value (divided by the repeat count), like the "
                          "aux losses; the gradient unchanged")
@pytest.mark.parametrize("repeats", [1, 3])
def test_mtp_repeated_layer_loss_values_are_megatrons_logged_values(mcore, gen, repeats):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    H, E, K, s, b = 16, 8, 2, 8, 4
    types, coeffs, zc = ["aux_loss", "global_aux_loss"], [0.02, 0.01], 0.01
    m = mcore(H, num_moe_experts=E, moe_router_topk=K, moe_router_load_balancing_type=types,
              moe_aux_loss_coeff=coeffs, moe_z_loss_coeff=zc, mtp_num_layers=3,
              mtp_use_repeated_layer=repeats > 1)
    m.is_mtp_layer = True  # the constructor argument of an MTP layer's router
    cfg = _cfg(E, K, aux_loss_type=types, aux_loss_coeff=coeffs, z_loss_coeff=zc,
               is_mtp_layer=True, mtp_use_repeated_layer=repeats > 1, mtp_num_layers=3)
    state = sy.GlobalAuxLossState()
    # The same logits for both: only the loss arithmetic is compared.
    z = torch.randn(s, b, E, generator=gen) * 2
    zm = z.clone().requires_grad_(True)
    pm, _ = m.routing(zm)
    zs = z.view(-1, E).clone().requires_grad_(True)
    ps, idx, info = syt.topk_route(zs, cfg, inputs=syt.RouteInputs(global_aux_loss_state=state))
    logged = {n: float(e.values[m.layer_number + m.config.num_layers - 1])
              for n, e in get_moe_metrics_tracker().metrics.items()}
    # Megatron logs loss / coefficient; RouteInfo carries the coefficient. fp32 sums over the T
    # tokens (Megatron) against double ones: (T + 16) u relative.
    T = s * b
    rel = (T + E + 16) * U32
    for ours, name, c in ((info.z_loss, "z_loss", zc),
                          (info.aux_loss_parts["aux_loss"], "load_balancing_loss", coeffs[0]),
                          (info.aux_loss_parts["global_aux_loss"], "global_load_balancing_loss",
                           coeffs[1])):
        assert math.isclose(ours, logged[name] * c, rel_tol=rel), (name, ours, logged[name] * c)
    # Gradients agree (the z-loss gradient is not divided, as in Megatron).
    G = torch.linspace(-1, 1, T * E).view(T, E)
    (pm * G).sum().backward()
    (_dense_of(ps, idx, E) * G).sum().backward()
    torch.testing.assert_close(zs.grad, zm.grad.view(-1, E), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# 5. Sinkhorn with a padding mask normalises over the unpadded rows (a README deviation)
# --------------------------------------------------------------------------------------------------
def test_sinkhorn_with_padding_mask_balances_the_unpadded_rows_only(mu_sinkhorn, gen):
    """Megatron runs its Sinkhorn iteration over every row, padded ones included (its
    sinkhorn_load_balancing never sees the mask), so padding shifts the real tokens' experts.
    switchyard balances the real rows only: their ids are Megatron's Sinkhorn over those rows
    alone (run here in float64, as switchyard runs it), and padded rows are -1."""
    T, E, K = 24, 8, 2
    z = torch.randn(T, E, generator=gen)
    pad = torch.zeros(T, dtype=torch.bool)
    pad[16:] = True
    z[16:, 0] += 6.0  # padded rows crowd expert 0: balancing over all rows pushes real rows away
    cfg = _cfg(E, K, aux_loss_type="sinkhorn")
    _, idx, _ = syt.topk_route(z, cfg, inputs=syt.RouteInputs(padding_mask=pad))
    assert bool((idx[pad] == -1).all())

    def sinkhorn_ids(rows):
        return torch.topk(mu_sinkhorn(rows.double()), k=K, dim=1).indices
    want = sinkhorn_ids(z[~pad])
    assert torch.equal(idx[~pad].sort(1).values, want.sort(1).values)
    megatron_all_rows = sinkhorn_ids(z)[~pad]
    assert not torch.equal(megatron_all_rows.sort(1).values, want.sort(1).values)


@pytest.fixture(scope="module")
def mu_sinkhorn(mcore):
    from megatron.core.transformer.moe.moe_utils import sinkhorn
    return sinkhorn


# --------------------------------------------------------------------------------------------------
# 6. moe_router_dtype=None means the input's dtype on both of the integration's paths
# --------------------------------------------------------------------------------------------------
@pytest.mark.hostile(tried="Megatron moe_router_dtype=None with bf16 activations through "
                           "apply(engine='cpu') and through topk_router()",
                     gets="bf16 logits on both paths (Megatron's meaning of None: the input's "
                          "dtype), the same ids and weights")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_dtype_none_means_the_input_dtype_on_both_megatron_paths(mcore, gen, dtype):
    from switchyard.integrations import megatron as sym
    H, E, K, T = 16, 8, 2, 24
    m = mcore(H, num_moe_experts=E, moe_router_topk=K, moe_router_dtype=None)
    with torch.no_grad():  # bf16 values in the fp32 weight: every path sees the same weight
        m.weight.copy_(m.weight.to(torch.bfloat16).float())
    kw = sym.topk_router_kwargs(m.config)
    assert kw["router_dtype"] is None
    srt = sym.topk_router(m)
    x = (torch.randn(T, 1, H, generator=gen) * 2).to(dtype)
    with torch.no_grad():
        logits_megatron = m.gating(x)  # Megatron's own: the input's dtype
        ps, idx = srt(x)
        with sym.patched(engine="cpu"):
            sym.attach_replay(m)
            logits_engine = m.gating(x)
            pe, me = m(x)
            sym.detach_replay(m)
    assert logits_megatron.dtype == logits_engine.dtype == dtype
    assert ps.dtype == pe.dtype == dtype
    ps, idx = ps.view(-1, K), idx.view(-1, K)
    assert torch.equal(torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True), me)
    # One gate (switchyard's) and one router on both paths: the same weights, bitwise.
    assert torch.equal(_dense_of(ps, idx, E), pe)
