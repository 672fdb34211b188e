"""The inference engine's fused-kernel numerics on a transformers model (the rollout side only).

Inference servers do not run transformers' modules: they run fused kernels that keep the
intermediate math in fp32 and round once (vLLM's ``rms_norm`` / ``fused_add_rms_norm`` multiply by
the weight in fp32 before the single cast; its ``silu_and_mul`` computes silu(gate) * up in fp32).
transformers' modules, which the trainer runs, round to bf16 in between (the normalised states
before the weight multiply; silu(gate) before the product). ``engine_kernels(model)`` installs
those two fused formulas on the module instances (RMSNorm, the dense MLP, the experts' gating),
written as the kernels compute them, and removes them on exit. Weights, routers and attention are
untouched (the engine's attention is sdpa, its experts grouped_mm, chosen by the caller)."""
import contextlib

import torch
import torch.nn.functional as F


def _rms_norm(mod):
    def forward(hidden_states):
        x = hidden_states.float()
        var = x.pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(var + mod.variance_epsilon) * mod.weight.float()).to(
            hidden_states.dtype)
    return forward


def _silu_and_mul(gate, up):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _mlp(mod):
    def forward(x):
        return mod.down_proj(_silu_and_mul(mod.gate_proj(x), mod.up_proj(x)))
    return forward


def _apply_gate(gate_up_out):
    gate, up = gate_up_out.chunk(2, dim=-1)
    return _silu_and_mul(gate, up)


@contextlib.contextmanager
def engine_kernels(model: torch.nn.Module):
    """Within the context, the model's RMSNorms, dense MLPs and experts' gating compute as the
    engine's fused kernels do (fp32 inside, one rounding). Yields the number of modules changed."""
    installed = []
    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):
            mod.forward = _rms_norm(mod)
            installed.append((mod, "forward"))
        elif name.endswith("MLP") and hasattr(mod, "gate_proj") and hasattr(mod, "up_proj"):
            mod.forward = _mlp(mod)
            installed.append((mod, "forward"))
        elif name.endswith("Experts") and hasattr(mod, "gate_up_proj"):
            mod._apply_gate = _apply_gate
            installed.append((mod, "_apply_gate"))
    try:
        yield len(installed)
    finally:
        for mod, attr in installed:
            mod.__dict__.pop(attr, None)
