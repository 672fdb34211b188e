"""switchyard.integrations.megatron.replay: router replay inside Megatron-Core's TopKRouter, an
adapter over the replay core (switchyard.replay: the row rule, the all-or-nothing ReplayDriver that
owns the queues, the recompute detector) -- per-router state (``_RouterState``: key, options,
counts), the patched ``TopKRouter.forward`` / ``routing`` and ``tensor_parallel.checkpoint``, and the public
replay API (attach_replay, set_replay_targets, set_replay_action, replay_counts, ...). See the
package docstring."""
from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

import torch

import switchyard as _sy
from switchyard import _names
import switchyard.replay as _syr
import switchyard.torch as _syt

from switchyard.replay import ReplayCounts, ReplayRows

from .._adapter import lifecycle
from .config import topk_options

_LIFE = lifecycle("megatron")  # patch.apply() / remove() set it


_Fn = Callable[..., Any]

Model = Union[torch.nn.Module, "list[torch.nn.Module]"]
"""A Megatron model: one module, or the list of its virtual-pipeline chunks."""
Key = Union[int, "tuple[str, int]"]
"""A router's key: its decoder layer number, or ("mtp", n) for an MTP layer."""

# --------------------------------------------------------------------------------------------------
# Replay state per router
# --------------------------------------------------------------------------------------------------
class _RouterState:
    """What the adapter keeps per router besides the core's queues: the key, the shared
    switchyard.replay.ReplayDriver, options and counts."""

    def __init__(self, key: Key, router: Any, replay: _sy.RouterReplay, aux_loss_routes: str,
                 max_pending_backward: int) -> None:
        self.key = key
        self.replay = replay
        self.driver: Any = None  # set by attach_replay: one driver for the model's routers
        self.num_experts: int = router.config.num_moe_experts
        self.top_k: int = router.config.moe_router_topk
        self.aux_loss_routes = aux_loss_routes
        self.max_pending_backward = max_pending_backward
        self.last = ReplayCounts()
        self.total = ReplayCounts()
        self.last_num_pairs: int | None = None
        self.input_requires_grad = False

    def label(self) -> str:
        k = self.key
        return f"mtp layer {k[1]}" if isinstance(k, tuple) else f"layer {k}"


def _num_pairs(rows: ReplayRows, K: int) -> int:
    """(token, expert) pairs routed: the replayed rows' (merged rows count each id once) plus K
    per natively routed row."""
    return rows.num_pairs + K * rows.num_native


# One entry per active call of Megatron's tensor_parallel.checkpoint: whether a backward (and so
# a recompute) will follow it (grad enabled at the call, an input that requires grad, no CUDA-graph
# capture, where Megatron runs the function without checkpointing).
_CKPT_STACK: list[bool] = []


def _checkpoint_says() -> bool | None:
    """What the innermost active tensor_parallel.checkpoint calls said (any of them: a backward
    follows), or None outside them (switchyard.replay.will_recompute's ``checkpoint``)."""
    return any(_CKPT_STACK) if _CKPT_STACK else None


def make_checkpoint(orig: _Fn) -> _Fn:
    """The wrapper ``apply()`` installs over Megatron-Core's tensor_parallel.checkpoint, noting
    whether a recompute will follow the call.

    Args:
        orig: the original function.

    Returns:
        The wrapper (functools.wraps of ``orig``).
    """
    @functools.wraps(orig)
    def checkpoint(function: _Fn, distribute_saved_activations: bool, *args: Any) -> Any:
        will = torch.is_grad_enabled() and any(torch.is_tensor(a) and a.requires_grad
                                               for a in args)
        if will:
            try:
                from megatron.core.transformer.cuda_graphs import (is_graph_capturing,
                                                                   is_graph_warmup)
                will = not (is_graph_warmup() or is_graph_capturing())
            except ImportError:
                pass
        _CKPT_STACK.append(will)
        try:
            return orig(function, distribute_saved_activations, *args)
        finally:
            _CKPT_STACK.pop()
    return checkpoint


