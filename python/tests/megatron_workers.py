"""Worker processes for test_megatron.py: real Megatron-Core MoE layers on CPU over gloo.

Each case runs on every rank of a torch.multiprocessing.spawn'd group and writes its findings
(tensors, error messages) to ``out_dir/rank{r}.pt``; the pytest side asserts on them. Small real
shapes (E 8, K 2, H 16), seeded; the EP=1 reference layer lives in the same process on a
singleton group with the same weights.
"""
import os
import sys
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
E, K, H, F = 8, 2, 16, 24


def _groups(rank, world):
    from megatron.core.process_groups_config import ProcessGroupCollection
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    w = dist.new_group(list(range(world)))
    me = singles[rank]

    def pgc(ep):
        pg = ProcessGroupCollection()
        pg.tp = pg.cp = pg.tp_cp = pg.expt_tp = me
        pg.tp_dp_cp = pg.ep = pg.tp_ep = ep
        pg.expt_dp = me
        return pg
    return pgc(w), pgc(me), w


def _config(world, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=1, ffn_hidden_size=F,
                moe_ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=K,
                moe_token_dispatcher_type="alltoall", add_bias_linear=False,
                use_cpu_initialization=True, moe_permute_fusion=False,
                params_dtype=torch.float32, expert_model_parallel_size=world,
                moe_router_dtype="fp32", moe_aux_loss_coeff=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _layer(cfg, pg, layer_number=1, is_mtp_layer=False):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    layer = spec(config=cfg, layer_number=layer_number, pg_collection=pg,
                 is_mtp_layer=is_mtp_layer)
    layer.set_layer_number(layer_number)
    # Deterministic weights by global expert id, so EP=1 and EP=n layers hold the same model.
    g = torch.Generator().manual_seed(1000 + layer_number)
    router_w = torch.randn(E, H, generator=g) * 0.5
    expert_w = [(torch.randn(F, H, generator=g) * 0.2, torch.randn(H, F, generator=g) * 0.2)
                for _ in range(E)]
    with torch.no_grad():
        layer.router.weight.copy_(router_w)
        for i, ex in enumerate(layer.experts.local_experts):
            w1, w2 = expert_w[layer.local_expert_indices[i]]
            ex.linear_fc1.weight.copy_(w1)
            ex.linear_fc2.weight.copy_(w2)
    return layer


def _tokens(rank, T=12):
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(T, 1, H, generator=g)


def _replay_ids(rank, T=12, zero_rows=(2, 5, 9)):
    g = torch.Generator().manual_seed(50 + rank)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    for t in zero_rows:
        ids[t] = 0  # zero-filled padding rows from a rollout: repeated id 0
    return ids


def _err(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 (the message is the finding)
        return f"{type(e).__name__}: {e}"


def _megatron_replay(layers, ids_list):
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    RouterReplay.set_replay_data(ids_list)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def _fwd_bwd(layer, x):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.sum().backward()
    return out.detach(), x.grad.detach()


# ---------------------------------------------------------------------------------------------
def case_seed(rank, world, res):
    """The seed bug: Megatron's own replay with zero-filled rows, unpatched then patched."""
    import switchyard.integrations.megatron as sym
    from megatron.core.transformer.moe.router_replay import RouterReplay
    pg_ep, pg_one, w = _groups(rank, world)
    cfg = _config(world, moe_enable_routing_replay=True)
    cfg1 = _config(1, moe_enable_routing_replay=True)
    RouterReplay.global_router_replay_instances.clear()
    layer = _layer(cfg, pg_ep)
    ref = _layer(cfg1, pg_one)
    x, ids = _tokens(rank), _replay_ids(rank)
    _megatron_replay([layer, ref], [ids, ids])
    res["unpatched_error"] = _err(lambda: layer(x))
    dist.barrier(w)
    # Fresh layers for switchyard's replay (Megatron's replay off), same weights. Megatron's
    # dispatcher keeps the earliest sync point it ever needed, so a native forward first fixes
    # the point this layout needs; the patched replay must not move it.
    layer_sy, ref_sy = _layer(_config(world), pg_ep), _layer(_config(1), pg_one)
    with torch.no_grad():
        layer_sy(x)
    res["native_sync_point"] = layer_sy.token_dispatcher.cuda_sync_point
    res["report"] = str(sym.apply())
    try:
        _megatron_replay([layer, ref], [ids, ids])
        res["patched_out"], res["patched_grad"] = _fwd_bwd(layer, x)
        res["patched_sync_point"] = layer.token_dispatcher.cuda_sync_point
        _megatron_replay([layer, ref], [ids, ids])
        res["ref_out"], res["ref_grad"] = _fwd_bwd(ref, x)
        # switchyard's replay: merged zero rows, host-known pair count.
        layer, ref = layer_sy, ref_sy
        for m in (layer, ref):
            sym.attach_replay(m, invalid_replay_rows="merge")
            sym.set_replay_targets(m, {1: ids}, num_tokens=ids.shape[0])
            sym.set_replay_action(m, "replay_forward")
        res["sy_out"], res["sy_grad"] = _fwd_bwd(layer, x)
        res["sy_ref_out"], res["sy_ref_grad"] = _fwd_bwd(ref, x)
        res["sy_counts"] = vars(sym.replay_counts(layer)[1])
        res["sy_num_out_tokens"] = int(layer.token_dispatcher.num_out_tokens)
        res["sy_sync_point"] = layer.token_dispatcher.cuda_sync_point
        sym.set_replay_targets(layer, {1: ids})
        probs, routing_map = layer.router(x)
        res["sy_probs"], res["sy_map"] = probs.detach(), routing_map
        res["ids"] = ids
    finally:
        sym.remove()


def case_fused(rank, world, res):
    """Replay on the unfused and fused (moe_router_fusion) router paths, record -> replay."""
    import megatron_shims
    import switchyard.integrations.megatron as sym
    from megatron.core.transformer.moe.router_replay import RouterReplay
    megatron_shims.install_fused_router_stand_in()
    pg_ep, _, _ = _groups(rank, world)
    ids = _replay_ids(rank, zero_rows=())
    x = _tokens(rank)
    for tag in ("unfused", "fused", "sinkhorn"):
        RouterReplay.global_router_replay_instances.clear()
        kw = {"moe_router_fusion": True} if tag == "fused" else \
            {"moe_router_load_balancing_type": "sinkhorn"} if tag == "sinkhorn" else {}
        cfg = _config(world, moe_enable_routing_replay=True, **kw)
        layer = _layer(cfg, pg_ep)
        _megatron_replay([layer], [ids])
        _, rm = layer.router(x)
        res[f"megatron_{tag}_map"] = rm
        with sym.patched():
            layer.router.router_replay = None
            sym.attach_replay(layer)
            sym.set_replay_targets(layer, {1: ids})
            sym.set_replay_action(layer, "replay_forward")
            probs, rm = layer.router(x)
            res[f"sy_{tag}_map"], res[f"sy_{tag}_probs"] = rm, probs.detach()
            res[f"sy_{tag}_counts"] = vars(sym.replay_counts(layer)[1])
            if tag == "sinkhorn":
                res["sinkhorn_logits"] = layer.router.gating(x).view(-1, E).detach()
            # R2: record in a no-grad pass, replay the recorded ids in the next one.
            sym.set_replay_action(layer, "record")
            with torch.no_grad():
                _, rm_rec = layer.router(x * 1.5)
            sym.set_replay_action(layer, "replay_forward")
            _, rm_rep = layer.router(x)
            res[f"r2_{tag}_recorded"], res[f"r2_{tag}_replayed"] = rm_rec, rm_rep
    res["ids"] = ids


def case_mtp(rank, world, res):
    """Routers keyed by layer number: an MTP router built between two decoder layers does not
    shift replay (Megatron's positional list does)."""
    import switchyard.integrations.megatron as sym
    from megatron.core.transformer.moe.router_replay import RouterReplay
    pg_ep, _, _ = _groups(rank, world)
    RouterReplay.global_router_replay_instances.clear()
    cfg = _config(world, moe_enable_routing_replay=True, mtp_num_layers=1)
    l1 = _layer(cfg, pg_ep, layer_number=1)
    mtp = _layer(cfg, pg_ep, layer_number=1, is_mtp_layer=True)
    l2 = _layer(cfg, pg_ep, layer_number=2)
    model = torch.nn.ModuleList([l1, l2, mtp])
    x = _tokens(rank)
    a, b = _replay_ids(rank, zero_rows=()), _replay_ids(rank + 10, zero_rows=())
    # Megatron: the list is in construction order, so the second table lands on the MTP router.
    _megatron_replay([l1, mtp, l2], [a, b, a])
    res["megatron_l2_map"] = l2.router(x)[1]
    with sym.patched():
        for m in (l1, l2, mtp):
            m.router.router_replay = None
        res["keys"] = sorted(map(str, sym.attach_replay(model)))
        sym.set_replay_targets(model, {1: a, 2: b})
        sym.set_replay_action(model, "replay_forward", keys=[1, 2])  # the MTP layer: native
        res["sy_l1_map"] = l1.router(x)[1]
        res["sy_l2_map"] = l2.router(x)[1]
        res["sy_mtp_map"] = mtp.router(x)[1]
        res["sy_counts"] = {str(k): vars(v) for k, v in sym.replay_counts(model).items()}
        res["bad_key"] = _err(lambda: sym.set_replay_targets(model, {3: a}))
        # Virtual pipeline chunks (a list of modules) keep the same keys.
        sym.detach_replay(model)
        chunks = [torch.nn.ModuleList([l1]), torch.nn.ModuleList([l2, mtp])]
        res["vpp_keys"] = sorted(map(str, sym.attach_replay(chunks)))
        sym.set_replay_targets(chunks, {2: b})
        sym.set_replay_action(chunks, "replay_forward", keys=[2])
        res["vpp_l2_map"] = l2.router(x)[1]
        # Two routers claiming one key (a model built twice into one container) is an error.
        dup = torch.nn.ModuleList([l1, _layer(cfg, pg_ep, layer_number=1)])
        res["dup_key"] = _err(lambda: sym.attach_replay(dup))
    res["a"], res["b"] = a, b


def case_recompute(rank, world, res):
    """Activation recompute (recompute_granularity='selective', modules ['moe']) reuses the
    forward's ids; forward-only passes queue nothing; gradients equal the non-recomputed layer."""
    import switchyard.integrations.megatron as sym
    pg_ep, _, _ = _groups(rank, world)
    cfg_rc = _config(world, recompute_granularity="selective", recompute_modules=["moe"])
    cfg = _config(world)
    rc, plain = _layer(cfg_rc, pg_ep), _layer(cfg, pg_ep)
    res["moe_layer_recompute"] = bool(rc.moe_layer_recompute)
    x = _tokens(rank)
    ids = _replay_ids(rank, zero_rows=(4,))
    seen = []
    rc.router.register_forward_hook(lambda m, i, o: seen.append(o[1].clone()))
    with sym.patched():
        sym.attach_replay(rc, invalid_replay_rows="merge")
        sym.attach_replay(plain, invalid_replay_rows="merge")
        for m in (rc, plain):
            sym.set_replay_action(m, "replay_forward")
        # A forward-only pass first (old-log-prob style): it must not grow the queue.
        sym.set_replay_targets(rc, {1: ids})
        with torch.no_grad():
            rc(x)
        res["pending_after_forward_only"] = sym.replays(rc)[1].num_pending_recompute
        sym.set_replay_targets(rc, {1: ids})
        sym.set_replay_targets(plain, {1: ids})
        rc.train()
        res["rc_out"], res["rc_grad"] = _fwd_bwd(rc, x)
        res["plain_out"], res["plain_grad"] = _fwd_bwd(plain, x)
        res["pending_after_backward"] = sym.replays(rc)[1].num_pending_recompute
        res["router_calls"] = len(seen)
        res["maps"] = seen[1:]  # [training forward under checkpoint, recompute in backward]
        res["rc_total"] = vars(sym.replay_counts(rc, total=True)[1])
        # Checkpointed forwards whose backward never comes hit the bound, with a clear error.
        sym.detach_replay(rc)
        sym.attach_replay(rc, invalid_replay_rows="merge", max_pending_backward=2)
        sym.set_replay_action(rc, "replay_forward")
        errs = []
        for _ in range(3):
            sym.set_replay_targets(rc, {1: ids})
            errs.append(_err(lambda: rc(x.clone().requires_grad_(True))))
        res["bound_errors"] = errs
        res["pending_at_bound"] = sym.replays(rc)[1].num_pending_recompute
        sym.clear_replay(rc)
        res["pending_after_clear"] = sym.replays(rc)[1].num_pending_recompute
    res["ids"] = ids


def case_bad(rank, world, res):
    """Bad replay tensors on one rank: every rank raises the same error, nobody hangs."""
    import switchyard.integrations.megatron as sym
    pg_ep, _, w = _groups(rank, world)
    layer = _layer(_config(world), pg_ep)
    x = _tokens(rank)
    good = _replay_ids(rank, zero_rows=())
    bad = {
        "repeat": _replay_ids(rank, zero_rows=(3,)),
        "range": good.clone().index_put_((torch.tensor([6]), torch.tensor([1])),
                                         torch.tensor(E + 3)),
        "mixed": good.clone().index_put_((torch.tensor([1]), torch.tensor([0])),
                                         torch.tensor(-1)),
        "shape": good[:, :1],
        "dtype": good.float(),
        "tokens": good[:-1],
    }
    with sym.patched():
        sym.attach_replay(layer)
        for name, t in bad.items():
            mine = t if rank == world - 1 else good
            res[f"err_{name}"] = _err(lambda: sym.set_replay_targets(
                layer, {1: mine}, num_tokens=x.shape[0], group=w))
        # An all -1 row is routed natively and counted; no target queued by the failures above.
        res["queued_after_errors"] = sym.replays(layer)[1].num_targets + \
            layer.router._sy.replay.num_targets
        nat = good.clone()
        nat[0] = -1
        sym.set_replay_targets(layer, {1: nat}, group=w)
        sym.set_replay_action(layer, "replay_forward")
        layer(x)
        res["native_counts"] = vars(sym.replay_counts(layer)[1])
        # A replay tensor whose token count differs from the router's (no num_tokens given).
        sym.set_replay_targets(layer, {1: good[:5]})
        res["err_forward_tokens"] = _err(lambda: layer.router(x))
        # repeated_ids="native": invalid rows are routed natively and counted as invalid.
        sym.clear_replay(layer)
        sym.attach_replay(layer, invalid_replay_rows="native")
        sym.set_replay_action(layer, "replay_forward")
        sym.set_replay_targets(layer, {1: bad["repeat"]}, group=w)
        _, rm = layer.router(x)
        res["invalid_native_counts"] = vars(sym.replay_counts(layer)[1])
        res["invalid_native_map"], res["repeat_ids"] = rm, bad["repeat"]


def case_engine(rank, world, res):
    """apply(engine="cpu"): switchyard's FP32 gate + topk_route on CPU tensors, against
    Megatron's own router math; batch invariance; the layer step against Megatron's math."""
    import switchyard.integrations.megatron as sym
    pg_ep, _, _ = _groups(rank, world)
    cfg = _config(world)
    layer = _layer(cfg, pg_ep)
    x = _tokens(rank, T=20)
    ids = _replay_ids(rank, T=20, zero_rows=(4, 11))
    with torch.no_grad():
        res["megatron_probs"], res["megatron_map"] = layer.router(x)
    with sym.patched():
        sym.attach_replay(layer, invalid_replay_rows="merge")
        sym.set_replay_targets(layer, {1: ids})
        sym.set_replay_action(layer, "replay_forward")
        res["megatron_out"], res["megatron_grad"] = _fwd_bwd(layer, x)
    sym.detach_replay(layer)
    with sym.patched(engine="cpu") as report:
        res["report"] = str(report)
        sym.attach_replay(layer, invalid_replay_rows="merge")
        with torch.no_grad():
            res["engine_probs"], res["engine_map"] = layer.router(x)
            res["engine_probs_first5"], _ = layer.router(x[:5])
        sym.set_replay_targets(layer, {1: ids})
        sym.set_replay_action(layer, "replay_forward")
        res["engine_out"], res["engine_grad"] = _fwd_bwd(layer, x)
        res["engine_counts"] = vars(sym.replay_counts(layer)[1])
        sym.set_replay_targets(layer, {1: ids})
        with torch.no_grad():
            res["engine_replay_probs"], res["engine_replay_map"] = layer.router(x)
    res["ids"] = ids


def case_datapath(rank, world, res):
    """verl routed_experts -> from_verl -> pack_thd -> layer_targets -> the model's routers:
    zero rows (tokens the rollout never routed) and alignment padding are routed natively and
    counted, every other token replays its rollout ids, layer by layer number."""
    import switchyard.integrations.megatron as sym
    import switchyard.routes as routes
    pg_ep, _, _ = _groups(rank, world)
    cfg = _config(world, num_layers=3)
    model = torch.nn.ModuleList([_layer(cfg, pg_ep, layer_number=n) for n in (2, 3)])
    g = torch.Generator().manual_seed(90 + rank)
    B, S, L = 2, 6, 3  # hidden layer 0 dense
    routed = torch.zeros(B, S, L, K, dtype=torch.int16)
    mask = torch.zeros(B, S, dtype=torch.int64)
    for b, n in enumerate((4, 6)):
        mask[b, S - n:] = 1
        for s_ in range(S - n, S - 1):
            for h in (1, 2):
                routed[b, s_, h] = torch.randperm(E, generator=g)[:K].to(torch.int16)
    tables, rep = routes.from_verl(routed, mask, num_experts=E, first_k_dense=1)
    packed, cu, cu_padded = routes.pack_thd(tables, tp_size=4, num_experts=E)
    T = packed.shape[0]
    x = torch.randn(T, 1, H, generator=g)
    with sym.patched():
        keys = sym.attach_replay(model)
        sym.set_replay_targets(model, routes.layer_targets(packed, rep["moe_layers"], keys),
                               num_tokens=T)
        sym.set_replay_action(model, "replay_forward")
        with torch.no_grad():
            res["maps"] = {n: model[i].router(x)[1] for i, n in enumerate((2, 3))}
        res["counts"] = {k: vars(v) for k, v in sym.replay_counts(model).items()}
    res["packed"], res["moe_layers"] = packed, list(rep["moe_layers"])
    res["cu"], res["cu_padded"] = list(cu), list(cu_padded)


def case_block(rank, world, res):
    """A real TransformerBlock (attention, a dense first layer, two MoE layers) with
    recompute_granularity='full': verl routes via from_verl/layer_targets replay in the layers
    they belong to (keys from TransformerLayer's own layer numbers), the recompute inside
    backward reuses the same ids, and output and gradients equal the block without recompute."""
    import switchyard.integrations.megatron as sym
    import switchyard.routes as routes
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_block import TransformerBlock
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    tensor_parallel.get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    try:
        pg = ProcessGroupCollection.use_mpu_process_groups()
        common = dict(num_layers=3, moe_layer_freq=[0, 1, 1], attention_dropout=0.0,
                      hidden_dropout=0.0)
        blocks = {}
        for name, kw in (("plain", {}), ("full", dict(recompute_granularity="full",
                                                      recompute_method="uniform",
                                                      recompute_num_layers=1))):
            cfg = _config(world, **common, **kw)
            torch.manual_seed(5)
            blocks[name] = TransformerBlock(cfg, get_gpt_decoder_block_spec(
                cfg, use_transformer_engine=False), pg_collection=pg)
        blocks["full"].load_state_dict(blocks["plain"].state_dict())
        S, L = 12, 3
        g = torch.Generator().manual_seed(70 + rank)
        routed = torch.zeros(1, S, L, K, dtype=torch.int16)
        for s_ in range(S - 1):  # the last token was never routed: zeros
            for h in (1, 2):
                routed[0, s_, h] = torch.randperm(E, generator=g)[:K].to(torch.int16)
        tables, rep = routes.from_verl(routed, torch.ones(1, S, dtype=torch.bool), num_experts=E, first_k_dense=1)
        x = torch.randn(S, 1, H, generator=g)
        am = torch.triu(torch.ones(1, 1, S, S), diagonal=1).bool()
        with sym.patched():
            for name, blk in blocks.items():
                keys = sym.attach_replay(blk)
                res[f"{name}_keys"] = sorted(keys)
                seen = res[f"{name}_maps"] = {k: [] for k in keys}
                for layer in blk.layers:
                    if hasattr(layer.mlp, "router"):
                        n = layer.mlp.router.layer_number
                        layer.mlp.router.register_forward_hook(
                            lambda m, i, o, n=n, seen=seen: seen[n].append(o[1].clone()))
                sym.set_replay_targets(blk, routes.layer_targets(tables[0], rep["moe_layers"],
                                                                 keys), num_tokens=S)
                sym.set_replay_action(blk, "replay_forward")
                blk.train()
                xi = x.clone().requires_grad_(True)
                out = blk(xi, attention_mask=am)
                out.sum().backward()
                res[f"{name}_out"], res[f"{name}_grad"] = out.detach(), xi.grad
                res[f"{name}_pending"] = {k: r.num_pending_recompute
                                          for k, r in sym.replays(blk).items()}
                res[f"{name}_counts"] = {k: vars(c) for k, c in
                                         sym.replay_counts(blk, total=True).items()}
        res["table"], res["moe_layers"] = tables[0], list(rep["moe_layers"])
    finally:
        parallel_state.destroy_model_parallel()


CASES = {n[5:]: f for n, f in globals().items() if n.startswith("case_")}


def init_gloo(rank, world, out_dir, **kw):
    """A gloo group through a file store in the test's own folder: no TCP rendezvous port, which a
    port picked by bind-and-close could lose to a concurrent test (ctest -j2 runs the MPI tests,
    whose Open MPI and gloo connections take ephemeral ports, beside pytest)."""
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'pg_store')}",
                            rank=rank, world_size=world, **kw)


def _worker(rank, world, cases, out_dir, module):
    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    init_gloo(rank, world, out_dir)
    import importlib
    import megatron_shims
    megatron_shims.install()
    table = importlib.import_module(module).CASES
    out = {}
    for case in cases:  # one process start (Megatron's import takes seconds) serves every case
        res = out[case] = {}
        try:
            table[case](rank, world, res)
        except Exception:  # noqa: BLE001 (reported to the test)
            res["worker_error"] = traceback.format_exc()
        dist.barrier()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def spawn(cases, world, out_dir, module="megatron_workers"):
    """Runs ``cases`` (names of the case_* functions of ``module``, a module of python/tests with a
    CASES table) on ``world`` gloo ranks; returns, per rank, {case: findings}."""
    import torch.multiprocessing as mp
    mp.spawn(_worker, args=(world, list(cases), out_dir, module), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world)]
