"""switchyard.integrations.hf.patch: ``patch()`` installs switchyard's router forward on every MoE
router of a transformers model (``_Layer``: one patched MoE layer, its replay queue and counts),
``Patch`` drives replay and capture and undoes the patch; the transformers version check. See the
package docstring."""
import collections
import contextlib
import copy
import inspect
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

import switchyard as sy
from switchyard import _ids
from switchyard import _torch_ops as _ops
from switchyard import replay as _replay
from switchyard import routes as syr

from .._adapter import check_version, routed_tokens
from .capture import LAYER_RE, Capture, experts_modules, is_experts
from .families import FAMILIES, _family_of, _gate
from .spec import REFUSED, REFUSED_ROUTERS

MIN_TRANSFORMERS_VERSION = "5.24.0"
"""Oldest transformers release this integration was checked against (router classes and the exact
routing math of every family in spec.py were read from it)."""
SUPPORTED_TRANSFORMERS_VERSIONS = ((5, 24), (5, 25))
"""Tested transformers releases, (major, minor) oldest and newest, any patch release: 5.24 to
5.25.x. ``patch()`` refuses an older release and another major version (which passes, with a
warning, under SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1). A later 5.x minor is patched without a
warning: what can change there is caught per router (a router class no spec covers, in a layer
whose experts switchyard would not route, is refused by name)."""


