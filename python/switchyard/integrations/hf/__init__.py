"""switchyard.integrations.hf: FP32 routers, router replay and route capture for Hugging Face MoE
models (transformers 5.24 to 5.x, an optional dependency: it comes with the model you pass; 5.24
and 5.25 are tested, a later 5.x minor is patched and any MoE block whose router no routing spec
covers is refused by name; ``patch()`` refuses an older release, and a newer major one unless
SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1, with a warning). The supported families, and the refused
ones with the reason, are in ``spec`` (SPECS, REFUSED, OUT_OF_SCOPE).

    import switchyard.integrations.hf as syhf
    p = syhf.patch(model, router_dtype=torch.float32)   # every MoE router of the model, in place
    print(p)                                            # family, router dtype, gate, patched layers
    ...train / generate as usual...
    p.unpatch()                                         # or: with syhf.patch(model): ...

What the patch does, per MoE decoder layer (keyed by its absolute layer number):

* It replaces the router module's ``forward`` on the instance (``mlp.gate``, ``mlp.router`` for
  GPT-OSS, ``feed_forward.router`` for Llama-4; for a family that routes inline in its MoE block,
  with no router module, the block's: Doge's ``mlp``, spec ``inline``, whose experts then run
  under the caller's autocast as unpatched). Module structure, parameter names, state-dict keys,
  FSDP wrapping, forward hooks (``output_router_logits``) and the router's return contract stay as
  they are; ``unpatch()`` restores the original forward (the handle of an earlier Patch whose
  routers were patched again changes nothing; ``active`` says whether the routers run this Patch).
  ``copy.deepcopy(model)`` (TRL's reference model) gives an independent patched copy, whose Patch is
  ``patch_of(copy)``. On the meta device (shape inference) the family's math runs on meta tensors,
  without replay, record or capture.
* ``router_dtype=torch.float32`` (or ``torch.float64``): the gate GEMM runs in that dtype even under
  ``torch.autocast``, and the family's routing math (softmax or sigmoid, correction bias,
  group-limited top-k, renormalisation, scaling) runs on those logits. On CPU tensors the gate is
  switchyard's engine (``switchyard.torch.router_gating_linear``: bf16/fp32 inputs, fp32
  accumulation in a fixed order, batch invariant, exact backward). On CUDA tensors it is a torch
  GEMM in router_dtype with autocast off: the same routing semantics, but NOT batch invariant
  (cuBLAS picks its reduction order by shape). ``gate="torch"`` asks for the torch GEMM on CPU too.
* ``router_dtype=None``: the family's own dtypes and GEMM, bitwise the same outputs as unpatched;
  use it for replay and capture without a precision change.
* Combine weights (what the router hands to the experts), per family, with router_dtype set:
  router_dtype for Qwen3-MoE, Qwen2-MoE, Qwen3-Next, OLMoE, HunYuan (their code casts the weights to
  the logits' dtype), Mixtral, DeepSeek-V3, GLM4-MoE (their code keeps them fp32) and GPT-OSS
  (softmax in the logits' dtype); the hidden-states dtype for ERNIE-4.5 (its code casts to it) and
  Llama-4 (its scores scale the experts' input, whose GEMM needs the experts' dtype).
  ``COMBINE_DTYPE`` says the same in code.
* Replay (R2 / R3): ``p.replays[layer]`` is a ``switchyard.RouterReplay``. Action ``"record"``
  records the ids of every forward; ``"replay_forward"`` replays the next target
  (``p.set_targets``) or else the oldest recorded table. Only ids are replayed: the weights are
  recomputed from the live logits at those ids with the family's formula, so gradients reach the
  router. A row of all -1 is routed natively and counted; an invalid row (mixing -1 and ids,
  repeating an id, an id outside [0, E)) is a ValueError naming the layer and token, or routed
  natively and counted with ``invalid_replay_rows="native"``. ``p.counts()`` gives per layer
  ``num_replayed_rows``, ``num_native_rows``, ``num_invalid_replay_rows``, ``num_recomputed_rows``
  and ``num_calls``. A step is all or nothing: ``set_targets`` checks every layer's rows before any
  layer queues its table, and a forward that fails anywhere drops that step's table (target, or
  recorded table with R2) in every layer, so the retry never replays a failed batch's ids (set the
  targets again).
* Activation checkpointing (``model.gradient_checkpointing_enable()``): a forward that will be
  recomputed queues its final ids; the recompute inside backward (detected as running inside the
  autograd engine) routes with exactly those ids, first in first out per layer, and neither records
  nor captures.
* Capture: ``with p.capture() as cap: model.generate(...)`` records the ids of the prefill and of
  every decode step (KV cache included); ``cap.routed_experts(attention_mask)`` gives vLLM's
  ``routed_experts`` per sequence (int32 ``[num_tokens - 1, num_hidden_layers, K]``, dense layers
  0), ``cap.tables(...)`` switchyard route tables, ``cap.write(path, ...)`` a route file. Beam
  search (``num_beams > 1``) is refused while capturing: it reorders the beams at every step.

* Several routers per decoder layer (JetMoE: its attention experts' router, then its MLP
  experts'): each is a route layer of its own, decoder layer i's at 2i and 2i + 1
  (``p.routes_per_layer``); ``p.layers`` and route data over all layers
  (``p.num_route_layers`` = 2 × num_hidden_layers) follow that order.
* Layers run in several passes (Inkling2-Loop's loop layers, ``loop_num_passes`` per forward):
  each (pass, layer) is a route layer of its own, in forward order (``p.num_route_layers`` = the
  config's ``total_num_hidden_layers``); the router reads its pass from the call, so the
  checkpoint recompute replays its own pass's ids.
* Per-layer K (HunYuan's ``moe_topk`` list): ``p.top_ks`` gives each layer's K; route tables in
  and out are ``p.top_k`` (the largest) wide, -1 past a layer's own K.
* Experts-side capture: ``cap.expert_ids()`` holds the ids the experts modules received
  (transformers' experts interface), and ``syhf.capture_experts(model)`` observes them on any
  model, patched or not (refused families too).

Modules: ``spec`` (each family's routing as data: a RoutingSpec), ``families`` (the generic
routed forward that reads a spec, and the gate), ``patch`` (install / unpatch, the replay queues,
``Patch``), ``capture`` (recording during generate).
"""
from .capture import Capture, ExpertsCapture, capture_experts
from .families import COMBINE_DTYPE, FAMILIES
from .patch import (MIN_TRANSFORMERS_VERSION, SUPPORTED_TRANSFORMERS_VERSIONS, Patch, patch,
                    patch_of)

__all__ = ["patch", "patch_of", "Patch", "Capture", "ExpertsCapture", "capture_experts", "MIN_TRANSFORMERS_VERSION",
           "SUPPORTED_TRANSFORMERS_VERSIONS", "FAMILIES", "COMBINE_DTYPE"]
