"""switchyard.integrations.hf: FP32 routers, router replay and route capture for Hugging Face MoE
models (transformers >= 5.24, an optional dependency: it comes with the model you pass).

    import switchyard.integrations.hf as syhf
    p = syhf.patch(model, router_dtype=torch.float32)   # every MoE router of the model, in place
    print(p)                                            # family, router dtype, gate, patched layers
    ...train / generate as usual...
    p.unpatch()                                         # or: with syhf.patch(model): ...

What the patch does, per MoE decoder layer (keyed by its absolute layer number):

* It replaces the router module's ``forward`` on the instance (``mlp.gate``, ``mlp.router`` for
  GPT-OSS, ``feed_forward.router`` for Llama-4). Module structure, parameter names, state-dict keys,
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
"""
import collections
import contextlib
import os
import re
import sys

import torch
import torch.nn.functional as F

import switchyard as sy
import switchyard.torch as syt
from switchyard import routes as syr

__all__ = ["patch", "patch_of", "Patch", "Capture", "MIN_TRANSFORMERS_VERSION", "FAMILIES",
           "COMBINE_DTYPE"]

#: Oldest transformers release this integration was checked against (router classes and the exact
#: routing math of every family below were read from it).
MIN_TRANSFORMERS_VERSION = "5.24.0"


def _sdt(logits):
    """The dtype the routing math runs in: fp32, or fp64 for fp64 logits (the families' code says
    ``dtype=torch.float``, which would round fp64 logits)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _ids(select, replay_ids, replay_mask):
    """The final ids: the family's live selection (run without autograd: ids are never
    differentiable, and the recompute of a replayed forward must save the same tensors as the
    forward did) for the rows not replayed, replay_ids for the replayed rows."""
    if replay_ids is not None and bool(replay_mask.all()):
        return replay_ids
    with torch.no_grad():
        ids = select()
    return ids if replay_ids is None else torch.where(replay_mask[:, None], replay_ids, ids)


# --------------------------------------------------------------------------------------------------
# Families: where the router is, its gate parameters, and its routing math (written from the
# semantics of each family's router in transformers 5.24; the ops and their order are the family's,
# so that router_dtype=None reproduces the unpatched outputs bitwise). The weights are always the
# scores gathered at the final ids, which for live rows is bitwise the family's top-k values (and
# the gradient of a gather is the gradient of a top-k), so live and replayed rows share one graph.
# --------------------------------------------------------------------------------------------------
class _Family:
    name = ""            # model_type
    title = ""           # how people write it
    router_class = ""    # class name in transformers.models.<name>.modeling_<name>
    combine_dtype = "router_dtype"

    @property
    def module(self):
        return f"transformers.models.{self.name}.modeling_{self.name}"

    def params(self, r):
        return r.weight, None

    def num_experts(self, r):
        return int(r.num_experts)

    def top_k(self, r):
        return int(r.top_k)

    def native_context(self, r, x):
        return contextlib.nullcontext()

    def native_logits(self, r, x):
        return F.linear(x, r.weight)

    def route(self, r, logits, replay_ids, replay_mask):
        """-> (weights [T, K], ids [T, K] int64); replayed rows take replay_ids."""
        raise NotImplementedError

    def outputs(self, r, logits, weights, ids, x, native):
        return logits, weights, ids


class _SoftmaxTopK(_Family):
    """softmax over all experts, top-k, optional renormalisation, weights cast to the logits' dtype
    (Qwen3-MoE, Qwen2-MoE, Qwen3-Next, OLMoE; HunYuan and Mixtral below)."""
    always_normalize = False
    cast_to_logits_dtype = True

    def _normalize(self, r):
        return self.always_normalize or bool(r.norm_topk_prob)

    def route(self, r, logits, replay_ids, replay_mask):
        probs = F.softmax(logits, dtype=_sdt(logits), dim=-1)
        ids = _ids(lambda: torch.topk(probs.detach(), self.top_k(r), dim=-1)[1], replay_ids,
                   replay_mask)
        weights = probs.gather(1, ids)
        if self._normalize(r):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.cast_to_logits_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids


class _Qwen3Moe(_SoftmaxTopK):
    name, title, router_class = "qwen3_moe", "Qwen3-MoE", "Qwen3MoeTopKRouter"


class _Qwen2Moe(_SoftmaxTopK):
    name, title, router_class = "qwen2_moe", "Qwen2-MoE", "Qwen2MoeTopKRouter"


class _Qwen3Next(_SoftmaxTopK):
    name, title, router_class = "qwen3_next", "Qwen3-Next", "Qwen3NextTopKRouter"


class _Olmoe(_SoftmaxTopK):
    name, title, router_class = "olmoe", "OLMoE", "OlmoeTopKRouter"


class _Mixtral(_SoftmaxTopK):
    """Always renormalised; weights stay fp32. The training-time jitter multiplies the hidden states
    in the MoE block before the router is called, so it is untouched by the patch."""
    name, title, router_class = "mixtral", "Mixtral", "MixtralTopKRouter"
    always_normalize = True
    cast_to_logits_dtype = False


class _HunYuan(_SoftmaxTopK):
    """The gate is ``wg`` (an nn.Linear, fp32 at init); the input is cast to fp32 when wg is."""
    name, title, router_class = "hunyuan_v1_moe", "HunYuan-MoE-V1", "HunYuanMoEV1Gate"
    always_normalize = True

    def params(self, r):
        return r.wg.weight, r.wg.bias

    def native_logits(self, r, x):
        if r.wg.weight.dtype == torch.float32:
            x = x.float()
        return r.wg(x)


class _SigmoidGroupLimited(_Family):
    """DeepSeek-V3 / GLM4-MoE: sigmoid scores; selection on scores + e_score_correction_bias,
    restricted to the topk_group best of n_group groups (a group scores the sum of its top 2), the
    other groups masked with -inf; weights = the scores at the ids, renormalised (+1e-20) when
    norm_topk_prob, times routed_scaling_factor. The family's gate is fp32 (x and W cast)."""
    combine_dtype = "router_dtype (fp32 unpatched too)"

    def native_logits(self, r, x):
        return F.linear(x.type(torch.float32), r.weight.type(torch.float32))

    def _select(self, r, scores):
        E, G = self.num_experts(r), int(r.num_group)
        choice = scores + r.e_score_correction_bias
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=int(r.topk_group), dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        return torch.topk(choice, k=self.top_k(r), dim=-1, sorted=False)[1]

    def route(self, r, logits, replay_ids, replay_mask):
        scores = logits.sigmoid()
        ids = _ids(lambda: self._select(r, scores.detach()), replay_ids, replay_mask)
        weights = scores.gather(1, ids)
        if r.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * r.routed_scaling_factor
        return weights, ids


