"""switchyard.torch: drop-in autograd pieces for PyTorch training stacks.

    import switchyard.torch as syt
    logits = syt.router_gating_linear(x, weight, bias=None, router_dtype=torch.float32)

Tensors cross into the engine without copies when they are contiguous CPU tensors; other layouts are
made contiguous once. A CUDA tensor or a wrong dtype raises ValueError naming the argument.
"""
import collections
import dataclasses
import math
import typing

import torch

from . import _ids
from . import _names
from . import _torch_ops as _ops
from . import _switchyard as _C
from . import replay as _replay

__all__ = ["router_gating_linear", "input_jitter", "topk_route", "TopKRoute", "RouteInputs", "RouteOptions",
           "RouteComms", "RouteInfo", "TopKRouter",
           "routing_plan", "permute", "unpermute",
           "update_expert_bias", "AlltoAllDispatcher", "AllGatherDispatcher", "DispatchHandle"]


# --------------------------------------------------------------------------------------------------
# Router gate
# --------------------------------------------------------------------------------------------------
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
    # Eager calls on plain CPU tensors take the operator's autograd.Function twin (the same
    # kernels and gradients without the operator's dispatch, as topk_route does); a tracer, a
    # tensor subclass or another device (its registered kernel, meta's fake one) gets the operator.
    if _plain_cpu(x, weight, bias) and not _traced():
        # Nothing to differentiate (generation, an old log-prob pass, frozen inputs): the kernel
        # alone, no autograd node (the Function's apply is ~30 us, twice a small gate's kernel).
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                                  (bias is not None and bias.requires_grad))
        gate = _ops.RouterGatingLinear.apply if needs_grad else _ops.gate_kernel
    else:
        gate = _ops.router_gating_linear
    # The operator takes [T, H]; a view restores the leading dims (a 2-D input gets the operator's
    # tensor itself: a view output would be flagged by FSDP2, an in-place op on it skipping its
    # pre-backward hook).
    if x.dim() == 2:
        return gate(x, weight, bias, router_dtype)
    logits = gate(x.reshape(-1, x.shape[-1]), weight, bias, router_dtype)
    return logits.view(*x.shape[:-1], logits.shape[-1])


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_cpu(*tensors):
    """Whether every tensor given (None skipped) is a plain torch.Tensor / Parameter (no
    subclass) on the CPU."""
    for t in tensors:  # (a loop and is_cpu: no generator frame, no torch.device per tensor)
        if t is not None and (type(t) not in _PLAIN or not t.is_cpu):
            return False
    return True


def _router_logits(x, weight, bias, router_dtype):
    """The router gate of TopKRouter and of the Megatron integration's engine path, one meaning of
    ``router_dtype`` for both: None is the input's dtype (Megatron's moe_router_dtype=None); bf16
    logits come from the fp32-accumulated gate rounded once (routing on bf16 logits, as Megatron
    with bf16 activations and an inference engine do)."""
    rd = x.dtype if router_dtype is None else router_dtype
    if rd == torch.bfloat16:
        return router_gating_linear(x, weight, bias, router_dtype=torch.float32).to(torch.bfloat16)
    return router_gating_linear(x, weight, bias, router_dtype=rd)


def input_jitter(x, eps, seed=None):
    """Input jitter (Megatron-Core ``moe_input_jitter_eps``): ``x * u``, u ~ U(1-eps, 1+eps) per
    element, in x's dtype (bf16/fp32/fp64), differentiable (grad * u). ``seed`` None draws one from
    torch's default generator, so ``torch.manual_seed`` fixes it and torch.utils.checkpoint's
    restored RNG state makes a recompute draw the same noise."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return _ops.input_jitter(x, float(eps), int(seed), False)


# --------------------------------------------------------------------------------------------------
# Expert-parallel dispatchers
# --------------------------------------------------------------------------------------------------
# The dtypes an id table may come in and the one narrowing of id tensors live in switchyard._ids.
_ID_DTYPES = _ids.ID_DTYPES


def _idx32(ids, op, name="topk_idx", dtypes=(torch.int64, torch.int32)):
    """``ids`` as int32 on its device (switchyard._ids.to_int32: a value outside int32 is a
    ValueError naming op, argument, value and position, never wrapped into another id).
    ``dtypes``: the dtypes the caller takes (a subset of ``_ID_DTYPES``)."""
    return _ids.to_int32(ids, op, name, dtypes)


def _fail_collective(op, error, comm):
    """Raises `error` on every rank: a check that failed here, before the collective, joins the
    collective's error agreement so the other ranks raise too instead of waiting (size 1: as is)."""
    if comm.size == 1:
        raise error
    _C.dist_fail_collective(op, str(error), comm)


def _agree_requires_grad(op, comm, flags):
    """Backward runs one collective per input that needs a gradient, so the flags must agree on
    every rank; checked in the forward, after the dispatch (one small allreduce)."""
    if comm.size == 1:
        return
    mx = comm.allreduce_max([int(f) for f in flags] + [1 - int(f) for f in flags])
    names = ("x", "topk_weights")
    for i, name in enumerate(names):
        if mx[i] and mx[len(flags) + i]:
            raise ValueError(f"[{op}] {name}.requires_grad must be the same on every rank (the "
                             f"backward runs a collective for it), got True on some ranks and "
                             f"False on others (rank {comm.rank}: {bool(flags[i])})")


def _handle_accessor(name, doc):
    return property(lambda self: getattr(self._c, name), doc=doc)


