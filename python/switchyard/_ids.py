"""switchyard._ids: expert-id tensors at every Python entry point, in one place: the dtypes an id
table may come in, the id-range rule and the one narrowing to int32.

The rule: an expert id is in ``[0, num_experts)``; ``-1`` means "no route" where the entry point
allows it (signed dtypes only: an unsigned id is never -1). A value is judged as it was given,
before anything narrows it: int64 ``2**32 + 5`` is an id outside the range, never expert 5, and
uint8 ``255`` is 255, never -1. Every id dtype of torch and numpy is taken (int8 ... int64,
uint8 ... uint64); bool, float and complex are refused with the list of what is accepted.

Nothing here depends on the rest of the package (it needs torch only), so every module can use it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ID_DTYPES", "ENGINE_ID_DTYPES", "ACCEPTED", "as_tensor", "table_list", "to_int32",
           "check_range", "first_outside"]

ID_DTYPES = tuple(getattr(torch, n) for n in ("int64", "int32", "int16", "int8", "uint8",
                                              "uint16", "uint32", "uint64") if hasattr(torch, n))
"""Every integer dtype an id table may come in (verl stores int16, vLLM 0.22 uint8 / uint16)."""
ENGINE_ID_DTYPES = tuple(getattr(torch, n) for n in ("int16", "uint16", "uint8", "int32")
                         if hasattr(torch, n))
"""Id dtypes the engine reads as they are (no widening copy); int32 is the engine's own."""
ACCEPTED = "int8, int16, int32, int64, uint8, uint16, uint32 or uint64"
"""The accepted id dtypes, as error messages list them."""

_UNSIGNED = tuple(getattr(torch, n) for n in ("uint8", "uint16", "uint32", "uint64")
                  if hasattr(torch, n))
_WIDE = tuple(getattr(torch, n) for n in ("int64", "uint32", "uint64") if hasattr(torch, n))
_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d).replace("torch.", "") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def as_tensor(ids: Any, op: str, name: str) -> torch.Tensor:
    """``ids`` (a torch tensor, a numpy array, or nested lists of Python ints) as a torch tensor of
    an integer dtype, values and dtype unchanged (no copy where torch can share the memory).
    ValueError naming ``op`` and ``name`` for None, text or bytes (base64 / .npy bytes must be
    decoded by an importer first), a bool / float / complex dtype, or anything else, with the
    accepted dtypes."""
    if isinstance(ids, torch.Tensor):
        t = ids
    elif ids is None:
        raise ValueError(f"[{op}] {name} is None: expected an integer array of expert ids "
                         f"({ACCEPTED}; torch or numpy)")
    elif isinstance(ids, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"[{op}] {name} is {type(ids).__name__} ({len(ids)} long), not an array "
                         f"of expert ids ({ACCEPTED}): decode base64 / .npy data first (e.g. "
                         "switchyard.routes.import_vllm_response)")
    else:
        try:
            t = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"[{op}] {name} must be an integer array of expert ids ({ACCEPTED}; "
                             f"torch or numpy), got {type(ids).__name__} ({e})") from None
    if t.dtype not in ID_DTYPES:
        raise ValueError(f"[{op}] {name} must have an integer dtype ({ACCEPTED}), got {t.dtype}")
    return t


def table_list(tables: Any, op: str, name: str = "tables") -> list[Any]:
    """``tables`` (a list, tuple or other iterable of per-sequence tables) as a list. ValueError
    naming ``op`` for one table given alone (a tensor or array, whose rows would be read as
    tables: pass ``[table]``) and for a str, bytes, dict or non-iterable."""
    if hasattr(tables, "shape") and hasattr(tables, "dtype"):
        raise ValueError(f"[{op}] {name} must be a list with one table per sequence, got one "
                         f"{type(tables).__name__} of shape {list(tables.shape)}: pass [table] "
                         "for a single sequence")
    if isinstance(tables, (str, bytes, bytearray, dict)) or not hasattr(tables, "__iter__"):
        raise ValueError(f"[{op}] {name} must be a list with one table per sequence, got "
                         f"{type(tables).__name__}")
    return list(tables)


def _int64(t: torch.Tensor) -> torch.Tensor:
    """int64 copy of an id tensor (uint64 values >= 2**63 come out negative: both are out of any
    range an id check uses, and ``_given`` recovers the value)."""
    return t.to(torch.int64)


