"""switchyard.integrations.hf.families: each supported transformers MoE family's router -- where it
is, its gate parameters and its routing math -- and the gate (switchyard's engine or a torch GEMM in
router_dtype). Used by ``patch`` (the patched router forward); see the package docstring."""
import contextlib

import torch
import torch.nn.functional as F

import switchyard.torch as syt


def _sdt(logits):
    """The dtype the routing math runs in: fp32, or fp64 for fp64 logits (the families' code says
    ``dtype=torch.float``, which would round fp64 logits)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _ids(select, replay_ids, replay_mask):
    """The final ids: the family's live selection (run without autograd: ids are never
    differentiable, and the recompute of a replayed forward must save the same tensors as the
    forward did) for the rows not replayed, replay_ids for the replayed rows."""
    # (Traced by torch.compile: no data-dependent branch; where() gives the same ids.)
    if replay_ids is not None and not torch.compiler.is_compiling() and bool(replay_mask.all()):
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
"""The supported families: {transformers model_type: family} (each family knows its router
class, where the router sits and its routing math)."""
COMBINE_DTYPE = {f.title: f.combine_dtype for f in FAMILIES.values()}
"""Dtype of the combine weights each family's patched router returns (router_dtype set):
{family name: "router_dtype", "router_dtype (fp32 unpatched too)" or "hidden dtype"}."""


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
