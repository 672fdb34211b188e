"""Every MoE family of the installed transformers, from the user's side: each has a routing spec
or a stated refusal; for each supported family (a tiny model from a config, no download) the FP32
router picks the experts a float64 reference of the family's maths picks (rows with a clear
margin), capture holds the ids the experts received, R3 reproduces captured ids after the router
weights changed, router_dtype=None is the unpatched model bitwise, and unpatch restores it."""
import glob
import inspect
import os

import pytest
import torch

pytest.importorskip("transformers")

import switchyard.integrations.hf as syhf  # noqa: E402
from switchyard.integrations.hf import spec as syspec  # noqa: E402
from hf_models import ALL_FAMILIES, VARIANT_OF, build, tokens  # noqa: E402

_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts",
                "num_routed_experts", "n_experts", "ffn_config")


def _package(cfg):
    return type(cfg).__module__.split(".")[2]


def _config_or_none(AutoConfig, model_type):
    try:
        return AutoConfig.for_model(model_type)
    except Exception:  # a config that needs arguments: the modeling-file scan sees the family
        return None


def _moe_packages():
    """The transformers.models packages of the installed transformers that route tokens to
    experts: a config (or its text config) with an experts count, or a modeling file with an
    experts class wrapped by transformers' experts interface."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    found = set()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # default configs warn about their token ids
    try:
        configs = [_config_or_none(AutoConfig, mt) for mt in CONFIG_MAPPING_NAMES]
    finally:
        transformers.logging.set_verbosity(verbosity)
    for cfg in configs:
        for c in (cfg, getattr(cfg, "text_config", None), getattr(cfg, "thinker_config", None)):
            if c is None or isinstance(c, dict):
                continue
            for k in _EXPERT_KEYS:
                try:
                    v = getattr(c, k, None)
                except Exception:  # a per-layer attribute (heterogeneous configs): experts there
                    v = "per layer"
                if v not in (None, 0, 1, []):
                    found.add(_package(c))
    root = os.path.dirname(transformers.__file__)
    for f in glob.glob(os.path.join(root, "models", "*", "modeling_*.py")):
        with open(f, encoding="utf-8") as fh:
            if "\n@use_experts_implementation" in fh.read():
                found.add(os.path.basename(os.path.dirname(f)))
    return found


def test_every_moe_family_of_the_installed_transformers_has_a_spec_or_a_stated_refusal():
    known = set(syhf.FAMILIES) | set(syspec.REFUSED) | set(syspec.OUT_OF_SCOPE)
    moe = _moe_packages()
    assert len(moe) > 60  # the scan sees transformers' MoE families at all
    missing = sorted(moe - known)
    assert not missing, (f"MoE families of transformers without a routing spec or a stated "
                         f"refusal (add them to switchyard/integrations/hf/spec.py): {missing}")
    # every spec'd family has a test model here
    assert set(syhf.FAMILIES) <= {_key(f) for f in ALL_FAMILIES}


# ---- a float64 reference written from each family's maths --------------------------------------
# family -> (score, selection bias, group rule, group mask); written from the model cards / papers
# and the families' router code, not from switchyard's spec table.
_SOFTMAX = ("softmax", None, None, None)
_DEEPSEEK_V3 = ("sigmoid", "e_score_correction_bias", "top2_sum", float("-inf"))
_TOPK_LOGITS = ("logits", None, None, None)
_SIGMOID_BIAS = ("sigmoid", "e_score_correction_bias", None, None)
_SIGMOID_BLOCK_BIAS = ("sigmoid", "block", None, None)
REFERENCE = {
    "qwen3_moe": _SOFTMAX, "qwen2_moe": _SOFTMAX, "qwen3_next": _SOFTMAX, "olmoe": _SOFTMAX,
    "mixtral": _SOFTMAX, "hunyuan_v1_moe": _SOFTMAX, "qwen3_5_moe": _SOFTMAX,
    "qwen3_vl_moe": _SOFTMAX, "flex_olmo": _SOFTMAX, "mellum": _SOFTMAX, "minimax": _SOFTMAX,
    "jamba": _SOFTMAX,
    "ernie4_5_moe": ("softmax", "moe_statics", None, None),
    "deepseek_v3": _DEEPSEEK_V3, "glm4_moe": _DEEPSEEK_V3, "deepseek_v32": _DEEPSEEK_V3,
    "glm4_moe_lite": _DEEPSEEK_V3, "glm_moe_dsa": _DEEPSEEK_V3, "dots1": _DEEPSEEK_V3,
    "exaone_moe": _DEEPSEEK_V3, "axk1": _DEEPSEEK_V3, "hy_v4": _DEEPSEEK_V3,
    "solar_open": _DEEPSEEK_V3, "nemotron_h": _DEEPSEEK_V3,
    "deepseek_v2": ("softmax", None, "max", 0.0),
    "mistral4": ("softmax", None, "top2_sum", 0.0),
    "gpt_oss": _TOPK_LOGITS, "llama4_text": _TOPK_LOGITS, "granitemoe": _TOPK_LOGITS,
    "granitemoeshared": _TOPK_LOGITS, "granitemoehybrid": _TOPK_LOGITS,
    "kimi_linear": _DEEPSEEK_V3, "minicpm5_moe": _DEEPSEEK_V3, "beam": _DEEPSEEK_V3,
    "bailing_hybrid": _DEEPSEEK_V3,
    "axk2": ("sigmoid", "e_score_correction_bias", "top2_sum", 0.0),
    "minimax_m2": _SIGMOID_BLOCK_BIAS, "hy_v3": _SIGMOID_BLOCK_BIAS, "afmoe": _SIGMOID_BLOCK_BIAS,
    "lfm2_moe": _SIGMOID_BLOCK_BIAS, "minimax_m3_vl": _SIGMOID_BIAS, "laguna": _SIGMOID_BIAS,
    "ergo": _SIGMOID_BIAS, "inkling2": _SIGMOID_BIAS, "inkling2_loop": _SIGMOID_BIAS,
    "flint": ("sigmoid", None, None, None),
    "deepseek_v4": ("sqrtsoftplus", "e_score_correction_bias", None, None),
    "kolibri1_1": ("logits", "e_score_correction_bias", None, None),
    "kolibri1": ("logits", "e_score_correction_bias", None, None),
    "lara_mini": _SOFTMAX, "dbrx": _SOFTMAX, "qwen3_omni_moe": _SOFTMAX,
    "mistral_large4": ("softmax", None, "top2_sum", 0.0),
    "phimoe": _TOPK_LOGITS, "aria": _TOPK_LOGITS, "granitemoe_swa": _TOPK_LOGITS,
    "mimo_v2_flash": _DEEPSEEK_V3, "glm4v_moe": _DEEPSEEK_V3, "glm5_next": _DEEPSEEK_V3,
    "hy_v4_vl": _DEEPSEEK_V3, "qwen4_exp": _SOFTMAX, "step3p7": _SIGMOID_BIAS,
    "muse_spark": _SIGMOID_BIAS,  # of the logits × output_multiplier
    "deepseek_ocr2": ("softmax", None, "max", 0.0), "unlimited_ocr": ("softmax", None, "max", 0.0),
    # Gemma-4: softmax of the projection of RMSNorm(x) · scale · H^-1/2 (see _gemma_input)
    "gemma4": _SOFTMAX, "diffusion_gemma": _SOFTMAX,
    # Cohere2-MoE: the K best logits (softmax or sigmoid of them: the same experts)
    "cohere2_moe": _TOPK_LOGITS, "cohere2_moe_sigmoid": _TOPK_LOGITS,
    # LongCat-Flash: softmax over routed + zero experts, correction bias for the choice
    "longcat_flash": ("softmax", "e_score_correction_bias", None, None),
    "dots3_note": _DEEPSEEK_V3,
    "ernie4_5_vl_moe": ("softmax", "moe_statics", None, None),
    # JetMoE's MLP experts: the K best logits (softmax over them: the same experts)
    "jetmoe": _TOPK_LOGITS,
    # Inkling: sigmoid scores of the routed experts + correction bias (its gate's last
    # n_shared_experts rows are the shared experts', never selected)
    "inkling": _SIGMOID_BIAS,
    # Zaya: softmax over E + 1 classes (the last a skip expert) of its router MLP's logits +
    # balancing_biases for the choice (see _zaya_logits)
    "zaya": ("softmax", "balancing_biases", None, None),
    # Doge: product keys over the token-mixed halves of the logits (see _product_key_scores)
    "doge": ("product_key", None, None, None),
}
_TOPK_METHOD = ("deepseek_v2", "deepseek_ocr2", "unlimited_ocr")
"""DeepSeek-V2's router: group-limited only when its topk_method is group_limited_greedy."""
_INPUT_NORMED = {"gemma4", "diffusion_gemma"}
"""Families whose router normalises and scales its input before the projection."""


def _gemma_input(router, x):
    """(Gemma-4's gate input in float64, a bound [T] on how far the family's logits can be from
    the reference's): RMSNorm without a scale (x / sqrt(mean(x²) + eps)), × the router's scale
    vector, × hidden_size**-0.5, each rounded to x's dtype as the family's ops do (the norm
    computed in fp32 and rounded once; the products exact in float64, rounded to fp32 then to x's
    dtype as a reduced-precision multiply is). The family's fp32 norm is within 1e-5 (relative)
    of the float64 one, so its rounding can differ from the reference's by one ulp only where the
    exact value lies within 1e-5 of a rounding midpoint: those elements (ambiguous) may move a
    logit by eps·|x̂_i w_ei| each."""
    xd = x.double()
    n = xd / torch.sqrt((xd * xd).mean(dim=1, keepdim=True) + router.eps)
    if x.dtype in (torch.float32, torch.float64):  # fp32 roundings: far below the 1e-4 margin
        return n * router.scale.double() * x.shape[1] ** -0.5, torch.zeros(len(x),
                                                                         dtype=torch.float64)

    def rnd(v):
        return v.float().to(x.dtype).double()
    amb = rnd(n * (1 - 1e-5)) != rnd(n * (1 + 1e-5))
    xh = rnd(rnd(n) * router.scale.double())
    xh = rnd(xh * torch.tensor(x.shape[1] ** -0.5, dtype=torch.float32).double())
    w = router.proj.weight.double()
    eps = torch.finfo(x.dtype).eps
    bound = 2 * eps * ((xh.abs() * amb) @ w.abs().t()).max(dim=1).values
    return xh, bound


