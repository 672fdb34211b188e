"""switchyard.integrations.hf.patch on real tiny transformers MoE models of every supported family:
what it patches, bitwise equality with the family's own dtypes, the fp32 gate under autocast, fp32
gradients against float64, and the top-k mismatch of bf16 vs fp32 routers against float64."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # an optional dependency of switchyard

import switchyard.torch as syt  # noqa: E402
import switchyard.integrations.hf as syhf  # noqa: E402
from hf_models import FAMILIES, build, router_of, tokens, unpack  # noqa: E402

TITLE = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "olmoe": "OLMoE", "mixtral": "Mixtral",
         "deepseek_v3": "DeepSeek-V3", "glm4_moe": "GLM4-MoE", "gpt_oss": "GPT-OSS",
         "qwen3_next": "Qwen3-Next", "llama4_text": "Llama-4", "ernie4_5_moe": "ERNIE-4.5-MoE",
         "hunyuan_v1_moe": "HunYuan-MoE-V1"}
HIDDEN_DTYPE_WEIGHTS = {"llama4_text", "ernie4_5_moe"}


def moe_layers(model):
    cfg = model.config
    if cfg.model_type in ("deepseek_v3", "glm4_moe"):
        return list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    return list(range(cfg.num_hidden_layers))


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_reports_layers_keeps_structure_and_unpatches(family):
    model = build(family)
    keys = list(model.state_dict().keys())
    names = [n for n, _ in model.named_parameters()]
    p = syhf.patch(model)
    assert p.family == TITLE[family]
    assert p.layers == moe_layers(model)
    assert all(f"layers.{layer}." in name for layer, name in p.modules.items())
    assert [r.layer for r in p.replays.values()] == p.layers
    assert "layers" in repr(p) and TITLE[family] in repr(p)
    assert list(model.state_dict().keys()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    with pytest.raises(ValueError, match="already patched by switchyard"):
        syhf.patch(model)
    p.unpatch()
    p.unpatch()  # idempotent
    for layer in p.layers:
        r = router_of(model, p, layer)
        assert "forward" not in r.__dict__
    assert all(not m._forward_pre_hooks for m in model.modules())


def _run(model, ids, gen_ids):
    """Training forward + backward (Mixtral's jitter on: seeded) and a greedy generate."""
    model.zero_grad(set_to_none=True)
    model.train()
    torch.manual_seed(7)
    kw = {"output_router_logits": True} if hasattr(model.config, "output_router_logits") else {}
    out = model(ids, labels=ids, **kw)
    out.loss.backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    model.eval()
    seq = model.generate(gen_ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    aux = getattr(out, "aux_loss", None)
    return out.logits.detach(), out.loss.detach(), aux, grads, seq


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_patch_in_the_family_dtypes_is_bitwise_unpatched(family, dtype):
    model = build(family, dtype)
    ids, gen_ids = tokens(2, 9, seed=1), tokens(2, 4, seed=2)
    ref = _run(model, ids, gen_ids)
    variants = [dict(router_dtype=None)]
    if dtype == torch.float32:  # fp32 models: the torch fp32 gate is the family's own GEMM
        variants.append(dict(router_dtype=torch.float32, gate="torch"))
    for kw in variants:
        with syhf.patch(model, **kw) as p:
            got = _run(model, ids, gen_ids)
        assert p.counts()[p.layers[0]]["num_calls"] == 1 + 4
        assert torch.equal(got[0], ref[0]), kw
        assert torch.equal(got[1], ref[1]), kw
        if ref[2] is not None:
            assert torch.equal(got[2], ref[2]), kw
        assert ref[3].keys() == got[3].keys()
        for n in ref[3]:
            assert torch.equal(got[3][n], ref[3][n]), (kw, n)
        assert torch.equal(got[4], ref[4]), kw


def _hook_routers(model, p):
    seen = {}

    def hook(layer):
        def f(mod, args, out):
            seen[layer] = (args[0].detach(), out)
        return f
    hs = [router_of(model, p, l).register_forward_hook(hook(l)) for l in p.layers]
    return seen, hs


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_router_under_bf16_autocast(family):
    """fp32 parameters under torch.autocast(bf16), as FSDP mixed precision trains: the unpatched
    gate runs in bf16 (ERNIE-4.5 alone turns autocast off); patched, the logits are the engine's
    fp32 gate of the router input, and the combine weights have the family's documented dtype."""
    model = build(family, torch.float32)
    ids = tokens(2, 8, seed=3)
    p = syhf.patch(model, router_dtype=None)
    seen, hs = _hook_routers(model, p)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    native_dtype = unpack(family, seen[p.layers[0]][1])[0].dtype
    assert native_dtype == (torch.float32 if family == "ernie4_5_moe" else torch.bfloat16)
    p.unpatch()
    for h in hs:
        h.remove()

    # gate="torch" is the code path CUDA tensors take (a torch GEMM in fp32 with autocast off).
    for gate in ("auto", "torch"):
        p = syhf.patch(model, router_dtype=torch.float32, gate=gate)
        seen, hs = _hook_routers(model, p)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids)
        for layer in p.layers:
            x, out = seen[layer]
            logits, weights, _ = unpack(family, out)
            r = router_of(model, p, layer)
            w, b = syhf.FAMILIES[_family_key(family)].params(r)
            x2 = x.reshape(-1, x.shape[-1])
            expect = (syt.router_gating_linear(x2, w, b) if gate == "auto" else
                      torch.nn.functional.linear(x2.float(), w.float(),
                                                 None if b is None else b.float()))
            assert logits.dtype == torch.float32
            assert torch.equal(logits, expect), (gate, layer)
            want = x.dtype if family in HIDDEN_DTYPE_WEIGHTS else torch.float32
            assert weights.dtype == want, layer
        for h in hs:
            h.remove()
        p.unpatch()


def _family_key(family):
    return "llama4" if family == "llama4_text" else family


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_router_gradients_match_float64(family, param_dtype, gen):
    """Gradients of the patched fp32 router (engine gate + family math) wrt its input, weight and
    bias against the same router in float64 at the same ids: equal to fp32 (bf16) rounding."""
    model = build(family, param_dtype)
    ref_model = copy.deepcopy(model).double()
    p = syhf.patch(model, router_dtype=torch.float32)
    p64 = syhf.patch(ref_model, router_dtype=torch.float64)
    layer = p.layers[-1]
    r, r64 = router_of(model, p, layer), router_of(ref_model, p64, layer)
    H = model.config.hidden_size
    x = torch.randn(37, H, generator=gen).to(param_dtype).requires_grad_()
    p.replays[layer].action = "record"
    logits, weights, _ = unpack(family, r(x))
    ids = p.replays[layer].pop_recorded()
    g_w = torch.randn(weights.shape, generator=gen, dtype=torch.float64)
    g_l = torch.randn(logits.shape, generator=gen, dtype=torch.float64)
    ((weights.double() * g_w).sum() + 0.1 * (logits.double() * g_l).sum()).backward()
    # Combine weights in the hidden dtype receive their gradient in that dtype: the float64
    # reference gets the same rounded upstream gradient, the rest of the path is compared exactly.
    g_w = g_w.to(weights.dtype).double()

    x64 = x.detach().double().requires_grad_()
    p64.replays[layer].set_target(ids)
    p64.replays[layer].action = "replay_forward"
    logits64, weights64, _ = unpack(family, r64(x64))
    ((weights64 * g_w).sum() + 0.1 * (logits64 * g_l).sum()).backward()
    assert p64.counts()[layer]["num_replayed_rows"] == 37

    tol = dict(rtol=1e-5, atol=1e-6) if param_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    fam = syhf.FAMILIES[_family_key(family)]
    torch.testing.assert_close(logits.double(), logits64, rtol=1e-5, atol=1e-6)
    wtol = tol if weights.dtype != torch.bfloat16 else dict(rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(weights.double(), weights64, **wtol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    w, b = fam.params(r)
    w64, b64 = fam.params(r64)
    assert w.grad is not None and w.grad.dtype == param_dtype
    torch.testing.assert_close(w.grad.double(), w64.grad, **tol)
    if b is not None:
        torch.testing.assert_close(b.grad.double(), b64.grad, **tol)


def _rows_differ(a, b):
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_topk_mismatch_against_float64_bf16_vs_fp32_router(family):
    """A bf16 model's routers on their own inputs: share of (token, layer) rows whose top-k set
    differs from float64 routing of the same inputs, for the unpatched router and the patched fp32
    router (printed; -s shows them). The fp32 router must not do worse, and stays below 1%."""
    model = build(family, torch.bfloat16)
    ref = copy.deepcopy(model).double()
    ids = tokens(16, 64, seed=4)
    p = syhf.patch(model, router_dtype=None)
    seen, hs = _hook_routers(model, p)
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    inputs = {layer: seen[layer][0] for layer in p.layers}

    def route(m, patch_kw, cast):
        q = syhf.patch(m, **patch_kw)
        q.set_action("record")
        out = {}
        with torch.no_grad():
            for layer in q.layers:
                router_of(m, q, layer)(cast(inputs[layer]))
                out[layer] = q.replays[layer].pop_recorded()
        q.unpatch()
        return out

    p.unpatch()
    native = route(model, dict(router_dtype=None), lambda x: x)
    fp32 = route(model, dict(router_dtype=torch.float32), lambda x: x)
    fp64 = route(ref, dict(router_dtype=torch.float64), lambda x: x.double())
    n = sum(v.shape[0] for v in fp64.values())
    bf16_share = sum(int(_rows_differ(native[l], fp64[l]).sum()) for l in fp64) / n
    fp32_share = sum(int(_rows_differ(fp32[l], fp64[l]).sum()) for l in fp64) / n
    print(f"\n[hf top-k mismatch vs float64] {TITLE[family]}: unpatched router "
          f"{100 * bf16_share:.2f}%, patched fp32 router {100 * fp32_share:.2f}% of {n} rows")
    assert fp32_share <= bf16_share
    assert fp32_share < 0.01


def test_patch_errors():
    model = build("qwen3_moe")
    with pytest.raises(ValueError, match=r"router_dtype must be None .* got torch.bfloat16"):
        syhf.patch(model, router_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gate must be 'auto' or 'torch'"):
        syhf.patch(model, gate="cuda")
    with pytest.raises(ValueError, match="invalid_replay_rows must be"):
        syhf.patch(model, invalid_replay_rows="skip")
    from transformers import AutoConfig, AutoModelForCausalLM
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=97))
    with pytest.raises(ValueError, match="no supported MoE router in LlamaForCausalLM"):
        syhf.patch(dense)


def test_patch_refuses_an_old_transformers(monkeypatch):
    import sys
    model = build("olmoe")  # transformers replaces its lazy module in sys.modules on first use
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.12.0")
    with pytest.raises(RuntimeError, match=r"needs transformers 5\.24 to 5\.25\.x, found 5\.12\.0"):
        syhf.patch(model)


def test_patch_under_fsdp2_keeps_outputs_and_gradients(tmp_path):
    """FSDP2 (fully_shard on every decoder layer and on the routers themselves, one gloo rank on
    the CPU): the router class becomes an FSDP subclass, its parameters DTensors outside forward.
    Patched with the family's dtypes: loss and router gradients bitwise the unpatched FSDP model's;
    patched fp32: the engine gate runs on the unsharded parameters inside the forward."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    # (a one-rank group another test left, helpers.single_rank_gloo's, serves as well)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                                world_size=1)
    assert dist.get_world_size() == 1
    try:
        models = [build("qwen3_moe") for _ in range(2)]
        for m in models:
            for layer in m.model.layers:
                fully_shard(layer.mlp.gate)
                fully_shard(layer)
            fully_shard(m)
            m.train()
        assert type(models[1].model.layers[0].mlp.gate).__name__.startswith("FSDP")
        ids = tokens(2, 8, seed=12)
        p = syhf.patch(models[1], router_dtype=None)
        assert p.layers == [0, 1]
        outs = []
        for m in models:
            out = m(ids, labels=ids)
            out.loss.backward()
            outs.append(out.loss.detach())
        assert torch.equal(outs[0], outs[1])
        for a, b in zip(models[0].model.layers, models[1].model.layers):
            assert torch.equal(a.mlp.gate.weight.grad.full_tensor(),
                               b.mlp.gate.weight.grad.full_tensor())
        p.unpatch()
        p = syhf.patch(models[1], router_dtype=torch.float32)
        models[1].zero_grad(set_to_none=True)
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            models[1](ids, labels=ids).loss.backward()
        assert not [w for w in caught if "view tensor" in str(w.message)]
        assert p.counts()[0]["num_calls"] == 1
        assert bool(models[1].model.layers[0].mlp.gate.weight.grad.full_tensor().abs().sum() > 0)
        p.unpatch()
    finally:
        if own:
            dist.destroy_process_group()


def test_capture_without_the_experts_hooks_keeps_the_routes_and_refuses_expert_ids():
    # capture(experts=False), what the trainer adapters use: the same routes, no hooks on the
    # experts or decoder layers, and expert_ids() says why it has nothing.
    model = build("qwen3_moe")
    p = syhf.patch(model, router_dtype=torch.float32)
    ids = tokens(2, 6, seed=3)
    hooks = lambda: sum(len(m._forward_pre_hooks) for m in model.modules())  # noqa: E731
    idle = hooks()
    with torch.no_grad(), p.capture() as full:
        assert hooks() > idle  # the experts capture's hooks
        model(ids)
    with torch.no_grad(), p.capture(experts=False) as lean:
        assert hooks() == idle  # none
        model(ids)
    assert torch.equal(lean.ids(), full.ids()) and torch.equal(full.expert_ids(), full.ids())
    with pytest.raises(ValueError, match=r"capture\(experts=False\)"):
        lean.expert_ids()
    p.unpatch()


def test_a_capture_places_gradient_free_forwards_it_keeps_as_a_capture_appending_each_would():
    # A gradient-free forward whose ids only a capture takes hands the forward's entries to the
    # capture in one call (Capture.add_forward), placed when the capture is next read or
    # appended to. The same forwards with a layer recording (each layer's ids handed on and
    # appended at the forward's end) must capture the same steps in the same order: gradient-free
    # forwards kept between forwards with grad (appended at once), a read in between, and a
    # generate(use_cache=False) after a kept forward (its re-fed steps are checked against the
    # columns captured before it).
    model = build("qwen3_moe").eval()
    p = syhf.patch(model, router_dtype=None)
    a, b, c = tokens(2, 3, seed=1), tokens(2, 2, seed=2), tokens(2, 4, seed=3)

    def run(kept):
        p.set_action(None if kept else "record")
        with p.capture(experts=False) as cap:
            with torch.no_grad():
                model(a)
            assert cap._forwards if kept else not cap._forwards  # (the path under test)
            model(b)  # with grad: appended at its end, after the kept forward
            with torch.no_grad():
                model(c)
            first = cap.moe_ids()  # a read places what was kept
            with torch.no_grad():
                model(a)
            out = [first, cap.ids(), cap.native_ids(), cap.moe_ids(), cap.num_forwards]
        with torch.no_grad(), p.capture(experts=False) as cap:
            model(a)
            model.generate(torch.cat([a, b], 1), max_new_tokens=3, do_sample=False,
                           pad_token_id=0, use_cache=False)
            out += [cap.ids(), cap.num_forwards]
        p.set_action(None)
        p.clear()  # (the recorded tables)
        return out

    kept, each = run(True), run(False)
    assert kept[0].shape[:2] == (2, 9) and kept[4] == each[4] == 4
    assert kept[5].shape[:2] == (2, 7) and kept[6] == each[6] == 4
    for x, y in zip(kept, each):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    p.unpatch()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_forward_hands_on_nothing_and_later_forwards_run_as_if_it_never_did(error):
    # A forward that fails in its second decoder layer: its first layer's ids reach neither the
    # capture nor the recorded tables. A KeyboardInterrupt skips torch's always_call hooks, so
    # the stack forward's end never runs: the next forward of the thread drops that state,
    # instead of running as a nested forward of it forever (nothing captured or recorded again,
    # and a later replayed forward routed natively by the interrupted no-grad forward's fast
    # path).
    model = build("qwen3_moe").eval()
    p = syhf.patch(model)
    ids = tokens(2, 5, seed=2)
    layer = model.model.layers[1]

    def interrupted():
        layer.forward = lambda *a, **k: (_ for _ in ()).throw(error("stop"))
        try:
            with pytest.raises(error, match="stop"), torch.no_grad():
                model(ids)
        finally:
            del layer.forward

    p.set_action("record")
    with p.capture(experts=False) as cap, torch.no_grad():
        model(ids)
        interrupted()
        model(ids)
    p.set_action(None)
    assert cap.num_forwards == 2
    assert torch.equal(cap.ids()[:, :5], cap.ids()[:, 5:])
    for layer_id in p.layers:
        assert p.replays[layer_id].num_recorded == 2
    p.clear()
    # a replayed forward after an interrupted gradient-free one replays
    interrupted()
    targets = (cap.moe_ids()[:, :5] + 1) % p.num_experts
    p.set_targets(targets)
    with p.capture(experts=False) as rep, torch.no_grad():
        model(ids)
    assert torch.equal(rep.moe_ids(), targets)
    assert p._pending is None and not p._running
    p.unpatch()


def test_moe_ids_are_the_captured_ids_of_the_patched_layers_in_set_targets_layout():
    # Capture.moe_ids (the trainer adapters' read): ids() / native_ids() at Patch.layers, for a
    # model whose first layer is dense, over a generate() (several forwards per layer) and over
    # a replayed forward whose routers' own choice differs from the replayed ids.
    model = build("deepseek_v3")
    p = syhf.patch(model, router_dtype=torch.float32)
    assert p.layers == [1, 2] and p.num_route_layers == 3
    ids = tokens(2, 5, seed=6)
    with torch.no_grad(), p.capture(experts=False) as gen:
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert gen.num_forwards == 3
    m = gen.moe_ids()
    assert m.dtype == torch.int32 and m.shape == (2, 7, 2, p.top_k)
    assert torch.equal(m, gen.ids()[:, :, p.layers]) and torch.equal(gen.moe_ids(native=True), m)
    targets = (m[:, :5] + 1) % p.num_experts  # other experts than the routers' own
    p.set_targets(targets)
    with torch.no_grad(), p.capture(experts=False) as rep:
        model(ids)
    p.set_action(None)
    assert torch.equal(rep.moe_ids(), targets)
    own = rep.moe_ids(native=True)
    assert torch.equal(own, rep.native_ids()[:, :, p.layers]) and not torch.equal(own, targets)
    with p.capture(experts=False) as empty:
        pass
    with pytest.raises(ValueError, match="nothing was captured"):
        empty.moe_ids()
    p.unpatch()


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_verl_targets_from_the_packed_values_are_the_padded_batchs_at_its_real_tokens(dtype):
    # Patch.targets_from_verl_packed (the verl adapter's packed micro-batches) against
    # targets_from_verl of the same sequences padded: the same targets at every real token, for a
    # model with a dense first layer, sequences of 1 to 9 tokens, zero rows (no route) and rows
    # the rollout never routed; a payload the reader refuses gets the padded path's message,
    # naming the sequence.
    model = build("deepseek_v3")
    p = syhf.patch(model, router_dtype=torch.float32)
    E, K, L = p.num_experts, p.top_k, p.num_route_layers
    g = torch.Generator().manual_seed(9)
    lengths = [5, 1, 9, 2, 7]
    total = sum(lengths)
    values = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(total * L)])
    values = values.view(total, L, K).to(dtype)
    values[:, 0] = 0  # the dense layer: verl's zeros
    values[3, 1:] = 0  # a zero row on every MoE layer (routed natively)
    values[10, 2] = 0
    offsets = torch.tensor([0] + lengths).cumsum(0)
    mask = torch.arange(max(lengths)).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    dense = values.new_zeros((len(lengths), max(lengths), L, K))
    dense[mask] = values
    ref, _ = p.targets_from_verl(dense, mask)
    got = p.targets_from_verl_packed(values, offsets)
    assert got.dtype == torch.int32 and got.shape == (total, len(p.layers), K)
    assert torch.equal(got, ref[mask])
    assert int((got == -1).all(-1).sum()) == len(lengths) * 2 + 2 + 1  # last tokens, zero rows
    bad = values.clone()
    bad[offsets[2] + 1, 2, 0] = E  # sequence 2's second token
    with pytest.raises(ValueError) as packed:
        p.targets_from_verl_packed(bad, offsets)
    padded = dense.clone()
    padded[mask] = bad
    with pytest.raises(ValueError) as want:
        p.targets_from_verl(padded, mask)
    assert str(packed.value) == str(want.value) and "sequence 2" in str(want.value)
    with pytest.raises(ValueError, match=r"offsets \[B \+ 1\] from 0 to total"):
        p.targets_from_verl_packed(values, offsets[:-1])
    p.unpatch()


@pytest.mark.parametrize("host_copy", [False, True], ids=["cpu_ids", "device_ids"])
@pytest.mark.parametrize("router_dtype", [None, torch.float32], ids=["native", "fp32"])
def test_a_stack_forward_hands_its_layers_ids_on_at_its_end(monkeypatch, router_dtype, host_copy):
    # The ids a forward of the decoder stack routed reach capture, record and the recompute queue
    # at its end; a router called outside a stack forward hands its ids on at once. Ids on the
    # CPU go on as the routers' own tensors (the core's record copies them, a capture converts
    # them when read): no host copy per forward. Ids on a device come to the host in one copy of
    # all layers per forward (one device sync, not one per MoE layer): that path is taken here
    # on the CPU by declaring no id dtype the core takes as it is. A no-grad native forward takes
    # the fast path (the router's own forward, decided once per forward): what it captures and
    # records is what the experts received.
    import importlib
    hp = importlib.import_module("switchyard.integrations.hf.patch")
    copies = []
    real = hp._host_ids
    monkeypatch.setattr(hp, "_host_ids", lambda ts: copies.append(len(ts)) or real(ts))
    if host_copy:
        monkeypatch.setattr(hp, "_CORE_IDS", ())
    model = build("qwen3_moe")
    p = syhf.patch(model, router_dtype=router_dtype)
    L = len(p.layers)
    ids = tokens(2, 5, seed=4)
    p.set_action("record")
    with torch.no_grad(), p.capture() as cap:
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    p.set_action(None)
    assert out.shape[1] == 8 and cap.num_forwards == 3
    assert copies == ([L] * 3 if host_copy else [])  # one copy of every layer's ids per forward
    got = cap.ids()
    assert got.shape[:2] == (2, 7)
    assert torch.equal(got, cap.expert_ids())  # what the experts received
    assert torch.equal(cap.native_ids(), got)
    for layer in p.layers:
        rec = [p.replays[layer].pop_recorded() for _ in range(3)]
        assert torch.equal(torch.cat([r.view(2, -1, p.top_k) for r in rec], 1),
                           got[:, :, layer, :]), layer
        c = p.counts()[layer]
        assert c["num_calls"] == 3 and c["num_native_rows"] == 2 * 7, c
    # A capture alone keeps the routers' id tensors and takes them to the host when read: no
    # copy per forward (device ids: one per forward, as above), the same ids.
    copies.clear()
    with torch.no_grad(), p.capture() as only:
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert copies == ([L] * 3 if host_copy else []) and only.num_forwards == 3
    assert torch.equal(only.ids(), got) and torch.equal(only.expert_ids(), got)
    assert torch.equal(only.native_ids(), got) and only.ids().dtype == torch.int32
    # outside a stack forward: at once, one layer's ids
    copies.clear()
    block = model.get_submodule(p.modules[p.layers[0]].rsplit(".", 1)[0])
    x = torch.randn(1, 4, model.config.hidden_size)
    p.set_action("record")
    with torch.no_grad(), p.capture(experts=False) as alone:
        block(x)
        assert copies == ([1] if host_copy else []) and alone.num_forwards == 1
    p.set_action(None)
    with torch.no_grad(), p.capture(experts=False) as alone2:
        block(x)
        assert copies == ([1, 1] if host_copy else []) and alone2.num_forwards == 1
    rec = p.replays[p.layers[0]].pop_recorded()
    assert rec.dtype == torch.int32 and rec.shape == (4, p.top_k)
    p.unpatch()
