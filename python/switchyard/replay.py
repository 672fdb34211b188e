"""switchyard.replay: the one replay core every path uses (the engine's router, the HF, Megatron,
TRL and verl adapters). It holds

* ``POLICIES`` / ``check_policy``: the one vocabulary for invalid replay rows, "error" (default),
  "native" (routed natively and counted) and "merge" (a repeated id is one pair with its slots'
  weights summed; only where the dispatcher merges pairs: the Megatron adapter);
* ``classify_rows``: the engine's row rule (valid / all -1 -> native / invalid: mixed -1, repeated
  id, out of range), bound from C++ (switchyard::classify_replay_rows);
* ``recompute_kind`` / ``in_recompute``: the one detector of an activation-checkpoint recompute
  (the re-run of a forward inside backward; torch has no public API for it);
* ``RouterReplay``: the replay queues of one MoE layer (record, targets, recompute);
* ``ReplayDriver``: the step transaction over the per-layer queues of one model, all or nothing;
* ``ReplayCounts``: the rows one routing call (or a sum of calls) replayed and routed natively,
  the one count record every integration reports.

Row kinds (``ReplayRows.kind``, uint8): ``NATIVE`` = 0 (all -1: routed natively), ``REPLAYED`` = 1,
``INVALID`` = 3 (routed natively under policy "native"), ``MERGED`` = 4 (a repeated id merged).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from . import _ids
from . import _names
from . import _switchyard as _C

__all__ = ["POLICIES", "check_policy", "NATIVE", "REPLAYED", "INVALID", "MERGED", "ReplayRows",
           "classify_rows", "ReplayCounts", "RouterReplay", "ReplayDriver", "recompute_kind",
           "in_recompute", "will_recompute", "raise_on_every_rank"]

POLICIES = ("error", "native", "merge")
"""The invalid-replay-row policies, in the order of switchyard::ReplayRowPolicy."""

# Old spellings of ReplayRowPolicy values -> the new one.
_OLD_POLICIES = {"to_none": "native"}


def check_policy(policy: object, op: str, name: str = "invalid_replay_rows",
                 allowed: tuple[str, ...] = POLICIES) -> str:
    """Checks an invalid-replay-row policy.

    Args:
        policy: the value given.
        op: the calling operation, named in the message.
        name: the argument's name, named in the message.
        allowed: the values accepted (default POLICIES).

    Returns:
        ``policy`` (a str).

    Raises:
        ValueError: naming ``op``, ``name`` and the value when it is not one of ``allowed`` (an
            old spelling, "to_none", names the new one, "native").
    """
    if policy in _OLD_POLICIES and _OLD_POLICIES[policy] in allowed:
        raise ValueError(f"[{op}] {name}={policy!r} is now spelled {_OLD_POLICIES[policy]!r}")
    if not isinstance(policy, str) or policy not in allowed:
        raise ValueError(f"[{op}] {name} must be one of {', '.join(map(repr, allowed))}, got "
                         f"{policy!r}")
    return policy


# Row kinds (switchyard::ReplayRowKind).
NATIVE, REPLAYED, INVALID, MERGED = 0, 1, 3, 4


class ReplayRows:
    """A classified replay table: ``ids`` [T, K] int32 on the CPU as given, ``kind`` [T] uint8
    (NATIVE all -1, REPLAYED, INVALID routed natively, MERGED), the counts ``num_replayed`` (merged
    included), ``num_merged``, ``num_native`` (invalid included), ``num_invalid`` and
    ``num_pairs`` ((token, expert) pairs the replayed rows send). Made by ``classify_rows`` /
    ``ReplayDriver``, not directly; ``group``: the torch.distributed group a forward checks the
    token count over (None: local).

    Args:
        ids: int32 [T, K] on the CPU, the table classified.
        core: the engine's classification of ``ids`` (kinds and counts).
    """
    _COUNTS = ("num_replayed", "num_merged", "num_native", "num_invalid", "num_pairs")
    __slots__ = ("ids", "kind", "group", "_replayed", "_native_rows", "_core") + _COUNTS
    num_replayed: int
    num_merged: int
    num_native: int
    num_invalid: int
    num_pairs: int

    def __init__(self, ids: torch.Tensor, core: Any) -> None:
        self.ids = ids
        """int32 [T, K] on the CPU: the ids as given (-1 = no route)."""
        self.kind = core.kind
        """uint8 [T]: each row's kind (NATIVE, REPLAYED, INVALID, MERGED)."""
        self.group = None  # the torch.distributed group a forward checks the token count over
        """The torch.distributed group a forward checks the token count over (None: local)."""
        self._replayed: torch.Tensor | None = None  # the mask, made once (a forward reads it)
        self._native_rows: torch.Tensor | None = None
        self._core = core  # (makes the mask and the native rows in one pass)
        self.num_replayed = core.num_replayed  # (_COUNTS, one by one: this runs per layer and
        self.num_merged = core.num_merged      # forward)
        self.num_native = core.num_native
        self.num_invalid = core.num_invalid
        self.num_pairs = core.num_pairs

    @property
    def num_tokens(self) -> int:
        """T, the rows of ``ids``."""
        return self.ids.shape[0]

    @property
    def replayed(self) -> torch.Tensor:
        """[T] bool: rows that take their ids (merged included); computed once, do not modify."""
        if self._replayed is None:
            T = self.num_tokens
            if self.num_replayed in (0, T):  # from the counts (merged rows count as replayed)
                self._replayed = torch.full((T,), self.num_replayed == T, dtype=torch.bool)
            else:
                self._replayed = self._core.replayed  # (kind == REPLAYED) | (kind == MERGED)
        return self._replayed

    @property
    def native_rows(self) -> torch.Tensor:
        """int64 [n]: the rows routed natively (kinds NATIVE and INVALID: where ``replayed`` is
        False), in order; computed once, do not modify."""
        if self._native_rows is None:
            self._native_rows = self._core.native_rows
        return self._native_rows

    @property
    def all_replayed(self) -> bool:
        """Whether every row takes its ids (from the counts: no tensor is read)."""
        return self.num_replayed == self.num_tokens

    @property
    def merged(self) -> torch.Tensor:
        """[T] bool: rows whose repeated id was merged (policy "merge")."""
        return self.kind == MERGED

    def resolved_ids(self) -> torch.Tensor:
        """The ids a recompute replays.

        Returns:
            int32 [T, K]: ids with every natively routed row (all -1 or invalid) as -1
            (classified again with the same policy it gives the same kinds, invalid rows
            native).
        """
        return self.ids.masked_fill(~self.replayed[:, None], -1)


