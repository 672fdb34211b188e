"""The skeleton every integration (hf, megatron, trl, verl) is built on: what they share, once.

* ``check_version`` / ``check_minimum_version``: the version rules (``_versions``), called when
  an integration patches or is built;
* ``Lifecycle``: the patch / unpatch lifecycle of a process-wide integration (Megatron-Core's
  functions): the originals it wrapped, the report, the options it was applied with, and the
  restore that puts them back; ``lifecycle(name)`` is the one instance per integration that its
  modules share (so none imports another for it);
* ``TrainerPhase``: where an RL trainer is in its step, one explicit state (which log-prob forward
  is running, so which routes it replays);
* ``routed_tokens``: which tokens of a padded batch a rollout routed (every real token but each
  sequence's last one), the rule the verl and TRL layouts share;
* the replay core's pieces every adapter reports and drives: ``switchyard.replay.ReplayCounts``,
  ``ReplayDriver``, ``will_recompute``.

The framework-specific translation (layer numbers, batch layouts, the framework's checkpoint call)
stays in each adapter; protocol (row rule, queues, the step transaction, counts) stays in
``switchyard.replay``.
"""
from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
from typing import Any

import torch

from ._versions import check_minimum_version, check_version  # noqa: F401  (re-exported)


class TrainerPhase(enum.Enum):
    """Where an RL trainer's step is, as the replay adapters see it.

    ``OFF``: the trainer's switchyard patch was undone (it trains like the unpatched trainer);
    ``IDLE``: no log-prob forward is expected (generation, logging); ``SCORING``: the batch is
    being scored after generation (the old-log-prob pass, when the trainer runs one, comes first,
    then the reference pass); ``SCORED_OLD``: scoring, the old-log-prob pass done (what follows
    is the reference pass); ``POLICY``: the loss's policy forward.
    """
    OFF = "off"
    IDLE = "idle"
    SCORING = "scoring"
    SCORED_OLD = "scored_old"
    POLICY = "policy"


class Lifecycle:
    """The patch / unpatch lifecycle of one process-wide integration.

    ``wrap(owner, name, make, why)`` replaces ``owner.name`` by ``make(original)`` and records
    it; ``restore()`` puts every original back, newest first; ``applied(report, **options)``
    marks the integration applied with its report and options, ``removed()`` marks it removed.
    Made by ``lifecycle(name)``, not directly.

    Args:
        name: the integration's name (used in ``repr``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        """The integration's name."""
        self.report: Any = None
        """The report ``apply()`` returned (None while not applied)."""
        self.options: dict[str, Any] = {}
        """The options the integration was applied with (empty while not applied)."""
        self._originals: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) in the order wrapped

    @property
    def is_applied(self) -> bool:
        """True between ``applied()`` and ``removed()``."""
        return self.report is not None

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any], why: str
             ) -> tuple[str, str]:
        """Replaces ``owner.name`` (from ``owner.__dict__``) by ``make(original)``.

        Args:
            owner: a class or a module.
            name: the attribute replaced.
            make: original -> the wrapper installed.
            why: what the wrapper fixes, for the report.

        Returns:
            (``"module.Class.name"``, why): the report's line.

        Raises:
            KeyError: when ``owner`` itself does not define ``name``.
        """
        orig = owner.__dict__[name]
        setattr(owner, name, make(orig))
        self._originals.append((owner, name, orig))
        where = owner.__name__ if isinstance(owner, type(contextlib)) else \
            f"{owner.__module__}.{owner.__qualname__}"
        return f"{where}.{name}", why

    def restore(self) -> None:
        """Puts every wrapped attribute back, newest first (idempotent)."""
        while self._originals:
            owner, name, orig = self._originals.pop()
            setattr(owner, name, orig)

    def applied(self, report: Any, **options: Any) -> None:
        """Marks the integration applied.

        Args:
            report: what ``apply()`` returns.
            **options: the options it was applied with (read back through ``options``).
        """
        self.report = report
        self.options = dict(options)

    def removed(self) -> None:
        """Restores every original and marks the integration removed."""
        self.restore()
        self.report = None
        self.options = {}

    def __repr__(self) -> str:
        return (f"<switchyard integration {self.name}: "
                f"{'applied' if self.is_applied else 'not applied'}>")


_LIFECYCLES: dict[str, Lifecycle] = {}


def lifecycle(name: str) -> Lifecycle:
    """The one Lifecycle of the integration ``name`` in this process (made on first use).

    Args:
        name: the integration's name, e.g. "megatron".

    Returns:
        Lifecycle.
    """
    if name not in _LIFECYCLES:
        _LIFECYCLES[name] = Lifecycle(name)
    return _LIFECYCLES[name]


def routed_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """The tokens of a padded batch that a rollout routed: each row's real tokens but its last
    one (an engine never routes a sequence's last token: it is sampled, never fed).

    Args:
        attention_mask: [B, S], nonzero = real token (any padding pattern).

    Returns:
        bool [B, S].
    """
    real = attention_mask != 0
    routed = real.clone()
    if real.shape[1] == 0:
        return routed
    last = real.shape[1] - 1 - real.flip(1).to(torch.int8).argmax(dim=1)
    has = real.any(dim=1)
    routed[torch.arange(real.shape[0])[has], last[has]] = False
    return routed
