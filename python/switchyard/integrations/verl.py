"""switchyard.integrations.verl: router replay (R3 and R2) on verl's FSDP engine for Hugging Face
MoE models, as a verl plugin (verl >= 0.9.1; no change to verl's source).

Turn it on with one environment variable on every verl process (Ray workers included):

    VERL_ENGINE_VENDOR=switchyard        # R3: the rollout's routes replayed in log-prob + update

verl imports this module through the ``verl.plugins`` entry point switchyard declares (or
``VERL_USE_EXTERNAL_MODULES=switchyard.integrations.verl`` when switchyard is not pip-installed),
which registers :class:`SwitchyardFSDPEngine` in verl's ``EngineRegistry`` for the
``language_model`` model type, the ``fsdp`` and ``fsdp2`` backends, vendor ``switchyard``;
``VERL_ENGINE_VENDOR`` makes verl pick it instead of ``FSDPEngineWithLMHead``, which it subclasses.

Modes (the engine config's ``router_replay.mode`` when not "disabled", else
``SWITCHYARD_VERL_ROUTER_REPLAY``, default "R3"):

* ``R3``: every log-prob and update forward of the actor replays the micro-batch's
  ``routed_experts`` (verl's layout, set by the rollout: int16 [B, tokens, num_hidden_layers, K],
  jagged after verl's ``left_right_2_no_padding``; a sequence's last token and all-zero rows have no
  route and are routed natively, counted). A micro-batch without ``routed_experts`` is an error:
  replay never silently does nothing.
* ``R2``: the actor's log-prob pass records its own routes and returns them as
  ``model_output["routed_experts"]`` (verl's ``_compute_old_log_prob`` merges them into the batch);
  the update forwards replay them.
* ``disabled``: the plain FSDP engine.

The reference model's engine (``forward_only``) and calls whose batch says
``enable_routing_replay=False`` route natively. Both packing modes are served: packed
(``use_remove_padding=True``, the (1, total_tokens) forward, with verl's static pad routed natively)
and padded (right-padded [B, max_len]). ``SWITCHYARD_VERL_ROUTER_DTYPE=float32`` also runs the
routers in fp32 (switchyard.integrations.hf's FP32 router); the default keeps the model's own.

Ulysses sequence parallelism (``ulysses_sequence_parallel_size`` > 1, packed layout): each SP
rank's targets are the rows of the packed micro-batch (verl's static pad included) that verl's own
``ulysses_pad_and_slice_inputs`` gives that rank, SP padding -1 (routed natively, not counted);
R2's records are gathered over the SP group back into the whole micro-batch. Vision-language
models under SP (verl slices them after the embedding) are refused with replay on.

More than one rank: every micro-batch, the ranks check they agree (``_ranks.check_ranks_agree``:
the call's kind and number, the micro-batch's index, the routes' layer count and K and whether
each rank's routes were valid; over the SP group also the micro-batch's sequences, tokens, the
rows each rank feeds and a checksum of the routes) and a disagreement, or bad routes on one rank,
raises a ValueError on every rank before any forward instead of a hang in the next collective.
Per micro-batch, the metrics get verl ``Metric``s: ``router_replay/replayed_rows``,
``router_replay/native_rows`` (real tokens routed natively: each sequence's last token, all-zero
rows; padding not counted) and ``router_replay/recorded_rows`` (R2's log-prob pass), summed over
MoE layers and over every rank of the engine (``_ranks.reduce_counts``; aggregation "sum", so
verl's DP aggregation logs the step's total over all ranks), each with ``/max_rank`` and
``/min_rank`` (aggregation "max" / "min": the largest and smallest single rank's count of a
micro-batch, so one misaligned rank does not hide in a sum).

With megatron-core installed the same vendor also gives :class:`SwitchyardMegatronEngine` for
verl's ``megatron`` backend: verl's own router_replay_patch stays off, Megatron-Core is patched by
``switchyard.integrations.megatron.apply()`` (the dropless dispatcher sized without ``.item()``)
and each micro-batch's ``routed_experts`` become keyed, validated targets
(:func:`megatron_replay_targets`: THD packing, CP zigzag, SP split, this pipeline chunk's layers).
R3 only; see docs/guides/verl.md for what is tested.
"""
import os

import torch

import switchyard.integrations.hf as syhf
from switchyard.integrations import _ranks
from switchyard.integrations._adapter import check_minimum_version
from switchyard.replay import ReplayCounts

