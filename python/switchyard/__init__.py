"""switchyard: MoE routing for RL post-training (FP32 router, router replay, expert-parallel dispatch).

    import switchyard as sy            # engine objects: RouterConfig, RouterReplay, dist, routes
    import switchyard.torch as syt     # autograd pieces for PyTorch training stacks

Engine errors map to ValueError (bad arguments), IndexError (missing key / empty queue) and
RuntimeError (switchyard.BackendError, switchyard.DataError and other failures), with the engine's
messages.
"""
import collections as _collections
import warnings as _warnings

import torch as _torch  # noqa: F401  (libtorch is loaded before the extension hands tensors to it)

from . import _switchyard as _C
from . import _names
from . import replay as _replay
from ._switchyard import (BackendError, DataError, GlobalAuxLossState, built_with_cuda, cpu_isa,
                          cuda_device_count, num_threads, set_cpu_isa, set_num_threads)


class RouterConfig(_C.RouterConfig):
    """Router configuration; names and defaults follow Megatron-Core (keyword arguments only):
    ``RouterConfig(num_experts=E, top_k=K, score_function="softmax", pre_softmax=False,
    num_groups=None, group_topk=None, topk_scaling_factor=None, capacity_factor=None,
    token_drop_policy="probs", pad_to_capacity=False, aux_loss_type=None, aux_loss_coeff=0.0,
    z_loss_coeff=0.0, ...)``; the full list with each Megatron name is in
    docs/megatron-options.md. The engine validates every field (ValueError naming it)."""

    def __init__(self, **kwargs):
        _names.check_kwargs("RouterConfig", kwargs)
        super().__init__(**kwargs)

    def __getattr__(self, name):
        raise _names.old_attribute(self, name)


def _state_getattr(self, name):
    raise _names.old_attribute(self, name)


GlobalAuxLossState.__getattr__ = _state_getattr

