"""switchyard.torch: drop-in autograd pieces for PyTorch training stacks.

    import switchyard.torch as syt
    logits = syt.router_gating_linear(x, weight, bias=None, router_dtype=torch.float32)

Tensors cross into the engine without copies when they are contiguous CPU tensors; other layouts are
made contiguous once. A CUDA tensor or a wrong dtype raises ValueError naming the argument.
"""
import torch

from . import _switchyard as _C

__all__ = ["router_gating_linear", "AlltoAllDispatcher", "AllGatherDispatcher", "DispatchHandle"]


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


# --------------------------------------------------------------------------------------------------
# Expert-parallel dispatchers
# --------------------------------------------------------------------------------------------------
def _idx32(topk_idx, op):
    if not isinstance(topk_idx, torch.Tensor):
        raise ValueError(f"[{op}] topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dtype == torch.int32:
        return topk_idx
    if topk_idx.dtype != torch.int64:
        raise ValueError(f"[{op}] topk_idx must have dtype int64 or int32, got {topk_idx.dtype}")
    if topk_idx.numel() and (int(topk_idx.max()) > 2**31 - 1 or int(topk_idx.min()) < -2**31):
        raise ValueError(f"[{op}] topk_idx holds ids outside the int32 range")
    return topk_idx.to(torch.int32)


class DispatchHandle:
    """What combine and the backwards need, returned by ``dispatch``. ``tokens_per_expert`` [L]
    int64 (rows per local expert, ascending), ``expert_offsets`` [L+1], ``recv_src_rank`` /
    ``recv_src_token`` [R]: the source of every received row. Integers, never differentiable."""

    def __init__(self, c_handle, probs, comm):
        self._c = c_handle
        self._probs = probs
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._c, name)

    def __repr__(self):
        h = self._c
        return (f"<DispatchHandle {h.kind} rank {h.rank}/{h.world_size}: {h.num_tokens} tokens, "
                f"{h.num_recv_tokens} received rows, {h.num_local_experts} local experts>")


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, topk_idx32, disp, box):
        with _no_autocast():
            w = probs.detach().to(torch.float32)
            recv_x, recv_w, h = _C.dispatch(x.detach(), topk_idx32, w, disp.num_experts, disp.kind,
                                            disp._capacity_factor, disp.token_drop_policy,
                                            disp.ep_comm)
        box.append(h)
        ctx.h = h
        ctx.comm = disp.ep_comm
        ctx.num_tokens = x.shape[0]
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        grad_x = grad_p = None
        # Collectives: every rank takes the same branches (needs_input_grad is the same everywhere).
        if ctx.needs_input_grad[0]:
            grad_x = _C.dispatch_backward(grad_recv_x.contiguous(), ctx.h, ctx.comm)
        if ctx.needs_input_grad[1]:
            # d recv_w[row] / d probs[t,k] = 1 for the slots of that row: send the row gradients
            # back with combine's weight-gradient path (<expert_y[row], grad_y[t]> with grad_y = 1).
            ones = torch.ones(ctx.num_tokens, 1, dtype=torch.float32)
            gw = grad_recv_w.to(torch.float32).reshape(-1, 1).contiguous()
            _, grad_p = _C.combine_backward(ones, gw, ctx.h, True, ctx.comm)
        return grad_x, grad_p, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, probs, handle, apply_probs):
        with _no_autocast():
            y = _C.combine(expert_out.detach(), handle._c, apply_probs, handle._comm)
        ctx.save_for_backward(expert_out)
        ctx.handle = handle
        ctx.apply_probs = apply_probs
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (expert_out,) = ctx.saved_tensors
        h = ctx.handle
        grad_y = grad_y.to(expert_out.dtype).contiguous()
        grad_e, grad_w = _C.combine_backward(grad_y, expert_out.detach(), h._c, ctx.apply_probs,
                                             h._comm)
        grad_p = grad_w if (ctx.apply_probs and ctx.needs_input_grad[1]) else None
        return (grad_e if ctx.needs_input_grad[0] else None), grad_p, None, None


class _Dispatcher:
    kind = None

    def __init__(self, num_experts, ep_comm=None, capacity_factor=None, token_drop_policy="probs"):
        from . import dist
        self.ep_comm = dist.as_communicator(ep_comm)
        ep = self.ep_comm.size
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % ep != 0:
            raise ValueError(f"[{type(self).__name__}] num_experts must be a positive multiple of "
                             f"the ep size {ep}, got num_experts={num_experts}")
        if token_drop_policy not in ("probs", "position"):
            raise ValueError(f"[{type(self).__name__}] token_drop_policy must be 'probs' or "
                             f"'position', got {token_drop_policy!r}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.capacity_factor = capacity_factor
        self._capacity_factor = 0.0 if capacity_factor is None else float(capacity_factor)
        self.token_drop_policy = token_drop_policy

    @property
    def local_expert_ids(self):
        """Global ids of this rank's experts: [rank*L, (rank+1)*L)."""
        r = self.ep_comm.rank
        return range(r * self.num_local_experts, (r + 1) * self.num_local_experts)

    def dispatch(self, x, probs, topk_idx):
        """Send every distinct valid (token, expert) pair to the expert's rank. Collective.

        x [T, H] fp32/bf16; probs [T, K] (routing weights, sent in fp32); topk_idx [T, K] int64
        or int32 (-1 = none). Returns (recv_x [R, H] in x's dtype, recv_probs [R] fp32, handle):
        rows grouped by local expert ascending (handle.tokens_per_expert[i] rows for local expert
        i), then by source rank and token. Differentiable in x and probs."""
        op = f"{type(self).__name__}.dispatch"
        if not isinstance(probs, torch.Tensor):
            raise ValueError(f"[{op}] probs must be a torch.Tensor, got {type(probs).__name__}")
        if probs.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"[{op}] probs must have dtype float32 or float64, got {probs.dtype}")
        box = []
        recv_x, recv_p = _Dispatch.apply(x, probs, _idx32(topk_idx, op), self, box)
        return recv_x, recv_p, DispatchHandle(box[0], probs, self.ep_comm)

    def combine(self, expert_out, handle, apply_probs=True):
        """y [T, H] = Σ_k probs[t,k]·expert_out[row(t,k)], summed in fp32 in k order on the token's
        own rank (deterministic, identical for any ep size). ``apply_probs=False`` when the experts
        already applied recv_probs. Collective; differentiable in expert_out and (with apply_probs)
        the probs given to dispatch."""
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"[{type(self).__name__}.combine] handle must be the DispatchHandle "
                             f"returned by dispatch, got {type(handle).__name__}")
        return _Combine.apply(expert_out, handle._probs, handle, bool(apply_probs))


class AlltoAllDispatcher(_Dispatcher):
    """Expert-parallel dispatcher over MPI all-to-all: each pair goes to its expert's rank only.
    Rank r holds experts [r*L, (r+1)*L), L = num_experts / ep size."""
    kind = "all_to_all"


class AllGatherDispatcher(_Dispatcher):
    """Expert-parallel dispatcher over all-gather: every rank gathers every token and keeps the
    pairs of its own experts. Bitwise the same results as AlltoAllDispatcher."""
    kind = "all_gather"
