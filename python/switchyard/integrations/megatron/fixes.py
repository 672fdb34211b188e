"""switchyard.integrations.megatron.fixes: Megatron-Core's expert-parallel dispatchers sized and
indexed from the routing map (the all-to-all's dropless output size, DeepEP / NCCL-EP metadata),
and the MoE layer handing the router's host-known pair count to the dispatcher. Installed by
``apply()``; see the package docstring."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

_Fn = Callable[..., Any]


# --------------------------------------------------------------------------------------------------
# The seed fix: dispatcher sizes from the routing map's counts
# --------------------------------------------------------------------------------------------------
def make_a2a_preprocess(orig: _Fn) -> _Fn:
    """The wrapper ``apply()`` installs over Megatron-Core's
    MoEAlltoAllTokenDispatcher.preprocess, sized from the routing map's pair count.

    Args:
        orig: the original function.

    Returns:
        The wrapper (functools.wraps of ``orig``).
    """
    @functools.wraps(orig)
    def preprocess(self: Any, routing_map: torch.Tensor) -> Any:
        num_pairs = getattr(self, "_sy_num_pairs", None)
        self._sy_num_pairs = None
        out = orig(self, routing_map)
        cfg = self.config
        if (self.drop_and_pad or cfg.moe_expert_capacity_factor is not None
                or getattr(cfg, "moe_router_padding_for_quantization", False)):
            return out  # Megatron already sizes these from the counts
        if num_pairs is not None:
            # Host integer from the patched router: no device-to-host copy, no sync point moved.
            self.num_out_tokens = int(num_pairs)
            return out
        if not getattr(cfg, "moe_enable_routing_replay", False):
            return out  # native top-k: K distinct experts per row, T*topk is exact
        if self.cuda_dtoh_point != "before_permutation_1":
            raise RuntimeError(
                "[megatron.dispatch] the dropless all-to-all needs the routing map's pair count "
                "before permutation 1, but CUDA-graph capture of moe_preprocess moves the host "
                f"copy to {self.cuda_dtoh_point!r}; attach a switchyard replay to the routers "
                "(sym.attach_replay) so the count is known on the host")
        # The per-expert counts Megatron already computed: their sum is the number of
        # (token, expert) pairs. It rides in the same device-to-host batch as the split sizes
        # (_maybe_dtoh_and_synchronize moves num_out_tokens), so the one sync happens before
        # permutation 1 -- Megatron's own path for token dropping / padding.
        counts = self.input_splits if (self.ep_size > 1 or self.tp_size > 1) else out
        self.num_out_tokens = counts.sum()
        self._maybe_update_cuda_sync_point("before_permutation_1")
        return out
    return preprocess


def make_ep_setup_metadata(orig: _Fn) -> _Fn:
    """The wrapper ``apply()`` installs over Megatron-Core's _DeepepManager /
    _NCCLEPManager.setup_metadata, indices rebuilt from the routing map.

    Args:
        orig: the original function.

    Returns:
        The wrapper (functools.wraps of ``orig``).
    """
    @functools.wraps(orig)
    def setup_metadata(self: Any, routing_map: torch.Tensor, probs: torch.Tensor) -> None:
        orig(self, routing_map, probs)
        if getattr(self, "drop_and_pad", False):
            return  # padded-to-capacity maps hold more than K entries per row by design
        T = routing_map.shape[0]
        rm = routing_map.reshape(T, self.num_experts).bool()
        p = probs.reshape(T, self.num_experts)
        # Probabilities are >= 0, so -1 ranks every pair the map does not hold below every pair
        # it holds (a held pair with weight 0 is still sent, as the map says).
        vals, idx = torch.topk(p.masked_fill(~rm, -1), self.router_topk, dim=-1)
        held = vals >= 0
        self.token_indices = idx.masked_fill(~held, -1)
        self.token_probs = vals.masked_fill(~held, 0)
    return setup_metadata


def make_layer_route(orig: _Fn) -> _Fn:
    """The wrapper ``apply()`` installs over Megatron-Core's MoELayer.route, handing the
    router's host-known pair count to the dispatcher.

    Args:
        orig: the original function.

    Returns:
        The wrapper (functools.wraps of ``orig``).
    """
    @functools.wraps(orig)
    def route(self: Any, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, routing_map = orig(self, hidden_states, padding_mask)
        st = getattr(self.router, "_sy", None)
        self.token_dispatcher._sy_num_pairs = None if st is None else st.last_num_pairs
        return probs, routing_map
    return route
