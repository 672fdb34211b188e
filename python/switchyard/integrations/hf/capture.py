"""switchyard.integrations.hf.capture: recording the routes of every forward while capturing
(a whole ``generate()``: prefill and every decode step), and turning them into vLLM's
``routed_experts``, switchyard route tables, route files or verl's batch layout."""
import os
import re

import torch

from switchyard import replay as _replay
from switchyard import routes as syr

LAYER_RE = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)(?:\.|$)")
"""A module name's decoder layer: the last ``layers.<n>`` (DBRX: ``blocks.<n>``) in it."""


def is_experts(mod: torch.nn.Module) -> bool:
    """Whether ``mod`` is an experts module of transformers' experts interface
    (``@use_experts_implementation``, integrations/moe.py): its forward receives
    ``(hidden_states, top_k_index, top_k_weights)``, the ids whichever router produced.

    Args:
        mod: a module.

    Returns:
        bool.
    """
    return all(hasattr(mod, a) for a in ("has_gate", "has_bias", "is_transposed",
                                         "is_concatenated", "_is_expert_parallel"))


def _batch_shape(shape, T):
    """(B, S) of a decoder layer's input shape (without its hidden dimension) whose T = B * S
    tokens the router routed: the leading two dimensions, also of an input with more (DeepSeek-V4's
    hyper-connection streams, [B, S, hc, H]); (1, T) when they are not B * S = T."""
    if shape is None or len(shape) < 2 or shape[0] * shape[1] != T:
        return (1, T)
    return (shape[0], shape[1])


def _received_ids(args, kwargs):
    ids = args[1] if len(args) > 1 else kwargs.get("top_k_index")
    return ids if isinstance(ids, torch.Tensor) else None


def _host_cat(steps):
    """The steps [B, S_step, K] concatenated over S as int32 on the CPU: one copy after the
    concatenation where they share device and dtype (the routers' own id tensors, kept as they
    were), else each step's first."""
    first = steps[0]
    if all(s.device == first.device and s.dtype == first.dtype for s in steps):
        return torch.cat(steps, dim=1).to(device="cpu", dtype=torch.int32)
    return torch.cat([s.to(device="cpu", dtype=torch.int32) for s in steps], dim=1)


def _host_layers(per_layer):
    """{layer: [B, S_step, K_layer] steps} -> {layer: int32 [B, S, K_layer] on the CPU}, every
    layer's steps concatenated; ValueError when nothing was captured or the steps' batch sizes
    (or the layers' token counts) differ."""
    per = {}
    for layer, steps in per_layer.items():
        if not steps:
            raise ValueError("[hf.Capture] nothing was captured (no forward ran while "
                             "capturing)")
        if len({s.shape[0] for s in steps}) != 1:
            raise ValueError("[hf.Capture] the captured forwards have different batch sizes "
                             f"{sorted({s.shape[0] for s in steps})}: capture one generate() "
                             "call at a time")
        per[layer] = _host_cat(steps) if len(steps) > 1 else \
            steps[0].to(device="cpu", dtype=torch.int32)
    if not per:
        raise ValueError("[hf.Capture] nothing was captured (no MoE layer ran while capturing)")
    B, S, _ = next(iter(per.values())).shape
    for layer, t in per.items():
        if t.shape[:2] != (B, S):
            raise ValueError(f"[hf.Capture] layer {layer} captured {list(t.shape[:2])} tokens, "
                             f"another layer {[B, S]}")
    return per


def _stack(per_layer, num_hidden_layers, K):
    """{layer: [B, S_step, K_layer] steps} -> int32 [B, S, num_hidden_layers, K]: dense layers 0,
    the columns past a layer's own K -1."""
    per = _host_layers(per_layer)
    B, S, _ = next(iter(per.values())).shape
    out = torch.zeros(B, S, num_hidden_layers, K, dtype=torch.int32)
    for layer, t in per.items():
        out[:, :, layer, :] = -1 if t.shape[2] < K else 0
        out[:, :, layer, :t.shape[2]] = t
    return out


