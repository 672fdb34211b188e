"""Careless and hostile uses of switchyard.integrations.hf (issue 22), on real tiny transformers MoE
models: a retry after a rejected replay step, an old Patch handle, beam search under capture,
copy.deepcopy of a patched model (TRL's reference model), a patched model on the meta device; and
the Megatron integration's retry after a token-count mismatch (real megatron-core on the CPU)."""
import copy

import pytest
import torch

pytest.importorskip("transformers")  # an optional dependency of switchyard

import switchyard.integrations.hf as syhf  # noqa: E402
from helpers import single_rank_gloo  # noqa: E402
from hf_models import FAMILIES, build, tokens  # noqa: E402


def _const_targets(p, T, ids):
    """[T, moe_layers, K] targets: every token of every MoE layer routed to ``ids``."""
    return torch.tensor(ids, dtype=torch.int32).expand(T, len(p.layers), p.top_k).clone()


def _used(p, model, ids):
    """The ids every MoE layer used in one forward: [T, moe_layers, K]."""
    with p.capture() as cap, torch.no_grad():
        model(ids)
    return cap.ids().reshape(-1, p.num_hidden_layers, p.top_k)[:, p.layers]


def _fails_once(module):
    """Makes ``module``'s next forward raise (a failure outside the router, mid-model)."""
    def hook(mod, args):
        h.remove()
        raise RuntimeError("injected failure")
    h = module.register_forward_pre_hook(hook)


# ---- 1. a step's replay targets are all or nothing -----------------------------------------------
def _retry_replays_its_own_targets(p, model, ids):
    """After a failed step no layer holds any of its ids; a retry's targets are used everywhere."""
    assert all(r.num_targets == 0 for r in p.replays.values())
    p.set_targets(_const_targets(p, 6, [2, 3]))
    used = _used(p, model, ids)
    assert bool((used.sort(dim=-1).values == torch.tensor([2, 3], dtype=torch.int32)).all()), used
    p.unpatch()


@pytest.mark.hostile(tried="HF R3: set_targets with a bad row in layer 0, then a corrected retry",
                     gets="the bad step is refused at set_targets, no layer stores any of it; the "
                          "retry replays its own ids in every layer")
def test_hf_retry_after_a_rejected_step_replays_its_own_targets():
    model = build("olmoe")
    p = syhf.patch(model)
    ids = tokens(1, 6, seed=3)
    bad = _const_targets(p, 6, [0, 1])
    bad[2, 0] = torch.tensor([4, -1])  # layer 0, token 2: mixes -1 and ids
    with pytest.raises(ValueError, match=r"token 2: topk_idx row \[4, -1\] mixes -1"):
        p.set_targets(bad)
        with torch.no_grad():
            model(ids)
    _retry_replays_its_own_targets(p, model, ids)


@pytest.mark.hostile(tried="HF R3: a forward that fails mid-model (targets of the wrong T; an "
                           "error in layer 1's attention), then set_targets again and retry",
                     gets="the failed step's targets are dropped in every layer; the retry replays "
                          "the new ids in every layer")
@pytest.mark.parametrize("failure", ["token_count", "attention"])
def test_hf_failed_forward_drops_the_step_in_every_layer(failure):
    model = build("olmoe")
    p = syhf.patch(model)
    ids = tokens(1, 6, seed=3)
    if failure == "token_count":
        p.set_targets(_const_targets(p, 4, [0, 1]))
        err, match = ValueError, r"layer 0 \(.*\): the replay tensor has 4 tokens, the router got 6"
    else:
        p.set_targets(_const_targets(p, 6, [0, 1]))
        _fails_once(model.model.layers[1].self_attn)
        err, match = RuntimeError, "injected failure"
    with pytest.raises(err, match=match), torch.no_grad():
        model(ids)
    _retry_replays_its_own_targets(p, model, ids)


@pytest.mark.hostile(tried="HF R2: a replay forward of micro-batch A fails in layer 1's attention, "
                           "then the replay of micro-batch B",
                     gets="A's recorded tables are dropped in every layer; B replays B's ids")