# --------------------------------------------------------------------------------------------------
# One patched MoE layer
# --------------------------------------------------------------------------------------------------
class _Layer:
    def __init__(self, owner, layer, name, router, decoder_layer, family, block=None):
        self.owner = owner
        self.layer = layer
        self.name = name
        self.router = router
        self.decoder_layer = decoder_layer
        self.family = family
        self.block = block  # the MoE block holding the router
        family.spec_for(router)  # a variant the spec does not list: refused before any change
        self.num_experts = family.num_experts(router, block)
        self.top_k = family.top_k(router, block)  # this layer's K (HunYuan's differs per layer)
        self.replay = sy.RouterReplay(self.top_k, layer=layer,
                                      invalid_replay_rows=owner.invalid_replay_rows,
                                      num_experts=self.num_experts)
        self.will_recompute = False
        self.batch_shape = None
        # spec.split_by (ERNIE-4.5-VL): the layer's other router (a _Layer of the same route
        # layer), which one this is (0: the first, 1: the second); on the first, the tokens of the
        # second in this forward ([T] bool, set by the block's pre-hook; None: all the first's)
        # and the state of a forward split between them (_route_split).
        self.pair = None
        self.part = 0
        self.split_mask = None
        self._split = None
        self._split_arg = None  # (argument name, its position in the block's forward)
        self._split_block = None  # the module whose forward splits the tokens
        self._split_hook = None
        # spec.loop (Inkling2-Loop): a loop layer's router routes once per pass, each pass a
        # _Layer of its own route layer sharing the router. The first pass's _Layer installs the
        # forward and the hooks; its ``passes`` lists every pass's _Layer, ``current_pass`` is
        # the pass of the call under way (set by _pass_pre_hook); the others' ``loop_first`` is
        # the first's.
        self.passes = None
        self.loop_first = None
        self.current_pass = 0
        self._pass_hook = None
        # A family whose router's own forward routes as the generic one (Family.own_forward_routes)
        # and that routes in training mode too: its gradient-free native forwards take the fast
        # path of forward().
        self.fast_native = family.own_forward_routes and family.spec.train_refused is None
        # ... and one whose generic forward needs nothing per call beyond the gate and the route
        # (no jitter, carried state, gate module, route method, split or loop): the fast path of
        # a router_dtype forward.
        sp = family.spec
        self.fast_generic = sp.train_refused is None and sp.returns != "logits" and \
            sp.input_jitter is None and sp.carried_state is None and sp.gate_module is None and \
            sp.split_by is None and sp.loop is None
        self.counts = _replay.ReplayCounts()  # forwards (the replay core's one count record)
        self.num_recomputed_rows = 0  # rows a recompute inside backward replayed
        # Compiled forwards (see _traced_state): the head of the replay queue as tensors, staged
        # before the forward by Patch._sync_traced, and the counts of natively routed compiled
        # forwards kept as a tensor (no symbolic size enters Python state).
        self.staged_rows = None        # the ReplayRows staged (None: nothing staged)
        self.staged_replay = None      # (ids int64 [T, K], replayed bool [T]) on the router's device
        self.traced_counts = torch.zeros(len(_TRACED_COUNTS), dtype=torch.int64)
        # Record and capture in compiled forwards: the ids leave the graph through the
        # switchyard::route_sink operator to _on_traced_ids (registered by ensure_sink).
        self.sink_key = None
        self.sink_token = torch.empty(0)
        self._hook = None
        self._had_instance_forward = "forward" in router.__dict__
        self._orig_forward = router.__dict__.get("forward")
        # A family whose router returns logits only (DBRX): the block's route method is patched too.
        self._route_method = family.spec.route_method
        self._had_route = self._route_method is not None and self._route_method in block.__dict__
        self._orig_route = block.__dict__.get(self._route_method) if self._route_method else None
        self._hidden_dtype = None  # the router's last input dtype (for the route method)

    def reset_counts(self):
        self.counts = _replay.ReplayCounts()
        self.num_recomputed_rows = 0
        self.traced_counts.zero_()

    def all_counts(self):
        """The counts of eager and compiled forwards together (a ReplayCounts)."""
        c = copy.copy(self.counts)
        native, calls = self.traced_counts.tolist()
        if calls:  # (compiled forwards ran)
            c.add(_replay.ReplayCounts(calls=calls, tokens=native, native=native))
        return c

    def install(self):
        # A bound method, not a closure: copy.deepcopy of the model copies this _Layer with it (its
        # router, replay and Patch), so the copy's router runs its own forward.
        if self.loop_first is not None:
            return  # a later pass of a loop layer: its first pass's _Layer patched the router
        self.router.forward = self.forward
        if self._route_method is not None:
            setattr(self.block, self._route_method, self.route_logits)
        if self.decoder_layer is not None:
            self._hook = self.decoder_layer.register_forward_pre_hook(self._pre_hook,
                                                                      with_kwargs=True)
        if self.passes is not None:
            module, _ = self.family.spec.loop_pass_arg
            self._pass_hook = self.decoder_layer.get_submodule(module).register_forward_pre_hook(
                self._pass_pre_hook, with_kwargs=True)
        if self.pair is not None and not self.part:
            self.pair.install()
            self._split_hook = self._split_block.register_forward_pre_hook(self._split_pre_hook,
                                                                           with_kwargs=True)

    def pair_with(self, name, router, split_block, block):
        """Makes router ``name`` the second router of this route layer (spec.split_by): a _Layer
        of the same key that routes the tokens ``split_block``'s argument sends it. ValueError
        when its E or K differ from this router's (one route table holds both)."""
        arg = self.family.spec.split_by[0]
        second = _Layer(self.owner, self.layer, name, router, None, self.family, block)
        if (second.num_experts, second.top_k) != (self.num_experts, self.top_k):
            raise ValueError(f"[hf.patch] {self.family.name}: routers {self.name} and {name} share "
                             f"route layer {self.layer} but route to E={self.num_experts}, "
                             f"K={self.top_k} and E={second.num_experts}, K={second.top_k}")
        params = list(inspect.signature(type(split_block).forward).parameters)[1:]
        second.pair, second.part, self.pair = self, 1, second
        self._split_arg = (arg, params.index(arg) if arg in params else None)
        self._split_block = split_block

    def add_passes(self, keys):
        """Makes this loop layer's router (spec.loop) route once per pass: a _Layer of route
        layer ``keys[q - 1]`` for each later pass q, sharing the router (its forward dispatches
        by the pass, _pass_pre_hook)."""
        later = [_Layer(self.owner, k, self.name, self.router, None, self.family, self.block)
                 for k in keys]
        for l in later:
            l.loop_first = self
        self.passes = [self, *later]
        return later

    def _pass_pre_hook(self, module, args, kwargs):
        # Runs inside the loop decoder layer's forward, before its router, so also in the
        # checkpoint recompute (whose decoder-layer hooks do not run): the pass is read from the
        # call's own argument, the offset of the pass's cache layer (layer + offset: the layer in
        # the first pass, num_hidden_layers + (pass - 1)·L + (layer - first) after), not from the
        # order of the calls (backward recomputes the passes last first).
        module_name, arg = self.family.spec.loop_pass_arg
        off = kwargs.get(arg)
        first, end, P = self.owner._loop
        L, N, i = end - first, self.owner.num_hidden_layers, self.layer
        c = i + off if isinstance(off, int) else None
        q = None if c is None else 0 if c == i else (c - N - (i - first)) // L + 1
        if q is None or not 0 <= q < P or (q and c != N + (q - 1) * L + (i - first)):
            raise ValueError(f"[hf] {self.family.name}: loop layer {i}'s {module_name} call got "
                             f"{arg}={off!r}, which is none of its {P} passes' (layer + {arg} = "
                             f"{i}, or {N} + (pass - 1)·{L} + {i - first}): the pass it routes "
                             "in is unknown (a transformers release that runs its loop "
                             "otherwise)")
        self.current_pass = q
        target = self.passes[q]
        if target is not self and not _replay.in_recompute():
            # the decoder layer's pre-hook state (outside the checkpoint) goes to this pass
            target.will_recompute, target.batch_shape = self.will_recompute, self.batch_shape
            self.will_recompute, self.batch_shape = False, None

    def _split_pre_hook(self, module, args, kwargs):
        # The block's forward is called inside the decoder layer's, so this runs in a checkpoint
        # recompute too: the recompute splits its tokens as its forward did. Where the argument
        # holds a nonzero value the block routes those tokens through the second router (the
        # family's own test: the argument given and any() of it).
        arg, i = self._split_arg
        t = args[i] if i is not None and len(args) > i else kwargs.get(arg)
        if not isinstance(t, torch.Tensor):
            self.split_mask = None
            return
        # Under torch.compile the split is refused: traced, or run eagerly after a graph break
        # (dynamo's fallback for this frame: no eager step of the model began, the step's queue
        # and counts are the compiled forward's).
        if torch.compiler.is_compiling() or not (
                _replay.in_recompute() or self.owner._running.get(threading.get_ident())):
            raise ValueError(f"[hf] {self.family.name}: a forward with {arg} whose MoE block runs "
                             "outside an eager forward of the model (torch.compile / "
                             "torch.export, or a decoder layer called on its own): the block "
                             "splits the tokens between its routers by a data-dependent mask "
                             "(transformers' own code breaks the graph there too); run forwards "
                             "with token types eagerly")
        self.split_mask = t.bool().reshape(-1) if bool(t.any()) else None

    @property
    def installed(self) -> bool:
        """Whether the router's forward is still this layer's (not unpatched, not replaced by a
        newer Patch)."""
        first = self.loop_first or self  # a later pass runs its first pass's forward
        return _owner_of(self.router.__dict__.get("forward")) is first

    def uninstall(self):
        if self.loop_first is not None:
            return  # its first pass's _Layer restores the router
        if self._pass_hook is not None:
            self._pass_hook.remove()
            self._pass_hook = None
        if self.installed:  # a newer Patch's forward stays where it is
            if self._had_instance_forward:
                self.router.forward = self._orig_forward
            else:
                self.router.__dict__.pop("forward", None)
            if self._route_method is not None:
                if self._had_route:
                    setattr(self.block, self._route_method, self._orig_route)
                else:
                    self.block.__dict__.pop(self._route_method, None)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.pair is not None and not self.part:
            self.pair.uninstall()
            if self._split_hook is not None:
                self._split_hook.remove()
                self._split_hook = None

    def _pre_hook(self, module, args, kwargs):
        # Runs in the decoder layer's __call__, outside the checkpointed forward, so once per real
        # forward: the condition under which transformers checkpoints the layer. A traced forward
        # queues nothing for its recompute (switchyard.replay.in_recompute).
        p = self.owner._pending
        if p is not None and p.plain and p.ident == threading.get_ident():
            self.will_recompute = False  # a gradient-free forward (Patch._step_begins decided it)
        elif torch.compiler.is_compiling() and self.replay.action != "record" and \
                self.owner._capture is None:
            return
        else:
            # (will_recompute(checkpoint=False) is False: asked only of a checkpointing layer)
            self.will_recompute = torch.is_grad_enabled() and module.training and \
                bool(getattr(module, "gradient_checkpointing", False)) and \
                _replay.will_recompute(checkpoint=True)
        h = args[0] if args else kwargs.get("hidden_states")
        self.batch_shape = tuple(h.shape[:-1]) if isinstance(h, torch.Tensor) else None

    # ---- the patched router forward ----
    def forward(self, hidden_states, *passed, **named):
        """The router's forward: the gate (router_dtype, or the family's own), then the family's
        routing with replay, record and capture. ``passed``: what the block passes after the hidden
        states (a correction bias, input_ids); ``named``: its keyword arguments (a carried router
        state)."""
        owner = self.owner
        p = owner._pending
        if p is not None and p.plain and not named and p.ident == threading.get_ident() and \
                not hidden_states.is_meta:
            # A gradient-free forward of the decoder stack that replays nothing (a generate()
            # step): what the checks below decide per call was decided once for the forward
            # (Patch._step_begins); the ids are handed on with the forward's others
            # (Patch._step_ends).
            if owner.router_dtype is None and self.fast_native:
                out = self._own_forward()(hidden_states, *passed)  # the family's own dtypes
                return self._fast_done(p, out[2], out)
            if owner.router_dtype is not None and self.fast_generic:
                return self._fast_generic(p, hidden_states, passed)
        if self.passes is not None:  # a loop layer: the _Layer of the pass under way routes
            q, self.current_pass = self.current_pass, 0
            if q:
                return self.passes[q].forward(hidden_states, *passed, **named)
        fam, r = self.family, self.router
        if named and fam.spec.carried_state is None:
            raise TypeError(f"[hf] {fam.name}: {fam.router_class}.forward() got unexpected keyword "
                            f"arguments {sorted(named)}")
        fam.check_mode(r)
        # (Not in a forward that will be recomputed: its recompute replays the queued ids through
        # the generic forward, which must save the same tensors as the forward did.)
        if owner.router_dtype is None and fam.own_forward_routes and self.pair is None and \
                self.replay.action in (None, "record") and not self.will_recompute and \
                not torch.compiler.is_compiling() and hidden_states.device.type != "meta" and \
                not _replay.in_recompute():
            return self._native_forward(hidden_states, passed, named)
        jitter = fam.spec.input_jitter
        if jitter is not None and r.training and getattr(r, jitter) is not None:
            eps = getattr(r, jitter)  # the family's own training jitter, in place as it does
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - eps, 1.0 + eps)
        x = fam.gate_input(r, hidden_states)  # [T, H], after the family's own ops (Gemma-4's norm)
        native = owner.router_dtype is None
        self._hidden_dtype = hidden_states.dtype
        meta = x.device.type == "meta"  # shape inference: autocast has no meta device
        with _NULL if native or meta else _autocast_off(x.device.type):
            with fam.native_context(r, x) if native and not meta else _NULL:
                if native or meta:
                    logits = (fam.native_logits(r, x) if native else
                              _gate(x, *fam.params(r), owner.router_dtype, "torch"))
                else:
                    w, b = fam.params(r)
                    logits = _gate(x, w, b, owner.router_dtype, owner.gate)
            logits = fam.logits(r, logits)
            state = None
            if fam.spec.gate_module is not None:  # the gate's output through the family's module
                logits, state = fam.module_logits(r, logits, hidden_states, passed, named, native)
        if fam.spec.returns == "logits":
            return logits  # the block's route method (route_logits) routes them
        if fam.spec.carried_state is not None:  # the next layer's router state, after the route
            return (*self._route(logits, hidden_states, passed), state)
        return self._route(logits, hidden_states, passed)

    def _fast_generic(self, p, hidden_states, passed):
        """forward() in router_dtype of a gradient-free stack forward that replays nothing
        (Patch._step_begins decided it): the gate, then the family's routing of every row, as
        the generic forward does with no row replayed."""
        owner, fam, r = self.owner, self.family, self.router
        x = fam.gate_input(r, hidden_states)
        self._hidden_dtype = hidden_states.dtype
        scores = []  # (grad is off: the router's returned scores may be the routing's own)
        with _autocast_off(x.device.type):
            w, b = fam.params(r)
            logits = fam.logits(r, _gate(x, w, b, owner.router_dtype, owner.gate))
            weights, ids = fam.route(r, logits, None, None, passed, self.block, scores_out=scores)
        self.staged_rows = self.staged_replay = None  # (as _take: nothing staged is used)
        return self._fast_done(p, ids, fam.outputs(r, logits, weights, ids, hidden_states, False,
                                                   scores[0] if scores else None))

    def _fast_done(self, p, ids, out):
        T = ids.shape[0]
        self.counts.add_native(T)
        if p.keep:
            p.entries.append((self, ids, T, self.batch_shape, False, None))
        self.will_recompute, self.batch_shape = False, None
        return out

    def _native_forward(self, hidden_states, passed, named):
        """A forward that routes natively with the family's own dtypes, replays nothing and is
        not checkpointed for a recompute: the router's own forward (the output router_dtype=None
        must give bit for bit, by construction), its ids counted, recorded and captured as
        _route's are. About half the Python of the generic routed forward per call, which is most
        of a generation's router calls."""
        out = self._own_forward()(hidden_states, *passed, **named)
        ids = out[2]
        T = ids.shape[0]
        self.staged_rows = self.staged_replay = None  # (as _take: nothing staged is used)
        self.counts.add_native(T)
        self._after_forward(ids, T)
        return out

    def _own_forward(self):
        """The router's own forward (bound): its instance forward from before the patch, or its
        class's."""
        return self._orig_forward if self._had_instance_forward else \
            type(self.router).forward.__get__(self.router)

    def route_logits(self, router_logits):
        """The block's route method of a family whose router returns logits only (DBRX):
        (weights, ids) from the patched router's logits."""
        dtype = self._hidden_dtype or router_logits.dtype
        return self._route(router_logits, router_logits.new_empty((0,), dtype=dtype), ())

    def _route(self, logits, hidden_states, passed):
        owner, fam, r = self.owner, self.family, self.router
        T = logits.shape[0]
        native = owner.router_dtype is None
        if logits.device.type == "meta":
            # Shape inference / deferred init: the family's math on meta tensors (autocast has no
            # meta device, the engine needs data); no replay, record or capture.
            weights, ids = fam.route(r, logits, None, None, passed, self.block)
            return fam.outputs(r, logits, weights, ids, hidden_states, native)
        if self.pair is not None and (self.part or self.split_mask is not None):
            return self._route_split(logits, hidden_states, passed)  # (ERNIE-4.5-VL's vision)
        recompute = _replay.in_recompute()  # the checkpoint recompute of this forward
        traced = torch.compiler.is_compiling()  # torch.compile / torch.export: see _traced_state
        with _NULL if native else _autocast_off(logits.device.type):
            with fam.native_context(r, logits) if native else _NULL:
                if traced:
                    rows = None
                    replay_ids, replay_mask = self._traced_state(T)
                else:
                    rows, replay_ids, replay_mask = self._take(T, recompute, logits.device)
                # The router's own choice (its live top-k), for the mismatch metric of a replayed
                # forward under capture: taken from the routing itself, not routed again.
                live = [] if rows is not None and not recompute and not traced and \
                    owner._capture is not None else None
                weights, ids = fam.route(r, logits, replay_ids, replay_mask, passed, self.block,
                                         live=live, native_rows=None if replay_mask is None or
                                         rows is None else rows.native_rows)
                native_ids = live[0] if live else None
            if traced:
                self._traced_after_forward(ids, T)
            elif not recompute:
                self._after_forward(ids, T, native_ids)
        # Outside the router's autocast-off (as _route_split): what the router hands on runs under
        # the caller's autocast, which matters where it runs the block's experts (spec.inline).
        return fam.outputs(r, logits, weights, ids, hidden_states, native)

    def _take(self, T, recompute, device):
        """(rows, replay ids int64 [T, K], replayed rows bool [T] or None: every row) an eager
        forward (or its checkpoint recompute) of T tokens replays, taken from the layer's queue
        and counted; (None, None, None) where it routes natively."""
        rows = staged = None
        if recompute:
            if self.replay.num_pending_recompute or self.replay.action == "replay_forward":
                rows = self.owner.driver.take_recompute(self.layer, T)
                self.num_recomputed_rows += T
        else:
            if self.replay.action == "recompute":
                raise ValueError(
                    f"[hf] layer {self.layer}: action 'recompute' is not used with "
                    "transformers models: the checkpoint recompute is detected and "
                    "replayed automatically; use 'replay_forward'")
            rows = self.owner.driver.take_forward(self.layer, T)
            if rows is not None and rows is self.staged_rows:
                staged = self.staged_replay  # staged for a compiled forward: the same
            self.staged_rows = self.staged_replay = None  # taken here: restaged later
            if rows is None:  # (in place: no count record made per layer and forward)
                self.counts.add_native(T)
            else:
                self.counts.add_rows(rows)
        if rows is None:
            return None, None, None
        # the core's rows -> the family's (ids, mask) on the device
        if staged is not None and staged[0].device != device:
            staged = None  # staged on another device: converted here
        replay_ids = rows.ids.to(device=device, dtype=torch.int64) if staged is None else staged[0]
        if rows.all_replayed:  # every row (known from the counts: no mask made or read)
            return rows, replay_ids, None
        return rows, replay_ids, rows.replayed.to(device) if staged is None else staged[1]

    def _route_split(self, logits, hidden_states, passed):
        """One router's route in a forward whose block split the tokens between the two routers
        of this route layer (spec.split_by): the first router's call takes the layer's table of
        all T tokens (replay or recompute, counted once) and routes its rows of it; the second's
        routes the others, then hands the layer's ids of all T tokens, in token order, to record,
        capture and the recompute queue, as one router's forward would."""
        owner, fam, r = self.owner, self.family, self.router
        first = self.pair if self.part else self
        mask = first.split_mask
        if mask is None or (self.part and first._split is None):
            raise ValueError(f"[hf] {fam.name}: router {self.name} ran outside its MoE block's "
                             f"split of the tokens ({fam.spec.split_by[0]}): its rows of the "
                             "route layer are unknown")
        native = owner.router_dtype is None
        recompute = _replay.in_recompute()
        T = mask.numel()
        sel = mask if self.part else ~mask
        with _NULL if native else _autocast_off(logits.device.type):
            with fam.native_context(r, logits) if native else _NULL:
                if not self.part:
                    rows, ids_all, replayed_all = self._take(T, recompute, logits.device)
                    live = rows is not None and not recompute and owner._capture is not None
                    first._split = (ids_all, replayed_all, live, [None, None], [None, None])
                ids_all, replayed_all, live, parts, lives = first._split
                own = [] if live else None
                weights, ids = fam.route(r, logits, None if ids_all is None else ids_all[sel],
                                         None if replayed_all is None else replayed_all[sel],
                                         passed, self.block, live=own)
                parts[self.part], lives[self.part] = ids, own[0] if own else None
        if self.part:
            first._split = first.split_mask = None
            if not recompute:
                def whole(a, b):  # the two routers' rows back in token order
                    out = a.new_empty((T, a.shape[1]))
                    out[~mask], out[mask] = a, b
                    return out
                first._after_forward(whole(*parts), T, whole(*lives) if live else None)
                if owner._capture is not None:
                    owner._capture.num_split_forwards += 1
        return fam.outputs(r, logits, weights, ids, hidden_states, native)

    def _traced_state(self, T):
        # The replay state of a forward that torch.compile / torch.export traces: no Python queue
        # is read inside the traced region. The target was staged before the forward as tensors
        # (Patch._sync_traced: the head of this layer's queue), so a new step's targets of the same
        # shape reuse the compiled graph. Nothing is mutated here (the router may run inside a
        # checkpoint, which dynamo traces as one operator without side effects): the model's
        # forward hook takes the staged tables and counts (Patch._traced_step_ends).
        staged = self.staged_replay
        if staged is not None and not torch.compiler.is_exporting():
            ids, mask = staged
            # (dynamo takes a message built from constants only: the counts are not in it)
            msg = (f"[replay] {self.owner.driver.label(self.layer)}: the replay tensor's token "
                   "count is not the router's (set the targets of this forward before it)")
            torch._check(ids.shape[0] == T, lambda: msg)
            return ids, mask
        return None, None

    def ensure_sink(self):
        """Registers this layer's receiver of compiled forwards' ids (again after copy.deepcopy,
        whose copy must not feed the original's capture)."""
        if self.sink_key is None or _ops.route_sink_owner(self.sink_key) is not self:
            self.sink_key = _ops.add_route_sink(self._on_traced_ids)

    def _traced_after_forward(self, ids, T):
        # Record and capture of a traced forward: the ids leave the graph through an operator that
        # runs at every call (no graph break); nothing is queued for a recompute (see
        # switchyard.replay.in_recompute). An exported program keeps no Patch state.
        if not (self.replay.action == "record" or self.owner._capture is not None) or \
                torch.compiler.is_exporting() or self.sink_key is None:
            return
        batch_shape = self.batch_shape
        self.will_recompute, self.batch_shape = False, None
        b, s = batch_shape[:2] if batch_shape is not None and len(batch_shape) >= 2 else (0, T)
        _ops.route_sink(ids, self.sink_token, self.sink_key, b, s)

    def _on_traced_ids(self, ids, batch, seq):
        ids32 = ids.to(device="cpu", dtype=torch.int32).contiguous()
        if self.replay.action == "record":
            self.replay.record(ids32)
        if self.owner._capture is not None:
            self.owner._capture.append(self.layer, ids32, (batch, seq), ids32.shape[0])

    def _after_forward(self, ids, T, native_ids=None):
        # The decoder layer's pre-hook state belongs to this one router call.
        will_recompute, batch_shape = self.will_recompute, self.batch_shape
        self.will_recompute, self.batch_shape = False, None
        owner = self.owner
        if not (will_recompute or owner._capture is not None or self.replay.action == "record"):
            return
        entry = (self, ids, T, batch_shape, will_recompute, native_ids)
        p = owner._pending
        if p is not None and p.ident == threading.get_ident():
            # Inside a forward of the decoder stack: handed on at its end with the other layers'
            # ids, in one host copy (Patch._step_ends).
            p.entries.append(entry)
        else:  # a router called on its own: now
            Patch._hand_on_forward([entry])

    def _hand_on(self, ids32, T, batch_shape, will_recompute, nat32):
        """Records, queues for the recompute and captures one forward's ids ([T, K] int32 or
        int64 on the CPU; nat32 the router's own choice where it differs, or None)."""
        if self.replay.action == "record":
            self.replay.record(ids32)
        if will_recompute:
            self.owner.driver.queue_recompute(self.layer, ids32)  # for the recompute
        if self.owner._capture is not None:
            self.owner._capture.append(self.layer, ids32, batch_shape, T, nat32)


