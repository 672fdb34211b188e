"""switchyard.integrations.trl: TRL's ``GRPOTrainer`` with switchyard's FP32 router and router
replay (R3 / R2) on a transformers MoE model (trl >= 1.16, an optional dependency).

    from switchyard.integrations.trl import GRPOTrainer     # instead of trl's; same arguments
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                          router_dtype=torch.float32,     # FP32 router (None: the family's own)
                          replay="R3")                    # "R3", "R2" or None
    trainer.train()

Constructor arguments (keyword only, after TRL's own, which pass through unchanged):

* ``router_dtype``: torch.float32 (default), torch.float64 or None (the family's own dtypes, e.g.
  a bf16 router in a bf16 model). The policy model and the reference model are patched with
  ``switchyard.integrations.hf.patch`` (a model patched beforehand keeps its Patch; its
  router_dtype must agree).
* ``replay``: ``"R3"`` (default): the rollout's routes are replayed in every log-prob forward
  (old log-probs, reference model, policy/loss). ``"R2"``: the routes of the old-log-prob pass
  (TRL runs it when it takes several updates per generation: ``num_iterations > 1`` or
  ``steps_per_generation > gradient_accumulation_steps``) are replayed in the updates; where TRL
  runs no such pass each batch is trained once and the update's own forward is the first.
  ``None``: no replay (the router mismatch is still measured).
* ``routes_field``: the key of the rollout's routes in ``rollout_func``'s output (default
  ``"routed_experts"``).
* ``gate``: passed to ``hf.patch`` ("auto" or "torch").

Where the rollout's routes come from:

* TRL's own generation (``transformers`` ``generate``: ``_generate_single_turn``, also each turn of
  the tool-call loop): captured with ``Patch.capture()``. With tools, a sequence's routes are those
  of its latest generation call (which re-fed the whole history), cut to its final length.
* ``rollout_func``: its output dict carries ``routes_field`` (default ``"routed_experts"``): one
  array per sequence, in ``completion_ids``' order, in vLLM's per-sequence ``routed_experts``
  layout: integer ``[len(prompt_ids[i]) + len(completion_ids[i]) - 1, num_hidden_layers, K]``
  (dense layers 0; the last token has no route), numpy or torch. The field is removed before TRL
  sees the output. With ``replay="R3"`` it is required.
* TRL's vLLM and continuous-batching paths return no routes: ``replay="R3"`` with them is refused
  (use a ``rollout_func`` that returns the routes).

The routes travel in the batch as int32 tensors ``[B, P + C, moe_layers, K]`` aligned to TRL's
rows ([left-padded prompt | right-padded completion]; -1 at padding and at each sequence's last
token, which are routed natively), under the keys ``ROLLOUT_ROUTES_KEY`` and (R2) ``R2_ROUTES_KEY``,
so TRL's shuffling and splitting move them with their sequences.

Metrics (TRL's ``_metrics``, logged with TRL's own; ``kind`` is ``old``, ``ref`` or ``policy``).
At more than one rank (``accelerator.num_processes > 1``) every metric speaks for all ranks, the
way TRL reduces its own (a masked mean is TRL's ``accelerator.reduce`` of (sum, count)): each
forward's counts are summed over the ranks before the share is taken, so every rank logs the
same values:

* ``switchyard/{kind}/router_mismatch``: share of the (token, MoE layer) rows that have a rollout
  route where the expert set the router chooses itself in this forward (its live top-k, also when
  the row is replayed) differs from the rollout's route at that token: the train / rollout router
  mismatch that R3 removes (the replayed rows use the rollout's ids whatever this says; see
  ``replayed_rows``). Routes placed at the wrong tokens show as a large mismatch, never as 0.
  Summed mismatch rows over summed compared rows of all ranks. Absent when no rank has rollout
  routes.
* ``switchyard/{kind}/router_mismatch/max_rank``: the largest single rank's share (to 1e-9), so
  one misaligned rank cannot hide in the average (equal to the share at one rank).
* ``switchyard/{kind}/replayed_rows`` and ``switchyard/{kind}/native_rows``: rows routed with
  replayed ids / natively in that forward, summed over MoE layers and ranks (padding and last
  tokens are native).
* ``trainer.switchyard_records``: one dict per forward pass (kind, mode, split ("train" or
  "eval"), global_step, mismatch_rows, used_mismatch_rows, compared_rows, replayed_rows,
  native_rows, invalid_rows: this rank's; ``ranks``: the same counts summed over the ranks, each
  with its largest and smallest single rank's value under ``name/max_rank`` and
  ``name/min_rank``, and ``world_size``). ``mismatch_rows`` is the router mismatch above (rows of
  ``compared_rows``); ``used_mismatch_rows`` compares the ids the experts received instead (0
  under R3, the old pass's drift under R2, ``mismatch_rows`` without replay).
  In evaluation TRL prefixes the metrics with ``eval_``.

At more than one rank each log-prob forward first checks that the ranks agree on what is replayed
(global step, forward kind, split, replay mode, MoE layer set, K, E, whether routes are carried
and replayed): a disagreement raises the same ValueError on every rank, naming the field and each
rank's value, instead of a hang or a silent misalignment in a later collective. Both the check
and the counts' reduction are collectives over the default process group (every rank runs the
same log-prob forwards in the same order, as TRL does). Layouts tested (docs/guides/trl.md): DDP
at 2 ranks over gloo on the CPU; accelerate's FSDP does not run on the CPU (it falls back to DDP).

``trainer.switchyard_patch`` is the policy model's ``hf.Patch``; ``trainer.switchyard_unpatch()``
restores the original routers of both models, after which the trainer is trl's own.

Not covered: vision-language models (refused with replay), PEFT reference models (the adapter-off
pass is told from the old pass by order), Liger kernels (their loss runs its own forward: refused).
"""
import hashlib
import inspect
import weakref

