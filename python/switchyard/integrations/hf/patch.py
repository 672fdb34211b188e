"""switchyard.integrations.hf.patch: ``patch()`` installs switchyard's router forward on every MoE
router of a transformers model (``_Layer``: one patched MoE layer, its replay queue and counts),
``Patch`` drives replay and capture and undoes the patch; the transformers version check. See the
package docstring."""
import collections
import contextlib
import re
import sys

import torch

import switchyard as sy
import switchyard.torch as syt
from switchyard import replay as _replay
from switchyard import routes as syr

from .._versions import check_version
from .capture import Capture
from .families import FAMILIES, _family_of, _gate

MIN_TRANSFORMERS_VERSION = "5.24.0"
"""Oldest transformers release this integration was checked against (router classes and the exact
routing math of every family in families.py were read from it)."""
SUPPORTED_TRANSFORMERS_VERSIONS = ((5, 24), (5, 24))
"""Supported transformers releases, (major, minor) oldest and newest, any patch release: 5.24.x.
``patch()`` refuses others (a newer one passes, with a warning, under
SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1)."""


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
                                      invalid_replay_rows=owner.invalid_replay_rows,
                                      num_experts=self.num_experts)
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
        recompute = _replay.in_recompute()  # the checkpoint recompute of this forward
        ctx = (contextlib.nullcontext() if native
               else torch.autocast(device_type=x.device.type, enabled=False))
        with ctx:
            with fam.native_context(r, x) if native else contextlib.nullcontext():
                if native:
                    logits = fam.native_logits(r, x)
                else:
                    w, b = fam.params(r)
                    logits = _gate(x, w, b, owner.router_dtype, owner.gate)
                rows = None
                if recompute:
                    if self.replay.num_pending_recompute or \
                            self.replay.action == "replay_forward":
                        rows = owner.driver.take_recompute(self.layer, T)
                        self.counts["num_recomputed_rows"] += T
                    else:
                        self.counts["num_recomputed_native_rows"] += T
                else:
                    if self.replay.action == "recompute":
                        raise ValueError(
                            f"[hf] layer {self.layer}: action 'recompute' is not used with "
                            "transformers models: the checkpoint recompute is detected and "
                            "replayed automatically; use 'replay_forward'")
                    rows = owner.driver.take_forward(self.layer, T)
                    if rows is not None:
                        self.counts["num_replayed_rows"] += rows.num_replayed
                        self.counts["num_native_rows"] += rows.num_native
                        self.counts["num_invalid_replay_rows"] += rows.num_invalid
                    else:
                        self.counts["num_native_rows"] += T
                    self.counts["num_calls"] += 1
                replay_ids = replay_mask = None
                if rows is not None:  # the core's rows -> the family's (ids, mask) on the device
                    replay_ids = rows.ids.to(device=logits.device, dtype=torch.int64)
                    replay_mask = rows.replayed.to(logits.device)
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
            self.owner.driver.queue_recompute(self.layer, ids32)  # for the recompute
        if self.owner._capture is not None:
            self.owner._capture._add(self.layer, ids32, batch_shape, T)