class ExpertsCapture:
    """The ids every experts module of a model received, per forward, whatever computed them
    (patched or not, any family: forward pre-hooks on transformers' experts interface and on the
    decoder layers, for the batch shape). Made by ``capture_experts(model)`` or
    ``Capture.expert_ids()``; a context manager. ``ids()``: int32 [B, S, num_hidden_layers, K]."""

    def __init__(self, model, layers=None, scan=None, blocks=None):
        self._model = model
        self._steps = {}
        self._shape = {}
        self._hooks = []
        self.refeed = False  # set by Capture under generate(use_cache=False)
        experts, decoders, num_hidden_layers = scan if scan is not None else \
            experts_modules(model, layers, blocks)
        for layer, mod in experts.items():
            self._steps[layer] = []
            self._hooks.append(mod.register_forward_pre_hook(
                lambda m, a, kw, layer=layer: self._on_experts(layer, a, kw), with_kwargs=True))
        for layer, mod in decoders.items():
            self._hooks.append(mod.register_forward_pre_hook(
                lambda m, a, kw, layer=layer: self._on_layer(layer, a, kw), with_kwargs=True))
        self.num_hidden_layers = num_hidden_layers
        """The layer dimension of ``ids()`` (the config's num_hidden_layers)."""

    @property
    def layers(self) -> list[int]:
        """The decoder layers whose experts are observed, ascending."""
        return sorted(self._steps)

    def _on_layer(self, layer, args, kwargs):
        h = args[0] if args else kwargs.get("hidden_states")
        if isinstance(h, torch.Tensor) and not torch.compiler.is_compiling():
            self._shape[layer] = tuple(h.shape[:-1])

    def _on_experts(self, layer, args, kwargs):
        ids = _received_ids(args, kwargs)
        if ids is None or torch.compiler.is_compiling():
            return
        if _replay.in_recompute():
            return  # a checkpoint recompute inside backward: not a new forward
        ids = ids.detach().to(device="cpu", dtype=torch.int32).reshape(-1, ids.shape[-1])
        shape = self._shape.pop(layer, None)
        T = ids.shape[0]
        shape = _batch_shape(shape, T)
        step = ids.view(shape[0], shape[1], -1)
        steps = self._steps[layer]
        if self.refeed and steps:
            have = sum(s.shape[1] for s in steps)
            step = step[:, have:]
        steps.append(step)

    def ids(self) -> torch.Tensor:
        """int32 [B, S_fed, num_hidden_layers, K]: the ids each observed layer's experts received
        for every fed token (dense layers 0; K the largest, -1 past a layer's own).

        Returns:
            int32 [B, S_fed, num_hidden_layers, K].

        Raises:
            ValueError: when nothing was captured or the forwards' batch sizes differ.
        """
        K = max((s.shape[2] for v in self._steps.values() for s in v), default=0)
        return _stack(self._steps, self.num_hidden_layers, K)

    def remove(self) -> None:
        """Removes the hooks (idempotent); the captured ids stay."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def experts_modules(model: torch.nn.Module, layers=None, blocks=None
                    ) -> tuple[dict[int, torch.nn.Module], dict[int, torch.nn.Module], int]:
    """The modules an ExpertsCapture hooks: the experts module (transformers' experts interface)
    and the decoder layer of each decoder layer that has one, found once by name
    (``layers.<n>``) so that a Patch capturing at every forward scans its model once.

    Args:
        model: a transformers model.
        layers: the decoder layers to take (None: all).
        blocks: the names of the modules whose experts to take (the MoE blocks of the patched
            routers; another modality's experts beside them are left out), or None: all.

    Returns:
        ({layer: experts module}, {layer: decoder layer module}, num_hidden_layers of the
        config).

    Raises:
        ValueError: for several experts modules in one decoder layer, or none in the model.
    """
    experts, decoders = {}, {}
    for name, mod in model.named_modules():
        mt = list(LAYER_RE.finditer(name))
        if not mt:
            continue
        layer = int(mt[-1].group(1))
        if layers is not None and layer not in layers:
            continue
        if is_experts(mod):
            if blocks is not None and name.rsplit(".", 1)[0] not in blocks:
                continue  # another modality's experts, beside the patched router's
            if layer in experts:
                raise ValueError(f"[hf.capture_experts] several experts modules in decoder "
                                 f"layer {layer} (several decoder stacks: capture the text "
                                 "model)")
            experts[layer] = mod
        elif name == name[:mt[-1].end(1)]:  # the decoder layer itself
            decoders[layer] = mod
    if not experts:
        raise ValueError(f"[hf.capture_experts] no experts module of transformers' experts "
                         f"interface in {type(model).__name__} (under 'layers.<n>')")
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return experts, decoders, int(getattr(cfg, "num_hidden_layers", max(experts) + 1))


def capture_experts(model: torch.nn.Module) -> ExpertsCapture:
    """Starts observing the ids every experts module of ``model`` receives (transformers' experts
    interface), for any MoE family, patched or not (refused ones too). Use as a context manager;
    ``ids()`` gives int32 [B, S_fed, num_hidden_layers, K].

    Args:
        model: a transformers model.

    Returns:
        ExpertsCapture.

    Raises:
        ValueError: when the model has no experts module of the interface.
    """
    return ExpertsCapture(model)


class Capture:
    """Route capture over forwards (a whole ``generate()``: prefill and every decode step).

    Every forward of a MoE layer appends its ids as [B, S, K]; the steps are concatenated along S,
    so token s of row b is the s-th token that row fed to the model. The layer dimension of what it
    returns is the Patch's ``num_route_layers``: num_hidden_layers, except for a family whose
    decoder layer routes several times (JetMoE: decoder layer i's attention experts' router at 2i,
    its MLP experts' router at 2i + 1) or that runs layers in several passes (Inkling2-Loop: each
    (pass, layer) in forward order). Made by ``Patch.capture()``
    (use it as a context manager), not directly. ``ids()`` and the methods built on it raise
    ValueError when nothing was captured or the captured forwards have different batch sizes (capture one
    ``generate()`` call at a time)."""

    def __init__(self, owner, experts=None, experts_off=False):
        self._owner = owner
        self._experts_scan = experts  # experts_modules(...) of the owner's layers, False: none
        self._experts_off = experts_off  # Patch.capture(experts=False)
        self._steps = {layer: [] for layer in owner.layers}
        self._native = {layer: [] for layer in owner.layers}  # the routers' own choices
        self._forwards = []  # forwards' entries not yet placed in _steps (add_forward)
        self.active = False
        """True while capturing (between Patch.capture() and the end of the ``with`` block)."""
        self._had_generate = False
        self._orig_generate = None
        self._refeed = False  # inside generate(use_cache=False): each forward re-feeds all tokens
        self._generated = False  # a generate() ran under this capture (its final token unfed)
        self._experts = None  # ExpertsCapture over the patched layers (start)
        self.num_split_forwards = 0
        """MoE layer forwards whose block split the tokens between two routers (spec.split_by:
        ERNIE-4.5-VL's vision tokens), counted by the patched routers."""

    def start(self) -> None:
        """Starts capturing: the model's ``generate()`` is wrapped (beam search refused) until
        ``stop()``. Called by ``Patch.capture()``."""
        m = self._owner.model
        if callable(getattr(m, "generate", None)):
            self._had_generate = "generate" in m.__dict__
            self._orig_generate = m.__dict__.get("generate")
            m.generate = self._generate  # an instance attribute, removed when the capture stops
        if self._experts_scan is False:  # a family whose experts are not transformers' interface
            self._experts = None
        elif self._experts_scan is not None:
            self._experts = ExpertsCapture(m, scan=self._experts_scan)
        else:
            try:
                self._experts = ExpertsCapture(m, layers=set(self._owner.layers),
                                               blocks=self._owner.router_blocks())
            except ValueError:  # (Llama-4)
                self._experts = None
        self.active = True

    def stop(self) -> None:
        """Stops capturing (idempotent): the model's ``generate()`` is restored and the Patch
        runs no capture any more if this was its running one. What leaving the ``with`` block
        does."""
        self.active = False
        if self._experts is not None:
            self._experts.remove()
        m = self._owner.model
        if getattr(m.__dict__.get("generate"), "__self__", None) is self:
            if self._had_generate:
                m.generate = self._orig_generate
            else:
                m.__dict__.pop("generate", None)
        if self._owner.running_capture is self:
            self._owner.stop_capture()

    def _generate(self, *args, **kwargs):
        """The model's generate() while capturing: beam search and the generate paths whose
        forwards do not follow the returned sequences refused before any forward; without a KV
        cache (use_cache=False) every step re-feeds the whole sequence, and only the columns it
        adds are kept (``append``)."""
        model = self._owner.model
        cfgs = [a for a in args if hasattr(a, "num_beams")]
        cfg = kwargs.get("generation_config") or (cfgs[0] if cfgs else None) or \
            getattr(model, "generation_config", None)

        def setting(name, default=None):
            v = kwargs.get(name)
            return v if v is not None else getattr(cfg, name, default)
        num_beams = setting("num_beams", 1)
        if num_beams is not None and int(num_beams) > 1:
            raise ValueError(f"[hf.capture] generate() with num_beams={int(num_beams)}: beam "
                             "search reorders the beams at every step, so the captured routes "
                             "would not follow the returned sequences; capture supports greedy "
                             "search and sampling (num_beams=1)")
        for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit",
                     "custom_generate"):
            if setting(name) is not None:
                raise ValueError(f"[hf.capture] generate() with {name}={setting(name)!r}: "
                                 "assisted / speculative decoding runs forwards over tokens it "
                                 "then drops (and custom decoding loops are unknown to capture), "
                                 "so the captured routes would not follow the returned "
                                 "sequences; capture supports greedy search and sampling, with "
                                 "or without a KV cache (use_cache)")
        self._place()  # (before the refeed rule applies to this call's steps)
        self._refeed = setting("use_cache", True) is False
        if self._experts is not None:
            self._experts.refeed = self._refeed
        self._generated = True
        try:
            if self._orig_generate is not None:
                return self._orig_generate(*args, **kwargs)
            return type(model).generate(model, *args, **kwargs)
        finally:
            self._refeed = False
            if self._experts is not None:
                self._experts.refeed = False

    def add_forward(self, entries: list[tuple]) -> None:
        """Appends one forward's ids of its MoE layers, each as ``append`` would, placed when the
        capture is next read (a gradient-free forward's routers hand on the router's own id
        tensors: one list append per forward instead of a reshape and two appends per layer
        inside the forward; the layers' ids are what the experts received either way).

        Args:
            entries: one tuple per router call, in forward order, whose first four items are an
                object with the route layer as ``layer`` (one of ``Patch.layers``), the ids [T, K]
                (as ``append``'s ``ids32``), T and the decoder layer's input shape without its
                hidden dimension (as ``append``'s ``batch_shape``). Kept as given until placed.
        """
        if self._refeed:  # (generate(use_cache=False) checks each step against the captured;
            # _generate placed the forwards kept before it)
            for e in entries:
                self._append(e[0].layer, e[1], e[3], e[2], None)
        else:
            self._forwards.append(entries)

    def _place(self) -> None:
        """Places the forwards add_forward kept, in order, before anything reads or appends
        (nothing when none is kept)."""
        if not self._forwards:
            return
        forwards, self._forwards = self._forwards, []
        for entries in forwards:
            for e in entries:
                self._append(e[0].layer, e[1], e[3], e[2], None)

    def append(self, layer: int, ids32: torch.Tensor, batch_shape: tuple[int, ...] | None,
               num_tokens: int, native32: torch.Tensor | None = None) -> None:
        """Appends one forward's ids of one MoE layer (called by the patched router).

        Args:
            layer: the route layer (one of ``Patch.layers``: the decoder layer's number, or
                R·layer + site for JetMoE).
            ids32: [T, K], the ids the forward routed: int32 on the CPU, or the router's own
                id tensor (an integer dtype, left unchanged until the capture is read: ids()
                converts every step to int32 on the CPU).
            batch_shape: the decoder layer's input shape without its hidden dimension ((B, S),
                or (B, S, streams)), or None (taken as (1, T)).
            num_tokens: T.
            native32: [T, K], the router's own top-k where it differs from ``ids32`` (a
                replayed forward; int32 on the CPU, or the router's own id tensor, converted when
                read as ``ids32``), or None (equal).

        Raises:
            ValueError: under generate(use_cache=False), for a step that does not extend the
                captured sequences.
        """
        self._place()
        self._append(layer, ids32, batch_shape, num_tokens, native32)

    def _append(self, layer, ids32, batch_shape, num_tokens, native32):
        T = num_tokens
        batch_shape = _batch_shape(batch_shape, T)
        # (reshape: a router's own id tensor, kept as it is, may be a strided view)
        step = ids32.reshape(batch_shape[0], batch_shape[1], -1)
        nat = step if native32 is None else native32.reshape(step.shape)
        steps = self._steps[layer]
        if self._refeed and steps:
            # generate(use_cache=False): this forward re-fed the whole sequence so far; its new
            # columns are those past the ones captured (the earlier ones were routed before).
            have = sum(s.shape[1] for s in steps)
            if step.shape[0] != steps[0].shape[0] or step.shape[1] <= have:
                raise ValueError(f"[hf.capture] generate(use_cache=False): a step fed "
                                 f"{list(step.shape[:2])} tokens after {have} were captured: "
                                 "it does not extend the sequences, the routes cannot be placed")
            step, nat = step[:, have:], nat[:, have:]
        steps.append(step)
        self._native[layer].append(nat)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    @property
    def num_forwards(self) -> int:
        """Forwards captured so far (the prefill and each decode step of a generate())."""
        self._place()
        return max((len(v) for v in self._steps.values()), default=0)

    def ids(self) -> torch.Tensor:
        """[B, S_fed, num_route_layers, K] int32: every fed token's ids, dense layers 0.

        Returns:
            int32 [B, S_fed, num_route_layers, K].

        Raises:
            ValueError: when nothing was captured or the forwards' batch sizes differ.
        """
        return self._stacked(self._steps)

    def native_ids(self) -> torch.Tensor:
        """The ids each router chose itself (its live top-k), also where a replayed row used other
        ids (``ids()``); equal to ``ids()`` where nothing was replayed. What a router mismatch is
        measured against.

        Returns:
            int32 [B, S_fed, num_route_layers, K], dense layers 0.

        Raises:
            ValueError: as ``ids()``.
        """
        return self._stacked(self._native)

    def moe_ids(self, native: bool = False) -> torch.Tensor:
        """The captured ids in ``Patch.set_targets``' layout: the patched route layers only, in
        the order of ``Patch.layers`` (``ids()`` has every route layer, dense ones 0). Cheaper
        than ``ids()[:, :, layers]`` (no dense table is made).

        Args:
            native: False: the ids the routers routed (``ids()``); True: each router's own choice
                (``native_ids()``).

        Returns:
            int32 [B, S_fed, moe_layers, K], -1 past a layer's own K.

        Raises:
            ValueError: as ``ids()``.
        """
        self._place()
        per = _host_layers(self._native if native else self._steps)
        K = self._owner.top_k
        return torch.stack([t if t.shape[2] == K else torch.cat(
            [t, t.new_full(t.shape[:2] + (K - t.shape[2],), -1)], dim=2)
            for t in (per[layer] for layer in self._owner.layers)], dim=2)

    def expert_ids(self) -> torch.Tensor:
        """The ids the experts modules of the patched layers received (transformers' experts
        interface), laid out as ``ids()``: equal to it wherever the experts ran the patched
        router's choice (a replayed forward included), except where the family's block rewrites
        the ids (LongCat-Flash hands a zero-compute expert's slot to its experts as a dummy routed
        id with weight 0).

        Returns:
            int32 [B, S_fed, num_hidden_layers, K], dense layers 0.

        Raises:
            ValueError: as ``ids()``; also for a family whose experts are not transformers'
                experts interface (Llama-4's take the router-scaled input only), and after a
                forward that split its tokens between two expert sets (ERNIE-4.5-VL's vision
                tokens).
        """
        if self._experts_off:
            raise ValueError("[hf.Capture] this capture was started with capture(experts=False): "
                             "the experts modules were not observed")
        if self._experts is None and self._owner.loop is not None:
            first, end, passes = self._owner.loop
            raise ValueError(f"[hf.Capture] {self._owner.family}: the experts of decoder layers "
                             f"{first}..{end - 1} run once per pass ({passes} per forward), "
                             "observed per decoder layer: their ids cannot be placed in the "
                             "route layers; ids() holds every pass's route")
        if self._experts is None:
            raise ValueError(f"[hf.Capture] the experts of {self._owner.family} are not "
                             "transformers' experts interface: their ids cannot be observed")
        if self.num_split_forwards:
            raise ValueError(f"[hf.Capture] {self._owner.family}: {self.num_split_forwards} "
                             "captured MoE layer forwards split their tokens between two expert "
                             "sets (vision tokens); expert_ids() observes the first set's "
                             "experts only, ids() holds every token's route")
        return _stack(self._experts._steps, self._owner.num_hidden_layers, self._owner.top_k)

    def _stacked(self, per_layer: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        self._place()
        o = self._owner
        return _stack(per_layer, o.num_route_layers, o.top_k)

    def routed_experts(self, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """vLLM's ``routed_experts`` per sequence: a list of int32 tensors
        [num_tokens - 1, num_route_layers, K] (dense layers 0; the last token, never fed, has no
        route). ``attention_mask`` [B, S_out] (any integer / bool dtype, nonzero = real token) of
        the generated sequences (prompt + new tokens, S_out = fed tokens + 1) or of the fed tokens
        (S_out = fed tokens); None = every fed token is real, all rows kept. A sequence that ended
        early fed its last token too: that row is dropped, as vLLM never routes the last token.
        With a mask of the fed tokens, a capture over ``generate()`` keeps the last fed row of a
        sequence real at the last column (its final token was generated, never fed), and a
        capture of plain forwards drops every sequence's last real row (it was fed)
        (switchyard.routes.routed_experts with ``final_token_fed``).

        Args:
            attention_mask: [B, S_out] or [B, S_fed] (nonzero = real token), or None.

        Returns:
            list of int32 [num_tokens - 1, num_route_layers, K].
        """
        # One implementation of vLLM's layout: switchyard.routes.routed_experts. A capture of
        # plain forwards fed each sequence's last token; one over generate() never fed the final
        # generated token.
        return syr.routed_experts(self.ids(), attention_mask,
                                  final_token_fed=not self._generated)

    def to_verl(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """verl's ``routed_experts`` batch layout: int16 [B, S_out, num_route_layers, K] over the
        generated sequences' positions (``attention_mask`` [B, S_out]), zero filled at padding, on
        dense layers and at each sequence's last token (which has no route), vLLM's routes at the
        other real tokens. ``Patch.targets_from_verl`` reads it back. ValueError when the mask's
        real tokens do not match the captured sequences.

        Args:
            attention_mask: [B, S_out] (nonzero = real token).

        Returns:
            int16 [B, S_out, num_route_layers, K].
        """
        m = torch.as_tensor(attention_mask).to("cpu").bool()
        tables, rep = self.tables(m)
        # One implementation of verl's layout: switchyard.routes.to_verl (from_verl's inverse).
        out, _ = syr.to_verl(tables, rep["moe_layers"], self._owner.num_route_layers,
                             attention_mask=m, num_experts=self._owner.num_experts)
        return out

    def save_npy(self, directory: str | os.PathLike, attention_mask: torch.Tensor | None = None,
                 prefix: str = "seq") -> list[str]:
        """Writes one .npy per sequence (vLLM's routed_experts, int32), the files the vLLM
        importer and ``switchyard routes import-vllm`` read (``<directory>/<prefix><i>.npy``, the
        directory created if missing); returns their paths. ``attention_mask`` as
        ``routed_experts``.

        Args:
            directory: where the files go (made if missing).
            attention_mask: as ``routed_experts``.
            prefix: the files' name prefix.

        Returns:
            list of the paths written.
        """
        import numpy as np
        os.makedirs(directory, exist_ok=True)
        paths = []
        for i, a in enumerate(self.routed_experts(attention_mask)):
            paths.append(os.path.join(str(directory), f"{prefix}{i}.npy"))
            np.save(paths[-1], a.numpy())
        return paths

    def tables(self, attention_mask: torch.Tensor | None = None) -> tuple[list[torch.Tensor], dict]:
        """switchyard route tables (int32 [num_tokens, moe_layers, K], last token -1), through the
        vLLM importer with the model's layer map. Returns (tables, report dict);
        ``attention_mask`` as ``routed_experts``.

        Args:
            attention_mask: as ``routed_experts``.

        Returns:
            (tables, report dict).

        Raises:
            ValueError: when the MoE layers route to different K (use ``ids()``), or as
                ``routed_experts``.
        """
        ks = self._owner.top_ks
        if len(set(ks.values())) > 1:
            raise ValueError(f"[hf.Capture] the MoE layers route to different K ({ks}): route "
                             "tables and files hold one K per layer stack with no -1 beside "
                             "ids; use ids() (-1 past a layer's own K) with Patch.set_targets")
        return self._owner.tables_from_vllm(self.routed_experts(attention_mask),
                                            zero_rows="keep")

    def write(self, path: str | os.PathLike, attention_mask: torch.Tensor | None = None,
              compression_level: int = 3) -> int:
        """Writes the captured sequences (``tables(attention_mask)``) to a route file at ``path``,
        committed atomically (switchyard.routes.write); returns the bytes written.

        Args:
            path: the route file.
            attention_mask: as ``routed_experts``.
            compression_level: zstd's level.

        Returns:
            int, the bytes written.
        """
        tables, _ = self.tables(attention_mask)
        return syr.write(path, tables, self._owner.num_experts, moe_layers=self._owner.layers,
                         compression_level=compression_level)
