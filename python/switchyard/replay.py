"""switchyard.replay: the one replay core every path uses (the engine's router, the HF and Megatron
adapters). It holds

* ``POLICIES`` / ``check_policy``: the one vocabulary for invalid replay rows, "error" (default),
  "native" (routed natively and counted) and "merge" (a repeated id is one pair with its slots'
  weights summed; only where the dispatcher merges pairs: the Megatron adapter);
* ``classify_rows``: the engine's row rule (valid / all -1 -> native / invalid: mixed -1, repeated
  id, out of range), bound from C++ (switchyard::classify_replay_rows);
* ``recompute_kind`` / ``in_recompute``: the one detector of an activation-checkpoint recompute
  (the re-run of a forward inside backward; torch has no public API for it);
* ``ReplayDriver``: the per-layer queues of one model, all or nothing.

Row kinds (``ReplayRows.kind``, uint8): ``NATIVE`` = 0 (all -1: routed natively), ``REPLAYED`` = 1,
``INVALID`` = 3 (routed natively under policy "native"), ``MERGED`` = 4 (a repeated id merged).
"""
import itertools

import torch

from . import _switchyard as _C

POLICIES = ("error", "native", "merge")
"""The invalid-replay-row policies, in the order of switchyard::ReplayRowPolicy."""

# Old spellings of ReplayRowPolicy values -> the new one.
_OLD_POLICIES = {"to_none": "native"}


def check_policy(policy, op, name="invalid_replay_rows", allowed=POLICIES):
    """Returns ``policy`` (a str) when it is one of ``allowed`` (default POLICIES); otherwise
    ValueError naming ``op``, the argument ``name`` and the value (an old spelling, "to_none",
    names the new one, "native")."""
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
    token count over (None: local)."""
    _COUNTS = ("num_replayed", "num_merged", "num_native", "num_invalid", "num_pairs")
    __slots__ = ("ids", "kind", "group") + _COUNTS

    def __init__(self, ids, core):
        self.ids = ids
        """int32 [T, K] on the CPU: the ids as given (-1 = no route)."""
        self.kind = core.kind
        """uint8 [T]: each row's kind (NATIVE, REPLAYED, INVALID, MERGED)."""
        self.group = None  # the torch.distributed group a forward checks the token count over
        """The torch.distributed group a forward checks the token count over (None: local)."""
        for f in self._COUNTS:
            setattr(self, f, getattr(core, f))

    @property
    def num_tokens(self):
        """T, the rows of ``ids``."""
        return self.ids.shape[0]

    @property
    def replayed(self):
        """[T] bool: rows that take their ids (merged included)."""
        return (self.kind == REPLAYED) | (self.kind == MERGED)

    @property
    def merged(self):
        """[T] bool: rows whose repeated id was merged (policy "merge")."""
        return self.kind == MERGED

    def resolved_ids(self):
        """int32 [T, K]: ids with every natively routed row (all -1 or invalid) as -1: what a
        recompute replays (classified again with the same policy it gives the same kinds, invalid
        rows native)."""
        return self.ids.masked_fill(~self.replayed[:, None], -1)


_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16)


def classify_rows(ids, num_experts, policy="error", layer=None, op="replay"):
    """The replay row rule (the engine's): ``ids`` [T, K] int64/int32/int16/int8/uint8/uint16
    (any device; copied to the CPU as int32, -1 = route natively), ``num_experts`` E (valid ids
    are in [0, E)) -> ReplayRows. policy "error": the engine's ValueError naming layer, token and
    row for an invalid row (-1 mixed with ids, a repeated id, an id outside [0, E)); "native":
    invalid rows are kind INVALID (routed natively); "merge": a row whose only fault is a repeated
    id is MERGED, other invalid rows are the error. ``layer`` / ``op`` name the caller in
    messages. ValueError also for a non-tensor, a float / bool dtype, ids that are not 2-D, an
    id that does not fit int32 and an unknown policy."""
    check_policy(policy, op)
    where = "" if layer is None else f"layer {layer}, "
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"[{op}] {where}replay ids must be a torch.Tensor, got "
                         f"{type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise ValueError(f"[{op}] {where}replay ids must have an integer dtype (int64, int32, "
                         f"int16, int8, uint8, uint16), got {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"[{op}] {where}replay ids must be [num_tokens, top_k], got "
                         f"{list(ids.shape)}")
    from . import torch as _syt  # the one narrowing of id tensors (torch.py imports this module)
    ids = _syt._idx32(ids.detach().to("cpu"), op,  # a device sync on CUDA: needs the values
                      f"{where}replay ids", _syt._ID_DTYPES)
    ids = ids.contiguous()
    core = _C.classify_replay_rows(ids, int(num_experts), policy,
                                   -1 if layer is None else int(layer))
    return ReplayRows(ids, core)


