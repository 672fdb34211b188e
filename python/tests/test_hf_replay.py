"""Router replay (R2, R3) and route capture through switchyard.integrations.hf on real tiny
transformers MoE models: record/replay round trips, targets from vLLM arrays, verl's
routed_experts and route files, -1 and invalid rows, activation-checkpoint recompute, and capture
during generate() checked against switchyard's vLLM importer."""
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")  # an optional dependency of switchyard

import switchyard as sy  # noqa: E402
import switchyard.routes as syr  # noqa: E402
import switchyard.integrations.hf as syhf  # noqa: E402
from hf_models import FAMILIES, build, tokens  # noqa: E402

# A representative subset for the slower end-to-end tests: softmax (with a dense first layer
# elsewhere), sigmoid + groups with a dense first layer, top-k-then-softmax with bias, Llama-4's
# dense scores, hybrid linear attention.
E2E = ["qwen3_moe", "deepseek_v3", "gpt_oss", "llama4_text", "qwen3_next"]


def _counts(replayed, native, invalid=0, recomputed=0, calls=1):
    return {"num_replayed_rows": replayed, "num_native_rows": native,
            "num_invalid_replay_rows": invalid, "num_recomputed_rows": recomputed,
            "num_calls": calls}


def _perturb_routers(model, p, scale=0.05, seed=9):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in p.layers:
            r = model.get_submodule(p.modules[layer])
            w, _ = syhf.FAMILIES["llama4" if model.config.model_type == "llama4_text"
                                 else model.config.model_type].params(r)
            w.add_(torch.randn(w.shape, generator=g).to(w.dtype) * scale)


def _captured(p, fn):
    with p.capture() as cap:
        out = fn()
    return cap.ids(), out  # [B, S, num_hidden_layers, K]


@pytest.mark.parametrize("family", FAMILIES)
def test_r2_record_then_replay_reproduces_ids_and_outputs(family):
    model = build(family)
    p = syhf.patch(model)
    ids = tokens(2, 11, seed=5)
    T = ids.numel()
    p.set_action("record")
    with torch.no_grad():
        rec_ids, ref = _captured(p, lambda: model(ids).logits)
    assert all(r.num_recorded == 1 for r in p.replays.values())
    # Same weights: the replay pass is bitwise the record pass.
    p.set_action("replay_forward")
    with torch.no_grad():
        got_ids, got = _captured(p, lambda: model(ids).logits)
    assert torch.equal(got, ref)
    assert torch.equal(got_ids, rec_ids)
    # The update changed the routers: replay still forces the recorded ids; gradients reach the
    # router weights through the weights recomputed from the live logits.
    p.reset_counts()
    p.set_action("record")
    with torch.no_grad():
        model(ids)
    _perturb_routers(model, p)
    p.set_action(None)
    with torch.no_grad():
        native_ids, _ = _captured(p, lambda: model(ids))
    assert not torch.equal(native_ids, rec_ids), "the perturbation must change some routes"
    p.reset_counts()
    p.set_action("replay_forward")
    model.train()
    replay_ids, out = _captured(p, lambda: model(ids, labels=ids))
    out.loss.backward()
    assert torch.equal(replay_ids, rec_ids)
    for layer, c in p.counts().items():
        assert c == _counts(replayed=T, native=0)
        w, _ = syhf.FAMILIES[p._layers[0].family.name].params(model.get_submodule(p.modules[layer]))
        assert w.grad is not None and bool(w.grad.abs().sum() > 0)
    p.unpatch()


def _left_padded_prompts():
    prompts = tokens(2, 6, seed=6)
    mask = torch.ones_like(prompts)
    prompts[1, :2] = 0  # pad_token_id
    mask[1, :2] = 0
    return prompts, mask


