"""Every supported family (switchyard.integrations.hf.FAMILIES, so a family added to spec.py is
swept here without an edit) under torch.compile(fullgraph=True): the patched model, with the
family's own router math (router_dtype=None) and with the fp32 engine gate, compiles to one graph
(a graph break fails fullgraph) and routes and captures the ids eager routes; with the fp32 router
(R3's setting) it also replays a step's targets as eager does (replayed rows take the targets, the
others the family's own choice); counts as eager. The representative families' generate() with a
compiled forward and torch.export beyond test_compile_hf.py's are at the end.

backend="eager" (dynamo's trace, run by the eager kernels: no AOT or code generation) keeps the
sweep at about 3 traces per family. The native variant (router_dtype=None: the family's own router
math, traced through switchyard's routed forward) runs once per distinct routing spec (a lead family
or the first by name: 41 of 75 with transformers 5.25); the fp32 variant traces every family's
modeling around the same patch, so a second family of a spec adds nothing its fp32 trace and the
spec's native trace do not already cover (about 2 min of CPU saved). test_compile_hf.py compiles
the representative families with aot_eager (the operators' fake kernels and registered autograd),
exports them and generates.
SWITCHYARD_COMPILE_SHARD="i/n" runs every n-th family from the i-th (the ctest entries split the
sweep so each stays well inside its timeout); unset, all families run."""
import dataclasses
import os

import pytest
import torch

pytest.importorskip("transformers")  # an optional dependency of switchyard

import switchyard.integrations.hf as syhf  # noqa: E402
from hf_models import build, check_generate_with_a_compiled_forward, tokens  # noqa: E402

_MODEL = {"llama4": "llama4_text"}
"""The tiny model (hf_models) of a family whose key is not its model_type."""

TRANSFORMERS_BREAKS = {
    "dbrx": "transformers' DbrxExperts loops over torch.nonzero() of the experts hit (a "
            "data-dependent length): the unpatched model breaks the graph there too (10 breaks in "
            "2 layers, transformers 5.25); the patched router adds none "
            "(test_transformers_breaks_are_its_own)",
    "qwen4_exp": "transformers' Qwen4-Exp selects tokens with torch.nonzero() in its "
                 "_select_tokens (a data-dependent length): the unpatched model breaks the graph "
                 "there too (13 breaks, transformers 5.25); the patched router adds none "
                 "(test_transformers_breaks_are_its_own)",
}
"""Families whose unpatched model does not compile to one graph: transformers' own code, not
switchyard's; skipped by the sweep with the reason."""


FORWARD_KWARGS = {
    "inkling2_loop": dict(use_cache=False),
}
"""The sweep's forward arguments of a family whose cached forward transformers does not compile:
Inkling2-Loop's deep-copies the loop layers' cache layers for its later passes (copy.deepcopy of
tensors, which dynamo does not trace: the unpatched model breaks the graph there, transformers
5.25); without a cache (training, log-probs) it compiles to one graph, patched too."""


def _shard():
    """(i, n) from SWITCHYARD_COMPILE_SHARD="i/n", or (0, 1)."""
    shard = os.environ.get("SWITCHYARD_COMPILE_SHARD")
    if not shard:
        return 0, 1
    i, n = (int(v) for v in shard.split("/"))
    return i, n


def _families():
    i, n = _shard()
    return sorted(syhf.FAMILIES)[i::n]


DTYPES = {"native": None, "fp32": torch.float32}

_NAMES = {"model_type", "title", "router_class", "models", "module"}
"""RoutingSpec fields that name a family rather than say what its router computes."""


def _routing_math(family):
    """What a family's native routed forward reads: its spec less the names (attribute paths
    stay: a different path is a different trace)."""
    spec = syhf.FAMILIES[family].spec
    return tuple((f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec)
                 if f.name not in _NAMES)


_LEADS = ("deepseek_v3", "qwen3_moe", "mixtral", "qwen3_5_moe", "deepseek_v2")
"""The most-trained families: each is its routing spec's native case."""


def _cases():
    """(family, variant) of this shard: fp32 for every family, native for one family of each
    routing spec (a lead family, else the first by name)."""
    first = {}
    for family in [*_LEADS, *sorted(syhf.FAMILIES)]:
        first.setdefault(_routing_math(family), family)
    native = set(first.values())
    return [(f, d) for f in _families() for d in DTYPES if d == "fp32" or f in native]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test compiles new models of the same code (recompile limit)
    yield
    torch._dynamo.reset()