class DispatchHandle:
    """What ``combine`` and the backwards need, returned by ``dispatch``: opaque (as DeepEP's
    handle), read through the accessors below. Integers, never differentiable; the tensors are
    copies (editing them cannot corrupt a later combine or backward).

    R = num_recv_tokens (rows of recv_x, padding rows included), L = num_local_experts."""

    __slots__ = ("_c", "_topk_weights", "_comm")

    kind = _handle_accessor("kind", "'all_to_all' or 'all_gather': the dispatcher that made it.")
    rank = _handle_accessor("rank", "This rank in the ep communicator.")
    world_size = _handle_accessor("world_size", "The ep size.")
    num_tokens = _handle_accessor("num_tokens", "T: tokens this rank dispatched.")
    hidden = _handle_accessor("hidden", "H: the hidden size (the same on every rank).")
    num_experts = _handle_accessor("num_experts", "E: experts over all ranks.")
    num_local_experts = _handle_accessor("num_local_experts", "L = E / ep size.")
    num_recv_tokens = _handle_accessor("num_recv_tokens",
                                       "R: rows of recv_x on this rank, padding rows included.")
    num_tokens_per_expert = _handle_accessor(
        "num_tokens_per_expert", "[L] int64: rows per local expert in recv_x (ascending expert), "
        "padding included (sum = R): what a grouped GEMM iterates over.")
    num_unpadded_tokens_per_expert = _handle_accessor(
        "num_unpadded_tokens_per_expert", "[L] int64: real (unpadded) received rows per local "
        "expert; equal to num_tokens_per_expert without padding.")
    expert_offsets = _handle_accessor(
        "expert_offsets", "[L+1] int64: where each local expert's rows start in recv_x.")
    recv_src_rank = _handle_accessor(
        "recv_src_rank", "[R] int64: the source rank of every received row (-1: padding row).")
    recv_src_token = _handle_accessor(
        "recv_src_token", "[R] int64: the source token (on its rank) of every received row "
        "(-1: padding row).")
    num_dropped = _handle_accessor("num_dropped",
                                   "(token, expert) pairs this rank dropped by capacity.")

    def __init__(self, c_handle, topk_weights, comm):
        self._c = c_handle
        self._topk_weights = topk_weights
        self._comm = comm

    def __getattr__(self, name):
        # Only reached for names that are not accessors: old names say what replaced them.
        raise _names.old_attribute(self, name)

    def __repr__(self):
        h = self._c
        return (f"<DispatchHandle {h.kind} rank {h.rank}/{h.world_size}: {h.num_tokens} tokens, "
                f"{h.num_recv_tokens} received rows, {h.num_local_experts} local experts>")


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx32, disp, box):
        with _ops.no_autocast():
            w = topk_weights.detach().to(torch.float32)
            recv_x, recv_w, h = _C.dispatch(x.detach(), topk_idx32, w, disp.num_experts, disp.kind,
                                            disp._capacity_factor, disp.token_drop_policy,
                                            disp.ep_comm, expert_alignment=disp.expert_alignment,
                                            pad_to_capacity=disp.pad_to_capacity)
        # After dispatch's own agreement (a rank that failed its checks has raised everywhere by
        # now), before any backward can mismatch.
        _agree_requires_grad(f"{type(disp).__name__}.dispatch", disp.ep_comm,
                             ctx.needs_input_grad[:2])
        box.append(h)
        ctx.h = h
        ctx.comm = disp.ep_comm
        ctx.num_tokens = x.shape[0]
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        grad_x = grad_w = None
        # Collectives: every rank takes the same branches (needs_input_grad is the same everywhere).
        if ctx.needs_input_grad[0]:
            grad_x = _C.dispatch_backward(grad_recv_x.contiguous(), ctx.h, ctx.comm)
        if ctx.needs_input_grad[1]:
            # d recv_w[row] / d topk_weights[t,k] = 1 for every slot of that row's (token, expert)
            # pair.
            gw = grad_recv_w.to(torch.float32).contiguous()
            grad_w = _C.dispatch_weights_backward(gw, ctx.h, ctx.comm)
        return grad_x, grad_w, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, topk_weights, handle, apply_weights):
        with _ops.no_autocast():
            y = _C.combine(expert_out.detach(), handle._c, apply_weights, handle._comm)
        ctx.save_for_backward(expert_out)
        ctx.handle = handle
        ctx.apply_weights = apply_weights
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (expert_out,) = ctx.saved_tensors
        h = ctx.handle
        grad_y = grad_y.to(expert_out.dtype).contiguous()
        grad_e, grad_w = _C.combine_backward(grad_y, expert_out.detach(), h._c, ctx.apply_weights,
                                             h._comm)
        grad_w = grad_w if (ctx.apply_weights and ctx.needs_input_grad[1]) else None
        return (grad_e if ctx.needs_input_grad[0] else None), grad_w, None, None