__all__ = ["BackendError", "DataError", "GlobalAuxLossState", "RouterConfig", "RouterReplay",
           "built_with_cuda", "cpu_isa", "cuda_device_count", "num_threads", "set_cpu_isa",
           "set_num_threads", "classify_replay_rows", "dist", "replay", "routes"]


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
                        recompute: set it before calling backward). "replay_backward" is its
                        deprecated old name.
    ``invalid_replay_rows``: "error" (default), "native" or "merge" (switchyard.replay.POLICIES)
    for rows that mix -1 and ids, repeat an id or name an id outside [0, E); "merge" replays a row
    whose only fault is a repeated id with its slots as given (topk_route accepts it: each slot
    gets its share of the weights, which add up where the dispatcher or the experts sum a
    repeated expert's slots; other invalid rows stay errors). ``num_experts``: when
    given, targets are classified by the engine's row rule as they are set (required by
    switchyard.replay.ReplayDriver). Tables come back as int32 [T, K] tensors."""

    ACTIONS = (None, "record", "replay_forward", "recompute")
    """The values of ``action``."""

    def __init__(self, top_k, layer=None, invalid_replay_rows="error", num_experts=None):
        _replay.check_policy(invalid_replay_rows, "replay")
        self._c = _C.RouterReplayCore(int(top_k), -1 if layer is None else int(layer))
        self.top_k = int(top_k)
        """K, the ids per row (ValueError at construction unless >= 1)."""
        self.num_experts = None if num_experts is None else int(num_experts)
        """E (ids in [0, E)), or None: targets are then classified at the forward."""
        self.invalid_replay_rows = invalid_replay_rows
        """"error", "native" or "merge" (ValueError at construction for another value)."""
        self._action = None
        self._targets = _collections.deque()  # (step, table) of set_step_targets / set_target
        self._last_step = 0  # the step of the last target a forward took

    @property
    def action(self):
        """One of ACTIONS (default None); setting another value is a ValueError."""
        return self._action

    @action.setter
    def action(self, value):
        if value == "replay_backward":
            _warnings.warn("RouterReplay action 'replay_backward' is now 'recompute'",
                           DeprecationWarning, stacklevel=2)
            value = "recompute"
        if value not in self.ACTIONS:
            raise ValueError(f"[replay] action must be one of {self.ACTIONS}, got {value!r}")
        self._action = value

    # Engine operations.
    def record(self, topk_idx):
        """Queues a copy of ``topk_idx`` (int32 or int64 [T, top_k]) as a recorded table (R2).
        ValueError for another dtype or shape, or an int64 value outside int32."""
        self._c.record(topk_idx)

    def pop_recorded(self):
        """Removes and returns the oldest recorded table (int32 [T, K]); IndexError when none is
        queued."""
        return self._c.pop_recorded()

    def peek_recorded(self):
        """The table pop_recorded() would return, left queued (IndexError when none is)."""
        return self._c.peek_recorded()

    def replay_forward(self, topk_idx):
        """Queues a copy of ``topk_idx`` (int32 or int64 [T, top_k]) for the recompute of this
        forward and returns it (int32 [T, K]). ValueError as ``record``."""
        return self._c.replay_forward(topk_idx)

    def recompute(self, num_tokens):
        """Removes and returns the oldest table queued by replay_forward (int32 [T, K], for its
        recompute). IndexError when none is queued; ValueError when its T is not
        ``num_tokens``."""
        return self._c.recompute(int(num_tokens))

    def replay_backward(self, num_tokens):
        """Deprecated name of recompute()."""
        _warnings.warn("RouterReplay.replay_backward is now RouterReplay.recompute",
                       DeprecationWarning, stacklevel=2)
        return self.recompute(num_tokens)

    def set_target(self, topk_idx):
        """Queue ids [T, K] for the next forward with action "replay_forward" (R3); with
        num_experts known, classified now (the engine's ValueError for an invalid row)."""
        self.set_step_targets([self], [topk_idx])

    def _check_target(self, topk_idx):
        if not isinstance(topk_idx, _torch.Tensor) or topk_idx.dim() != 2 or \
                topk_idx.shape[1] != self.top_k:
            raise ValueError(f"[replay] set_target: topk_idx must be a [T, {self.top_k}] tensor, "
                             f"got {getattr(topk_idx, 'shape', type(topk_idx).__name__)}")

    @staticmethod
    def set_step_targets(replays, tables):
        """Queues ``tables[i]`` ([T, K] ids) on ``replays[i]`` for the next forward, all or none:
        switchyard.replay.ReplayDriver.set_step_targets (rows classified now when every replay
        knows num_experts, else at the forward by topk_route; a step that some of these layers
        took and others did not is dropped first)."""
        replays = list(replays)
        _replay.ReplayDriver(dict(enumerate(replays)),
                             label=lambda i: f"layer {replays[i].layer}"
                             ).set_step_targets(list(tables))

    def next_target(self):
        """The table the next "replay_forward" uses, left queued: the oldest target (set_target),
        else the oldest recorded table. IndexError when neither is queued."""
        if self._targets:
            t = self._targets[0][1]
            return t.ids if isinstance(t, _replay.ReplayRows) else t
        return self._c.peek_recorded()

    def pop_next_target(self):
        """Removes and returns the next target (a ReplayRows when it was classified as set, else
        the table): once its forward succeeded, or to drop the table of a forward that failed."""
        if self._targets:
            self._last_step, t = self._targets.popleft()
            return t
        return self._c.pop_recorded()

    @property
    def num_recorded(self):
        """Recorded tables queued."""
        return self._c.num_recorded

    @property
    def num_pending_recompute(self):
        """Tables queued by replay_forward, waiting for their recompute."""
        return self._c.num_pending_recompute

    @property
    def num_pending_backward(self):
        """Deprecated name of num_pending_recompute."""
        _warnings.warn("RouterReplay.num_pending_backward is now num_pending_recompute",
                       DeprecationWarning, stacklevel=2)
        return self._c.num_pending_recompute

    @property
    def num_targets(self):
        """Targets queued (set_target / set_step_targets)."""
        return len(self._targets)

    @property
    def layer(self):
        """The layer named in messages (an int), or None."""
        return None if self._c.layer < 0 else self._c.layer

    def clear(self):
        """Drop every queued table (recorded, pending recompute and targets)."""
        self._c.clear()
        self._targets.clear()

    # Router hooks. Validation never mutates: _ids_for_forward only looks at the queues, and
    # _after_forward (called once topk_route succeeded) consumes them, so a forward that fails
    # (bad ids, a T that does not match) leaves every queue as it was for the corrected retry.
    def _ids_for_forward(self, num_tokens):
        if self._action in (None, "record"):
            return None
        if self._action == "replay_forward":
            return self.next_target()
        return self._c.peek_recompute(int(num_tokens))

    def _after_forward(self, topk_idx, num_tokens, will_recompute=True):
        if self._action == "record":
            self._c.record(topk_idx)
        elif self._action == "replay_forward":
            t = self.pop_next_target()
            if will_recompute:  # only a forward whose recompute will come queues its table
                self._c.replay_forward(t.ids if isinstance(t, _replay.ReplayRows) else t)
        elif self._action == "recompute":
            self._c.recompute(int(num_tokens))

    def __repr__(self):
        return (f"RouterReplay(top_k={self.top_k}, layer={self.layer}, action={self._action!r}, "
                f"recorded={self.num_recorded}, pending_recompute={self.num_pending_recompute}, "
                f"targets={self.num_targets})")


from . import dist  # noqa: E402
from . import routes  # noqa: E402
from . import replay  # noqa: E402,F811
from .replay import classify_rows as classify_replay_rows  # noqa: E402
