"""EP 2 cases of test_replay_conformance.py: real Megatron-Core MoE layers (alltoall dispatcher) on
two gloo ranks, built with megatron_workers' helpers (same shapes, seeded weights by global expert
id, an EP 1 reference layer with the same weights in the same process; the CPU shims of
megatron_shims). Each case writes its findings to ``out_dir/rank{r}.pt``."""
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
T = 12


def _targets(rank, K, seed, repeated=(), minus1=()):
    import megatron_workers as mw
    g = torch.Generator().manual_seed(seed + rank)
    ids = torch.stack([torch.randperm(mw.E, generator=g)[:K] for _ in range(T)])
    for r in repeated:
        ids[r, 1] = ids[r, 0]  # a partially repeated row [a, a, c]
    for r in minus1:
        ids[r] = -1
    return ids


def case_merge_grad(rank, world, res):
    """K = 3, invalid_replay_rows='merge', rows [a, a, c] and a -1 row: outputs, input and router weight
    gradients of the EP 2 layer against the EP 1 layer with the same weights and ids."""
    import megatron_workers as mw

    import switchyard.integrations.megatron as sym
    pg_ep, pg_one, _ = mw._groups(rank, world)
    layer = mw._layer(mw._config(world, moe_router_topk=3), pg_ep)
    ref = mw._layer(mw._config(1, moe_router_topk=3), pg_one)
    x = mw._tokens(rank, T)
    ids = _targets(rank, 3, 60, repeated=(1, 4, 7), minus1=(2,))
    with sym.patched():
        for name, m in (("ep", layer), ("ref", ref)):
            sym.attach_replay(m, invalid_replay_rows="merge")
            sym.set_replay_targets(m, {1: ids}, num_tokens=T)
            sym.set_replay_action(m, "replay_forward")
            xg = x.clone().requires_grad_(True)
            out, _ = m(xg)
            out.sum().backward()
            res[f"{name}_out"], res[f"{name}_xgrad"] = out.detach(), xg.grad
            res[f"{name}_wgrad"] = m.router.weight.grad.clone()
            c = sym.replay_counts(m)[1]
            res[f"{name}_counts"] = (c.replayed, c.merged, c.native, c.invalid)
            sym.detach_replay(m)


def case_mid_step(rank, world, res):
    """Two MoE layers (layer numbers 1, 2); a step fails between them on every rank (an error
    outside the router), the retry's targets are set: the experts each layer's router picked in
    the retry, and the retry's targets."""
    import megatron_workers as mw

    import switchyard.integrations.megatron as sym
    pg_ep, _, _ = mw._groups(rank, world)
    cfg = mw._config(world)
    layers = torch.nn.ModuleList([mw._layer(cfg, pg_ep, layer_number=n) for n in (1, 2)])
    x = mw._tokens(rank, T)
    old = {n: _targets(rank, mw.K, 70 + n) for n in (1, 2)}
    new = {n: _targets(rank, mw.K, 80 + n) for n in (1, 2)}
    maps = []
    for lay in layers:
        lay.router.register_forward_hook(lambda m, i, o: maps.append(o[1].clone()))

    def fail(mod, args):
        h.remove()
        raise RuntimeError("injected failure")

    def run():
        h = x
        for lay in layers:
            h, _ = lay(h)
        return h
    with sym.patched(), torch.no_grad():
        sym.attach_replay(layers)
        sym.set_replay_action(layers, "replay_forward")
        sym.set_replay_targets(layers, old, num_tokens=T)
        h = layers[1].register_forward_pre_hook(fail)
        try:
            run()
        except RuntimeError as e:
            res["error"] = str(e)
        maps.clear()
        sym.set_replay_targets(layers, new, num_tokens=T)
        run()
        res["retry_maps"] = list(maps)
        res["counts"] = {k: (c.replayed, c.native) for k, c in sym.replay_counts(layers).items()}
        sym.detach_replay(layers)
    res["new"] = new


CASES = {n[5:]: f for n, f in globals().items() if n.startswith("case_")}


def spawn(cases, world, out_dir):
    """Runs ``cases`` on ``world`` gloo ranks with megatron_workers' runner."""
    import megatron_workers as mw
    return mw.spawn(cases, world, out_dir, module=__name__)