class _Dispatcher:
    kind = None

    def __init__(self, num_experts, ep_comm=None, capacity_factor=None, token_drop_policy="probs",
                 expert_alignment=1, pad_to_capacity=False):
        """``expert_alignment`` (Megatron-Core's moe_router_padding_for_quantization with its
        get_align_size_for_quantization) and ``pad_to_capacity`` (moe_pad_expert_input_to_capacity,
        needs capacity_factor) pad each source rank's block of every local expert; the padding
        rows of recv_x are zero rows with weight 0 (recv_src_rank -1), never sent, and combine
        and the backwards ignore them. ``handle.num_tokens_per_expert`` counts them,
        ``handle.num_unpadded_tokens_per_expert`` does not."""
        from . import dist
        self.ep_comm = dist.as_communicator(ep_comm)
        ep = self.ep_comm.size
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % ep != 0:
            raise ValueError(f"[{type(self).__name__}] num_experts must be a positive multiple of "
                             f"the ep size {ep}, got num_experts={num_experts}")
        if token_drop_policy not in ("probs", "position"):
            raise ValueError(f"[{type(self).__name__}] token_drop_policy must be 'probs' or "
                             f"'position', got {token_drop_policy!r}")
        if capacity_factor is not None and not (
                isinstance(capacity_factor, (int, float)) and math.isfinite(capacity_factor)
                and capacity_factor > 0):
            # None is "no capacity"; the engine's 0.0 sentinel must not be reachable by mistake.
            raise ValueError(f"[{type(self).__name__}] capacity_factor must be None (no capacity) "
                             f"or a finite number > 0, got capacity_factor={capacity_factor!r}")
        if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or \
                expert_alignment < 1:
            raise ValueError(f"[{type(self).__name__}] expert_alignment must be an int >= 1, got "
                             f"expert_alignment={expert_alignment!r}")
        if pad_to_capacity and capacity_factor is None:
            raise ValueError(f"[{type(self).__name__}] pad_to_capacity needs capacity_factor, got "
                             f"capacity_factor=None")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.capacity_factor = capacity_factor
        self._capacity_factor = 0.0 if capacity_factor is None else float(capacity_factor)
        self.token_drop_policy = token_drop_policy
        self.expert_alignment = expert_alignment
        self.pad_to_capacity = pad_to_capacity

    @property
    def local_expert_ids(self):
        """Global ids of this rank's experts: [rank*L, (rank+1)*L)."""
        r = self.ep_comm.rank
        return range(r * self.num_local_experts, (r + 1) * self.num_local_experts)

    def dispatch(self, x, topk_weights=None, topk_idx=None, **renamed):
        """Send every distinct valid (token, expert) pair to the expert's rank. Collective.

        x [T, H] fp32/bf16; topk_weights [T, K] (routing weights, sent in fp32); topk_idx [T, K]
        int64 or int32 (-1 = none). Returns (recv_x [R, H] in x's dtype, recv_topk_weights [R]
        fp32, handle): rows grouped by local expert ascending (handle.num_tokens_per_expert[i] rows
        for local expert i), then by source rank and token. Differentiable in x and
        topk_weights."""
        op = f"{type(self).__name__}.dispatch"
        _names.check_kwargs(op, renamed)
        if renamed:
            raise TypeError(f"[{op}] unexpected keyword arguments {sorted(renamed)}")
        if topk_weights is None or topk_idx is None:
            raise TypeError(f"[{op}] needs x, topk_weights and topk_idx")
        try:
            # Checks the engine cannot see; a failure joins dispatch's error agreement, so the
            # other ranks raise too instead of waiting in the exchange.
            if not isinstance(topk_weights, torch.Tensor):
                raise ValueError(f"[{op}] topk_weights must be a torch.Tensor, got "
                                 f"{type(topk_weights).__name__}")
            if topk_weights.dtype not in (torch.float32, torch.float64):
                raise ValueError(f"[{op}] topk_weights must have dtype float32 or float64, got "
                                 f"{topk_weights.dtype}")
            idx32 = _idx32(topk_idx, op)
        except ValueError as e:
            _fail_collective("dispatch", e, self.ep_comm)
        box = []
        recv_x, recv_w = _Dispatch.apply(x, topk_weights, idx32, self, box)
        return recv_x, recv_w, DispatchHandle(box[0], topk_weights, self.ep_comm)

    def combine(self, expert_out, handle, apply_weights=True, **renamed):
        """y [T, H] = Σ_k topk_weights[t,k]·expert_out[row(t,k)], summed in fp32 in k order on the
        token's own rank (deterministic, identical for any ep size). ``apply_weights=False`` when
        the experts already applied recv_topk_weights. Collective; differentiable in expert_out
        and (with apply_weights) the topk_weights given to dispatch."""
        op = f"{type(self).__name__}.combine"
        _names.check_kwargs(op, renamed)
        if renamed:
            raise TypeError(f"[{op}] unexpected keyword arguments {sorted(renamed)}")
        if not isinstance(handle, DispatchHandle):
            _fail_collective("combine", ValueError(
                f"[{op}] handle must be the DispatchHandle returned by dispatch, got "
                f"{type(handle).__name__}"), self.ep_comm)
        return _Combine.apply(expert_out, handle._topk_weights, handle, bool(apply_weights))


class AlltoAllDispatcher(_Dispatcher):
    """Expert-parallel dispatcher over MPI all-to-all: each pair goes to its expert's rank only.
    Rank r holds experts [r*L, (r+1)*L), L = num_experts / ep size."""
    kind = "all_to_all"


class AllGatherDispatcher(_Dispatcher):
    """Expert-parallel dispatcher over all-gather: every rank gathers every token and keeps the
    pairs of its own experts. Bitwise the same results as AlltoAllDispatcher."""
    kind = "all_gather"


