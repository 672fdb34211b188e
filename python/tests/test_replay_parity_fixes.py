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


@pytest.mark.hostile(tried="Megatron replay with repeated_ids='merge' and rows like [5, 5, 2], "
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
        sym.attach_replay(m, repeated_ids="merge")
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