def _experts_get(family, ids, block):
    """The ids a family's MoE block hands its experts for the router's ids [T, K]: the same ids,
    except LongCat-Flash's zero-compute experts (ids n + j, j < Z): the block gives their slots
    weight 0 and the dummy routed id j·n // Z (spread over the routed experts) and adds the
    token's own hidden state × the zero slots' weight (the identity path) itself (transformers
    5.25; before, its experts module took the router's ids and ran a zero expert as the
    identity)."""
    if family == "longcat_flash" and hasattr(block, "num_routed_experts"):
        n, Z = block.num_routed_experts, block.zero_expert_num
        return torch.where(ids >= n, (ids - n) * n // Z, ids)
    if family == "zaya":  # the skip class (id E): id 0 with weight 0
        return torch.where(ids == block.experts.num_experts, 0, ids)
    return ids


def _gate_params(router):
    lin = next((getattr(router, a) for a in ("wg", "layer", "linear", "gate", "proj",
                                              "classifier")
                if isinstance(getattr(router, a, None), torch.nn.Linear)), router)
    b = getattr(lin, "bias", None)
    return lin.weight, (b if isinstance(b, torch.Tensor) else None)


def _zaya_logits(router, x, state):
    """Zaya's router logits in float64: h = down_proj(x) (+ the previous layer's router state ×
    router_states_scale from layer 1), then RMSNorm (× its weight), two GELU (erf) layers and the
    output projection to E + 1 classes."""
    def lin(m, v):
        out = v @ m.weight.double().t()
        return out if m.bias is None else out + m.bias.double()

    def gelu(v):
        return 0.5 * v * (1.0 + torch.erf(v / 2 ** 0.5))
    h = lin(router.down_proj, x.double())
    if router.use_eda and state is not None:
        h = h + state.reshape(h.shape).double() * router.router_states_scale.double()
    mlp = router.router_mlp
    n = h / torch.sqrt((h * h).mean(dim=1, keepdim=True) + mlp.norm.variance_epsilon)
    n = n * mlp.norm.weight.double()
    return lin(mlp.out_proj, gelu(lin(mlp.fc2, gelu(lin(mlp.fc1, n)))))


def _product_key_scores(router, x, weight=None):
    """Doge's scores over its n² experts in float64, from DogeCDMoE's maths: logits = x W^T
    ([T, 2n], router_gate, no bias) of the T = B·S tokens in row order; the block views them as
    (2, T, n), so row t's x sub-key scores are the n logits at flat position t·n, i.e. token
    t // 2's half t % 2, and its y sub-key scores those at flat position (T + t)·n, token
    (T + t) // 2's half (T + t) % 2 (the token mixing); expert i·n + j scores x_i + y_j."""
    n = int(router.num_keys)
    weight = router.router_gate.weight.double() if weight is None else weight
    logits = x.double() @ weight.t()
    T = len(x)

    def half(u):
        return logits[u // 2, (u % 2) * n:(u % 2 + 1) * n]
    xs = torch.stack([half(t) for t in range(T)])
    ys = torch.stack([half(T + t) for t in range(T)])
    return (xs[:, :, None] + ys[:, None, :]).reshape(T, n * n)


def _reference(family, router, x, K, block=None, input_ids=None, state=None):
    """(ids as sorted rows [T, K], clear [T] bool): the family's selection in float64 and the rows
    whose K-th and (K+1)-th choice (and the kept / dropped group) are 1e-4 apart. The fp32 gate's
    error is below H·u·Σ|x_i w_i| < 1e-5 for these models (H = 32, |x w| < 1), and softmax /
    sigmoid are 1-Lipschitz, so a 1e-4 margin cannot flip on rounding. A family that rounds its
    own ops before the projection (Gemma-4) widens the margin by twice their bound."""
    score, bias, group, fill = REFERENCE[family]
    tol = torch.zeros(len(x), dtype=torch.float64)
    if family == "zaya":
        logits = _zaya_logits(router, x, state)
    elif family == "doge":
        logits = _product_key_scores(router, x)
    else:
        w, b = _gate_params(router)
        if family in _INPUT_NORMED:
            x, tol = _gemma_input(router, x)
        if family == "longcat_flash":
            b = None  # its router's F.linear takes the classifier's weight only
        logits = x.double() @ w.double().t()
        if b is not None:
            logits = logits + b.double()
    if family == "inkling":  # the shared experts' rows: in every route, never selected
        logits = logits[:, :logits.shape[1] - router.n_shared_experts]
    logits = logits * float(getattr(router, "output_multiplier", 1.0))  # MuseSpark
    cap = float(getattr(router, "router_logit_softcapping", 0.0) or 0.0)
    if cap > 0:  # Laguna: c·tanh(z/c)
        logits = torch.tanh(logits / cap) * cap
    E = logits.shape[1]
    if hasattr(router, "tid2eid"):  # DeepSeek-V4's hash layer: the token's fixed experts
        return (router.tid2eid[input_ids.reshape(-1)].long().sort(dim=1).values,
                torch.ones(len(x), dtype=torch.bool))
    if score == "softmax":
        s = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
        s = s / s.sum(dim=1, keepdim=True)
    elif score == "sigmoid":
        s = 1.0 / (1.0 + torch.exp(-logits))
    elif score == "sqrtsoftplus":
        s = torch.sqrt(torch.log1p(torch.exp(logits)))
    else:
        s = logits
    choice = s.clone()
    if bias == "e_score_correction_bias":
        choice = choice + router.e_score_correction_bias.double()
    elif bias == "block":  # held by the MoE block, passed to the router's forward
        held = getattr(block, "e_score_correction_bias", None)
        held = getattr(block, "expert_bias", None) if held is None else held
        choice = choice + held.double()
    elif bias == "balancing_biases":
        choice = choice + router.balancing_biases.double()
    elif bias == "moe_statics":
        choice = choice + router.moe_statics.e_score_correction_bias.double().reshape(-1)
    clear = torch.ones(len(x), dtype=torch.bool)
    if group is not None and (family not in _TOPK_METHOD or
                              router.topk_method == "group_limited_greedy"):
        G, keep = int(router.num_group), int(router.topk_group)
        g = choice.view(len(x), G, E // G)
        gs = g.topk(2, dim=-1).values.sum(-1) if group == "top2_sum" else g.max(-1).values
        order = gs.sort(dim=1, descending=True)
        if keep < G:
            clear &= (order.values[:, keep - 1] - order.values[:, keep]) > 1e-4 + 2 * tol
        kept = torch.zeros(len(x), G, dtype=torch.bool)
        kept.scatter_(1, order.indices[:, :keep], True)
        choice = torch.where(kept.repeat_interleave(E // G, dim=1), choice,
                             torch.full_like(choice, fill))
    top = choice.sort(dim=1, descending=True)
    if K < E:
        gap = top.values[:, K - 1] - top.values[:, K]
        clear &= torch.nan_to_num(gap, posinf=1.0) > 1e-4 + 2 * tol
    return top.indices[:, :K].sort(dim=1).values, clear


# ---- hooks: what the routers saw and what the experts received ---------------------------------
def _is_experts(m):
    # transformers' experts interface, or an experts module of the same signature that a release
    # does not wrap yet (Step-3.7 in 5.24)
    return (hasattr(m, "_is_expert_parallel") and hasattr(m, "is_concatenated")) or \
        "top_k_index" in inspect.signature(m.forward).parameters


def _grouped_ids(out):
    """The ids [T, K] a block that runs its experts on expert-sorted groups (JetMoE) hands its
    experts: the router's (slot order, token, weight, slots per expert, logits); the j-th sorted
    slot goes to the expert whose group holds position j."""
    order, token, _, sizes, _ = out
    experts = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    flat = torch.empty_like(order)
    flat[order] = experts
    return flat.view(int(token.max()) + 1 if len(token) else 0, -1)


class _Seen:
    """Forward pre-hooks on each patched layer's router (its input) and experts module (the ids
    it received: the experts interface's (hidden_states, top_k_index, top_k_weights)); for a
    block that runs its experts on the router's expert-sorted groups (JetMoE), the ids those
    groups hold, from the router's output."""

    def __init__(self, model, p):
        self.x, self.ids, self.state, self._hooks = {}, {}, {}, []
        # A router of several route layers (Inkling2-Loop's loop layers: one per pass) serves
        # them in call order: the n-th call of a forward is its n-th route layer.
        layers_of = {}
        for layer, name in sorted(p.modules.items()):
            layers_of.setdefault(name, []).append(layer)
        for name, layers in layers_of.items():
            router = model.get_submodule(name)
            block = model.get_submodule(name.rsplit(".", 1)[0])
            calls = {"router": 0, "experts": 0}

            def at(kind, layers=layers, calls=calls):
                calls[kind] += 1
                return layers[(calls[kind] - 1) % len(layers)]
            self._hooks.append(router.register_forward_pre_hook(
                lambda m, a, kw, at=at: self._saw(at("router"), a, kw), with_kwargs=True))
            if type(router).__name__ == "JetMoeTopKGating":
                self._hooks.append(router.register_forward_hook(
                    lambda m, a, o, layer=layers[0]: self.ids.__setitem__(layer,
                                                                           _grouped_ids(o))))
            if isinstance(getattr(router, "down_embed", None), torch.nn.Embedding):
                # Doge: the router is the block, its experts are the rows of down_embed and
                # up_embed gathered at the ids: what down_embed received, kept where up_embed
                # received the same (else a mismatch the tests' comparisons fail on)
                layer = layers[0]
                self._hooks.append(router.down_embed.register_forward_pre_hook(
                    lambda m, a, layer=layer: self.ids.__setitem__(layer, a[0].detach().clone())))
                self._hooks.append(router.up_embed.register_forward_pre_hook(
                    lambda m, a, layer=layer: self._same(layer, a[0])))
            for child in block.children():
                if _is_experts(child):
                    self._hooks.append(child.register_forward_pre_hook(
                        lambda m, a, kw, at=at: self.ids.__setitem__(
                            at("experts"),
                            (a[1] if len(a) > 1 else kw["top_k_index"]).detach().clone()),
                        with_kwargs=True))

    def _same(self, layer, ids):
        if not torch.equal(self.ids.get(layer, ids.new_empty(0)), ids):
            self.ids[layer] = torch.full_like(ids, -2)  # not what the other experts received

    def _saw(self, layer, a, kw):
        self.x[layer] = a[0].detach().clone()
        state = kw.get("router_states")  # Zaya: the router state from the previous layer
        self.state[layer] = None if state is None else state.detach().clone()

    def remove(self):
        for h in self._hooks:
            h.remove()


def _text_type(family):
    return "llama4_text" if family == "llama4" else family


def _families():
    return [f for f in ALL_FAMILIES if _key(f) in syhf.FAMILIES]


def _key(family):
    return "llama4" if family == "llama4_text" else VARIANT_OF.get(family, family)


@pytest.mark.parametrize("family", _families())
def test_fp32_router_picks_the_experts_of_a_float64_reference_and_capture_is_what_experts_got(
        family):
    model = build(family, dtype=torch.bfloat16)
    ids = tokens(2, 12, seed=3)
    p = syhf.patch(model, router_dtype=torch.float32)
    seen = _Seen(model, p)
    try:
        with torch.no_grad(), p.capture() as cap:
            model(ids)
        captured = cap.ids()
    finally:
        seen.remove()
    B, S = ids.shape
    n_clear = 0
    for layer in p.layers:
        router = model.get_submodule(p.modules[layer])
        got = captured[:, :, layer, :].reshape(B * S, -1).long()
        x = seen.x[layer].reshape(B * S, -1)
        block = model.get_submodule(p.modules[layer].rsplit(".", 1)[0])
        ref, clear = _reference(family, router, x, p.top_k, block, ids, seen.state[layer])
        n_clear += int(clear.sum())
        bad = (got.sort(dim=1).values != ref).any(dim=1) & clear
        assert not bad.any(), (f"{family} layer {layer}: rows {bad.nonzero().flatten().tolist()} "
                               f"pick {got[bad].tolist()}, the float64 reference "
                               f"{ref[bad].tolist()}")
        if layer in seen.ids:  # the experts received exactly the captured ids, in order
            assert torch.equal(seen.ids[layer].reshape(B * S, -1).long(),
                               _experts_get(family, got, block)), family
        else:
            # Llama-4's experts take the router-scaled input only; DBRX's are not transformers'
            # experts interface
            assert family in ("llama4_text", "dbrx")
    assert n_clear >= len(p.layers) * B * S // 2  # the comparison covered most rows
    p.unpatch()


@pytest.mark.parametrize("family", _families())
def test_router_dtype_none_captures_what_the_experts_got_and_counts_every_row_native(family):
    # A natively routed forward with router_dtype=None runs the router's own forward whole where
    # the family allows (patch._Layer._native_forward) and the generic routed forward elsewhere:
    # either way the captured ids are those the experts received, and the outputs are the
    # unpatched model's bit for bit.
    model = build(family)
    ids = tokens(2, 9, seed=6)
    with torch.no_grad():
        before = model(ids)[0].clone()
    p = syhf.patch(model, router_dtype=None)
    seen = _Seen(model, p)
    try:
        with torch.no_grad(), p.capture() as cap:
            after = model(ids)[0]
        captured = cap.ids()
    finally:
        seen.remove()
    assert torch.equal(after, before), family
    B, S = ids.shape
    for layer in p.layers:
        got = captured[:, :, layer, :].reshape(B * S, -1).long()
        block = model.get_submodule(p.modules[layer].rsplit(".", 1)[0])
        if layer in seen.ids:
            assert torch.equal(seen.ids[layer].reshape(B * S, -1).long(),
                               _experts_get(family, got, block)), (family, layer)
        else:  # as in the fp32 test: Llama-4's and DBRX's experts show no ids
            assert family in ("llama4_text", "dbrx")
    c = p.counts()
    assert all(c[l]["num_calls"] == 1 and c[l]["num_native_rows"] == B * S for l in p.layers), c
    p.unpatch()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_router_dtype_none_checkpointed_training_forward_keeps_gradients_bitwise(reentrant):
    # A checkpointed forward queues its ids for the recompute, which replays them through the
    # generic routed forward: the forward must take that path too (not the router's own
    # forward), or the recompute saves other tensors than the forward and backward fails.
    import copy
    model = build("qwen3_moe")
    model.train()
    _checkpoint_layers(model, reentrant)
    ref = copy.deepcopy(model)
    ids = tokens(2, 9, seed=7)
    ref(ids)[0].float().square().mean().backward()
    p = syhf.patch(model, router_dtype=None)
    with p.capture() as cap:
        model(ids)[0].float().square().mean().backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None) and (
            a.grad is None or torch.equal(a.grad, b.grad)), name
    c = p.counts()
    assert all(c[l]["num_recomputed_rows"] == ids.numel() for l in p.layers), c
    assert cap.ids().shape[:2] == ids.shape
    p.unpatch()


def _perturb(model, p, family, scale=0.5, seed=11):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in p.layers:
            w, _ = syhf.FAMILIES[_key(family)].params(model.get_submodule(p.modules[layer]))
            w.add_(torch.randn(w.shape, generator=g).to(w.dtype) * scale * w.float().std())


def _forward_seeing_routers(model, names, ids):
    """(the model's first output, {router name: what the router returned}) of one forward."""
    outs = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda m, a, o, n=n: outs.__setitem__(n, o)) for n in names]
    try:
        with torch.no_grad():
            y = model(ids)[0].clone()
    finally:
        for h in hooks:
            h.remove()
    return y, outs


@pytest.mark.parametrize("family", _families())
def test_r3_replays_captured_ids_after_the_router_weights_changed_and_unpatch_restores(family):
    model = build(family)
    ids = tokens(2, 10, seed=5)
    p = syhf.patch(model, router_dtype=None)
    names = list(p.modules.values())
    p.unpatch()
    before, native = _forward_seeing_routers(model, names, ids)
    # router_dtype=None is the unpatched model bitwise, and each router returns what the family's
    # returns (its logits too: transformers records them for the auxiliary loss)
    p = syhf.patch(model, router_dtype=None)
    got, routed = _forward_seeing_routers(model, names, ids)
    assert torch.equal(got, before), family
    for n in names:
        a, b = native[n], routed[n]
        a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
        assert len(a) == len(b) and all(x == y if isinstance(x, list) else  # JetMoE's sizes
                                        x.dtype == y.dtype and torch.equal(x, y)
                                        for x, y in zip(a, b)), (family, n)
    p.unpatch()
    p = syhf.patch(model, router_dtype=torch.float32)
    with torch.no_grad(), p.capture() as cap:
        model(ids)
    routes = cap.ids()[:, :, p.layers, :]  # [B, S, moe_layers, K]
    p.unpatch()  # restores the family's own routers: the unpatched outputs, bitwise
    assert not p.active and syhf.patch_of(model) is None
    for name in p.modules.values():
        assert "forward" not in model.get_submodule(name).__dict__
    with torch.no_grad():
        assert torch.equal(model(ids)[0], before), family
    p = syhf.patch(model, router_dtype=torch.float32)
    _perturb(model, p, family)
    seen = _Seen(model, p)
    try:
        with torch.no_grad(), p.capture() as cap:
            model(ids)
        live = cap.ids()[:, :, p.layers, :]
        assert not torch.equal(live, routes), f"{family}: the perturbation changed no route"
        p.set_targets(routes)
        with torch.no_grad(), p.capture() as cap:
            model(ids)
        assert torch.equal(cap.ids()[:, :, p.layers, :], routes), family
        for m, layer in enumerate(p.layers):
            if layer in seen.ids:  # the experts received the replayed ids
                block = model.get_submodule(p.modules[layer].rsplit(".", 1)[0])
                assert torch.equal(seen.ids[layer].reshape(routes.shape[0], routes.shape[1], -1)
                                   .to(routes.dtype),
                                   _experts_get(family, routes[:, :, m, :], block)), (family,
                                                                                     layer)
        assert all(c["num_replayed_rows"] == ids.numel() for c in p.counts().values())
    finally:
        seen.remove()
        p.unpatch()


@pytest.mark.parametrize("router_dtype", [None, torch.float32], ids=["native", "fp32"])
@pytest.mark.parametrize("family", _families())
def test_a_partly_replayed_forward_selects_its_native_rows_as_a_whole_selection_does(
        family, router_dtype, monkeypatch):
    # Targets with some rows -1: those rows take the router's own choice, the others the
    # targets. A family whose selection treats each row alone selects the -1 rows alone (a
    # top-k of a few rows); the ids and the model's output are those of selecting every row and
    # merging, bit for bit.
    import importlib
    fams = importlib.import_module("switchyard.integrations.hf.families")
    model = build(family)
    ids = tokens(2, 10, seed=6)
    p = syhf.patch(model, router_dtype=router_dtype)
    try:
        with torch.no_grad(), p.capture() as cap:
            model(ids)
        routes = cap.ids()[:, :, p.layers, :].clone()  # [B, S, moe_layers, K]
        _perturb(model, p, family)
        native = torch.zeros(routes.shape[:2], dtype=torch.bool)
        native[0, [0, 3, 7]] = native[1, [2, 9]] = True
        routes[native] = -1

        def replayed():  # (no capture: a capture asks for every row's own choice)
            p.reset_counts()
            p.set_targets(routes)
            seen = _Seen(model, p)
            try:
                with torch.no_grad():
                    out = model(ids)[0]
            finally:
                seen.remove()
            assert all(c["num_native_rows"] == int(native.sum()) for c in p.counts().values())
            return out, {k: v.clone() for k, v in seen.ids.items()}
        out, got = replayed()
        whole = fams._ids
        monkeypatch.setattr(fams, "_ids", lambda select, replay_ids, replay_mask, live=None,
                            select_rows=None, native_rows=None: whole(select, replay_ids,
                                                                      replay_mask, live))
        out_whole, got_whole = replayed()
        assert torch.equal(out, out_whole), family
        assert got.keys() == got_whole.keys() and all(
            torch.equal(got[k], got_whole[k]) for k in got), family
    finally:
        p.unpatch()


@pytest.mark.parametrize("family", _families())
def test_a_gradient_free_fp32_forward_returns_what_the_routers_generic_forward_does(family):
    # A no-grad forward that replays nothing takes the fast path (Patch._step_begins decides it
    # once; _Layer._fast_generic: the gate, the routing, the outputs, reusing the routing's scores
    # for a family whose router returns them). Every router call must return, bit for bit, what
    # the generic forward returns for the same hidden states (a forward with grad enabled), and
    # the model's output must be the same.
    model = build(family).eval()
    ids = tokens(2, 7, seed=8)
    p = syhf.patch(model, router_dtype=torch.float32)
    seen = []
    hooks = [model.get_submodule(p.modules[layer]).register_forward_hook(
        lambda m, a, out: seen.append([t.detach().clone() for t in
                                       (out if isinstance(out, tuple) else (out,))
                                       if isinstance(t, torch.Tensor)]))
        for layer in dict.fromkeys(p.layers) if p.modules.get(layer)]
    try:
        with torch.no_grad():
            fast = model(ids)[0]
        fast_seen, seen[:] = list(seen), []
        generic = model(ids)[0].detach()
        assert fast_seen and len(fast_seen) == len(seen), family
        for a, b in zip(fast_seen, seen):
            assert len(a) == len(b) and all(
                x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b)), family
        assert torch.equal(fast, generic), family
    finally:
        for h in hooks:
            h.remove()
        p.unpatch()