def recompute_kind():
    """None outside an activation-checkpoint recompute; inside one (a forward run by the autograd
    engine during backward) "non_reentrant" for torch.utils.checkpoint(use_reentrant=False) (its
    forward ran with grad and was counted) or "reentrant" (any other: torch's reentrant
    checkpoint, Megatron's CheckpointFunction, Transformer Engine's; their forward ran under
    no_grad). The one recompute detector of switchyard: torch has no public API for it, so this
    reads torch.utils.checkpoint's own private state (pinned by the tests). Inside a region
    torch.compile / torch.export traces: None (see in_recompute)."""
    if _traced() or torch._C._current_graph_task_id() == -1:
        return None
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and bool(getattr(hooks[0], "_checkpoint_internal", False)):
        return "non_reentrant"
    return "reentrant"


def will_recompute(input_requires_grad):
    """Whether a forward running now will be recomputed inside backward (so its replay ids must be
    queued for that recompute): inside torch.utils.checkpoint(use_reentrant=False)'s forward
    (exact: its saved-tensor hooks), or, with grad disabled, a forward whose input requires grad
    (a reentrant checkpoint's forward: torch's, Megatron's, Transformer Engine's; the layers of a
    reentrant block after its first see inputs that do not require grad, so checkpoint them one by
    one or non-reentrantly). A forward that keeps its graph, or a forward-only pass, is not.
    Inside a traced region: False (a compiled forward's recompute is its compiled backward's, fed
    the same graph inputs, so nothing is queued for it; see in_recompute)."""
    if _traced():
        return False
    if torch._C._current_graph_task_id() != -1:
        return False  # a recompute itself (an adapter that nests checkpoints queues again)
    if torch.is_grad_enabled():
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return hooks is not None and bool(getattr(hooks[0], "_checkpoint_internal", False))
    return bool(input_requires_grad)


def _traced():
    """Whether torch.compile (dynamo) or torch.export is tracing this call: dynamo folds it to a
    constant, so the autograd-engine queries below are never traced (dynamo cannot trace
    torch._C._current_graph_task_id)."""
    return torch.compiler.is_compiling()


def in_recompute():
    """True inside an activation-checkpoint recompute (recompute_kind() is not None).

    Inside a region that torch.compile or torch.export traces the answer is fixed when it is
    traced: False. A compiled forward is never re-run in Python by a checkpoint: the checkpoint
    traced inside the region becomes part of the compiled graph, and its recompute runs in the
    compiled backward from the same graph inputs (the replay tensors staged before the forward
    included), so it routes exactly as the forward did without any detection."""
    return not _traced() and torch._C._current_graph_task_id() != -1


def raise_on_every_rank(err, group):
    """Raises ValueError(err) (``err``: a str, or None = no error here); returns None when no
    rank failed. With a torch.distributed ``group``,
    collective: the ranks exchange their errors and all raise the lowest failing rank's, so no
    rank is left waiting in a later all-to-all."""
    if group is not None:
        import torch.distributed as dist
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, err, group=group)
        for rank, e in enumerate(errors):
            if e is not None:
                raise ValueError(f"{e} (on rank {rank} of the group)")
    elif err is not None:
        raise ValueError(err)


_STEPS = itertools.count(1)  # step numbers of set_step_targets calls (all drivers: comparable)