import torch

import switchyard.integrations.hf as syhf
from switchyard import _ids
from switchyard import routes as _syroutes
from switchyard.integrations import _ranks
from switchyard.integrations._adapter import TrainerPhase, check_minimum_version, routed_tokens
from switchyard.replay import ReplayCounts

try:
    import trl as _trl
except ImportError as e:  # an optional dependency
    raise ImportError("switchyard.integrations.trl needs the `trl` package (>= 1.16)") from e

__all__ = ["GRPOTrainer", "ROLLOUT_ROUTES_KEY", "R2_ROUTES_KEY",
           "REPLAY_MODES", "METRIC_NAMES", "MIN_TRL_VERSION"]

ROLLOUT_ROUTES_KEY = "switchyard_rollout_routes"
"""Batch key of the rollout's routes carried through TRL's shuffling and splitting: int32
[B, P + C, moe_layers, K] aligned to TRL's rows, -1 at padding and last tokens."""
R2_ROUTES_KEY = "switchyard_r2_routes"
"""Batch key of the old-log-prob pass's routes (replay="R2"), same layout as ROLLOUT_ROUTES_KEY."""
REPLAY_MODES = (None, "R2", "R3")
"""The values of GRPOTrainer's ``replay``."""
MIN_TRL_VERSION = "1.16.0"
"""Oldest trl release whose GRPOTrainer internals (_generate_single_turn, _tool_call_loop,
_generate, _generate_and_score_completions, _get_per_token_logps_and_entropies, _compute_loss)
this subclass was written against."""
METRIC_NAMES = ("switchyard/{kind}/router_mismatch", "switchyard/{kind}/router_mismatch/max_rank",
                "switchyard/{kind}/replayed_rows", "switchyard/{kind}/native_rows")
"""Metric names, per forward kind (old, ref, policy); floats over every rank, logged with TRL's
own."""

_WHO = "[trl.GRPOTrainer]"
_OP = "trl.GRPOTrainer"
# Keys of rollout_func's output that TRL reads itself: routes_field must not take one of them.
_TRL_ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs", "env_mask")
_INT32_MAX = 2**31 - 1  # an id outside [0, E) for every E: a counted invalid row under "native"
_COUNTS = ("mismatch_rows", "used_mismatch_rows", "compared_rows", "replayed_rows",
           "native_rows", "invalid_rows")  # the integer counts of a record, reduced over ranks
_PPB = 10**9  # a rank's mismatch share travels as an integer count of parts per billion
_KIND_CODE = {"old": 0, "ref": 1, "policy": 2}
_MODE_CODE = {None: 0, "R2": 2, "R3": 3}
_MM_ARGS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
            "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids",
            "image_position_ids")


def _check_version():
    check_minimum_version("trl.GRPOTrainer", "trl", _trl.__version__, MIN_TRL_VERSION,
                          "its GRPOTrainer hook points were read from that release")


