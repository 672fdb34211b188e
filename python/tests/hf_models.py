"""Tiny randomly initialised transformers MoE models of every family switchyard.integrations.hf
supports, built from a config on the CPU (no download): hidden 32, 2-3 decoder layers, 8 experts."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, head_dim=8,
              pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)

# model_type -> config arguments. DeepSeek-V3 / GLM4-MoE keep their first layer dense, so the MoE
# layers are not numbered from 0 (what replay must key by); Qwen3-Next mixes linear attention in.
CONFIGS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.1),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                        n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16,
                        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        num_hidden_layers=3, num_key_value_heads=4),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                     n_group=2, topk_group=1, first_k_dense_replace=1, num_hidden_layers=3,
                     routed_scaling_factor=1.5, norm_topk_prob=True),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2,
                    layer_types=["full_attention", "sliding_attention"], sliding_window=16),
    "qwen3_next": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                       layer_types=["linear_attention", "full_attention"]),
    "llama4_text": dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size_mlp=64,
                        interleave_moe_layer_step=1),
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=16,
                         moe_layer_start_index=0),
    "hunyuan_v1_moe": dict(num_experts=8, moe_topk=2, moe_intermediate_size=16),
}
FAMILIES = list(CONFIGS)
"""The families the end-to-end tests (test_hf_patch.py, test_hf_replay.py) run on."""

_DSV3 = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_group=4,
             topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
             norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=3, num_key_value_heads=4)
_QWEN = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
MORE_CONFIGS = {
    # DeepSeek-V3's router under other names (the configs take DeepSeek-V3's arguments)
    "deepseek_v32": dict(_DSV3),
    "glm4_moe_lite": dict(_DSV3),
    "glm_moe_dsa": dict(_DSV3),
    "dots1": dict(_DSV3),
    "exaone_moe": dict(_DSV3),
    "solar_open": dict(_DSV3, first_k_dense_replace=0),
    "nemotron_h": dict(_DSV3),
    "axk1": dict(_DSV3),
    "hy_v4": dict(_DSV3),
    # DeepSeek-V2 (group-limited greedy: group score = max, others 0) and Mistral-4 (softmax,
    # group score = top-2 sum, others 0)
    "deepseek_v2": dict(_DSV3, topk_method="group_limited_greedy"),
    "mistral4": dict(_DSV3, qk_rope_head_dim=4),
    # softmax over all experts
    "qwen3_5_moe": dict(_QWEN, shared_expert_intermediate_size=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                        layer_types=["linear_attention", "full_attention"]),
    "qwen3_vl_moe": dict(_QWEN),
    "flex_olmo": dict(_QWEN),
    "mellum": dict(_QWEN),
    "minimax": dict(num_local_experts=8, num_experts_per_tok=2),
    "jamba": dict(_QWEN, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1,
                  expert_layer_offset=0, mamba_d_state=4, mamba_dt_rank=4, mamba_expand=2),
    # top-k of the logits, softmax over the K selected
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2),
    "granitemoeshared": dict(num_local_experts=8, num_experts_per_tok=2,
                             shared_intermediate_size=16),
    "granitemoehybrid": dict(num_local_experts=8, num_experts_per_tok=2,
                             layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_n_groups=1, mamba_d_state=8, shared_intermediate_size=16),
    # DeepSeek-V3's router under more names
    "kimi_linear": dict(_DSV3, num_experts=8, linear_num_heads=2, linear_head_dim=8,
                        layer_types=["full_attention", "linear_attention", "full_attention"]),
    "minicpm5_moe": dict(_DSV3),
    "axk2": dict(_DSV3),
    "beam": dict(_QWEN, n_group=4, topk_group=2, mlp_layer_types=["dense", "sparse"]),
    # sigmoid + correction bias (held, or passed in by the block)
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2),
    "minimax_m3_vl": dict(num_local_experts=8, num_experts_per_tok=2),
    "hy_v3": dict(num_local_experts=8, num_experts_per_tok=2),
    "afmoe": dict(_QWEN),
    "lfm2_moe": dict(_QWEN, use_expert_bias=True, num_dense_layers=1,
                     layer_types=["conv", "full_attention"]),
    "laguna": dict(_QWEN, moe_router_logit_softcapping=3.0),
    "ergo": dict(_QWEN),
    "flint": dict(_QWEN, mlp_only_layers=[0]),
    "deepseek_v4": dict(num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=3,
                        mlp_layer_types=["hash_moe", "moe", "moe"]),
    "inkling2": dict(num_local_experts=8, num_experts_per_tok=2),
    "kolibri1_1": dict(_QWEN, layer_types=["sliding_attention", "sliding_attention"],
                       sliding_window=16, index_layers=[], kv_source_layers=[0, 1],
                       head_dim=16, index_num_heads=1, mlp_only_layers=[0]),
    "kolibri1": dict(_QWEN),
    # softmax
    "qwen3_omni_moe": dict(_QWEN),
    "bailing_hybrid": dict(_DSV3, num_experts=8, layer_types=["full_attention", "linear_attention",
                                               "full_attention"]),
    "lara_mini": dict(_QWEN),
    "mistral_large4": dict(_DSV3, qk_rope_head_dim=4),
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=128,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=16, moe_num_experts=8, moe_top_k=2,
                                 moe_normalize_expert_weights=1.0)),
    "aria": dict(moe_num_experts=8, moe_topk=2),
    "granitemoe_swa": dict(num_local_experts=8, num_experts_per_tok=2),
    # DeepSeek-V3's router in newer families (MiMo: SWA layers double the KV heads, partial RoPE;
    # GLM-4.5V / Hy4-VL: 3-axis mRoPE; GLM-5.3: hyper-connections, NoPE DSA + linear attention)
    "mimo_v2_flash": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                          n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                          num_hidden_layers=3, v_head_dim=8, sliding_window=16,
                          rope_parameters={t: dict(rope_type="default", rope_theta=10000.0,
                                                   partial_rotary_factor=0.5)
                                           for t in ("full_attention", "sliding_attention")}),
    "glm4v_moe": dict(_DSV3, head_dim=16,
                      rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                           mrope_section=[2, 1, 1], partial_rotary_factor=0.5)),
    "glm5_next": dict(_DSV3, qk_rope_head_dim=0, mlp_layer_types=["dense", "sparse", "sparse"],
                      layer_types=["linear_attention", "indexed_attention", "linear_attention"],
                      index_topk=4, index_head_dim=8, index_n_heads=2, index_kpool=2,
                      linear_head_dim=8, linear_num_heads=4, hc_mult=2),
    "hy_v4_vl": dict(_DSV3, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                 mrope_section=[2, 1, 1])),
    # Qwen3-MoE's router (Qwen4-Exp: hyper-connections, gated delta net + QSA-indexed attention)
    "qwen4_exp": dict(_QWEN, shared_expert_intermediate_size=16, hc_lowrank=8,
                      layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                      indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                      indexer_compress_ratio=2),
    # MiniMax-M3-VL's router; the block scales the experts' output
    "step3p7": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                    share_expert_dim=16, num_hidden_layers=3, sliding_window=16,
                    mlp_layer_types=["dense", "sparse", "sparse"], moe_router_scaling_factor=2.0),
    # sigmoid + correction bias of the logits × output_multiplier (its default 0.177)
    "muse_spark": dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_hidden_size=16, routed_scaling_factor=2.5),
    # DeepSeek-V2's router: group-limited greedy in one, greedy (the configs' default) in the other
    "deepseek_ocr2": dict(_DSV3, topk_method="group_limited_greedy",
                          mlp_layer_types=["dense", "sparse", "sparse"]),
    "unlimited_ocr": dict(_DSV3, mlp_layer_types=["dense", "sparse", "sparse"]),
    # Gemma-4: the MoE block beside the dense MLP in every layer (enable_moe_block), no per-layer
    # input embeddings; DiffusionGemma's encoder text stack (its decoder's layers are the same)
    "gemma4": dict(enable_moe_block=True, num_experts=8, top_k_experts=2,
                   moe_intermediate_size=16, hidden_size_per_layer_input=0,
                   layer_types=["sliding_attention", "full_attention"], sliding_window=16),
    "diffusion_gemma": dict(num_experts=8, top_k_experts=2, moe_intermediate_size=16,
                            layer_types=["sliding_attention", "full_attention"],
                            sliding_window=16),
    # Cohere2-MoE, both score functions of config.expert_selection_fn
    "cohere2_moe": dict(num_experts=8, num_experts_per_tok=2, expert_selection_fn="softmax"),
    "cohere2_moe_sigmoid": dict(num_experts=8, num_experts_per_tok=2,
                                expert_selection_fn="sigmoid", norm_topk_prob=True),
    # LongCat-Flash: 8 routed + 4 zero-compute experts; two decoder layers (num_hidden_layers
    # counts the two attention sublayers of each); wider router init so that the scores, not the
    # correction bias alone, pick the experts
    "longcat_flash": dict(n_routed_experts=8, zero_expert_num=4, moe_topk=2,
                          expert_ffn_hidden_size=16, kv_lora_rank=16, q_lora_rank=16,
                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                          num_key_value_heads=4, num_hidden_layers=4, initializer_range=0.2),
    # dots3-note's text model (DeepSeek-V3's router)
    "dots3_note": dict(_DSV3),
    # ERNIE-4.5-VL-MoE's text model: text and vision expert sets in every MoE layer
    "ernie4_5_vl_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=[16, 16],
                            moe_num_shared_experts=1,
                            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                 mrope_section=[1, 1, 2])),
    # JetMoE: 8 MLP experts and 8 attention experts (a router each, both patched); wider
    # init so that the router's logits have margins
    "jetmoe": dict(num_local_experts=8, num_experts_per_tok=2, kv_channels=8,
                   initializer_range=0.2),
    # Inkling: 8 routed + 2 shared experts (the shared ones' weights normalised with the routed
    # slots'); wider init so that the scores, not the correction bias alone, pick the experts
    "inkling": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                    moe_intermediate_size=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                    swa_head_dim=8, sliding_window_size=16, rel_extent=16, d_rel=4,
                    initializer_range=0.2),
    # Inkling2-Loop: layers 1 and 2 (one sliding, one full attention) looped in 3 passes per
    # forward, so 4 decoder layers route 8 times (route layers 0, 1-2, 3-4, 5-6, 7)
    "inkling2_loop": dict(num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
                          layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid",
                                       "hybrid_sliding"],
                          n_layers_per_attn_res_block=1, loop_layer_index_start=1,
                          loop_layer_index_end=3, loop_num_passes=3, loop_gate_rank=8,
                          unpadded_vocab_size=97, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=16,
                          rel_extent=16, d_rel=4, initializer_range=0.2),
    # Zaya: 8 experts + the skip class, top-1 (its only K), an MLP router over a 16-wide
    # down-projection, the router state carried from layer 0 to layer 1
    "zaya": dict(num_experts=8, num_experts_per_tok=1, moe_intermediate_size=16,
                 router_hidden_size=16, initializer_range=0.2),
    # Doge: the CDMoE block (is_moe) in every layer, product keys over 4 sub-keys (16 experts),
    # K = 2; not renormalised (the family's default: with norm_topk_prob=True transformers' block
    # divides its softmax's output in place, which its backward needs, so it does not train)
    "doge": dict(is_moe=True, num_experts=16, num_experts_per_tok=2),
}
"""Tiny configs of the other supported families (test_hf_families.py)."""
ALL_FAMILIES = FAMILIES + list(MORE_CONFIGS)
_CONFIG_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_vl_moe": "qwen3_vl_moe_text",
                "glm4v_moe": "glm4v_moe_text", "glm5_next": "glm5_next_text",
                "hy_v4_vl": "hy_v4_vl_text", "minimax_m3_vl": "minimax_m3_vl_text",
                "muse_spark": "muse_spark_text", "inkling2": "inkling2_text",
                "qwen3_omni_moe": "qwen3_omni_moe_text", "qwen4_exp": "qwen4_exp_text",
                "mistral_large4": "mistral_large4_text", "deepseek_ocr2": "deepseek_ocr2_text",
                "unlimited_ocr": "unlimited_ocr_text", "aria": "aria_text",
                "gemma4": "gemma4_text", "diffusion_gemma": "diffusion_gemma_text",
                "cohere2_moe_sigmoid": "cohere2_moe", "dots3_note": "dots3_note_text",
                "ernie4_5_vl_moe": "ernie4_5_vl_moe_text", "inkling": "inkling_text",
                "inkling2_loop": "inkling2_loop_text"}
"""The config model_type of a family's text model, where it is not the family's key."""
_MODEL_CLASS = {"qwen3_omni_moe": "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe."
                                  "Qwen3OmniMoeThinkerTextModel",
                "deepseek_ocr2": "transformers.models.deepseek_ocr2.modeling_deepseek_ocr2."
                                 "DeepseekOcr2TextModel",
                "unlimited_ocr": "transformers.models.unlimited_ocr.modeling_unlimited_ocr."
                                 "UnlimitedOcrTextModel",
                "step3p7": "transformers.models.step3p7.modeling_step3p7.Step3p7TextModel",
                "diffusion_gemma": "transformers.models.diffusion_gemma.modeling_diffusion_gemma."
                                   "DiffusionGemmaEncoderTextModel",
                "ernie4_5_vl_moe": "transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe."
                                   "Ernie4_5_VLMoeTextModel"}
"""The text model's class, where no Auto class builds it from its config."""
_CONFIG_CLASS = {"step3p7": "transformers.models.step3p7.configuration_step3p7.Step3p7TextConfig"}
"""The text config's class, where no Auto class maps a model_type to it (Step-3.7's text config
says model_type "step3p5", which transformers does not register)."""
_KEEP_FP32 = {"inkling2_loop"}
"""Families whose forward needs the modules of ``_keep_in_fp32_modules_strict`` in fp32 (kept so
by from_pretrained; Inkling2-Loop's message gates compute in fp32): build() restores them to fp32
after casting the model."""
VARIANT_OF = {"cohere2_moe_sigmoid": "cohere2_moe"}
"""A test model that is another configuration of a family: {its key: the family's}."""