def _given(v: int, dtype: torch.dtype) -> int:
    """A value read from the int64 copy, as it was in ``dtype``."""
    if dtype == getattr(torch, "uint64", None) and v < 0:
        return v + 2**64
    return v


def first_outside(ids: torch.Tensor, lo: int, hi: int, allow_none: bool = False
                  ) -> tuple[list[int], int] | None:
    """The first position (a list of ints, row-major) of ``ids`` (an integer tensor, any dtype of
    ID_DTYPES) holding a value outside ``[lo, hi]`` (and not -1 when ``allow_none`` and the dtype
    is signed), with that value as given: ``(position, value)``, or None when there is none. One
    min/max pass; the search for the position only runs when something is outside."""
    if ids.numel() == 0:
        return None
    t = ids if ids.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8) \
        else _int64(ids)  # torch has no comparisons for uint16 / uint32 / uint64
    unsigned_wide = ids.dtype in _UNSIGNED and t.dtype == torch.int64
    mn, mx = torch.aminmax(t)
    if int(mn) >= lo and int(mx) <= hi and not (unsigned_wide and int(mn) < 0):
        return None  # the common case: one pass
    none_ok = allow_none and ids.dtype not in _UNSIGNED
    bad = (t < lo) | (t > hi)
    if none_ok:
        bad &= t != -1
    if unsigned_wide:
        bad |= t < 0
    if not bool(bad.any()):
        return None
    pos = bad.nonzero()[0].tolist()
    return pos, _given(int(t[tuple(pos)]), ids.dtype)


def to_int32(ids: torch.Tensor, op: str, name: str = "topk_idx",
             dtypes: Sequence[torch.dtype] = ID_DTYPES, saturate: bool = False) -> torch.Tensor:
    """``ids`` as int32 on its device, the one narrowing of id tensors: int32 as it is, int16 /
    int8 / uint8 / uint16 widened, int64 / uint32 / uint64 checked first. A value outside int32 is
    a ValueError naming op, argument, value and position (``[op] name holds 4294967301 at
    [0, 3, 1, 0], outside int32``), never wrapped into another id; with ``saturate`` it is clamped
    to int32's range instead (2**31 - 1 or -2**31: outside [0, E) for every E, so the row rule
    sees an invalid row: the "native" policy's counted invalid row). ``dtypes``: the dtypes the
    caller takes (a subset of ID_DTYPES; ValueError listing them for another)."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"[{op}] {name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype == torch.int32:
        return ids
    if ids.dtype not in dtypes:
        raise ValueError(f"[{op}] {name} must have dtype {_dtype_names(dtypes)}, got {ids.dtype}")
    if ids.dtype in _WIDE:
        t = _int64(ids)
        bad = first_outside(ids, _INT32_MIN, _INT32_MAX)
        if bad is not None:
            if not saturate:
                raise ValueError(f"[{op}] {name} holds {bad[1]} at {bad[0]}, outside int32")
            if ids.dtype == getattr(torch, "uint64", None):
                t = torch.where(t < 0, _INT32_MAX, t)  # >= 2**63: clamp high, not low
            return t.clamp(_INT32_MIN, _INT32_MAX).to(torch.int32)
        return t.to(torch.int32)
    return ids.to(torch.int32)


def check_range(ids: torch.Tensor, num_experts: int, op: str, name: str,
                axes: Sequence[str] | None = None, allow_none: bool = True) -> None:
    """ValueError unless every id of ``ids`` (an integer tensor of ID_DTYPES, any shape) is in
    ``[0, num_experts)``, or -1 ("no route") when ``allow_none`` (signed dtypes). The message names
    ``op``, ``name``, the first bad position (by ``axes``, one name per dimension, e.g.
    ``("token", "layer", "slot")``; else the index list), the value as given and its dtype, and
    what is accepted. Checked before any narrowing, so no dtype can wrap an id into range."""
    E = int(num_experts)
    bad = first_outside(ids, 0, E - 1, allow_none)
    if bad is None:
        return
    pos, v = bad
    where = (", ".join(f"{a} {i}" for a, i in zip(axes, pos)) if axes and len(axes) == len(pos)
             else f"position {pos}")
    ok = f"[0, {E})" + (" or -1 (no route)" if allow_none and ids.dtype not in _UNSIGNED else "")
    raise ValueError(f"[{op}] {name}: {where} holds expert id {v} ({str(ids.dtype)[6:]}), outside "
                     f"{ok}")
