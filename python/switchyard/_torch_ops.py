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
import contextlib
import functools
import itertools
import json
import weakref

import torch
from torch import Tensor

from . import _switchyard as _C

__all__ = ["router_gating_linear", "router_gating_linear_backward", "RouterGatingLinear",
           "gate_kernel", "no_autocast", "input_jitter", "route_sink",
           "add_route_sink", "route_sink_owner", "topk_route", "topk_route_backward",
           "config_key", "ROUTE_STATS", "permute", "permute_backward", "unpermute",
           "unpermute_backward", "OPERATORS"]


def no_autocast():
    """The context every engine call runs in: CPU autocast off (the engine computes in the dtypes
    it is given; autocast must not re-cast anything around it).

    Returns:
        torch.autocast(device_type="cpu", enabled=False) while CPU autocast is on, else a no-op
        context (entering and leaving an autocast context costs about 3 us, a tenth of a small
        gate's kernel).
    """
    if torch.is_autocast_enabled("cpu"):
        return torch.autocast(device_type="cpu", enabled=False)
    return contextlib.nullcontext()


def without_autocast(fn, *args):
    """``fn(*args)`` in ``no_autocast()``'s context, without entering a context where CPU
    autocast is off (the common case: a no-op context's enter and exit are ~2 us of a small
    gate's ~10 us engine call, once per router call)."""
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast(device_type="cpu", enabled=False):
            return fn(*args)
    return fn(*args)


# --------------------------------------------------------------------------------------------------
# Router gate: logits [T, E] = x [T, H] · weight [E, H]ᵀ (+ bias [E]) in router_dtype.
# --------------------------------------------------------------------------------------------------
def gate_kernel(x: Tensor, weight: Tensor, bias: Tensor | None,
                router_dtype: torch.dtype) -> Tensor:
    """x [T, H] bf16/fp32 (fp64 with router_dtype fp64), weight [E, H], bias [E] or None ->
    logits [T, E] in router_dtype (torch.float32 / torch.float64). Deterministic and batch
    invariant (the engine's fixed accumulation order)."""
    return without_autocast(_C.router_gating_linear, x, weight, bias, router_dtype)


router_gating_linear = torch.library.custom_op("switchyard::router_gating_linear", gate_kernel,
                                               mutates_args=())


@router_gating_linear.register_fake
def _(x, weight, bias, router_dtype):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=router_dtype)