_CORE_IDS = (torch.int32, torch.int64)  # what the replay core's record / queue take as they are


def _core_ids(t):
    """Whether id tensor ``t`` goes on as it is (on the CPU, a dtype the core takes): no host
    copy."""
    return t.is_cpu and t.dtype in _CORE_IDS


def _host_ids(tensors):
    """int32 contiguous CPU copies of the id tensors ``tensors`` (a list): one stacked copy when
    they share shape, dtype and device (one device-to-host transfer for a forward's layers),
    else one each."""
    first = tensors[0]
    if len(tensors) > 1 and all(t.shape == first.shape and t.dtype == first.dtype and
                                t.device == first.device for t in tensors):
        return list(torch.stack(tensors).detach().to(device="cpu", dtype=torch.int32).unbind(0))
    return [t.detach().to(device="cpu", dtype=torch.int32).contiguous() for t in tensors]


class _Pending:
    """The ids of one forward of the decoder stack, handed on at its end (Patch._step_ends):
    the thread running it; whether its routers take the fast path (``plain``: grad disabled, not
    a recompute, no layer replaying) and whether that path keeps its ids (``keep``: a capture
    running or a layer recording); whether only a capture takes them (``capture_only``: plain,
    no layer recording); entries (layer, ids, T, batch shape, will_recompute, native ids or
    None); the frame of the stack module's call (alive while the forward runs: _on_stack)."""
    __slots__ = ("ident", "plain", "keep", "capture_only", "entries", "frame")

    def __init__(self, ident, plain, keep, capture_only, frame):
        self.ident, self.plain, self.keep, self.entries = ident, plain, keep, []
        self.capture_only, self.frame = capture_only, frame


