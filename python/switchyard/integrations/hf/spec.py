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
    "fp32_if_weight_fp32" (x cast to fp32 when W is; HunYuan)."""
    autocast_off: bool = False
    """The family's router runs with autocast off (ERNIE)."""
    score: str = "softmax"
    """"softmax" (over all experts), "sigmoid", "softmax_topk" (top-k of the logits, then softmax
    over the K selected logits) or "sigmoid_dense" (top-k of the logits, dense [T, E] scores:
    sigmoid of the selected logits, 0 elsewhere; Llama-4)."""
    score_in_fp32: bool = True
    """softmax in fp32 (``dtype=torch.float``) rather than in the logits' dtype."""
    select_bias: str | None = None
    """A selection-only bias held by the router: "e_score_correction_bias" (added to the scores
    for the choice of experts, not to the weights), "moe_statics" (ERNIE: a module applied to the
    scores), or None."""
    group: str | None = None
    """Group-limited selection: "top2_sum" (a group scores the sum of its 2 best experts), "max",
    or None; the best ``topk_group`` of ``num_group`` groups are kept."""
    group_mask: float = NEG_INF
    """What the experts of the other groups score (-inf or 0.0)."""
    group_if: tuple | None = None
    """(attribute, value): group-limited only when r.<attribute> == value (DeepSeek-V2)."""
    sorted_topk: bool = True
    """torch.topk(sorted=...) of the family's selection (the order of the ids in a row)."""
    renorm: str = "none"
    """"none", "sum" (weights / their sum), "sum_eps" (/ (sum + eps)) or "clamp" (/ clamp(sum,
    min=r.norm_min); ERNIE)."""
    renorm_eps: float = 1e-20
    renorm_if: str | None = None
    """Router attribute that switches the renormalisation on (norm_topk_prob); None = always."""
    scale: str | None = None
    """Router attribute of a factor the weights are multiplied by (routed_scaling_factor)."""
    weights_dtype: str = "scores"
    """Dtype of the weights the family returns: "scores" (as computed), "logits" (cast to the
    logits' dtype) or "hidden" (cast to the hidden states' dtype)."""
    combine_dtype: str = "router_dtype"
    """What the patched router's weights are (COMBINE_DTYPE): "router_dtype", "router_dtype (fp32
    unpatched too)" or "hidden dtype"."""
    num_experts: str = "num_experts"
    top_k: str = "top_k"

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
    return RoutingSpec(model_type, title, router_class, models, gate_cast="fp32", score="sigmoid",
                       select_bias="e_score_correction_bias", group="top2_sum", sorted_topk=False,
                       renorm="sum_eps", renorm_if="norm_topk_prob", scale="routed_scaling_factor",
                       combine_dtype="router_dtype (fp32 unpatched too)", **kw)


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
    RoutingSpec("deepseek_v2", "DeepSeek-V2", "DeepseekV2TopkRouter",
                "DeepSeek-V2, DeepSeek-V2-Lite, DeepSeek-Coder-V2", gate_cast="fp32",
                group="max", group_mask=0.0, group_if=("topk_method", "group_limited_greedy"),
                sorted_topk=False, scale="routed_scaling_factor",
                combine_dtype="router_dtype (fp32 unpatched too)"),
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
)
"""The supported families, one spec each."""


_NOT_YET = ("not supported yet: its router ({cls}) has not been read into a routing spec; until it "
            "is, patch() refuses the model rather than route it with another family's math")
