"""switchyard.torch: drop-in autograd pieces for PyTorch training stacks.

    import switchyard.torch as syt
    logits = syt.router_gating_linear(x, weight, bias=None, router_dtype=torch.float32)

Tensors cross into the engine without copies when they are contiguous CPU tensors; other layouts are
made contiguous once. A CUDA tensor or a wrong dtype raises ValueError naming the argument.
"""
import torch

from . import _switchyard as _C

__all__ = ["router_gating_linear"]


def _no_autocast():
    # The engine computes in the dtypes it is given; autocast must not re-cast anything around it.
    return torch.autocast(device_type="cpu", enabled=False)


# --------------------------------------------------------------------------------------------------
# Router gate
# --------------------------------------------------------------------------------------------------
class _RouterGatingLinear(torch.autograd.Function):
    """logits = x·Wᵀ (+ b) accumulated and returned in router_dtype (fp32 or fp64), whatever the
    dtypes of x and W; gradients come back in the inputs' dtypes (Megatron-Core's
    RouterGatingLinearFunction contract)."""

    @staticmethod
    def forward(ctx, x, weight, bias, router_dtype):
        with _no_autocast():
            lead = x.shape[:-1]
            x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
            logits = _C.router_gating_linear(x2, weight, bias, router_dtype)
        ctx.save_for_backward(x2, weight, bias)
        ctx.router_dtype = router_dtype
        ctx.lead = lead
        return logits.view(*lead, logits.shape[-1])

    @staticmethod
    def backward(ctx, grad_logits):
        x2, weight, bias = ctx.saved_tensors
        with _no_autocast():
            g = grad_logits.reshape(-1, grad_logits.shape[-1]).to(ctx.router_dtype)
            grad_x, grad_w, grad_b = _C.router_gating_linear_backward(
                g, x2, weight, bias, ctx.router_dtype)
        grad_x = grad_x.view(*ctx.lead, x2.shape[-1]) if ctx.needs_input_grad[0] else None
        grad_w = grad_w if ctx.needs_input_grad[1] else None
        grad_b = grad_b.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def router_gating_linear(x, weight, bias=None, router_dtype=torch.float32):
    """The router gate: ``logits = x @ weight.T (+ bias)`` in ``router_dtype``.

    x [..., H] bf16/fp32 (fp64 with router_dtype fp64); weight [E, H] bf16/fp32; bias [E] or None,
    applied in the forward. Returns [..., E] in router_dtype (torch.float32 or torch.float64), also
    under torch.autocast. Backward: grad_x in x's dtype, grad_weight in weight's dtype, grad_bias in
    bias's dtype, all accumulated in router_dtype in a fixed order (deterministic, batch invariant).
    """
    if router_dtype not in (torch.float32, torch.float64):
        raise ValueError("[router_gating_linear] router_dtype must be torch.float32 or "
                         f"torch.float64, got {router_dtype}")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"[router_gating_linear] x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("[router_gating_linear] x must be [..., hidden], got a 0-d tensor")
    return _RouterGatingLinear.apply(x, weight, bias, router_dtype)
