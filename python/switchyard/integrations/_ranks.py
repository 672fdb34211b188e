"""What the trainer adapters (trl, verl) need at more than one rank, once: counts reduced over
the ranks, and a check that the ranks agree on a step's routes.

* ``reduce_counts(counts)``: the sum of every rank's integer counts, plus, for each count, the
  largest and the smallest single rank's value (``name + MAX_RANK_SUFFIX`` / ``MIN_RANK_SUFFIX``),
  so one misaligned rank cannot hide in an average;
* ``check_ranks_agree(what, fields)``: every rank's description of a step (ints: step, layer
  count, id width, ...) gathered and compared; a disagreement raises the same ValueError on every
  rank, naming the field, the ranks and their values, instead of the hang or the silent
  misalignment a later collective would give.

Both are collectives: every rank of ``group`` calls them, in the same order, with the same
names (the names are not exchanged; each rank sends a fixed-length int64 vector). Outside
``torch.distributed`` (or with one rank) they return the local values and check nothing.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

MAX_RANK_SUFFIX = "/max_rank"
"""Suffix of the largest single rank's value of a count in ``reduce_counts``."""
MIN_RANK_SUFFIX = "/min_rank"
"""Suffix of the smallest single rank's value of a count in ``reduce_counts``."""


def world(group: Any = None) -> tuple[int, int]:
    """(rank, world size) of ``group`` (the default group when None); (0, 1) outside
    ``torch.distributed``.

    Args:
        group: a ``torch.distributed`` process group, or None.

    Returns:
        (rank, size).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _device(group: Any) -> torch.device:
    # gloo reduces CPU tensors; nccl needs the rank's current CUDA device.
    backend = torch.distributed.get_backend(group)
    if backend == "nccl" or "cuda" in str(backend).split(","):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(values: Sequence[int], group: Any) -> torch.Tensor:
    """[world, len(values)] int64: every rank's ``values``."""
    _, size = world(group)
    local = torch.tensor([int(v) for v in values], dtype=torch.int64, device=_device(group))
    out = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(out, local, group=group)
    return torch.stack(out).cpu()


def reduce_counts(counts: Mapping[str, int], group: Any = None, *,
                  per_rank: bool = True) -> dict[str, int]:
    """Every rank's ``counts`` summed over the ranks of ``group``.

    Args:
        counts: name -> integer count of this rank (the same names, in the same order, on every
            rank).
        group: a ``torch.distributed`` process group (None: the default group).
        per_rank: also return, per name, the largest and smallest single rank's value under
            ``name + MAX_RANK_SUFFIX`` and ``name + MIN_RANK_SUFFIX``.

    Returns:
        dict name -> sum (and the per-rank extremes). With one rank (or without
        ``torch.distributed``) the local counts, the extremes equal to them.

    Raises:
        TypeError: when a count is not an integer (named, with its value).
    """
    names = list(counts)
    for n in names:
        v = counts[n]
        if isinstance(v, bool) or not isinstance(v, (int, torch.Tensor)) or (
                isinstance(v, torch.Tensor) and (v.numel() != 1 or v.is_floating_point())):
            raise TypeError(f"reduce_counts: counts[{n!r}] must be an integer, got {v!r}")
    local = [int(counts[n]) for n in names]
    _, size = world(group)
    # one rank: its own counts, as Python ints (no tensor per count: this runs per micro-batch)
    cols = list(zip(*_gather(local, group).tolist())) if size > 1 and names else \
        [(v,) for v in local]
    out = {n: sum(c) for n, c in zip(names, cols)}
    if per_rank:
        for n, c in zip(names, cols):
            out[n + MAX_RANK_SUFFIX] = max(c)
            out[n + MIN_RANK_SUFFIX] = min(c)
    return out


def check_ranks_agree(what: str, fields: Mapping[str, int], group: Any = None) -> None:
    """Raises on every rank when the ranks of ``group`` disagree on any of ``fields``.

    Args:
        what: what is being checked, for the message (e.g. "verl micro-batch routes").
        fields: name -> integer this rank holds (the same names, in the same order, on every
            rank; e.g. step, number of MoE layers, top-k).
        group: a ``torch.distributed`` process group (None: the default group).

    Raises:
        ValueError: on every rank, naming the first field that differs and each rank's value.
    """
    _, size = world(group)
    if size <= 1 or not fields:
        return
    names = list(fields)
    table = _gather([int(fields[n]) for n in names], group)
    for i, n in enumerate(names):
        col = table[:, i].tolist()
        if len(set(col)) > 1:
            per = ", ".join(f"rank {r}: {v}" for r, v in enumerate(col))
            raise ValueError(f"switchyard: the ranks disagree on {what}: {n} differs ({per}); "
                             "every rank must replay the same step with the same routes layout")