# --------------------------------------------------------------------------------------------------
# Top-k routing (scores, top-k or replay, capacity, auxiliary losses)
# --------------------------------------------------------------------------------------------------
class RouteInfo:
    """Readable results of one routing call (``TopKRoute.info``, ``TopKRouter.last_info``): loss
    values (Python floats, coefficients included, 0 when off), ``num_tokens_per_expert`` [E] int64,
    capacity, and the replayed / native / padded row counts (replayed + native + padded == T), so
    replay can never silently do nothing."""

    _FIELDS = ("aux_loss", "aux_loss_parts", "z_loss", "qb_beta_local", "expert_capacity",
               "pad_to_capacity", "expert_alignment", "num_dropped", "num_replayed_rows",
               "num_native_rows", "num_padded_rows", "num_invalid_replay_rows")
    __slots__ = ("num_tokens_per_expert", "_stats", "_qb", "_vals")

    def __init__(self, res, stats=None, qb_beta_local=None):
        if stats is not None:
            # From the topk_route operator: res is num_tokens_per_expert, stats its [13] fp64
            # values (switchyard._torch_ops.ROUTE_STATS, the integers exact), read when a field is
            # first read (so a compiled forward that keeps a RouteInfo needs no host sync).
            self.num_tokens_per_expert = res
            self._stats, self._qb, self._vals = stats, qb_beta_local, None
            return
        self.num_tokens_per_expert = res.num_tokens_per_expert
        self._stats = self._qb = None
        self._vals = {
            "aux_loss": res.aux_loss,
            "aux_loss_parts": res.aux_loss_parts,  # {"aux_loss": .., "seq_aux_loss": .., ...}
            "z_loss": res.z_loss,
            "qb_beta_local": res.qb_beta_local,  # [E] fp32 (quantile_balancing, training) or None
            "expert_capacity": None if res.expert_capacity < 0 else res.expert_capacity,
            # Padding the routing plan applies (moe_pad_expert_input_to_capacity, padding for
            # quantization): see routing_plan_options.
            "pad_to_capacity": res.pad_to_capacity, "expert_alignment": res.expert_alignment,
            "num_dropped": res.num_dropped, "num_replayed_rows": res.num_replayed_rows,
            "num_native_rows": res.num_native_rows, "num_padded_rows": res.num_padded_rows,
            "num_invalid_replay_rows": res.num_invalid_replay_rows}

    def _field(self, name):
        if self._vals is None:
            v = self._stats.tolist()
            self._vals = {
                "aux_loss": v[0],
                "aux_loss_parts": {"aux_loss": v[1], "seq_aux_loss": v[2],
                                   "global_aux_loss": v[3]},
                "z_loss": v[4], "qb_beta_local": self._qb if self._qb.numel() else None,
                "expert_capacity": None if v[5] < 0 else int(v[5]),
                "pad_to_capacity": bool(v[6]), "expert_alignment": int(v[7]),
                "num_dropped": int(v[8]), "num_replayed_rows": int(v[9]),
                "num_native_rows": int(v[10]), "num_padded_rows": int(v[11]),
                "num_invalid_replay_rows": int(v[12])}
        return self._vals[name]

    @property
    def routing_plan_options(self):
        """Keyword arguments of ``routing_plan`` that carry this route's capacity and padding
        (the route already dropped, so the plan drops nothing more)."""
        return dict(expert_capacity=self.expert_capacity, pad_to_capacity=self.pad_to_capacity,
                    expert_alignment=self.expert_alignment)

    def __repr__(self):
        return "RouteInfo(" + ", ".join(
            f"{k}={getattr(self, k)!r}" for k in self._FIELDS) + ")"

    def __getattr__(self, name):
        raise _names.old_attribute(self, name)


for _f in RouteInfo._FIELDS:
    setattr(RouteInfo, _f, property(lambda self, _f=_f: self._field(_f)))
del _f


class _TopKRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, config, expert_bias, replay_idx, padding_mask, global_state,
                invalid_replay_rows, layer, seq_length, loss_grad_scale, accumulate, extra,
                qb_beta, info_box):
        # extra: (force_seed, force_bias_seed, training, loss_comm, global_aux_loss_comm).
        with _ops.no_autocast():
            res = _C.topk_route(logits.detach(), config,
                                None if expert_bias is None else expert_bias.detach(),
                                replay_idx, padding_mask, global_state, invalid_replay_rows,
                                layer, seq_length, accumulate, *extra[:3],
                                qb_beta=None if qb_beta is None else qb_beta.detach(),
                                loss_comm=extra[3], global_aux_loss_comm=extra[4])
        ctx.res = res
        ctx.loss_grad_scale = loss_grad_scale
        ctx.save_for_backward(logits)  # version check: the engine reads these logits in backward
        info_box.append(res)
        topk_idx = res.topk_idx.to(torch.int64)
        ctx.mark_non_differentiable(topk_idx)
        return res.topk_weights, topk_idx

    @staticmethod
    def backward(ctx, grad_topk_weights, _grad_idx):
        ctx.saved_tensors  # raises if the logits were modified in place since the forward
        with _ops.no_autocast():
            g = grad_topk_weights.to(ctx.res.topk_weights.dtype).contiguous()
            grad_logits = _C.topk_route_backward(g, ctx.res, ctx.loss_grad_scale)
        return (grad_logits,) + (None,) * 13


def _comm(obj):
    if obj is None:
        return None
    from . import dist
    return dist.as_communicator(obj, "loss communicator")


def _force_seeds(config, force_seed, force_bias_seed):
    """(force_seed, force_bias_seed) for the engine; unused (0) unless forced routing is on."""
    if not (config.force_load_balancing or config.force_biased):
        return (0, 0)
    draw = lambda: int(torch.randint(0, 2**62, (1,)).item())  # noqa: E731
    return (draw() if force_seed is None else int(force_seed),
            draw() if force_bias_seed is None else int(force_bias_seed))


@dataclasses.dataclass(frozen=True)
class RouteInputs:
    """Optional tensors of ``topk_route`` (the engine's RouteInputs). None = not given.

    expert_bias [E] fp32/fp64: aux-loss-free balancing bias, selection only.
    replay_idx [T, K] int64/int32: ids to use instead of the live top-k (weights from the live
    logits at those ids); an all -1 row is routed natively; an invalid row (mixing -1 and ids,
    repeating an id, id outside [0, E)) follows ``RouteOptions.invalid_replay_rows``.
    padding_mask [T] bool: True = padded token (row all -1, left out of counts and losses).
    qb_beta [E] fp32: the quantile-balancing bias (None = zeros).
    global_aux_loss_state: a switchyard.GlobalAuxLossState, required by global_aux_loss."""
    expert_bias: "torch.Tensor | None" = None
    replay_idx: "torch.Tensor | None" = None
    padding_mask: "torch.Tensor | None" = None
    qb_beta: "torch.Tensor | None" = None
    global_aux_loss_state: "object | None" = None


