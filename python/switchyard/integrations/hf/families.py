"""switchyard.integrations.hf.families: the generic routed forward (``Family``) that reads a
family's RoutingSpec (spec.py) -- its gate parameters, its own gate, its selection and weights --
and the gate (switchyard's engine or a torch GEMM in router_dtype). Used by ``patch`` (the patched
router forward); see the package docstring."""
import contextlib
import dataclasses

import torch
import torch.nn.functional as F

import switchyard.torch as syt

from .spec import SET, SPECS, RoutingSpec


def _sdt(logits):
    """The dtype the routing math runs in: fp32, or fp64 for fp64 logits (the families' code says
    ``dtype=torch.float``, which would round fp64 logits)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _without_grad(fn, *args):
    """fn(*args) with autograd off: grad mode switched by calls (no_grad()'s context costs ~2 us
    more per layer and call), by the context where torch.compile traces."""
    if not torch.is_grad_enabled():
        return fn(*args)
    if torch.compiler.is_compiling():
        with torch.no_grad():
            return fn(*args)
    torch.set_grad_enabled(False)
    try:
        return fn(*args)
    finally:
        torch.set_grad_enabled(True)


def _ids(select, replay_ids, replay_mask, live=None, select_rows=None, native_rows=None):
    """The final ids: the family's live selection (run without autograd: ids are never
    differentiable, and the recompute of a replayed forward must save the same tensors as the
    forward did) for the rows not replayed, replay_ids for the replayed rows (replay_mask None:
    every row; a mask is given only where some row is not replayed, so it is not read here: an
    all-true one gives the same ids through where()). ``live``: a list that receives the live
    selection, computed also when every row is replayed (the router's own choice, for the
    mismatch metric), or None. ``select_rows``: the same selection of some rows (an int64
    index), for a family whose selection treats every row on its own; with ``native_rows`` (the
    rows not replayed, on the CPU) only those rows are selected (a top-k of a few rows instead of
    every row and a merge; per row the same kernel on the same values, so the same ids)."""
    # (Traced by torch.compile: no data-dependent branch.)
    if replay_ids is not None and replay_mask is None and live is None:
        return replay_ids
    if live is None and native_rows is not None and select_rows is not None and \
            replay_ids.is_cpu and not torch.compiler.is_compiling():
        return replay_ids.index_copy(0, native_rows, _without_grad(select_rows, native_rows))
    ids = _without_grad(select)
    if live is not None:
        live.append(ids)
    if replay_ids is None:
        return ids
    return replay_ids if replay_mask is None else torch.where(replay_mask[:, None], replay_ids,
                                                              ids)


# --------------------------------------------------------------------------------------------------
# The generic routed forward: one Family per RoutingSpec (spec.py). The weights are always the
# scores gathered at the final ids, which for live rows is bitwise the family's top-k values (and
# the gradient of a gather is the gradient of a top-k), so live and replayed rows share one graph.
# --------------------------------------------------------------------------------------------------
def _attr(r, path, block=None):
    """r.<path> (dotted); a path starting with "block." is read on the MoE block instead."""
    if path.startswith("block."):
        r, path = block, path[len("block."):]
    for a in path.split("."):
        r = getattr(r, a)
    return r


class Family:
    """A family's router, read from its RoutingSpec: where the gate is, the family's own gate
    (router_dtype=None), its selection and its weights. Called by patch's router forward. ``block``
    is the MoE block that holds the router (the parent module), ``passed`` the router forward's
    arguments after the hidden states (a correction bias, input_ids)."""

    def __init__(self, spec: RoutingSpec):
        self.spec = spec
        self.name = spec.model_type
        self.title = spec.title
        self.router_class = spec.router_class
        self.module = spec.module_name
        self.combine_dtype = spec.combine_dtype
        self._variants = {v: dataclasses.replace(spec, **dict(o)) for v, o in spec.variants}
        s = spec
        self.own_forward_routes = (
            s.returns in ("route", "scores") and s.variant_by is None and not s.skip_expert and
            s.shared_slots is None and s.score != "sigmoid_dense" and s.inline is None and
            s.route_method is None and s.carried_state is None and s.gate_module is None and
            s.split_by is None and s.loop is None and not s.route_sites)
        """Whether the router's own forward routes a natively routed call as the generic forward
        does, so a patched forward with router_dtype=None that replays nothing may run it whole
        (patch's _native_forward): it returns (logits or scores, weights, ids) with the ids as
        the experts receive them and routes once per call."""

    def __repr__(self):
        return f"<hf family {self.title} ({self.name}): {self.router_class}>"

    def spec_for(self, r):
        """The RoutingSpec router ``r`` runs: the spec, or the variant its ``variant_by``
        attribute picks (ValueError for a value the spec does not list)."""
        if self.spec.variant_by is None:
            return self.spec
        v = _attr(r, self.spec.variant_by)
        if v not in self._variants:
            raise ValueError(f"[hf] {self.name}: {self.router_class}.{self.spec.variant_by}="
                             f"{v!r} is not one of {sorted(self._variants)}")
        return self._variants[v]

    def gate_input(self, r, hidden_states):
        """The gate's input [T, H] (native or router_dtype): the hidden states flattened as the
        family's router does, then its own ops before the projection, in its own dtypes."""
        s = self.spec
        x = hidden_states
        if s.flatten_input or x.dim() != 2:
            x = x.reshape(-1, x.shape[-1])
        if s.input_norm is not None:
            x = getattr(r, s.input_norm)(x)
        for a in s.input_scale:
            x = x * getattr(r, a)
        return x

    def params(self, r):
        s = self.spec
        return _attr(r, s.weight), (None if s.bias is None else _attr(r, s.bias))

    def num_experts(self, r, block=None):
        if self.spec.score == "product_key":  # the ids a product key reaches: n²
            return int(_attr(r, self.spec.keys)) ** 2
        return int(_attr(r, self.spec.num_experts, block))

    def top_k(self, r, block=None):
        return int(_attr(r, self.spec.top_k, block))

    def native_context(self, r, x):
        if self.spec.autocast_off:
            return torch.autocast(device_type=x.device.type, enabled=False)
        return contextlib.nullcontext()

    def native_logits(self, r, x):
        w, b = self.params(r)
        cast = self.spec.gate_cast
        if cast == "fp32":
            return F.linear(x.float(), w.float(), None if b is None else b.float())
        if cast == "fp32_after":
            return F.linear(x, w, b).float()
        if cast == "fp32_weight_as_x":
            return F.linear(x.float(), w.to(x.dtype).float(), None if b is None else b.float())
        if cast == "weight_dtype":
            x = x.to(w.dtype)
        if cast == "fp32_if_weight_fp32" and w.dtype == torch.float32:
            x = x.float()
        return F.linear(x, w, b)

    def logits(self, r, z):
        """The router's logits from its gate's output z: the family's logit multiplier and tanh
        softcap (MuseSpark, Laguna), in z's dtype. They are what the router returns as its logits
        (transformers records them for the auxiliary loss) and what its scores are computed from."""
        s = self.spec
        if s.logit_scale is not None:
            z = z * getattr(r, s.logit_scale)
        if s.softcap is not None and getattr(r, s.softcap) > 0.0:
            c = getattr(r, s.softcap)
            z = torch.tanh(z / c) * c
        return z

    def check_mode(self, r):
        """ValueError for a forward the family's router cannot route faithfully (PhiMoE in
        training mode)."""
        if self.spec.train_refused is not None and r.training:
            raise ValueError(f"[hf] {self.name}: {self.spec.train_refused}")

    def _bias(self, s, r, passed):
        """The selection-only bias (a tensor added to the scores for the choice), or None."""
        if s.select_bias_if is not None and not getattr(r, s.select_bias_if):
            return None
        if s.select_bias in ("e_score_correction_bias", "balancing_biases"):
            return getattr(r, s.select_bias)
        if s.select_bias == "passed":
            return passed[0] if passed else None
        return None

    def _select(self, s, r, choice, K, block):
        """The family's selection on detached scores (bias added) -> ids [T, K] int64."""
        if s.select_bias == "moe_statics":
            choice = r.moe_statics(choice)
        if s.group is not None and self._grouped(r):
            E, G = self.num_experts(r, block), int(r.num_group)
            grouped = choice.view(-1, G, E // G)
            if s.group == "top2_sum":
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            group_idx = torch.topk(group_scores, k=int(r.topk_group), dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
            choice = choice.masked_fill(~score_mask.bool(), s.group_mask)
        return torch.topk(choice, K, dim=-1, sorted=s.sorted_topk)[1]

    def _grouped(self, r):
        if self.spec.group_if is None:
            return True
        attr, value = self.spec.group_if
        return getattr(r, attr) is not None if value == SET else getattr(r, attr) == value

    def _sparsemixer(self, r, z, replay_ids, replay_mask, live=None):
        """PhiMoE's sparse mixer in eval mode (K = 2): slot 1 is the best expert, slot 2 the best
        of the others; each slot's weight is a softmax over the experts whose logit is within a
        relative 2·eps of the slot's own (the others, and slot 1's expert for slot 2, masked).
        Replayed ids take the same formula with their own logits as the thresholds."""
        def own():
            first = z.max(dim=-1, keepdim=True)[1]
            second = z.scatter(-1, first, float("-inf")).max(dim=-1, keepdim=True)[1]
            return torch.cat((first, second), dim=-1)
        ids = _ids(lambda: own(), replay_ids, replay_mask, live)
        eps2 = 2 * float(r.router_jitter_noise)
        weights = []
        masked_before = z
        for k in range(ids.shape[1]):
            i = ids[:, k:k + 1]
            with torch.no_grad():
                t = z.gather(-1, i)
                drop = ((t - z) / z.abs().clamp(min=t)) > eps2
            gates = torch.softmax(masked_before.masked_fill(drop, float("-inf")), dim=-1)
            weights.append(gates.gather(-1, i))
            masked_before = torch.scatter(masked_before, -1, i, float("-inf"))
        return torch.cat(weights, dim=-1), ids

    def route(self, r, logits, replay_ids, replay_mask, passed=(), block=None, live=None,
              native_rows=None, scores_out=None):
        """-> (weights [T, K], ids [T, K] int64); replayed rows take replay_ids (replay_mask
        None: every row); ``live``: None, or a list that receives the family's own ids (``_ids``);
        ``native_rows``: None, or the rows replay_mask leaves out as an int64 index (``_ids``);
        ``scores_out``: None, or a list that receives the scores over all experts where the
        family's weights are gathered from them (what ``outputs`` returns for a family whose
        router returns its scores, the same op on the same logits)."""
        s = self.spec_for(r)
        sd = _sdt(logits)
        K = self.top_k(r, block)
        z = logits
        if s.score == "sparsemixer":
            return self._sparsemixer(r, z, replay_ids, replay_mask, live)
        bias = self._bias(s, r, passed)
        if s.score == "logsigmoid_topk":
            return self._logsigmoid_topk(s, r, z, bias, K, replay_ids, replay_mask, live)
        if s.score == "product_key":
            weights, ids = self._product_key(s, r, z, K, replay_ids, replay_mask, live)
        elif s.score in ("softmax_topk", "sigmoid_dense", "sigmoid_topk"):
            choice = z if bias is None else z + bias
            ids = _ids(lambda: torch.topk(choice.detach(), K, dim=-1, sorted=s.sorted_topk)[1],
                       replay_ids, replay_mask, live,
                       lambda rows: torch.topk(choice.detach()[rows], K, dim=-1,
                                               sorted=s.sorted_topk)[1], native_rows)
            weights = z.gather(1, ids)
            if s.score == "softmax_topk":
                weights = F.softmax(weights, dim=-1,
                                    dtype=sd if s.score_in_fp32 else weights.dtype)
            elif s.score == "sigmoid_topk":
                weights = weights.sigmoid()
        else:
            scores = self._scores(s, r, z, sd)
            if scores_out is not None:
                scores_out.append(scores)
            if s.select == "hash":
                ids = _ids(lambda: r.tid2eid[passed[0].reshape(-1)].long(), replay_ids,
                           replay_mask, live,
                           lambda rows: r.tid2eid[passed[0].reshape(-1)[rows]].long(),
                           native_rows)
            else:
                def choice(rows=None):
                    c = scores.detach()
                    c = c.to(sd) if s.select_in_fp32 and c.dtype != sd else c
                    c = c if bias is None else c + bias
                    return c if rows is None else c[rows]
                ids = _ids(lambda: self._select(s, r, choice(), K, block), replay_ids,
                           replay_mask, live,
                           lambda rows: self._select(s, r, choice(rows), K, block), native_rows)
            weights = scores.gather(1, ids)
        if s.renorm != "none" and (s.renorm_if is None or
                                   _attr(r, s.renorm_if, block) not in (None, False, 0)):
            if s.renorm == "pnorm":
                total = torch.norm(weights, p=_attr(r, s.renorm_if, block), dim=-1, keepdim=True)
            else:
                total = weights.sum(dim=-1, keepdim=True)
            if s.renorm == "sum_eps":
                total = total + s.renorm_eps
            elif s.renorm == "clamp":
                total = torch.clamp(total, min=r.norm_min)
            weights = weights / total
        if s.expert_scale is not None:
            weights = weights * getattr(r, s.expert_scale)[ids]
        if s.scale is not None:
            weights = weights * getattr(r, s.scale)
        if s.scale_param is not None:
            weights = weights * getattr(r, s.scale_param).to(sd)
        if s.weights_dtype == "logits":
            weights = weights.to(logits.dtype)
        return weights, ids

    @staticmethod
    def _shared(s, r):
        """The number of shared slots S (the gate's last S rows), 0 without."""
        return 0 if s.shared_slots is None else int(getattr(r, s.shared_slots))

    def _logsigmoid_topk(self, s, r, z, bias, K, replay_ids, replay_mask, live=None):
        """Inkling: the K best sigmoid scores of the routed experts (+ bias) are selected; the
        weights are a softmax over the K selected and the S shared slots of their log-sigmoid
        logits, × scale × scale_param -> (weights [T, K + S], ids [T, K])."""
        sd = _sdt(z)
        S = self._shared(s, r)
        routed = z[..., :z.shape[-1] - S]

        def select():
            choice = z.sigmoid()[..., :z.shape[-1] - S]
            choice = choice if bias is None else choice + bias.to(sd)
            return torch.topk(choice, K, dim=-1, sorted=s.sorted_topk)[1]
        ids = _ids(select, replay_ids, replay_mask, live)
        slots = torch.cat([routed.gather(-1, ids), z[..., z.shape[-1] - S:]], dim=-1)
        log_probs = F.logsigmoid(slots)
        weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
        if s.scale is not None:
            weights = weights * getattr(r, s.scale)
        if s.scale_param is not None:
            weights = weights * getattr(r, s.scale_param).to(sd)
        return weights, ids

    def _product_key(self, s, r, z, K, replay_ids, replay_mask, live=None):
        """Product-key routing (Doge's DogeCDMoE): the [T, 2n] logits viewed as (2, T, n) as the
        family's block views its [B, S, 2n] logits, so row t's x and y sub-key scores are rows t
        of the two halves of the flat logits (tokens t // 2 and (T + t) // 2: the choice mixes
        tokens, as the family's does); the family's selection (all n sub-keys sorted per half,
        the n² sums x_i + y_j at ids i·n + j, the K best) for the rows not replayed; the weights
        are the sums at the final ids, recomputed from these live logits (so replayed rows'
        gradients reach the gate), softmax over the K -> (weights [T, K], ids [T, K])."""
        n = int(_attr(r, s.keys))
        T = z.shape[0]
        xy = z.view(2, T, n)

        def select():
            (sx, sy), (ix, iy) = xy.topk(n, dim=-1)
            sums = (sx.unsqueeze(-1) + sy.unsqueeze(-2)).view(T, -1)
            keyed = (ix.unsqueeze(-1) * n + iy.unsqueeze(-2)).view(T, -1)
            return keyed.gather(-1, sums.topk(K, dim=-1)[1])
        ids = _ids(select, replay_ids, replay_mask, live)
        scores = xy[0].gather(1, ids // n) + xy[1].gather(1, ids % n)
        return F.softmax(scores, dim=-1, dtype=_sdt(z) if s.score_in_fp32 else scores.dtype), ids

    def _cdmoe(self, r, logits, weights, ids, x):
        """Doge's DogeCDMoE after its route, its ops in its order: the experts are the rows of
        down_embed and up_embed at the ids (token t's row t), act(down·x) × weights combined over
        up, plus the shared MLP -> (hidden states [B, S, H], the (2, T, n) logits)."""
        bsz, seq_len, _ = x.shape
        T = bsz * seq_len
        down_embed = r.down_embed(ids)
        up_embed = r.up_embed(ids)
        experts_weights = torch.matmul(down_embed, x.view(T, -1, 1)).view(T, -1)
        experts_weights = r.act_fn(experts_weights) * weights
        experts_states = torch.matmul(experts_weights.view(T, 1, -1), up_embed).view(
            bsz, seq_len, -1)
        hidden_states = r.down_proj(r.act_fn(r.gate_proj(x)) * r.up_proj(x))
        return hidden_states + experts_states, logits.view(2, T, -1)

    def _expert_groups(self, r, logits, weights, ids):
        """The route as the family's block takes it when its experts run on contiguous groups
        (JetMoE): the T·K slots sorted by expert (the slot order), the token of each sorted slot,
        its weight, the number of slots per expert (a list, the experts' split sizes) and the
        logits; the family's own ops, so bitwise its outputs for the same (weights, ids)."""
        E, K = self.num_experts(r), ids.shape[1]
        counts = torch.zeros([weights.size(0), E], dtype=weights.dtype, device=weights.device)
        expert_size = counts.scatter(1, ids, 1).long().sum(0).tolist()
        _, slot_order = ids.flatten().sort(0)
        token = slot_order.div(K, rounding_mode="trunc")
        return slot_order, token, weights.flatten()[slot_order], expert_size, logits

    @staticmethod
    def _scores(s, r, z, sd):
        """The scores over all experts [T, E] of the (scaled, capped) logits."""
        if s.score == "sigmoid":
            return (z.to(sd) if s.score_in_fp32 else z).sigmoid()
        if s.score == "fn":
            return r.score_fn(z)
        if s.score_in_fp32:
            return F.softmax(z, dim=-1, dtype=sd)
        return z.softmax(-1)

    def module_logits(self, r, h, hidden_states, passed, named, native):
        """(logits, state or None) of a family whose gate's output h [T, D] passes through a
        module (gate_module): + the carried state × scale (carried_state), the module run on it
        (its parameters cast to h's dtype when patched); the state returned per token,
        [..., D] as the hidden states' leading dimensions."""
        s = self.spec
        state_in = named.get("router_states", passed[0] if passed else None)
        if s.carried_state is not None and state_in is not None and \
                getattr(r, s.carried_state_if):
            h = h + state_in.reshape(h.shape) * getattr(r, s.carried_state)
        state = None
        if s.carried_state is not None:
            state = h.view(*hidden_states.shape[:-1], h.shape[-1]).clone()
        mod = _attr(r, s.gate_module)
        if native:
            return mod(h), state
        params = {n: q.to(h.dtype) for n, q in mod.named_parameters()}
        return torch.func.functional_call(mod, params, (h,)), state

    def outputs(self, r, logits, weights, ids, x, native, scores=None):
        """What the family's router returns, from the routing's logits, weights and ids (x: the
        hidden states; ``scores``: None, or route's scores_out, for a family that returns its
        scores: reused instead of computed again)."""
        s = self.spec_for(r)
        if s.skip_expert:  # the skip class's slots: id 0, weight 0 for the experts
            skip = ids == self.num_experts(r) - 1
            weights, ids = weights.masked_fill(skip, 0), ids.masked_fill(skip, 0)
        if s.score == "sigmoid_dense":
            # Llama-4: dense scores [T, E], sigmoid of the selected logits, 0 elsewhere (sigmoid
            # of -inf), and the logits. Unpatched: sigmoid in fp32, back to the logits' dtype;
            # patched, the scores multiply the experts' input, so the hidden states' dtype.
            scores = torch.full_like(logits, float("-inf")).scatter_(1, ids, weights)
            out_dtype = scores.dtype if native else x.dtype
            return torch.sigmoid(scores.to(_sdt(scores))).to(out_dtype), logits
        if s.weights_dtype == "hidden":
            weights = weights.to(x.dtype)
        elif s.weights_dtype == "hidden_fp32" and native:
            weights = weights.to(x.dtype).float()
        if s.inline == "cdmoe":  # the block's own experts (the patched forward is the block's)
            return self._cdmoe(r, logits, weights, ids, x)
        if s.returns == "logits":
            return weights, ids
        if s.returns == "expert_groups":
            return self._expert_groups(r, logits, weights, ids)
        S = self._shared(s, r)
        if S:  # (routed logits, K routed weights, ids, S shared weights)
            K = ids.shape[1]
            return (logits[..., :logits.shape[-1] - S], weights[..., :K].contiguous(), ids,
                    weights[..., K:].contiguous())
        if s.returns == "scores":  # the same ops as route's: bitwise its scores
            if scores is None:
                scores = self._scores(s, r, logits, _sdt(logits))
            return scores, weights, ids
        return logits, weights, ids


_ALL = [Family(s) for s in SPECS]
FAMILIES = {}
for _f in _ALL:  # a family with several router classes (variants) is keyed by its first spec
    FAMILIES.setdefault(_f.name, _f)
"""The supported families: {transformers model_type: Family} (each reads its RoutingSpec; a
family whose model has several router classes has one spec per class, e.g. DeepSeek-V4's hash
layers, found by ``_family_of``)."""
COMBINE_DTYPE = {f.title: f.combine_dtype for f in FAMILIES.values()}
"""Dtype of the combine weights each family's patched router returns (router_dtype set):
{family name: "router_dtype", "router_dtype (fp32 unpatched too)" or "hidden dtype"}."""


def _family_of(module):
    for cls in type(module).__mro__:  # FSDP2 subclasses the module's class: look through it
        for fam in _ALL:
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