_ID_DTYPES = _ids.ID_DTYPES


def classify_rows(ids: torch.Tensor, num_experts: int, policy: str = "error",
                  layer: int | None = None, op: str = "replay") -> ReplayRows:
    """The replay row rule (the engine's): sorts every row of a replay table by kind.

    Args:
        ids: [T, K] ids of any integer dtype (switchyard._ids; any device; copied to the CPU as
            int32; -1 = route natively).
        num_experts: E (valid ids are in [0, E)).
        policy: "error": an invalid row (-1 mixed with ids, a repeated id, an id outside
            [0, E)) is the engine's ValueError naming layer, token and row; "native": invalid
            rows are kind INVALID (routed natively); "merge": a row whose only fault is a
            repeated id is MERGED, other invalid rows are the error.
        layer: the layer named in messages, or None.
        op: the operation named in messages.

    Returns:
        ReplayRows.

    Raises:
        ValueError: for an invalid row (by ``policy``), a non-tensor, a float / bool dtype, ids
            that are not 2-D, an id that does not fit int32 (never wrapped; under "native" its
            row is a counted invalid row) and an unknown policy.
    """
    if type(ids) is torch.Tensor and ids.dtype == torch.int32 and ids.is_cpu and \
            ids.dim() == 2 and ids.is_contiguous() and policy in POLICIES:
        # (what every check and conversion below leaves as it is: a table set_targets made, one
        # per layer and step; this is the replay path's per-layer Python)
        return ReplayRows(ids, _C.classify_replay_rows(ids, int(num_experts), policy,
                                                       -1 if layer is None else int(layer)))
    check_policy(policy, op)
    where = "" if layer is None else f"layer {layer}, "
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"[{op}] {where}replay ids must be a torch.Tensor, got "
                         f"{type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise ValueError(f"[{op}] {where}replay ids must have an integer dtype ({_ids.ACCEPTED}), "
                         f"got {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"[{op}] {where}replay ids must be [num_tokens, top_k], got "
                         f"{list(ids.shape)}")
    # The one narrowing of id tensors (a device sync on CUDA: needs the values). Under "native" an
    # id outside int32 saturates (outside [0, E) for every E), so its row is a counted invalid row.
    ids = _ids.to_int32(ids.detach().to("cpu"), op, f"{where}replay ids",
                        saturate=policy == "native")
    ids = ids.contiguous()
    core = _C.classify_replay_rows(ids, int(num_experts), policy,
                                   -1 if layer is None else int(layer))
    return ReplayRows(ids, core)