def _check_args(replay, router_dtype, routes_field, gate, args, rollout_func):
    if replay not in REPLAY_MODES:
        raise ValueError(f"{_WHO} replay must be 'R3', 'R2' or None, got replay={replay!r}")
    if router_dtype not in (None, torch.float32, torch.float64):
        raise ValueError(f"{_WHO} router_dtype must be torch.float32, torch.float64 or None, got "
                         f"router_dtype={router_dtype}")
    if not isinstance(routes_field, str) or not routes_field:
        raise ValueError(f"{_WHO} routes_field must be a non-empty str, got "
                         f"routes_field={routes_field!r}")
    if routes_field in _TRL_ROLLOUT_KEYS:
        raise ValueError(f"{_WHO} routes_field={routes_field!r} is a key TRL reads from "
                         f"rollout_func's output ({', '.join(_TRL_ROLLOUT_KEYS)}): name the routes "
                         "field something else (default 'routed_experts')")
    if gate not in ("auto", "torch"):
        raise ValueError(f"{_WHO} gate must be 'auto' or 'torch', got gate={gate!r}")
    if args is None:
        return
    if replay == "R3" and rollout_func is None:
        if getattr(args, "use_vllm", False):
            raise ValueError(f"{_WHO} replay='R3' with use_vllm=True and no rollout_func: TRL's "
                             "vLLM path returns no routes; pass a rollout_func whose output "
                             f"carries {routes_field!r}, or replay='R2' / None")
        if getattr(args, "use_transformers_continuous_batching", False):
            raise ValueError(f"{_WHO} replay='R3' with use_transformers_continuous_batching=True: "
                             "that path returns no routes; use generate() or a rollout_func")
    if replay is not None and getattr(args, "use_liger_kernel", False):
        raise ValueError(f"{_WHO} replay={replay!r} with use_liger_kernel=True: the Liger loss "
                         "runs its own forward, which switchyard cannot replay")


def _patch_model(model, router_dtype, gate, what):
    """The model's Patch: the existing one (settings must agree) or a new one. ValueError (the
    model is untouched) when the model has no MoE router switchyard supports."""
    p = syhf.patch_of(model)
    if p is not None:
        if p.router_dtype != router_dtype:
            raise ValueError(f"{_WHO} {what} is already patched with router_dtype="
                             f"{p.router_dtype}, but router_dtype={router_dtype} was asked for")
        return p
    try:
        return syhf.patch(model, router_dtype=router_dtype, gate=gate)
    except ValueError as e:
        raise ValueError(f"{_WHO} {what}: switchyard needs a transformers MoE model ({e})") from e


class _GenState:
    """The routes of one _generate() call: per sequence (tokens, routes [n - 1, L, K]) in
    ``seqs``; or, after a single in-process turn, that turn as captured (``turn``: the capture's
    ids [B, S_fed, L, K], its prompt mask, the prompts and completions), turned into ``seqs`` only
    where a tool-call turn follows or TRL's batch is not that turn's (_sy_batch_routes reads the
    captured turn directly in TRL's rows)."""

    def __init__(self):
        self._seqs = None
        self.turn = None

    @property
    def seqs(self):
        if self._seqs is None and self.turn is not None:
            self._seqs, self.turn = _turn_seqs(*self.turn), None
        return self._seqs

    @seqs.setter
    def seqs(self, value):
        self._seqs, self.turn = value, None


def _pad_mask(seqs, side, multiple):
    """The mask TRL's ``pad()`` gives sequences of ones (TRL pads its prompts left, its
    completions right): long [B, W], 1 at each sequence's tokens, W the longest length rounded up
    to ``multiple`` (pad_to_multiple_of, or None), as pad() sizes it; without a tensor per
    sequence (a test compares it with pad())."""
    lens = torch.tensor([len(x) for x in seqs], dtype=torch.long)
    W = int(lens.max()) if len(seqs) else 0
    if multiple and W % multiple:
        W += multiple - W % multiple
    pos = torch.arange(W)
    return (pos >= (W - lens)[:, None] if side == "left" else pos < lens[:, None]).long()


def _invalid_rows(routes, num_experts):
    """[...] bool of routes [..., K]: the rows holding an id outside [0, E) and not -1 (replayed
    as invalid rows under invalid_replay_rows="native": marked _INT32_MAX)."""
    return ((routes < -1) | (routes >= num_experts)).any(-1)


def _turn_seqs(ids, pm, prompt_ids, completion_ids):
    """One captured generate() turn -> [(tokens, routes int32 [n - 1, L, K])] per sequence (the
    capture's ids [B, S_fed, L, K] over the fed tokens; pm: the prompts' left-padded mask)."""
    G = ids.shape[1] - pm.shape[1] + 1  # generated steps (the last token is never fed)
    cm = torch.zeros(len(completion_ids), G, dtype=torch.long)
    for b, c in enumerate(completion_ids):
        cm[b, :len(c)] = 1
    routes = _syroutes.routed_experts(ids, torch.cat([pm, cm], dim=1))
    return [(list(p) + list(c), r) for p, c, r in zip(prompt_ids, completion_ids, routes)]