def _ids_for_forward(st: _RouterState, T: int) -> ReplayRows | None:
    """The ReplayRows this forward replays (None: route natively), from the replay core: queued
    for the recompute when one will follow, taken back when this forward is that recompute."""
    action = st.replay.action
    if action in (None, "record"):
        return None
    d = st.driver
    if action == "recompute" or (_syr.in_recompute() and torch.is_grad_enabled()):
        rows: ReplayRows = d.take_recompute(st.key, T)  # the engine's FIFO checks T against the table
        if _syr.will_recompute(checkpoint=_checkpoint_says()):  # a nested checkpoint: queue again
            d.queue_recompute(st.key, rows.ids)
        return rows
    rows = d.take_forward(st.key, T)  # taken whether the forward goes on or fails
    # Queue for the recompute only when one will come: inside a call of Megatron's
    # tensor_parallel.checkpoint (full and selective recompute) that a backward will follow, or,
    # outside it, a forward under no_grad whose inputs require grad (another reentrant
    # checkpoint, e.g. Transformer Engine's). Forward-only passes, also through a checkpoint under
    # no_grad, and forwards that keep their graph queue nothing.
    if _syr.will_recompute(st.input_requires_grad, checkpoint=_checkpoint_says()):
        n = st.replay.num_pending_recompute
        if n >= st.max_pending_backward:
            raise ValueError(f"[megatron.replay] {st.label()}: {n} checkpointed "
                             f"forwards are waiting for their backward (max_pending_backward="
                             f"{st.max_pending_backward}); call clear_replay between steps")
        d.queue_recompute(st.key, rows.ids)
    return rows


# --------------------------------------------------------------------------------------------------
# Router patches
# --------------------------------------------------------------------------------------------------
def make_router_forward(orig: _Fn) -> _Fn:
    """The wrapper ``apply()`` installs over Megatron-Core's TopKRouter.forward, noting the
    attached router's input for replay.

    Args:
        orig: the original function.

    Returns:
        The wrapper (functools.wraps of ``orig``).
    """
    @functools.wraps(orig)
    def forward(self: Any, input: torch.Tensor, padding_mask: torch.Tensor | None = None) -> Any:
        st = getattr(self, "_sy", None)
        if st is not None:
            st.input_requires_grad = bool(input.requires_grad)
            st.last_num_pairs = None
        return orig(self, input, padding_mask)
    return forward


def _ids_from_map(routing_map: torch.Tensor, K: int) -> torch.Tensor:
    """[T, E] bool with K True per row -> [T, K] ids ascending, without a host sync."""
    E = routing_map.shape[1]
    ar = torch.arange(E, device=routing_map.device, dtype=torch.int64)
    return torch.where(routing_map, ar, E).sort(dim=1).values[:, :K]