class _DeepseekV3(_SigmoidGroupLimited):
    name, title, router_class = "deepseek_v3", "DeepSeek-V3", "DeepseekV3TopkRouter"


class _Glm4Moe(_SigmoidGroupLimited):
    name, title, router_class = "glm4_moe", "GLM4-MoE", "Glm4MoeTopkRouter"


class _GptOss(_Family):
    """Top-k on the logits (router bias included), then softmax over the K selected logits."""
    name, title, router_class = "gpt_oss", "GPT-OSS", "GptOssTopKRouter"

    def params(self, r):
        return r.weight, r.bias

    def native_logits(self, r, x):
        return F.linear(x, r.weight, r.bias)

    def route(self, r, logits, replay_ids, replay_mask):
        ids = _ids(lambda: torch.topk(logits.detach(), self.top_k(r), dim=-1)[1], replay_ids,
                   replay_mask)
        top = logits.gather(1, ids)
        return F.softmax(top, dim=1, dtype=top.dtype), ids


class _Llama4(_Family):
    """Top-k on the logits; the router returns dense scores [T, E]: sigmoid of the selected
    logits, 0 elsewhere (sigmoid of -inf), and the logits."""
    name, title, router_class = "llama4", "Llama-4", "Llama4Router"
    combine_dtype = "hidden dtype"

    def params(self, r):
        return r.weight, r.bias

    def native_logits(self, r, x):
        return F.linear(x, r.weight, r.bias)

    def route(self, r, logits, replay_ids, replay_mask):
        ids = _ids(lambda: torch.topk(logits.detach(), self.top_k(r), dim=1)[1], replay_ids,
                   replay_mask)
        return logits.gather(1, ids), ids

    def outputs(self, r, logits, weights, ids, x, native):
        scores = torch.full_like(logits, float("-inf")).scatter_(1, ids, weights)
        # Unpatched: sigmoid in fp32, back to the logits' dtype. Patched, the scores multiply the
        # experts' input, so they come back in the hidden states' dtype.
        out_dtype = scores.dtype if native else x.dtype
        return torch.sigmoid(scores.to(_sdt(scores))).to(out_dtype), logits


class _Ernie45(_Family):
    """softmax; selection on probs + e_score_correction_bias (moe_statics); weights = probs at the
    ids / clamp(sum, min=moe_norm_min), cast to the hidden dtype. Gate and routing in fp32 with
    autocast off (as the family does)."""
    name, title, router_class = "ernie4_5_moe", "ERNIE-4.5-MoE", "Ernie4_5_MoeTopKRouter"
    combine_dtype = "hidden dtype"

    def native_context(self, r, x):
        return torch.autocast(device_type=x.device.type, enabled=False)

    def native_logits(self, r, x):
        return F.linear(x.float(), r.weight.float())

    def route(self, r, logits, replay_ids, replay_mask):
        probs = F.softmax(logits, dim=1, dtype=_sdt(logits))
        ids = _ids(lambda: torch.topk(r.moe_statics(probs.detach()), self.top_k(r), dim=-1)[1],
                   replay_ids, replay_mask)
        weights = torch.gather(probs, dim=-1, index=ids)
        weights = weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=r.norm_min)
        return weights, ids

    def outputs(self, r, logits, weights, ids, x, native):
        return logits, weights.to(x.dtype), ids