@dataclasses.dataclass(frozen=True)
class RouteOptions:
    """Options of ``topk_route`` (the engine's RouteOptions, plus RouteBackwardOptions'
    ``loss_grad_scale`` as ``aux_loss_grad_scale``).

    invalid_replay_rows: "error" (ValueError naming the token) or "native" (routed natively).
    layer: MoE layer number, used only in error messages. seq_length: tokens per sequence for
    seq_aux_loss ([s, b] layout, token t in sequence t % b). training: Megatron's module training
    flag; False is its eval path: no aux or z loss (values 0 in RouteInfo, no loss gradient, the
    global aux-loss state untouched), sinkhorn selects on the logits, no RouteInfo.qb_beta_local.
    force_seed / force_bias_seed: seeds of config.force_load_balancing / force_biased (None: drawn
    from torch's default generator). accumulate_global_aux_loss: add this batch to the global
    aux-loss state (True), or only read it (False); None: Megatron-Core's rule, only training
    forwards with grad enabled (not under torch.no_grad, not the recompute of a non-reentrant
    checkpoint). aux_loss_grad_scale: multiplies the aux- and z-loss gradients."""
    invalid_replay_rows: str = "error"
    layer: "int | None" = None
    seq_length: "int | None" = None
    training: bool = True
    force_seed: "int | None" = None
    force_bias_seed: "int | None" = None
    accumulate_global_aux_loss: "bool | None" = None
    aux_loss_grad_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class RouteComms:
    """Communicators of the cross-rank loss statistics (the engine's RouteComms):
    switchyard.dist.Communicator or mpi4py communicators, None = local. ``loss``: Megatron's tp_cp
    group; ``global_aux_loss``: its tp_dp_cp group. With either, topk_route is collective (every
    rank must call it with the same config)."""
    loss: object = None
    global_aux_loss: object = None


class TopKRoute(typing.NamedTuple):
    """The result of ``topk_route``, the same whatever the options.

    weights [T, K] (T = the logits' leading dims) in the logits' dtype, differentiable to the
    logits; idx [T, K] int64, -1 = none; info: the RouteInfo (losses, counts, row kinds)."""
    weights: torch.Tensor
    idx: torch.Tensor
    info: RouteInfo


# The flat keywords of topk_route before the options were grouped -> where each went.
_OLD_ROUTE_KWARGS = {
    "expert_bias": "inputs", "replay_idx": "inputs", "padding_mask": "inputs",
    "qb_beta": "inputs", "global_aux_loss_state": "inputs",
    "invalid_replay_rows": "options", "layer": "options", "seq_length": "options",
    "training": "options", "force_seed": "options", "force_bias_seed": "options",
    "accumulate_global_aux_loss": "options", "aux_loss_grad_scale": "options",
    "loss_comm": "comms", "global_aux_loss_comm": "comms",
}
_GROUP_CLASS = {"inputs": "RouteInputs", "options": "RouteOptions", "comms": "RouteComms"}


def _old_route_call(kwargs, positional):
    """TypeError naming the new form for a call in topk_route's old flat form."""
    for name in kwargs:
        if name == "return_info":
            return TypeError("[topk_route] return_info was removed: topk_route always returns a "
                             "TopKRoute(weights, idx, info)")
        group = _OLD_ROUTE_KWARGS.get(name)
        if group is not None:
            field = {"loss_comm": "loss", "global_aux_loss_comm": "global_aux_loss"}.get(name, name)
            return TypeError(f"[topk_route] keyword '{name}' moved into the {group} group: pass "
                             f"{group}=switchyard.torch.{_GROUP_CLASS[group]}({field}=...)")
    if kwargs:
        return TypeError(f"[topk_route] unexpected keyword arguments {sorted(kwargs)}")
    for group, value in positional:
        cls = {"inputs": RouteInputs, "options": RouteOptions, "comms": RouteComms}[group]
        if value is not None and not isinstance(value, cls):
            return TypeError(f"[topk_route] {group} must be a switchyard.torch."
                             f"{_GROUP_CLASS[group]} or None, got {type(value).__name__} (the "
                             f"old positional form topk_route(logits, config, expert_bias, "
                             f"replay_idx, invalid_replay_rows) became topk_route(logits, config, "
                             f"RouteInputs(expert_bias=..., replay_idx=...), "
                             f"RouteOptions(invalid_replay_rows=...)))")
    return None


def topk_route(logits, config, inputs=None, options=None, comms=None, **old):
    """Route T tokens to K of E experts from router logits (Megatron-Core's TopKRouter semantics).

    logits [..., E] fp32 or fp64 (the router dtype), or bf16 (Megatron's moe_router_dtype=None:
    scores and weights in fp32 from the bf16 logits, weights returned in bf16, gradient in bf16);
    T = the product of the leading dims. config: a switchyard.RouterConfig. inputs: a RouteInputs
    (expert bias, replay ids, padding mask, quantile-balancing bias, global aux-loss state);
    options: a RouteOptions (replay-row policy, layer, seq_length, training, seeds, global
    aux-loss accumulation, loss-gradient scale); comms: a RouteComms (loss communicators:
    collective). None = the defaults.

    Returns a TopKRoute(weights [..., K] in the logits' dtype, differentiable to logits;
    idx [..., K] int64, -1 = none; info: RouteInfo). Auxiliary and z losses are not added to the
    weights: as in Megatron-Core, their gradients (× aux_loss_grad_scale) are added to the logits'
    gradient when the weights' backward runs; their values are in info.

    The flat keywords of earlier releases (expert_bias=, replay_idx=, loss_comm=, return_info=,
    ...) raise a TypeError naming the group they moved to (docs/deprecations.md)."""
    err = _old_route_call(old, (("inputs", inputs), ("options", options), ("comms", comms)))
    if err is not None:
        raise err
    return _topk_route(logits, config, inputs, options, comms)


def _traced():
    """Whether a tracer or a transform runs this call: dynamo (torch.compile, torch.export), a
    dispatch mode (make_fx, AOT autograd, fake tensors) or a torch.func transform (the operators
    serve them; the eager autograd.Functions, whose forward takes ctx, do not)."""
    return torch.compiler.is_compiling() or \
        torch.utils._python_dispatch._get_current_dispatch_mode() is not None or \
        torch._C._are_functorch_transforms_active()


