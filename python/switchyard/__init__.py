"""switchyard: MoE routing for RL post-training (FP32 router, router replay, expert-parallel dispatch).

    import switchyard as sy            # engine objects: RouterConfig, RouterReplay, dist, routes
    import switchyard.torch as syt     # autograd pieces for PyTorch training stacks

Engine errors map to ValueError (bad arguments), IndexError (missing key / empty queue) and
RuntimeError (switchyard.BackendError, switchyard.DataError and other failures), with the engine's
messages. This module defines nothing: it re-exports the package's face.
"""
import torch as _torch  # noqa: F401  (libtorch is loaded before the extension hands tensors to it)

from ._switchyard import (BackendError, DataError, built_with_cuda, cpu_isa, cuda_device_count,
                          num_threads, set_cpu_isa, set_num_threads)
from ._engine import GlobalAuxLossState, RouterConfig
from . import replay
from .replay import RouterReplay
from . import dist
from . import routes

__all__ = ["BackendError", "DataError", "GlobalAuxLossState", "RouterConfig", "RouterReplay",
           "built_with_cuda", "cpu_isa", "cuda_device_count", "num_threads", "set_cpu_isa",
           "set_num_threads", "dist", "replay", "routes"]