REFUSED = {
    # Families or features switchyard refuses, with the reason patch() gives.
    "deepseek_v4": "DeepSeek-V4 is not supported yet: its hash-routed layers "
                   "(DeepseekV4HashRouter) pick experts as a function of the token id (no "
                   "logits to compute in fp32, nothing for R3 to replay), and its "
                   "DeepseekV4TopKRouter has not been read into a spec",
    "minimax_m2": "MiniMax-M2 is not supported yet: its MoE block passes the correction bias into "
                  "the router's forward (MiniMaxM2TopKRouter.forward(hidden_states, "
                  "e_score_correction_bias)), which the patched forward does not take",
    "jetmoe": "JetMoE is not supported: JetMoeTopKGating returns expert-sorted groups and the "
              "attention layers route too (mixture of attention heads); neither is a [T, K] "
              "top-k route table",
    "dbrx": _NOT_YET.format(cls="DbrxRouter"),
    "phimoe": "PhiMoE is not supported yet: its sparse mixer (PhimoeTopKRouter) selects with "
              "jittered, masked two-stage sampling in training; not read into a spec",
    "kimi_linear": _NOT_YET.format(cls="KimiLinearTopkRouter, DeepSeek-V3's math; its hybrid "
                                   "linear-attention tiny config is not built in the tests yet"),
    "mimo_v2_flash": _NOT_YET.format(cls="MiMoV2FlashTopkRouter, DeepSeek-V3's math; no tiny "
                                     "config in the tests yet"),
    "glm4v_moe": _NOT_YET.format(cls="Glm4vMoeTextTopkRouter, DeepSeek-V3's math; no tiny config "
                                 "in the tests yet"),
    "qwen3_omni_moe": _NOT_YET.format(cls="Qwen3OmniMoeThinkerTextTopKRouter / "
                                      "Qwen3OmniMoeTalkerTextTopKRouter; no tiny config in the "
                                      "tests yet"),
}
for _pkg, _cls in (
        ("afmoe", "AfmoeTokenChoiceRouter"), ("aria", "AriaTextTopKRouter"),
        ("axk2", "AXK2TopkRouter"),
        ("bailing_hybrid", "BailingHybridTopkRouter"), ("beam", "BeamTopKRouter"),
        ("cohere2_moe", "Cohere2MoeTopKRouter"), ("deepseek_ocr2", "DeepseekOcr2TextTopkRouter"),
        ("diffusion_gemma", "DiffusionGemmaTextRouter"), ("doge", "its router"),
        ("dots3_note", "Dots3NoteTextTopkRouter, Dots3NoteVisionTopKRouter"),
        ("ergo", "ErgoTopkRouter"), ("ernie4_5_vl_moe", "Ernie4_5_VLMoeMoeTopKRouter"),
        ("flint", "FlintTopKRouter"), ("gemma4", "Gemma4TextRouter"),
        ("glm5_next", "Glm5NextTextTopkRouter"), ("granitemoe_swa", "GraniteMoeSWATopKRouter"),
        ("hy_v3", "HYV3TopKRouter"), ("hy_v4_vl", "HYV4VLTopkRouter"),
        ("inkling", "InklingTopkRouter"), ("inkling2", "Inkling2TopKRouter"),
        ("inkling2_loop", "Inkling2LoopTopKRouter"), ("kolibri1", "Kolibri1TopKRouter"),
        ("kolibri1_1", "Kolibri1_1TopKRouter"), ("laguna", "LagunaTopKRouter"),
        ("lara_mini", "LaraMiniTopKRouter"), ("lfm2_moe", "Lfm2MoeTopKRouter"),
        ("longcat_flash", "LongcatFlashTopkRouter"),
        ("minicpm5_moe", "MiniCPM5MoeTopkRouter"), ("minimax_m3_vl", "MiniMaxM3VLTopKRouter"),
        ("mistral_large4", "MistralLarge4TextTopkRouter"), ("muse_spark", "MuseSparkTopkRouter"),
        ("param2moe", "its router"), ("qwen4_exp", "Qwen4ExpTextTopKRouter"),
        ("sarvam_mla", "its router"), ("sarvam_moe", "its router"),
        ("step3p7", "Step3p7TopKRouter"), ("unlimited_ocr", "UnlimitedOcrTextTopkRouter"),
        ("zaya", "ZayaRouter")):
    REFUSED.setdefault(_pkg, _NOT_YET.format(cls=_cls))
"""{transformers.models package: why patch() refuses it} (ValueError before any router is
touched)."""

OUT_OF_SCOPE = {
    "switch_transformers": "encoder-decoder MoE (Switch Transformers): outside RL post-training "
                           "of causal LMs",
    "nllb_moe": "encoder-decoder MoE (NLLB-MoE): outside RL post-training of causal LMs",
    "openai_privacy_filter": "a token classifier, not a causal LM: outside RL post-training",
}
"""{transformers.models package: why it is out of scope} (patch() finds no supported router
there and says so)."""
