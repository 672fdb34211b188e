"""The supported-version check of the integrations: one rule for transformers and megatron-core.

A release below the oldest supported minor is refused (the integration uses what appeared there).
A release above the newest supported minor is refused too: the patched functions and the routing
math were read from the supported releases, and a newer one may have changed them silently. Setting
``SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1`` in the environment lets a newer release through with a
warning naming it (never an older one)."""
from __future__ import annotations

import os
import warnings

ALLOW_ENV = "SWITCHYARD_ALLOW_UNTESTED_VERSIONS"


def _range(oldest: tuple[int, ...], newest: tuple[int, ...]) -> str:
    lo, hi = ".".join(map(str, oldest)), ".".join(map(str, newest))
    return f"{hi}.x" if oldest == newest else f"{lo} to {hi}.x"


def check_version(op: str, package: str, found: str, oldest: tuple[int, ...],
                  newest: tuple[int, ...]) -> tuple[int, ...]:
    """The supported-range rule (transformers, megatron-core).

    Args:
        op: the calling operation, named in messages.
        package: the package's name.
        found: its installed version string.
        oldest: (major, minor) of the oldest supported release.
        newest: (major, minor) of the newest supported release (any patch release of it).

    Returns:
        found's release tuple.

    Raises:
        RuntimeError: when ``found`` is unreadable or outside [oldest, newest] by (major, minor)
            (a newer one passes, with a warning, under SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1).
    """
    from packaging.version import InvalidVersion, Version
    try:
        release = Version(str(found)).release
    except InvalidVersion:
        raise RuntimeError(f"[{op}] cannot read the installed {package} version {found!r}; "
                           f"supported: {package} {_range(oldest, newest)}") from None
    rng = _range(oldest, newest)
    if release[:2] < tuple(oldest):
        raise RuntimeError(f"[{op}] needs {package} {rng}, found {found}")
    if release[:2] > tuple(newest):
        msg = (f"[{op}] {package} {found} is newer than the supported {rng} (the patched code was "
               f"read from those releases and may have changed)")
        if os.environ.get(ALLOW_ENV) != "1":
            raise RuntimeError(f"{msg}; set {ALLOW_ENV}=1 to patch it anyway")
        warnings.warn(f"{msg}; patching anyway ({ALLOW_ENV}=1)", stacklevel=3)
    return release


def check_minimum_version(op: str, package: str, found: str, minimum: str, why: str) -> None:
    """The minimum-version rule (trl, verl: extension points that newer releases keep).

    Args:
        op: the calling operation, named in messages.
        package: the package's name.
        found: its installed version string.
        minimum: the oldest release supported, a version string.
        why: what was read from ``minimum``, said in the message.

    Raises:
        RuntimeError: when ``found`` is older than ``minimum``.
    """
    from packaging.version import Version
    if Version(str(found)) < Version(minimum):
        raise RuntimeError(f"[{op}] needs {package} >= {minimum}, found {found} ({why})")