def config(model_type, **overrides):
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if _CONFIG_TYPE.get(model_type, model_type) not in CONFIG_MAPPING_NAMES:
        import pytest  # a family a later transformers release added (ergo, kolibri1_1, ...)
        pytest.skip(f"{model_type} is not in transformers {transformers.__version__}")
    args = dict(COMMON)
    args.update(CONFIGS[model_type] if model_type in CONFIGS else MORE_CONFIGS[model_type])
    args.update(overrides)
    if model_type in _CONFIG_CLASS:
        import importlib
        mod, _, cls = _CONFIG_CLASS[model_type].rpartition(".")
        return getattr(importlib.import_module(mod), cls)(**args)
    return AutoConfig.for_model(_CONFIG_TYPE.get(model_type, model_type), **args)


def _randomise_router_state(model, gen):
    # Biases initialise to 0; give the correction biases (selection-only) and the routers' weights
    # real values so that every branch of the routing math matters.
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "e_score_correction_bias" in name:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
            elif "router" in name and name.endswith("weight") and not t.abs().sum():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)  # AFMoE's gate starts at 0
            elif name.endswith("expert_bias"):  # AFMoE, LFM2-MoE: held by the block
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash layers: K distinct experts
                E = model.config.get_text_config().num_local_experts
                t.copy_(torch.stack([torch.randperm(E, generator=gen)[:t.shape[1]]
                                     for _ in range(t.shape[0])]))
            elif name.endswith("router.bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
            elif name.endswith("balancing_biases"):  # Zaya: 0 (the skip class -1) at init;
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)  # the skip class at 0.02
                t[-1] = 0.02  # so that the tests route some tokens to it
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma-4: ones
                t.copy_(1.0 + torch.randn(t.shape, generator=gen) * 0.2)