def test_hf_r2_failed_replay_keeps_the_layers_aligned():
    model = build("olmoe")
    p = syhf.patch(model)
    a, b = tokens(1, 6, seed=3), tokens(1, 6, seed=4)
    p.set_action("record")
    with p.capture() as cap, torch.no_grad():
        model(a)
        model(b)
    rec_b = cap.ids()[0, 6:, p.layers]  # [6, moe_layers, K]
    p.set_action("replay_forward")
    _fails_once(model.model.layers[1].self_attn)
    with pytest.raises(RuntimeError, match="injected failure"), torch.no_grad():
        model(a)
    assert all(r.num_recorded == 1 for r in p.replays.values())
    # B's forward replays B's tables in every layer (negated routers would route elsewhere).
    with torch.no_grad():
        for l in p.layers:
            model.get_submodule(p.modules[l]).weight.neg_()
    assert torch.equal(_used(p, model, b), rec_b)
    p.unpatch()


@pytest.mark.hostile(tried="Megatron: a forward whose token count does not match the queued "
                           "replay target, then the corrected retry",
                     gets="a ValueError naming both counts; the failed step's target is dropped, "
                          "and the retry replays the targets set for it")
def test_megatron_token_count_mismatch_drops_the_step_and_the_retry_uses_its_own(request):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import torch.distributed as dist
    import switchyard.integrations.megatron as sym
    single_rank_gloo()
    saved = torch.cuda.current_device  # Megatron's router buffers: the current device = the CPU
    torch.cuda.current_device = lambda: "cpu"
    request.addfinalizer(lambda: setattr(torch.cuda, "current_device", saved))
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    destroy_moe_metrics_tracker()
    W = dist.group.WORLD
    pg = ProcessGroupCollection(tp=W, cp=W, tp_cp=W, tp_dp_cp=W, dp=W, ep=W)
    E, K, H = 8, 2, 16
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1,
                            params_dtype=torch.float32, moe_router_dtype="fp32",
                            add_bias_linear=False, num_moe_experts=E, moe_router_topk=K,
                            moe_token_dispatcher_type="alltoall")
    router = TopKRouter(cfg, pg_collection=pg)
    router.set_layer_number(1)
    with sym.patched():
        sym.attach_replay(router)
        sym.set_replay_action(router, "replay_forward")
        target = torch.tensor([[2, 3]] * 6, dtype=torch.int32)
        sym.set_replay_targets(router, {1: target})
        g = torch.Generator().manual_seed(0)
        with pytest.raises(ValueError, match="the replay tensor has 6 tokens, the router got 8"):
            router(torch.randn(8, 1, H, generator=g))
        assert sym.replays(router)[1].num_targets == 0  # the failed step's ids are gone
        with pytest.raises(ValueError, match="no replay target is set"):
            router(torch.randn(6, 1, H, generator=g))  # never the failed step's table
        sym.set_replay_targets(router, {1: torch.tensor([[4, 1]] * 6, dtype=torch.int32)})
        _, routing_map = router(torch.randn(6, 1, H, generator=g))
        assert torch.equal(routing_map.nonzero()[:, 1].view(6, K),
                           torch.tensor([[1, 4]] * 6))
        assert sym.replay_counts(router)[1].replayed == 6
        sym.detach_replay(router)


# ---- 2. an old Patch handle ----------------------------------------------------------------------
@pytest.mark.hostile(tried="HF: unpatch() an old Patch handle after patching the model again",
                     gets="a no-op: the newer Patch stays installed, active and recording")
def test_hf_unpatch_of_an_old_handle_leaves_the_newer_patch():
    model = build("olmoe")
    ids = tokens(1, 5, seed=2)
    old = syhf.patch(model)
    old.unpatch()
    new = syhf.patch(model)
    old.unpatch()
    new.set_action("record")
    with new.capture() as cap, torch.no_grad():
        model(ids)
    assert cap.num_forwards == 1
    assert all(r.num_recorded == 1 for r in new.replays.values())
    assert all(r.num_recorded == 0 for r in old.replays.values())
    assert new.active and not old.active
    assert syhf.patch_of(model) is new
    new.unpatch()
    assert not new.active and syhf.patch_of(model) is None
    for l in new.layers:
        assert "forward" not in model.get_submodule(new.modules[l]).__dict__


# ---- 3. beam search under capture ----------------------------------------------------------------
@pytest.mark.hostile(tried="HF: capture during generate() with beam search, num_return_sequences "
                           "== num_beams",
                     gets="a ValueError naming num_beams before any forward; greedy and sampling "
                          "still capture")