def test_a_per_layer_top_k_routes_captures_and_replays_each_layer_with_its_own_k(tmp_path):
    # HunYuan's moe_topk may be a list: K differs per MoE layer. Route tables are as wide as the
    # largest K; a layer with a smaller K holds -1 past its own.
    model = build("hunyuan_v1_moe", moe_topk=[2, 3])
    p = syhf.patch(model, router_dtype=torch.float32)
    assert p.top_ks == {0: 2, 1: 3} and p.top_k == 3
    ids = tokens(2, 6, seed=1)
    with torch.no_grad(), p.capture() as cap:
        model(ids)
    got = cap.ids()
    assert got.shape == (2, 6, 2, 3)
    assert (got[:, :, 0, 2] == -1).all() and (got[:, :, 0, :2] >= 0).all()
    assert (got[:, :, 1, :] >= 0).all()
    assert torch.equal(cap.expert_ids(), got)  # what the experts received, K per layer
    routes = got[:, :, p.layers, :]
    _perturb(model, p, "hunyuan_v1_moe")
    p.set_targets(routes)
    with torch.no_grad(), p.capture() as cap:
        model(ids)
    assert torch.equal(cap.ids(), got) and torch.equal(cap.expert_ids(), got)
    bad = routes.clone()
    bad[0, 0, 0, 2] = 5
    with pytest.raises(ValueError, match=r"\[hf.set_targets\] layer 0 routes to K=2 experts: "
                                         r"routes\[\.\.\., 0, 2:\] must be -1"):
        p.set_targets(bad)
    with pytest.raises(ValueError, match=r"\[hf.Capture\] the MoE layers route to different K "
                                         r"\(\{0: 2, 1: 3\}\)"):
        cap.tables()
    p.unpatch()


