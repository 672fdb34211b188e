"""routes.moe_layer_freq_from_config: the MoE / dense pattern of a model's hidden layers read from
its transformers config, the layer map the importers take (a payload over all hidden layers
imported with another family's map would mislabel layers)."""
import pytest

transformers = pytest.importorskip("transformers")

import switchyard.routes as syr  # noqa: E402


def _cfg(name, **kw):
    return getattr(transformers, name)(**kw)


@pytest.mark.parametrize("config, want", [
    # DeepSeek-V3 / GLM-4.5: the first k layers dense
    (lambda: _cfg("DeepseekV3Config", num_hidden_layers=6, first_k_dense_replace=3),
     [0, 0, 0, 1, 1, 1]),
    (lambda: _cfg("Glm4MoeConfig", num_hidden_layers=4, first_k_dense_replace=1), [0, 1, 1, 1]),
    # Qwen3-MoE: mlp_only_layers and the sparse step
    (lambda: _cfg("Qwen3MoeConfig", num_hidden_layers=4, mlp_only_layers=[0]), [0, 1, 1, 1]),
    (lambda: _cfg("Qwen3MoeConfig", num_hidden_layers=4, decoder_sparse_step=2), [0, 1, 0, 1]),
    # Llama 4: every interleave_moe_layer_step-th layer, kept in config.moe_layers
    (lambda: _cfg("Llama4TextConfig", num_hidden_layers=4, interleave_moe_layer_step=2),
     [0, 1, 0, 1]),
    # Mixtral: every layer
    (lambda: _cfg("MixtralConfig", num_hidden_layers=3), [1, 1, 1]),
    # a plain dict with transformers 5's per-layer kinds
    (lambda: {"num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"]},
     [0, 1, 1]),
    (lambda: {"num_hidden_layers": 5, "first_k_dense_replace": 1, "moe_layer_freq": 2},
     [0, 0, 1, 0, 1]),
])
def test_moe_layer_freq_from_config_reads_each_family_pattern(config, want):
    assert syr.moe_layer_freq_from_config(config()) == want


def test_the_map_from_the_config_moves_a_dense_first_payload_to_the_right_layers():
    """vLLM returns every hidden layer (dense ones zero-filled): with the config's map the dense
    layer is dropped; mislabelled as all-MoE, its zeros would be imported as routes."""
    import numpy as np
    cfg = _cfg("DeepseekV3Config", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8)
    a = np.zeros((4, 3, 2), np.uint8)
    a[:, 1:] = [[3, 5], [1, 6]]
    tables, rep = syr.import_vllm_arrays([a], 8, moe_layer_freq=syr.moe_layer_freq_from_config(cfg))
    assert rep["moe_layers"] == [1, 2] and rep["num_zero_rows"] == 0
    assert tables[0][:4].tolist() == a[:, 1:].astype(int).tolist()


def test_a_layer_list_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match=r"mlp_layer_types has 2 entries, expected "
                                         r"num_hidden_layers=3"):
        syr.moe_layer_freq_from_config({"num_hidden_layers": 3,
                                        "mlp_layer_types": ["dense", "sparse"]})
    with pytest.raises(ValueError, match=r"num_hidden_layers must be an int >= 1, got None"):
        syr.moe_layer_freq_from_config({})
