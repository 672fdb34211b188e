"""switchyard.integrations.megatron: router replay and expert-parallel dispatch fixed inside
Megatron-Core (0.16 to 0.19.x: ``apply()`` refuses other releases, a newer one passes with a
warning under SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1), in place.

    import switchyard.integrations.megatron as sym
    sym.apply()                                   # patches megatron.core; returns a PatchReport
    replays = sym.attach_replay(model)            # {layer_number or ("mtp", n): RouterReplay}

then per micro-batch (R3: ids from the rollout engine; see ``switchyard.routes.from_verl``)::

    sym.set_replay_targets(model, {3: ids_l3, 4: ids_l4, ...}, group=ep_group)
    sym.set_replay_action(model, "replay_forward")
    loss = forward_backward(...)                  # recompute inside backward reuses the same ids
    sym.replay_counts(model)                      # replayed / native / invalid rows per layer

What ``apply()`` changes (each is one function or method of Megatron-Core, wrapped, and put back
by ``remove()``):

* ``MoEAlltoAllTokenDispatcher.preprocess``: in the dropless case Megatron sizes the permuted
  buffer as ``T * moe_router_topk`` although the routing map may hold fewer pairs (a replayed row
  that repeats an id, e.g. a zero-filled padding row): the all-to-all then fails with "Split sizes
  doesn't match total dim 0 size" (and since core 0.17 the unfused permute truncates to that
  size). Patched, the size is the routing map's pair count: a host integer when the patched
  router knows it (its replay ids were validated on the host: no synchronisation at all), else,
  with Megatron's own replay enabled (``moe_enable_routing_replay``), the sum of the per-expert
  counts Megatron already copies to the host for the split sizes, in the same device-to-host
  batch (Megatron's own path for capacity / quantisation padding; the one synchronisation then
  happens before permutation 1 instead of before the all-to-all). Native routing keeps
  Megatron's static size (exact there).
  Capacity and drop-and-pad keep Megatron's code unchanged.
* ``_DeepepManager.setup_metadata`` / ``_NCCLEPManager.setup_metadata``: the (index, weight)
  metadata is rebuilt from the routing map instead of ``topk(probs)``, so a row with fewer than
  K experts gets -1 slots instead of extra experts at weight 0.
* ``TopKRouter.forward`` / ``TopKRouter.routing``: only for routers given a replay by
  ``attach_replay`` (others run Megatron's code unchanged): replay ids validated by switchyard's
  engine (shape, dtype, id range, -1 rows routed natively and counted, repeated ids an error or
  merged with summed weight), replay and record on every router path (``moe_router_fusion``,
  sinkhorn included), routing weights recomputed with Megatron's own score function at the
  replayed ids, activation-checkpoint recompute inside backward reusing the forward's ids
  (bounded queue; forward-only passes queue nothing), aux loss on the routes used.
* ``MoELayer.route``: hands the router's host-known pair count to the dispatcher.
* ``tensor_parallel.checkpoint``: notes whether a backward (so a recompute) will follow the call.

On CUDA tensors everything above is Megatron's math plus these fixes. ``apply(engine="cpu")``
additionally runs, for attached routers on CPU tensors, switchyard's FP32-accumulated
batch-invariant gate (``switchyard.torch.router_gating_linear``, also patching ``Router.gating``;
logits in moe_router_dtype, None = the input's dtype as in Megatron and ``topk_router_kwargs``) and
``switchyard.torch.topk_route`` with Megatron's option names mapped; token dropping, aux losses
and expert-bias counting stay Megatron's functions. See notes/megatron.md for versions.

Modules: ``patch`` (apply / remove, version check, PatchReport), ``fixes`` (dispatcher fixes),
``replay`` (replay inside TopKRouter and its API), ``config`` (TransformerConfig -> switchyard
options, the dtype map).
"""
from switchyard.replay import ReplayCounts

from .config import router_config, topk_router, topk_router_kwargs
from .patch import (SUPPORTED_VERSIONS, TESTED_VERSIONS, PatchReport, apply, is_applied, patched,
                    remove)
from .replay import (attach_replay, clear_replay, detach_replay, replay_counts, replays,
                     set_replay_action, set_replay_targets)

__all__ = ["apply", "remove", "patched", "is_applied", "PatchReport", "SUPPORTED_VERSIONS",
           "router_config", "topk_router_kwargs", "topk_router",
           "TESTED_VERSIONS", "attach_replay", "detach_replay", "replays", "set_replay_targets",
           "set_replay_action", "clear_replay", "replay_counts", "ReplayCounts"]