def test_a_router_class_no_spec_covers_is_refused_naming_it(monkeypatch):
    # A release that renames Qwen3-MoE's router: its experts would run unrouted by switchyard.
    model = build("qwen3_moe")
    fam = syhf.FAMILIES["qwen3_moe"]
    monkeypatch.setattr(fam, "router_class", "Qwen3MoeRenamedRouter")
    with pytest.raises(ValueError, match=r"\[hf.patch\] model type 'qwen3_moe': the MoE block "
                                         r"model\.layers\.0\.mlp \(Qwen3MoeSparseMoeBlock\) routes "
                                         r"its experts \(Qwen3MoeExperts\) with "
                                         r"Qwen3MoeTopKRouter, which no switchyard routing spec "
                                         r"covers.*spec\.py"):
        syhf.patch(model)
    assert syhf.patch_of(model) is None


def test_a_refused_family_names_itself_and_the_reason(monkeypatch):
    # The families REFUSED lists today have no modeling file (nothing to build): the refusal is
    # checked on a model whose family is made refused here; patch() names it and the reason and
    # leaves the model untouched.
    assert "doge" not in syspec.REFUSED and "doge" in syhf.FAMILIES  # supported (issue 32)
    model = build("qwen3_moe")
    monkeypatch.setitem(syspec.REFUSED, "qwen3_moe", "Qwen3-MoE is not supported: a reason")
    with pytest.raises(ValueError, match=r"\[hf.patch\] qwen3_moe: Qwen3-MoE is not supported: "
                                         r"a reason"):
        syhf.patch(model)
    assert syhf.patch_of(model) is None
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_phimoe_routes_in_eval_mode_and_refuses_training_mode_by_name():
    model = build("phimoe")
    p = syhf.patch(model, router_dtype=torch.float32)
    with torch.no_grad():
        model(tokens(1, 5))  # eval: the sparse mixer's deterministic top-2
    model.train()
    with pytest.raises(ValueError, match=r"\[hf\] phimoe: PhiMoE's sparse mixer samples the "
                                         r"experts .* eval mode only"):
        model(tokens(1, 5))
    p.unpatch()


def test_dbrx_patches_the_blocks_route_method_and_unpatch_restores_it():
    model = build("dbrx")
    ids = tokens(2, 6, seed=2)
    with torch.no_grad():
        before = model(ids)[0].clone()
    p = syhf.patch(model, router_dtype=torch.float32)
    blocks = [model.get_submodule(n.rsplit(".", 1)[0]) for n in p.modules.values()]
    assert all("route_tokens_to_experts" in b.__dict__ for b in blocks)
    p.unpatch()
    assert not any("route_tokens_to_experts" in b.__dict__ for b in blocks)
    with torch.no_grad():
        assert torch.equal(model(ids)[0], before)


def test_capture_experts_observes_any_model_and_equals_the_patched_capture():
    # The experts interface sees the ids whatever routed them: an unpatched model's experts get
    # the family's own choice, which the patched router (router_dtype=None) reproduces.
    model = build("qwen3_moe")
    ids = tokens(2, 7, seed=4)
    with torch.no_grad(), syhf.capture_experts(model) as seen:
        model(ids)
    p = syhf.patch(model, router_dtype=None)
    with torch.no_grad(), p.capture() as cap:
        model(ids)
    p.unpatch()
    assert seen.layers == p.layers
    assert torch.equal(seen.ids(), cap.ids()) and torch.equal(cap.expert_ids(), cap.ids())
    with pytest.raises(ValueError, match=r"\[hf.capture_experts\] no experts module"):
        syhf.capture_experts(torch.nn.Linear(2, 2))


def test_a_moe_block_running_a_replaced_kernel_forward_is_refused(monkeypatch):
    # transformers' kernels integration replaces a decorated block's forward with a hub kernel
    # (e.g. a MegaBlocks MoE MLP) that may route inside the kernel, never calling the router.
    model = build("gpt_oss")
    block = model.get_submodule("model.layers.0.mlp")
    monkeypatch.setattr(type(block), "kernel_layer_name", "MegaBlocksMoeMLP", raising=False)
    block.forward = lambda hidden_states: hidden_states
    with pytest.raises(ValueError, match=r"\[hf.patch\] model type 'gpt_oss': the MoE block of "
                                         r"model\.layers\.0\.mlp\.router \(GptOssMLP\) runs a "
                                         r"replaced forward \(hub kernel 'MegaBlocksMoeMLP'\)"):
        syhf.patch(model)
    assert syhf.patch_of(model) is None


# ---- Doge ------------------------------------------------------------------------------------------
def _cdmoe_reference(block, x, ids, weight):
    """DogeCDMoE's output in float64 from its maths with the experts ``ids`` [T, K] (T = B·S in
    row order) and gate ``weight``: the weights a softmax over the K ids' product-key scores
    (_product_key_scores), / their sum when norm_topk_prob; token t's output is the shared MLP's
    plus Σ_k silu(down[e_k]·x_t)·w_tk·up[e_k] (down, up: the rows of down_embed, up_embed)."""
    B, S, H = x.shape
    xf = x.reshape(B * S, H).double()
    w = torch.softmax(_product_key_scores(block, xf, weight).gather(1, ids), dim=1)
    if block.norm_topk_prob:
        w = w / w.sum(dim=1, keepdim=True)
    silu = torch.nn.functional.silu
    down, up = block.down_embed.weight.double()[ids], block.up_embed.weight.double()[ids]
    routed = ((silu((down * xf[:, None, :]).sum(-1)) * w)[:, :, None] * up).sum(1)
    lin = [m.weight.double() for m in (block.gate_proj, block.up_proj, block.down_proj)]
    shared = (silu(xf @ lin[0].t()) * (xf @ lin[1].t())) @ lin[2].t()
    return (shared + routed).view(B, S, H)


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm_topk_prob"])
def test_doge_replayed_ids_take_their_weights_from_the_live_logits_and_train_the_gate(norm):
    # R2 / R3 on a product-key block: the recorded ids are forced after the gate changed, the
    # weights are the family's formula at those ids from the live logits (x_i + y_j of the
    # token-mixed rows), and the gradients reach router_gate: all against float64 from the maths.
    model = build("doge", norm_topk_prob=norm)
    p = syhf.patch(model, router_dtype=torch.float32)
    layer = p.layers[-1]
    block = model.get_submodule(p.modules[layer])
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    p.replays[layer].action = "record"
    with torch.no_grad():
        block(x)
    recorded = p.replays[layer].pop_recorded()
    ids = recorded.long()
    _perturb(model, p, "doge")
    live, _ = _reference("doge", block, x.reshape(18, 32), p.top_k)
    assert (live != ids.sort(dim=1).values).any()  # the replay forces other ids than the live
    p.replays[layer].set_target(recorded)
    p.replays[layer].action = "replay_forward"
    out, logits = block(x)
    assert logits.shape == (2, 18, 4) and logits.dtype == torch.float32
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * g).sum().backward()
    w64 = block.router_gate.weight.detach().double().requires_grad_()
    want = _cdmoe_reference(block, x, ids, w64)
    (want * g.double()).sum().backward()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    got = block.router_gate.weight.grad
    assert got is not None and got.abs().sum() > 0
    torch.testing.assert_close(got.double(), w64.grad, rtol=1e-4, atol=1e-6)
    p.unpatch()