def _native(self: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's own native routing of this router (any path: fused, sinkhorn, QB)."""
    cfg = self.config
    if self.routing_type == "sinkhorn":
        return self.sinkhorn_load_balancing(logits)
    if self.routing_type == "quantile_balancing":
        return self.quantile_balancing(logits)
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    return topk_routing_with_score_function(
        logits, self.topk, use_pre_softmax=cfg.moe_router_pre_softmax,
        num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
        scaling_factor=cfg.moe_router_topk_scaling_factor, score_function=self.score_function,
        expert_bias=self.expert_bias, fused=cfg.moe_router_fusion, router_replay=None)


class _GivenIds:
    """Megatron's replay hook (``router_replay.get_replay_topk``, the same call its own
    RouterReplay answers in REPLAY_FORWARD) handing over ids switchyard validated: Megatron's
    score function then computes the weights at those ids, on every version from 0.16.

    It answers with the scores at the ids but names the slots 0..K-1 as their "experts", so the
    [T, E] output Megatron scatters holds each slot's weight in its own column (distinct columns:
    nothing is overwritten, and the scatter's backward hands each slot its own gradient). A row
    that repeats an id keeps all its slots; ``_replayed`` adds them up at their experts."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.arange(self.ids.shape[1], device=self.ids.device).expand_as(self.ids)
        return scores.gather(1, self.ids), slots


def _replayed(self: Any, logits: torch.Tensor, ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E], routing_map [T, E]) at given ids [T, K] with Megatron's score function
    (unfused math: the fused kernel cannot take given ids). A repeated id is one pair whose
    weight is the sum over its slots: the K slot weights are scatter-added into [T, E], so the
    backward gives each slot the gradient at its expert once (the derivative of that sum)."""
    cfg = self.config
    T, E = logits.shape
    K = ids.shape[1]
    if self.routing_type == "sinkhorn":
        # Megatron's sinkhorn weights: sigmoid for K = 1, softmax over all experts otherwise
        # (its _sinkhorn_activation), at the ids.
        act = torch.sigmoid(logits) if self.topk == 1 else \
            torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        slot_w = act.gather(1, ids)
    else:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
        # No expert_bias: it only selects, and with it Megatron would gather the scores at the
        # returned indices (here the slot numbers) instead of taking the hook's scores.
        probs, _ = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=cfg.moe_router_pre_softmax,
            scaling_factor=cfg.moe_router_topk_scaling_factor, score_function=self.score_function,
            expert_bias=None, fused=False, router_replay=_GivenIds(ids))
        slot_w = probs[:, :K]  # slot k's weight sits in column k (see _GivenIds)
    # A repeated id's slots gather the same score and so carry equal weights: their sum does not
    # depend on the order scatter_add adds them in.
    probs = torch.zeros_like(logits).scatter_add(1, ids, slot_w.type_as(logits))
    routing_map = torch.zeros(T, E, dtype=torch.bool, device=logits.device).scatter(1, ids, True)
    return probs, routing_map


def make_router_routing(orig: _Fn) -> _Fn:
    """The wrapper ``apply()`` installs over Megatron-Core's TopKRouter.routing, validated keyed
    replay and record on attached routers.

    Args:
        orig: the original function.

    Returns:
        The wrapper (functools.wraps of ``orig``).
    """
    @functools.wraps(orig)
    def routing(self: Any, logits: torch.Tensor, padding_mask: torch.Tensor | None = None
                ) -> Any:
        st = getattr(self, "_sy", None)
        if st is None:
            return orig(self, logits, padding_mask)
        cfg = self.config
        E, K = cfg.num_moe_experts, self.topk
        seq_length, bsz = logits.shape[:2]
        T = logits.numel() // E
        tgt = _ids_for_forward(st, T)
        action = st.replay.action
        if _LIFE.options.get("engine") == "cpu" and not logits.is_cuda and \
                self.routing_type not in ("sinkhorn", "quantile_balancing"):
            return _engine_routing(self, st, tgt, logits, padding_mask)
        if tgt is None and action is None:  # native: Megatron's routing, unchanged
            st.last = ReplayCounts.of_native(T)
            st.total.add(st.last)
            st.last_num_pairs = T * K  # every native path selects K distinct experts per row
            return orig(self, logits, padding_mask)
        logits = logits.view(-1, E)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        if tgt is None:  # "record" (_ids_for_forward gives no target then), or no target
            probs, routing_map = _native(self, logits)
            if action == "record" and not _syr.in_recompute():  # a recompute records nothing
                st.replay.record(_ids_from_map(routing_map, K).to("cpu", torch.int32))
            counts = ReplayCounts.of_native(T)
            st.last_num_pairs = T * K
        else:
            dev_ids = tgt.resolved_ids().to(logits.device, torch.int64, non_blocking=True)
            native_rows = (~tgt.replayed).to(logits.device, non_blocking=True)
            native = _native(self, logits) if tgt.num_native > 0 else None
            if native is not None:  # native rows take the native ids, so weights are defined
                dev_ids = torch.where(native_rows[:, None], _ids_from_map(native[1], K), dev_ids)
            probs, routing_map = _replayed(self, logits, dev_ids)
            if native is not None:
                probs = torch.where(native_rows[:, None], native[0], probs)
                routing_map = torch.where(native_rows[:, None], native[1], routing_map)
            counts = ReplayCounts.of_rows(tgt)
            st.last_num_pairs = _num_pairs(tgt, K)
        return _finish(self, st, tgt, logits, probs, routing_map, counts, padding_mask,
                       seq_length, bsz)
    return routing