class GRPOTrainer(_trl.GRPOTrainer):
    """TRL's GRPOTrainer with switchyard's FP32 router and R3/R2 (see the module docstring).

    Errors while training: ValueError when a ``rollout_func``'s routes are not one integer array
    [len(prompt_ids[i]) + len(completion_ids[i]) - 1, num_hidden_layers, K] per sequence (or
    missing under R3), hold an id outside [0, E) or an invalid row (the vLLM importer's message),
    or multimodal inputs reach a replayed forward; RuntimeError when the routes cannot be aligned
    with TRL's rows (routes taken for other tokens, a tool-call turn that extends no sequence) or
    the policy model's routers were unpatched behind the trainer's back."""

    def __init__(self, *args, router_dtype: torch.dtype | None = torch.float32,
                 replay: str | None = "R3", routes_field: str = "routed_experts",
                 gate: str = "auto", **kwargs):
        """TRL's arguments (positional or keyword) plus switchyard's, keyword only (see the
        module docstring). ValueError for a bad switchyard argument or a model without a
        supported MoE router (replay / router_dtype / routes_field / gate out of range; R3 with
        use_vllm or continuous batching and no rollout_func; replay with Liger kernels or a
        vision-language model; a model patched beforehand with another router_dtype), raised
        before the model is patched (a model this call patched is unpatched again if TRL's own
        constructor fails); RuntimeError for trl < MIN_TRL_VERSION."""
        _check_version()
        given = inspect.signature(_trl.GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        model = given.get("model")
        _check_args(replay, router_dtype, routes_field, gate, given.get("args"),
                    given.get("rollout_func"))
        new_patch = None
        if isinstance(model, torch.nn.Module):  # refuse a non-MoE model before TRL builds anything
            had = syhf.patch_of(model)
            p = _patch_model(model, router_dtype, gate, "model")
            new_patch = p if had is None else None
        self.switchyard_replay = replay
        """"R3", "R2" or None, as given."""
        self.switchyard_router_dtype = router_dtype
        """torch.float32, torch.float64 or None, as given."""
        self.switchyard_routes_field = routes_field
        """The key of the routes in rollout_func's output, as given."""
        self.switchyard_gate = gate
        """"auto" or "torch", as given (hf.patch's gate)."""
        self.switchyard_records = []
        """One dict per log-prob forward: kind, mode, split, global_step, mismatch_rows,
        used_mismatch_rows, compared_rows, replayed_rows, native_rows, invalid_rows (kind, mode,
        split: str or None;
        the others ints)."""
        self._sy_phase = TrainerPhase.IDLE  # where the step is: the one state of the trainer
        self._sy_gen = None         # _GenState of the running _generate()
        self._sy_rollout = None     # [B, P+C, M, K] rollout routes of the batch being scored
        self._sy_r2 = None          # routes of the old-log-prob pass of that batch (R2)
        self._sy_inputs = None      # the batch _compute_loss runs on
        self._sy_patches = {}       # id(model) -> weakrefs (model, its Patch), _sy_patch_for
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            if new_patch is not None:  # TRL refused: leave the model as it was given
                new_patch.unpatch()
            raise
        if self._is_vlm and replay is not None:
            raise ValueError(f"{_WHO} replay={replay!r} with a vision-language model: not "
                             "supported (text-only MoE models)")
        self.switchyard_patch = _patch_model(self.accelerator.unwrap_model(self.model),
                                             router_dtype, gate, "model")
        """The policy model's switchyard.integrations.hf.Patch."""
        if self.ref_model is not None:
            _patch_model(self.accelerator.unwrap_model(self.ref_model), router_dtype, gate,
                         "ref_model")
        if self.rollout_func is not None:
            self.rollout_func = self._sy_wrap_rollout(self.rollout_func)
            """TRL's rollout_func, wrapped: the routes field is taken out (and checked) before TRL
            sees the output; the given function is its ``__wrapped__``."""

    def switchyard_unpatch(self) -> None:
        """Restores the original routers of the policy and reference models (idempotent); the
        trainer then trains exactly like trl's own (no capture, replay or metrics)."""
        self._sy_phase = TrainerPhase.OFF
        for m in (self.model, self.ref_model):
            p = syhf.patch_of(self.accelerator.unwrap_model(m)) if m is not None else None
            if p is not None:
                p.unpatch()

    @property
    def _sy_active(self):
        """False once switchyard_unpatch() ran (TrainerPhase.OFF)."""
        return self._sy_phase is not TrainerPhase.OFF

    def _sy_enter(self, phase):
        """Moves to ``phase`` (a TrainerPhase) unless the trainer was unpatched (OFF stays)."""
        if self._sy_phase is not TrainerPhase.OFF:
            self._sy_phase = phase

    # ---- where the rollout's routes come from ------------------------------------------------
    def _sy_wrap_rollout(self, fn):
        def rollout_func(prompts, trainer):
            out = fn(prompts, trainer)
            if not isinstance(out, dict) or self._sy_gen is None:
                return out  # not a dict: TRL's own error; outside _generate: not a rollout
            routes = out.pop(self.switchyard_routes_field, None)
            if not self._sy_active:
                return out
            if routes is None:
                if self.switchyard_replay == "R3":
                    raise ValueError(f"{_WHO} replay='R3' needs the rollout's routes: rollout_func "
                                     f"returned no {self.switchyard_routes_field!r} field (keys "
                                     f"{sorted(out)})")
                return out
            self._sy_gen.seqs = self._sy_check_rollout_routes(out, routes)
            return out
        rollout_func.__wrapped__ = fn
        return rollout_func

    def _sy_check_rollout_routes(self, out, routes):
        """rollout_func's routes -> [(tokens, int32 [n - 1, H, K] on the CPU)] per sequence, every
        one checked against its sequence (shape, dtype, ids) before anything is used."""
        p, f = self.switchyard_patch, self.switchyard_routes_field
        prompt_ids, completion_ids = out.get("prompt_ids"), out.get("completion_ids")
        if prompt_ids is None or completion_ids is None:
            return None  # TRL raises for the missing keys
        if not isinstance(routes, (list, tuple)) or len(routes) != len(completion_ids):
            n = (f"{len(routes)} entries" if isinstance(routes, (list, tuple)) else
                 f"a {type(routes).__name__}" + (f" of shape {list(routes.shape)}"
                                                 if hasattr(routes, "shape") else ""))
            raise ValueError(f"{_WHO} rollout_func's {f!r} must be a list with one array per "
                             f"sequence ({len(completion_ids)}, in completion_ids' order), got "
                             f"{n}")
        seqs = []
        for i, (pi, ci, r) in enumerate(zip(prompt_ids, completion_ids, routes)):
            name = f"rollout_func's {f!r}[{i}]"
            if len(ci) == 0:  # TRL reads each completion's last token (an IndexError there)
                raise ValueError(f"{_WHO} rollout_func's completion_ids[{i}] is empty: TRL's "
                                 "GRPOTrainer needs at least one completion token per sequence "
                                 "(end an empty completion with the EOS token)")
            n = len(pi) + len(ci)
            if n < 2:
                if r is None or (hasattr(r, "__len__") and len(r) == 0):
                    seqs.append((list(pi) + list(ci), None))  # nothing to route: no row
                    continue
            t = _ids.as_tensor(r, _OP, name)
            want = [max(n - 1, 0), p.num_route_layers, p.top_k]
            if list(t.shape) != want:
                raise ValueError(f"{_WHO} {name} must be an integer array "
                                 f"[len(prompt_ids[{i}]) + len(completion_ids[{i}]) - 1, "
                                 f"num_hidden_layers, K] = {want}, got {list(t.shape)} "
                                 f"{t.dtype}")
            t = t.detach().to("cpu")
            if p.invalid_replay_rows != "native":
                # The id-range rule before any narrowing: int64 2**32 + 5 is not expert 5.
                _ids.check_range(t, p.num_experts, _OP, f"{name} (sequence {i})",
                                 axes=("token", "layer", "slot"))
            seqs.append((list(pi) + list(ci), _ids.to_int32(t, _OP, name, saturate=True)))
        return seqs

    def _generate(self, prompts):
        self._sy_gen = _GenState()
        try:
            res = super()._generate(prompts)
            prompt_ids, completion_ids = res[0], res[1]
            self._sy_rollout = self._sy_batch_routes(prompt_ids, completion_ids)
        finally:
            self._sy_gen = None
        return res

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        if self.use_vllm or self.use_transformers_continuous_batching or self._sy_gen is None \
                or not self._sy_active:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                 num_generations, has_tool_images)
        with self.switchyard_patch.capture(experts=False) as cap:
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        self._sy_record_generation(cap, prompt_ids, completion_ids)
        return completion_ids, logprobs

    def _sy_record_generation(self, cap, prompt_ids, completion_ids):
        pm = _pad_mask(prompt_ids, "left", self.pad_to_multiple_of)
        ids = cap.ids()
        S_fed = ids.shape[1]
        G = S_fed - pm.shape[1] + 1  # generated steps (the last token is never fed)
        if G < max((len(c) for c in completion_ids), default=0):
            raise RuntimeError(f"{_WHO} captured {S_fed} fed tokens, fewer than the prompts "
                               f"({pm.shape[1]}) and completions need")
        st = self._sy_gen
        if st.seqs is None:  # the first turn: kept as captured (see _GenState)
            st.turn = (ids, pm, [list(p) for p in prompt_ids], [list(c) for c in completion_ids])
            return
        new = _turn_seqs(ids, pm, prompt_ids, completion_ids)
        # A tool-call turn: each new prompt extends one sequence's history (in batch order).
        j = 0
        for i, (tokens, _) in enumerate(st.seqs):
            if j < len(new) and new[j][0][:len(tokens)] == tokens:
                st.seqs[i] = new[j]
                j += 1
        if j != len(new):
            raise RuntimeError(f"{_WHO} a tool-call turn's prompt {j} extends no sequence of the "
                               "batch: its routes cannot be placed")

    def _sy_batch_routes(self, prompt_ids, completion_ids):
        """[B, P+C, M, K] int32 rollout routes in TRL's rows, or None (no routes)."""
        st = self._sy_gen
        if not self._sy_active:
            return None
        if st is None or (st.turn is None and st.seqs is None):
            if self.switchyard_replay == "R3":
                raise RuntimeError(f"{_WHO} replay='R3': this generation gave no routes")
            return None
        pm = _pad_mask(prompt_ids, "left", self.pad_to_multiple_of)
        cm = _pad_mask(completion_ids, "right", self.pad_to_multiple_of)
        mask = torch.cat([pm, cm], dim=1)
        if st.turn is not None:
            t = self._sy_turn_routes(st.turn, prompt_ids, completion_ids, pm, mask)
            if t is not None:
                return t.to(self.accelerator.device)
        arrays, invalid = [], []
        E = self.switchyard_patch.num_experts
        for i, (pi, ci) in enumerate(zip(prompt_ids, completion_ids)):
            tokens, r = st.seqs[i]
            full = list(pi) + list(ci)
            if r is None:  # a sequence of fewer than 2 tokens: no routed token
                r = torch.zeros(0, self.switchyard_patch.num_route_layers,
                                self.switchyard_patch.top_k, dtype=torch.int32)
            if tokens[:len(full)] != full or r.shape[0] < len(full) - 1:
                raise RuntimeError(f"{_WHO} sequence {i}: the routes were taken for other tokens "
                                   "than TRL trains on")
            r = r[:max(len(full) - 1, 0)]
            # Under invalid_replay_rows="native" a row holding an id outside [0, E) is replayed
            # as an invalid row (routed natively, counted): kept out of the importer, put back
            # below as an id outside every range.
            bad = _invalid_rows(r, E)  # [n - 1, H]
            if bool(bad.any()):
                r = r.masked_fill(bad[..., None], -1)
            invalid.append(bad)
            arrays.append(r)
        try:
            t, _ = self.switchyard_patch.targets_from_vllm(arrays, mask)
        except ValueError as e:
            raise ValueError(f"{_WHO} the rollout's routes ({self.switchyard_routes_field!r}): "
                             f"{e}") from e
        cols = self.switchyard_patch.layers  # hidden layer of each MoE column
        for b, bad in enumerate(invalid):
            if bad.numel() and bool(bad[:, cols].any()):
                pos = mask[b].bool().nonzero().flatten()[:bad.shape[0]]
                sub = t[b, pos]
                sub[bad[:, cols]] = _INT32_MAX
                t[b, pos] = sub
        return t.to(self.accelerator.device)

    def _sy_turn_routes(self, turn, prompt_ids, completion_ids, pm, mask):
        """[B, P+C, M, K] int32 rollout routes of TRL's batch read straight from one captured
        turn, or None where the batch is not that turn's sequences in its layout (then the
        per-sequence path reads it). The same tensor as that path gives (a test compares them):
        the fed tokens' routes at their own positions (the prompts are left-padded the same way),
        -1 at padding and at each sequence's last token (never routed), and a row holding an id
        outside [0, E) as _INT32_MAX (replayed as an invalid row)."""
        ids, tpm, tp, tc = turn
        p = self.switchyard_patch
        if len(set(p.top_ks.values())) != 1 or tuple(tpm.shape) != tuple(pm.shape) or \
                len(tp) != len(prompt_ids) or len(tc) != len(completion_ids) or \
                any(list(a) != b for a, b in zip(prompt_ids, tp)) or \
                any(list(a) != b for a, b in zip(completion_ids, tc)):
            return None
        B, W = mask.shape
        t = ids[:, :W, p.layers, :]
        if t.shape[1] < W:  # the last column's token was never fed
            t = torch.cat([t, t.new_full((B, W - t.shape[1]) + tuple(t.shape[2:]), -1)], dim=1)
        t = t.masked_fill(_invalid_rows(t, p.num_experts)[..., None], _INT32_MAX)
        return t.masked_fill(~routed_tokens(mask)[:, :, None, None], -1)

    # ---- carried through TRL's batch ---------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        self._sy_enter(TrainerPhase.SCORING)
        self._sy_rollout, self._sy_r2 = None, None
        try:
            out = super()._generate_and_score_completions(inputs)
            if self._sy_rollout is not None:
                out[ROLLOUT_ROUTES_KEY] = self._sy_rollout
            if self._sy_r2 is not None:
                out[R2_ROUTES_KEY] = self._sy_r2
        finally:
            self._sy_enter(TrainerPhase.IDLE)
            self._sy_rollout, self._sy_r2 = None, None
        return out

    def _compute_loss(self, model, inputs):
        self._sy_enter(TrainerPhase.POLICY)
        self._sy_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._sy_enter(TrainerPhase.IDLE)
            self._sy_inputs = None

    # ---- replayed in the log-prob forwards ---------------------------------------------------
    def _sy_old_expected(self):
        every = self.args.steps_per_generation * self.num_iterations
        return bool(self.args.gradient_accumulation_steps % every != 0 or
                    (self.use_vllm and self.vllm_importance_sampling_correction))

    def _sy_kind(self, model):
        """The log-prob forward running now: "policy", "old", "ref", or None (not replayed)."""
        phase = self._sy_phase
        if phase is TrainerPhase.POLICY:
            return "policy"
        if phase not in (TrainerPhase.SCORING, TrainerPhase.SCORED_OLD):
            return None  # OFF, IDLE
        if self.ref_model is not None and model is self.ref_model:
            return "ref"
        if phase is TrainerPhase.SCORING and self._sy_old_expected():
            return "old"
        return "ref"  # PEFT: the adapter-off pass on the policy model

    def _sy_patch_for(self, model, kind):
        # The Patch found for this model object last time, while it is still active: finding it
        # again (accelerate's unwrap, a walk of every module) was ~0.3 ms per log-prob forward.
        # Weak references: a reference model replaced later is not kept alive by this cache.
        hit = self._sy_patches.get(id(model))
        p = hit[1]() if hit is not None and hit[0]() is model else None
        if p is not None and p.active:
            return p
        p = self._sy_find_patch(model, kind)
        self._sy_patches[id(model)] = (weakref.ref(model), weakref.ref(p))
        return p

    def _sy_find_patch(self, model, kind):
        m = self.accelerator.unwrap_model(model)
        p = syhf.patch_of(m)
        if p is None:
            if kind != "ref":
                raise RuntimeError(f"{_WHO} the policy model's routers are not patched (was the "
                                   "Patch undone?)")
            # a reference model set after construction (e.g. a deep copy of an unpatched model)
            p = _patch_model(m, self.switchyard_router_dtype, self.switchyard_gate, "ref_model")
        return p

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False,
                                           compute_aux_loss=False, **mm):
        kind = self._sy_kind(model)
        if kind is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **mm)
        given = sorted(k for k in _MM_ARGS if mm.get(k) is not None)
        if kind == "policy":
            rollout = self._sy_inputs.get(ROLLOUT_ROUTES_KEY)
            r2 = self._sy_inputs.get(R2_ROUTES_KEY)
        else:
            rollout, r2 = self._sy_rollout, None
        mode = self.switchyard_replay
        target = rollout if mode == "R3" else r2 if mode == "R2" and kind == "policy" else None
        # R2: None when TRL ran no old-log-prob pass (the first forward routes)
        multi = self.accelerator.num_processes > 1
        if multi:
            # before anything this rank alone could refuse: every rank raises, none waits
            self._sy_check_ranks(model, kind, mode, rollout, target, given)
        if given:
            raise ValueError(f"{_WHO} multimodal inputs ({given}) are not supported with "
                             "switchyard")
        if mode == "R3" and rollout is None:
            raise RuntimeError(f"{_WHO} replay='R3': the {kind} forward's batch carries no "
                               f"rollout routes ({ROLLOUT_ROUTES_KEY!r} missing)")
        for name, t in (("rollout routes", rollout), ("R2 routes", target)):
            if t is not None and tuple(t.shape[:2]) != tuple(input_ids.shape):
                raise RuntimeError(f"{_WHO} the {kind} forward's {name} are "
                                   f"{list(t.shape[:2])}, its input_ids {list(input_ids.shape)}: "
                                   "routes and rows are not aligned")
        p = self._sy_patch_for(model, kind)
        B = input_ids.size(0)
        bs = batch_size or B
        logps, ents, auxs = [], [], []
        rec = dict(kind=kind, mode=mode, split="train" if self.model.training else "eval",
                   global_step=int(self.state.global_step), mismatch_rows=0,
                   used_mismatch_rows=0, compared_rows=0,
                   replayed_rows=0, native_rows=0, invalid_rows=0)
        ids_all = []
        for s in range(0, B, bs):
            e = min(s + bs, B)
            p.reset_counts()
            try:
                if target is not None:
                    p.set_targets(target[s:e])
                with p.capture(experts=False) as cap:
                    lp, en, ax = super()._get_per_token_logps_and_entropies(
                        model, input_ids[s:e], attention_mask[s:e], logits_to_keep, e - s,
                        compute_entropy, compute_aux_loss)
            except BaseException:
                p.clear()  # no queued target may outlive its forward
                raise
            finally:
                p.set_action(None)
            counts = p.replay_counts()
            if not counts or min(c.calls for c in counts.values()) < 1:
                p.clear()
                raise RuntimeError(f"{_WHO} the {kind} forward did not run the patched routers")
            total = ReplayCounts.summed(counts.values())
            rec["replayed_rows"] += total.replayed
            rec["native_rows"] += total.native
            rec["invalid_rows"] += total.invalid
            ids = cap.moe_ids()  # [b, S, M, K]: what the experts received
            ids_all.append(ids)
            if rollout is not None:
                # The mismatch is the routers' own choice (live top-k) against the rollout's route
                # at each token position, never the replayed ids against themselves: routes
                # placed at the wrong tokens show up here even when they are replayed. Rows
                # compare as sets where the rollout routes the row and the token is attended; the
                # live and the used ids in one engine pass.
                compared, (mismatch, used) = _syroutes.row_mismatch(
                    rollout[s:e], [cap.moe_ids(native=True), ids], attention_mask[s:e])
                rec["mismatch_rows"] += mismatch
                rec["used_mismatch_rows"] += used
                rec["compared_rows"] += compared
            logps.append(lp)
            if compute_entropy:
                ents.append(en)
            if compute_aux_loss:
                auxs.append(ax)
        if kind == "old":
            self._sy_enter(TrainerPhase.SCORED_OLD)
            if mode == "R2":
                r2 = torch.cat(ids_all).to(torch.int32)
                r2[~attention_mask.to("cpu").bool()] = -1
                self._sy_r2 = r2.to(input_ids.device)
        local = {n: rec[n] for n in _COUNTS}
        local["mismatch_share_ppb"] = (rec["mismatch_rows"] * _PPB + rec["compared_rows"] // 2) \
            // rec["compared_rows"] if rec["compared_rows"] else 0
        rec["world_size"] = self.accelerator.num_processes
        rec["ranks"] = _ranks.reduce_counts(local) if multi else {
            n + sfx: v for n, v in local.items()
            for sfx in ("", _ranks.MAX_RANK_SUFFIX, _ranks.MIN_RANK_SUFFIX)}
        self._sy_log(rec)
        return (torch.cat(logps), torch.cat(ents) if compute_entropy else None,
                torch.stack(auxs).mean() if compute_aux_loss else None)

    def _sy_check_ranks(self, model, kind, mode, rollout, target, multimodal):
        """Raises the same ValueError on every rank when the ranks disagree on this log-prob
        forward (a collective: every rank calls it for each forward, in the same order)."""
        p = syhf.patch_of(self.accelerator.unwrap_model(model))
        layers = p.layers if p is not None else []
        _ranks.check_ranks_agree(f"the routes of the {kind} log-prob forward {_WHO}", dict(
            global_step=int(self.state.global_step), kind=_KIND_CODE[kind],
            eval=int(not self.model.training), replay=_MODE_CODE[mode],
            patched=int(p is not None), moe_layers=len(layers),
            moe_layer_set=_layer_set_hash(layers), top_k=p.top_k if p is not None else -1,
            num_experts=p.num_experts if p is not None else -1,
            rollout_routes=int(rollout is not None), replayed=int(target is not None),
            multimodal=int(bool(multimodal))))

    def _sy_log(self, rec):
        """Appends one forward's metrics (the counts summed over the ranks in rec["ranks"])."""
        self.switchyard_records.append(rec)
        m = self._metrics[rec["split"]]
        k, tot = rec["kind"], rec["ranks"]
        if tot["compared_rows"]:
            m[f"switchyard/{k}/router_mismatch"].append(tot["mismatch_rows"] /
                                                        tot["compared_rows"])
            m[f"switchyard/{k}/router_mismatch/max_rank"].append(
                tot["mismatch_share_ppb" + _ranks.MAX_RANK_SUFFIX] / _PPB)
        m[f"switchyard/{k}/replayed_rows"].append(float(tot["replayed_rows"]))
        m[f"switchyard/{k}/native_rows"].append(float(tot["native_rows"]))


def _layer_set_hash(layers):
    """A 62-bit integer that differs between (almost all) different MoE layer sets."""
    digest = hashlib.blake2b(",".join(map(str, layers)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2