FAMILIES = {f.name: f for f in (_Qwen3Moe(), _Qwen2Moe(), _Qwen3Next(), _Olmoe(), _Mixtral(),
                                _DeepseekV3(), _Glm4Moe(), _GptOss(), _Llama4(), _Ernie45(),
                                _HunYuan())}
#: Dtype of the combine weights each family's patched router returns (router_dtype set).
COMBINE_DTYPE = {f.title: f.combine_dtype for f in FAMILIES.values()}


def _family_of(module):
    for cls in type(module).__mro__:  # FSDP2 subclasses the module's class: look through it
        for fam in FAMILIES.values():
            if cls.__name__ == fam.router_class and cls.__module__ == fam.module:
                return fam
    return None


# --------------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------------
_ENGINE_DTYPES = (torch.bfloat16, torch.float32)


def _gate(x, weight, bias, router_dtype, gate):
    # The engine takes bf16/fp32 weights (an fp64 model's gate, a reference, goes through torch).
    if x.device.type == "cpu" and gate == "auto" and weight.dtype in _ENGINE_DTYPES:
        if router_dtype == torch.float64:
            x = x.double()
        elif x.dtype not in _ENGINE_DTYPES:
            x = x.to(weight.dtype)
        if bias is not None and bias.dtype != weight.dtype:
            bias = bias.to(weight.dtype)
        return syt.router_gating_linear(x, weight, bias, router_dtype=router_dtype)
    return F.linear(x.to(router_dtype), weight.to(router_dtype),
                    None if bias is None else bias.to(router_dtype))