def test_doge_captures_the_ids_its_embeddings_are_gathered_at_and_refuses_expert_ids():
    # Doge's experts are embedding rows inside the block, not transformers' experts interface:
    # ids() are the ids the patched block gathers down_embed / up_embed at (the generic tests
    # compare them with what the embeddings received); expert_ids() is refused by name.
    model = build("doge")
    p = syhf.patch(model, router_dtype=torch.float32)
    x = tokens(2, 5, seed=2)
    seen = _Seen(model, p)
    try:
        with torch.no_grad(), p.capture() as cap:
            model(x)
    finally:
        seen.remove()
    for layer in p.layers:
        assert torch.equal(cap.ids()[:, :, layer].long(), seen.ids[layer].view(2, 5, -1))
    with pytest.raises(ValueError, match=r"\[hf.Capture\] the experts of Doge are not "
                                         r"transformers' experts interface"):
        cap.expert_ids()
    p.unpatch()


def test_doge_block_experts_run_under_the_callers_autocast_and_only_the_router_in_fp32():
    # The patched forward is the whole block: its router part runs in fp32 with autocast off, its
    # experts (the shared MLP, the embeddings' products) under the caller's autocast, as
    # unpatched; router_dtype=None under autocast is the unpatched model bitwise.
    model = build("doge")
    ids = tokens(2, 6, seed=4)
    block = model.get_submodule("model.layers.0.mlp")
    seen = {}
    hooks = [block.gate_proj.register_forward_hook(
                 lambda m, a, o: seen.__setitem__("shared", o.dtype)),
             block.register_forward_hook(lambda m, a, o: seen.__setitem__("block", o[0].dtype)),
             block.register_forward_hook(lambda m, a, o: seen.__setitem__("logits", o[1].dtype))]

    def run():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(ids)[0].clone()
    before = run()
    assert seen == {"shared": torch.bfloat16, "block": torch.bfloat16, "logits": torch.bfloat16}
    with syhf.patch(model, router_dtype=None):
        assert torch.equal(run(), before)
    with syhf.patch(model, router_dtype=torch.float32):
        run()
    assert seen == {"shared": torch.bfloat16, "block": torch.bfloat16, "logits": torch.float32}
    for h in hooks:
        h.remove()