def recompute_kind() -> str | None:
    """The one recompute detector of switchyard: which activation-checkpoint recompute runs now.

    torch has no public API for it, so this reads torch.utils.checkpoint's own private state
    (pinned by the tests).

    Returns:
        None outside an activation-checkpoint recompute; inside one (a forward run by the
        autograd engine during backward) "non_reentrant" for
        torch.utils.checkpoint(use_reentrant=False) (its forward ran with grad and was counted)
        or "reentrant" (any other: torch's reentrant checkpoint, Megatron's CheckpointFunction,
        Transformer Engine's; their forward ran under no_grad). Inside a region torch.compile /
        torch.export traces: None (see in_recompute).
    """
    if _traced() or torch._C._current_graph_task_id() == -1:
        return None
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and bool(getattr(hooks[0], "_checkpoint_internal", False)):
        return "non_reentrant"
    return "reentrant"


def will_recompute(input_requires_grad: bool = False, checkpoint: bool | None = None) -> bool:
    """Whether a forward running now will be recomputed inside backward (so its replay ids must be
    queued for that recompute): the one decision every router path (``switchyard.torch``, the HF
    and Megatron adapters) takes it from.

    Args:
        input_requires_grad: whether the router's input requires grad (a reentrant checkpoint runs
            its forward under no_grad with such an input).
        checkpoint: what the adapter's framework said at the entry of the checkpoint call that
            runs this forward (transformers' ``gradient_checkpointing`` on a training layer with
            grad enabled; Megatron's ``tensor_parallel.checkpoint`` with grad enabled and an input
            that requires grad, outside CUDA-graph capture): True or False is taken as the
            answer; None (no such call known) lets torch's state decide.

    Returns:
        bool. With ``checkpoint`` None: False inside a recompute; inside
        torch.utils.checkpoint(use_reentrant=False)'s forward True (exact: its saved-tensor
        hooks); with grad disabled, ``input_requires_grad`` (a reentrant checkpoint's forward:
        torch's, Megatron's, Transformer Engine's; the layers of a reentrant block after its first
        see inputs that do not require grad, so checkpoint them one by one or non-reentrantly). A
        forward that keeps its graph, or a forward-only pass, is not recomputed. Inside a traced
        region: False, whatever ``checkpoint`` says (a compiled forward's recompute is its
        compiled backward's, fed the same graph inputs, so nothing is queued for it; see
        in_recompute).
    """
    if _traced():
        return False
    if checkpoint is not None:
        return bool(checkpoint)
    if torch._C._current_graph_task_id() != -1:
        return False  # a recompute itself (an adapter that nests checkpoints says so itself)
    if torch.is_grad_enabled():
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return hooks is not None and bool(getattr(hooks[0], "_checkpoint_internal", False))
    return bool(input_requires_grad)


def _traced() -> bool:
    """Whether torch.compile (dynamo) or torch.export is tracing this call: dynamo folds it to a
    constant, so the autograd-engine queries below are never traced (dynamo cannot trace
    torch._C._current_graph_task_id)."""
    return bool(torch.compiler.is_compiling())


def in_recompute() -> bool:
    """Whether the running forward is an activation-checkpoint recompute.

    Inside a region that torch.compile or torch.export traces the answer is fixed when it is
    traced: False. A compiled forward is never re-run in Python by a checkpoint: the checkpoint
    traced inside the region becomes part of the compiled graph, and its recompute runs in the
    compiled backward from the same graph inputs (the replay tensors staged before the forward
    included), so it routes exactly as the forward did without any detection.

    Returns:
        bool: ``recompute_kind() is not None`` (a forward run by the autograd engine during
        backward).
    """
    return not _traced() and torch._C._current_graph_task_id() != -1


def raise_on_every_rank(err: str | None, group: Any) -> None:
    """Raises the same error on every rank of ``group`` when any rank has one.

    Collective over ``group``: the ranks exchange their errors and all raise the lowest failing
    rank's, so no rank is left waiting in a later all-to-all.

    Args:
        err: this rank's error message (a str), or None (no error here).
        group: a torch.distributed group, or None (local: raise ``err`` if any).

    Raises:
        ValueError: ``err``, or the lowest failing rank's (naming that rank).
    """
    if group is not None:
        import torch.distributed as dist
        errors: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, err, group=group)
        for rank, e in enumerate(errors):
            if e is not None:
                raise ValueError(f"{e} (on rank {rank} of the group)")
    elif err is not None:
        raise ValueError(err)