# --------------------------------------------------------------------------------------------------
# One patched MoE layer
# --------------------------------------------------------------------------------------------------
class _Layer:
    def __init__(self, owner, layer, name, router, decoder_layer, family):
        self.owner = owner
        self.layer = layer
        self.name = name
        self.router = router
        self.decoder_layer = decoder_layer
        self.family = family
        self.num_experts = family.num_experts(router)
        self.top_k = family.top_k(router)
        self.replay = sy.RouterReplay(self.top_k, layer=layer,
                                      invalid_replay_rows=owner.invalid_replay_rows)
        self._config = None
        self.will_recompute = False
        self.batch_shape = None
        self.counts = collections.Counter()
        self._hook = None
        self._had_instance_forward = "forward" in router.__dict__
        self._orig_forward = router.__dict__.get("forward")

    def install(self):
        # A bound method, not a closure: copy.deepcopy of the model copies this _Layer with it (its
        # router, replay and Patch), so the copy's router runs its own forward.
        self.router.forward = self.forward
        if self.decoder_layer is not None:
            self._hook = self.decoder_layer.register_forward_pre_hook(self._pre_hook,
                                                                      with_kwargs=True)

    @property
    def installed(self) -> bool:
        """Whether the router's forward is still this layer's (not unpatched, not replaced by a
        newer Patch)."""
        return _owner_of(self.router.__dict__.get("forward")) is self

    def uninstall(self):
        if self.installed:  # a newer Patch's forward stays where it is
            if self._had_instance_forward:
                self.router.forward = self._orig_forward
            else:
                self.router.__dict__.pop("forward", None)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _pre_hook(self, module, args, kwargs):
        # Runs in the decoder layer's __call__, outside the checkpointed forward, so once per real
        # forward: the condition under which transformers checkpoints the layer.
        self.will_recompute = bool(getattr(module, "gradient_checkpointing", False) and
                                   module.training and torch.is_grad_enabled())
        h = args[0] if args else kwargs.get("hidden_states")
        self.batch_shape = tuple(h.shape[:-1]) if isinstance(h, torch.Tensor) else None

    # ---- replay ----
    def _classify(self, target, T):
        """Engine check of replay rows ([T, K] int32/int64 on the CPU): which rows are replayed.
        The engine keeps a valid row as given and routes all -1 rows (and, with "native", invalid
        rows) natively; a natively routed row never equals its invalid or all -1 replay row. It
        raises its ValueError (naming layer, token and row) on an invalid row by default, and on a
        table whose shape is not [T, K]. The logits are zeros: only the row kinds are used."""
        if self._config is None:
            self._config = sy.RouterConfig(num_experts=self.num_experts, top_k=self.top_k)
        try:
            with torch.no_grad():
                _, idx, info = syt.topk_route(
                    torch.zeros(T, self.num_experts, dtype=torch.float32), self._config,
                    replay_idx=target, invalid_replay_rows=self.owner.invalid_replay_rows,
                    layer=self.layer, return_info=True)
        except ValueError as e:  # the engine's message, with the layer where it does not say it
            if f"layer {self.layer}" in str(e):
                raise
            raise ValueError(f"[hf] layer {self.layer} ({self.name}): {e}") from e
        ids32 = target.to(torch.int32)  # in range: the engine checked
        return ids32, (idx.to(torch.int32) == ids32).all(dim=1), info

    def _target(self):
        r = self.replay
        if r.action == "replay_forward":
            # set_target queue first (R3), then the recorded tables (R2): RouterReplay's order.
            # Taken before it is checked: a forward that fails never leaves it for the retry.
            self.owner._consumed.add(self.layer)
            return r.pop_next_target()
        if r.action == "replay_backward":
            raise ValueError(f"[hf] layer {self.layer}: action 'replay_backward' is not used with "
                             "transformers models: the checkpoint recompute is detected and "
                             "replayed automatically; use 'replay_forward'")
        return None

    # ---- the patched router forward ----
    def forward(self, hidden_states):
        owner, fam, r = self.owner, self.family, self.router
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        T = x.shape[0]
        native = owner.router_dtype is None
        if x.device.type == "meta":
            # Shape inference / deferred init: the family's math on meta tensors (autocast has no
            # meta device, the engine needs data); no replay, record or capture.
            logits = (fam.native_logits(r, x) if native else
                      _gate(x, *fam.params(r), owner.router_dtype, "torch"))
            weights, ids = fam.route(r, logits, None, None)
            return fam.outputs(r, logits, weights, ids, hidden_states, native)
        recompute = torch._C._current_graph_task_id() != -1  # inside backward: checkpoint replay
        ctx = (contextlib.nullcontext() if native
               else torch.autocast(device_type=x.device.type, enabled=False))
        with ctx:
            with fam.native_context(r, x) if native else contextlib.nullcontext():
                if native:
                    logits = fam.native_logits(r, x)
                else:
                    w, b = fam.params(r)
                    logits = _gate(x, w, b, owner.router_dtype, owner.gate)
                replay_ids = replay_mask = None
                if recompute:
                    if self.replay.num_pending_backward:
                        ids32 = self.replay.replay_backward(T)
                        replay_ids = ids32.to(device=logits.device, dtype=torch.int64)
                        replay_mask = torch.ones(T, dtype=torch.bool, device=logits.device)
                        self.counts["num_recomputed_rows"] += T
                    elif self.replay.action == "replay_forward":
                        raise RuntimeError(
                            f"[hf] layer {self.layer}: a checkpoint recompute found no queued ids "
                            "(the layer was checkpointed by something other than transformers' "
                            "gradient_checkpointing_enable, so its forward did not queue them)")
                    else:
                        self.counts["num_recomputed_native_rows"] += T
                else:
                    target = self._target()
                    if target is not None:
                        ids32, mask, info = self._classify(target.to("cpu").contiguous(), T)
                        replay_ids = ids32.to(device=logits.device, dtype=torch.int64)
                        replay_mask = mask.to(logits.device)
                        self.counts["num_replayed_rows"] += info.num_replayed_rows
                        self.counts["num_native_rows"] += info.num_native_rows
                        self.counts["num_invalid_replay_rows"] += info.num_invalid_replay_rows
                    else:
                        self.counts["num_native_rows"] += T
                    self.counts["num_calls"] += 1
                weights, ids = fam.route(r, logits, replay_ids, replay_mask)
            if not recompute:
                self._after_forward(ids, T)
            return fam.outputs(r, logits, weights, ids, hidden_states, native)

    def _after_forward(self, ids, T):
        # The decoder layer's pre-hook state belongs to this one router call.
        will_recompute, batch_shape = self.will_recompute, self.batch_shape
        self.will_recompute, self.batch_shape = False, None
        if not (self.replay.action == "record" or will_recompute or
                self.owner._capture is not None):
            return
        ids32 = ids.detach().to(device="cpu", dtype=torch.int32).contiguous()
        if self.replay.action == "record":
            self.replay.record(ids32)
        if will_recompute:
            self.replay.replay_forward(ids32)  # queued for the recompute inside backward
        if self.owner._capture is not None:
            self.owner._capture._add(self.layer, ids32, batch_shape, T)