def build(model_type, dtype=torch.float32, seed=0, **overrides):
    """A seeded tiny causal LM (or text model) of `model_type` in `dtype`, eval mode, eager
    attention."""
    from transformers import AutoModel, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = config(model_type, **overrides)
    cfg._attn_implementation = "eager"
    try:
        if model_type in _MODEL_CLASS:  # a text model no Auto class maps its config to
            import importlib
            mod, _, cls = _MODEL_CLASS[model_type].rpartition(".")
            model = getattr(importlib.import_module(mod), cls)(cfg)
        else:
            model = AutoModelForCausalLM.from_config(cfg)
    except ValueError:  # a text backbone without a causal-LM head class (Qwen3-VL-MoE, Mistral-4)
        model = AutoModel.from_config(cfg)
    _randomise_router_state(model, torch.Generator().manual_seed(seed + 1))
    model = model.to(dtype).eval()
    if model_type in _KEEP_FP32:  # what from_pretrained does for the family
        import re
        keep = [re.compile(rf"(^|\.){re.escape(k)}(\.|$)")
                for k in model._keep_in_fp32_modules_strict]
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and any(k.search(name) for k in keep):
                t.data = t.data.float()
    return model


def tokens(batch, seq, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, seq), generator=g)


def router_of(model, patch, layer):
    return model.get_submodule(patch.modules[layer])


