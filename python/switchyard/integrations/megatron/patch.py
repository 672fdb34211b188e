"""switchyard.integrations.megatron.patch: ``apply()`` / ``remove()`` / ``patched()`` wrap
Megatron-Core's functions with the dispatcher fixes (``fixes``), the replay router patches
(``replay``) and the engine gate (``config``), check the megatron-core version and report what
was patched (``PatchReport``). See the package docstring."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from .._adapter import lifecycle
from .._versions import check_version
from .config import make_engine_gating
from .fixes import make_a2a_preprocess, make_ep_setup_metadata, make_layer_route
from .replay import make_checkpoint, make_router_forward, make_router_routing

SUPPORTED_VERSIONS = ((0, 16), (0, 19))
"""Supported megatron-core releases, (major, minor) oldest and newest, any patch release: 0.16
(router replay appeared) to 0.19.x. ``apply()`` refuses others (a newer one passes, with a
warning, under SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1)."""
TESTED_VERSIONS = ("0.19.2",)
"""megatron-core releases the tests ran against (``PatchReport.tested``)."""


# --------------------------------------------------------------------------------------------------
# Version and patch bookkeeping
# --------------------------------------------------------------------------------------------------
def _megatron_version() -> str:
    try:
        from megatron.core import package_info
    except ImportError as e:  # optional dependency
        raise ImportError("[megatron.apply] megatron-core is not installed (pip install "
                          "megatron-core)") from e
    return str(package_info.__version__)


@dataclasses.dataclass
class PatchReport:
    """What ``apply()`` patched: ``version`` of megatron-core (``tested``: one of
    TESTED_VERSIONS), ``patched`` as a list of (``"module.Class.method"``, why) and ``skipped``
    (targets this version lacks, with why). ``str(report)`` lists them, one per line.

    Args:
        version: megatron-core's version string.
        patched: [(target, why)] of every function wrapped.
        skipped: [(target, why)] of the targets this version lacks.
        engine: the ``engine`` apply() was called with.
        tested: whether ``version`` is one of TESTED_VERSIONS.
    """
    version: str
    """megatron-core's version string."""
    patched: list[tuple[str, str]]
    """[(``"module.Class.method"``, why)] of every function wrapped."""
    skipped: list[tuple[str, str]]
    """[(target, why)] of the targets this version lacks."""
    engine: str | None
    """The ``engine`` apply() was called with: None or "cpu"."""
    tested: bool = False
    """Whether ``version`` is one of TESTED_VERSIONS."""

    def __str__(self) -> str:
        lines = [f"switchyard.integrations.megatron on megatron-core {self.version} "
                 f"({'tested' if self.tested else 'supported, not tested'}; "
                 f"engine={self.engine!r}):"]
        lines += [f"  patched {t}: {w}" for t, w in self.patched]
        lines += [f"  skipped {t}: {w}" for t, w in self.skipped]
        return "\n".join(lines)


_LIFE = lifecycle("megatron")  # the originals, the report and the engine (shared with replay)


def is_applied() -> bool:
    """True between ``apply()`` and ``remove()``.

    Returns:
        bool.
    """
    return _LIFE.is_applied


def _patch(owner: Any, name: str, make: Callable[[Any], Any], report: PatchReport,
           why: str) -> None:
    report.patched.append(_LIFE.wrap(owner, name, make, why))


def apply(*, engine: str | None = None) -> PatchReport:
    """Patches megatron.core in place (idempotent: a second call returns the first report).

    ``engine``: None (Megatron's own math everywhere, plus the fixes) or ``"cpu"`` (on CPU tensors
    the router gate of routers with a replay attached runs switchyard's FP32-accumulated
    batch-invariant ``router_gating_linear``; CUDA tensors keep Megatron's math). Returns the
    PatchReport. Raises ValueError for another ``engine`` or one that differs from the already
    applied one (remove() first), ImportError without megatron-core and RuntimeError outside
    SUPPORTED_VERSIONS (0.16 to 0.19.x; a newer release is let through, with a warning, when the
    environment sets SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1); nothing stays patched on an error.

    Args:
        engine: None or "cpu".

    Returns:
        PatchReport.

    Raises:
        ValueError: for another ``engine``, or one that differs from the applied one.
        ImportError: without megatron-core.
        RuntimeError: outside SUPPORTED_VERSIONS.
    """
    if engine not in (None, "cpu"):
        raise ValueError(f"[megatron.apply] engine must be None or 'cpu', got {engine!r}")
    if _LIFE.is_applied:
        if _LIFE.options["engine"] != engine:
            raise ValueError(f"[megatron.apply] already applied with "
                             f"engine={_LIFE.options['engine']!r}; remove() first to apply with "
                             f"engine={engine!r}")
        return _LIFE.report
    ver_str = _megatron_version()
    ver = check_version("megatron.apply", "megatron-core", ver_str, *SUPPORTED_VERSIONS)
    from megatron.core.transformer.moe import moe_layer, router, token_dispatcher as td

    report = PatchReport(version=ver_str, patched=[], skipped=[], engine=engine,
                         tested=".".join(map(str, ver)) in TESTED_VERSIONS)
    try:
        _patch(td.MoEAlltoAllTokenDispatcher, "preprocess", make_a2a_preprocess, report,
               "dropless output size from the routing map's pair count (was T*topk)")
        for cls_name in ("_DeepepManager", "_NCCLEPManager"):
            cls = getattr(td, cls_name, None)
            if cls is None:
                report.skipped.append((f"{td.__name__}.{cls_name}.setup_metadata",
                                       "not in this version"))
                continue
            _patch(cls, "setup_metadata", make_ep_setup_metadata, report,
                   "indices rebuilt from the routing map (-1 slots, no zero-weight experts)")
        _patch(router.TopKRouter, "forward", make_router_forward, report,
               "replay/record state per call (attached routers only)")
        _patch(router.TopKRouter, "routing", make_router_routing, report,
               "validated, keyed replay and record on every router path (attached routers only)")
        _patch(moe_layer.MoELayer, "route", make_layer_route, report,
               "hands the router's host-known pair count to the dispatcher")
        import megatron.core.tensor_parallel as tensor_parallel
        _patch(tensor_parallel, "checkpoint", make_checkpoint, report,
               "notes whether a recompute will follow, so replay queues ids only then")
        if engine == "cpu":
            _patch(router.Router, "gating", make_engine_gating, report,
                   "CPU tensors: switchyard's FP32 batch-invariant gate (attached routers only)")
    except BaseException:
        _LIFE.restore()
        raise
    _LIFE.applied(report, engine=engine)
    return report


def remove() -> None:
    """Puts every patched Megatron-Core function back. Replays attached to routers stay attached
    (and unused) until ``detach_replay``."""
    _LIFE.removed()


@contextlib.contextmanager
def patched(*, engine: str | None = None) -> Iterator[PatchReport]:
    """``with patched(): ...`` applies for the block and removes afterwards (only if this block
    applied it). Yields the PatchReport; raises as ``apply``.

    Args:
        engine: None or "cpu", as ``apply``.

    Returns:
        A context manager that yields the PatchReport.

    Raises:
        ValueError: as ``apply``.
        ImportError: as ``apply``.
        RuntimeError: as ``apply``.
    """
    was = is_applied()
    report = apply(engine=engine)
    try:
        yield report
    finally:
        if not was:
            remove()