def _generate_with_capture(model, p, new_tokens=4):
    prompts, mask = _left_padded_prompts()
    with p.capture() as cap:
        seq = model.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones(2, new_tokens, dtype=mask.dtype)], dim=1)
    return cap, seq, full_mask


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_during_generate_is_vllm_routed_experts(family, tmp_path):
    """Prefill and every decode step (KV cache) land in vLLM's layout, which switchyard's vLLM
    importer reads back (from .npy files) to the same tables; the route file round trips."""
    model = build(family)
    p = syhf.patch(model)
    new = 4
    cap, seq, full_mask = _generate_with_capture(model, p, new)
    assert cap.num_forwards == new  # prefill + new-1 decode steps: the last token is never fed
    arrays = cap.routed_experts(full_mask)
    L, K, E = model.config.num_hidden_layers, p.top_k, p.num_experts
    dense = [l for l in range(L) if l not in p.layers]
    for b, a in enumerate(arrays):
        n = int(full_mask[b].sum())
        assert a.dtype == torch.int32 and tuple(a.shape) == (n - 1, L, K)
        assert bool((a[:, dense] == 0).all())
        moe = a[:, p.layers]
        assert bool(((moe >= 0) & (moe < E)).all())
        assert bool((moe.sort(dim=-1).values.diff(dim=-1) != 0).all())  # distinct ids per row
    paths = cap.save_npy(tmp_path, full_mask)
    assert all(torch.equal(torch.from_numpy(np.load(f)), a) for f, a in zip(paths, arrays))
    freq = [1 if l in p.layers else 0 for l in range(L)]
    from_files, report = syr.import_vllm(paths, E, moe_layer_freq=freq)
    tables, _ = cap.tables(full_mask)
    assert report["moe_layers"] == p.layers and report["num_zero_rows"] == 0
    for t, f, a in zip(tables, from_files, arrays):
        assert torch.equal(t, f)
        assert torch.equal(t[:-1], a[:, p.layers])
        assert bool((t[-1] == -1).all())  # the last token has no route
    cap.write(tmp_path / "routes.syr", full_mask)
    back = syr.read(tmp_path / "routes.syr")
    assert all(torch.equal(a, b) for a, b in zip(back, tables))
    assert syr.RouteFile(tmp_path / "routes.syr").info["moe_layers"] == p.layers
    p.unpatch()


@pytest.mark.parametrize("family", E2E)
def test_capture_prefill_matches_a_plain_forward_and_decode_a_full_forward(family):
    """The prefill rows are bitwise those of a forward of the prompts; the decode rows (KV cache)
    match a full forward of the generated sequences wherever that forward's K-th choice leads the
    next by a margin the cache's rounding cannot cross."""
    model = build(family)
    p = syhf.patch(model)
    cap, seq, full_mask = _generate_with_capture(model, p)
    ids = cap.ids()
    prompts, mask = _left_padded_prompts()
    with torch.no_grad():
        pre, _ = _captured(p, lambda: model(prompts, attention_mask=mask))
    S0 = prompts.shape[1]
    assert torch.equal(ids[:, :S0], pre)
    # Full forward of the fed tokens, with the router logits to measure margins.
    logits = {}
    hs = []
    for layer in p.layers:
        r = model.get_submodule(p.modules[layer])
        hs.append(r.register_forward_hook(
            lambda m, a, o, layer=layer: logits.__setitem__(
                layer, (o[1] if family == "llama4_text" else o[0]).detach())))
    fed = seq[:, :-1]
    with torch.no_grad():
        full, _ = _captured(p, lambda: model(fed, attention_mask=full_mask[:, :-1]))
    for h in hs:
        h.remove()
    checked = 0
    for layer in p.layers:
        z = logits[layer].view(*fed.shape, -1)
        top = z.sort(dim=-1, descending=True).values
        margin = top[..., p.top_k - 1] - top[..., p.top_k]
        ok = (margin > 1e-3) & full_mask[:, :-1].bool()
        if family == "deepseek_v3":  # group-limited: a logit margin does not bound the selection
            ok = torch.zeros_like(ok)
        a = ids[:, :, layer].sort(dim=-1).values
        f = full[:, :, layer].sort(dim=-1).values
        assert bool((a == f).all(dim=-1)[ok].all()), layer
        checked += int(ok.sum())
    assert checked > 0 or family == "deepseek_v3"
    p.unpatch()


@pytest.mark.parametrize("family", [*E2E, "jetmoe"])
def test_r3_targets_from_vllm_verl_and_route_files_replay_the_rollout(family, tmp_path):
    """R3: routes captured during generate() (the rollout) replayed in a training forward over the
    generated sequences, from vLLM arrays, from verl's padded int16 routed_experts and from a route
    file: the replayed ids are the rollout's; padding and each last token route natively. (JetMoE:
    two route layers per decoder layer, its attention experts' and its MLP experts' routers.)"""
    model = build(family)
    p = syhf.patch(model)
    cap, seq, full_mask = _generate_with_capture(model, p)
    arrays = cap.routed_experts(full_mask)
    targets, report = p.targets_from_vllm(arrays, full_mask)
    B, S = seq.shape
    assert tuple(targets.shape) == (B, S, len(p.layers), p.top_k)
    # verl: [B, S, num_hidden_layers, K] int16, left padded, zero filled, the last token zero
    # (JetMoE: num_route_layers = 2 × num_hidden_layers)
    L = model.config.num_hidden_layers * (2 if family == "jetmoe" else 1)
    assert p.num_route_layers == L
    verl = torch.zeros(B, S, L, p.top_k, dtype=torch.int16)
    for b, a in enumerate(arrays):
        pos = full_mask[b].nonzero().flatten()
        verl[b, pos[:-1]] = a.to(torch.int16)
    assert torch.equal(cap.to_verl(full_mask), verl)
    from_verl, vrep = p.targets_from_verl(verl, full_mask)
    assert torch.equal(from_verl, targets)
    assert vrep["num_zero_rows"] == 0
    # route file
    cap.write(tmp_path / "r.syr", full_mask)
    from_file = p.targets_from_tables(syr.read(tmp_path / "r.syr"), full_mask)
    assert torch.equal(from_file, targets)

    real = int(full_mask.sum())
    p.reset_counts()
    p.set_targets(targets)
    model.train()
    got, out = _captured(p, lambda: model(seq, attention_mask=full_mask, labels=seq))
    out.loss.backward()
    for m, layer in enumerate(p.layers):
        c = p.counts()[layer]
        assert c["num_replayed_rows"] == real - B, c
        assert c["num_native_rows"] == B * S - (real - B), c
        keep = targets[:, :, m, 0] >= 0
        assert torch.equal(got[:, :, layer][keep], targets[:, :, m][keep])
    p.unpatch()


