"""tests/common/model_shapes.h (read through bench/model_shapes.py) against a second source: the
transformers config classes, whose defaults are DeepSeek-V3's and Mixtral-8x7B's published
configs, and Qwen3-MoE's apart from the layer count and norm_topk_prob (the 30B-A3B checkpoint has
48 layers and norm_topk_prob true; the class defaults to 24 and false)."""
import importlib.util
import pathlib
import sys

import pytest

transformers = pytest.importorskip("transformers")

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "model_shapes.py"
_spec = importlib.util.spec_from_file_location("model_shapes", _BENCH)
model_shapes = importlib.util.module_from_spec(_spec)
sys.modules["model_shapes"] = model_shapes  # dataclasses look their module up there
_spec.loader.exec_module(model_shapes)


def test_deepseek_v3_shape_is_its_published_config():
    m, c = model_shapes.DEEPSEEK_V3, transformers.DeepseekV3Config()
    assert (m.hidden, m.moe_ffn_hidden, m.num_experts, m.top_k) == (
        c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok)
    assert (m.num_groups, m.group_topk, m.topk_scaling_factor) == (
        c.n_group, c.topk_group, c.routed_scaling_factor)
    assert m.num_shared_experts == c.n_shared_experts
    assert m.shared_expert_ffn_hidden == c.n_shared_experts * c.moe_intermediate_size
    assert (m.num_layers, m.num_moe_layers) == (
        c.num_hidden_layers, c.num_hidden_layers - c.first_k_dense_replace)
    assert (m.score_function, m.expert_bias) == ("sigmoid", True)


def test_mixtral_8x7b_shape_is_its_published_config():
    m, c = model_shapes.MIXTRAL_8X7B, transformers.MixtralConfig()
    assert (m.hidden, m.moe_ffn_hidden, m.num_experts, m.top_k, m.num_layers) == (
        c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
        c.num_hidden_layers)
    assert (m.score_function, m.num_groups, m.num_shared_experts) == ("softmax", 0, 0)


def test_qwen3_30b_a3b_shape_is_its_published_config():
    m, c = model_shapes.QWEN3_30B_A3B, transformers.Qwen3MoeConfig()
    assert (m.hidden, m.moe_ffn_hidden, m.top_k, m.aux_loss_coeff) == (
        c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok, c.router_aux_loss_coef)
    assert m.num_experts == getattr(c, "num_experts", getattr(c, "num_local_experts", None))
    assert (m.num_layers, m.num_moe_layers, m.score_function) == (48, 48, "softmax")


def test_every_model_routes_with_its_own_router_options():
    sy = pytest.importorskip("switchyard")
    for m in model_shapes.MODELS.values():
        cfg = sy.RouterConfig(**m.router_options())
        assert (cfg.num_experts, cfg.top_k) == (m.num_experts, m.top_k)
