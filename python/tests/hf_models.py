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


def config(model_type, **overrides):
    from transformers import AutoConfig
    args = dict(COMMON)
    args.update(CONFIGS[model_type])
    args.update(overrides)
    return AutoConfig.for_model(model_type, **args)


def _randomise_router_state(model, gen):
    # Biases initialise to 0; give the correction biases (selection-only) and the routers' weights
    # real values so that every branch of the routing math matters.
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "e_score_correction_bias" in name:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
            elif name.endswith("router.bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)


def build(model_type, dtype=torch.float32, seed=0, **overrides):
    """A seeded tiny causal LM of `model_type` in `dtype`, eval mode, eager attention."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = config(model_type, **overrides)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg)
    _randomise_router_state(model, torch.Generator().manual_seed(seed + 1))
    return model.to(dtype).eval()


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