def test_all_none_rows_route_natively_and_invalid_rows_are_errors_or_counted():
    model = build("qwen3_moe")
    ids = tokens(1, 6, seed=8)
    p = syhf.patch(model)
    p.set_action("record")
    with torch.no_grad():
        model(ids)
    layer = p.layers[1]
    tables = [p.replays[l].pop_recorded() for l in p.layers]
    t = torch.stack(tables, dim=1)  # [T, moe_layers, K]
    bad = t.clone()
    bad[2, 1] = -1            # all -1: native
    bad[4, 1, 1] = -1         # mixes -1 and ids: invalid
    with pytest.raises(ValueError, match=rf"\[replay\] layer {layer}, token 4: topk_idx row "
                                         r"\[\d+, -1\] mixes -1 and expert ids"):
        p.set_targets(bad)  # every layer's rows are checked before any layer queues its table
    assert all(r.num_targets == 0 for r in p.replays.values())
    p.unpatch()
    p = syhf.patch(model, invalid_replay_rows="native")
    bad[5, 0] = torch.tensor([3, 3])  # repeats an id
    p.set_targets(bad)
    with torch.no_grad():
        model(ids)
    c = p.counts()
    assert c[p.layers[0]] == _counts(replayed=5, native=1, invalid=1)
    assert c[layer] == _counts(replayed=4, native=2, invalid=1)
    p.unpatch()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8,
                                   torch.uint8, torch.uint16])
