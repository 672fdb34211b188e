"""The engine's configuration objects with their Python faces: ``RouterConfig`` (keyword
arguments only, old keyword names refused by name) and ``GlobalAuxLossState`` (old attribute
names refused by name). Re-exported by ``switchyard``."""
from typing import Any

from . import _names
from . import _switchyard as _C
from ._switchyard import GlobalAuxLossState


class RouterConfig(_C.RouterConfig):
    """Router configuration; names and defaults follow Megatron-Core (keyword arguments only).

    ``RouterConfig(num_experts=E, top_k=K, score_function="softmax", pre_softmax=False,
    num_groups=None, group_topk=None, topk_scaling_factor=None, capacity_factor=None,
    token_drop_policy="probs", pad_to_capacity=False, aux_loss_type=None, aux_loss_coeff=0.0,
    z_loss_coeff=0.0, ...)``; the full list with each Megatron name is in
    docs/megatron-options.md.

    Args:
        **kwargs: the fields by name.

    Raises:
        ValueError: from the engine, naming a field with a bad value.
        TypeError: for a keyword an earlier release used, naming its new name.
    """

    def __init__(self, **kwargs: Any) -> None:
        _names.check_kwargs("RouterConfig", kwargs)
        super().__init__(**kwargs)

    def __getattr__(self, name):
        raise _names.old_attribute(self, name)


def _state_getattr(self, name):
    raise _names.old_attribute(self, name)


GlobalAuxLossState.__getattr__ = _state_getattr