@dataclasses.dataclass
class ReplayCounts:
    """The rows of one routing call (or summed over calls): what every integration reports, so a
    replay that did nothing is visible. ``replayed + native == tokens``.

    Made by ``of_rows`` / ``of_native`` (one call) and summed with ``add``; the Megatron adapter's
    ``replay_counts`` returns these, the HF adapter's ``Patch.counts()`` their fields as
    ``num_*`` keys.
    """
    calls: int = 0
    """Routing calls counted."""
    tokens: int = 0
    """Tokens (rows) routed."""
    replayed: int = 0
    """Rows that used their replay ids (merged rows included)."""
    merged: int = 0
    """Replayed rows that repeated an id (one pair, weights summed)."""
    native: int = 0
    """Rows routed by the live top-k (all -1, no replay, or invalid under "native")."""
    invalid: int = 0
    """Native rows that were invalid replay rows."""

    @classmethod
    def of_rows(cls, rows: ReplayRows) -> ReplayCounts:
        """The counts of one forward replaying ``rows``.

        Args:
            rows: a ReplayRows (from classify_rows or a ReplayDriver).

        Returns:
            ReplayCounts with ``calls`` 1.
        """
        return cls(calls=1, tokens=rows.num_tokens, replayed=rows.num_replayed,
                   merged=rows.num_merged, native=rows.num_native, invalid=rows.num_invalid)

    @classmethod
    def of_native(cls, num_tokens: int) -> ReplayCounts:
        """The counts of one forward that routed all its ``num_tokens`` rows natively.

        Args:
            num_tokens: T, the rows routed.

        Returns:
            ReplayCounts with ``calls`` 1 and ``native`` T.
        """
        return cls(calls=1, tokens=int(num_tokens), native=int(num_tokens))

    @classmethod
    def summed(cls, counts: Iterable[ReplayCounts]) -> ReplayCounts:
        """The sum of several counts (e.g. over a model's layers).

        Args:
            counts: an iterable of ReplayCounts.

        Returns:
            ReplayCounts, a new one.
        """
        total = cls()
        for c in counts:
            total.add(c)
        return total

    def add_rows(self, rows: ReplayRows) -> None:
        """Adds the counts of one forward replaying ``rows`` (``of_rows``), in place.

        Args:
            rows: a ReplayRows.
        """
        self.calls += 1
        self.tokens += rows.num_tokens
        self.replayed += rows.num_replayed
        self.merged += rows.num_merged
        self.native += rows.num_native
        self.invalid += rows.num_invalid

    def add_native(self, num_tokens: int) -> None:
        """Adds one forward that routed all its ``num_tokens`` rows natively (``of_native``), in
        place.

        Args:
            num_tokens: T, the rows routed.
        """
        self.calls += 1
        self.tokens += int(num_tokens)
        self.native += int(num_tokens)

    def add(self, other: ReplayCounts) -> None:
        """Adds ``other``'s counts to these, in place.

        Args:
            other: a ReplayCounts.
        """
        # Field by field, not through dataclasses.fields: this runs per layer and forward.
        self.calls += other.calls
        self.tokens += other.tokens
        self.replayed += other.replayed
        self.merged += other.merged
        self.native += other.native
        self.invalid += other.invalid