def _on_stack(frame):
    """Whether ``frame`` is one of the calling thread's running frames (the outer stack forward
    a later stack forward of the same thread runs inside)."""
    f = sys._getframe(2)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False



_NARROWED = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def _layer_tables(t, top_ks):
    """The per-layer tables of routes ``t`` [T, M, K]: ``t[:, m, :top_ks[m]]``. A table of ids
    that fit int32 is converted once, layer-major on the CPU, so each layer's rows are a
    contiguous int32 view the row rule takes as it is (one copy instead of one per layer); other
    tables (ids outside int32) are sliced as given, so the row rule names the layer and position."""
    if t.dtype not in _NARROWED or (t.dtype == torch.int64 and
                                    _ids.first_outside(t, -2**31, 2**31 - 1) is not None):
        return [t[:, m, :k] for m, k in enumerate(top_ks)]
    tl = torch.empty((t.shape[1], t.shape[0], t.shape[2]), dtype=torch.int32)
    tl.copy_(t.detach().permute(1, 0, 2))  # (and to the CPU)
    K = t.shape[2]
    return [tl[m] if k == K else tl[m, :, :k] for m, k in enumerate(top_ks)]


def _autocast_off(device_type):
    """autocast(enabled=False) for ``device_type`` while its autocast is on, else a no-op context
    (entering and leaving an autocast context costs about 3 us; the router runs it per layer)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return _NULL


_NULL = contextlib.nullcontext()  # reentrant and stateless: one for every call that needs none


# --------------------------------------------------------------------------------------------------
# The patch
# --------------------------------------------------------------------------------------------------
class Patch:
    """What ``patch()`` did, and the handle to drive replay and capture. ``family`` (the family's
    name), ``layers`` (the route layers of the patched routers, ascending: absolute decoder-layer
    numbers; for a family that routes several times per decoder layer, JetMoE, R·layer + site,
    see ``routes_per_layer``), ``modules`` (layer -> router module name), ``replays`` (layer ->
    switchyard.RouterReplay). Made by ``patch()`` (and found again by ``patch_of``), not
    directly. Route tensors in and out are laid out per MoE layer in the order of ``layers``
    (``moe_layers`` = len(layers)) with K = ``top_k``; -1 = no route (routed natively); data over
    all layers (vLLM's and verl's layouts, ``Capture.ids()``) has ``num_route_layers``."""

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
        self._experts_scan = None  # capture.experts_modules of the patched layers (capture())
        self._stack_hooks = []  # on the modules that run the decoder layers (see _install)
        self._targets_thread = None  # (ident, name) of the thread whose targets are queued
        self._running = collections.Counter()  # thread ident -> forwards of it in progress
        self._pending = None  # _Pending: the ids of the stack forward under way (_step_ends)
        self.driver = None  # the replay core's driver over the layers' queues (_install)
        """The switchyard.replay.ReplayDriver over the layers' replay queues."""
        cfg = model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.num_hidden_layers = int(cfg.num_hidden_layers)
        """The model's decoder layers (dense and MoE)."""
        self._text_config = cfg
        self._loop = None  # spec.loop: (first looped layer, end, passes), set by patch()
        self.routes_per_layer = 1
        """R, the routers each token passes per decoder layer: 1, or for a family whose decoder
        layer routes several times (spec.route_sites) their number (JetMoE: 2, its attention
        experts' router, then its MLP experts' router). Route layer R·layer + site; set by
        ``patch()``."""

    # ---- what was patched ----
    @property
    def active(self) -> bool:
        """Whether every patched router still runs this Patch's forward (False once unpatched,
        also when a newer Patch took the routers over)."""
        return bool(self._layers) and all(l.installed and (l.pair is None or l.pair.installed)
                                          for l in self._layers)

    @property
    def family(self) -> str:
        """The family's name as people write it, e.g. "Qwen3-MoE" (a key of COMBINE_DTYPE)."""
        return self._layers[0].family.title

    @property
    def loop(self) -> tuple[int, int, int] | None:
        """For a family that runs some decoder layers more than once per forward (spec.loop:
        Inkling2-Loop), ``(first, end, passes)``: decoder layers ``first..end - 1`` run
        ``passes`` times; None for every other family."""
        return self._loop

    @property
    def num_route_layers(self) -> int:
        """The layer dimension of route data over all layers (vLLM's ``routed_experts``, verl's
        layout, ``Capture.ids()``): num_hidden_layers × routes_per_layer, in forward order
        (JetMoE: decoder layer i's attention router at 2i, its MLP router at 2i + 1), plus
        (passes - 1)·L for a family that loops L of its layers (Inkling2-Loop, spec.loop: its
        config's total_num_hidden_layers)."""
        n = self.num_hidden_layers * self.routes_per_layer
        if self._loop is not None:
            first, end, passes = self._loop
            n += (passes - 1) * (end - first)
        return n

    def _route_layer(self, layer, site=0, pass_=0):
        """The route layer of decoder layer ``layer``'s router at route site ``site`` in pass
        ``pass_``: R·layer + site; for a looping family (spec.loop) its place in forward order:
        layer before the loop, first + pass·L + (layer - first) in it, layer + (passes - 1)·L
        after it."""
        if self._loop is None:
            return self.routes_per_layer * layer + site
        first, end, passes = self._loop
        if layer < first:
            return layer
        if layer < end:
            return first + pass_ * (end - first) + (layer - first)
        return layer + (passes - 1) * (end - first)

    @property
    def layers(self) -> list[int]:
        """The route layers of the patched routers, ascending: absolute decoder-layer numbers,
        or R·layer + site where a decoder layer routes R times (``routes_per_layer``), or each
        (pass, layer) in forward order for a looping family (Inkling2-Loop, ``num_route_layers``).
        """
        return [l.layer for l in self._layers]

    @property
    def modules(self) -> dict[int, str]:
        """{layer: qualified name of its router module}."""
        return {l.layer: l.name for l in self._layers}

    def router_blocks(self) -> set[str]:
        """The qualified names of the modules holding the patched routers (the MoE blocks): the
        experts captured beside them are these blocks' (another modality's experts in the same
        decoder layer are not).

        Returns:
            {qualified name of each patched router's parent module}.
        """
        return {n.rsplit(".", 1)[0] for n in self.modules.values()}

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
        """K, the experts each token is routed to: the largest over the MoE layers, the width of
        route tables in and out (a layer with a smaller K has -1 in the columns past its own)."""
        return max(l.top_k for l in self._layers)

    @property
    def top_ks(self) -> dict[int, int]:
        """{layer: K} of each patched MoE layer (HunYuan's ``moe_topk`` may differ per layer)."""
        return {l.layer: l.top_k for l in self._layers}

    @property
    def combine_dtype(self) -> str:
        """Dtype of the combine weights the patched routers return (COMBINE_DTYPE)."""
        if self.router_dtype is None:
            return "the family's own (unchanged)"
        return self._layers[0].family.combine_dtype

    def gate_description(self) -> str:
        """What computes the router logits, in words (shown by ``repr``).

        Returns:
            str.
        """
        if self.router_dtype is None:
            return "the family's own (unchanged)"
        if self.gate == "torch":
            return f"torch GEMM in {self.router_dtype}, autocast off"
        return (f"switchyard engine in {self.router_dtype} on CPU tensors (batch invariant); torch "
                f"GEMM in {self.router_dtype} on CUDA tensors (not batch invariant)")

    def __repr__(self):
        per = "" if self.routes_per_layer == 1 else \
            f" route layers ({self.routes_per_layer} per decoder layer)"
        if self._loop is not None:
            first, end, passes = self._loop
            per = f" route layers (decoder layers {first}..{end - 1} in {passes} passes)"
        return (f"<switchyard.hf.Patch {self.family}: {len(self._layers)} MoE layers "
                f"{self.layers} of {self.num_route_layers}{per}, "
                f"router_dtype={self.router_dtype}, "
                f"gate: {self.gate_description()}, combine weights: {self.combine_dtype}"
                f"{'' if self.active else ' (unpatched)'}>")

    # ---- replay ----
    def set_action(self, action: str | None) -> None:
        """Sets every layer's RouterReplay action: None, "record" or "replay_forward" (ValueError
        for another value; "recompute" is refused at the next forward: the checkpoint recompute
        is detected by itself).

        Args:
            action: None, "record" or "replay_forward".

        Raises:
            ValueError: for another value.
        """
        for l in self._layers:
            l.replay.action = action
        self._sync_traced()

    def set_targets(self, routes: torch.Tensor) -> None:
        """Queues replay targets for the next forward of every MoE layer and sets the action to
        "replay_forward". ``routes``: [T, moe_layers, K] or [B, S, moe_layers, K] ids (int64,
        int32, int16, int8, uint8 or uint16, any device; -1 = route natively), tokens in the order
        the forward sees them (row-major over [B, S]); moe_layers in the order of ``layers``.
        ValueError for another rank or another moe_layers / K; every layer's rows are checked by
        the engine first (its ValueError, naming layer and token, by ``invalid_replay_rows``);
        nothing is queued unless all pass. The next forward must see T (= B * S) tokens (else its
        ValueError).

        Threads: the targets are taken by the model's next forward, so one patched model replays
        for one thread at a time. While targets one thread set are queued (not yet all taken),
        ``set_targets`` from another thread, and a forward started by another thread, raise
        ValueError naming both threads (nothing queued or taken); so does ``set_targets`` while
        another thread's forward is running. Give each thread its own model (e.g. a
        ``copy.deepcopy``, which has its own Patch), or hand the batches to one thread.

        Args:
            routes: [T, moe_layers, K] or [B, S, moe_layers, K] integer ids.

        Raises:
            ValueError: nothing queued, as above.
        """
        if routes is not None and not isinstance(routes, torch.Tensor) and hasattr(routes, "dtype"):
            routes = _ids.as_tensor(routes, "hf.set_targets", "routes")  # a numpy array
        if not isinstance(routes, torch.Tensor) or routes.dim() not in (3, 4):
            got = (f"shape {list(routes.shape)}" if isinstance(routes, torch.Tensor) else
                   type(routes).__name__)
            raise ValueError("[hf.set_targets] routes must be a [T, moe_layers, K] or "
                             f"[B, S, moe_layers, K] tensor (or numpy array), got {got}")
        t = routes.reshape(-1, routes.shape[-2], routes.shape[-1])
        M, K = len(self._layers), self.top_k
        if t.shape[1] != M or t.shape[2] != K:
            raise ValueError(f"[hf.set_targets] routes must hold {M} MoE layers and K={K}, got "
                             f"shape {list(routes.shape)}")
        for m, l in enumerate(self._layers):  # a layer with a smaller K: -1 past its own
            if l.top_k < K and bool((t[:, m, l.top_k:] != -1).any()):
                raise ValueError(f"[hf.set_targets] layer {l.layer} routes to K={l.top_k} "
                                 f"experts: routes[..., {m}, {l.top_k}:] must be -1 (the table is "
                                 f"K={K} wide for the model's largest K)")
        me = threading.current_thread()
        with _THREADS_LOCK:
            self._check_thread(me, "[hf.set_targets] from")
            others = [i for i, n in self._running.items() if n and i != me.ident]
            if others:
                raise ValueError(f"[hf.set_targets] a forward of another thread "
                                 f"({_thread(others[0])}) is running on this model: targets set "
                                 f"now would be taken by "
                                 f"it; one patched model replays for one thread at a time (give "
                                 f"each thread its own model, or set the targets from the thread "
                                 f"that runs the forwards)")
            self.driver.set_step_targets(_layer_tables(t, [l.top_k for l in self._layers]))
            self._targets_thread = (me.ident, me.name)
            for l in self._layers:
                l.replay.action = "replay_forward"
        self._sync_traced()

    def _check_thread(self, me, who):
        """ValueError when targets another thread set are still queued (called under
        _THREADS_LOCK)."""
        owner = self._targets_thread
        if owner is None or owner[0] == me.ident:
            return
        if not any(l.replay.num_targets for l in self._layers):
            self._targets_thread = None  # all taken: the model is free again
            return
        raise ValueError(f"{who} thread {me.name!r}: replay targets that thread {owner[1]!r} "
                         "set are still queued (no forward has taken them yet): one "
                         "patched model replays for one thread at a time (its next forward takes "
                         "the targets, whichever thread runs it); give each thread its own model "
                         "(copy.deepcopy has its own Patch), or run the batches from one thread "
                         "(Patch.clear() drops targets no forward will take)")

    def replay_counts(self) -> dict[int, _replay.ReplayCounts]:
        """The forwards' rows per layer since reset_counts(), as the replay core counts them.

        Returns:
            {layer: switchyard.replay.ReplayCounts} (copies: changing them changes nothing).
        """
        self._sync_traced()
        return {l.layer: l.all_counts() for l in self._layers}

    def counts(self) -> dict[int, dict[str, int]]:
        """{layer: {"num_replayed_rows", "num_native_rows", "num_invalid_replay_rows",
        "num_recomputed_rows", "num_calls": int}}: rows replayed / routed natively / invalid
        (routed natively, also counted as native) in forwards, rows recomputed with queued ids
        inside backward, and forward calls, since reset_counts().

        Returns:
            {layer: {name: int}}.
        """
        counts = self.replay_counts()
        return {l.layer: {"num_replayed_rows": counts[l.layer].replayed,
                          "num_native_rows": counts[l.layer].native,
                          "num_invalid_replay_rows": counts[l.layer].invalid,
                          "num_recomputed_rows": l.num_recomputed_rows,
                          "num_calls": counts[l.layer].calls} for l in self._layers}

    def reset_counts(self) -> None:
        """Zeroes the counts of every layer (the queues stay)."""
        self._sync_traced()
        for l in self._layers:
            l.reset_counts()

    def clear(self) -> None:
        """Drops every queued table (recorded, targets, pending recompute) and the counts."""
        self.driver.clear()
        for l in self._layers:
            l.reset_counts()
            l.staged_rows = l.staged_replay = None

    def _traced_step_ends(self, output):
        # The end of a traced forward of the decoder stack (outside any checkpoint): each layer's
        # staged target is taken (a constant attribute store dynamo replays after the graph runs;
        # _sync_traced then takes the table from the queue and counts it, outside the traced
        # region), and a natively routed layer counts its rows into a tensor, so no symbolic size
        # enters Python state. An exported program keeps no Patch state.
        if torch.compiler.is_exporting():
            return
        h = output[0] if isinstance(output, (tuple, list)) else getattr(
            output, "last_hidden_state", None)
        T = h.shape[:-1].numel() if isinstance(h, torch.Tensor) else None
        for l in self._layers:
            if l.staged_replay is not None:
                l.staged_replay = None
            elif T is not None:
                l.traced_counts[_TRACED_COUNTS.index("num_native_rows")] += T
                l.traced_counts[_TRACED_COUNTS.index("num_calls")] += 1

    def _sync_traced(self):
        """Outside any traced region: settles what compiled forwards did and stages the next
        targets for them. A layer whose staged target a compiled forward took (its staged_replay
        was cleared) takes that table from the replay queue and counts it, as an eager forward
        would; then every layer in "replay_forward" with a table queued gets the head of its queue
        staged as tensors (ids int64 [T, K], replayed rows bool [T]) on the router's device.
        Under torch.compile set the targets before every forward (one step is staged at a time)."""
        if torch.compiler.is_compiling():
            return
        first = self._layers[0]
        if first.sink_key is None or _ops.route_sink_owner(first.sink_key) is not first:
            for l in self._layers:  # (all or none: a deep copy copies the Patch whole)
                l.ensure_sink()
        for l in self._layers:
            rows, r = l.staged_rows, l.replay
            if rows is None and r.action != "replay_forward":
                continue  # nothing staged, nothing to stage
            if rows is not None and l.staged_replay is not None and not (
                    r.action == "replay_forward" and (r.num_targets or r.num_recorded) and
                    ((t := r.next_target()) is rows.ids or torch.equal(t, rows.ids))):
                l.staged_rows = rows = None  # the queue changed under it (cleared, dropped)
            if rows is not None and l.staged_replay is None:  # a compiled forward took it
                self.driver.take_forward(l.layer, rows.num_tokens)
                l.counts.add(_replay.ReplayCounts.of_rows(rows))
                l.staged_rows = None
            if l.staged_rows is None and r.action == "replay_forward" and \
                    (r.num_targets or r.num_recorded):
                # The queued ReplayRows itself (classified as it was set), so the eager forward
                # that takes it uses these tensors instead of converting them again.
                rows = self.driver.peek_forward(l.layer)
                if rows is None:
                    continue  # a layer without num_experts: eager only
                dev = l.family.params(l.router)[0].device
                l.staged_rows = rows
                l.staged_replay = (rows.ids.to(device=dev, dtype=torch.int64),
                                   rows.replayed.to(dev))

    # ---- route sources (R3) ----
    def _layer_freq(self):
        s = set(self.layers)
        return [1 if i in s else 0 for i in range(self.num_route_layers)]

    def _check_route_layers(self, shapes, op, what):
        """ValueError, for a family with several routes per decoder layer (JetMoE), naming the
        family and its route layer count when route data's layer dimension (the second last of
        each shape) is not num_route_layers; an engine's arrays over the hidden layers (one route
        per layer, MLP experts only) are refused here rather than read as the wrong routers."""
        R = self.routes_per_layer
        if self.num_route_layers == self.num_hidden_layers:
            return
        if self._loop is not None:
            first, end, passes = self._loop
            how = (f"runs its decoder layers {first}..{end - 1} {passes} times per forward, "
                   "routing every token in each pass")
            where = (f"pass p of loop layer i at {first} + p·{end - first} + (i - {first}), the "
                     f"layers after the loop at i + {(passes - 1) * (end - first)}")
        else:
            sites = ", then ".join(self._layers[0].family.spec.route_sites)
            how = f"routes every token {R} times per decoder layer ({sites})"
            where = f"decoder layer i's routes at {R}i to {R}i + {R - 1}"
        for i, shape in enumerate(shapes):
            if len(shape) >= 2 and int(shape[-2]) != self.num_route_layers:
                raise ValueError(
                    f"[{op}] {self.family} {how}: {what} must hold its "
                    f"num_route_layers={self.num_route_layers} route layers ({where}, as "
                    f"Capture.routed_experts() lays them out), got shape {list(shape)}"
                    f"{f' at [{i}]' if len(shapes) > 1 else ''}; an engine's routes over the "
                    f"{self.num_hidden_layers} hidden layers do not hold every router's ids")

    def tables_from_vllm(self, arrays: Sequence[Any], zero_rows: str = "keep"
                         ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """vLLM / SGLang routed_experts arrays -> switchyard route tables, through switchyard's
        vLLM importer with this model's layer map.

        Args:
            arrays: one integer [n_b - 1, num_route_layers, K] array per sequence (numpy or
                torch, dense layers 0; num_route_layers is num_hidden_layers except for JetMoE).
            zero_rows: "keep", "to_none" or "error" (the importer's).

        Returns:
            (tables, report): int32 [n_b, moe_layers, K] per sequence (last token -1) and the
            import report dict.

        Raises:
            ValueError: the importer's, naming sequence, token, layer and value; for JetMoE,
                arrays whose layer dimension is not num_route_layers (naming the family).
        """
        return self._import_vllm(arrays, zero_rows, "hf.tables_from_vllm")

    def _import_vllm(self, arrays, zero_rows, op):
        self._check_route_layers([a.shape for a in arrays if hasattr(a, "shape")], op,
                                 "routed_experts arrays")
        return syr.import_vllm_arrays(arrays, self.num_experts, moe_layer_freq=self._layer_freq(),
                                      num_input_layers=self.num_route_layers, top_k=self.top_k,
                                      zero_rows=zero_rows)

    def targets_from_tables(self, tables: Sequence[Any], attention_mask: torch.Tensor | None = None
                            ) -> torch.Tensor:
        """switchyard route tables (one [n_b, moe_layers, K] per sequence, int32 / int64 / int16 /
        int8 / uint8 / uint16, e.g. from switchyard.routes.read) and ``attention_mask`` [B, S]
        (nonzero = real token; None: tables of one length, stacked) -> int32 [B, S, moe_layers, K]
        targets for ``set_targets``, -1 at padding (switchyard.routes.add_padding). ValueError
        for another dtype, tables of different layers / K, or a mask row whose real tokens are not
        n_b.

        Args:
            tables: one [n_b, moe_layers, K] integer table per sequence.
            attention_mask: [B, S] (nonzero = real token), or None (tables of one length).

        Returns:
            int32 [B, S, moe_layers, K].

        Raises:
            ValueError: as above.
        """
        op = "hf.targets_from_tables"
        tables = [_ids.to_int32(_ids.as_tensor(t, op, f"tables[{i}]"), op, f"tables[{i}]")
                  for i, t in enumerate(_ids.table_list(tables, op))]
        return syr.add_padding(tables, attention_mask)

    def targets_from_vllm(self, arrays: Sequence[Any], attention_mask: torch.Tensor | None = None,
                          zero_rows: str = "keep") -> tuple[torch.Tensor, dict]:
        """vLLM / SGLang routed_experts arrays (one integer [n_b - 1, num_route_layers, K] per
        sequence, numpy or torch, dense layers 0) and ``attention_mask`` [B, S] (None: sequences of
        one length) -> (int32 [B, S, moe_layers, K] targets with -1 at padding and last tokens,
        import report dict), through switchyard's vLLM importer and this model's layer map
        (``zero_rows`` as there: "keep", "to_none" or "error"). ValueError (the importer's, naming
        sequence, token, layer and value) for a wrong shape or an id outside [0, num_experts).

        Args:
            arrays: one integer [n_b - 1, num_route_layers, K] array per sequence.
            attention_mask: [B, S] (nonzero = real token), or None (sequences of one length).
            zero_rows: "keep", "to_none" or "error".

        Returns:
            (int32 [B, S, moe_layers, K] targets, import report dict).

        Raises:
            ValueError: the importer's.
        """
        tables, report = self._import_vllm(
            _ids.table_list(arrays, "hf.targets_from_vllm", "arrays"), zero_rows,
            "hf.targets_from_vllm")
        return syr.add_padding(tables, attention_mask), report

    def targets_from_verl(self, routed_experts: torch.Tensor, attention_mask: torch.Tensor,
                          zero_rows: str = "to_none") -> tuple[torch.Tensor, dict]:
        """verl's ``routed_experts`` ([B, S, num_route_layers, K], int16, padded, zero filled;
        each row holds vLLM's routes of its real tokens, the last real token having none; any
        integer dtype) and its attention mask [B, S] -> (int32 [B, S, moe_layers, K] targets,
        import report dict); ValueError as ``targets_from_vllm``. Padding is dropped
        by the mask (switchyard.routes.drop_padding), the layers mapped by the vLLM importer (all
        zero rows on MoE layers become -1 with zero_rows="to_none": routed natively, counted).

        Args:
            routed_experts: verl's [B, S, num_route_layers, K] integer batch tensor
                (num_route_layers is num_hidden_layers except for JetMoE).
            attention_mask: [B, S] (nonzero = real token).
            zero_rows: "keep", "to_none" or "error".

        Returns:
            (int32 [B, S, moe_layers, K] targets, import report dict).

        Raises:
            ValueError: as ``targets_from_vllm``.
        """
        m = torch.as_tensor(attention_mask).to("cpu")
        # verl's layout has one reader, routes.from_verl; the last real token of each row (no
        # route in the rollout) is masked out there and gets its -1 row back here.
        routed = routed_tokens(m)
        has = (m != 0).any(dim=1)
        routed_experts = _ids.as_tensor(routed_experts, "hf.targets_from_verl", "routed_experts")
        self._check_route_layers([routed_experts.shape], "hf.targets_from_verl", "routed_experts")
        tables, report = syr.from_verl(routed_experts, routed, self.num_experts,
                                       moe_layer_freq=self._layer_freq(), zero_rows=zero_rows)
        tables = [torch.cat([t, t.new_full((1, *t.shape[1:]), -1)]) if h else t
                  for t, h in zip(tables, has.tolist())]
        return syr.add_padding(tables, m), report

    def targets_from_verl_packed(self, values: torch.Tensor, offsets: torch.Tensor,
                                 zero_rows: str = "to_none") -> torch.Tensor:
        """``targets_from_verl`` of verl's jagged ``routed_experts`` (a nested tensor's values
        [total, num_route_layers, K], the sequences end to end, and its offsets [B + 1]), in that
        packed token order: the padded batch's targets at its real tokens, without making the
        padded batch (one reader call for the micro-batch, each sequence's last token -1).

        Args:
            values: [total, num_route_layers, K] integer ids (verl stores int16).
            offsets: [B + 1] int, the sequences' starts and the end (nondecreasing, from 0).
            zero_rows: as ``targets_from_verl``.

        Returns:
            int32 [total, moe_layers, K] targets (no import report: the reader saw the
            micro-batch as one sequence; ``targets_from_verl`` reports per sequence).

        Raises:
            ValueError: as ``targets_from_verl``, naming the sequence and token (a payload the
                reader refuses is read again sequence by sequence for the message).
        """
        values = _ids.as_tensor(values, "hf.targets_from_verl", "routed_experts")
        offsets = torch.as_tensor(offsets)
        offs = offsets.reshape(-1).tolist()  # (a few ints: checked in Python)
        total = values.shape[0] if values.dim() == 3 else -1
        if values.dim() != 3 or offsets.dim() != 1 or not offs or \
                offs[0] != 0 or offs[-1] != total or any(b < a for a, b in zip(offs, offs[1:])):
            raise ValueError(f"[hf.targets_from_verl] values must be [total, num_route_layers, K] "
                             f"and offsets [B + 1] from 0 to total, got values "
                             f"{list(values.shape)}, offsets {offs}")
        routed = torch.ones(total, dtype=torch.bool)
        routed[[b - 1 for a, b in zip(offs, offs[1:]) if b > a]] = False  # each last token
        try:
            self._check_route_layers([(1,) + tuple(values.shape)], "hf.targets_from_verl",
                                     "routed_experts")
            tables, _ = syr.from_verl(values.to("cpu").unsqueeze(0), routed.unsqueeze(0),
                                      self.num_experts, moe_layer_freq=self._layer_freq(),
                                      zero_rows=zero_rows)
        except ValueError:
            # The padded batch, read per sequence: the same refusal, naming sequence and token.
            lengths = torch.tensor(offs, dtype=torch.int64).diff()
            B, width = lengths.numel(), int(lengths.max()) if lengths.numel() else 0
            mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
            dense = values.new_zeros((B, width) + tuple(values.shape[1:]))
            dense[mask] = values.to(dense.device)
            self.targets_from_verl(dense.to("cpu"), mask, zero_rows=zero_rows)
            raise
        out = tables[0].new_full((total,) + tuple(tables[0].shape[1:]), -1)
        out[routed] = tables[0]
        return out

    # ---- capture ----
    def capture(self, experts: bool = True) -> "Capture":
        """Starts capturing the ids of every forward (until the returned Capture's context exits
        or stop_capture()); recomputes inside backward are not captured. ``generate()`` with beam
        search (num_beams > 1) is refused while capturing: the beams are reordered at every step,
        so the routes of a step would not follow the returned sequences. Returns the Capture;
        ValueError when a capture is already running.

        Args:
            experts: also observe the ids the experts modules receive (``Capture.expert_ids()``,
                forward pre-hooks on the experts and decoder layers, about 20 us per MoE layer
                and forward); False leaves them out (the trainer adapters, which read ``ids()``
                only).

        Returns:
            Capture (a context manager).

        Raises:
            ValueError: when a capture is already running.
        """
        if self._capture is not None:
            raise ValueError("[hf.capture] a capture is already running")
        cap = Capture(self, False, experts_off=True) if not experts else None
        if self._experts_scan is None and self.num_route_layers != self.num_hidden_layers:
            # (JetMoE: its experts run on the routers' expert-sorted groups, not transformers'
            # experts interface; Inkling2-Loop's loop layers' experts run once per pass; an
            # ExpertsCapture holds one route per decoder layer)
            self._experts_scan = False
        if cap is None and self._experts_scan is None:  # the experts modules, found once
            try:
                self._experts_scan = experts_modules(self.model, set(self.layers),
                                                      self.router_blocks())
            except ValueError:  # a family whose experts are not transformers' interface (Llama-4)
                self._experts_scan = False
        if cap is None:
            cap = Capture(self, self._experts_scan)
        cap.start()
        self._capture = cap
        self._sync_traced()  # compiled forwards hand their ids to the capture (ensure_sink)
        return cap

    @property
    def running_capture(self) -> "Capture | None":
        """The running Capture, or None."""
        return self._capture

    def stop_capture(self) -> None:
        """Stops the running capture, if any (what leaving its ``with`` block does)."""
        cap, self._capture = self._capture, None
        if cap is not None:
            cap.stop()

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
        if torch.compiler.is_compiling():
            return  # the compiled forward reads the state staged before it (_sync_traced)
        self._sync_traced()
        me = threading.current_thread()
        stale = False
        with _THREADS_LOCK:
            self._check_thread(me, "[hf] a forward from")
            p = self._pending
            if p is not None and p.ident == me.ident and not _on_stack(p.frame):
                # This thread's earlier stack forward ended without _step_ends: a BaseException
                # (KeyboardInterrupt) skips torch's always_call hooks. Its state is dropped, as a
                # failed forward's is, or every later forward would be taken for a nested one.
                self._running.pop(me.ident, None)
                self._pending, stale = None, not p.plain
            self._running[me.ident] += 1
            if self._pending is None:  # the outermost stack forward: its layers' ids wait for it
                plain = not torch.is_grad_enabled() and not _replay.in_recompute()
                record = False
                for l in self._layers:
                    a = l.replay.action
                    plain = plain and a in (None, "record")
                    record = record or a == "record"
                self._pending = _Pending(me.ident, plain, record or self._capture is not None,
                                         plain and not record, sys._getframe(1))
            elif self._pending.ident != me.ident:
                plain = False
            else:
                plain = self._pending.plain
        if stale:
            self.driver.end_step(failed=True)
        if not plain:
            # (A plain forward takes no target and queues nothing for a recompute: the driver's
            # step would begin and end on nothing; _step_ends skips its end the same way.)
            self.driver.begin_step()

    def _step_ends(self, module, args, output):
        if torch.compiler.is_compiling():
            self._traced_step_ends(output)
            return
        pending = None
        with _THREADS_LOCK:
            me = threading.get_ident()
            if not self._running[me]:  # _step_begins refused this forward: it took nothing
                self._running.pop(me, None)
                return
            self._running[me] -= 1
            mine = self._pending is not None and self._pending.ident == me
            plain = mine and self._pending.plain  # (as _step_begins decided it)
            if not self._running[me]:
                del self._running[me]
                if mine:
                    pending, self._pending = self._pending, None
        failed = output is None and sys.exc_info()[1] is not None
        # A forward that failed hands nothing on: its layers' ids up to the failure would leave
        # the capture's layers, and the recorded tables, at different step counts.
        if pending is not None and pending.entries and not failed:
            try:
                cap, entries = self._capture, pending.entries
                if pending.capture_only and cap is not None and all(
                        _core_ids(e[1]) and not e[4] and e[5] is None for e in entries):
                    cap.add_forward(entries)  # (nothing recorded or queued: the capture's alone)
                else:
                    self._hand_on_forward(entries)
            except BaseException:
                # (a capture refusing a step fails the forward, as it did inside a router call)
                if not plain:
                    self.driver.end_step(failed=True)
                raise
        if not plain:
            self.driver.end_step(failed=failed)

    @staticmethod
    def _hand_on_forward(entries):
        """Hands on the ids a forward's router calls produced (record, recompute queue, capture),
        in forward order. ``entries``: (layer, ids, T, batch shape, will_recompute, native ids or
        None) per call. Ids on the CPU go on as the routers' own tensors: the replay core's record
        and recompute queue copy them (int32 or int64) into their own tables, and a capture keeps
        them and converts them when read, one copy per layer for the whole capture instead of one
        per forward. Ids on a device come to the host in one copy for the forward's layers first
        (kept on the device, a long generation's ids would hold device memory, int64, until the
        capture is read)."""
        if all(_core_ids(e[1]) and (e[5] is None or _core_ids(e[5])) for e in entries):
            for l, ids, T, batch_shape, will_recompute, nat in entries:
                l._hand_on(ids, T, batch_shape, will_recompute, nat)
            return
        tensors = [e[1] for e in entries] + [e[5] for e in entries if e[5] is not None]
        host = iter(_host_ids(tensors))
        ids32 = [next(host) for _ in entries]
        for (l, _, T, batch_shape, will_recompute, nat), i32 in zip(entries, ids32):
            l._hand_on(i32, T, batch_shape, will_recompute, None if nat is None else next(host))

    # ---- lifetime ----
    def unpatch(self) -> None:
        """Restores every router's original forward and removes the hooks (idempotent). The
        handle of an earlier Patch whose routers a newer Patch took over changes nothing."""
        for l in self._layers:
            l.uninstall()
        for h in self._stack_hooks:
            h.remove()
        self._stack_hooks = []
        self.stop_capture()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpatch()


def _transformers_version():
    import transformers
    return transformers.__version__


def _check_version():
    # A later 5.x minor than the newest tested passes: every MoE layer whose router no spec covers
    # is refused by name (_refuse_unrouted_experts), so a new or renamed router never passes
    # through silently; the router classes of 5.24 and 5.25 are the same text.
    found = _transformers_version()
    oldest, newest = SUPPORTED_TRANSFORMERS_VERSIONS
    from packaging.version import InvalidVersion, Version
    try:
        release = Version(str(found)).release
    except InvalidVersion:  # check_version names it
        release = ()
    if release and release[0] == newest[0] and release[:2] > tuple(newest):
        newest = release[:2]
    check_version("hf.patch", "transformers", found, oldest, newest)


_TRACED_COUNTS = ("num_native_rows", "num_calls")
"""The counts a traced (compiled) forward keeps in _Layer.traced_counts (int64 tensor)."""


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

    Args:
        model: a transformers model (torch.nn.Module).
        router_dtype: torch.float32, torch.float64 or None.
        gate: "auto" or "torch".
        invalid_replay_rows: "error", "native" or "merge".

    Returns:
        Patch.

    Raises:
        ValueError: as above, the model untouched.
        RuntimeError: for an unsupported transformers release.
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
    seconds = {}  # spec.split_by: {the splitting block: (name, router)} of each second router
    stacks = {}
    for name, mod in modules.items():
        fam = _family_of(mod)
        if fam is None:
            continue
        if _owner_of(mod.__dict__.get("forward")) is not None:
            raise ValueError(f"[hf.patch] {name} is already patched by switchyard: unpatch() the "
                             "earlier Patch first")
        split = fam.spec.split_by
        if split is not None:
            end = _split_end(fam, name)
            if end == split[1][1]:  # paired with the first router of its block below
                seconds[name[:-len(end) - 1]] = (name, mod)
                continue
        mt = list(LAYER_RE.finditer(name))
        if not mt:
            raise ValueError(f"[hf.patch] cannot tell the decoder layer of router {name} (no "
                             "'layers.<n>' or 'blocks.<n>' in its name)")
        layer = int(mt[-1].group(1))
        dec_name = name[:mt[-1].end(1)]
        stacks.setdefault(name[:mt[-1].start()], None)  # the module that holds `layers`
        found.append((layer, name, mod, modules.get(dec_name), fam, _site(fam, name)))
    model_type = _model_type(model)
    if model_type in REFUSED:
        raise ValueError(f"[hf.patch] {model_type}: {REFUSED[model_type]}")
    _refuse_unrouted_experts(modules, found, model_type,
                             {n.rsplit(".", 1)[0] for n, _ in seconds.values()})
    if not found:
        names = ", ".join(f.title for f in FAMILIES.values())
        raise ValueError(f"[hf.patch] no supported MoE router in {type(model).__name__}; "
                         f"supported families: {names}")
    fams = {f[4].title for f in found}
    if len(fams) != 1:
        raise ValueError(f"[hf.patch] routers of several families in one model: {sorted(fams)}")
    # A family that routes several times per decoder layer (spec.route_sites, JetMoE) has R
    # route layers per decoder layer, in forward order: route layer R·layer + site.
    p.routes_per_layer = max(len(found[0][4].spec.route_sites), 1)
    # A family that runs a range of its layers several times per forward (spec.loop,
    # Inkling2-Loop): one route layer per (pass, layer), in forward order (Patch._route_layer).
    loop = found[0][4].spec.loop
    if loop is not None:
        p._loop = tuple(int(getattr(p._text_config, a)) for a in loop)
    keys = [p._route_layer(f[0], f[5]) for f in found]
    if len(set(keys)) != len(keys):
        raise ValueError(f"[hf.patch] several routers claim one decoder layer: {sorted(keys)} "
                         f"(a model with several decoder stacks: {', '.join(stacks)}; patch each "
                         "one on its own, patch(model.get_submodule(name)), or the text model)")
    for layer, name, mod, dec, fam, site in found:
        _refuse_kernelized(modules.get(name.rsplit(".", 1)[0]), name, model_type)
    for key, (layer, name, mod, dec, fam, site) in sorted(zip(keys, found), key=lambda f: f[0]):
        if layer >= p.num_hidden_layers:
            raise ValueError(f"[hf.patch] router {name} is in layer {layer}, beyond "
                             f"num_hidden_layers={p.num_hidden_layers}")
        p._layers.append(_Layer(p, key, name, mod, dec, fam, modules.get(name.rsplit(".", 1)[0])))
        if p._loop is not None and p._loop[0] <= layer < p._loop[1]:
            if dec is None:
                raise ValueError(f"[hf.patch] {fam.name}: loop layer {layer}'s router {name} is "
                                 "outside a decoder layer module: its pass cannot be read")
            p._layers += p._layers[-1].add_passes(
                [p._route_layer(layer, pass_=q) for q in range(1, p._loop[2])])
        if fam.spec.split_by is not None:
            split_block = name[:-len(fam.spec.split_by[1][0]) - 1]
            if split_block not in seconds:
                raise ValueError(f"[hf.patch] {fam.name}: the MoE block {split_block} holds "
                                 f"{fam.spec.split_by[1][0]} without {fam.spec.split_by[1][1]}")
            second, router = seconds.pop(split_block)
            _refuse_kernelized(modules.get(second.rsplit(".", 1)[0]), second, model_type)
            p._layers[-1].pair_with(second, router, modules[split_block],
                                    modules.get(second.rsplit(".", 1)[0]))
    if seconds:
        name = next(iter(seconds.values()))[0]
        raise ValueError(f"[hf.patch] router {name} has no first router of its MoE block to share "
                         "a route layer with")
    p._layers.sort(key=lambda l: l.layer)  # (a loop layer's later passes come after the loop)
    p._install([modules[s] for s in stacks if s in modules])
    return p


# Guards every Patch's thread bookkeeping (a few dict operations per forward; one lock for all
# Patches so that copy.deepcopy of a patched model, which copies its Patch, needs no lock copied).
_THREADS_LOCK = threading.Lock()


def _thread(ident):
    t = next((t for t in threading.enumerate() if t.ident == ident), None)
    return repr(t.name) if t is not None else f"ident {ident}"


def _split_end(fam, name):
    """Which of its family's spec.split_by routers ``name`` is (the module name's end); ValueError
    for a router of the class at neither."""
    ends = fam.spec.split_by[1]
    for end in ends:
        if name.endswith("." + end):
            return end
    raise ValueError(f"[hf.patch] {fam.name}: router {name} ({fam.router_class}) is neither of the "
                     f"family's routers ({', '.join(ends)}): its tokens cannot be placed in the "
                     "route tables")


def _site(fam, name):
    """The route site of router ``name`` among its family's spec.route_sites (0 without);
    ValueError for a router of the class at none of them (patch() refuses it by name)."""
    sites = fam.spec.route_sites
    if not sites:
        return 0
    for i, end in enumerate(sites):
        if name.endswith("." + end):
            return i
    raise ValueError(f"[hf.patch] {fam.name}: router {name} ({fam.router_class}) is at none of "
                     f"the family's route sites ({', '.join(sites)}): its route cannot be placed "
                     "in the route tables")


def _model_type(model):
    """The transformers.models package of the model's (text) config: the key of SPECS and
    REFUSED (a multimodal model's text backbone is in the model's package)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    parts = type(text).__module__.split(".")
    if len(parts) > 2 and parts[:2] == ["transformers", "models"]:
        return parts[2]
    return getattr(text, "model_type", None)


def _refuse_unrouted_experts(modules, found, model_type, unpatched=()):
    """ValueError naming the router class, the model type and where a spec is registered, for
    every experts module in a block with no router of a known family (a family a transformers
    release added or renamed): never a silent pass-through. ``unpatched``: the blocks of a
    family's routers of another modality, whose forwards the family's spec refuses."""
    routed = set(unpatched)
    for _, name, *_ in found:
        routed.add(name.rsplit(".", 1)[0])  # the MoE block holding the router
    for name, mod in modules.items():
        if not is_experts(mod):
            continue
        block = name.rsplit(".", 1)[0] if "." in name else ""
        if block in routed:
            continue
        parent = modules.get(block)
        others = sorted({type(m).__name__ for n, m in (parent.named_children() if parent is not None
                                                          else ()) if m is not mod})
        refused = [REFUSED_ROUTERS[c] for c in others if c in REFUSED_ROUTERS]
        if refused:
            raise ValueError(f"[hf.patch] {model_type}: {refused[0]}")
        raise ValueError(
            f"[hf.patch] model type {model_type!r}: the MoE block {block or '<model>'} "
            f"({type(parent).__name__}) routes its experts ({type(mod).__name__}) with "
            f"{', '.join(others) or 'no router module'}, which no switchyard routing spec covers; "
            "a spec is registered in switchyard/integrations/hf/spec.py (SPECS, or REFUSED with "
            "the reason)")


def _refuse_kernelized(block, router_name, model_type):
    """ValueError when the MoE block holding a router runs another forward than its class's
    (transformers' ``kernels`` hub integration replaces a decorated block's forward, e.g. a
    MegaBlocks MoE MLP that routes inside its kernel and never calls the router)."""
    if block is None:
        return
    cls_forward = type(block).forward
    own = "forward" in block.__dict__ or getattr(cls_forward, "__module__", None) not in (
        type(block).__module__, *(c.__module__ for c in type(block).__mro__))
    kernel = getattr(block, "kernel_layer_name", None)
    if own:
        raise ValueError(
            f"[hf.patch] model type {model_type!r}: the MoE block of {router_name} "
            f"({type(block).__name__}) runs a replaced forward"
            f"{f' (hub kernel {kernel!r})' if kernel else ''}, which may route inside its kernel "
            "without calling the router: switchyard cannot guarantee the patched router is what "
            "runs; load the model without kernels (use_kernels=False, or model.reset_kernels())")


def _owner_of(forward):
    """The _Layer whose patched forward ``forward`` is (None for any other callable)."""
    owner = getattr(forward, "__self__", None)
    return owner if isinstance(owner, _Layer) and \
        getattr(forward, "__func__", None) is _Layer.forward else None


def patch_of(model: torch.nn.Module) -> "Patch | None":
    """The active Patch of ``model`` (the one whose forwards its routers run), or None. After
    ``copy.deepcopy(model)`` (e.g. TRL's reference model) the copy has its own Patch: same
    settings, its own replay queues and counts, forwards bound to its own routers.

    Args:
        model: a torch.nn.Module.

    Returns:
        Patch or None.
    """
    for mod in model.modules():
        layer = _owner_of(mod.__dict__.get("forward"))
        if layer is not None:
            return layer.owner
    return None