def test_set_targets_queues_each_layer_the_row_rule_of_its_slice_in_every_dtype(dtype):
    """set_targets converts a table whose ids fit int32 once, layer-major (hf.patch._layer_tables):
    each layer's queued rows (ids, kinds, counts) are the row rule's on that layer's slice of the
    table as given; an int64 id outside int32 still fails naming the layer and its position in the
    layer's table, with nothing queued."""
    model = build("qwen3_moe")
    p = syhf.patch(model, invalid_replay_rows="native")
    M, K, E = len(p.layers), p.top_k, p.num_experts
    g = torch.Generator().manual_seed(3)
    t = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(12 * M)]).view(12, M, K)
    t[2, 1] = -1                 # all -1: native
    t[5, 0] = torch.tensor([3, 3])  # a repeated id: invalid (counted under "native")
    if dtype.is_signed:
        t[7, 1, 1] = -1          # mixes -1 and ids: invalid
    given = t.to(dtype)
    p.set_targets(given)
    for m, layer in enumerate(p.layers):
        queued = p.driver.peek_forward(layer)  # the ReplayRows the forward will take
        want = sy.replay.classify_rows(given[:, m], E, policy="native", layer=layer)
        assert queued.ids.dtype == torch.int32 and queued.ids.is_contiguous()
        assert torch.equal(queued.ids, want.ids) and torch.equal(queued.kind, want.kind)
        assert (queued.num_replayed, queued.num_native, queued.num_invalid) == \
            (want.num_replayed, want.num_native, want.num_invalid)
    p.unpatch()
    if dtype == torch.int64:
        p = syhf.patch(model)  # (policy "error")
        big = t.clone()
        big[5, 0], big[7, 1] = big[4, 0], big[4, 1]
        big[4, 1, 0] = 2**32 + 5
        with pytest.raises(ValueError, match=rf"\[replay\] layer {p.layers[1]}, replay ids holds "
                                             rf"{2**32 + 5} at \[4, 0\], outside int32"):
            p.set_targets(big)
        assert all(r.num_targets == 0 for r in p.replays.values())
        p.unpatch()


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "native"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "llama4_text", "jetmoe"])
def test_checkpoint_recompute_reuses_the_forward_ids(family, reentrant, replay):
    """Under activation (gradient) checkpointing the recompute inside backward routes with the ids
    its forward used (replayed targets, native rows included), records and captures nothing, and the
    gradients are bitwise those of the same step without checkpointing."""
    model = build(family)
    model.train()
    p = syhf.patch(model)
    ids = tokens(2, 7, seed=10)
    T = ids.numel()
    g = torch.Generator().manual_seed(11)
    E, K, M = p.num_experts, p.top_k, len(p.layers)
    targets = torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
                           for _ in range(M)], dim=1).to(torch.int32)
    targets[3] = -1  # one token routed natively on every layer

    def step():
        model.zero_grad(set_to_none=True)
        p.reset_counts()
        if replay:
            p.set_targets(targets)
        with p.capture() as cap:
            out = model(ids, labels=ids)
            out.loss.backward()
        return {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}, cap

    ref, _ = step()
    if model.supports_gradient_checkpointing:
        # transformers 5.x's name for gradient_checkpointing_enable (deprecated, the same switch).
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        # JetMoE does not declare checkpointing support, but its decoder layers are checkpointing
        # layers: switched on there as activation_checkpointing_enable does, so that the
        # recompute of both its routers per decoder layer (attention and MLP experts) runs.
        import functools
        from torch.utils.checkpoint import checkpoint
        model._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=functools.partial(checkpoint,
                                                                       use_reentrant=reentrant))
        model.enable_input_require_grads()
    got, cap = step()
    assert cap.num_forwards == 1  # the recompute is not captured
    for layer, c in p.counts().items():
        want = (T - 1, 1) if replay else (0, T)
        assert c == _counts(replayed=want[0], native=want[1], recomputed=T)
        assert p.replays[layer].num_pending_recompute == 0
    assert ref.keys() == got.keys()
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    if model.supports_gradient_checkpointing:
        model.activation_checkpointing_disable()
    p.unpatch()


def test_set_targets_checks_the_layout():
    model = build("olmoe")
    p = syhf.patch(model)
    p.set_targets(torch.tensor([0, 1], dtype=torch.int32).expand(5, 2, 2))  # valid rows, T=5
    with pytest.raises(ValueError, match=r"\[replay\] layer 0 \(model.layers.0.mlp.gate\): the "
                                         r"replay tensor has 5 tokens, the router got 6"):
        model(tokens(1, 6))
    p.clear()
    p.set_action("replay_forward")  # nothing recorded, no targets
    with pytest.raises(ValueError, match=r"layer 0 \(model.layers.0.mlp.gate\): action "
                                         r"'replay_forward' but no replay target is set and "
                                         r"nothing was recorded"):
        model(tokens(1, 6))
    p.set_action(None)
    with pytest.raises(ValueError, match=r"routes must hold 2 MoE layers and K=2, got shape "
                                         r"\[5, 3, 2\]"):
        p.set_targets(torch.zeros(5, 3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="attention mask has 3 real tokens, the routes 4"):
        p.targets_from_tables([torch.zeros(4, 2, 2, dtype=torch.int32)],
                              torch.tensor([[0, 1, 1, 1]]))
    p.unpatch()


def test_the_hf_guide_example_is_the_example_file_and_runs():
    import os
    import runpy
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "examples", "hf_quickstart.py")
    with open(path) as f:
        example = f.read()
    with open(os.path.join(root, "docs", "guides", "hf.md")) as f:
        guide = f.read()
    assert "```python\n" + example + "```" in guide
    runpy.run_path(path, run_name="__main__")


def test_capture_of_a_plain_forward_drops_each_last_real_token():
    """A capture of one forward over padded sequences (mask as wide as the fed tokens): each
    sequence gives its real tokens but the last, in order, as vLLM would have returned them."""
    model = build("olmoe")
    p = syhf.patch(model)
    ids = tokens(2, 7, seed=13)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, 5:] = 0  # right padding
    with torch.no_grad(), p.capture() as cap:
        model(ids, attention_mask=mask)
    fed = cap.ids()
    arrays = cap.routed_experts(mask)
    assert [a.shape[0] for a in arrays] == [3, 4]
    assert torch.equal(arrays[0], fed[0, 3:6]) and torch.equal(arrays[1], fed[1, :4])
    with pytest.raises(ValueError, match=r"attention_mask must be \[2, 8\] \(generated sequences\) "
                                         r"or \[2, 7\] \(fed tokens\), got \[2, 5\]"):
        cap.routed_experts(mask[:, :5])
    p.unpatch()