def unpack(family, out):
    """(logits, weights, ids or None) from a router's return value (Llama-4 returns dense scores
    [T, E] and the logits)."""
    if family == "llama4_text":
        return out[1], out[0], None
    return out[0], out[1], out[2]


def check_generate_with_a_compiled_forward(family, backend_name):
    """generate() of a patched fp32-router model whose decode steps transformers compiles itself
    (static cache + compile_config, fullgraph, dynamo backend ``backend_name``) equals eager's:
    tokens, the captured ids of every forward, and the counts."""
    import switchyard.integrations.hf as syhf
    from transformers import CompileConfig
    eager_model, model = build(family), build(family)
    pe = syhf.patch(eager_model, router_dtype=torch.float32)
    pc = syhf.patch(model, router_dtype=torch.float32)
    graphs = []

    def backend(gm, example_inputs, **options):  # counting (options: CompileConfig's)
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend_name)(gm, example_inputs)

    cfg = CompileConfig(fullgraph=True, backend=backend)
    cfg._compile_all_devices = True  # transformers compiles on accelerators only by default
    model.generation_config.compile_config = cfg
    x = tokens(2, 7)
    kw = dict(max_new_tokens=5, do_sample=False, cache_implementation="static")
    with pe.capture() as ce:
        out_e = eager_model.generate(x, **kw)
    with pc.capture() as cc:
        out_c = model.generate(x, **kw)
    assert graphs  # the decode steps ran the compiled forward
    assert torch.equal(out_c, out_e)
    assert cc.num_forwards == 5
    assert torch.equal(cc.ids(), ce.ids())
    assert pc.counts() == pe.counts()
