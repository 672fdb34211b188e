"""switchyard.integrations.hf.spec: each transformers MoE family's routing, as data.

A ``RoutingSpec`` says where a family's router and its gate weight live and which routing
primitives its router composes (score function, selection bias, group rule, renormalisation,
scaling, what it returns). ``families.Family`` is the one generic routed forward that reads a spec.
A family whose router reuses known primitives is one ``RoutingSpec(...)`` line in ``SPECS`` below;
a family, or one feature of it, switchyard cannot patch faithfully is a line in ``REFUSED`` with
the reason (``patch()`` raises it, naming the family and the router class).

Every spec was read from the router's source in transformers 5.24 and 5.25 (the router classes of
the families below are the same text in both releases); the ops and their order are the family's,
so ``router_dtype=None`` reproduces the unpatched outputs bitwise.
"""
from dataclasses import dataclass

NEG_INF = float("-inf")
SET = "<set>"
"""group_if value: the attribute is not None."""


@dataclass(frozen=True)
class RoutingSpec:
    """One family's routing. Attribute names are the router module's (``r.<name>``)."""

    model_type: str
    """The family's transformers.models package (the causal LM's ``model_type``; a multimodal
    model's, whose text backbone holds the router)."""
    title: str
    """How people write the family (``Patch.family``, a key of COMBINE_DTYPE)."""
    router_class: str
    """The router's class name in ``module``."""
    models: str = ""
    """Public models that use it (for the docs' family table)."""
    module: str = ""
    """Defining module; default ``transformers.models.<model_type>.modeling_<model_type>``."""
    weight: str = "weight"
    """Gate weight, a dotted attribute path of the router ([E, H])."""
    bias: str | None = None
    """Gate bias (added to the logits, so it moves selection and weights), or None."""
    gate_cast: str = "none"
    """The family's own gate (router_dtype=None): "none" (F.linear in the model's dtype),
    "fp32" (x and W cast to fp32), "fp32_after" (F.linear, then the logits cast to fp32),
    "fp32_if_weight_fp32" (x cast to fp32 when W is; HunYuan), "weight_dtype" (x cast to W's
    dtype; MiniMax-M2), "fp32_weight_as_x" (W rounded to x's dtype, both cast to fp32; Ergo)."""
    autocast_off: bool = False
    """The family's router runs with autocast off (ERNIE)."""
    logit_scale: str | None = None
    """Router attribute the gate's output is multiplied by (MuseSpark's output_multiplier)."""
    softcap: str | None = None
    """Router attribute c of a tanh softcap of the gate's output, c·tanh(z/c), when c > 0
    (Laguna). Both are part of the logits the router returns and scores (Family.logits)."""
    score: str = "softmax"
    """"softmax" (over all experts), "sigmoid", "fn" (the router's own ``score_fn`` module, e.g.
    ACT2FN[config.scoring_func]: sigmoid or sqrtsoftplus; DeepSeek-V4), "softmax_topk" (top-k of the
    logits, then softmax over the K selected logits), "sigmoid_topk" (top-k of the logits plus the
    selection bias, then sigmoid of the K selected logits; Kolibri), "sigmoid_dense" (top-k of the
    logits, dense [T, E] scores: sigmoid of the selected logits, 0 elsewhere; Llama-4),
    "logsigmoid_topk" (top-k of the sigmoid of the logits plus the selection bias; the weights a
    softmax over the selected slots of their log-sigmoid logits, exp(ls - logsumexp(ls)), the
    shared slots included; Inkling), "sparsemixer" (PhiMoE's two-stage masked softmax, eval
    mode) or "product_key" (product-key routing over n = r.<keys> sub-keys, Doge: the [T, 2n]
    logits viewed as (2, T, n) as the family's block does, so row t's x sub-key scores are the
    first half's row t and its y scores the second half's row t (rows of the flat logits: they
    mix tokens' halves, token t // 2's and token (T + t) // 2's); expert i·n + j scores
    x[t, i] + y[t, j]; the K best of the n² sums; the weights a softmax over the K selected
    sums. E = n², the experts a product key reaches)."""
    score_in_fp32: bool = True
    """softmax / sigmoid in fp32 (``dtype=torch.float``, ``logits.float()``) rather than in the
    logits' dtype."""
    select: str = "topk"
    """"topk" (the best scores) or "hash" (a fixed table ``r.tid2eid[input_ids]``: the experts are a
    function of the token id, the block passes input_ids to the router; DeepSeek-V4's hash layers).
    Replay forces the ids in both."""
    select_bias: str | None = None
    """A selection-only bias: "e_score_correction_bias" or "balancing_biases" (Zaya) (held by the
    router, added to the scores for the choice of experts, not to the weights), "passed" (the
    same, passed in by the block as the router forward's second argument; MiniMax-M2, AFMoE,
    LFM2-MoE), "moe_statics" (ERNIE: a module applied to the scores), or None."""
    select_in_fp32: bool = False
    """The selection adds the bias to the (detached) scores cast to fp32 (Zaya)."""
    select_bias_if: str | None = None
    """Router attribute that switches the selection bias on (LFM2's use_expert_bias)."""
    group: str | None = None
    """Group-limited selection: "top2_sum" (a group scores the sum of its 2 best experts), "max",
    or None; the best ``topk_group`` of ``num_group`` groups are kept."""
    group_mask: float = NEG_INF
    """What the experts of the other groups score (-inf or 0.0)."""
    group_if: tuple | None = None
    """(attribute, value): group-limited only when r.<attribute> == value (DeepSeek-V2), or
    (attribute, SET): only when r.<attribute> is not None (A.X-K2)."""
    sorted_topk: bool = True
    """torch.topk(sorted=...) of the family's selection (the order of the ids in a row)."""
    renorm: str = "none"
    """"none", "sum" (weights / their sum), "sum_eps" (/ (sum + renorm_eps)), "clamp" (/ clamp(sum,
    min=r.norm_min); ERNIE) or "pnorm" (/ their p-norm, p = the renorm_if attribute; DBRX)."""
    renorm_eps: float = 1e-20
    renorm_if: str | None = None
    """Router attribute that switches the renormalisation on (norm_topk_prob); None = always."""
    scale: str | None = None
    """Router attribute of a factor the weights are multiplied by (routed_scaling_factor)."""
    scale_param: str | None = None
    """Router parameter (a tensor) the weights are multiplied by after ``scale``, cast to the
    routing dtype (Inkling's learned global_scale), or None."""
    shared_slots: str | None = None
    """Router attribute S: the gate's last S rows are shared experts' logits, in every token's
    route beside the K selected (not selectable, not in the route table); the weights are
    normalised over the K + S slots and the router returns (the routed experts' logits, the K
    routed weights, ids, the S shared experts' weights); Inkling's n_shared_experts. Or None."""
    weights_dtype: str = "scores"
    """Dtype of the weights the family returns: "scores" (as computed), "logits" (cast to the
    logits' dtype), "hidden" (cast to the hidden states' dtype) or "hidden_fp32" (rounded to the
    hidden states' dtype, then fp32; Ergo, unpatched only)."""
    combine_dtype: str = "router_dtype"
    """What the patched router's weights are (COMBINE_DTYPE): "router_dtype", "router_dtype (fp32
    unpatched too)" or "hidden dtype"."""
    num_experts: str = "num_experts"
    top_k: str = "top_k"
    """Attribute paths of E and K (``block.`` = the MoE block holding the router)."""
    returns: str = "route"
    """"route" (the router returns (logits, weights, ids)), "scores" (it returns (the scores over
    all experts, weights, ids); Gemma-4's probabilities), "logits" (the router returns the
    logits and the MoE block's ``route_method`` turns them into (weights, ids); DBRX: the router
    and the route method are patched) or "expert_groups" (the route handed over as the T·K slots
    sorted by expert: (slot order, token of each sorted slot, its weight, the experts' slot
    counts as a list, logits); JetMoE, whose block runs its experts on contiguous groups).
    With ``shared_slots``, "route" is (routed logits, weights, ids, shared weights)."""
    route_method: str | None = None
    input_jitter: str | None = None
    """Router attribute eps of a training-mode multiplicative jitter U(1-eps, 1+eps) of the
    router's input, applied in place as the family does (DBRX's moe_jitter_eps)."""
    train_refused: str | None = None
    """Why a forward in training mode is refused (PhiMoE's sampling sparse mixer), or None."""
    flatten_input: bool = True
    """The router reshapes its input to [T, H] even when it is 2-D already (an autograd view node:
    where the family's router has none, as Gemma-4's, the patched forward adds none either, so
    that gradients reach the hidden states in the family's order, bitwise)."""
    input_norm: str | None = None
    """Router attribute of a module the hidden states pass through before the projection, the
    family's own op in its own dtypes (Gemma-4's RMSNorm without a scale), or None."""
    input_scale: tuple[str, ...] = ()
    """Router attributes the (normalised) hidden states are multiplied by, in order, before the
    projection (Gemma-4's ``scale`` vector, then ``scalar_root_size`` = hidden_size**-0.5)."""
    expert_scale: str | None = None
    """Router attribute, [E], gathered at the ids and multiplied into the weights after the
    renormalisation (Gemma-4's per_expert_scale), or None."""
    route_sites: tuple[str, ...] = ()
    """The ends of the router module names of a family whose decoder layer routes every token
    through several routers of its class, in the order its forward calls them (JetMoE's attention
    experts' router, then its MLP experts' router: ("self_attention.experts.router",
    "mlp.router")). Each is a route layer of its own: route layer R·layer + site (R sites), so the
    route tables hold R·num_hidden_layers layers in forward order (``Patch.num_route_layers``).
    () = one router per decoder layer, the route layer the decoder layer's number."""
    loop: tuple[str, str, str] | None = None
    """(first looped layer, end, passes): text-config attributes of a family whose decoder stack
    runs its layers first .. end - 1 ``passes`` times per forward, each pass routing every token
    again from other inputs (Inkling2-Loop: ("loop_layer_index_start", "loop_layer_index_end",
    "loop_num_passes")). Each (pass, layer) routing is a route layer of its own, in the order the
    forward runs them: layer i < first is route layer i, pass p of loop layer i is first + p·L +
    (i - first) (L = end - first), layer i >= end is i + (passes - 1)·L; the route tables hold
    num_hidden_layers + (passes - 1)·L layers (``Patch.num_route_layers``, the config's
    ``total_num_hidden_layers``). Or None."""
    loop_pass_arg: tuple[str, str] | None = None
    """(submodule of a loop decoder layer, its keyword argument): the call inside the decoder
    layer's forward, before its router, whose argument tells the pass, also in a checkpoint
    recompute (whose forward re-runs inside the decoder layer while its hooks do not): the offset
    of the pass's cache layer, layer + offset = the layer itself in the first pass,
    num_hidden_layers + (pass - 1)·L + (layer - first) after (Inkling2-Loop: ("self_attn",
    "cache_offset")). With ``loop``."""
    split_by: tuple | None = None
    """(block argument, (first router, second router)): a family whose MoE block (the common
    parent of the two routers' blocks) routes each token through one of two routers of its
    class, picked per token by an argument of the block's forward: the first router (its module
    name's end) routes the tokens where the argument is 0, the second those where it is nonzero,
    each receiving its tokens in order, the first called first (ERNIE-4.5-VL:
    ("moe_mm_token_type_ids", ("text_moe.gate", "vision_moe.gate")), text tokens through the text
    experts' router, image and video tokens through the vision experts'). Both are patched and
    make one route layer per decoder layer (keyed, named and counted by the first router): a row
    holds the ids of the router that routed its token. Or None."""
    gate_module: str | None = None
    """Router attribute of a module the gate's output passes through to give the logits (Zaya's
    router_mlp: RMSNorm, two GELU layers, an output projection over the classes); the gate
    (``weight``, ``bias``) is then the router's input projection. Patched, the module runs with
    its parameters cast to router_dtype (differentiable casts), so the whole router is in fp32.
    Or None."""
    carried_state: str | None = None
    """Router attribute of the scale of a router state carried from the previous MoE layer's
    router (the block passes it as ``router_states``): the gate's output + state × scale, when
    the ``carried_state_if`` attribute is true and a state is passed, goes to gate_module, and
    is returned (per token) as the router's fourth output, the next layer's state. The state
    does not depend on the selection. Or None."""
    carried_state_if: str | None = None
    skip_expert: bool = False
    """The router's last class is a skip expert (no compute): the route (capture, replay,
    ``num_experts``: the classes) holds it as id E; the block's experts receive its slot as id 0
    with weight 0 (Zaya)."""
    keys: str = "num_keys"
    """Router attribute n, the sub-keys of score "product_key" (Doge's num_keys)."""
    inline: str | None = None
    """A family that routes inline in its MoE block's forward, with no router module or route
    method (its gate a bare nn.Linear): ``router_class`` is then the block, ``weight`` its gate's
    weight, and the patched forward is the whole block's: the gate and the route (replay, record,
    capture as for any router), then the block's own experts at the route's ids, written in
    Family with the family's ops in its order (router_dtype=None: its outputs bitwise); it
    returns what the block returns. "cdmoe" (Doge's DogeCDMoE: the experts are the rows of
    down_embed and up_embed gathered at the ids, act(down·x) × weights combined over up, plus the
    shared MLP; returns (hidden states, the (2, T, n) logits)), or None."""
    variant_by: str | None = None
    """Router attribute whose value picks one of ``variants`` at run time (Cohere2-MoE's
    expert_selection_fn), or None."""
    variants: tuple = ()
    """((value, ((field, value), ...)), ...): the spec fields each value of ``variant_by``
    overrides; a value not listed is refused (ValueError naming the family and the value)."""

    @property
    def module_name(self) -> str:
        return self.module or f"transformers.models.{self.model_type}.modeling_{self.model_type}"