def _targets(p, B, S, seed):
    # R3 targets: K distinct experts per row (a layer with a smaller K: -1 past its own), every
    # 3rd token -1 (routed by the family itself).
    g = torch.Generator().manual_seed(seed)
    M, K, E = len(p.layers), p.top_k, p.num_experts
    t = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S * M)])
    t = t.view(B, S, M, K)
    for m, k in enumerate(p.top_ks.values()):
        t[..., m, k:] = -1
    t[:, ::3] = -1
    return t


def _halves(cap, p):
    # The captured ids of the two forwards (eager, then compiled), each [T, moe_layers, K] in
    # token order (the capture lays forwards out along the sequence, [B, 2S]).
    ids = cap.ids()[:, :, p.layers]
    n = ids.shape[1] // 2
    return (ids[:, :n].reshape(-1, *ids.shape[2:]), ids[:, n:].reshape(-1, *ids.shape[2:]))


def _first(out):
    return out[0]  # logits (a causal LM) or last_hidden_state (a text backbone)


def _tol(ref):
    # backend="eager" runs the same kernels in the same order; allow the few-ulp reorderings a
    # traced graph may still make (n·eps of the largest magnitude, n = 64), far below a change
    # of route.
    return 64 * torch.finfo(torch.float32).eps * float(ref.abs().max())


@pytest.mark.parametrize("family,router_dtype", _cases())
def test_every_family_compiles_fullgraph_routes_replays_and_captures_as_eager(family,
                                                                               router_dtype):
    from torch._dynamo.testing import CompileCounterWithBackend
    if family in TRANSFORMERS_BREAKS:
        pytest.skip(TRANSFORMERS_BREAKS[family])
    model = build(_MODEL.get(family, family))
    p = syhf.patch(model, router_dtype=DTYPES[router_dtype])
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    B, S = 2, 7
    x = tokens(B, S, seed=1)
    kw = FORWARD_KWARGS.get(family, {})
    with torch.no_grad():
        # Natively routed, captured: one forward eager, one compiled.
        with p.capture() as cap:
            ye = _first(model(x, **kw))
            yc = _first(compiled(x, **kw))
        # (fullgraph=True: a graph break raises. A text backbone, the outermost module, runs its
        # step hooks as a second frame, also fullgraph.)
        assert 1 <= counter.frame_count <= 2
        eager_ids, compiled_ids = _halves(cap, p)
        assert torch.equal(compiled_ids, eager_ids)
        assert (yc - ye).abs().max() <= _tol(ye)
        c = p.counts()  # the compiled forward counted as its eager twin
        assert all(c[l]["num_calls"] == 2 and c[l]["num_native_rows"] == 2 * B * S
                   for l in p.layers), c
        if router_dtype != "fp32":  # R3 runs with the fp32 router (the RL setting)
            return
        # R3: the same targets replayed eager, then compiled, captured.
        t = _targets(p, B, S, seed=2)
        with p.capture() as cap:
            p.set_targets(t)
            ye = _first(model(x, **kw))
            p.set_targets(t)
            yc = _first(compiled(x, **kw))
        eager_ids, compiled_ids = _halves(cap, p)
        assert torch.equal(compiled_ids, eager_ids)
        t = t.view(-1, *t.shape[2:])
        rows = t[..., 0] >= 0
        assert torch.equal(compiled_ids[rows], t[rows].to(compiled_ids.dtype))
        assert (yc - ye).abs().max() <= _tol(ye)
    c = p.counts()
    replayed = int(rows[:, 0].sum())  # per layer (the same tokens in every layer)
    assert all(c[l]["num_calls"] == 4 and c[l]["num_replayed_rows"] == 2 * replayed and
               c[l]["num_native_rows"] == 2 * B * S + 2 * (B * S - replayed)
               for l in p.layers), c


@pytest.mark.parametrize("family", sorted(TRANSFORMERS_BREAKS))
def test_transformers_breaks_are_its_own(family):
    """A skipped family's graph breaks are all in its transformers modeling file (DBRX's experts
    loop, Qwen4-Exp's token selection): the patched model, capturing, breaks nowhere else."""
    if family not in _families():
        pytest.skip(f"{family} is in another shard")
    model = build(_MODEL.get(family, family))
    p = syhf.patch(model, router_dtype=torch.float32)
    with torch.no_grad(), p.capture():
        ex = torch._dynamo.explain(model)(tokens(2, 7))
    assert ex.graph_break_count > 0, f"transformers fixed it: drop {family} from the skips"
    for b in ex.break_reasons:  # the innermost frame of each break: the family's own code
        frame = b.user_stack[-1]
        assert frame.filename.endswith(f"modeling_{family}.py"), (str(b.reason), frame)