# --------------------------------------------------------------------------------------------------
# The patch
# --------------------------------------------------------------------------------------------------
class Patch:
    """What ``patch()`` did, and the handle to drive replay and capture. ``family`` (the family's
    name), ``layers`` (absolute decoder-layer numbers of the patched MoE layers, ascending),
    ``modules`` (layer -> router module name), ``replays`` (layer -> switchyard.RouterReplay).
    Made by ``patch()`` (and found again by ``patch_of``), not directly. Route tensors in and out
    are laid out per MoE layer in the order of ``layers`` (``moe_layers`` = len(layers)) with
    K = ``top_k``; -1 = no route (routed natively)."""

    def __init__(self, model, router_dtype, gate, invalid_replay_rows):
        self.model = model
        """The patched model (torch.nn.Module)."""
        self.router_dtype = router_dtype
        """torch.float32, torch.float64 or None (the family's own dtypes), as given to patch()."""
        self.gate = gate
        """"auto" or "torch", as given to patch()."""
        self.invalid_replay_rows = invalid_replay_rows
        """The replay policy of every layer: "error", "native" or "merge"."""
        self._layers = []
        self._capture = None
        self._stack_hooks = []  # on the modules that run the decoder layers (see _install)
        self.driver = None  # the replay core's driver over the layers' queues (_install)
        """The switchyard.replay.ReplayDriver over the layers' replay queues."""
        cfg = model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.num_hidden_layers = int(cfg.num_hidden_layers)
        """The model's decoder layers (dense and MoE): the layer dimension of vLLM / verl data."""

    # ---- what was patched ----
    @property
    def active(self) -> bool:
        """Whether every patched router still runs this Patch's forward (False once unpatched,
        also when a newer Patch took the routers over)."""
        return bool(self._layers) and all(l.installed for l in self._layers)

    @property
    def family(self) -> str:
        """The family's name as people write it, e.g. "Qwen3-MoE" (a key of COMBINE_DTYPE)."""
        return self._layers[0].family.title

    @property
    def layers(self) -> list[int]:
        """Absolute decoder-layer numbers of the patched MoE layers, ascending."""
        return [l.layer for l in self._layers]

    @property
    def modules(self) -> dict[int, str]:
        """{layer: qualified name of its router module}."""
        return {l.layer: l.name for l in self._layers}

    @property
    def replays(self) -> dict[int, sy.RouterReplay]:
        """{layer: switchyard.RouterReplay} (each with num_experts, so targets are classified as
        they are set)."""
        return {l.layer: l.replay for l in self._layers}

    @property
    def num_experts(self) -> int:
        """E, the routed experts per MoE layer (the largest, for a model whose layers differ)."""
        return max(l.num_experts for l in self._layers)

    @property
    def top_k(self) -> int:
        """K, the experts each token is routed to."""
        return self._layers[0].top_k

    @property
    def combine_dtype(self) -> str:
        """Dtype of the combine weights the patched routers return (COMBINE_DTYPE)."""
        if self.router_dtype is None:
            return "the family's own (unchanged)"
        return self._layers[0].family.combine_dtype

    def gate_description(self) -> str:
        """What computes the router logits, in words (shown by ``repr``)."""
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
        """Sets every layer's RouterReplay action: None, "record" or "replay_forward" (ValueError
        for another value; "recompute" is refused at the next forward: the checkpoint recompute
        is detected by itself)."""
        for l in self._layers:
            l.replay.action = action

    def set_targets(self, routes: torch.Tensor) -> None:
        """Queues replay targets for the next forward of every MoE layer and sets the action to
        "replay_forward". ``routes``: [T, moe_layers, K] or [B, S, moe_layers, K] ids (int64,
        int32, int16, int8, uint8 or uint16, any device; -1 = route natively), tokens in the order
        the forward sees them (row-major over [B, S]); moe_layers in the order of ``layers``.
        ValueError for another rank or another moe_layers / K; every layer's rows are checked by
        the engine first (its ValueError, naming layer and token, by ``invalid_replay_rows``);
        nothing is queued unless all pass. The next forward must see T (= B * S) tokens (else its
        ValueError)."""
        if not isinstance(routes, torch.Tensor) or routes.dim() not in (3, 4):
            raise ValueError("[hf.set_targets] routes must be a [T, moe_layers, K] or "
                             "[B, S, moe_layers, K] tensor, got "
                             f"{getattr(routes, 'shape', type(routes).__name__)}")
        t = routes.reshape(-1, routes.shape[-2], routes.shape[-1])
        M, K = len(self._layers), self.top_k
        if t.shape[1] != M or t.shape[2] != K:
            raise ValueError(f"[hf.set_targets] routes must hold {M} MoE layers and K={K}, got "
                             f"shape {list(routes.shape)}")
        self.driver.set_step_targets([t[:, m, :] for m in range(M)])  # all or none
        for l in self._layers:
            l.replay.action = "replay_forward"

    def counts(self) -> dict[int, dict[str, int]]:
        """{layer: {"num_replayed_rows", "num_native_rows", "num_invalid_replay_rows",
        "num_recomputed_rows", "num_calls": int}}: rows replayed / routed natively / invalid
        (routed natively, also counted as native) in forwards, rows recomputed with queued ids
        inside backward, and forward calls, since reset_counts()."""
        keys = ("num_replayed_rows", "num_native_rows", "num_invalid_replay_rows",
                "num_recomputed_rows", "num_calls")
        return {l.layer: {k: int(l.counts[k]) for k in keys} for l in self._layers}

    def reset_counts(self) -> None:
        """Zeroes the counts of every layer (the queues stay)."""
        for l in self._layers:
            l.counts.clear()

    def clear(self) -> None:
        """Drops every queued table (recorded, targets, pending recompute) and the counts."""
        self.driver.clear()
        for l in self._layers:
            l.counts.clear()

    # ---- route sources (R3) ----
    def _layer_freq(self):
        s = set(self.layers)
        return [1 if i in s else 0 for i in range(self.num_hidden_layers)]

    def _import_vllm(self, arrays, zero_rows):
        return syr.import_vllm_arrays(arrays, self.num_experts, moe_layer_freq=self._layer_freq(),
                                      num_input_layers=self.num_hidden_layers, top_k=self.top_k,
                                      zero_rows=zero_rows)

    def targets_from_tables(self, tables, attention_mask: torch.Tensor | None = None
                            ) -> torch.Tensor:
        """switchyard route tables (one [n_b, moe_layers, K] per sequence, int32 / int64 / int16 /
        int8 / uint8 / uint16, e.g. from switchyard.routes.read) and ``attention_mask`` [B, S]
        (nonzero = real token; None: tables of one length, stacked) -> int32 [B, S, moe_layers, K]
        targets for ``set_targets``, -1 at padding (switchyard.routes.add_padding). ValueError
        for another dtype, tables of different layers / K, or a mask row whose real tokens are not
        n_b."""
        tables = [syt._idx32(torch.as_tensor(t), "hf.targets_from_tables", f"tables[{i}]",
                             syt._ID_DTYPES) for i, t in enumerate(tables)]
        return syr.add_padding(tables, attention_mask)

    def targets_from_vllm(self, arrays, attention_mask: torch.Tensor | None = None,
                          zero_rows: str = "keep") -> tuple[torch.Tensor, dict]:
        """vLLM / SGLang routed_experts arrays (one integer [n_b - 1, num_hidden_layers, K] per
        sequence, numpy or torch, dense layers 0) and ``attention_mask`` [B, S] (None: sequences of
        one length) -> (int32 [B, S, moe_layers, K] targets with -1 at padding and last tokens,
        import report dict), through switchyard's vLLM importer and this model's layer map
        (``zero_rows`` as there: "keep", "to_none" or "error"). ValueError (the importer's, naming
        sequence, token, layer and value) for a wrong shape or an id outside [0, num_experts)."""
        tables, report = self._import_vllm(list(arrays), zero_rows)
        return syr.add_padding(tables, attention_mask), report

    def targets_from_verl(self, routed_experts: torch.Tensor, attention_mask: torch.Tensor,
                          zero_rows: str = "to_none") -> tuple[torch.Tensor, dict]:
        """verl's ``routed_experts`` ([B, S, num_hidden_layers, K], int16, padded, zero filled;
        each row holds vLLM's routes of its real tokens, the last real token having none; any
        integer dtype) and its attention mask [B, S] -> (int32 [B, S, moe_layers, K] targets,
        import report dict); ValueError as ``targets_from_vllm``. Padding is dropped
        by the mask (switchyard.routes.drop_padding), the layers mapped by the vLLM importer (all
        zero rows on MoE layers become -1 with zero_rows="to_none": routed natively, counted)."""
        m = torch.as_tensor(attention_mask).to("cpu")
        # verl's layout has one reader, routes.from_verl; the last real token of each row (no
        # route in the rollout) is masked out there and gets its -1 row back here.
        real = m != 0
        has = real.any(dim=1)
        last = real.shape[1] - 1 - real.flip(1).to(torch.int8).argmax(dim=1)
        routed = real.clone()
        routed[has, last[has]] = False
        tables, report = syr.from_verl(torch.as_tensor(routed_experts), routed, self.num_experts,
                                       moe_layer_freq=self._layer_freq(), zero_rows=zero_rows)
        tables = [torch.cat([t, t.new_full((1, *t.shape[1:]), -1)]) if h else t
                  for t, h in zip(tables, has.tolist())]
        return syr.add_padding(tables, m), report

    # ---- capture ----
    def capture(self) -> "Capture":
        """Starts capturing the ids of every forward (until the returned Capture's context exits
        or stop_capture()); recomputes inside backward are not captured. ``generate()`` with beam
        search (num_beams > 1) is refused while capturing: the beams are reordered at every step,
        so the routes of a step would not follow the returned sequences. Returns the Capture;
        ValueError when a capture is already running."""
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
        """Stops the running capture, if any (what leaving its ``with`` block does)."""
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
        names = {l.layer: l.name for l in self._layers}
        self.driver = _replay.ReplayDriver({l.layer: l.replay for l in self._layers},
                                           label=lambda k: f"layer {k} ({names[k]})")
        for l in self._layers:
            l.install()
        for m in stacks:
            self._stack_hooks.append(m.register_forward_pre_hook(self._step_begins))
            self._stack_hooks.append(m.register_forward_hook(self._step_ends, always_call=True))

    def _step_begins(self, module, args):
        self.driver.begin_step()

    def _step_ends(self, module, args, output):
        self.driver.end_step(failed=output is None and sys.exc_info()[1] is not None)

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
    check_version("hf.patch", "transformers", _transformers_version(),
                  *SUPPORTED_TRANSFORMERS_VERSIONS)


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def patch(model: torch.nn.Module, router_dtype: torch.dtype | None = torch.float32, *,
          gate: str = "auto", invalid_replay_rows: str = "error") -> Patch:
    """Patches every MoE router of a transformers model in place; returns a Patch.

    router_dtype: torch.float32 (default) or torch.float64: gate GEMM and routing math in that dtype
    (also under autocast); None: the family's own dtypes (bitwise the unpatched outputs).
    gate: "auto" (switchyard's engine on CPU tensors, torch GEMM on CUDA) or "torch".
    invalid_replay_rows: "error", "native" or "merge" (switchyard.replay.POLICIES; with "merge" a
    row that repeats an id keeps its slots, each with the family's weight at that id: the experts
    add them up).
    Raises ValueError (the model untouched) for another router_dtype / gate / policy, a model that
    is not a torch.nn.Module, has no supported router, has routers already patched (unpatch the
    earlier Patch first) or of several families, and RuntimeError for a transformers
    release outside SUPPORTED_TRANSFORMERS_VERSIONS (5.24.x; a newer one is let through, with a
    warning, when the environment sets SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1).
    """
    if router_dtype not in (None, torch.float32, torch.float64):
        raise ValueError("[hf.patch] router_dtype must be None (the family's own), torch.float32 "
                         f"or torch.float64, got {router_dtype}")
    if gate not in ("auto", "torch"):
        raise ValueError(f"[hf.patch] gate must be 'auto' or 'torch', got {gate!r}")
    _replay.check_policy(invalid_replay_rows, "hf.patch")
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