from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.utils.ulysses import ulysses_pad_and_slice_inputs
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

__all__ = ["VENDOR", "MODES", "ENV_MODE", "ENV_ROUTER_DTYPE", "MIN_VERL_VERSION",
           "SwitchyardFSDPEngine"]

MIN_VERL_VERSION = "0.9.1"
"""Oldest verl release this plugin was checked against (its FSDP engine's prepare_model_inputs /
prepare_model_outputs / forward_step contract and the jagged routed_experts layout)."""

VENDOR = "switchyard"
"""The vendor name the engines are registered under (``VERL_ENGINE_VENDOR=switchyard``)."""
MODES = ("R3", "R2", "disabled")
"""Replay modes, as verl's ``router_replay.mode`` spells them."""
ENV_MODE = "SWITCHYARD_VERL_ROUTER_REPLAY"
"""Environment variable choosing the mode when the engine config leaves it "disabled" (default
"R3"; another value than MODES: ValueError when the engine is built)."""
ENV_ROUTER_DTYPE = "SWITCHYARD_VERL_ROUTER_DTYPE"
"""Environment variable choosing the routers' dtype: "native" (default) or "float32" ("fp32");
another value: ValueError when the engine is built."""

_ROUTER_DTYPES = {"native": None, "float32": torch.float32, "fp32": torch.float32}
_CALLS = {None: 0, "replay": 1, "record": 2}  # a call's kind, as the ranks compare it


def _jagged_values(nt: torch.Tensor) -> torch.Tensor:
    """A jagged nested tensor's values [total, ...] as ``values()`` gives them (its buffer,
    detached). values() dispatches through the nested tensor's handlers, ~50 us per call on a
    micro-batch's routes; the buffer itself is read where the tensor has it."""
    buf = getattr(nt, "_values", None)
    if type(buf) is torch.Tensor:
        return buf.detach()
    return nt.values()


def replay_metrics(counts, group=None) -> dict:
    """``counts`` (name -> this rank's int count of a micro-batch) summed over the ranks of
    ``group`` (``_ranks.reduce_counts``; a collective), as verl Metrics: the sum with aggregation
    "sum" (verl averages a "sum" metric over DP ranks, which all hold the same total, then sums
    the micro-batches: the step's total over every rank) and the per-rank extremes
    ``name/max_rank`` / ``name/min_rank`` with aggregation "max" / "min"."""
    reduced = _ranks.reduce_counts(counts, group)
    out = {}
    for name, value in reduced.items():
        if name.endswith(_ranks.MAX_RANK_SUFFIX):
            agg = AggregationType.MAX
        elif name.endswith(_ranks.MIN_RANK_SUFFIX):
            agg = AggregationType.MIN
        else:
            agg = AggregationType.SUM
        out[name] = Metric(aggregation=agg, value=value)
    return out


def _check_version():
    import verl
    check_minimum_version("verl", "verl", verl.__version__, MIN_VERL_VERSION,
                          "switchyard's verl engine plugins were written against it")


def _mode_of(engine_config) -> str:
    rr = getattr(engine_config, "router_replay", None)
    mode = getattr(rr, "mode", "disabled") if rr is not None else "disabled"
    source = "router_replay.mode"
    if mode == "disabled":
        mode, source = os.environ.get(ENV_MODE, "R3"), ENV_MODE
    if mode not in MODES:
        raise ValueError(f"[verl] {source} must be one of {list(MODES)}, got {mode!r}")
    return mode


def _router_dtype() -> "torch.dtype | None":
    name = os.environ.get(ENV_ROUTER_DTYPE, "native")
    if name not in _ROUTER_DTYPES:
        raise ValueError(f"[verl] {ENV_ROUTER_DTYPE} must be one of {sorted(_ROUTER_DTYPES)}, got "
                         f"{name!r}")
    return _ROUTER_DTYPES[name]


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"],
                         device=["cuda", "npu", "cpu"], vendor=VENDOR)
class SwitchyardFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP engine for HF causal LMs, with switchyard's router replay (see the module).

    Built by verl (same arguments as FSDPEngineWithLMHead). Raises RuntimeError for verl <
    MIN_VERL_VERSION, ValueError for a mode or router dtype outside MODES / ENV_ROUTER_DTYPE's
    values, and (at ``initialize()``) for replay on a vision-language model under Ulysses SP or
    ranks built with different modes. The methods below are verl's engine hooks, called by
    verl."""

    def __init__(self, *args, **kwargs):
        _check_version()
        super().__init__(*args, **kwargs)
        mode = _mode_of(self.engine_config)
        # The reference policy's engine is forward-only: verl never replays into it.
        self.router_replay_mode = "disabled" if self.engine_config.forward_only else mode
        """"R3", "R2" or "disabled" (always "disabled" for a forward-only engine: the reference)."""
        self.router_dtype = _router_dtype()
        """torch.float32, or None (the model's own router dtype), from ENV_ROUTER_DTYPE."""
        self.router_patch = None  # switchyard.integrations.hf.Patch, once the model is built
        """The model's switchyard.integrations.hf.Patch once ``initialize()`` built it (None while
        replay is disabled and the router dtype is the model's own)."""
        self._call = None  # None, "replay" or "record": what the running forward_backward does
        self._capture = None
        self._packed = True
        self._pad_rows = 0
        self._total = 0
        self._calls = 0  # forward_backward_batch calls with the patch on (compared over ranks)
        self._micro = 0  # the running call's micro-batch index

    # ---- the model ----
    def initialize(self):
        """verl's initialize(), then patches the model's MoE routers (hf.patch; its ValueError /
        RuntimeError for a model without a supported router or another transformers)."""
        super().initialize()
        # every rank of the engine must replay alike (the per-micro-batch checks are collectives)
        _ranks.check_ranks_agree("the verl engine's router replay setup", {
            "mode": MODES.index(self.router_replay_mode),
            "router dtype": 0 if self.router_dtype is None else 1})
        if self.router_replay_mode == "disabled" and self.router_dtype is None:
            return
        if self.router_replay_mode != "disabled" and self.use_ulysses_sp and hasattr(
                getattr(self.module, "module", self.module).config, "vision_config"):
            raise ValueError("[verl] switchyard router replay under Ulysses sequence parallelism "
                             "serves text models; a vision-language model (sliced after its "
                             "embedding by verl) is not supported yet, got "
                             "ulysses_sequence_parallel_size="
                             f"{self.engine_config.ulysses_sequence_parallel_size}")
        self.router_patch = syhf.patch_of(self.module) or \
            syhf.patch(self.module, router_dtype=self.router_dtype)

    # ---- per call ----
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """verl's forward_backward_batch, replaying (R3; R2 updates) or recording (R2's
        forward-only log-prob pass) unless the batch says ``enable_routing_replay=False``; a call
        that fails leaves no queued ids behind."""
        flag = tu.get_non_tensor_data(data=data, key="enable_routing_replay", default=None)
        if self.router_patch is None or self.router_replay_mode == "disabled" or flag is False:
            call = None
        elif self.router_replay_mode == "R2" and forward_only:
            call = "record"
        else:
            call = "replay"
        self._call = call
        self._micro = 0
        if self.router_patch is not None:
            self._calls += 1
        try:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        except BaseException:
            if self.router_patch is not None:
                self.router_patch.clear()  # no failed call's ids survive into the next one
            raise
        finally:
            self._call = None
            self._stop_capture()
            if self.router_patch is not None:
                self.router_patch.set_action(None)

    def _stop_capture(self):
        if self._capture is not None:
            self.router_patch.stop_capture()
            self._capture = None

    # ---- per micro-batch ----
    def prepare_model_inputs(self, micro_batch):
        """verl's model inputs; when replaying, the micro-batch's ``routed_experts`` (jagged
        integer [B, tokens, num_hidden_layers, K], the lengths of input_ids) become the forward's
        targets (this SP rank's rows under Ulysses): ValueError when they are missing, not jagged,
        of another shape or lengths, not integers, or hold invalid rows (hf.Patch.set_targets),
        before anything is queued; at more than one rank also when the ranks disagree (on every
        rank: see the module)."""
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        if self.router_patch is None:
            return model_inputs, output_args
        self._total = int(micro_batch["input_ids"].offsets()[-1])
        self._packed = model_inputs.get("attention_mask") is None
        error = None
        try:
            rows = self._rows(model_inputs)  # this rank's forward rows -> packed token (-1: pad)
            # rows the forward feeds beyond the real tokens (padded layout, static and SP pad)
            self._pad_rows = model_inputs["input_ids"].numel() - (
                int((rows >= 0).sum()) if isinstance(rows, torch.Tensor) else self._total)
            if self._call == "replay":
                targets = self._targets(micro_batch, model_inputs, rows)
                self.router_patch.reset_counts()
                # every row checked, all or nothing queued (forward_backward_batch clears the
                # queue when the ranks' check below fails)
                self.router_patch.set_targets(targets)
        except (ValueError, RuntimeError) as e:  # raised below, after the ranks compared notes
            error = e
        try:
            self._check_ranks(micro_batch, model_inputs, ok=error is None)
        except ValueError as disagree:
            if error is not None:
                raise error from disagree
            raise
        if error is not None:
            raise error
        self._micro += 1
        if self._call == "record":
            self.router_patch.reset_counts()
            self._capture = self.router_patch.capture(experts=False)
        return model_inputs, output_args

    def _rows(self, model_inputs):
        """Packed layout: [rows this rank feeds] int64, the packed token each row is (-1: verl's
        static pad or Ulysses pad), cut by verl's own ulysses_pad_and_slice_inputs under SP;
        without SP the int number of rows fed (the packed tokens in order, then verl's static
        pad: no index is needed). None for the padded layout."""
        if not self._packed:
            return None
        total = self._total
        fed = model_inputs["input_ids"].shape[-1]
        if not self.use_ulysses_sp:
            width = total + self._get_packed_pad_size(total)
            if fed != width:
                raise RuntimeError(f"[verl] switchyard expected the forward to feed {width} "
                                   f"rows of the packed micro-batch ({total} tokens), verl feeds "
                                   f"{list(model_inputs['input_ids'].shape)}")
            return width
        glob = torch.arange(total + self._get_packed_pad_size(total)).unsqueeze(0)
        glob, _, _ = ulysses_pad_and_slice_inputs(
            glob, sp_size=self.ulysses_sequence_parallel_size, pad_value=-1)
        rows = glob[0]
        rows[rows >= total] = -1
        if rows.numel() != fed:
            raise RuntimeError(f"[verl] switchyard expected the forward to feed {rows.numel()} "
                               f"rows of the packed micro-batch ({total} tokens), verl feeds "
                               f"{list(model_inputs['input_ids'].shape)}")
        return rows

    def _check_ranks(self, micro_batch, model_inputs, ok):
        """Collective: the ranks agree on the call and the micro-batch (every rank), and the SP
        ranks on its tokens and routes; ValueError on every rank otherwise."""
        if _ranks.world()[1] <= 1:
            return  # (one rank: nothing to compare, not even the routes' shape read below)
        routed = micro_batch.get("routed_experts", None) if self._call == "replay" else None
        values = _jagged_values(routed) if isinstance(routed, torch.Tensor) and routed.is_nested \
            else None
        shape = list(values.shape) if values is not None and values.dim() == 3 else [-1, -1, -1]
        _ranks.check_ranks_agree("the verl micro-batch's routes", {
            "call kind (0 native, 1 replay, 2 record)": _CALLS[self._call],
            "call": self._calls, "micro-batch": self._micro,
            "routes' layers": shape[1], "routes' K": shape[2], "routes valid": int(ok)})
        if self.use_ulysses_sp:
            checksum = 0
            if values is not None and values.numel() and not values.is_floating_point():
                v = values.reshape(-1).to(torch.int64)
                w = torch.arange(1, v.numel() + 1, device=v.device, dtype=torch.int64) % 1009
                checksum = int((v * w).sum())
            _ranks.check_ranks_agree(
                "the verl micro-batch across the Ulysses sequence-parallel group", {
                    "sequences": micro_batch["input_ids"].offsets().numel() - 1,
                    "tokens": self._total, "forward rows": model_inputs["input_ids"].numel(),
                    "routes' rows": shape[0], "routes checksum": checksum},
                group=self.ulysses_parallel_group)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        """verl's model outputs; when recording (R2), plus ``model_output["routed_experts"]``:
        jagged int16 [B, tokens, num_hidden_layers, K] (dense layers 0), the layout R3 reads."""
        model_output = super().prepare_model_outputs(output, output_args, micro_batch,
                                                     logits_processor_func)
        if self._call == "record":
            model_output["routed_experts"] = self._recorded(micro_batch)
        return model_output

    def forward_step(self, micro_batch, loss_function, forward_only):
        """verl's forward_step, plus the metrics router_replay/replayed_rows and
        router_replay/native_rows (replay) or router_replay/recorded_rows (R2 recording), summed
        over the ranks, with their per-rank extremes (``replay_metrics``; a collective)."""
        loss, output = super().forward_step(micro_batch, loss_function, forward_only)
        if self._call is not None:
            c = self.router_patch.replay_counts()  # {layer: ReplayCounts}
            total = ReplayCounts.summed(c.values())
            if self._call == "replay":
                counts = {"router_replay/replayed_rows": int(total.replayed),
                          "router_replay/native_rows": int(
                              total.native + total.invalid - self._pad_rows * len(c))}
            else:
                counts = {"router_replay/recorded_rows": int(
                    total.native - self._pad_rows * len(c))}
            output.setdefault("metrics", {}).update(replay_metrics(counts))
        return loss, output

    def _layout(self, micro_batch):
        """(offsets [B+1], lengths [B], mask [B, max_len]) of the micro-batch's jagged tokens."""
        offsets = micro_batch["input_ids"].offsets().to("cpu", torch.int64)
        lengths = offsets.diff()
        max_len = int(lengths.max()) if lengths.numel() else 0
        mask = torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)
        return offsets, lengths, mask

    def _targets(self, micro_batch, model_inputs, rows) -> torch.Tensor:
        """The micro-batch's routed_experts as replay targets in the forward's token order (the
        rows of this rank: ``rows``, packed layout)."""
        p = self.router_patch
        routed = micro_batch.get("routed_experts", None)
        if routed is None:
            raise ValueError(f"[verl] router replay {self.router_replay_mode}: the micro-batch has "
                             "no 'routed_experts' (R3: the rollout must return them, e.g. "
                             "actor_rollout_ref.rollout.enable_rollout_routing_replay=True; R2: "
                             "the log-prob pass of this engine records them)")
        offsets = micro_batch["input_ids"].offsets()
        values = _jagged_values(routed) if isinstance(routed, torch.Tensor) and routed.is_nested \
            else None
        L, K = p.num_route_layers, p.top_k
        B, total = offsets.numel() - 1, self._total
        want = f"[B={B}, tokens (as input_ids), num_hidden_layers={L}, K={K}]"
        if values is None:
            raise ValueError(f"[verl] routed_experts must be a jagged nested tensor {want} (verl's "
                             "left_right_2_no_padding layout), got "
                             f"{getattr(routed, 'shape', type(routed).__name__)}")
        if values.dim() != 3 or values.shape[0] != total or values.shape[1] != L or \
                values.shape[2] != K or not (routed.offsets() is offsets or torch.equal(
                    routed.offsets().to("cpu", torch.int64), offsets.to("cpu", torch.int64))):
            raise ValueError(f"[verl] routed_experts must be {want}, got {routed.size(0)} "
                             f"sequences with values {list(values.shape)} (lengths "
                             f"{routed.offsets().diff().tolist()}, input_ids lengths "
                             f"{offsets.diff().tolist()})")
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"[verl] routed_experts must hold integer expert ids, got dtype "
                             f"{values.dtype}")
        ids = model_inputs["input_ids"]
        if rows is not None:  # packed
            t = p.targets_from_verl_packed(values, offsets)  # [total, M, K], the last tokens -1
            if isinstance(rows, int):  # no SP: the tokens in order, then the static pad
                if rows > total:
                    t = torch.cat([t, t.new_full((rows - total, *t.shape[1:]), -1)])
            else:  # under SP: this rank's rows of (total + pads)
                t = torch.where((rows >= 0)[:, None, None], t[rows.clamp(min=0)], -1) \
                    if t.shape[0] else t.new_full((rows.numel(), *t.shape[1:]), -1)
        else:
            # Right-padded [B, max_len, L, K] (zeros at padding) + its mask: verl's own batch
            # layout, read by the hf integration's verl importer (the last token and zero rows:
            # no route).
            _, _, mask = self._layout(micro_batch)
            dense = values.new_zeros((B, mask.shape[1], L, K))
            dense[mask.to(values.device)] = values
            t, _ = p.targets_from_verl(dense.to("cpu"), mask)  # [B, max_len, M, K], -1 at pad
        if t.shape[0] * (t.shape[1] if t.dim() == 4 else 1) != ids.numel():
            raise ValueError(f"[verl] routed_experts cover {total} tokens but the forward feeds "
                             f"{list(ids.shape)}")
        return t

    def _recorded(self, micro_batch):
        """This forward's routes in verl's layout: jagged int16 [B, tokens, num_hidden_layers, K]."""
        ids = self._capture.ids()  # [b, S, L, K] int32 of the one forward, dense layers 0
        self._stop_capture()
        if self.use_ulysses_sp:  # each SP rank fed its slice: the whole packed micro-batch
            parts = [torch.empty_like(ids) for _ in range(self.ulysses_sequence_parallel_size)]
            torch.distributed.all_gather(parts, ids.contiguous(),
                                         group=self.ulysses_parallel_group)
            ids = torch.cat(parts, dim=1)
        offsets, lengths, mask = self._layout(micro_batch)
        total = int(offsets[-1])
        # packed: (1, total + verl's static pad, dropped); padded: [B, max_len]
        values = ids[0, :total] if self._packed else ids[mask]
        dev = micro_batch["input_ids"].values().device
        return torch.nested.nested_tensor_from_jagged(values.to(dev, torch.int16),
                                                      offsets.to(dev))


