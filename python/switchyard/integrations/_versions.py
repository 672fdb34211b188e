"""The supported-version check of the integrations: one rule for transformers and megatron-core.

A release below the oldest supported minor is refused (the integration uses what appeared there).
A release above the newest supported minor is refused too: the patched functions and the routing
math were read from the supported releases, and a newer one may have changed them silently. Setting
``SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1`` in the environment lets a newer release through with a
warning naming it (never an older one)."""
import os
import warnings

ALLOW_ENV = "SWITCHYARD_ALLOW_UNTESTED_VERSIONS"


def _range(oldest, newest):
    lo, hi = ".".join(map(str, oldest)), ".".join(map(str, newest))
    return f"{hi}.x" if oldest == newest else f"{lo} to {hi}.x"


def check_version(op, package, found, oldest, newest):
    """Raises RuntimeError when ``found`` (a version string) is outside [oldest, newest] by
    (major, minor), any patch release of ``newest`` included; returns found's release tuple."""
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