# --------------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------------
class Capture:
    """Route capture over forwards (a whole ``generate()``: prefill and every decode step).

    Every forward of a MoE layer appends its ids as [B, S, K]; the steps are concatenated along S,
    so token s of row b is the s-th token that row fed to the model."""

    def __init__(self, owner):
        self._owner = owner
        self._steps = {l.layer: [] for l in owner._layers}
        self.active = False
        self._had_generate = False
        self._orig_generate = None

    def _generate(self, *args, **kwargs):
        """The model's generate() while capturing: beam search refused before any forward."""
        model = self._owner.model
        cfgs = [a for a in args if hasattr(a, "num_beams")]
        cfg = kwargs.get("generation_config") or (cfgs[0] if cfgs else None) or \
            getattr(model, "generation_config", None)
        num_beams = kwargs.get("num_beams", getattr(cfg, "num_beams", 1))
        if num_beams is not None and int(num_beams) > 1:
            raise ValueError(f"[hf.capture] generate() with num_beams={int(num_beams)}: beam "
                             "search reorders the beams at every step, so the captured routes "
                             "would not follow the returned sequences; capture supports greedy "
                             "search and sampling (num_beams=1)")
        if self._orig_generate is not None:
            return self._orig_generate(*args, **kwargs)
        return type(model).generate(model, *args, **kwargs)

    def _add(self, layer, ids32, batch_shape, T):
        if batch_shape is None or len(batch_shape) != 2 or batch_shape[0] * batch_shape[1] != T:
            batch_shape = (1, T)
        self._steps[layer].append(ids32.view(batch_shape[0], batch_shape[1], -1))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._owner._stop_capture(self)

    @property
    def num_forwards(self) -> int:
        return max((len(v) for v in self._steps.values()), default=0)

    def ids(self) -> torch.Tensor:
        """[B, S_fed, num_hidden_layers, K] int32: every fed token's ids, dense layers 0."""
        o = self._owner
        per = {}
        for layer, steps in self._steps.items():
            if not steps:
                raise ValueError("[hf.Capture] nothing was captured (no forward ran while "
                                 "capturing)")
            if len({s.shape[0] for s in steps}) != 1:
                raise ValueError("[hf.Capture] the captured forwards have different batch sizes "
                                 f"{sorted({s.shape[0] for s in steps})}: capture one generate() "
                                 "call at a time")
            per[layer] = torch.cat(steps, dim=1)
        first = next(iter(per.values()))
        B, S, K = first.shape
        out = torch.zeros(B, S, o.num_hidden_layers, K, dtype=torch.int32)
        for layer, t in per.items():
            out[:, :, layer, :] = t
        return out

    def routed_experts(self, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """vLLM's ``routed_experts`` per sequence: a list of int32 tensors
        [num_tokens - 1, num_hidden_layers, K] (dense layers 0; the last token, never fed, has no
        route). ``attention_mask`` [B, S_out] (nonzero = real token) of the generated sequences
        (prompt + new tokens, S_out = fed tokens + 1) or of the fed tokens; None = every token is
        real. A sequence that ended early fed its last token too: that row is dropped, as vLLM never
        routes the last token."""
        ids = self.ids()
        B, S = ids.shape[:2]
        if attention_mask is None:
            return [ids[b] for b in range(B)]
        m = torch.as_tensor(attention_mask).to("cpu")
        if m.dim() != 2 or m.shape[0] != B or m.shape[1] not in (S, S + 1):
            raise ValueError(f"[hf.Capture] attention_mask must be [{B}, {S + 1}] (generated "
                             f"sequences) or [{B}, {S}] (fed tokens), got {list(m.shape)}")
        m = m.bool()
        generated = m.shape[1] == S + 1
        out = []
        for b in range(B):
            rows = ids[b][m[b, :S]]
            # vLLM has no route for a sequence's last token: drop the last fed real token's route
            # unless the sequence's last token is the unfed final one.
            if not (generated and bool(m[b, S])):
                rows = rows[:-1]
            out.append(rows.contiguous())
        return out

    def to_verl(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """verl's ``routed_experts`` batch layout: int16 [B, S_out, num_hidden_layers, K] over the
        generated sequences' positions (``attention_mask`` [B, S_out]), zero filled at padding, on
        dense layers and at each sequence's last token (which has no route), vLLM's routes at the
        other real tokens. ``Patch.targets_from_verl`` reads it back."""
        m = torch.as_tensor(attention_mask).to("cpu").bool()
        tables, rep = self.tables(m)
        # One implementation of verl's layout: switchyard.routes.to_verl (from_verl's inverse).
        out, _ = syr.to_verl(tables, rep["moe_layers"], self._owner.num_hidden_layers,
                             attention_mask=m, num_experts=self._owner.num_experts)
        return out

    def save_npy(self, directory: str | os.PathLike, attention_mask: torch.Tensor | None = None,
                 prefix: str = "seq") -> list[str]:
        """Writes one .npy per sequence (vLLM's routed_experts, int32), the files the vLLM
        importer and ``switchyard routes import-vllm`` read; returns their paths."""
        import numpy as np
        os.makedirs(directory, exist_ok=True)
        paths = []
        for i, a in enumerate(self.routed_experts(attention_mask)):
            paths.append(os.path.join(str(directory), f"{prefix}{i}.npy"))
            np.save(paths[-1], a.numpy())
        return paths

    def tables(self, attention_mask: torch.Tensor | None = None) -> tuple[list[torch.Tensor], dict]:
        """switchyard route tables ([num_tokens, moe_layers, K], last token -1), through the vLLM
        importer with the model's layer map. Returns (tables, report)."""
        return self._owner._import_vllm(self.routed_experts(attention_mask), zero_rows="keep")

    def write(self, path: str | os.PathLike, attention_mask: torch.Tensor | None = None,
              compression_level: int = 3) -> int:
        """Writes the captured sequences to a route file; returns the bytes written."""
        tables, _ = self.tables(attention_mask)
        return syr.write(path, tables, self._owner.num_experts, moe_layers=self._owner.layers,
                         compression_level=compression_level)


# --------------------------------------------------------------------------------------------------
# The patch
# --------------------------------------------------------------------------------------------------
class Patch:
    """What ``patch()`` did, and the handle to drive replay and capture. ``family`` (the family's
    name), ``layers`` (absolute decoder-layer numbers of the patched MoE layers, ascending),
    ``modules`` (layer -> router module name), ``replays`` (layer -> switchyard.RouterReplay)."""

    def __init__(self, model, router_dtype, gate, invalid_replay_rows):
        self.model = model
        self.router_dtype = router_dtype
        self.gate = gate
        self.invalid_replay_rows = invalid_replay_rows
        self._layers = []
        self._capture = None
        self._stack_hooks = []  # on the modules that run the decoder layers (see _install)
        self._consumed = set()  # layers that took their replay table in the running forward
        cfg = model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.num_hidden_layers = int(cfg.num_hidden_layers)

    # ---- what was patched ----
    @property
    def active(self) -> bool:
        """Whether every patched router still runs this Patch's forward (False once unpatched,
        also when a newer Patch took the routers over)."""
        return bool(self._layers) and all(l.installed for l in self._layers)

    @property
    def family(self) -> str:
        return self._layers[0].family.title

    @property
    def layers(self) -> list[int]:
        return [l.layer for l in self._layers]

    @property
    def modules(self) -> dict[int, str]:
        return {l.layer: l.name for l in self._layers}

    @property
    def replays(self) -> dict[int, sy.RouterReplay]:
        return {l.layer: l.replay for l in self._layers}

    @property
    def num_experts(self) -> int:
        return max(l.num_experts for l in self._layers)

    @property
    def top_k(self) -> int:
        return self._layers[0].top_k

    @property
    def combine_dtype(self) -> str:
        """Dtype of the combine weights the patched routers return (COMBINE_DTYPE)."""
        if self.router_dtype is None:
            return "the family's own (unchanged)"
        return self._layers[0].family.combine_dtype

    def gate_description(self) -> str:
        if self.router_dtype is None:
            return "the family's own (unchanged)"
        if self.gate == "torch":
            return f"torch GEMM in {self.router_dtype}, autocast off"
        return (f"switchyard engine in {self.router_dtype} on CPU tensors (batch invariant); torch "
                f"GEMM in {self.router_dtype} on CUDA tensors (not batch invariant)")

    def __repr__(self):
        return (f"<switchyard.hf.Patch {self.family}: {len(self._layers)} MoE layers "
                f"{self.layers} of {self.num_hidden_layers}, router_dtype={self.router_dtype}, "
                f"gate: {self.gate_description()}, combine weights: {self.combine_dtype}"
                f"{'' if self.active else ' (unpatched)'}>")

    # ---- replay ----
    def set_action(self, action: str | None) -> None:
        """Sets every layer's RouterReplay action: None, "record" or "replay_forward"."""
        for l in self._layers:
            l.replay.action = action

    def set_targets(self, routes: torch.Tensor) -> None:
        """Queues replay targets for the next forward of every MoE layer and sets the action to
        "replay_forward". ``routes``: [T, moe_layers, K] or [B, S, moe_layers, K] ids (-1 = route
        natively), tokens in the order the forward sees them (row-major over [B, S]); moe_layers
        in the order of ``layers``. Every layer's rows are checked by the engine first (its
        ValueError, naming layer and token); nothing is queued unless all pass."""
        if not isinstance(routes, torch.Tensor) or routes.dim() not in (3, 4):
            raise ValueError("[hf.set_targets] routes must be a [T, moe_layers, K] or "
                             "[B, S, moe_layers, K] tensor, got "
                             f"{getattr(routes, 'shape', type(routes).__name__)}")
        t = routes.reshape(-1, routes.shape[-2], routes.shape[-1])
        M, K = len(self._layers), self.top_k
        if t.shape[1] != M or t.shape[2] != K:
            raise ValueError(f"[hf.set_targets] routes must hold {M} MoE layers and K={K}, got "
                             f"shape {list(routes.shape)}")
        tables = [t[:, m, :] for m in range(M)]
        for l, table in zip(self._layers, tables):  # every layer's rows, before any is queued
            l._classify(table.to("cpu").contiguous(), table.shape[0])
        sy.RouterReplay.set_step_targets([l.replay for l in self._layers], tables)
        for l in self._layers:
            l.replay.action = "replay_forward"

    def counts(self) -> dict[int, dict[str, int]]:
        """Per layer: rows replayed / routed natively / invalid (routed natively) in forwards, rows
        recomputed with queued ids inside backward, and forward calls, since reset_counts()."""
        keys = ("num_replayed_rows", "num_native_rows", "num_invalid_replay_rows",
                "num_recomputed_rows", "num_calls")
        return {l.layer: {k: int(l.counts[k]) for k in keys} for l in self._layers}

    def reset_counts(self) -> None:
        for l in self._layers:
            l.counts.clear()

    def clear(self) -> None:
        """Drops every queued table (recorded, targets, pending recompute) and the counts."""
        for l in self._layers:
            l.replay.clear()
            l.counts.clear()

    # ---- route sources (R3) ----
    def _layer_freq(self):
        s = set(self.layers)
        return [1 if i in s else 0 for i in range(self.num_hidden_layers)]

    def _import_vllm(self, arrays, zero_rows):
        return syr.import_vllm_arrays(arrays, self.num_experts, moe_layer_freq=self._layer_freq(),
                                      num_input_layers=self.num_hidden_layers, top_k=self.top_k,
                                      zero_rows=zero_rows)

    def _pad(self, tables, attention_mask):
        if attention_mask is None:
            if len({t.shape[0] for t in tables}) != 1:
                raise ValueError("[hf] sequences of different lengths need an attention_mask "
                                 "[B, S] to place them")
            return torch.stack(tables)
        m = torch.as_tensor(attention_mask).to("cpu").bool()
        if m.dim() != 2 or m.shape[0] != len(tables):
            raise ValueError(f"[hf] attention_mask must be [{len(tables)}, S], got "
                             f"{list(m.shape)}")
        out = torch.full((m.shape[0], m.shape[1], len(self._layers), self.top_k), -1,
                         dtype=torch.int32)
        for b, t in enumerate(tables):
            n = int(m[b].sum())
            if n != t.shape[0]:
                raise ValueError(f"[hf] sequence {b}: the attention mask has {n} real tokens, the "
                                 f"routes {t.shape[0]}")
            out[b][m[b]] = t
        return out

    def targets_from_tables(self, tables, attention_mask: torch.Tensor | None = None
                            ) -> torch.Tensor:
        """switchyard route tables (one [n_b, moe_layers, K] per sequence, e.g. from
        switchyard.routes.read) -> [B, S, moe_layers, K] targets, -1 at padding."""
        return self._pad([syt._idx32(torch.as_tensor(t), "hf.targets_from_tables", f"tables[{i}]",
                                     syt._ID_DTYPES) for i, t in enumerate(tables)],
                         attention_mask)

    def targets_from_vllm(self, arrays, attention_mask: torch.Tensor | None = None,
                          zero_rows: str = "keep") -> tuple[torch.Tensor, dict]:
        """vLLM / SGLang routed_experts arrays (one [n_b - 1, num_hidden_layers, K] per sequence,
        dense layers 0) -> ([B, S, moe_layers, K] targets with -1 at padding and last tokens,
        import report), through switchyard's vLLM importer and this model's layer map."""
        tables, report = self._import_vllm(list(arrays), zero_rows)
        return self._pad(tables, attention_mask), report

    def targets_from_verl(self, routed_experts: torch.Tensor, attention_mask: torch.Tensor,
                          zero_rows: str = "to_none") -> tuple[torch.Tensor, dict]:
        """verl's ``routed_experts`` ([B, S, num_hidden_layers, K], int16, padded, zero filled;
        each row holds vLLM's routes of its real tokens, the last real token having none) and its
        attention mask [B, S] -> ([B, S, moe_layers, K] targets, import report). Padding is dropped
        by the mask (switchyard.routes.drop_padding), the layers mapped by the vLLM importer (all
        zero rows on MoE layers become -1 with zero_rows="to_none": routed natively, counted)."""
        ids = syt._idx32(torch.as_tensor(routed_experts), "hf.targets_from_verl",
                         "routed_experts", syt._ID_DTYPES)
        m = torch.as_tensor(attention_mask).to("cpu")
        seqs = syr.drop_padding(ids, m, self.num_experts)
        tables, report = self._import_vllm([s[:-1] for s in seqs], zero_rows)
        return self._pad(tables, m), report

    # ---- capture ----
    def capture(self) -> "Capture":
        """Starts capturing the ids of every forward (until the returned Capture's context exits
        or stop_capture()); recomputes inside backward are not captured. ``generate()`` with beam
        search (num_beams > 1) is refused while capturing: the beams are reordered at every step,
        so the routes of a step would not follow the returned sequences."""
        if self._capture is not None:
            raise ValueError("[hf.capture] a capture is already running")
        cap = Capture(self)
        m = self.model
        if callable(getattr(m, "generate", None)):
            cap._had_generate = "generate" in m.__dict__
            cap._orig_generate = m.__dict__.get("generate")
            m.generate = cap._generate  # an instance attribute, removed when the capture stops
        self._capture = cap
        cap.active = True
        return cap

    def stop_capture(self) -> None:
        if self._capture is not None:
            self._stop_capture(self._capture)

    def _stop_capture(self, cap):
        cap.active = False
        m = self.model
        if getattr(m.__dict__.get("generate"), "__self__", None) is cap:
            if cap._had_generate:
                m.generate = cap._orig_generate
            else:
                m.__dict__.pop("generate", None)
        if self._capture is cap:
            self._capture = None

    # ---- a failed forward ----
    def _install(self, stacks):
        # On each module that runs the decoder layers (the base model): a forward that fails
        # anywhere (a router's check, attention, an expert) drops the replay table of that step
        # in every layer that has not taken it yet, so no layer keeps a failed batch's ids for the
        # retry (the layers that took theirs dropped them already).
        for l in self._layers:
            l.install()
        for m in stacks:
            self._stack_hooks.append(m.register_forward_pre_hook(self._step_begins))
            self._stack_hooks.append(m.register_forward_hook(self._step_ends, always_call=True))

    def _step_begins(self, module, args):
        self._consumed = set()

    def _step_ends(self, module, args, output):
        if output is not None or sys.exc_info()[1] is None:
            return  # the forward succeeded
        for l in self._layers:
            if l.layer not in self._consumed and l.replay.action == "replay_forward" and \
                    (l.replay.num_targets or l.replay.num_recorded):
                l.replay.pop_next_target()
        self._consumed = set()

    # ---- lifetime ----
    def unpatch(self) -> None:
        """Restores every router's original forward and removes the hooks (idempotent). The
        handle of an earlier Patch whose routers a newer Patch took over changes nothing."""
        for l in self._layers:
            l.uninstall()
        for h in self._stack_hooks:
            h.remove()
        self._stack_hooks = []
        if self._capture is not None:
            self._stop_capture(self._capture)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpatch()


def _transformers_version():
    import transformers
    return transformers.__version__


def _check_version():
    from packaging.version import Version
    found = _transformers_version()
    if Version(found) < Version(MIN_TRANSFORMERS_VERSION):
        raise RuntimeError(f"[hf.patch] needs transformers >= {MIN_TRANSFORMERS_VERSION}, found "
                           f"{found} (the router modules and their routing math were checked "
                           "against that release)")


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def patch(model: torch.nn.Module, router_dtype: torch.dtype | None = torch.float32, *,
          gate: str = "auto", invalid_replay_rows: str = "error") -> Patch:
    """Patches every MoE router of a transformers model in place; returns a Patch.

    router_dtype: torch.float32 (default) or torch.float64: gate GEMM and routing math in that dtype
    (also under autocast); None: the family's own dtypes (bitwise the unpatched outputs).
    gate: "auto" (switchyard's engine on CPU tensors, torch GEMM on CUDA) or "torch".
    invalid_replay_rows: "error" or "native" (see switchyard.RouterReplay).
    Raises ValueError when the model has no supported router, RuntimeError for an old transformers.
    """
    if router_dtype not in (None, torch.float32, torch.float64):
        raise ValueError("[hf.patch] router_dtype must be None (the family's own), torch.float32 "
                         f"or torch.float64, got {router_dtype}")
    if gate not in ("auto", "torch"):
        raise ValueError(f"[hf.patch] gate must be 'auto' or 'torch', got {gate!r}")
    if invalid_replay_rows not in ("error", "native"):
        raise ValueError("[hf.patch] invalid_replay_rows must be 'error' or 'native', got "
                         f"{invalid_replay_rows!r}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"[hf.patch] model must be a torch.nn.Module, got {type(model).__name__}")
    _check_version()
    p = Patch(model, router_dtype, gate, invalid_replay_rows)
    modules = dict(model.named_modules())
    found = []
    stacks = {}
    for name, mod in modules.items():
        fam = _family_of(mod)
        if fam is None:
            continue
        if _owner_of(mod.__dict__.get("forward")) is not None:
            raise ValueError(f"[hf.patch] {name} is already patched by switchyard: unpatch() the "
                             "earlier Patch first")
        mt = list(_LAYER_RE.finditer(name))
        if not mt:
            raise ValueError(f"[hf.patch] cannot tell the decoder layer of router {name} (no "
                             "'layers.<n>' in its name)")
        layer = int(mt[-1].group(1))
        dec_name = name[:mt[-1].end(1)]
        stacks.setdefault(name[:mt[-1].start()], None)  # the module that holds `layers`
        found.append((layer, name, mod, modules.get(dec_name), fam))
    if not found:
        names = ", ".join(f.title for f in FAMILIES.values())
        raise ValueError(f"[hf.patch] no supported MoE router in {type(model).__name__}; "
                         f"supported families: {names}")
    fams = {f[4].title for f in found}
    if len(fams) != 1:
        raise ValueError(f"[hf.patch] routers of several families in one model: {sorted(fams)}")
    layers = [f[0] for f in found]
    if len(set(layers)) != len(layers):
        raise ValueError(f"[hf.patch] several routers claim one decoder layer: {sorted(layers)} "
                         "(a model with several decoder stacks: patch the text model)")
    for layer, name, mod, dec, fam in sorted(found, key=lambda f: f[0]):
        if layer >= p.num_hidden_layers:
            raise ValueError(f"[hf.patch] router {name} is in layer {layer}, beyond "
                             f"num_hidden_layers={p.num_hidden_layers}")
        p._layers.append(_Layer(p, layer, name, mod, dec, fam))
    p._install([modules[s] for s in stacks if s in modules])
    return p


def _owner_of(forward):
    """The _Layer whose patched forward ``forward`` is (None for any other callable)."""
    owner = getattr(forward, "__self__", None)
    return owner if isinstance(owner, _Layer) and \
        getattr(forward, "__func__", None) is _Layer.forward else None


def patch_of(model: torch.nn.Module) -> "Patch | None":
    """The active Patch of ``model`` (the one whose forwards its routers run), or None. After
    ``copy.deepcopy(model)`` (e.g. TRL's reference model) the copy has its own Patch: same
    settings, its own replay queues and counts, forwards bound to its own routers."""
    for mod in model.modules():
        layer = _owner_of(mod.__dict__.get("forward"))
        if layer is not None:
            return layer.owner
    return None