def _softmax_topk(model_type, title, router_class, models="", **kw):
    """Softmax over all experts in fp32, top-k, weights renormalised when r.norm_topk_prob, cast
    to the logits' dtype (Qwen3-MoE's router)."""
    kw.setdefault("renorm", "sum")
    kw.setdefault("renorm_if", "norm_topk_prob")
    kw.setdefault("weights_dtype", "logits")
    return RoutingSpec(model_type, title, router_class, models, **kw)


def _deepseek_v3(model_type, title, router_class, models="", **kw):
    """DeepSeek-V3's router: fp32 gate; sigmoid scores; selection on scores +
    e_score_correction_bias restricted to the topk_group best of n_group groups (a group scores
    the sum of its top 2; the others -inf); weights = scores at the ids, / (sum + 1e-20) when
    norm_topk_prob, × routed_scaling_factor."""
    args = dict(gate_cast="fp32", score="sigmoid", select_bias="e_score_correction_bias",
                group="top2_sum", sorted_topk=False, renorm="sum_eps", renorm_if="norm_topk_prob",
                scale="routed_scaling_factor", combine_dtype="router_dtype (fp32 unpatched too)")
    args.update(kw)
    return RoutingSpec(model_type, title, router_class, models, **args)


def _deepseek_v2(model_type, title, router_class, models="", **kw):
    """DeepSeek-V2's router: fp32 gate; softmax over all experts in fp32; top-k (unsorted),
    restricted to the topk_group best of n_group groups (a group scores its max; the others 0)
    when r.topk_method is "group_limited_greedy"; weights = the scores at the ids (no
    renormalisation) × routed_scaling_factor."""
    args = dict(gate_cast="fp32", group="max", group_mask=0.0,
                group_if=("topk_method", "group_limited_greedy"), sorted_topk=False,
                scale="routed_scaling_factor", combine_dtype="router_dtype (fp32 unpatched too)")
    args.update(kw)
    return RoutingSpec(model_type, title, router_class, models, **args)


