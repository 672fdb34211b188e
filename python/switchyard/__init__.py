"""switchyard: MoE routing for RL post-training (FP32 router, router replay, expert-parallel dispatch).

    import switchyard as sy            # engine objects: RouterConfig, RouterReplay, dist, routes
    import switchyard.torch as syt     # autograd pieces for PyTorch training stacks

Engine errors map to ValueError (bad arguments), IndexError (missing key) and RuntimeError
(BackendError, DataError and other failures), with the engine's messages.
"""
import torch as _torch  # noqa: F401  (loads libtorch before the extension hands tensors to it)

from . import _switchyard as _C
from ._switchyard import BackendError, DataError, num_threads, set_num_threads

__all__ = ["BackendError", "DataError", "num_threads", "set_num_threads"]