def _topk_route(logits, config, inputs, options, comms, config_key=None, operator=None):
    """topk_route; ``config_key``: _ops.config_key(config) when the caller keeps it (TopKRouter:
    computed once, so a traced forward reads a constant string instead of tracing json).
    ``operator``: True takes the operator, False the engine's autograd.Function, None (default)
    the operator when traced and the Function in eager mode. Both give bitwise the same ids,
    weights, counts and gradients (test_torch_ops); the Function is cheaper per eager call
    (bench/py_torch_ops.py: the operator's dispatch and the routing pass its functional backward
    repeats cost about 3x at small T), the operator is what a tracer can see."""
    inputs = RouteInputs() if inputs is None else inputs
    options = RouteOptions() if options is None else options
    comms = RouteComms() if comms is None else comms
    loss_comm, global_aux_loss_comm = _comm(comms.loss), _comm(comms.global_aux_loss)
    expert_bias, qb_beta = inputs.expert_bias, inputs.qb_beta
    try:
        if not isinstance(logits, torch.Tensor):
            raise ValueError("[topk_route] logits must be a torch.Tensor, got "
                             f"{type(logits).__name__}")
        if not isinstance(config, _C.RouterConfig):
            raise ValueError("[topk_route] config must be a switchyard.RouterConfig, got "
                             f"{type(config).__name__}")
        _replay.check_policy(options.invalid_replay_rows, "topk_route")
        for name, t in (("expert_bias", expert_bias), ("qb_beta", qb_beta)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise ValueError(f"[topk_route] {name} must be a torch.Tensor or None, got "
                                 f"{type(t).__name__}")
    except ValueError as e:
        # With loss communicators: the other ranks raise too instead of waiting for this one.
        if any(c is not None and c.size > 1 for c in (loss_comm, global_aux_loss_comm)):
            _C.router_fail_collective("topk_route", str(e), loss_comm, global_aux_loss_comm)
        raise
    accumulate = options.accumulate_global_aux_loss
    if accumulate is None:
        accumulate = _trained_forward(options.training)
    lead = logits.shape[:-1]
    if logits.dim() != 2:
        logits = logits.reshape(-1, logits.shape[-1])
    layer = -1 if options.layer is None else int(options.layer)
    seq_length = 0 if options.seq_length is None else int(options.seq_length)
    seeds = _force_seeds(config, options.force_seed, options.force_bias_seed)
    stateful = inputs.global_aux_loss_state is not None or loss_comm is not None or \
        global_aux_loss_comm is not None
    if operator is None:
        operator = _traced()
    if operator and not stateful:
        # The operator (torch.ops.switchyard.topk_route): functional, traceable, exportable.
        key = _ops.config_key(config) if config_key is None else config_key
        topk_weights, topk_idx, counts, stats, qb_local = _ops.topk_route(
            logits, key, expert_bias, inputs.replay_idx, inputs.padding_mask, qb_beta,
            options.invalid_replay_rows, layer, seq_length, bool(options.training), *seeds,
            float(options.aux_loss_grad_scale))
        info = RouteInfo(counts, stats, qb_local)
    else:
        # Eager calls, and a global aux-loss state (engine state it updates) or loss
        # communicators (collective): the engine's stateful autograd.Function.
        box = []
        topk_weights, topk_idx = _TopKRoute.apply(
            logits, config, expert_bias, inputs.replay_idx, inputs.padding_mask,
            inputs.global_aux_loss_state, options.invalid_replay_rows, layer, seq_length,
            float(options.aux_loss_grad_scale), bool(accumulate),
            seeds + (bool(options.training), loss_comm, global_aux_loss_comm), qb_beta, box)
        info = RouteInfo(box[0])
    if len(lead) != 1:
        topk_weights = topk_weights.view(*lead, topk_weights.shape[-1])
        topk_idx = topk_idx.view(*lead, topk_idx.shape[-1])
    return TopKRoute(topk_weights, topk_idx, info)


def routing_plan(topk_idx, topk_weights, num_experts, *, expert_alignment=1, capacity_factor=None,
                 expert_capacity=None, token_drop_policy="probs", pad_to_capacity=False):
    """The routing plan of a [T, K] id table (int64/int32, -1 = none) and its weights ([T, K]
    fp32 or None): per-expert counts, row blocks padded to ``expert_alignment`` (Megatron's
    moe_router_padding_for_quantization) or to the capacity (moe_pad_expert_input_to_capacity,
    needs capacity_factor or expert_capacity), and each row's source token (-1 for a padding row,
    weight 0). ``routing_plan(idx, w, E, **info.routing_plan_options)`` lays out a route as
    Megatron's dispatcher pads it. Not differentiable."""
    if capacity_factor is not None and not (
            isinstance(capacity_factor, (int, float)) and math.isfinite(capacity_factor)
            and capacity_factor > 0):
        raise ValueError("[routing_plan] capacity_factor must be None (no capacity) or a finite "
                         f"number > 0, got capacity_factor={capacity_factor!r}")
    if topk_weights is not None and isinstance(topk_weights, torch.Tensor):
        topk_weights = topk_weights.detach().to(torch.float32)
    return _C.build_routing_plan(
        topk_idx, topk_weights, int(num_experts), int(expert_alignment),
        0.0 if capacity_factor is None else float(capacity_factor),
        -1 if expert_capacity is None else int(expert_capacity), token_drop_policy,
        bool(pad_to_capacity))


def _plan_rows(plan):
    """The row maps torch.ops.switchyard.permute / unpermute take (copies, [R] / [T, K] / [T+1] /
    [P] int64 and [R] fp32)."""
    return (plan.row_token, plan.row_weight, plan.slot_row, plan.token_offsets, plan.token_rows)


def permute(x, plan):
    """Single-process dispatch: the experts' input rows of a ``routing_plan`` (expert-major,
    every expert's block padded as the plan says: zero rows for padding). x [T, H] fp32/bf16 ->
    [plan.num_rows, H], differentiable (the backward sums a token's rows in the plan's order)."""
    if not isinstance(plan, _C.RoutingPlan):
        raise ValueError(f"[permute] plan must come from syt.routing_plan, got {type(plan).__name__}")
    return _ops.permute(x, *_plan_rows(plan))


def unpermute(expert_out, plan, topk_weights=None):
    """Single-process combine: y[t] = sum over t's rows of w_row * expert_out[row] (fp32, the
    plan's fixed order; padding rows are never read). ``topk_weights`` [T, K]: the weights the
    plan was built from (their values are the plan's row weights); given, y is differentiable in
    them; None: the experts applied the weights already. Differentiable in expert_out."""
    if not isinstance(plan, _C.RoutingPlan):
        raise ValueError("[unpermute] plan must come from syt.routing_plan, got "
                         f"{type(plan).__name__}")
    return _ops.unpermute(expert_out, topk_weights, *_plan_rows(plan))


def update_expert_bias(expert_bias, num_tokens_per_expert, rate, comm=None):
    """Aux-loss-free bias update (DeepSeek-V3): expert_bias + rate * sign(mean(c) - c), [E] fp32
    from the per-expert counts c = num_tokens_per_expert [E]; with ``comm`` (Megatron's tp_dp_cp
    group) the counts are summed over its ranks first (collective)."""
    return _C.update_expert_bias(expert_bias, num_tokens_per_expert, float(rate), _comm(comm))


def _trained_forward(training):
    """Megatron-Core's rule for the loss state (global aux-loss counts, the quantile-balancing
    accumulators): a training forward with grad enabled. A reentrant checkpoint runs its forward
    under no_grad (not counted) and its recompute with grad (counted: its graph carries the loss
    gradient); a non-reentrant checkpoint counts its forward, so its recompute must not (see
    notes/router-parity.md)."""
    return bool(training) and torch.is_grad_enabled() and \
        _replay.recompute_kind() != "non_reentrant"


class TopKRouter(torch.nn.Module):
    """A drop-in MoE router: gate (syt.router_gating_linear in router_dtype) then topk_route.

    Parameters: ``weight`` [E, hidden] (params_dtype, normal(0, init_std)), ``bias`` [E] when
    ``bias=True``; buffer ``expert_bias`` [E] fp32 when ``enable_expert_bias=True`` (updated by
    ``update_expert_bias(rate)`` from the counts accumulated since the last update).
    ``forward(x, replay=None) -> (topk_weights, topk_idx)``: ``replay`` is a switchyard.RouterReplay
    (its ``action`` decides record / replay_forward / recompute) or a [T, K] id tensor;
    ``self.replay`` is used when not given. ``last_info`` holds the RouteInfo of the last call.
    ``router_dtype``: None (the input's dtype: Megatron's default moe_router_dtype=None),
    torch.bfloat16, float32 or float64. ``input_jitter_eps`` (Megatron moe_input_jitter_eps):
    jitter the gate input on every forward (syt.input_jitter; replayed ids are unaffected).
    The global aux-loss state and the quantile-balancing accumulators advance only on training
    forwards with grad enabled (Megatron's rule; a non-reentrant checkpoint's recompute does not
    count, see notes/router-parity.md); in eval (``.eval()``) no aux or z loss is computed, as in
    Megatron. Expert-bias token counts grow on every forward with grad enabled, eval included
    (Megatron's _apply_expert_bias)."""

    def __init__(self, hidden_size, config, router_dtype=torch.float32, *, bias=False,
                 params_dtype=torch.float32, init_std=0.02, enable_expert_bias=False,
                 layer_number=None, aux_loss_grad_scale=1.0, input_jitter_eps=None,
                 loss_comm=None, global_aux_loss_comm=None):
        super().__init__()
        if not isinstance(config, _C.RouterConfig):
            raise ValueError("[TopKRouter] config must be a switchyard.RouterConfig, got "
                             f"{type(config).__name__}")
        if router_dtype not in (None, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError("[TopKRouter] router_dtype must be None (the input's dtype, "
                             "Megatron's default), torch.bfloat16, torch.float32 or "
                             f"torch.float64, got {router_dtype}")
        self.config = config
        self._config_key = _ops.config_key(config)
        self.hidden_size = int(hidden_size)
        self.router_dtype = router_dtype
        self.layer_number = layer_number
        self.aux_loss_grad_scale = aux_loss_grad_scale
        self.input_jitter_eps = input_jitter_eps
        self.loss_comm = loss_comm  # Megatron's tp_cp group (None = local)
        self.global_aux_loss_comm = global_aux_loss_comm  # its tp_dp_cp group
        E = config.num_experts
        self.weight = torch.nn.Parameter(
            torch.empty(E, self.hidden_size, dtype=params_dtype).normal_(0.0, init_std))
        self.bias = torch.nn.Parameter(torch.zeros(E, dtype=params_dtype)) if bias else None
        if enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(E, dtype=torch.float64))
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        types = config.aux_loss_type if isinstance(config.aux_loss_type, list) else [
            config.aux_loss_type]
        self.global_aux_loss_state = (_C.GlobalAuxLossState()
                                      if "global_aux_loss" in types else None)
        self._gstate_snapshots = collections.deque()
        if config.aux_loss_type == "quantile_balancing":
            # Megatron's qb_beta (persistent) and its per-global-batch accumulators.
            self.register_buffer("qb_beta", torch.zeros(E, dtype=torch.float32))
            self.register_buffer("qb_beta_accum", torch.zeros(E, dtype=torch.float32),
                                 persistent=False)
            self.register_buffer("qb_beta_count", torch.zeros((), dtype=torch.long),
                                 persistent=False)
        else:
            self.qb_beta = self.qb_beta_accum = self.qb_beta_count = None
        self.replay = None
        self.last_info = None

    def forward(self, x, replay=None, *, padding_mask=None, seq_length=None):
        """Routes x [..., hidden] (bf16/fp32; T = the product of the leading dims). Returns
        (topk_weights [T, K] in the logits' dtype (the router dtype), differentiable; topk_idx
        [T, K] int64, -1 = none); the RouteInfo is in ``self.last_info``. ``replay``: a
        switchyard.RouterReplay whose ``action`` decides record / replay, or a [T, K] id tensor to
        force (default ``self.replay``). ``padding_mask`` [T] bool: True = padded token (row all
        -1, left out of counts, capacity and losses). ``seq_length``: tokens per sequence for
        seq_aux_loss."""
        # Whether this forward's recompute will come (checkpointed): only then does a replayed
        # forward queue its ids for it (switchyard.replay.will_recompute).
        will_recompute = _replay.will_recompute(x.requires_grad)
        if self.input_jitter_eps is not None:
            # Megatron applies it on every forward (training or not), before the gate.
            x = input_jitter(x, self.input_jitter_eps)
        logits = _router_logits(x, self.weight, self.bias, self.router_dtype)
        replay = self.replay if replay is None else replay
        T = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
        replay_idx = None
        invalid = "error"
        if isinstance(replay, torch.Tensor):
            replay_idx = replay
        elif replay is not None:
            replay_idx = replay.forward_ids(T)
            invalid = replay.invalid_replay_rows
        gstate = self.global_aux_loss_state
        # Megatron-Core advances the loss state once per trained micro-batch (_trained_forward).
        # In eval the engine computes no loss at all (training=False), as Megatron.
        accumulate = _trained_forward(self.training)
        snapshot = None
        driven = replay is not None and not isinstance(replay, torch.Tensor)
        if gstate is not None and driven:
            # With a RouterReplay the recompute is known exactly: "recompute" pairs with a
            # replay_forward (FIFO, like the replay queue). If that forward counted, the recompute
            # routes on a snapshot taken before it, so it reproduces the forward's loss and the
            # live state advances once per micro-batch; if it did not (no_grad forward, reentrant
            # checkpointing), the recompute counts. The snapshot queue, like the replay queues,
            # changes only after routing succeeded.
            if replay.action == "replay_forward" and will_recompute:
                snapshot = (gstate.copy(), accumulate)
            elif replay.action == "recompute" and self._gstate_snapshots:
                snap, counted = self._gstate_snapshots[0]
                if counted:
                    gstate = snap.copy()  # the queued one stays intact if routing fails
                    accumulate = True  # on the private copy
        topk_weights, topk_idx, info = _topk_route(
            logits, self.config,
            RouteInputs(expert_bias=self.expert_bias, replay_idx=replay_idx,
                        padding_mask=padding_mask, qb_beta=self.qb_beta,
                        global_aux_loss_state=gstate),
            RouteOptions(invalid_replay_rows=invalid, layer=self.layer_number,
                         seq_length=seq_length, training=self.training,
                         accumulate_global_aux_loss=accumulate,
                         aux_loss_grad_scale=self.aux_loss_grad_scale,
                         # force_biased < 0: Megatron draws the bias once per layer and reuses it.
                         force_bias_seed=((0x5EED0000 + (self.layer_number or 0)) & (2**62 - 1)
                                          if (self.config.force_biased or 0) < 0 else None)),
            RouteComms(loss=self.loss_comm, global_aux_loss=self.global_aux_loss_comm),
            self._config_key)
        if driven:
            replay.forward_done(topk_idx, T, will_recompute)
            if snapshot is not None:
                # One snapshot per table still queued for recompute (the replay may have been
                # cleared, or earlier forwards never recomputed).
                while len(self._gstate_snapshots) > max(replay.num_pending_recompute - 1, 0):
                    self._gstate_snapshots.popleft()
                self._gstate_snapshots.append(snapshot)
            elif gstate is not None and replay.action == "recompute" and \
                    self._gstate_snapshots:
                self._gstate_snapshots.popleft()
        if self.local_tokens_per_expert is not None and torch.is_grad_enabled():
            # Megatron's _apply_expert_bias counts every forward with grad enabled, eval included.
            self.local_tokens_per_expert += info.num_tokens_per_expert.to(torch.float64)
        if self.qb_beta is not None and _trained_forward(self.training):
            self.qb_beta_accum += info.qb_beta_local
            self.qb_beta_count += 1
        self.last_info = info
        return topk_weights, topk_idx

    @torch.no_grad()
    def update_qb_beta(self, ema=0.0, comm=None):
        """Quantile balancing, once per global batch (Megatron's _update_router_qb_beta,
        moe_router_quantile_balancing_ema = ema): the mean of the accumulated quantiles, averaged
        over ``comm`` (Megatron's dp_cp group; collective, deterministic) when given, then
        qb_beta = ema*qb_beta + (1-ema)*avg re-centred to mean 0; the accumulators restart."""
        if self.qb_beta is None:
            raise ValueError("[TopKRouter] update_qb_beta needs aux_loss_type='quantile_balancing'")
        self.qb_beta.copy_(_C.update_qb_beta(self.qb_beta, self.qb_beta_accum,
                                             int(self.qb_beta_count), float(ema), _comm(comm)))
        self.qb_beta_accum.zero_()
        self.qb_beta_count.zero_()

    @torch.no_grad()
    def update_expert_bias(self, rate, comm=None):
        """expert_bias += rate * sign(mean(c) - c) with the counts since the last update (summed
        over ``comm``, Megatron's tp_dp_cp group, when given: collective)."""
        if self.expert_bias is None:
            raise ValueError("[TopKRouter] update_expert_bias needs enable_expert_bias=True")
        self.expert_bias.copy_(update_expert_bias(self.expert_bias, self.local_tokens_per_expert,
                                                  rate, comm))
        self.local_tokens_per_expert.zero_()