@pytest.mark.parametrize("how", ["kwarg", "generation_config"])
def test_hf_capture_refuses_beam_search(how):
    from transformers import GenerationConfig
    model = build("qwen3_moe")
    p = syhf.patch(model)
    ids = tokens(1, 5, seed=2)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, num_return_sequences=3)
    if how == "kwarg":
        kw["num_beams"] = 3
    else:
        kw["generation_config"] = GenerationConfig(num_beams=3, num_return_sequences=3,
                                                   max_new_tokens=3, pad_token_id=0)
        kw = {"generation_config": kw["generation_config"]}
    with p.capture() as cap:
        with pytest.raises(ValueError, match=r"num_beams=3: beam search .*\(num_beams=1\)"):
            model.generate(ids, **kw)
    assert cap.num_forwards == 0
    assert "generate" not in model.__dict__  # the guard lives only while capturing
    with torch.no_grad():
        model.generate(ids, **kw)  # beam search without a capture is the caller's business
    with p.capture() as cap:
        seq = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert cap.ids().shape[:2] == (1, seq.shape[1] - 1)
    p.unpatch()


# ---- 4. copy.deepcopy (TRL's reference model) ----------------------------------------------------
@pytest.mark.hostile(tried="HF: copy.deepcopy of a patched model (TRL's reference model)",
                     gets="an independent patched copy: its own Patch (patch_of), replay queues "
                          "and routers; the same outputs; unpatching one leaves the other patched")
@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "llama4_text"])
def test_hf_deepcopy_of_a_patched_model_is_independent(family):
    model = build(family)
    p = syhf.patch(model)
    ids = tokens(2, 5, seed=6)
    p.set_action("record")
    with torch.no_grad():
        model(ids)
    twin = copy.deepcopy(model)
    q = syhf.patch_of(twin)
    assert q is not None and q is not p and q.model is twin and q.active
    assert q.layers == p.layers and q.router_dtype == p.router_dtype
    for l in q.layers:  # the copy's forwards belong to the copy's routers
        assert q._layers[q.layers.index(l)].router is twin.get_submodule(q.modules[l])
    # The recorded tables were copied, not shared.
    assert all(q.replays[l].num_recorded == 1 for l in q.layers)
    p.clear()
    assert all(q.replays[l].num_recorded == 1 for l in q.layers)
    q.clear()
    # Same outputs for the same input.
    p.set_action(None)
    q.set_action(None)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, twin(ids).logits)
    # Different targets on the two: both route as told, each counts only its own forward.
    p.reset_counts()
    q.reset_counts()
    T = ids.numel()
    p.set_targets(_const_targets(p, T, [0, 1][:p.top_k]))
    q.set_targets(_const_targets(q, T, [2, 3][:q.top_k]))
    used_p, used_q = _used(p, model, ids), _used(q, twin, ids)
    assert bool((used_p.sort(dim=-1).values == torch.tensor([0, 1][:p.top_k]).int()).all())
    assert bool((used_q.sort(dim=-1).values == torch.tensor([2, 3][:q.top_k]).int()).all())
    assert all(c["num_calls"] == 1 for c in p.counts().values())
    assert all(c["num_calls"] == 1 for c in q.counts().values())
    # Unpatching one leaves the other patched.
    q.unpatch()
    assert p.active and syhf.patch_of(model) is p and syhf.patch_of(twin) is None
    p.set_action("record")
    with torch.no_grad():
        model(ids)
        twin(ids)
    assert all(r.num_recorded == 1 for r in p.replays.values())
    assert all(r.num_recorded == 0 for r in q.replays.values())
    p.unpatch()


# ---- 5. the meta device --------------------------------------------------------------------------
@pytest.mark.hostile(tried="HF: a patched model (router_dtype=fp32) on the meta device (shape "
                           "inference, deferred init)",
                     gets="meta outputs with the patched dtypes and the unpatched shapes; no "
                          "replay table is taken")
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_patched_model_runs_on_the_meta_device(family):
    model = build(family, dtype=torch.bfloat16)
    ids = tokens(2, 5, seed=1)
    with torch.no_grad():
        ref = model.to("meta")(ids.to("meta")).logits
    p = syhf.patch(model, router_dtype=torch.float32)
    p.set_targets(_const_targets(p, ids.numel(), [0, 1][:p.top_k]))
    with torch.no_grad():
        got = model(ids.to("meta")).logits
    assert got.is_meta and got.shape == ref.shape and got.dtype == ref.dtype
    assert all(r.num_targets == 1 for r in p.replays.values())
    p.unpatch()