def _gemma4(model_type, title, router_class, models=""):
    """Gemma-4's router: RMSNorm (no scale) of the (already flat) hidden states, × scale ×
    hidden_size**-0.5, then the projection; softmax over all in fp32, top-k, renormalised,
    × per_expert_scale at the ids; returns the probabilities, not the logits."""
    return RoutingSpec(model_type, title, router_class, models, weight="proj.weight",
                       num_experts="proj.out_features", top_k="config.top_k_experts",
                       flatten_input=False, input_norm="norm",
                       input_scale=("scale", "scalar_root_size"), renorm="sum",
                       expert_scale="per_expert_scale", returns="scores",
                       combine_dtype="router_dtype (fp32 unpatched too)")


SPECS = (
    # ---- softmax over all experts, top-k (Qwen3-MoE's router, same text in each) ----
    _softmax_topk("qwen3_moe", "Qwen3-MoE", "Qwen3MoeTopKRouter", "Qwen3-30B-A3B, Qwen3-235B-A22B"),
    _softmax_topk("qwen2_moe", "Qwen2-MoE", "Qwen2MoeTopKRouter",
                  "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B"),
    _softmax_topk("qwen3_next", "Qwen3-Next", "Qwen3NextTopKRouter", "Qwen3-Next-80B-A3B"),
    _softmax_topk("olmoe", "OLMoE", "OlmoeTopKRouter", "OLMoE-1B-7B"),
    _softmax_topk("flex_olmo", "FlexOlmo", "FlexOlmoTopKRouter", "FlexOlmo-7x7B-1T"),
    _softmax_topk("mellum", "Mellum", "MellumTopKRouter", "Mellum2-12B-A2.5B"),
    # Qwen3.5 / Qwen3-VL-MoE / Qwen3-Omni-MoE text: always renormalised (no norm_topk_prob)
    _softmax_topk("qwen3_5_moe", "Qwen3.5-MoE", "Qwen3_5MoeTopKRouter",
                  "Qwen3.5-35B-A3B, Qwen3.6 MoE", renorm_if=None),
    _softmax_topk("qwen3_vl_moe", "Qwen3-VL-MoE", "Qwen3VLMoeTextTopKRouter",
                  "Qwen3-VL-30B-A3B (text backbone)", renorm_if=None),
    # ---- softmax variants ----
    RoutingSpec("mixtral", "Mixtral", "MixtralTopKRouter", "Mixtral-8x7B, Mixtral-8x22B",
                renorm="sum"),
    RoutingSpec("minimax", "MiniMax-Text-01", "MiniMaxTopKRouter", "MiniMax-Text-01",
                renorm="sum"),
    RoutingSpec("hunyuan_v1_moe", "HunYuan-MoE-V1", "HunYuanMoEV1Gate", "Hunyuan-A13B",
                weight="wg.weight", bias="wg.bias", gate_cast="fp32_if_weight_fp32",
                renorm="sum", weights_dtype="logits"),
    RoutingSpec("jamba", "Jamba", "JambaTopKRouter", "Jamba-v0.1",
                weights_dtype="hidden", combine_dtype="hidden dtype"),
    RoutingSpec("ernie4_5_moe", "ERNIE-4.5-MoE", "Ernie4_5_MoeTopKRouter",
                "ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B", gate_cast="fp32", autocast_off=True,
                select_bias="moe_statics", renorm="clamp", weights_dtype="hidden",
                combine_dtype="hidden dtype"),
    # softmax over all, group-limited (mask 0), always renormalised / norm_topk_prob, scaled
    RoutingSpec("mistral4", "Mistral-4", "Mistral4TopkRouter", "Mistral-Small-4-119B",
                score_in_fp32=False, group="top2_sum", group_mask=0.0, sorted_topk=False,
                renorm="sum_eps", renorm_if="norm_topk_prob", scale="routed_scaling_factor"),
    _deepseek_v2("deepseek_v2", "DeepSeek-V2", "DeepseekV2TopkRouter",
                 "DeepSeek-V2, DeepSeek-V2-Lite, DeepSeek-Coder-V2"),
    # ---- top-k of the logits, then softmax over the K selected ----
    RoutingSpec("gpt_oss", "GPT-OSS", "GptOssTopKRouter", "gpt-oss-20b, gpt-oss-120b",
                bias="bias", score="softmax_topk", score_in_fp32=False),
    RoutingSpec("granitemoe", "Granite-MoE", "GraniteMoeTopKRouter", "PowerMoE-3b, Granite 3.x MoE",
                gate_cast="fp32_after", score="softmax_topk", weights_dtype="hidden",
                combine_dtype="hidden dtype"),
    RoutingSpec("granitemoeshared", "Granite-MoE-Shared", "GraniteMoeSharedTopKRouter",
                "Granite MoE with shared experts", gate_cast="fp32_after",
                score="softmax_topk", weights_dtype="hidden", combine_dtype="hidden dtype"),
    RoutingSpec("granitemoehybrid", "Granite-MoE-Hybrid", "GraniteMoeHybridTopKRouter",
                "granite-4.0-h-tiny", gate_cast="fp32_after",
                score="softmax_topk", weights_dtype="hidden", combine_dtype="hidden dtype"),
    # ---- Llama-4: dense sigmoid scores ----
    RoutingSpec("llama4", "Llama-4", "Llama4Router", "Llama-4-Scout, Llama-4-Maverick",
                bias="bias", score="sigmoid_dense", score_in_fp32=False,
                combine_dtype="hidden dtype"),
    # ---- DeepSeek-V3's router under other names ----
    _deepseek_v3("deepseek_v3", "DeepSeek-V3", "DeepseekV3TopkRouter",
                 "DeepSeek-V3, DeepSeek-R1, Kimi-K2, Moonlight"),
    _deepseek_v3("deepseek_v32", "DeepSeek-V3.2", "DeepseekV32TopkRouter", "DeepSeek-V3.2-Exp"),
    _deepseek_v3("glm4_moe", "GLM4-MoE", "Glm4MoeTopkRouter", "GLM-4.5, GLM-4.6, GLM-4.7"),
    _deepseek_v3("glm4_moe_lite", "GLM4-MoE-Lite", "Glm4MoeLiteTopkRouter", "GLM-4.7-Flash"),
    _deepseek_v3("glm_moe_dsa", "GLM-MoE-DSA", "GlmMoeDsaTopkRouter", "GLM-5"),
    _deepseek_v3("dots1", "dots.llm1", "Dots1TopkRouter", "dots.llm1.inst"),
    _deepseek_v3("nemotron_h", "Nemotron-H", "NemotronHTopkRouter",
                 "NVIDIA-Nemotron-3-Nano-30B-A3B"),
    _deepseek_v3("axk1", "A.X-K1", "AXK1TopkRouter", "A.X-K1"),
    _deepseek_v3("hy_v4", "Hy4", "HYV4TopkRouter", "Hy4-preview"),
    _deepseek_v3("exaone_moe", "EXAONE-MoE", "ExaoneMoeTopkRouter", "K-EXAONE-236B-A23B"),
    _deepseek_v3("solar_open", "Solar-Open", "SolarOpenTopkRouter", "Solar-Open-100B"),
    _deepseek_v3("kimi_linear", "Kimi-Linear", "KimiLinearTopkRouter", "Kimi-Linear-48B-A3B"),
    # MiniCPM5-MoE: DeepSeek-V3's router with autocast off around the gate
    _deepseek_v3("minicpm5_moe", "MiniCPM5-MoE", "MiniCPM5MoeTopkRouter", autocast_off=True),
    # A.X-K2: group-limited only when n_group is set, the other groups score 0
    _deepseek_v3("axk2", "A.X-K2", "AXK2TopkRouter", group_mask=0.0, group_if=("num_group", SET)),
    # Beam: sorted top-k, routed_scaling_factor applied by the block after the experts
    _deepseek_v3("beam", "Beam", "BeamTopKRouter", sorted_topk=True, scale=None),
    # ---- sigmoid + a correction bias, no groups ----
    # MiniMax-M2: the block holds the correction bias and passes it to the router's forward
    RoutingSpec("minimax_m2", "MiniMax-M2", "MiniMaxM2TopKRouter", "MiniMax-M2",
                gate_cast="weight_dtype", score="sigmoid", select_bias="passed",
                sorted_topk=False, renorm="sum"),
    RoutingSpec("minimax_m3_vl", "MiniMax-M3-VL", "MiniMaxM3VLTopKRouter",
                gate_cast="weight_dtype", score="sigmoid",
                select_bias="e_score_correction_bias", sorted_topk=False, renorm="sum"),
    RoutingSpec("hy_v3", "Hy3", "HYV3TopKRouter", gate_cast="fp32", score="sigmoid",
                select_bias="passed", sorted_topk=False, renorm="sum_eps",
                scale="router_scaling_factor", combine_dtype="router_dtype (fp32 unpatched too)"),
    RoutingSpec("afmoe", "AFMoE", "AfmoeTokenChoiceRouter", weight="gate.weight",
                gate_cast="fp32_after", score="sigmoid", select_bias="passed", renorm="sum_eps",
                scale="route_scale", combine_dtype="router_dtype (fp32 unpatched too)"),
    RoutingSpec("lfm2_moe", "LFM2-MoE", "Lfm2MoeTopKRouter", "LFM2-8B-A1B", score="sigmoid",
                score_in_fp32=False, select_bias="passed", select_bias_if="use_expert_bias",
                renorm="sum_eps", renorm_eps=1e-6, renorm_if="norm_topk_prob",
                scale="routed_scaling_factor", weights_dtype="logits"),
    RoutingSpec("laguna", "Laguna", "LagunaTopKRouter", gate_cast="fp32_after",
                softcap="router_logit_softcapping", score="sigmoid",
                select_bias="e_score_correction_bias", renorm="sum", weights_dtype="hidden",
                combine_dtype="hidden dtype"),
    RoutingSpec("ergo", "Ergo", "ErgoTopkRouter", weight="linear.weight",
                gate_cast="fp32_weight_as_x", score="sigmoid",
                select_bias="e_score_correction_bias", sorted_topk=False, renorm="sum_eps",
                scale="routed_scaling_factor", weights_dtype="hidden_fp32",
                num_experts="linear.out_features",
                combine_dtype="router_dtype (fp32 unpatched too)"),
    RoutingSpec("flint", "Flint", "FlintTopKRouter", gate_cast="fp32", autocast_off=True,
                score="sigmoid", renorm="sum", renorm_if="norm_topk_prob",
                combine_dtype="router_dtype (fp32 unpatched too)"),
    # DeepSeek-V4: score_fn (sigmoid or sqrtsoftplus) + correction bias; its hash layers take the
    # experts from a token-id table (r.tid2eid[input_ids]) and weight them with the same scores
    RoutingSpec("deepseek_v4", "DeepSeek-V4", "DeepseekV4TopKRouter", "DeepSeek-V4",
                score="fn", select_bias="e_score_correction_bias", sorted_topk=False,
                renorm="sum_eps", scale="routed_scaling_factor"),
    RoutingSpec("deepseek_v4", "DeepSeek-V4", "DeepseekV4HashRouter", "DeepSeek-V4",
                score="fn", select="hash", renorm="sum_eps", scale="routed_scaling_factor"),
    RoutingSpec("inkling2", "Inkling2", "Inkling2TopKRouter", gate_cast="fp32", score="fn",
                select_bias="e_score_correction_bias", sorted_topk=False, renorm="sum_eps",
                scale="routed_scaling_factor", combine_dtype="router_dtype (fp32 unpatched too)"),
    # Inkling2-Loop: Inkling2's router; the layers loop_layer_index_start .. end - 1 run
    # loop_num_passes times per forward (each pass from the pre-loop states and the previous
    # pass's messages): one route layer per (pass, layer), in forward order; the pass is read
    # from the cache_offset the loop layer hands its attention (in the recompute too)
    RoutingSpec("inkling2_loop", "Inkling2-Loop", "Inkling2LoopTopKRouter", gate_cast="fp32",
                score="fn", select_bias="e_score_correction_bias", sorted_topk=False,
                renorm="sum_eps", scale="routed_scaling_factor",
                combine_dtype="router_dtype (fp32 unpatched too)",
                loop=("loop_layer_index_start", "loop_layer_index_end", "loop_num_passes"),
                loop_pass_arg=("self_attn", "cache_offset")),
    # Kolibri: top-k of logits + correction bias, sigmoid of the K selected logits
    RoutingSpec("kolibri1_1", "Kolibri-1.1", "Kolibri1_1TopKRouter", gate_cast="fp32",
                score="sigmoid_topk", select_bias="e_score_correction_bias", renorm="sum",
                renorm_if="norm_topk_prob", combine_dtype="router_dtype (fp32 unpatched too)"),
    RoutingSpec("kolibri1", "Kolibri-1", "Kolibri1TopKRouter", gate_cast="fp32",
                score="sigmoid_topk", select_bias="e_score_correction_bias", renorm="sum",
                renorm_if="norm_topk_prob", combine_dtype="router_dtype (fp32 unpatched too)"),
    # ---- more softmax routers ----
    # Qwen3-Omni-MoE: the thinker's text model (and the talker's, same maths)
    _softmax_topk("qwen3_omni_moe", "Qwen3-Omni-MoE", "Qwen3OmniMoeThinkerTextTopKRouter",
                  "Qwen3-Omni-30B-A3B (thinker text model)"),
    _softmax_topk("qwen3_omni_moe", "Qwen3-Omni-MoE", "Qwen3OmniMoeTalkerTextTopKRouter",
                  "Qwen3-Omni-30B-A3B (talker text model)"),
    _deepseek_v3("bailing_hybrid", "Bailing-Hybrid", "BailingHybridTopkRouter"),
    RoutingSpec("lara_mini", "Lara-Mini", "LaraMiniTopKRouter", gate_cast="fp32", renorm="sum",
                renorm_if="norm_topk_prob", weights_dtype="hidden", combine_dtype="hidden dtype"),
    RoutingSpec("mistral_large4", "Mistral-Large-4", "MistralLarge4TextTopkRouter",
                gate_cast="fp32", score_in_fp32=False, group="top2_sum", group_mask=0.0,
                sorted_topk=False, renorm="sum_eps", scale="routed_scaling_factor",
                combine_dtype="router_dtype (fp32 unpatched too)"),
    # PhiMoE: sparse mixer (eval mode); training samples experts with a custom gradient
    RoutingSpec("phimoe", "PhiMoE", "PhimoeTopKRouter", "Phi-3.5-MoE-instruct", bias=None,
                score="sparsemixer",
                train_refused="PhiMoE's sparse mixer samples the experts (Gumbel noise) and "
                "replaces their gradient with its own estimator in training mode; switchyard "
                "routes it in eval mode only (model.eval(): generation, log-probs, R3 capture)"),
    # DBRX: the router returns the logits, the block's route_tokens_to_experts selects (softmax
    # in the logits' dtype, top-k, optional p-norm renormalisation)
    RoutingSpec("dbrx", "DBRX", "DbrxRouter", "dbrx-base, dbrx-instruct", weight="layer.weight",
                score_in_fp32=False, renorm="pnorm",
                renorm_if="block.moe_normalize_expert_weights", weights_dtype="hidden",
                combine_dtype="hidden dtype", num_experts="layer.out_features",
                top_k="block.top_k", returns="logits", route_method="route_tokens_to_experts",
                input_jitter="moe_jitter_eps"),
    # ---- top-k of the logits, softmax over the K selected ----
    RoutingSpec("aria", "Aria", "AriaTextTopKRouter", "Aria (text backbone)",
                score="softmax_topk", score_in_fp32=False),
    RoutingSpec("granitemoe_swa", "Granite-MoE-SWA", "GraniteMoeSWATopKRouter",
                gate_cast="fp32_after", score="softmax_topk", weights_dtype="hidden",
                combine_dtype="hidden dtype"),
    # ---- known routers in newer families (each router's text read in 5.24 and 5.25) ----
    _deepseek_v3("mimo_v2_flash", "MiMo-V2-Flash", "MiMoV2FlashTopkRouter", "MiMo-V2-Flash"),
    _deepseek_v3("glm4v_moe", "GLM4V-MoE", "Glm4vMoeTextTopkRouter",
                 "GLM-4.5V, GLM-4.6V (text backbone)"),
    _deepseek_v3("glm5_next", "GLM5-Next", "Glm5NextTextTopkRouter",
                 "GLM-5.3-Flash (text backbone)"),
    _deepseek_v3("hy_v4_vl", "Hy4-VL", "HYV4VLTopkRouter", "Hy4 (text backbone)"),
    _softmax_topk("qwen4_exp", "Qwen4-Exp", "Qwen4ExpTextTopKRouter", "Qwen4-Exp"),
    # Step-3.7: MiniMax-M3-VL's router; the block scales the experts' output by
    # moe_router_scaling_factor after the experts (not the router's weights)
    RoutingSpec("step3p7", "Step-3.7", "Step3p7TopKRouter", "Step-3.7-Flash",
                gate_cast="weight_dtype", score="sigmoid",
                select_bias="e_score_correction_bias", sorted_topk=False, renorm="sum"),
    # Muse-Spark: fp32 gate, logits × output_multiplier (returned so), sigmoid + correction bias,
    # / (sum + 1e-15), × routed_scaling_factor
    RoutingSpec("muse_spark", "Muse-Spark", "MuseSparkTopkRouter",
                "Muse-Spark-Open-816B-A42B (text backbone)", gate_cast="fp32",
                logit_scale="output_multiplier", score="sigmoid",
                select_bias="e_score_correction_bias", sorted_topk=False, renorm="sum_eps",
                renorm_eps=1e-15, scale="routed_scaling_factor",
                combine_dtype="router_dtype (fp32 unpatched too)"),
    _deepseek_v2("deepseek_ocr2", "DeepSeek-OCR-2", "DeepseekOcr2TextTopkRouter",
                 "DeepSeek-OCR-2 (text backbone)"),
    _deepseek_v2("unlimited_ocr", "Unlimited-OCR", "UnlimitedOcrTextTopkRouter",
                 "Unlimited-OCR (text backbone)"),
    # Gemma-4 (and DiffusionGemma's encoder and decoder): RMSNorm (no scale) of the hidden states,
    # × scale × hidden_size**-0.5, then the projection; softmax in fp32, top-k, renormalised,
    # × per_expert_scale at the ids; the router returns the probabilities, not the logits
    _gemma4("gemma4", "Gemma-4", "Gemma4TextRouter", "gemma-4-26B-A4B (text model)"),
    _gemma4("diffusion_gemma", "DiffusionGemma", "DiffusionGemmaTextRouter",
            "DiffusionGemma (its encoder and decoder text stacks, one Patch each)"),
    # dots3-note's text model: DeepSeek-V3's router (its vision tower's router: REFUSED_ROUTERS)
    _deepseek_v3("dots3_note", "dots3-note", "Dots3NoteTextTopkRouter", "dots3-note (text model)"),
    # ERNIE-4.5-VL-MoE: ERNIE-4.5-MoE's router in each modality's expert set (the same E and K,
    # config.num_experts and num_experts_per_tok); the MoE block sends the text tokens
    # (moe_mm_token_type_ids 0, or no token types) through the text experts' router, the image
    # and video tokens through the vision experts' router: one route per token and layer
    RoutingSpec("ernie4_5_vl_moe", "ERNIE-4.5-VL-MoE", "Ernie4_5_VLMoeMoeTopKRouter",
                "ERNIE-4.5-VL-28B-A3B, ERNIE-4.5-VL-424B-A47B (text and vision tokens)",
                gate_cast="fp32", autocast_off=True, select_bias="moe_statics", renorm="clamp",
                weights_dtype="hidden", combine_dtype="hidden dtype",
                split_by=("moe_mm_token_type_ids", ("text_moe.gate", "vision_moe.gate"))),
    # Cohere2-MoE: top-k of the logits; config.expert_selection_fn picks softmax over the K
    # selected (fp32) or their sigmoid (renormalised when norm_topk_prob); cast to the input dtype
    RoutingSpec("cohere2_moe", "Cohere2-MoE", "Cohere2MoeTopKRouter", score="softmax_topk",
                weights_dtype="hidden", combine_dtype="hidden dtype",
                variant_by="expert_selection_fn",
                variants=(("softmax", ()),
                          ("sigmoid", (("score", "sigmoid_topk"), ("renorm", "sum"),
                                       ("renorm_if", "norm_topk_prob"))))),
    # Inkling: fp32 gate over the routed and the shared experts (autocast off); sigmoid scores of
    # the routed ones + correction bias pick K (unsorted); the K selected and the S shared slots'
    # log-sigmoid logits are softmax-normalised together, × route_scale × global_scale, cast to
    # the input dtype; the shared slots' weights (gammas) are returned beside the route
    RoutingSpec("inkling", "Inkling", "InklingTopkRouter", "Inkling, Inkling-NVFP4",
                gate_cast="fp32", autocast_off=True, score="logsigmoid_topk",
                select_bias="e_score_correction_bias", sorted_topk=False, scale="route_scale",
                scale_param="global_scale", shared_slots="n_shared_experts",
                weights_dtype="hidden", combine_dtype="hidden dtype"),
    # Zaya: the down-projection of the input (+ the previous layer's router state × scale, from
    # layer 1), an MLP to E + 1 classes (the last a skip expert), softmax in the logits' dtype,
    # balancing_biases added in fp32 for the choice, top-k; a skip slot goes to the experts as
    # id 0 with weight 0; the state (the projection, before the MLP) is returned for the next
    # layer's router
    RoutingSpec("zaya", "Zaya", "ZayaRouter", "ZAYA1-8B", weight="down_proj.weight",
                bias="down_proj.bias", score_in_fp32=False, select_bias="balancing_biases",
                select_in_fp32=True, num_experts="num_router_classes", gate_module="router_mlp",
                carried_state="router_states_scale", carried_state_if="use_eda",
                skip_expert=True),
    # JetMoE: one router class (logits cast to fp32, top-k, softmax over the K selected, cast to
    # the input dtype) routes its attention experts (mixture of attention heads,
    # self_attention.experts.router) and then its MLP experts (mlp.router) in every decoder
    # layer, with the same E and K (config.num_local_experts, num_experts_per_tok); each hands
    # the route over as expert-sorted groups. Two route layers per decoder layer
    RoutingSpec("jetmoe", "JetMoE", "JetMoeTopKGating", "JetMoE-8B",
                weight="layer.weight", gate_cast="fp32_after", score="softmax_topk",
                weights_dtype="hidden", combine_dtype="hidden dtype", flatten_input=False,
                returns="expert_groups",
                route_sites=("self_attention.experts.router", "mlp.router")),
    # Doge: DogeCDMoE routes inline (router_gate a bare nn.Linear, no router module): the block is
    # patched whole. Product keys over num_keys = floor(sqrt(num_experts)) sub-keys; the logits'
    # (2, B·S, n) view mixes tokens' halves in the choice (as transformers does, kept), while the
    # ids applied to token t are row t's; softmax over the K selected sums in the logits' dtype,
    # renormalised when norm_topk_prob; the experts are embeddings gathered at the ids
    RoutingSpec("doge", "Doge", "DogeCDMoE", "Doge with is_moe=True (SmallDoge's CDMoE)",
                weight="router_gate.weight", score="product_key", score_in_fp32=False,
                renorm="sum", renorm_if="norm_topk_prob", weights_dtype="hidden",
                combine_dtype="hidden dtype", inline="cdmoe"),
    # LongCat-Flash: fp32 gate (the classifier's bias unused), softmax over the n_routed_experts
    # routed + zero_expert_num zero-compute experts, DeepSeek-style correction bias for the choice,
    # × routed_scaling_factor. The route is the router's ids over all E + Z; the block hands a
    # zero expert's slot to the experts as a dummy routed id with weight 0 (identity path)
    RoutingSpec("longcat_flash", "LongCat-Flash", "LongcatFlashTopkRouter",
                "LongCat-Flash-Chat, LongCat-Flash-Thinking", weight="classifier.weight",
                gate_cast="fp32", select_bias="e_score_correction_bias", sorted_topk=False,
                scale="routed_scaling_factor", weights_dtype="logits",
                num_experts="n_routed_experts",
                combine_dtype="router_dtype (fp32 unpatched too)"),
)

