"""switchyard's tensor operations as torch.library operators (``torch.ops.switchyard.*``).

Each operator has a kernel (the engine, through the pybind bindings), a fake kernel (shapes and
dtypes only, for torch.compile, torch.export and FakeTensor), and, where it is differentiable, its
backward registered with it (the backward is itself an operator, so a compiled graph holds both).
Python ``torch.library.custom_op`` over the existing bindings, not C++ ``TORCH_LIBRARY``: the
extension stays independent of torch's C++ ABI (one wheel for every torch release); the cost is a
Python frame per call in eager mode, none inside a compiled graph's hot loop beyond the kernel call
(see docs/design.md, "Operators").

The kernels are registered for every device: on a device the engine was not built for, the
bindings raise their ValueError naming the argument. A device backend registers its own kernel
with ``torch.ops.switchyard.<op>`` 's ``register_kernel("cuda", fn)``
(``router_gating_linear.register_kernel``) without changing the operator or its callers.

The public functions (switchyard.torch.router_gating_linear, input_jitter, permute, unpermute)
validate their arguments and call these operators; use those.
"""
import itertools
import weakref

import torch
from torch import Tensor

from . import _switchyard as _C

__all__ = ["router_gating_linear", "router_gating_linear_backward", "input_jitter", "route_sink",
           "add_route_sink", "route_sink_owner", "OPERATORS"]


def _no_autocast():
    # The engine computes in the dtypes it is given; autocast must not re-cast anything around it.
    return torch.autocast(device_type="cpu", enabled=False)


# --------------------------------------------------------------------------------------------------
# Router gate: logits [T, E] = x [T, H] · weight [E, H]ᵀ (+ bias [E]) in router_dtype.
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("switchyard::router_gating_linear", mutates_args=())
def router_gating_linear(x: Tensor, weight: Tensor, bias: Tensor | None,
                         router_dtype: torch.dtype) -> Tensor:
    """x [T, H] bf16/fp32 (fp64 with router_dtype fp64), weight [E, H], bias [E] or None ->
    logits [T, E] in router_dtype (torch.float32 / torch.float64). Deterministic and batch
    invariant (the engine's fixed accumulation order)."""
    with _no_autocast():
        return _C.router_gating_linear(x, weight, bias, router_dtype)


@router_gating_linear.register_fake
def _(x, weight, bias, router_dtype):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=router_dtype)


@torch.library.custom_op("switchyard::router_gating_linear_backward", mutates_args=())
def router_gating_linear_backward(grad_logits: Tensor, x: Tensor, weight: Tensor,
                                  bias: Tensor | None, router_dtype: torch.dtype
                                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x [T, H] in x's dtype, grad_weight [E, H] in weight's dtype, grad_bias [E] in
    bias's dtype, or an empty [0] tensor without bias), all accumulated in router_dtype in a fixed
    order. ``grad_logits`` [T, E] in router_dtype."""
    with _no_autocast():
        grad_x, grad_w, grad_b = _C.router_gating_linear_backward(
            grad_logits.contiguous(), x, weight, bias, router_dtype)
    if bias is None:
        grad_b = weight.new_empty((0,))
    elif grad_b.dtype != bias.dtype:
        grad_b = grad_b.to(bias.dtype)
    return grad_x, grad_w, grad_b


@router_gating_linear_backward.register_fake
def _(grad_logits, x, weight, bias, router_dtype):
    grad_b = weight.new_empty((0,)) if bias is None else torch.empty_like(bias)
    return torch.empty_like(x), torch.empty_like(weight), grad_b


def _gate_setup_context(ctx, inputs, output):
    x, weight, bias, router_dtype = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.router_dtype = router_dtype


def _gate_backward(ctx, grad_logits):
    x, weight, bias = ctx.saved_tensors
    grad_x, grad_w, grad_b = torch.ops.switchyard.router_gating_linear_backward(
        grad_logits.to(ctx.router_dtype), x, weight, bias, ctx.router_dtype)
    return (grad_x if ctx.needs_input_grad[0] else None,
            grad_w if ctx.needs_input_grad[1] else None,
            grad_b if bias is not None and ctx.needs_input_grad[2] else None,
            None)


router_gating_linear.register_autograd(_gate_backward, setup_context=_gate_setup_context)


# --------------------------------------------------------------------------------------------------
# Input jitter: x * u, u ~ U(1-eps, 1+eps) per element from a counter-based generator keyed by seed
# (the same seed gives the same u, so the backward is grad * u).
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("switchyard::input_jitter", mutates_args=())
def input_jitter(x: Tensor, eps: float, seed: int, backward: bool) -> Tensor:
    """x (or, with backward=True, the gradient) [...] bf16/fp32/fp64 -> x * u in x's dtype."""
    return _C.input_jitter(x.contiguous(), eps, seed, backward=backward)


@input_jitter.register_fake
def _(x, eps, seed, backward):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _jitter_setup_context(ctx, inputs, output):
    _, ctx.eps, ctx.seed, ctx.backward = inputs


def _jitter_backward(ctx, grad):
    # d(x * u)/dx = u: the backward multiplies by the same u (linear in x, so the backward of the
    # backward is the forward again).
    return torch.ops.switchyard.input_jitter(grad, ctx.eps, ctx.seed, True), None, None, None


input_jitter.register_autograd(_jitter_backward, setup_context=_jitter_setup_context)


# --------------------------------------------------------------------------------------------------
# Route sink: hands the ids a compiled forward computed to Python (record, capture) at run time.
# --------------------------------------------------------------------------------------------------
_SINKS = {}  # key -> weakref.WeakMethod of the receiver
_SINK_KEYS = itertools.count(1)


def add_route_sink(receiver) -> int:
    """Registers ``receiver`` (a bound method ``(ids [T, K], batch, seq)``, held weakly) and
    returns the key a ``route_sink`` call names it by."""
    key = next(_SINK_KEYS)
    _SINKS[key] = weakref.WeakMethod(receiver)
    return key


def route_sink_owner(key):
    """The object whose method the key ``key`` names (None: unknown or collected)."""
    ref = _SINKS.get(key)
    fn = None if ref is None else ref()
    return None if fn is None else fn.__self__


@torch.library.custom_op("switchyard::route_sink", mutates_args=("token",))
def route_sink(ids: Tensor, token: Tensor, key: int, batch: int, seq: int) -> None:
    """Calls the receiver registered under ``key`` with a copy of ``ids`` [T, K] and the forward's
    batch shape (batch, seq; T = batch * seq, or batch 0 when unknown). Inside a compiled graph it
    runs where the forward computed the ids, at every call, without a graph break: the graph
    treats it as writing ``token`` (an empty tensor of the receiver), so it is never dropped or
    reordered past its inputs. Not differentiable; a key with no live receiver does nothing."""
    ref = _SINKS.get(key)
    fn = None if ref is None else ref()
    if fn is not None:
        fn(ids.detach().clone(), batch, seq)


@route_sink.register_fake
def _(ids, token, key, batch, seq):
    return None


OPERATORS = ("router_gating_linear", "router_gating_linear_backward", "input_jitter",
             "route_sink")
"""The names of switchyard's operators under torch.ops.switchyard (every one passes
torch.library.opcheck in python/tests/test_torch_ops.py)."""
