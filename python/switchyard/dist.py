"""switchyard.dist: communicators for expert parallelism.

    comm = sy.dist.world()   # MPI world (initialises MPI if nobody has); comm.rank, comm.size
    comm = sy.dist.local()   # a size-1 communicator, always available
    comm = sy.dist.from_mpi4py(mpi4py_comm)

Every communicator here is a duplicate, freed at interpreter exit before MPI is finalised; MPI is
finalised by switchyard only when switchyard initialised it.
"""
from __future__ import annotations

import atexit
from typing import Any

from . import _switchyard as _C

Communicator = _C.Communicator
"""An expert-parallel communicator (engine object): ``rank`` and ``size`` (ints), ``name``,
``barrier()`` and ``allreduce_max(values)`` (a list of ints -> their element-wise max over the
ranks, collective). Made by ``world()``, ``local()``, ``from_mpi4py()``, not directly."""

__all__ = ["Communicator", "world", "local", "from_mpi4py", "as_communicator", "mpi_built"]

_world: Any = None


def mpi_built() -> bool:
    """Whether the engine was built with MPI (``-DSWITCHYARD_MPI=ON``).

    Returns:
        bool.
    """
    return bool(_C.dist_mpi_built())


def world() -> Any:
    """The MPI world communicator (one duplicate of MPI_COMM_WORLD per process, cached).
    Initialises MPI (MPI_Init_thread, MPI_THREAD_MULTIPLE) if nobody has.

    Returns:
        Communicator.

    Raises:
        switchyard.BackendError: when the engine was built without MPI, MPI was already
            finalised in this process, or MPI_Init_thread fails.
    """
    global _world
    if _world is None:
        _world = _C.dist_world()
    return _world


def local() -> Any:
    """A new size-1 Communicator (rank 0 of 1): collectives are local copies. Always available
    (no MPI needed).

    Returns:
        Communicator.
    """
    return _C.dist_local()


def from_mpi4py(comm: Any) -> Any:
    """A Communicator duplicating an mpi4py communicator (through its Fortran handle,
    ``comm.py2f()``).

    Args:
        comm: an mpi4py communicator.

    Returns:
        Communicator.

    Raises:
        switchyard.BackendError: when the engine was built without MPI or MPI is not
            initialised.
        ValueError: for MPI_COMM_NULL.
    """
    return _C.dist_from_mpi_fortran(int(comm.py2f()))


def as_communicator(obj: Any, what: str = "ep_comm") -> Any:
    """The Communicator a caller's argument names: None -> ``local()``; a switchyard
    Communicator as is; an mpi4py communicator -> ``from_mpi4py``.

    Args:
        obj: None, a Communicator or an mpi4py communicator.
        what: the caller's argument name, for the error.

    Returns:
        Communicator.

    Raises:
        ValueError: for anything else, naming ``what`` and the type given.
    """
    if obj is None:
        return local()
    if isinstance(obj, Communicator):
        return obj
    if hasattr(obj, "py2f") and hasattr(obj, "Get_size"):
        return from_mpi4py(obj)
    raise ValueError(f"[dist] {what} must be a switchyard.dist.Communicator, an mpi4py communicator "
                     f"or None, got {type(obj).__name__}")


@atexit.register
def _shutdown() -> None:
    global _world
    _world = None
    _C.dist_shutdown()