def _recompute_targets(T, M, K, E, seed=3):
    """[T, M, K] replay targets of the checkpoint-recompute tests: K distinct random experts per
    row, token 4 routed natively (-1)."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * M)]).view(
        T, M, K)
    targets[4] = -1
    return targets


def _checkpoint_layers(model, reentrant):
    """Checkpoint every decoder layer of a transformers model (reentrant or not)."""
    import functools
    from torch.utils.checkpoint import checkpoint
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=functools.partial(
        checkpoint, use_reentrant=reentrant))
    if reentrant:
        model.enable_input_require_grads()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_doge_checkpoint_recompute_replays_the_ids_of_its_forward(reentrant):
    # The patched block is the checkpointed decoder layer's MLP: the recompute inside backward
    # replays the ids its forward used (replayed and native rows), gradients bitwise those of the
    # step without checkpointing, nothing captured twice.
    model = build("doge").train()
    ids = tokens(2, 9, seed=2)
    p = syhf.patch(model)
    T, E, K, M = ids.numel(), p.num_experts, p.top_k, len(p.layers)
    targets = _recompute_targets(T, M, K, E)

    def step():
        model.zero_grad(set_to_none=True)
        p.reset_counts()
        p.set_targets(targets)
        with p.capture() as cap:
            out = model(ids)[0]
            out.float().pow(2).mean().backward()
        return {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}, cap
    ref, _ = step()
    _checkpoint_layers(model, reentrant)
    got, cap = step()
    assert cap.num_forwards == 1
    rows = targets[:, :, 0] >= 0
    assert torch.equal(cap.ids().view(T, M, K)[rows], targets[rows].to(torch.int32))
    for layer, c in p.counts().items():
        assert (c["num_replayed_rows"], c["num_native_rows"], c["num_recomputed_rows"]) == \
            (T - 1, 1, T), c
    assert ref.keys() == got.keys() and any("router_gate" in n for n in got)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    p.unpatch()


# ---- Gemma-4 / DiffusionGemma, Cohere2-MoE, LongCat-Flash --------------------------------------
def _train_step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids)[0]
    out.float().pow(2).mean().backward()
    return out.detach(), {n: q.grad.clone() for n, q in model.named_parameters()
                          if q.grad is not None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", ["gemma4", "diffusion_gemma", "cohere2_moe",
                                    "cohere2_moe_sigmoid", "longcat_flash", "jetmoe",
                                    "inkling", "zaya", "inkling2_loop", "doge"])
def test_router_dtype_none_keeps_outputs_and_gradients_bitwise_in_training(family, dtype):
    # Gemma-4's router normalises its (already flat) input itself: the patched forward adds no
    # reshape node, so the gradients reach the hidden states in the family's order.
    model = build(family, dtype).train()
    ids = tokens(2, 9, seed=1)
    out, grads = _train_step(model, ids)
    with syhf.patch(model, router_dtype=None):
        got, got_grads = _train_step(model, ids)
    assert torch.equal(got, out)
    assert got_grads.keys() == grads.keys()
    for n in grads:
        assert torch.equal(got_grads[n], grads[n]), n


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemma4_fp32_router_returns_probabilities_and_its_gradients_match_float64(param_dtype):
    # The patched router returns (probabilities over all experts, weights, ids) as Gemma-4's
    # does; its gradients reach the router's input, projection, scale and per-expert scale.
    import copy
    model = build("gemma4", param_dtype)
    ref = copy.deepcopy(model).double()
    p = syhf.patch(model, router_dtype=torch.float32)
    p64 = syhf.patch(ref, router_dtype=torch.float64)
    layer = p.layers[-1]
    r, r64 = model.get_submodule(p.modules[layer]), ref.get_submodule(p64.modules[layer])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 32, generator=gen).to(param_dtype).requires_grad_()
    p.replays[layer].action = "record"
    probs, weights, ids = r(x)
    assert probs.dtype == weights.dtype == torch.float32 and probs.shape == (37, 8)
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(37), rtol=0, atol=1e-6)
    g = torch.randn(weights.shape, generator=gen, dtype=torch.float64)
    (weights.double() * g).sum().backward()
    x64 = x.detach().double().requires_grad_()
    p64.replays[layer].set_target(p.replays[layer].pop_recorded())
    p64.replays[layer].action = "replay_forward"
    _, weights64, ids64 = r64(x64)
    (weights64 * g).sum().backward()
    assert torch.equal(ids64, ids)
    # float64 of the family's maths: probabilities at the ids, renormalised, × per_expert_scale
    xh, _ = _gemma_input(r64, x64.detach())
    pr = torch.softmax(xh @ r64.proj.weight.detach().t(), dim=1).gather(1, ids)
    want = pr / pr.sum(dim=1, keepdim=True) * r64.per_expert_scale.detach()[ids]
    # (the family's RMSNorm computes in fp32 whatever the model's dtype: fp32 rounding)
    torch.testing.assert_close(weights64.detach(), want, rtol=1e-6, atol=0)
    tol = dict(rtol=1e-5, atol=1e-6) if param_dtype == torch.float32 else \
        dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(weights.double(), weights64, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    for name in ("proj.weight", "scale", "per_expert_scale"):
        got, want = r.get_parameter(name).grad, r64.get_parameter(name).grad
        assert got is not None and got.dtype == param_dtype, name
        torch.testing.assert_close(got.double(), want, **tol, msg=name)
    p.unpatch()
    p64.unpatch()


def test_diffusion_gemma_routes_its_encoder_and_decoder_stacks_with_one_patch_each():
    from transformers import AutoConfig
    from hf_models import config
    text = config("diffusion_gemma").to_dict()  # (skips where transformers has no DiffusionGemma)
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as dg
    cfg = AutoConfig.for_model("diffusion_gemma", text_config=text)
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = dg.DiffusionGemmaForBlockDiffusion(cfg).eval()
    with pytest.raises(ValueError, match=r"several decoder stacks: model\.encoder\."
                                         r"language_model, model\.decoder; patch each one"):
        syhf.patch(model)
    assert syhf.patch_of(model) is None
    ids = tokens(2, 8, seed=2)
    stacks = [model.model.encoder.language_model, model.model.decoder]
    patches = [syhf.patch(s) for s in stacks]
    with torch.no_grad(), patches[0].capture() as c0, patches[1].capture() as c1:
        model(input_ids=ids)
    routes = [c.ids()[:, :, q.layers, :] for c, q in ((c0, patches[0]), (c1, patches[1]))]
    for c in (c0, c1):
        assert torch.equal(c.expert_ids(), c.ids())
    _perturb(stacks[0], patches[0], "diffusion_gemma")
    _perturb(stacks[1], patches[1], "diffusion_gemma")
    for q, t in zip(patches, routes):
        q.set_targets(t)
    with torch.no_grad(), patches[0].capture() as c0, patches[1].capture() as c1:
        model(input_ids=ids)
    for c, q, t in ((c0, patches[0], routes[0]), (c1, patches[1], routes[1])):
        assert torch.equal(c.ids()[:, :, q.layers, :], t)
        assert torch.equal(c.expert_ids(), c.ids())
        q.unpatch()


def test_cohere2_moe_refuses_an_expert_selection_fn_it_does_not_know_by_name():
    model = build("cohere2_moe")
    for layer in model.model.layers:
        layer.mlp.gate.expert_selection_fn = "relu"
    with pytest.raises(ValueError, match=r"\[hf\] cohere2_moe: Cohere2MoeTopKRouter\."
                                         r"expert_selection_fn='relu' is not one of "
                                         r"\['sigmoid', 'softmax'\]"):
        syhf.patch(model)
    assert syhf.patch_of(model) is None


def test_longcat_flash_routes_replays_and_captures_its_zero_compute_experts():
    # The route is the router's [T, K] ids over n_routed_experts + zero_expert_num; the experts
    # module receives a zero expert's slot as a dummy routed id with weight 0 (the block adds the
    # token's own hidden state × that weight itself): Capture.expert_ids() shows those dummies.
    # (Before transformers 5.25 its own experts module took the router's ids and ran a zero
    # expert as the identity: what the experts received is then the route itself.)
    from switchyard.integrations.hf.capture import is_experts
    model = build("longcat_flash")
    ids = tokens(2, 10, seed=6)
    p = syhf.patch(model, router_dtype=torch.float32)
    n, Z = model.config.n_routed_experts, model.config.zero_expert_num
    assert p.num_experts == n + Z
    block = model.get_submodule(p.modules[p.layers[0]].rsplit(".", 1)[0])
    interface = is_experts(block.experts)
    got_w = {}
    hooks = [model.get_submodule(name.rsplit(".", 1)[0]).experts.register_forward_pre_hook(
        lambda m, a, layer=layer: got_w.__setitem__(layer, (a[1].clone(), a[2].clone())))
        for layer, name in p.modules.items()]
    with torch.no_grad(), p.capture() as cap:
        model(ids)
    live = cap.ids()
    assert (live[:, :, p.layers] >= n).any() and (live[:, :, p.layers] < n).any()
    if interface:
        assert torch.equal(cap.expert_ids(), _experts_get("longcat_flash", live, block))
    for layer, (eids, w) in got_w.items():
        zero = live[:, :, layer, :].reshape(eids.shape) >= n
        if interface:
            assert (w[zero] == 0).all() and (w[~zero] != 0).all()
        else:
            assert torch.equal(eids, live[:, :, layer, :].reshape(eids.shape).long())
    # replay: every token's first slot forced to zero expert n + Z - 1, the second to expert 0
    routes = torch.zeros_like(live[:, :, p.layers, :])
    routes[..., 0] = n + Z - 1
    p.set_targets(routes)
    with torch.no_grad(), p.capture() as cap:
        model(ids)
    assert torch.equal(cap.ids()[:, :, p.layers, :], routes)
    for layer, (eids, w) in got_w.items():
        if interface:
            assert (eids[:, 0] == (Z - 1) * n // Z).all() and (w[:, 0] == 0).all()
        else:
            assert (eids[:, 0] == n + Z - 1).all()
        assert (eids[:, 1] == 0).all() and (w[:, 1] > 0).all()
    for h in hooks:
        h.remove()
    p.unpatch()


def test_dots3_note_routes_its_text_model_and_refuses_the_vision_tower_by_name():
    from transformers import AutoConfig, AutoModel
    from hf_models import config
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  moe_intermediate_size=16, num_experts_per_tok=2, pyramid_num_routed=[-1, 4],
                  adapter_in_dim=32, adapter_out_dim=32)
    audio = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 adapter_input_size=32, adapter_out_dim=32, downsample_hidden_size=16)
    cfg = AutoConfig.for_model("dots3_note", text_config=config("dots3_note").to_dict(),
                               vision_config=vision, audio_config=audio)
    cfg.get_text_config()._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg).eval()
    assert any(type(m).__name__ == "Dots3NoteVisionTopKRouter" for m in model.modules())
    with pytest.raises(ValueError, match=r"\[hf.patch\] dots3_note: dots3-note's vision tower "
                                         r"routes .* patch\(model\.model\.language_model\)"):
        syhf.patch(model)
    assert syhf.patch_of(model) is None
    text = model.language_model
    ids = tokens(2, 7, seed=4)
    p = syhf.patch(text, router_dtype=torch.float32)
    assert p.family == "dots3-note" and p.layers == [1, 2]
    with torch.no_grad(), p.capture() as cap:
        model(input_ids=ids)
    routes = cap.ids()[:, :, p.layers, :]
    assert torch.equal(cap.expert_ids(), cap.ids())
    _perturb(text, p, "dots3_note")
    p.set_targets(routes)
    with torch.no_grad(), p.capture() as cap:
        model(input_ids=ids)
    assert torch.equal(cap.ids()[:, :, p.layers, :], routes)
    p.unpatch()


def _ernie_types(B, S):
    """moe_mm_token_type_ids [B, S]: text tokens 0, an image run (1) in row 0, video (2) at the
    end of row 1."""
    types = torch.zeros(B, S, dtype=torch.long)
    types[0, 2:5] = 1
    types[1, S - 3:] = 2
    return types


class _ErnieSeen:
    """Forward pre-hooks on both routers of every ERNIE-4.5-VL MoE layer (their inputs) and both
    experts modules (the ids they received), keyed (layer, "text_moe" / "vision_moe")."""

    def __init__(self, model, p):
        self.x, self.ids, self._hooks = {}, {}, []
        for layer, name in p.modules.items():
            mlp = name[:-len(".text_moe.gate")]
            for part in ("text_moe", "vision_moe"):
                key = (layer, part)
                gate = model.get_submodule(f"{mlp}.{part}.gate")
                experts = model.get_submodule(f"{mlp}.{part}.experts")
                self._hooks.append(gate.register_forward_pre_hook(
                    lambda m, a, key=key: self.x.__setitem__(key, a[0].detach().clone())))
                self._hooks.append(experts.register_forward_pre_hook(
                    lambda m, a, key=key: self.ids.__setitem__(key, a[1].detach().clone())))

    def remove(self):
        for h in self._hooks:
            h.remove()


def test_ernie4_5_vl_moe_routes_each_token_through_its_modalitys_router():
    # Each MoE layer holds a text and a vision expert set, each with its own router of one class
    # and the same E and K; the block sends the text tokens (moe_mm_token_type_ids 0) through the
    # text experts' router and the image / video tokens through the vision experts'. Both routers
    # are patched and share one route layer: a row holds the ids of the router of its token.
    model = build("ernie4_5_vl_moe", dtype=torch.bfloat16)
    B, S = 2, 9
    ids, types = tokens(B, S, seed=8), _ernie_types(B, S)
    vision = types.reshape(-1) != 0
    T = B * S
    p = syhf.patch(model, router_dtype=torch.float32)
    assert all(name.endswith("mlp.text_moe.gate") for name in p.modules.values())
    seconds = [n.replace("text_moe", "vision_moe") for n in p.modules.values()]
    assert all("forward" in model.get_submodule(n).__dict__ for n in seconds)
    K = p.top_k
    seen = _ErnieSeen(model, p)
    try:
        with torch.no_grad(), p.capture() as cap:
            model(ids, moe_mm_token_type_ids=types)
        captured = cap.ids()
        n_clear = 0
        for layer in p.layers:  # each modality's rows: its router's float64 reference
            route = captured[:, :, layer].reshape(T, K).long()
            for part, rows in (("text_moe", ~vision), ("vision_moe", vision)):
                router = model.get_submodule(p.modules[layer].replace("text_moe", part))
                x = seen.x[(layer, part)]
                assert x.shape[0] == int(rows.sum())  # the block sent the router its tokens
                ref, clear = _reference("ernie4_5_vl_moe", router, x, K)
                bad = (route[rows].sort(dim=1).values != ref).any(dim=1) & clear
                assert not bad.any(), (layer, part, route[rows][bad].tolist(), ref[bad].tolist())
                assert torch.equal(seen.ids[(layer, part)], route[rows]), (layer, part)
                n_clear += int(clear.sum())
        assert n_clear >= len(p.layers) * T // 2
        assert cap.num_split_forwards == len(p.layers)
        with pytest.raises(ValueError, match=r"\[hf.Capture\] ERNIE-4.5-VL-MoE: 1 captured MoE "
                                             r"layer forwards split their tokens between two "
                                             r"expert sets"):
            cap.expert_ids()
        # R3 after both routers' weights changed: every token replays its captured ids, each
        # through its own modality's experts; the step is counted once per layer.
        routes = captured[:, :, p.layers]
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name in list(p.modules.values()) + seconds:
                w = model.get_submodule(name).weight
                w.add_(torch.randn(w.shape, generator=g).to(w.dtype) * 0.5 * w.float().std())
        with torch.no_grad(), p.capture() as cap:
            model(ids, moe_mm_token_type_ids=types)
        assert not torch.equal(cap.ids()[:, :, p.layers], routes)
        p.reset_counts()
        p.set_targets(routes)
        with torch.no_grad(), p.capture() as cap:
            model(ids, moe_mm_token_type_ids=types)
        assert torch.equal(cap.ids()[:, :, p.layers], routes)
        for m, layer in enumerate(p.layers):
            route = routes[:, :, m].reshape(T, K).long()
            assert torch.equal(seen.ids[(layer, "text_moe")], route[~vision])
            assert torch.equal(seen.ids[(layer, "vision_moe")], route[vision])
            c = p.counts()[layer]
            assert c["num_replayed_rows"] == T and c["num_calls"] == 1, c
        # a text-only forward (no token types, or all 0) routes through the text router alone
        p.set_targets(routes)
        with torch.no_grad(), p.capture() as cap:
            model(ids, moe_mm_token_type_ids=torch.zeros_like(types))
        assert torch.equal(cap.ids()[:, :, p.layers], routes) and cap.num_split_forwards == 0
        assert torch.equal(cap.expert_ids(), cap.ids())
    finally:
        seen.remove()
    p.unpatch()
    assert not p.active
    for n in list(p.modules.values()) + seconds:
        assert "forward" not in model.get_submodule(n).__dict__


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_ernie4_5_vl_moe_with_vision_tokens_router_dtype_none_is_bitwise_in_training(dtype):
    model = build("ernie4_5_vl_moe", dtype).train()
    ids, types = tokens(2, 9, seed=1), _ernie_types(2, 9)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids, moe_mm_token_type_ids=types)[0]
        out.float().pow(2).mean().backward()
        return out.detach(), {n: q.grad.clone() for n, q in model.named_parameters()
                              if q.grad is not None}
    out, grads = step()
    assert any("vision_moe.gate" in n for n in grads)  # the vision router is trained
    with syhf.patch(model, router_dtype=None):
        got, got_grads = step()
    assert torch.equal(got, out)
    assert got_grads.keys() == grads.keys()
    for n in grads:
        assert torch.equal(got_grads[n], grads[n]), n


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_ernie4_5_vl_moe_checkpoint_recompute_splits_the_tokens_as_its_forward(reentrant):
    # The recompute inside backward runs the block again (its pre-hook sees the same token types)
    # and replays the ids its forward used, each router its own rows: gradients bitwise those of
    # the step without checkpointing.
    model = build("ernie4_5_vl_moe").train()
    ids, types = tokens(2, 9, seed=2), _ernie_types(2, 9)
    p = syhf.patch(model)
    T, E, K, M = ids.numel(), p.num_experts, p.top_k, len(p.layers)
    targets = _recompute_targets(T, M, K, E)

    def step():
        model.zero_grad(set_to_none=True)
        p.reset_counts()
        p.set_targets(targets)
        with p.capture() as cap:
            out = model(ids, moe_mm_token_type_ids=types)[0]
            out.float().pow(2).mean().backward()
        return {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}, cap
    ref, _ = step()
    _checkpoint_layers(model, reentrant)
    got, cap = step()
    assert cap.num_forwards == 1
    for layer, c in p.counts().items():
        assert (c["num_replayed_rows"], c["num_native_rows"], c["num_recomputed_rows"]) == \
            (T - 1, 1, T), c
    assert ref.keys() == got.keys()
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    p.unpatch()


# ---- JetMoE, Inkling ---------------------------------------------------------------------------
def _weights64(family, router, x, ids):
    """The float64 weights of the experts at ids [T, K] (and Inkling's shared experts'), from the
    family's maths: JetMoE, a softmax over the K selected logits; Zaya, the softmax over all
    classes at the ids (0 at the skip class); Inkling, each slot's
    sigmoid(logit) over the sum of the K selected and the S shared slots' sigmoids (a softmax of
    log-sigmoids), × route_scale × global_scale."""
    if family != "zaya":
        w, _ = _gate_params(router)
        z = x.double() @ w.double().t()
    if family == "jetmoe":
        e = torch.exp(z.gather(1, ids))
        return e / e.sum(dim=1, keepdim=True), None
    if family == "zaya":  # softmax over the E + 1 classes; the skip class's slot weighs 0
        z = _zaya_logits(router, x, None)
        p = torch.exp(z - z.max(dim=1, keepdim=True).values)
        p = (p / p.sum(dim=1, keepdim=True)).gather(1, ids)
        return torch.where(ids == router.num_experts, 0.0, p), None
    S = router.n_shared_experts
    s = torch.sigmoid(torch.cat([z[:, :-S].gather(1, ids), z[:, -S:]], dim=1))
    s = s / s.sum(dim=1, keepdim=True) * router.route_scale * float(router.global_scale.detach())
    return s[:, :ids.shape[1]], s[:, ids.shape[1]:]


@pytest.mark.parametrize("family", ["jetmoe", "jetmoe_attention", "inkling", "zaya"])
def test_replayed_ids_take_the_familys_weights_from_live_logits_and_gradients_reach_the_router(
        family):
    # Replay forces the ids; the weights are the family's formula at those ids from the live
    # logits (float64 reference from the maths), differentiable w.r.t. the gate and the input.
    # (jetmoe_attention: JetMoE's attention experts' router, the route layer before the last.)
    model = build(family.replace("_attention", ""))
    p = syhf.patch(model, router_dtype=torch.float32)
    layer = p.layers[-2] if family == "jetmoe_attention" else p.layers[-1]
    family = family.replace("_attention", "")
    r = model.get_submodule(p.modules[layer])
    gen = torch.Generator().manual_seed(0)
    T, E, K = 23, p.num_experts, p.top_k
    x = torch.randn(T, 32, generator=gen).requires_grad_()
    forced = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    if family == "zaya":  # the skip class too (E counts it); layer 1 carries no state here
        forced[::3] = E - 1
    p.replays[layer].set_target(forced)
    p.replays[layer].action = "replay_forward"
    out = r(x)
    ref, shared = _weights64(family, r, x.detach(), forced)
    if family == "jetmoe":  # expert-sorted groups: slot order, token, weight, sizes, logits
        order, token, gates, sizes, _ = out
        assert sizes == torch.bincount(forced.flatten(), minlength=E).tolist()
        assert torch.equal(forced.flatten()[order], torch.repeat_interleave(
            torch.arange(E), torch.tensor(sizes)))
        assert torch.equal(token, order // K)
        weights = torch.empty_like(gates).index_put((order,), gates).view(T, K)
    elif family == "zaya":  # logits, weights, ids (skip: id 0, weight 0), the next state
        logits, weights, ids, state = out
        assert torch.equal(ids, forced.masked_fill(forced == E - 1, 0))
        assert logits.shape == (T, E) and state.shape == (T, r.router_hidden_size)
    else:
        logits, weights, ids, gammas = out
        assert torch.equal(ids, forced) and logits.shape == (T, E)
        assert gammas.shape == (T, r.n_shared_experts)
        torch.testing.assert_close(gammas.double(), shared, rtol=1e-5, atol=1e-6)
    # fp32 gate and normalisation of O(1) values: a few ulp of fp32
    torch.testing.assert_close(weights.double(), ref, rtol=1e-5, atol=1e-6)
    g = torch.randn(weights.shape, generator=gen)  # (the weights of a row sum to a constant)
    (weights * g).sum().backward()
    w = r.down_proj.weight if family == "zaya" else _gate_params(r)[0]
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert w.grad is not None and w.grad.abs().sum() > 0
    p.unpatch()


def test_jetmoe_routes_its_attention_and_mlp_experts_as_two_route_layers_per_decoder_layer():
    # Every JetMoE decoder layer routes each token twice, with one router class and the same E and
    # K (config.num_local_experts, num_experts_per_tok): its attention experts (mixture of
    # attention heads), then its MLP experts. Each router is a route layer of its own, in forward
    # order: decoder layer i's attention router is route layer 2i, its MLP router 2i + 1.
    model = build("jetmoe")
    cfg = model.config
    N, E, K = cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok
    p = syhf.patch(model, router_dtype=torch.float32)
    sites = ("self_attention.experts.router", "mlp.router")
    assert p.routes_per_layer == 2 and p.num_route_layers == 2 * N and p.num_hidden_layers == N
    assert p.layers == list(range(2 * N))
    assert p.modules == {2 * i + s: f"model.layers.{i}.{site}" for i in range(N)
                         for s, site in enumerate(sites)}
    assert p.num_experts == E and p.top_k == K
    assert f"of {2 * N} route layers (2 per decoder layer)" in repr(p)
    called, got = [], {}

    def saw(k, out):
        called.append(k)
        got[k] = _grouped_ids(out)
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, a, o, k=k: saw(k, o))
             for k, n in p.modules.items()]
    ids = tokens(2, 8, seed=3)
    T = ids.numel()
    try:
        with torch.no_grad(), p.capture() as cap:
            model(ids)
        assert called == p.layers  # the route layers are the forward's order
        live = cap.ids()
        assert live.shape == (2, 8, 2 * N, K)
        for k in p.layers:  # each router's groups held the captured ids
            assert torch.equal(got[k], live[:, :, k].reshape(T, K).long()), k
        with pytest.raises(ValueError, match=r"the experts of JetMoE are not transformers' "
                                             r"experts interface"):
            cap.expert_ids()
        # Replay of the attention routers alone: their experts get the targets, the MLP routers
        # (rows of -1) route natively, each counted on its own route layer.
        g = torch.Generator().manual_seed(4)
        forced = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T * N)])
        targets = torch.full((2, 8, 2 * N, K), -1, dtype=torch.int64)
        targets[:, :, 0::2] = forced.view(2, 8, N, K)
        p.reset_counts()
        p.set_targets(targets)
        called.clear()
        with torch.no_grad(), p.capture() as cap:
            model(ids)
        assert called == p.layers
        for k in p.layers:
            c = p.counts()[k]
            if k % 2 == 0:
                assert torch.equal(got[k], targets[:, :, k].reshape(T, K)), k
                assert c["num_replayed_rows"] == T and c["num_native_rows"] == 0, (k, c)
            else:
                assert c["num_replayed_rows"] == 0 and c["num_native_rows"] == T, (k, c)
            assert torch.equal(cap.ids()[:, :, k].reshape(T, K).long(), got[k]), k
    finally:
        for h in hooks:
            h.remove()
    # The route data over all layers holds the 2N route layers; an engine's over the N hidden
    # layers (one route each) is refused naming the family and the count.
    mask = torch.ones(2, 8, dtype=torch.long)
    arrays = cap.routed_experts(mask)  # (a plain forward: each last real token has no route)
    assert all(a.shape == (7, 2 * N, K) for a in arrays)
    t, _ = p.targets_from_vllm(arrays, mask)
    assert torch.equal(t[:, :-1], cap.ids()[:, :-1]) and bool((t[:, -1] == -1).all())
    verl = cap.to_verl(mask)
    assert verl.shape == (2, 8, 2 * N, K)
    assert torch.equal(p.targets_from_verl(verl, mask)[0], t)
    msg = (r"JetMoE routes every token 2 times per decoder layer \(self_attention\.experts\."
           rf"router, then mlp\.router\): {{}} must hold its num_route_layers={2 * N} route "
           rf"layers .* got shape {{}}; an engine's routes over the {N} hidden layers")
    with pytest.raises(ValueError, match=r"\[hf\.targets_from_vllm\] " + msg.format(
            "routed_experts arrays", rf"\[7, {N}, {K}\] at \[0\]")):
        p.targets_from_vllm([a[:, 1::2] for a in arrays])
    with pytest.raises(ValueError, match=r"\[hf\.tables_from_vllm\] " + msg.format(
            "routed_experts arrays", rf"\[7, {N}, {K}\] at \[0\]")):
        p.tables_from_vllm([a[:, 1::2] for a in arrays])
    with pytest.raises(ValueError, match=r"\[hf\.targets_from_verl\] " + msg.format(
            "routed_experts", rf"\[2, 8, {N}, {K}\]")):
        p.targets_from_verl(verl[:, :, 1::2], mask)
    p.unpatch()
    assert not any("forward" in model.get_submodule(n).__dict__ for n in p.modules.values())


# ---- Inkling2-Loop -----------------------------------------------------------------------------
def _loop_layout(cfg):
    """{route layer: (decoder layer, pass)} of Inkling2-Loop in the order its forward runs them:
    the layers before the loop, each pass over the loop layers, the layers after it."""
    first, end, P = cfg.loop_layer_index_start, cfg.loop_layer_index_end, cfg.loop_num_passes
    order = [(i, 0) for i in range(first)]
    order += [(i, q) for q in range(P) for i in range(first, end)]
    order += [(i, 0) for i in range(end, cfg.num_hidden_layers)]
    return dict(enumerate(order))


def test_inkling2_loop_routes_each_pass_of_its_loop_layers_as_a_route_layer_in_forward_order():
    model = build("inkling2_loop")
    cfg = model.config
    N, K, E = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_local_experts
    layout = _loop_layout(cfg)
    R = cfg.total_num_hidden_layers
    assert len(layout) == R == 8
    p = syhf.patch(model, router_dtype=torch.float32)
    assert p.num_route_layers == R and p.num_hidden_layers == N and p.routes_per_layer == 1
    assert p.layers == list(range(R))
    assert p.modules == {k: f"model.layers.{i}.mlp.gate" for k, (i, _) in layout.items()}
    assert "of 8 route layers (decoder layers 1..2 in 3 passes)" in repr(p)
    ids = tokens(2, 8, seed=3)
    B, S = ids.shape
    T = B * S
    # What each router call received and returned, in call order (the pass under way).
    calls = []
    hooks = [model.get_submodule(f"model.layers.{i}.mlp.gate").register_forward_hook(
        lambda m, a, o, i=i: calls.append((i, o[2].detach().clone()))) for i in range(N)]
    try:
        with torch.no_grad(), p.capture() as cap:
            model(ids)
        assert [i for i, _ in calls] == [i for i, _ in layout.values()]
        live = cap.ids()
        assert live.shape == (B, S, R, K)
        for k, (_, out) in enumerate(calls):  # each call's ids are its route layer's
            assert torch.equal(live[:, :, k].reshape(T, K).long(), out), k
        # each pass routes from other inputs: the passes of a loop layer differ
        assert not torch.equal(live[:, :, 1], live[:, :, 3])
        with pytest.raises(ValueError, match=r"\[hf.Capture\] Inkling2-Loop: the experts of "
                                             r"decoder layers 1\.\.2 run once per pass"):
            cap.expert_ids()
        # Replay of the second pass alone: its calls get the targets, the others route natively,
        # each counted on its own route layer.
        g = torch.Generator().manual_seed(4)
        targets = torch.full((B, S, R, K), -1, dtype=torch.int64)
        second = [k for k, (_, q) in layout.items() if q == 1]
        targets[:, :, second] = torch.stack([torch.randperm(E, generator=g)[:K]
                                             for _ in range(T * len(second))]).view(
            B, S, len(second), K)
        p.reset_counts()
        p.set_targets(targets)
        calls.clear()
        with torch.no_grad(), p.capture() as cap:
            model(ids)
        for k, (_, out) in enumerate(calls):
            c = p.counts()[k]
            if k in second:
                assert torch.equal(out, targets[:, :, k].reshape(T, K)), k
                assert (c["num_replayed_rows"], c["num_native_rows"]) == (T, 0), (k, c)
            else:
                assert (c["num_replayed_rows"], c["num_native_rows"]) == (0, T), (k, c)
            assert torch.equal(cap.ids()[:, :, k].reshape(T, K).long(), out), k
        # R2: recorded in one forward, replayed pass by pass in the next
        p.set_action("record")
        with torch.no_grad():
            model(ids)
        recorded = [out for _, out in calls[-R:]]
        _perturb(model, p, "inkling2_loop")
        p.set_action("replay_forward")
        calls.clear()
        with torch.no_grad():
            model(ids)
        assert all(torch.equal(out, r) for (_, out), r in zip(calls, recorded))
    finally:
        for h in hooks:
            h.remove()
    # The route data over all layers holds the R route layers; an engine's over the N hidden
    # layers is refused naming the family and the count.
    mask = torch.ones(B, S, dtype=torch.long)
    arrays = cap.routed_experts(mask)
    assert all(a.shape == (S - 1, R, K) for a in arrays)
    t, _ = p.targets_from_vllm(arrays, mask)
    assert torch.equal(t[:, :-1], cap.ids()[:, :-1]) and bool((t[:, -1] == -1).all())
    verl = cap.to_verl(mask)
    assert verl.shape == (B, S, R, K)
    assert torch.equal(p.targets_from_verl(verl, mask)[0], t)
    msg = (r"Inkling2-Loop runs its decoder layers 1\.\.2 3 times per forward, routing every "
           rf"token in each pass: {{}} must hold its num_route_layers={R} route layers .* got "
           rf"shape {{}}; an engine's routes over the {N} hidden layers")
    first_pass = [k for k, (_, q) in layout.items() if q == 0]
    with pytest.raises(ValueError, match=r"\[hf\.targets_from_vllm\] " + msg.format(
            "routed_experts arrays", rf"\[{S - 1}, {N}, {K}\] at \[0\]")):
        p.targets_from_vllm([a[:, first_pass] for a in arrays])
    with pytest.raises(ValueError, match=r"\[hf\.targets_from_verl\] " + msg.format(
            "routed_experts", rf"\[{B}, {S}, {N}, {K}\]")):
        p.targets_from_verl(verl[:, :, first_pass], mask)
    p.unpatch()
    assert not p.active and syhf.patch_of(model) is None
    for i in range(N):
        layer = model.get_submodule(f"model.layers.{i}")
        assert "forward" not in layer.mlp.gate.__dict__
        assert not layer.self_attn._forward_pre_hooks and not layer._forward_pre_hooks


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_inkling2_loop_checkpoint_recompute_replays_each_passs_own_ids(reentrant):
    # Backward recomputes the passes of a loop layer last first; each recompute reads its pass
    # from the call and routes with the ids that pass's forward used (replayed or routed
    # natively): every recomputed router call, found by its input (the recompute's is the
    # forward's, bitwise), returns its forward's ids; without reentrancy the gradients are those
    # of the step without checkpointing, bitwise (transformers' reentrant checkpoint sums this
    # family's gradients in another order, the unpatched model's too: ~5e-7 apart).
    from switchyard import replay as sr
    model = build("inkling2_loop").train()
    ids = tokens(2, 9, seed=2)
    p = syhf.patch(model)
    T, E, K, M = ids.numel(), p.num_experts, p.top_k, len(p.layers)
    targets = _recompute_targets(T, M, K, E)
    calls = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, a, o, i=i: calls.append((i, sr.in_recompute(), a[0].detach().clone(),
                                           o[2].detach().clone())))
        for i, layer in enumerate(model.model.layers)]

    def step(replay):
        model.zero_grad(set_to_none=True)
        p.reset_counts()
        calls.clear()
        if replay:
            p.set_targets(targets)
        else:
            p.set_action(None)
        with p.capture() as cap:
            out = model(ids)[0]
            out.float().pow(2).mean().backward()
        return {n: q.grad.clone() for n, q in model.named_parameters()
                if q.grad is not None}, cap.ids()
    try:
        refs = [step(False), step(True)]
        _checkpoint_layers(model, reentrant)
        for replay, (ref, ref_ids) in zip((False, True), refs):
            got, got_ids = step(replay)
            assert torch.equal(got_ids, ref_ids)
            for layer, c in p.counts().items():
                assert c["num_recomputed_rows"] == T and c["num_calls"] == 1, (layer, c)
                assert c["num_replayed_rows"] == (T - 1 if replay else 0), (layer, c)
            forward = [c for c in calls if not c[1]]
            recomputed = [c for c in calls if c[1]]
            assert len(forward) == len(recomputed) == M
            for i, _, x, out in recomputed:
                twin = [f for f in forward if f[0] == i and torch.equal(f[2], x)]
                assert len(twin) == 1 and torch.equal(twin[0][3], out), (replay, i)
            if not reentrant:
                assert ref.keys() == got.keys()
                for n in ref:
                    assert torch.equal(got[n], ref[n]), (replay, n)
    finally:
        for h in hooks:
            h.remove()
    # the passes' routes differ, so a recompute with another pass's ids would have shown
    assert not torch.equal(refs[0][1][:, :, 1], refs[0][1][:, :, 3])
    p.unpatch()


def test_inkling2_loop_capture_during_generate_is_replayed_by_r3():
    # generate() with the KV cache (the loop layers' later passes use cache layers of their own):
    # the prefill and every decode step captured per route layer; R3 of those routes in a
    # training forward over the sequence forces them pass by pass.
    model = build("inkling2_loop")
    p = syhf.patch(model)
    ids = tokens(2, 6, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with p.capture() as cap:
        seq = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, pad_token_id=0)
    assert cap.num_forwards == 4
    full = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1)
    arrays = cap.routed_experts(full)
    assert [tuple(a.shape) for a in arrays] == [(9, 8, 2), (7, 8, 2)]
    targets, _ = p.targets_from_vllm(arrays, full)
    p.set_targets(targets)
    with torch.no_grad(), p.capture() as cap2:
        model(seq, attention_mask=full)
    rows = targets[..., 0] >= 0  # [B, S, route layers]
    assert int(rows.sum()) == (9 + 7) * 8
    assert torch.equal(cap2.ids()[rows], targets[rows])
    # the teacher-forced forward without replay routes as generate() did, up to rounding (the
    # cached and the full attention differ in the last bits); a pass mapped to another pass's
    # route layer would agree on few rows
    p.set_action(None)
    with torch.no_grad(), p.capture() as cap3:
        model(seq, attention_mask=full)
    same = (cap3.ids() == targets).all(-1)[rows]
    assert float(same.float().mean()) > 0.9
    p.unpatch()


def test_inkling2_loop_a_pass_it_cannot_read_is_refused_by_name():
    model = build("inkling2_loop")
    p = syhf.patch(model)
    attn = model.model.layers[2].self_attn
    first = p._layers[2]
    # decoder layer 2 of N = 4, loop 1..2 (L = 2): its cache layers 2, then 4 + (pass - 1)·2 + 1
    with pytest.raises(ValueError, match=r"\[hf\] inkling2_loop: loop layer 2's self_attn call "
                                         r"got cache_offset=4, which is none of its 3 passes'"):
        first._pass_pre_hook(attn, (), {"cache_offset": 4})
    with pytest.raises(ValueError, match=r"got cache_offset=None"):
        first._pass_pre_hook(attn, (), {})
    first._pass_pre_hook(attn, (), {"cache_offset": 7 - 2})  # the third pass: cache layer 7
    assert first.current_pass == 2
    first._pass_pre_hook(attn, (), {"cache_offset": 0})
    assert first.current_pass == 0
    p.unpatch()
