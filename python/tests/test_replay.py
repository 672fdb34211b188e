"""Router replay: replay_idx semantics (weights from the live logits at the replayed ids, all -1
rows native, invalid rows), RouterReplay queues, and the R2 / R3 flows with activation-checkpoint
recompute under torch.utils.checkpoint."""
import pytest
import torch
import torch.utils.checkpoint as ckpt

import switchyard as sy
import switchyard.torch as syt
import torch_ref as ref

SCORES = [dict(score_function="softmax"), dict(score_function="softmax", pre_softmax=True),
          dict(score_function="sigmoid", topk_scaling_factor=2.0),
          dict(score_function="sqrtsoftplus")]


def _replay_table(gen, T, E, K):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    ids[2] = -1  # routed natively, counted
    return ids


@pytest.mark.parametrize("kw", SCORES, ids=lambda kw: kw["score_function"] + (
    "-pre" if kw.get("pre_softmax") else ""))
def test_replay_weights_from_live_logits(gen, kw):
    T, E, K = 20, 16, 4
    cfg = sy.RouterConfig(num_experts=E, top_k=K, **kw)
    z = torch.randn(T, E, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = _replay_table(gen, T, E, K)
    probs, idx, info = syt.topk_route(z, cfg, inputs=syt.RouteInputs(replay_idx=ids))
    zr = z.detach().clone().requires_grad_(True)
    pr, ir, _, _, rinfo = ref.topk_route(zr, E, K, **kw, replay_idx=ids)
    assert torch.equal(idx[torch.arange(T) != 2], ids[torch.arange(T) != 2])  # order kept
    assert torch.equal(idx, ir)
    torch.testing.assert_close(probs, pr.detach(), rtol=1e-12, atol=1e-12)
    assert (info.num_replayed_rows, info.num_native_rows) == (T - 1, 1)
    g = torch.randn(T, K, generator=gen, dtype=torch.float64)
    (probs * g).sum().backward()
    (pr * g).sum().backward()
    torch.testing.assert_close(z.grad, zr.grad, rtol=1e-10, atol=1e-12)
    # Gradients reach the router through replayed rows too.
    assert float(z.grad[0].abs().sum()) > 0
    cfg2 = sy.RouterConfig(num_experts=E, top_k=K, **kw)
    assert torch.autograd.gradcheck(
        lambda z: syt.topk_route(z, cfg2,
                                 inputs=syt.RouteInputs(replay_idx=ids[:6]))[0],
        (z.detach()[:6].requires_grad_(),))


def test_recorded_routes_replay_bitwise(gen):
    # Replaying what a native pass chose reproduces its weights bit for bit.
    T, E, K = 33, 32, 8
    cfg = sy.RouterConfig(num_experts=E, top_k=K, score_function="sigmoid")
    z = torch.randn(T, E, generator=gen)
    p0, i0, _ = syt.topk_route(z, cfg)
    p1, i1, info = syt.topk_route(z, cfg, inputs=syt.RouteInputs(replay_idx=i0))
    assert torch.equal(i0, i1) and torch.equal(p0, p1) and info.num_replayed_rows == T


@pytest.mark.parametrize("row,why", [([3, -1, 5, 6], "mixes -1"), ([3, 3, 5, 6], "repeats expert 3"),
                                     ([3, 4, 5, 16], "outside")])
def test_invalid_rows(gen, row, why):
    T, E, K = 10, 16, 4
    cfg = sy.RouterConfig(num_experts=E, top_k=K)
    z = torch.randn(T, E, generator=gen)
    ids = _replay_table(gen, T, E, K)
    ids[7] = torch.tensor(row)
    with pytest.raises(ValueError, match=rf"layer 4, token 7: topk_idx row .*{why}"):
        syt.topk_route(z, cfg,
                       inputs=syt.RouteInputs(replay_idx=ids),
                       options=syt.RouteOptions(layer=4))
    probs, idx, info = syt.topk_route(z, cfg,
                                      inputs=syt.RouteInputs(replay_idx=ids),
                                      options=syt.RouteOptions(invalid_replay_rows="native"))
    assert info.num_invalid_replay_rows == 1 and info.num_native_rows == 2
    native = syt.topk_route(z[7:8], cfg)[1]
    assert torch.equal(idx[7:8], native)


def test_replay_queue_engine_ops():
    r = sy.RouterReplay(top_k=2, layer=3)
    a = torch.tensor([[0, 1], [2, 3]])
    b = torch.tensor([[4, 5]])
    r.record(a)
    r.record(b)
    assert r.num_recorded == 2
    assert torch.equal(r.pop_recorded().long(), a)
    assert torch.equal(r.replay_forward(b).long(), b)
    assert r.num_pending_recompute == 1
    with pytest.raises(ValueError):
        r.recompute(5)  # wrong token count: stays queued
    assert torch.equal(r.recompute(1).long(), b)
    with pytest.raises(IndexError):
        r.recompute(1)
    r.clear()
    with pytest.raises(IndexError):
        r.pop_recorded()
    with pytest.raises(ValueError, match="action"):
        r.action = "bogus"


def _layer(router, x):
    # A toy MoE-ish block: routed weights times a per-expert scale.
    probs, idx = router(x)
    scale = torch.arange(1, router.config.num_experts + 1, dtype=torch.float32)
    return (probs * scale[idx.clamp(min=0)]).sum(-1, keepdim=True) * x


def test_r2_record_then_replay_with_checkpoint_recompute(gen):
    E, K, H, T = 16, 4, 12, 9
    cfg = sy.RouterConfig(num_experts=E, top_k=K, score_function="sigmoid")
    router = syt.TopKRouter(hidden_size=H, config=cfg)
    replay = sy.RouterReplay(top_k=K, layer=0)
    router.replay = replay
    mbs = [torch.randn(T, H, generator=gen) for _ in range(3)]
    # Old-log-prob pass: record.
    replay.action = "record"
    with torch.no_grad():
        recorded = [router(x)[1].clone() for x in mbs]
    assert replay.num_recorded == 3
    # The policy moves: native routing would now differ.
    with torch.no_grad():
        router.weight.add_(torch.randn(E, H, generator=gen) * 0.5)
    # Update pass, 1F1B order: forward all micro-batches, then backward them first in first out;
    # the recompute inside backward replays the same ids.
    outs = []
    replay.action = "replay_forward"
    for x in mbs:
        xi = x.clone().requires_grad_(True)
        outs.append((xi, ckpt.checkpoint(_layer, router, xi)))
        assert router.last_info.num_replayed_rows == T
        assert torch.equal(router.last_info.num_tokens_per_expert,
                           torch.bincount(recorded[len(outs) - 1].flatten(), minlength=E))
    assert replay.num_recorded == 0 and replay.num_pending_recompute == 3
    replay.action = "recompute"
    for i, (xi, out) in enumerate(outs):
        router.weight.grad = None
        out.sum().backward()
        # Reference: the same block with the recorded ids replayed on the live weights.
        xr = xi.detach().clone().requires_grad_(True)
        wr = router.weight.detach().clone().requires_grad_(True)
        pr, ir, *_ = ref.topk_route(ref.gating_linear(xr, wr), E, K, score_function="sigmoid",
                                    replay_idx=recorded[i])
        assert torch.equal(ir, recorded[i])
        scale = torch.arange(1, E + 1, dtype=torch.float64)
        ((pr * scale[ir]).sum(-1, keepdim=True) * xr.double()).sum().backward()
        torch.testing.assert_close(xi.grad.double(), xr.grad.double(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(router.weight.grad.double(), wr.grad.double(), rtol=1e-4, atol=1e-5)
    assert replay.num_pending_recompute == 0


def test_r3_replay_rollout_routes_with_checkpoint(gen, tmp_path):
    # R3: ids recorded by the rollout engine (stored in a route file), -1 rows routed natively.
    E, K, H, T, L = 8, 2, 10, 7, 2
    cfg = sy.RouterConfig(num_experts=E, top_k=K)
    routers = [syt.TopKRouter(hidden_size=H, config=cfg, layer_number=l) for l in range(L)]
    replays = [sy.RouterReplay(top_k=K, layer=l) for l in range(L)]
    table = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T * L)]).view(T, L, K)
    table[T - 1] = -1  # the last sampled token has no route
    path = tmp_path / "routes.syr"
    sy.routes.write(str(path), [table], num_experts=E)
    (read,) = sy.routes.read(str(path))
    assert torch.equal(read.long(), table)
    x = torch.randn(T, H, generator=gen, requires_grad=True)

    def model(x):
        h = x
        for l in range(L):
            h = _layer(routers[l], h)
        return h

    for l in range(L):
        replays[l].action = "replay_forward"
        replays[l].set_target(read[:, l, :])
        routers[l].replay = replays[l]
    out = ckpt.checkpoint(model, x, use_reentrant=False)  # the inner layers see it exactly
    for l in range(L):
        info = routers[l].last_info
        assert (info.num_replayed_rows, info.num_native_rows) == (T - 1, 1)
        replays[l].action = "recompute"
    out.sum().backward()
    assert all(r.num_pending_recompute == 0 for r in replays)
    for l in range(L):
        assert routers[l].weight.grad is not None and float(routers[l].weight.grad.abs().sum()) > 0