class RouterReplay:
    """Router replay of one MoE layer (R2 and R3), first in first out, as in the engine.

    Direct use (engine calls): ``record(topk_idx)``, ``pop_recorded()``,
    ``replay_forward(topk_idx) -> ids`` (queues a copy for the recompute) and
    ``recompute(num_tokens) -> ids``. "Recompute" is the activation-checkpoint re-run of a forward
    inside backward.

    Driven by a router (``syt.TopKRouter(...).forward(x, replay=this)``), ``action`` decides:
      None              route natively;
      "record"          route natively and record the ids (R2, old-log-prob pass);
      "replay_forward"  replay the next target (``set_target``, e.g. a route-table slice for R3) or,
                        when none is set, the oldest recorded table (R2), and queue it for
                        recompute;
      "recompute"       replay the oldest table queued by replay_forward (the checkpoint
                          recompute: set it before calling backward).
    Tables come back as int32 [T, K] tensors.

    Args:
        top_k: K, the ids per row (ValueError unless >= 1).
        layer: the layer named in messages (an int), or None.
        invalid_replay_rows: "error" (default), "native" or "merge" (POLICIES) for rows that mix
            -1 and ids, repeat an id or name an id outside [0, E); "merge" replays a row whose
            only fault is a repeated id with its slots as given (topk_route accepts it: each
            slot gets its share of the weights, which add up where the dispatcher or the
            experts sum a repeated expert's slots; other invalid rows stay errors).
        num_experts: E; when given, targets are classified by the engine's row rule as they are
            set (required by ReplayDriver).

    Raises:
        ValueError: for a top_k below 1 or another policy.
    """

    ACTIONS = (None, "record", "replay_forward", "recompute")
    """The values of ``action``."""

    def __init__(self, top_k: int, layer: int | None = None, invalid_replay_rows: str = "error",
                 num_experts: int | None = None) -> None:
        check_policy(invalid_replay_rows, "replay")
        self._c = _C.RouterReplayCore(int(top_k), -1 if layer is None else int(layer))
        self.top_k = int(top_k)
        """K, the ids per row."""
        self.num_experts = None if num_experts is None else int(num_experts)
        """E (ids in [0, E)), or None: targets are then classified at the forward."""
        self.invalid_replay_rows = invalid_replay_rows
        """"error", "native" or "merge"."""
        self._action: str | None = None
        # (step, table) of set_step_targets / set_target
        self._targets: collections.deque[tuple[int, ReplayRows | torch.Tensor]] = \
            collections.deque()
        self._last_step = 0  # the step of the last target a forward took

    @property
    def action(self) -> str | None:
        """One of ACTIONS (default None); setting another value is a ValueError."""
        return self._action

    @action.setter
    def action(self, value: str | None) -> None:
        if value == "replay_backward":
            raise ValueError("[replay] action 'replay_backward' was renamed 'recompute' (the old "
                             "name was removed in 0.3.0)")
        if value not in self.ACTIONS:
            raise ValueError(f"[replay] action must be one of {self.ACTIONS}, got {value!r}")
        self._action = value

    # Engine operations.
    def record(self, topk_idx: torch.Tensor) -> None:
        """Queues a copy of ``topk_idx`` as a recorded table (R2).

        Args:
            topk_idx: int32 or int64 [T, top_k] ids.

        Raises:
            ValueError: for another dtype or shape, or an int64 value outside int32.
        """
        self._c.record(topk_idx)

    def pop_recorded(self) -> torch.Tensor:
        """Removes and returns the oldest recorded table.

        Returns:
            int32 [T, K].

        Raises:
            IndexError: when none is queued.
        """
        return self._c.pop_recorded()

    def peek_recorded(self) -> torch.Tensor:
        """The table pop_recorded() would return, left queued.

        Returns:
            int32 [T, K].

        Raises:
            IndexError: when none is queued.
        """
        return self._c.peek_recorded()

    def replay_forward(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """Queues a copy of ``topk_idx`` for the recompute of this forward and returns it.

        Args:
            topk_idx: int32 or int64 [T, top_k] ids.

        Returns:
            int32 [T, K].

        Raises:
            ValueError: as ``record``.
        """
        return self._c.replay_forward(topk_idx)

    def peek_recompute(self, num_tokens: int) -> torch.Tensor:
        """The table recompute(num_tokens) would return, left queued.

        Args:
            num_tokens: T the recompute routes.

        Returns:
            int32 [T, K].

        Raises:
            IndexError: when none is queued.
            ValueError: when its T is not ``num_tokens``.
        """
        return self._c.peek_recompute(int(num_tokens))

    def recompute(self, num_tokens: int) -> torch.Tensor:
        """Removes and returns the oldest table queued by replay_forward (for its recompute).

        Args:
            num_tokens: T the recompute routes.

        Returns:
            int32 [T, K].

        Raises:
            IndexError: when none is queued.
            ValueError: when its T is not ``num_tokens``.
        """
        return self._c.recompute(int(num_tokens))

    def drop_newest_recompute(self, count: int) -> None:
        """Drops the ``count`` newest tables queued for recompute (those of a failed forward).

        Args:
            count: tables to drop (at most num_pending_recompute are).
        """
        self._c.drop_newest_recompute(int(count))

    def set_target(self, topk_idx: torch.Tensor) -> None:
        """Queues ids for the next forward with action "replay_forward" (R3).

        Args:
            topk_idx: [T, K] integer ids (-1 = route natively).

        Raises:
            ValueError: for another shape, or (with num_experts known, classified now) the
                engine's error for an invalid row.
        """
        self.set_step_targets([self], [topk_idx])

    @staticmethod
    def set_step_targets(replays: Iterable[RouterReplay], tables: Iterable[torch.Tensor]
                         ) -> None:
        """Queues ``tables[i]`` on ``replays[i]`` for the next forward, all or none.

        ReplayDriver.set_step_targets over these replays: rows classified now when every replay
        knows num_experts, else at the forward by topk_route; a step that some of these layers
        took and others did not is dropped first.

        Args:
            replays: RouterReplay objects.
            tables: one [T, K] id table per replay.

        Raises:
            ValueError: nothing queued, as ReplayDriver.set_step_targets.
        """
        replays = list(replays)
        ReplayDriver(dict(enumerate(replays)),
                     label=lambda i: f"layer {replays[i].layer}").set_step_targets(list(tables))

    def next_target(self) -> torch.Tensor:
        """The table the next "replay_forward" uses, left queued.

        Returns:
            The oldest target (set_target), else the oldest recorded table: int32 [T, K].

        Raises:
            IndexError: when neither is queued.
        """
        if self._targets:
            t = self._targets[0][1]
            return t.ids if isinstance(t, ReplayRows) else t
        return self._c.peek_recorded()

    def pop_next_target(self) -> ReplayRows | torch.Tensor:
        """Removes and returns the next target: once its forward succeeded, or to drop the table
        of a forward that failed.

        Returns:
            A ReplayRows when it was classified as set, else the table.

        Raises:
            IndexError: when nothing is queued.
        """
        if self._targets:
            self._last_step, t = self._targets.popleft()
            return t
        return self._c.pop_recorded()

    @property
    def num_recorded(self) -> int:
        """Recorded tables queued."""
        return self._c.num_recorded

    @property
    def num_pending_recompute(self) -> int:
        """Tables queued by replay_forward, waiting for their recompute."""
        return self._c.num_pending_recompute

    @property
    def num_targets(self) -> int:
        """Targets queued (set_target / set_step_targets)."""
        return len(self._targets)

    @property
    def layer(self) -> int | None:
        """The layer named in messages (an int), or None."""
        return None if self._c.layer < 0 else self._c.layer

    def clear(self) -> None:
        """Drops every queued table (recorded, pending recompute and targets)."""
        self._c.clear()
        self._targets.clear()

    # Router hooks (switchyard.torch.TopKRouter). Validation never mutates: forward_ids only looks
    # at the queues, and forward_done (called once topk_route succeeded) consumes them, so a
    # forward that fails (bad ids, a T that does not match) leaves every queue as it was for the
    # corrected retry.
    def forward_ids(self, num_tokens: int) -> torch.Tensor | None:
        """The ids a router's forward replays under ``action``, left queued.

        Args:
            num_tokens: T the forward routes.

        Returns:
            None (action None / "record": route natively), the next target ("replay_forward")
            or the oldest table queued for recompute ("recompute").

        Raises:
            IndexError: when the action's queue is empty.
            ValueError: for a recompute table whose T is not ``num_tokens``.
        """
        if self._action in (None, "record"):
            return None
        if self._action == "replay_forward":
            return self.next_target()
        return self._c.peek_recompute(int(num_tokens))

    def forward_done(self, topk_idx: torch.Tensor, num_tokens: int,
                     will_recompute: bool = True) -> None:
        """Consumes the queues after a router's forward succeeded: records ``topk_idx``
        ("record"), takes the target and, when ``will_recompute``, queues it for the recompute
        ("replay_forward"), or takes the recompute table ("recompute").

        Args:
            topk_idx: the ids the forward routed, [T, K].
            num_tokens: T.
            will_recompute: whether this forward's recompute will come (will_recompute()).
        """
        if self._action == "record":
            self._c.record(topk_idx)
        elif self._action == "replay_forward":
            t = self.pop_next_target()
            if will_recompute:  # only a forward whose recompute will come queues its table
                self._c.replay_forward(t.ids if isinstance(t, ReplayRows) else t)
        elif self._action == "recompute":
            self._c.recompute(int(num_tokens))

    # The step bookkeeping of ReplayDriver (same module).
    def _queue_target(self, step: int, rows: ReplayRows | torch.Tensor) -> None:
        self._targets.append((step, rows))

    def _drop_targets_through(self, step: int) -> None:
        while self._targets and self._targets[0][0] <= step:
            self._targets.popleft()

    def __getattr__(self, name: str) -> Any:
        raise _names.old_attribute(self, name)  # an old name says the new one

    def __repr__(self) -> str:
        return (f"RouterReplay(top_k={self.top_k}, layer={self.layer}, action={self._action!r}, "
                f"recorded={self.num_recorded}, pending_recompute={self.num_pending_recompute}, "
                f"targets={self.num_targets})")


_STEPS = itertools.count(1)  # step numbers of set_step_targets calls (all drivers: comparable)


class ReplayDriver:
    """The replay queues of one model's MoE layers, all or nothing: the step transaction.

    The driver is the only protocol: adapters call

    * ``set_step_targets(tables)``: every table is classified (the engine's rule, each layer's
      policy) and its token count checked before any layer queues one;
    * ``begin_step(keys)`` / ``end_step(keys, failed)`` around a model (chunk) forward: a failed
      forward drops, in every layer of ``keys``, the step's target it has not taken yet and the
      recompute tables queued during the step, so no layer keeps a failed batch's ids;
    * ``take_forward(key, num_tokens)``: the ReplayRows this forward replays (None: route
      natively), taken from the queue whether the forward then succeeds or not;
    * ``queue_recompute(key, ids)`` / ``take_recompute(key, num_tokens)``: the ids a checkpointed
      forward used, handed back to its recompute (FIFO).

    ValueError from any of them names the layer (``label``); a key that is not in ``replays`` is
    a KeyError.

    Args:
        replays: {key: RouterReplay} (each with ``num_experts``).
        label: key -> how messages name that layer (default "layer <key>").
    """

    def __init__(self, replays: Mapping[Any, RouterReplay],
                 label: Callable[[Any], str] | None = None) -> None:
        self.replays = dict(replays)
        """{key: switchyard.RouterReplay}, the layers this driver queues for."""
        self._label = label or (lambda k: f"layer {k}")
        self._taken: set[Any] = set()  # keys that took their target in the running step
        self._queued: dict[Any, int] = {}  # key -> recompute tables queued in the running step

    def label(self, key: Any) -> str:
        """How messages name a layer.

        Args:
            key: the layer's key in ``replays``.

        Returns:
            str (default "layer <key>").
        """
        return self._label(key)

    # ---- targets ----
    def classify(self, key: Any, ids: torch.Tensor) -> ReplayRows | torch.Tensor:
        """Classifies one layer's table by the engine's rule and the layer's policy.

        Args:
            key: the layer's key in ``replays``.
            ids: [T, K] integer ids (-1 = route natively).

        Returns:
            ReplayRows (classify_rows); for a RouterReplay without num_experts the table itself,
            unchanged (its router's topk_route checks the rows at the forward).

        Raises:
            ValueError: classify_rows', or, without num_experts, a table that is not
                [T, top_k].
        """
        r = self.replays[key]
        if r.num_experts is None:
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != r.top_k:
                raise ValueError(f"[replay] set_target: topk_idx must be a [T, {r.top_k}] "
                                 f"tensor, got {getattr(ids, 'shape', type(ids).__name__)}")
            return ids
        if isinstance(ids, torch.Tensor) and ids.dtype in _ID_DTYPES and \
                (ids.dim() != 2 or ids.shape[1] != r.top_k):
            raise ValueError(f"[replay] {self.label(key)}: replay ids must be [num_tokens, "
                             f"{r.top_k}], got {list(ids.shape)}")
        try:
            return classify_rows(ids, r.num_experts, r.invalid_replay_rows, layer=r.layer,
                                 op="replay")
        except ValueError as e:
            if r.layer is not None:
                raise
            raise ValueError(f"{e} ({self.label(key)})") from None

    def set_step_targets(self, tables: Mapping[Any, torch.Tensor] | Iterable[torch.Tensor], *,
                         num_tokens: int | None = None, group: Any = None
                         ) -> dict[Any, ReplayRows | torch.Tensor]:
        """Queues one table per named layer for its next forward, all or none.

        Collective over ``group`` when given: the same error on every rank.

        Args:
            tables: {key: ids} or a list with one table per layer in the order of ``replays``;
                ids [T, K] integers, -1 = route natively.
            num_tokens: every table must have that many rows (checked now; None: at the
                forward).
            group: a torch.distributed group, or None (local).

        Returns:
            {key: ReplayRows} (the table itself for a layer without num_experts).

        Raises:
            ValueError: nothing queued, for a list of the wrong length, an unknown key, an
                invalid row (by each layer's policy) or a token count that is not
                ``num_tokens``.
        """
        if not isinstance(tables, dict):
            tables = list(tables)
            if len(tables) != len(self.replays):
                raise ValueError(f"[replay.set_step_targets] {len(self.replays)} layers but "
                                 f"{len(tables)} tables")
            tables = dict(zip(self.replays, tables))
        self._drop_failed_steps()
        err, rows = None, {}
        try:
            for k, ids in tables.items():
                if k not in self.replays:
                    raise ValueError(f"[replay.set_step_targets] no layer has the key {k!r} "
                                     f"(layers: {sorted(self.replays, key=str)})")
                rows[k] = r = self.classify(k, ids)
                n = r.shape[0] if isinstance(r, torch.Tensor) else r.num_tokens
                if num_tokens is not None and n != int(num_tokens):
                    raise ValueError(f"[replay] {self.label(k)}: the replay tensor has "
                                     f"{n} tokens, the router gets {int(num_tokens)}")
        except ValueError as e:
            err = str(e)
        raise_on_every_rank(err, group)
        step = next(_STEPS)
        for k, r in rows.items():
            if isinstance(r, ReplayRows):
                r.group = None if num_tokens is not None else group
            self.replays[k]._queue_target(step, r)
        return rows

    def _drop_failed_steps(self) -> None:
        """A step some layers took and others did not failed between them (an error outside any
        hook the adapter has): its tables still queued are dropped, so every layer is at the same
        step again. Tables queued ahead for later steps stay."""
        last = max((r._last_step for r in self.replays.values()), default=0)
        for r in self.replays.values():
            r._drop_targets_through(last)

    # ---- one step ----
    def begin_step(self, keys: Iterable[Any] | None = None) -> None:
        """Marks the start of a (chunk) forward.

        Args:
            keys: the layers the forward runs (None: all).
        """
        for k in self.replays if keys is None else keys:
            self._taken.discard(k)
            self._queued[k] = 0

    def end_step(self, keys: Iterable[Any] | None = None, failed: bool = False) -> None:
        """Marks the end of a (chunk) forward.

        Args:
            keys: the layers the forward ran (None: all).
            failed: True drops, in each of those layers, the step's target it has not taken and
                the recompute tables queued during the step.
        """
        keys = list(self.replays if keys is None else keys)
        if failed:
            for k in keys:
                r = self.replays[k]
                if k not in self._taken and r.action == "replay_forward" and \
                        (r.num_targets or r.num_recorded):
                    r.pop_next_target()
                r.drop_newest_recompute(self._queued.get(k, 0))
        for k in keys:
            self._taken.discard(k)
            self._queued[k] = 0

    def take_forward(self, key: Any, num_tokens: int) -> ReplayRows | None:
        """The rows a layer's forward replays, taken from its queue now (a forward that fails
        does not leave them for the retry).

        Args:
            key: the layer's key.
            num_tokens: T the forward routes.

        Returns:
            None for action None / "record"; for "replay_forward" the oldest target as
            ReplayRows, else the oldest recorded table's (R2).

        Raises:
            ValueError: when none is queued or its token count is not ``num_tokens`` (over the
                group the targets were set with).
        """
        r = self.replays[key]
        if r.action != "replay_forward":
            return None
        if not (r.num_targets or r.num_recorded):
            raise ValueError(f"[replay] {self.label(key)}: action 'replay_forward' but no replay "
                             "target is set and nothing was recorded")
        self._taken.add(key)
        t = r.pop_next_target()
        rows = t if isinstance(t, ReplayRows) else self._classified(key, t)
        err = None
        if rows.num_tokens != int(num_tokens):
            err = (f"[replay] {self.label(key)}: the replay tensor has {rows.num_tokens} tokens, "
                   f"the router got {int(num_tokens)}")
        raise_on_every_rank(err, getattr(rows, "group", None))
        return rows

    def peek_forward(self, key: Any) -> ReplayRows | None:
        """The rows a layer's next ``take_forward`` would return, left queued.

        Args:
            key: the layer's key.

        Returns:
            None unless the action is "replay_forward" with a table queued and the layer knows
            num_experts; else the queued target's ReplayRows itself (classified as it was set:
            the same object the forward takes), or the oldest recorded table classified now.

        Raises:
            ValueError: classify's, for a recorded table.
        """
        r = self.replays[key]
        if r.action != "replay_forward" or r.num_experts is None:
            return None
        if r._targets:
            t = r._targets[0][1]
            return t if isinstance(t, ReplayRows) else self._classified(key, t)
        return self._classified(key, r.peek_recorded()) if r.num_recorded else None

    def queue_recompute(self, key: Any, ids: torch.Tensor) -> None:
        """Queues the ids a checkpointed forward used, for its recompute.

        Args:
            key: the layer's key.
            ids: int32 [T, K] on the CPU.
        """
        self.replays[key].replay_forward(ids)
        self._queued[key] = self._queued.get(key, 0) + 1

    def take_recompute(self, key: Any, num_tokens: int) -> ReplayRows:
        """The rows the recompute of a layer's oldest checkpointed forward replays, taken from
        its queue (first in, first out).

        Args:
            key: the layer's key.
            num_tokens: T the recompute routes.

        Returns:
            ReplayRows.

        Raises:
            ValueError: when none is queued or its token count is not ``num_tokens``.
        """
        r = self.replays[key]
        if not r.num_pending_recompute:
            raise ValueError(f"[replay] {self.label(key)}: a checkpoint recompute found no ids "
                             "queued by its forward (the layer was checkpointed by a mechanism "
                             "the adapter does not see, so its forward did not queue them)")
        ids = r.peek_recompute(num_tokens)
        rows = self._classified(key, ids)
        r.recompute(num_tokens)
        if self._queued.get(key):
            self._queued[key] -= 1
        return rows

    def _classified(self, key: Any, ids: torch.Tensor) -> ReplayRows:
        rows = self.classify(key, ids)
        if not isinstance(rows, ReplayRows):
            raise ValueError(f"[replay] {self.label(key)}: a forward driven by a ReplayDriver "
                             "needs the layer's num_experts (RouterReplay(num_experts=E))")
        return rows

    def clear(self) -> None:
        """Drops every queued table of every layer (recorded, targets, pending recompute)."""
        for r in self.replays.values():
            r.clear()
        self._taken.clear()
        self._queued.clear()