# ---- verl's Megatron engine -------------------------------------------------------------------
def megatron_replay_targets(routed_experts, input_ids, *, num_experts, num_layers, moe_layer_freq,
                            keys, tp_size=1, tp_rank=0, sequence_parallel=False, cp_size=1,
                            cp_rank=0, bshd_seq_len=None):
    """One verl Megatron micro-batch's ``routed_experts`` -> ``{layer_number: ids [T_local, K]}``
    for ``switchyard.integrations.megatron.set_replay_targets``, in the order this rank's routers
    see the tokens.

    routed_experts: jagged [B, tokens, num_layers, K] integers (verl's layout; a sequence may have
    one row fewer than its input_ids: the rollout never routes the last token), input_ids: jagged
    [B, tokens]. The tokens are packed as verl's ``preprocess_thd_engine`` packs input_ids (each
    sequence padded to ``tp_size`` or ``2 * tp_size * cp_size``), cut to this context-parallel
    rank's zigzag piece and, under sequence parallelism, to this tensor-parallel rank's block.
    All-zero rows, missing last rows and padding are -1 (routed natively, counted). ``keys``: the
    layer numbers of this (virtual) pipeline chunk's routers (``attach_replay``'s keys), so
    pipeline stages take their own layers. ``moe_layer_freq``: Megatron's (int or per-layer list).
    ``bshd_seq_len``: the padded layout instead (verl's ``preprocess_bshd_engine``, padding off):
    every sequence right-padded to this length (the micro-batch's longest, or verl's
    ``forced_max_seqlen``, aligned to ``tp_size`` or ``2 * tp_size * cp_size``), zigzag-cut per
    sequence under CP, the sequence dimension cut under SP, in Megatron's sequence-first token
    order (token s of sequence b is row s * B + b).

    Returns {layer_number: int32 [T_local, K]} (views of one table; -1 = route natively) for the
    int keys among ``keys``. ValueError when routed_experts / input_ids are not jagged tensors,
    routed_experts is not integer [B, tokens, num_layers, K] with each sequence's length (or one
    fewer), an id is outside [0, num_experts), bshd_seq_len is shorter than the longest sequence
    or not aligned, or a key is not a MoE layer."""
    import switchyard as sy
    want = f"[B, tokens (as input_ids), num_layers={num_layers}, K]"
    if not isinstance(routed_experts, torch.Tensor) or not routed_experts.is_nested or \
            not isinstance(input_ids, torch.Tensor) or not input_ids.is_nested:
        raise ValueError(f"[verl] routed_experts must be a jagged nested tensor {want} (verl's "
                         "no-padding layout), got "
                         f"{getattr(routed_experts, 'shape', type(routed_experts).__name__)}")
    values = routed_experts.values()
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"[verl] routed_experts must hold integer expert ids, got dtype "
                         f"{values.dtype}")
    lengths = input_ids.offsets().diff().to("cpu", torch.int64)
    rlen = routed_experts.offsets().diff().to("cpu", torch.int64)
    if values.dim() != 3 or values.shape[1] != num_layers or len(rlen) != len(lengths) or \
            bool(((rlen != lengths) & (rlen != lengths - 1)).any()):
        raise ValueError(f"[verl] routed_experts must be {want}, got {len(rlen)} sequences with "
                         f"values {list(values.shape)} (lengths {rlen.tolist()}, input_ids "
                         f"lengths {lengths.tolist()})")
    B, S = len(lengths), int(lengths.max()) if len(lengths) else 0
    mask = torch.arange(S).unsqueeze(0) < lengths.unsqueeze(1)
    rmask = torch.arange(S).unsqueeze(0) < rlen.unsqueeze(1)
    dense = values.new_zeros((B, S, *values.shape[1:]))
    dense[rmask.to(values.device)] = values  # a missing last row stays 0: no route
    if isinstance(moe_layer_freq, int):
        freq = [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    else:
        freq = [int(v) for v in moe_layer_freq]
    tables, rep = sy.routes.from_verl(dense.to("cpu"), mask.to(torch.int64), num_experts,
                                      moe_layer_freq=freq)
    if bshd_seq_len is None:
        packed, _, cu_padded = sy.routes.pack_thd(tables, tp_size=tp_size, cp_size=cp_size)
        if cp_size > 1:
            packed = sy.routes.cp_zigzag_split(packed, cu_padded, cp_size, cp_rank)
        if sequence_parallel and tp_size > 1:
            packed = sy.routes.sp_split(packed, tp_size, tp_rank)
        return sy.routes.layer_targets(packed, rep["moe_layers"], keys)
    Sp = int(bshd_seq_len)
    align = 2 * tp_size * cp_size if cp_size > 1 else tp_size
    if Sp < S or Sp % align:
        raise ValueError(f"[verl] bshd_seq_len must be >= the longest sequence ({S}) and a "
                         f"multiple of {align}, got bshd_seq_len={bshd_seq_len}")
    M = len(rep["moe_layers"])
    padded = torch.full((B, Sp, M, values.shape[2]), -1, dtype=torch.int32)
    for b, t in enumerate(tables):
        padded[b, :t.shape[0]] = t
    if cp_size > 1:  # each sequence cut in 2 * cp chunks; rank r keeps chunks r and 2cp-1-r
        padded = sy.routes.cp_zigzag_split(padded.reshape(B * Sp, M, -1),
                                           [b * Sp for b in range(B + 1)], cp_size, cp_rank)
        padded = padded.reshape(B, Sp // cp_size, M, -1)
    if sequence_parallel and tp_size > 1:  # Megatron scatters [S, B, H] along S
        n = padded.shape[1] // tp_size
        padded = padded[:, tp_rank * n:(tp_rank + 1) * n]
    return sy.routes.layer_targets(padded.reshape(-1, M, padded.shape[-1]).contiguous(),
                                   rep["moe_layers"], keys, batch_size=B)


try:
    from megatron.core import parallel_state as _mpu
    from verl.utils.megatron_utils import unwrap_model as _unwrap_model
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
except ImportError:  # no megatron-core: the FSDP engine alone
    MegatronEngineWithLMHead = None

if MegatronEngineWithLMHead is not None:
    import switchyard.integrations.megatron as sym

    __all__.append("SwitchyardMegatronEngine")

    @EngineRegistry.register(model_type="language_model", backend="megatron",
                             device=["cuda", "npu", "cpu"], vendor=VENDOR)
    class SwitchyardMegatronEngine(MegatronEngineWithLMHead):
        """verl's Megatron engine with switchyard.integrations.megatron in place of verl's
        router_replay_patch: Megatron-Core patched by ``sym.apply()`` (the dropless all-to-all
        sized from the validated replay's pair count, no ``.item()``), one keyed, validated
        ``RouterReplay`` per router (``attach_replay``), R3 targets per micro-batch from its
        ``routed_experts`` (``megatron_replay_targets``).

        Built by verl (same arguments as MegatronEngineWithLMHead). R3 or disabled: ValueError
        for R2, for dynamic_context_parallel, or (at ``initialize()``) fp8 padding with replay on;
        RuntimeError for verl < MIN_VERL_VERSION. The methods below are verl's engine hooks."""

        # verl's own replay (its TopKRouter patch, moe_enable_routing_replay in the config, its
        # per-micro-batch set_router_replay_data) stays off: every use of this flag in verl's
        # engine reads False, whatever its __init__ assigns.
        @property
        def enable_routing_replay(self):
            """Always False: verl's own router replay stays off (assignments are ignored)."""
            return False

        @enable_routing_replay.setter
        def enable_routing_replay(self, value):
            pass

        def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
            _check_version()
            mode = _mode_of(engine_config)
            self.router_replay_mode = "disabled" if engine_config.forward_only else mode
            """"R3" or "disabled" (always "disabled" for a forward-only engine)."""
            if self.router_replay_mode == "R2":
                raise ValueError("[verl] switchyard's Megatron engine serves router_replay mode "
                                 "R3 (or disabled), got R2 (its log-prob pass does not record "
                                 "routes yet; the FSDP engine does)")
            if self.router_replay_mode != "disabled":
                if engine_config.dynamic_context_parallel:
                    raise ValueError("[verl] switchyard router replay does not support "
                                     "dynamic_context_parallel, got True")
                sym.apply()  # before the model is built; idempotent
            super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
            self._replaying = False
            self.router_replays = {}
            """{layer_number or ("mtp", n): switchyard.RouterReplay} once initialize() attached
            them (empty while replay is disabled)."""

        def initialize(self):
            """verl's initialize(), then ``attach_replay(invalid_replay_rows="merge")`` on the
            model (ValueError for fp8 padding with replay on)."""
            super().initialize()
            if self.router_replay_mode != "disabled":
                if getattr(self.tf_config, "fp8", None):
                    raise ValueError("[verl] switchyard's Megatron router replay does not support "
                                     f"fp8 padding yet, got fp8={self.tf_config.fp8!r}")
                self.router_replays = sym.attach_replay(self.module, invalid_replay_rows="merge")

        def forward_backward_batch(self, data, loss_function, forward_only=False):
            """verl's forward_backward_batch, replaying each micro-batch's routes unless the batch
            says ``enable_routing_replay=False``; the queues are cleared afterwards, failed or
            not."""
            flag = tu.get_non_tensor_data(data=data, key="enable_routing_replay", default=None)
            self._replaying = bool(self.router_replays) and flag is not False
            # verl's own R2 recording (forward_backward_batch reads this key) stays off.
            tu.assign_non_tensor(data, enable_routing_replay=False)
            try:
                return super().forward_backward_batch(data, loss_function,
                                                      forward_only=forward_only)
            finally:
                if flag is not None:
                    tu.assign_non_tensor(data, enable_routing_replay=flag)
                if self.router_replays:
                    sym.set_replay_action(self.module, None)
                    sym.clear_replay(self.module)
                self._replaying = False

        def forward_step(self, batch_iter, model, logits_processor_func,
                         postprocess_micro_batch_func):
            """verl's forward_step, the micro-batch's targets set first (set_micro_batch_targets)
            when replaying."""
            batch = next(batch_iter)
            if self._replaying:
                self.set_micro_batch_targets(batch, model)
            return super().forward_step(iter([batch]), model, logits_processor_func,
                                        postprocess_micro_batch_func)

        def set_micro_batch_targets(self, batch, model):
            """Validates the micro-batch's routes (``routed_experts``: jagged integer [B, tokens,
            num_layers, K]) and queues them for ``model``'s routers (one VPP chunk), every check
            before any state changes, collective over the expert-parallel group (the same
            ValueError on every rank): ValueError when routed_experts is missing or fails
            ``megatron_replay_targets`` / ``set_replay_targets``."""
            routed = batch.get("routed_experts", None)
            if routed is None:
                raise ValueError("[verl] router replay R3: the micro-batch has no "
                                 "'routed_experts' (the rollout must return them, e.g. "
                                 "actor_rollout_ref.rollout.enable_rollout_routing_replay=True)")
            chunk = _unwrap_model(model)
            keys = [k for k in sym.replays(chunk) if isinstance(k, int)]
            cfg = self.tf_config
            tp, cp = (_mpu.get_tensor_model_parallel_world_size(),
                      _mpu.get_context_parallel_world_size())
            seq_len = None
            if not self.engine_config.use_remove_padding:  # verl's preprocess_bshd_engine
                lengths = batch["input_ids"].offsets().diff()
                seq_len = tu.get_non_tensor_data(data=batch, key="forced_max_seqlen", default=None)
                seq_len = int(lengths.max()) if seq_len is None else int(seq_len)
                align = 2 * tp * cp if cp > 1 else tp
                seq_len += (align - seq_len % align) % align
            targets = megatron_replay_targets(
                routed, batch["input_ids"], num_experts=cfg.num_moe_experts,
                num_layers=cfg.num_layers, moe_layer_freq=cfg.moe_layer_freq, keys=keys,
                tp_size=tp,
                tp_rank=_mpu.get_tensor_model_parallel_rank(),
                sequence_parallel=bool(cfg.sequence_parallel),
                cp_size=cp,
                cp_rank=_mpu.get_context_parallel_rank(), bshd_seq_len=seq_len)
            sym.set_replay_targets(chunk, targets,
                                   group=_mpu.get_expert_model_parallel_group())
            sym.set_replay_action(chunk, "replay_forward", keys=keys)