def _finish(self: Any, st: _RouterState, tgt: ReplayRows | None, logits: torch.Tensor,
            probs: torch.Tensor, routing_map: torch.Tensor, counts: ReplayCounts,
            padding_mask: torch.Tensor | None, seq_length: int, bsz: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's steps after top-k, on the routes used: capacity, aux losses, expert bias."""
    from megatron.core.transformer.moe.moe_utils import (
        apply_router_token_dropping, compute_routing_scores_for_aux_loss)
    cfg = self.config
    K = self.topk
    st.last = dataclasses.replace(counts, calls=1)
    st.total.add(st.last)

    if cfg.moe_expert_capacity_factor is not None:
        probs, routing_map = apply_router_token_dropping(
            probs, routing_map, router_topk=K, capacity_factor=cfg.moe_expert_capacity_factor,
            drop_policy=cfg.moe_token_drop_policy,
            pad_to_capacity=cfg.moe_pad_expert_input_to_capacity)
        st.last_num_pairs = None

    if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
        map_aux, scores_aux = compute_routing_scores_for_aux_loss(
            logits, K, self.score_function, fused=cfg.moe_router_fusion,
            padding_mask=padding_mask)
        if tgt is not None and st.aux_loss_routes == "used":
            # The load-balancing loss counts the experts the tokens were sent to: replayed
            # rows count their replayed ids, native rows Megatron's own aux-loss map.
            rep = tgt.replayed.to(logits.device)[:, None]
            used = routing_map if padding_mask is None else routing_map & ~padding_mask[:, None]
            map_aux = torch.where(rep, used, map_aux)
        wpm = padding_mask is not None
        probs = self._apply_aux_loss(probs, scores_aux, map_aux, with_padding_mask=wpm)
        probs = self._apply_seq_aux_loss(probs, scores_aux, map_aux, seq_length, bsz,
                                         with_padding_mask=wpm)
        probs = self._apply_global_aux_loss(probs, scores_aux, map_aux, with_padding_mask=wpm)
    self._apply_expert_bias(routing_map, padding_mask=padding_mask)
    return probs, routing_map


def _engine_routing(self: Any, st: _RouterState, tgt: ReplayRows | None, logits: torch.Tensor,
                    padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU tensors with apply(engine="cpu"): switchyard's topk_route (Megatron's score functions
    and option names mapped; weights differentiable to the logits) for native and replayed rows;
    rows that repeat an id (merged) take Megatron's math at their ids, as on CUDA."""
    cfg = self.config
    E, K = cfg.num_moe_experts, self.topk
    seq_length, bsz = logits.shape[:2]
    logits = logits.view(-1, E)
    T = logits.shape[0]
    if padding_mask is not None:
        padding_mask = padding_mask.reshape(-1)
    logits = self.apply_z_loss(logits, padding_mask=padding_mask)
    rc = _sy.RouterConfig(**topk_options(cfg))  # the one option map (config.py)
    # bf16 logits (moe_router_dtype=None with bf16 activations) route as Megatron routes them.
    lg = logits if logits.dtype in (torch.bfloat16, torch.float32, torch.float64) else \
        logits.float()
    replay_idx = None
    if tgt is not None:
        replay_idx = tgt.resolved_ids().masked_fill(tgt.merged[:, None], -1)
    w, idx, info = _syt.topk_route(
        lg, rc, _syt.RouteInputs(expert_bias=self.expert_bias, replay_idx=replay_idx),
        _syt.RouteOptions(layer=st.key if isinstance(st.key, int) else None))
    if st.replay.action == "record" and not _syr.in_recompute():
        st.replay.record(idx.to(torch.int32))
    probs = torch.zeros_like(lg).scatter_add(1, idx, w).type_as(logits)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
    if tgt is not None and tgt.num_merged:
        merged = tgt.merged[:, None]
        ids = torch.where(merged, tgt.ids.to(torch.int64), idx)
        p_m, map_m = _replayed(self, logits, ids)
        probs = torch.where(merged, p_m, probs)
        routing_map = torch.where(merged, map_m, routing_map)
    if tgt is None:
        counts = ReplayCounts.of_native(T)
        st.last_num_pairs = T * K
    else:
        counts = ReplayCounts.of_rows(tgt)
        st.last_num_pairs = _num_pairs(tgt, K)
    return _finish(self, st, tgt, logits, probs, routing_map, counts, padding_mask, seq_length,
                   bsz)



# --------------------------------------------------------------------------------------------------
# Attaching replays to a model
# --------------------------------------------------------------------------------------------------
def _routers(model: Model) -> list[Any]:
    from megatron.core.transformer.moe.router import TopKRouter
    modules = model.modules() if isinstance(model, torch.nn.Module) else \
        (m for part in model for m in part.modules())
    return [m for m in modules if isinstance(m, TopKRouter)]


def _key(router: Any) -> Key:
    if router.layer_number is None:
        raise ValueError("[megatron.attach_replay] a TopKRouter has no layer_number (build the "
                         "model through TransformerLayer, or call set_layer_number)")
    n = int(router.layer_number)
    return ("mtp", n) if getattr(router, "is_mtp_layer", False) else n


def attach_replay(model: Model, *, invalid_replay_rows: str = "error",
                  aux_loss_routes: str = "used", max_pending_backward: int = 64,
                  repeated_ids: str | None = None) -> dict[Key, _sy.RouterReplay]:
    """Gives every TopKRouter of ``model`` (a module, or a list of VPP chunks) its own
    ``switchyard.RouterReplay``, keyed by layer number: ``int`` for decoder layers (Megatron's
    global 1-based ``layer_number``, so pipeline stages and VPP chunks keep their keys), ``("mtp",
    n)`` for MTP layers. Returns ``{key: RouterReplay}``; the replay's ``action`` is None (route
    natively) until ``set_replay_action``.

    The replay queues are one switchyard.replay.ReplayDriver for all of the model's routers: all
    or nothing (set_replay_targets classifies every layer's table before any is queued; a forward
    of ``model`` -- or of a VPP chunk -- that fails drops, in each of its layers, the target not
    yet taken and the recompute tables queued during it).

    ``invalid_replay_rows`` (switchyard.replay.POLICIES): "error" (default: a ValueError naming
    layer, token and row), "merge" (a row whose only fault is a repeated id sends that pair once,
    its weights summed: what zero-filled padding rows from a rollout become; other invalid rows
    are errors) or "native" (every invalid row -- repeated id, -1 mixed with ids, id outside
    [0, E) -- routed natively and counted). ``repeated_ids`` (its name before 0.3.0) is a
    TypeError naming it.
    ``aux_loss_routes``: "used" (default: replayed rows
    count their replayed experts in the load-balancing loss) or "native" (Megatron's own map).
    ``max_pending_backward``: bound on checkpointed forwards waiting for their recompute.

    Raises RuntimeError before ``apply()``, ValueError for another policy or aux_loss_routes, a
    TopKRouter without layer_number, or two routers with one key (attaching again replaces the
    earlier replays).

    Args:
        model: a module, or a list of VPP chunks.
        invalid_replay_rows: "error", "merge" or "native".
        aux_loss_routes: "used" or "native".
        max_pending_backward: the bound on checkpointed forwards waiting for their recompute.
        repeated_ids: removed in 0.3.0 (a TypeError naming invalid_replay_rows).

    Returns:
        {key: switchyard.RouterReplay}.

    Raises:
        RuntimeError: before ``apply()``.
        ValueError: as above.
        TypeError: for ``repeated_ids``.
    """
    if repeated_ids is not None:  # removed in 0.3.0: the error names the new keyword
        _names.check_kwargs("megatron.attach_replay", {"repeated_ids": repeated_ids})
    _syr.check_policy(invalid_replay_rows, "megatron.attach_replay")
    if aux_loss_routes not in ("used", "native"):
        raise ValueError("[megatron.attach_replay] aux_loss_routes must be 'used' or 'native', "
                         f"got {aux_loss_routes!r}")
    if not _LIFE.is_applied:
        raise RuntimeError("[megatron.attach_replay] call switchyard.integrations.megatron.apply() "
                           "first")
    routers = _routers(model)
    out: dict[Key, _sy.RouterReplay] = {}
    states: dict[Key, _RouterState] = {}
    for r in routers:
        k = _key(r)
        if k in out:
            raise ValueError(f"[megatron.attach_replay] two routers have the key {k!r}")
        out[k] = _sy.RouterReplay(top_k=r.config.moe_router_topk,
                                  layer=k if isinstance(k, int) else None,
                                  invalid_replay_rows=invalid_replay_rows,
                                  num_experts=r.config.num_moe_experts)
        states[k] = _RouterState(k, r, out[k], aux_loss_routes, int(max_pending_backward))
    detach_replay(model)
    driver = _syr.ReplayDriver(out, label=_label)
    for r in routers:
        st = states[_key(r)]
        st.driver = driver
        r._sy = st
    # A step is one forward of the model (of each VPP chunk): begin, and end (failed or not).
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for c in chunks:
        keys = [_key(r) for r in _routers(c)]
        # (a plain attribute on the module: nn.Module's __setattr__ types it as a submodule)
        c._sy_step_hooks = (  # type: ignore[assignment]
            c.register_forward_pre_hook(lambda m, a, keys=keys: driver.begin_step(keys)),
            c.register_forward_hook(
                lambda m, a, out, keys=keys: driver.end_step(
                    keys, failed=out is None and sys.exc_info()[1] is not None),
                always_call=True))
    return out


def _label(k: Key) -> str:
    return f"mtp layer {k[1]}" if isinstance(k, tuple) else f"layer {k}"


def detach_replay(model: Model) -> None:
    """Removes the replays ``attach_replay`` gave ``model``'s routers (module or list of VPP
    chunks): they route with Megatron's code again. Idempotent.

    Args:
        model: a module, or a list of VPP chunks.
    """
    for r in _routers(model):
        if getattr(r, "_sy", None) is not None:
            r._sy = None
    for c in [model] if isinstance(model, torch.nn.Module) else list(model):
        for h in c.__dict__.pop("_sy_step_hooks", ()):
            h.remove()


def _states(model: Model) -> dict[Key, _RouterState]:
    out: dict[Key, _RouterState] = {}
    for r in _routers(model):
        st = getattr(r, "_sy", None)
        if st is not None:
            out[st.key] = st
    return out


def replays(model: Model) -> dict[Key, _sy.RouterReplay]:
    """{key: switchyard.RouterReplay} of ``model``'s attached routers (empty when none is).

    Args:
        model: a module, or a list of VPP chunks.

    Returns:
        {key: switchyard.RouterReplay}.
    """
    return {k: st.replay for k, st in _states(model).items()}


def set_replay_action(model: Model, action: str | None, keys: Iterable[Key] | None = None
                      ) -> None:
    """Sets ``action`` (None, "record", "replay_forward", "recompute") on the attached
    routers named by ``keys`` (default: all). "recompute" is optional: a recompute inside
    backward is detected. A router in "replay_forward" without a target (and nothing recorded)
    raises at its forward; leave layers the rollout has no routes for (MTP) at None. ValueError
    for a key that names no attached router, or another action.

    Args:
        model: a module, or a list of VPP chunks.
        action: None, "record", "replay_forward" or "recompute".
        keys: the routers' keys (None: all).

    Raises:
        ValueError: as above.
    """
    states = _states(model)
    for k in (states if keys is None else keys):
        if k not in states:
            raise ValueError(f"[megatron.set_replay_action] no attached router has the key {k!r}")
        states[k].replay.action = action


def clear_replay(model: Model) -> None:
    """Drops every queued table (targets, recorded, pending backward) and the counts.

    Args:
        model: a module, or a list of VPP chunks.
    """
    for st in _states(model).values():
        st.replay.clear()
        st.last = ReplayCounts()
        st.total = ReplayCounts()


def set_replay_targets(model: Model, targets: Mapping[Key, torch.Tensor], *,
                       num_tokens: int | None = None, group: Any = None) -> None:
    """Queues one replay table per layer for the next forward (R3), validated by the engine.

    ``targets``: {key: ids [T, K]} (keys as ``attach_replay``; int64, int32, int16, int8, uint8
    or uint16, any device; -1 = route natively; K = moe_router_topk). Every key must name an
    attached router of this model (pipeline stage); keys left out queue nothing.
    ``num_tokens``: the tokens the router will
    see, checked here. ``group``: a torch.distributed group (e.g. the EP group): every rank
    validates its own tables, then the ranks exchange the first error, so all raise the same
    ValueError (naming the rank) and none is left waiting in an all-to-all. Collective over
    ``group`` when given; without ``num_tokens`` the token count is checked at each layer's
    forward instead, again over ``group`` (one small exchange per layer and forward; give
    ``num_tokens`` to check here once). Returns None. ValueError (nothing queued on any layer)
    for an unknown key, a table that is not [T, K], an invalid row (by ``invalid_replay_rows``)
    or a token count that is not ``num_tokens``, or routers attached by several calls.

    Args:
        model: a module, or a list of VPP chunks.
        targets: {key: ids [T, K]}.
        num_tokens: the tokens the routers will see, or None.
        group: a torch.distributed group, or None.

    Raises:
        ValueError: as above, the same on every rank of ``group``.
    """
    states = _states(model)
    unknown = [k for k in targets if k not in states]
    err = None
    if unknown:
        err = (f"[megatron.set_replay_targets] no attached router has the key {unknown[0]!r} "
               f"(attached: {sorted(states, key=str)})")
    elif states:
        drivers = {id(st.driver) for st in states.values()}
        if len(drivers) != 1:
            err = ("[megatron.set_replay_targets] the routers were attached by several "
                   "attach_replay calls: set the targets of each attached model separately")
    if err is not None:
        _syr.raise_on_every_rank(err, group)
    if not states:
        return
    next(iter(states.values())).driver.set_step_targets(dict(targets), num_tokens=num_tokens,
                                                        group=group)


def replay_counts(model: Model, total: bool = False) -> dict[Key, ReplayCounts]:
    """{key: ReplayCounts} of the last routing call per layer (or summed since attach / clear
    with total=True), so a replay that did nothing is visible. Copies: changing them changes
    nothing.

    Args:
        model: a module, or a list of VPP chunks.
        total: False: the last call's counts; True: summed since attach / clear.

    Returns:
        {key: switchyard.replay.ReplayCounts}.
    """
    return {k: dataclasses.replace(st.total if total else st.last)
            for k, st in _states(model).items()}