# ---- representative families beyond test_compile_hf.py's (one shard runs them) ----
def _representative():
    i, n = _shard()
    if i != n - 1:
        pytest.skip("the representative families run in the last shard")


# Sigmoid + group-limited selection, top-k of the logits then softmax (with a router bias), PhiMoE's
# sparse mixer. (DeepSeek-V4's hash layers: transformers' static cache does not build for its
# attention, KeyError 'heavily_compressed_attention', so generate() compiles no forward there; its
# compile is swept above and exported below.)
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "phimoe"])
def test_generate_with_a_compiled_forward_captures_as_eager_across_families(family):
    _representative()
    check_generate_with_a_compiled_forward(family, "eager")


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids, use_cache=False)[0]


# Top-k of the logits then softmax (router bias); DeepSeek-V4 (hash layers: the experts indexed by
# the input ids, score_fn + correction bias in the others); PhiMoE's sparse mixer.
@pytest.mark.parametrize("family,router_dtype", [("gpt_oss", "fp32"), ("deepseek_v4", "native"),
                                                 ("phimoe", "fp32")])
def test_export_static_and_dynamic_prefill_and_decode_across_families(family, router_dtype):
    from torch.export import Dim
    _representative()
    model = build(family)
    p = syhf.patch(model, router_dtype=DTYPES[router_dtype])
    m = _Logits(model)
    prompt = tokens(2, 7)
    with torch.no_grad():
        m(prompt)  # an eager prefill first (its counts stay Python ints)
        static = torch.export.export(m, (prompt,))
        ref = m(prompt)
        assert (static.module()(prompt) - ref).abs().max() <= _tol(ref)
        prefill = torch.export.export(m, (prompt,), dynamic_shapes=({1: Dim("S", min=2, max=64)},))
        decode = torch.export.export(m, (tokens(3, 1, seed=1),),
                                     dynamic_shapes=({0: Dim("B", min=2, max=16)},))
        for x, ep in ((tokens(2, 12, seed=4), prefill), (tokens(5, 1, seed=6), decode),
                      (tokens(2, 1, seed=7), decode)):
            ref = m(x)
            assert (ep.module()(x) - ref).abs().max() <= _tol(ref), list(x.shape)
    c = p.counts()
    assert all(type(v) is int for cl in c.values() for v in cl.values())
    assert all(c[l]["num_calls"] == 1 + 1 + 3 for l in p.layers), c  # eager calls only


def test_capture_keeps_the_batch_of_decoder_inputs_with_streams_eager_and_compiled():
    # DeepSeek-V4's decoder layers take [B, S, hc, H] (hyper-connection streams) and route B * S
    # tokens: the capture lays them out [B, S] as for any family, eager and compiled.
    _representative()
    model = build("deepseek_v4")
    p = syhf.patch(model, router_dtype=torch.float32)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x = tokens(2, 7, seed=5)
    with torch.no_grad(), p.capture() as cap:
        model(x)
        compiled(x)
    ids = cap.ids()
    assert list(ids.shape) == [2, 14, p.num_hidden_layers, p.top_k]
    assert torch.equal(ids[:, 7:], ids[:, :7])
    assert torch.equal(cap.expert_ids(), ids[:, :7])  # the experts hooks observe eager forwards


def test_ernie4_5_vl_moe_refuses_vision_tokens_under_compile_and_routes_them_eagerly():
    # The block splits the tokens between the text and the vision experts' routers by a
    # data-dependent mask: a compiled forward given token types is refused (dynamo's fallback
    # that runs the block eagerly inside the compiled forward too), the eager forward routes it.
    _representative()
    model = build("ernie4_5_vl_moe")
    p = syhf.patch(model, router_dtype=torch.float32)
    compiled = torch.compile(model, backend="eager")
    x = tokens(2, 7, seed=3)
    types = torch.zeros(2, 7, dtype=torch.long)
    types[0, 2:5] = 1
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"\[hf\] ernie4_5_vl_moe: a forward with "
                                             r"moe_mm_token_type_ids whose MoE block runs outside "
                                             r"an eager forward of the model"):
            compiled(x, moe_mm_token_type_ids=types)
        with p.capture() as cap:
            model(x, moe_mm_token_type_ids=types)
    assert cap.num_split_forwards == len(p.layers)
    assert all(c["num_calls"] == 1 and c["num_native_rows"] == x.numel()
               for c in p.counts().values()), p.counts()
