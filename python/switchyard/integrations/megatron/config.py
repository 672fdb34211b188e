"""switchyard.integrations.megatron.config: Megatron-Core's TransformerConfig -> switchyard's router
options (``router_config``, ``topk_router_kwargs``, ``topk_router``), the moe_router_dtype map,
and the engine="cpu" gate. See the package docstring."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

import switchyard as _sy
import switchyard.torch as _syt


# --------------------------------------------------------------------------------------------------
# Megatron-Core's TransformerConfig -> switchyard's router options
# --------------------------------------------------------------------------------------------------
# moe_router_dtype -> the router dtype of switchyard's gate; None is the input's dtype, as in
# Megatron's Router.gating. The one map of topk_router_kwargs and the engine="cpu" gate.
_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


def _router_dtype(config: Any) -> torch.dtype | None:
    if config.moe_router_dtype not in _ROUTER_DTYPES:
        raise ValueError("[megatron.router_config] moe_router_dtype must be None, 'fp32' or "
                         f"'fp64', got {config.moe_router_dtype!r}")
    return _ROUTER_DTYPES[config.moe_router_dtype]


def topk_options(config: Any) -> dict[str, Any]:
    """Megatron's top-k selection and weight options under switchyard's names: the one option map
    of ``router_config`` and of the engine="cpu" routing (which leaves capacity, aux losses and
    the expert bias to Megatron's own functions).

    Args:
        config: Megatron's TransformerConfig (or any object with its attributes).

    Returns:
        dict of RouterConfig keyword arguments.
    """
    return dict(num_experts=config.num_moe_experts, top_k=config.moe_router_topk,
                score_function=config.moe_router_score_function,
                pre_softmax=bool(config.moe_router_pre_softmax),
                num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
                topk_scaling_factor=config.moe_router_topk_scaling_factor)


def router_config(config: Any, *, is_mtp_layer: bool = False) -> _sy.RouterConfig:
    """A ``switchyard.RouterConfig`` with every router option switchyard has, read from Megatron-Core's
    ``TransformerConfig`` under its names: num_moe_experts, moe_router_topk,
    moe_router_score_function, moe_router_pre_softmax, moe_router_num_groups /
    moe_router_group_topk, moe_router_topk_scaling_factor, moe_expert_capacity_factor,
    moe_token_drop_policy, moe_pad_expert_input_to_capacity, moe_router_load_balancing_type and
    moe_aux_loss_coeff (a name or lists; "sinkhorn" and "quantile_balancing" take no coefficient,
    "none" entries are dropped), moe_z_loss_coeff, calculate_per_token_loss, the MTP options
    (``is_mtp_layer`` is the router's constructor argument; mtp_use_repeated_layer,
    mtp_num_layers), moe_router_force_load_balancing, moe_router_force_biased and
    moe_router_padding_for_quantization / moe_router_padding_for_fp8 (the alignment from
    Megatron's own get_align_size_for_quantization). The options that live on the router module
    (moe_router_dtype, moe_input_jitter_eps, moe_router_enable_expert_bias,
    moe_router_quantile_balancing_ema) are in ``topk_router_kwargs``. ``config``: any object with
    those attributes. ValueError (the engine's, naming the switchyard option) for a value the
    engine refuses.

    Args:
        config: Megatron's TransformerConfig (or any object with its attributes).
        is_mtp_layer: whether the router is an MTP layer's.

    Returns:
        switchyard.RouterConfig.

    Raises:
        ValueError: the engine's, naming the switchyard option.
    """
    lb, coeff = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    kw: dict[str, Any] = {}
    if isinstance(lb, (list, tuple)):
        coeffs = coeff if isinstance(coeff, (list, tuple)) else [coeff] * len(lb)
        pairs = [(t, float(c)) for t, c in zip(lb, coeffs) if t != "none"]
        if len(pairs) == 1 and pairs[0][0] in ("sinkhorn", "quantile_balancing"):
            kw.update(aux_loss_type=pairs[0][0])
        elif pairs:
            kw.update(aux_loss_type=[t for t, _ in pairs], aux_loss_coeff=[c for _, c in pairs])
    elif lb in ("sinkhorn", "quantile_balancing"):
        kw.update(aux_loss_type=lb)  # Megatron ignores moe_aux_loss_coeff there
    elif lb not in (None, "none"):
        kw.update(aux_loss_type=lb, aux_loss_coeff=float(coeff))
    padding = bool(config.moe_router_padding_for_quantization or config.moe_router_padding_for_fp8)
    if padding:
        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
        kw.update(padding_for_quantization=True,
                  padding_align_size=int(get_align_size_for_quantization(config)))
    return _sy.RouterConfig(
        **topk_options(config),
        capacity_factor=config.moe_expert_capacity_factor,
        token_drop_policy=config.moe_token_drop_policy,
        pad_to_capacity=bool(config.moe_pad_expert_input_to_capacity),
        z_loss_coeff=float(config.moe_z_loss_coeff or 0.0),
        calculate_per_token_loss=bool(config.calculate_per_token_loss),
        is_mtp_layer=bool(is_mtp_layer),
        mtp_use_repeated_layer=bool(getattr(config, "mtp_use_repeated_layer", False)),
        mtp_num_layers=getattr(config, "mtp_num_layers", None),
        force_load_balancing=bool(config.moe_router_force_load_balancing),
        force_biased=config.moe_router_force_biased, **kw)


def topk_router_kwargs(config: Any) -> dict[str, Any]:
    """The ``switchyard.torch.TopKRouter`` keyword arguments that Megatron keeps on its router
    module: router_dtype (moe_router_dtype None / "fp32" / "fp64"), bias (add_bias_linear),
    params_dtype, enable_expert_bias (moe_router_enable_expert_bias), input_jitter_eps
    (moe_input_jitter_eps). moe_router_bias_update_rate and moe_router_quantile_balancing_ema are
    arguments of ``update_expert_bias(rate)`` / ``update_qb_beta(ema)``: pass
    ``config.moe_router_bias_update_rate`` / ``config.moe_router_quantile_balancing_ema``.
    Returns a dict; ValueError for a moe_router_dtype other than None, "fp32" or "fp64".

    Args:
        config: Megatron's TransformerConfig (or any object with its attributes).

    Returns:
        dict of TopKRouter keyword arguments.

    Raises:
        ValueError: for a moe_router_dtype other than None, "fp32" or "fp64".
    """
    return dict(router_dtype=_router_dtype(config),
                bias=bool(config.add_bias_linear), params_dtype=config.params_dtype,
                enable_expert_bias=bool(config.moe_router_enable_expert_bias),
                input_jitter_eps=config.moe_input_jitter_eps)


def topk_router(router: Any, **kwargs: Any) -> _syt.TopKRouter:
    """A ``switchyard.torch.TopKRouter`` equivalent to a Megatron-Core ``TopKRouter``: its config
    mapped by ``router_config`` / ``topk_router_kwargs``, and a copy of its state (weight, bias,
    expert bias and its token counts, qb_beta and its accumulators, layer number). ``kwargs`` go to
    TopKRouter (e.g. loss_comm=, global_aux_loss_comm= for Megatron's tp_cp / tp_dp_cp groups).
    The copy is independent of ``router`` (its parameters are new tensors). ValueError as
    ``router_config`` / ``topk_router_kwargs``.

    Args:
        router: a Megatron-Core TopKRouter.
        **kwargs: more TopKRouter keyword arguments (they win over the mapped ones).

    Returns:
        switchyard.torch.TopKRouter.

    Raises:
        ValueError: as ``router_config`` / ``topk_router_kwargs``.
    """
    cfg = router.config
    kw = topk_router_kwargs(cfg)
    kw.update(kwargs)
    s = _syt.TopKRouter(cfg.hidden_size,
                        router_config(cfg, is_mtp_layer=getattr(router, "is_mtp_layer", False)),
                        layer_number=router.layer_number, **kw)
    with torch.no_grad():
        s.weight.copy_(router.weight)
        # Each group of state is copied when both routers hold its first tensor.
        for group in (("bias",), ("expert_bias", "local_tokens_per_expert"),
                      ("qb_beta", "qb_beta_accum", "qb_beta_count")):
            if getattr(s, group[0]) is not None and getattr(router, group[0], None) is not None:
                for name in group:
                    getattr(s, name).copy_(getattr(router, name))
    return s


def make_engine_gating(orig: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper ``apply()`` installs over Megatron-Core's Router.gating, switchyard's FP32
    gate on CPU tensors of attached routers.

    Args:
        orig: the original function.

    Returns:
        The wrapper (functools.wraps of ``orig``).
    """
    @functools.wraps(orig)
    def gating(self: Any, input: torch.Tensor) -> torch.Tensor:
        st = getattr(self, "_sy", None)
        if st is None or input.is_cuda or self.weight.is_cuda:
            return orig(self, input)
        return _syt._router_logits(input, self.weight, self.bias, _router_dtype(self.config))
    return gating