"""The supported families, one spec each."""


REFUSED = {
    # Families switchyard refuses, with the reason patch() gives (ValueError before any router is
    # touched). Each reason names what has no faithful [T, K] route to compute, replay or capture.
    "param2moe": "param2moe has no modeling file in this transformers release (configuration "
                 "only): nothing to patch",
    "sarvam_mla": "sarvam_mla has no modeling file in this transformers release (configuration "
                  "only): nothing to patch",
    "sarvam_moe": "sarvam_moe has no modeling file in this transformers release (configuration "
                  "only): nothing to patch",
}
"""{transformers.models package: why patch() refuses it} (ValueError before any router is
touched)."""

REFUSED_ROUTERS = {
    "Dots3NoteVisionTopKRouter": "dots3-note's vision tower routes its image patches too "
                                 "(Dots3NoteVisionTopKRouter in vision_tower.blocks.<n>, a second "
                                 "stack numbered like the text layers, its tokens the image "
                                 "patches); switchyard routes, replays and captures the text "
                                 "model's experts only: patch the text model, "
                                 "patch(model.model.language_model), whose routes then hold the "
                                 "text stack and whose vision experts route natively",
}
"""{router class: why a model holding it is refused} (a router no spec covers whose experts
patch() would otherwise leave unrouted: the reason names what to patch instead)."""

OUT_OF_SCOPE = {
    "switch_transformers": "encoder-decoder MoE (Switch Transformers): outside RL post-training "
                           "of causal LMs",
    "nllb_moe": "encoder-decoder MoE (NLLB-MoE): outside RL post-training of causal LMs",
    "openai_privacy_filter": "a token classifier, not a causal LM: outside RL post-training",
}
"""{transformers.models package: why it is out of scope} (patch() finds no supported router
there and says so)."""