def test_global_aux_loss_recompute_sees_its_forward_state(gen):
    # With global_aux_loss the running counts advance per call; the checkpoint recompute must
    # route on the state its forward saw, so the gradient equals the one without checkpointing.
    E, K, H, T = 8, 2, 6, 10
    cfg = sy.RouterConfig(num_experts=E, top_k=K, aux_loss_type="global_aux_loss",
                          aux_loss_coeff=0.5)
    xs = [torch.randn(T, H, generator=gen) for _ in range(2)]
    grads = []
    for use_ckpt in (False, True):
        torch.manual_seed(0)
        router = syt.TopKRouter(hidden_size=H, config=cfg)
        replay = sy.RouterReplay(top_k=K)
        router.replay = replay
        ids = [torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(i + 50 * j))[:K]
                            for j in range(T)]) for i in range(2)]
        for i in ids:
            replay.set_target(i)
        replay.action = "replay_forward"
        xg = [x.clone().requires_grad_(True) for x in xs]
        outs = [ckpt.checkpoint(_layer, router, x) if use_ckpt else _layer(router, x) for x in xg]
        replay.action = "recompute"
        g = []
        for out in outs:
            router.weight.grad = None
            out.sum().backward()
            g.append(router.weight.grad.clone())
        assert router.global_aux_loss_state.steps == 2
        if not use_ckpt:
            replay.clear()
        grads.append(g)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