def _gate_grads(grad_logits: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                router_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x [T, H] in x's dtype, grad_weight [E, H] in weight's dtype, grad_bias [E] in
    bias's dtype, or an empty [0] tensor without bias), all accumulated in router_dtype in a fixed
    order. ``grad_logits`` [T, E] in router_dtype."""
    with no_autocast():
        grad_x, grad_w, grad_b = _C.router_gating_linear_backward(
            grad_logits.contiguous(), x, weight, bias, router_dtype)
    if bias is None:
        grad_b = weight.new_empty((0,))
    elif grad_b.dtype != bias.dtype:
        grad_b = grad_b.to(bias.dtype)
    return grad_x, grad_w, grad_b


router_gating_linear_backward = torch.library.custom_op(
    "switchyard::router_gating_linear_backward", _gate_grads, mutates_args=())


@router_gating_linear_backward.register_fake
def _(grad_logits, x, weight, bias, router_dtype):
    grad_b = weight.new_empty((0,)) if bias is None else torch.empty_like(bias)
    return torch.empty_like(x), torch.empty_like(weight), grad_b


def _gate_setup_context(ctx, inputs, output):
    x, weight, bias, router_dtype = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.router_dtype = router_dtype


def _gate_backward_with(backward, ctx, grad_logits):
    x, weight, bias = ctx.saved_tensors
    grad_x, grad_w, grad_b = backward(grad_logits.to(ctx.router_dtype), x, weight, bias,
                                      ctx.router_dtype)
    return (grad_x if ctx.needs_input_grad[0] else None,
            grad_w if ctx.needs_input_grad[1] else None,
            grad_b if bias is not None and ctx.needs_input_grad[2] else None,
            None)


def _gate_backward(ctx, grad_logits):
    # The operator's backward is the backward operator (a compiled graph holds both).
    return _gate_backward_with(torch.ops.switchyard.router_gating_linear_backward, ctx,
                               grad_logits)


router_gating_linear.register_autograd(_gate_backward, setup_context=_gate_setup_context)


class RouterGatingLinear(torch.autograd.Function):
    """The gate operator's eager twin: the same kernels (``_gate`` / ``_gate_grads``), the same
    saved tensors and gradients, called without the operator's dispatch (a Python frame through
    the dispatcher and its autograd wrapper on each side: about 30 us per forward and 150 us per
    backward at T <= 256, several times the kernels' own time; bench/py_torch_ops.py).
    switchyard.torch.router_gating_linear takes it for eager calls on plain CPU tensors and the
    operator for everything a tracer, a tensor subclass or another device's kernel must see."""

    # (forward takes ctx: an autograd.Function with a separate setup_context costs about 50 us
    # more per call in torch 2.15's apply; functorch transforms, which need that form, take the
    # operator.)
    @staticmethod
    def forward(ctx, x, weight, bias, router_dtype):
        _gate_setup_context(ctx, (x, weight, bias, router_dtype), None)
        return gate_kernel(x, weight, bias, router_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logits):
        return _gate_backward_with(_gate_grads, ctx, grad_logits)


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


# --------------------------------------------------------------------------------------------------
# Top-k routing: weights and ids of T tokens from router logits (the engine's topk_route).
# --------------------------------------------------------------------------------------------------
# An operator's schema holds tensors and scalars, so the RouterConfig crosses as its fields in a
# JSON string (a constant of the graph, readable in an exported program), rebuilt once per string.
_CONFIG_FIELDS = ("num_experts", "top_k", "score_function", "pre_softmax", "num_groups",
                  "group_topk", "topk_scaling_factor", "capacity_factor", "token_drop_policy",
                  "pad_to_capacity", "aux_loss_type", "aux_loss_coeff", "z_loss_coeff",
                  "calculate_per_token_loss", "is_mtp_layer", "mtp_use_repeated_layer",
                  "mtp_num_layers", "force_load_balancing", "force_biased",
                  "padding_for_quantization", "padding_align_size")

ROUTE_STATS = ("aux_loss", "aux_loss_parts.aux_loss", "aux_loss_parts.seq_aux_loss",
               "aux_loss_parts.global_aux_loss", "z_loss", "expert_capacity", "pad_to_capacity",
               "expert_alignment", "num_dropped", "num_replayed_rows", "num_native_rows",
               "num_padded_rows", "num_invalid_replay_rows")
"""The entries of topk_route's ``stats`` output ([13] fp64; the integers are exact)."""


def config_key(config) -> str:
    """The string that names ``config`` (a switchyard.RouterConfig) in topk_route's schema."""
    return json.dumps({f: getattr(config, f) for f in _CONFIG_FIELDS}, sort_keys=True)


@functools.lru_cache(maxsize=256)
def _config(key: str):
    try:
        fields = json.loads(key)
    except ValueError as e:
        raise ValueError(f"[topk_route] config must be switchyard._torch_ops.config_key(config), "
                         f"got {key!r}") from e
    if not fields.get("padding_for_quantization"):
        fields.pop("padding_align_size", None)  # the engine default, not a user setting
    return _C.RouterConfig(**fields)


def _route(logits, config, expert_bias, replay_idx, padding_mask, qb_beta, invalid_replay_rows,
           layer, seq_length, training, force_seed, force_bias_seed):
    with no_autocast():
        return _C.topk_route(logits, _config(config), expert_bias, replay_idx, padding_mask, None,
                             invalid_replay_rows, layer, seq_length, False, force_seed,
                             force_bias_seed, training, qb_beta=qb_beta)


def _qb_local_size(config: str, training: bool) -> int:
    cfg = _config(config)
    return cfg.num_experts if training and cfg.aux_loss_type == "quantile_balancing" else 0


@torch.library.custom_op("switchyard::topk_route", mutates_args=())
def topk_route(logits: Tensor, config: str, expert_bias: Tensor | None,
               replay_idx: Tensor | None, padding_mask: Tensor | None, qb_beta: Tensor | None,
               invalid_replay_rows: str, layer: int, seq_length: int, training: bool,
               force_seed: int, force_bias_seed: int, loss_grad_scale: float
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Routes logits [T, E] (bf16/fp32/fp64) with the RouterConfig named by ``config``
    (config_key). Returns (topk_weights [T, K] in the logits' dtype, topk_idx [T, K] int64 (-1 =
    none), num_tokens_per_expert [E] int64, stats [13] fp64 (ROUTE_STATS), qb_beta_local [E] fp32
    while training with quantile_balancing, else [0]). Deterministic: the same inputs give the same
    bits, which is what lets the backward route again instead of holding engine state. No global
    aux-loss state and no communicators (those calls keep switchyard.torch's stateful path).
    ``loss_grad_scale`` multiplies the aux- and z-loss gradients in the backward only."""
    res = _route(logits, config, expert_bias, replay_idx, padding_mask, qb_beta,
                 invalid_replay_rows, layer, seq_length, training, force_seed, force_bias_seed)
    stats = torch.tensor([res.aux_loss, *(res.aux_loss_parts[k] for k in
                                          ("aux_loss", "seq_aux_loss", "global_aux_loss")),
                          res.z_loss, res.expert_capacity, res.pad_to_capacity,
                          res.expert_alignment, res.num_dropped, res.num_replayed_rows,
                          res.num_native_rows, res.num_padded_rows,
                          res.num_invalid_replay_rows], dtype=torch.float64)
    qb = res.qb_beta_local
    if qb is None:
        qb = torch.empty(0, dtype=torch.float32)
    return res.topk_weights, res.topk_idx.to(torch.int64), res.num_tokens_per_expert, stats, qb


@topk_route.register_fake
def _(logits, config, expert_bias, replay_idx, padding_mask, qb_beta, invalid_replay_rows, layer,
      seq_length, training, force_seed, force_bias_seed, loss_grad_scale):
    cfg = _config(config)
    T, K, E = logits.shape[0], cfg.top_k, cfg.num_experts
    return (logits.new_empty((T, K)), logits.new_empty((T, K), dtype=torch.int64),
            logits.new_empty((E,), dtype=torch.int64),
            logits.new_empty((len(ROUTE_STATS),), dtype=torch.float64),
            logits.new_empty((_qb_local_size(config, training),), dtype=torch.float32))


@torch.library.custom_op("switchyard::topk_route_backward", mutates_args=())
def topk_route_backward(grad_topk_weights: Tensor, logits: Tensor, config: str,
                        expert_bias: Tensor | None, replay_idx: Tensor | None,
                        padding_mask: Tensor | None, qb_beta: Tensor | None,
                        invalid_replay_rows: str, layer: int, seq_length: int, training: bool,
                        force_seed: int, force_bias_seed: int, loss_grad_scale: float) -> Tensor:
    """grad_logits [T, E] in the logits' dtype: the gradient through the weights plus the aux- and
    z-loss gradients (x loss_grad_scale). Routes the forward's inputs again (deterministic, so the
    engine's saved state is the forward's, bit for bit) and runs the engine's backward on it."""
    res = _route(logits, config, expert_bias, replay_idx, padding_mask, qb_beta,
                 invalid_replay_rows, layer, seq_length, training, force_seed, force_bias_seed)
    with no_autocast():
        g = grad_topk_weights.to(res.topk_weights.dtype).contiguous()
        return _C.topk_route_backward(g, res, loss_grad_scale)


@topk_route_backward.register_fake
def _(grad_topk_weights, logits, config, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _route_setup_context(ctx, inputs, output):
    (logits, config, expert_bias, replay_idx, padding_mask, qb_beta, *scalars) = inputs
    # The router updates expert_bias and qb_beta in place between steps: the backward routes on
    # the forward's values (copies, [E] each), as the engine's saved state did.
    ctx.save_for_backward(logits, None if expert_bias is None else expert_bias.detach().clone(),
                          replay_idx, padding_mask,
                          None if qb_beta is None else qb_beta.detach().clone())
    ctx.config, ctx.scalars = config, tuple(scalars)
    ctx.mark_non_differentiable(*output[1:])


def _route_backward(ctx, grad_topk_weights, *_):
    logits, expert_bias, replay_idx, padding_mask, qb_beta = ctx.saved_tensors
    grad = torch.ops.switchyard.topk_route_backward(
        grad_topk_weights, logits, ctx.config, expert_bias, replay_idx, padding_mask, qb_beta,
        *ctx.scalars)
    return (grad,) + (None,) * 12


topk_route.register_autograd(_route_backward, setup_context=_route_setup_context)


# --------------------------------------------------------------------------------------------------
# Permute / unpermute over a routing plan given as its five row maps (RoutingPlan.row_token
# [R] int64, row_weight [R] fp32, slot_row [T, K] int64, token_offsets [T+1] int64, token_rows [P]
# int64): the bindings check every index before a kernel reads it.
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("switchyard::permute", mutates_args=())
def permute(x: Tensor, row_token: Tensor, row_weight: Tensor, slot_row: Tensor,
            token_offsets: Tensor, token_rows: Tensor) -> Tensor:
    """x [T, H] fp32/bf16 -> [R, H]: row r is x[row_token[r]] (zeros for a padding row, -1)."""
    with no_autocast():
        return _C.permute_rows(x, row_token, row_weight, slot_row, token_offsets, token_rows)


@permute.register_fake
def _(x, row_token, row_weight, slot_row, token_offsets, token_rows):
    return x.new_empty((row_token.shape[0], x.shape[1]))


@torch.library.custom_op("switchyard::permute_backward", mutates_args=())
def permute_backward(grad_permuted: Tensor, row_token: Tensor, row_weight: Tensor,
                     slot_row: Tensor, token_offsets: Tensor, token_rows: Tensor) -> Tensor:
    """grad_permuted [R, H] -> grad_x [T, H]: each token's rows summed in the plan's order."""
    with no_autocast():
        return _C.permute_rows(grad_permuted, row_token, row_weight, slot_row, token_offsets,
                               token_rows, backward=True)


@permute_backward.register_fake
def _(grad_permuted, row_token, row_weight, slot_row, token_offsets, token_rows):
    return grad_permuted.new_empty((slot_row.shape[0], grad_permuted.shape[1]))


def _permute_setup_context(ctx, inputs, output):
    x, *plan = inputs
    ctx.save_for_backward(*plan)
    ctx.dtype = x.dtype


def _permute_backward(ctx, grad):
    return (torch.ops.switchyard.permute_backward(grad.to(ctx.dtype), *ctx.saved_tensors),
            None, None, None, None, None)


permute.register_autograd(_permute_backward, setup_context=_permute_setup_context)


@torch.library.custom_op("switchyard::unpermute", mutates_args=())
def unpermute(permuted: Tensor, topk_weights: Tensor | None, row_token: Tensor,
              row_weight: Tensor, slot_row: Tensor, token_offsets: Tensor,
              token_rows: Tensor) -> Tensor:
    """permuted [R, H] fp32/bf16 -> y [T, H]: y[t] = sum over t's rows of w_row * permuted[row]
    in fp32 in the plan's order, w_row = row_weight (the merged ``topk_weights`` [T, K] the plan
    was built from) when ``topk_weights`` is given, else 1. Differentiable in permuted and
    topk_weights."""
    with no_autocast():
        return _C.unpermute_rows(permuted, row_token, row_weight, slot_row, token_offsets,
                                 token_rows, topk_weights is not None)


@unpermute.register_fake
def _(permuted, topk_weights, row_token, row_weight, slot_row, token_offsets, token_rows):
    return permuted.new_empty((slot_row.shape[0], permuted.shape[1]))


@torch.library.custom_op("switchyard::unpermute_backward", mutates_args=())
def unpermute_backward(grad_y: Tensor, permuted: Tensor, row_token: Tensor, row_weight: Tensor,
                       slot_row: Tensor, token_offsets: Tensor, token_rows: Tensor,
                       apply_weights: bool) -> tuple[Tensor, Tensor]:
    """(grad_permuted [R, H] in grad_y's dtype, grad_topk_weights [T, K] fp32: the dot of each
    slot's row with its token's gradient, zeros without apply_weights)."""
    with no_autocast():
        return tuple(_C.unpermute_rows_backward(grad_y, permuted, row_token, row_weight,
                                                slot_row, token_offsets, token_rows,
                                                apply_weights))


@unpermute_backward.register_fake
def _(grad_y, permuted, row_token, row_weight, slot_row, token_offsets, token_rows,
      apply_weights):
    return (grad_y.new_empty((row_token.shape[0], grad_y.shape[1])),
            grad_y.new_empty(tuple(slot_row.shape), dtype=torch.float32))


def _unpermute_setup_context(ctx, inputs, output):
    permuted, topk_weights, *plan = inputs
    ctx.save_for_backward(permuted, *plan)
    ctx.apply_weights = topk_weights is not None
    ctx.w_dtype = None if topk_weights is None else topk_weights.dtype


def _unpermute_backward(ctx, grad_y):
    permuted, *plan = ctx.saved_tensors
    gp, gw = torch.ops.switchyard.unpermute_backward(grad_y.to(permuted.dtype), permuted, *plan,
                                                     ctx.apply_weights)
    gw = gw.to(ctx.w_dtype) if ctx.apply_weights and ctx.needs_input_grad[1] else None
    return (gp, gw) + (None,) * 5


unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup_context)


OPERATORS = ("router_gating_linear", "router_gating_linear_backward", "input_jitter",
             "route_sink", "topk_route", "topk_route_backward", "permute", "permute_backward",
             "unpermute", "unpermute_backward")
"""The names of switchyard's operators under torch.ops.switchyard (every one passes
torch.library.opcheck in python/tests/test_torch_ops.py)."""