class ReplayDriver:
    """The replay queues of one model's MoE layers, all or nothing.

    ``replays``: {key: switchyard.RouterReplay} (each with ``num_experts``); ``label(key)`` names a
    layer in messages. The driver is the only protocol: adapters call

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
    a KeyError."""

    def __init__(self, replays, label=None):
        self.replays = dict(replays)
        """{key: switchyard.RouterReplay}, the layers this driver queues for."""
        for k, r in self.replays.items():
            self._label = label or (lambda k: f"layer {k}")
        self._taken = set()     # keys that took their target in the running step
        self._queued = {}       # key -> recompute tables queued in the running step

    def label(self, key):
        """How messages name the layer ``key`` (default "layer <key>")."""
        return self._label(key)

    # ---- targets ----
    def classify(self, key, ids):
        """``ids`` [T, K] integer tensor -> ReplayRows by the engine's rule and the layer's policy
        (classify_rows; its ValueError). A RouterReplay without num_experts only has the table's
        shape checked (ValueError unless [T, top_k]; its router's topk_route checks the rows at
        the forward) and gets the table back unchanged."""
        r = self.replays[key]
        if r.num_experts is None:
            r._check_target(ids)
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

    def set_step_targets(self, tables, *, num_tokens=None, group=None):
        """Queues tables[key] ([T, K] integer ids, -1 = native) for the next forward of each named
        layer, all or none (over ``group``: the same error on every rank, collective). ``tables``:
        {key: ids}, or a list with one table per layer in the order of ``replays``.
        ``num_tokens``: every table must have that many rows (checked now; else at the forward).
        Returns {key: ReplayRows} (the table itself for a layer without num_experts). ValueError,
        nothing queued, for a list of the wrong length, an unknown key, an invalid row (by each
        layer's policy) or a token count that is not ``num_tokens``."""
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
                rows[k] = self.classify(k, ids)
                n = rows[k].shape[0] if isinstance(rows[k], torch.Tensor) else rows[k].num_tokens
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
            self.replays[k]._targets.append((step, r))
        return rows

    def _drop_failed_steps(self):
        """A step some layers took and others did not failed between them (an error outside any
        hook the adapter has): its tables still queued are dropped, so every layer is at the same
        step again. Tables queued ahead for later steps stay."""
        last = max((r._last_step for r in self.replays.values()), default=0)
        for r in self.replays.values():
            while r._targets and r._targets[0][0] <= last:
                r._targets.popleft()

    # ---- one step ----
    def begin_step(self, keys=None):
        """Marks the start of a (chunk) forward over the layers ``keys`` (None: all)."""
        for k in self.replays if keys is None else keys:
            self._taken.discard(k)
            self._queued[k] = 0

    def end_step(self, keys=None, failed=False):
        """Marks its end; ``failed=True`` drops, in each layer of ``keys``, the step's target it has
        not taken and the recompute tables queued during the step."""
        keys = list(self.replays if keys is None else keys)
        if failed:
            for k in keys:
                r = self.replays[k]
                if k not in self._taken and r.action == "replay_forward" and \
                        (r.num_targets or r.num_recorded):
                    r.pop_next_target()
                r._c.drop_newest_recompute(self._queued.get(k, 0))
        for k in keys:
            self._taken.discard(k)
            self._queued[k] = 0

    def take_forward(self, key, num_tokens):
        """The ReplayRows the forward of ``key`` replays: None for action None / "record"; for
        "replay_forward" the oldest target, else the oldest recorded table (R2), taken now (a
        forward that fails does not leave it for the retry). ValueError when none is queued or
        its token count is not ``num_tokens`` (over the group the targets were set with)."""
        r = self.replays[key]
        if r.action != "replay_forward":
            return None
        if not (r.num_targets or r.num_recorded):
            raise ValueError(f"[replay] {self.label(key)}: action 'replay_forward' but no replay "
                             "target is set and nothing was recorded")
        self._taken.add(key)
        t = r.pop_next_target()
        rows = t if isinstance(t, ReplayRows) else self.classify(key, t)
        err = None
        if rows.num_tokens != int(num_tokens):
            err = (f"[replay] {self.label(key)}: the replay tensor has {rows.num_tokens} tokens, "
                   f"the router got {int(num_tokens)}")
        raise_on_every_rank(err, getattr(rows, "group", None))
        return rows

    def queue_recompute(self, key, ids):
        """Queues ``ids`` (int32 [T, K] on the CPU: the ids this checkpointed forward used) for its
        recompute."""
        self.replays[key].replay_forward(ids)
        self._queued[key] = self._queued.get(key, 0) + 1

    def take_recompute(self, key, num_tokens):
        """The ReplayRows the recompute of ``key``'s oldest checkpointed forward replays (the
        engine's FIFO checks num_tokens). ValueError when none is queued or its token count is
        not ``num_tokens``."""
        r = self.replays[key]
        if not r.num_pending_recompute:
            raise ValueError(f"[replay] {self.label(key)}: a checkpoint recompute found no ids "
                             "queued by its forward (the layer was checkpointed by a mechanism "
                             "the adapter does not see, so its forward did not queue them)")
        ids = r._c.peek_recompute(int(num_tokens))
        rows = self.classify(key, ids)
        r._c.recompute(int(num_tokens))
        if self._queued.get(key):
            self._queued[key] -= 1
        return rows

    def clear(self):
        """Drops every queued table of every layer (recorded, targets, pending recompute)."""
        for r in self.replays.values():
            r.clear()
        self._taken.clear()
        self._queued.clear()
