"""The public surface (issue 26, docs/deprecations.md): one result type for topk_route, its options
grouped as the engine's structs, old call forms refused with an error that names the new form."""
import pytest
import torch

import switchyard as sy
import switchyard.torch as syt


def _cfg():
    return sy.RouterConfig(num_experts=8, top_k=2)


def test_topk_route_returns_one_result_type_whatever_the_options():
    z = torch.randn(5, 8, dtype=torch.float64)
    plain = syt.topk_route(z, _cfg())
    grouped = syt.topk_route(z, _cfg(), syt.RouteInputs(padding_mask=torch.zeros(5, dtype=bool)),
                             syt.RouteOptions(layer=3, training=False), syt.RouteComms())
    for r in (plain, grouped):
        assert isinstance(r, syt.TopKRoute) and len(r) == 3
        assert r.weights.shape == (5, 2) and r.weights.dtype == torch.float64
        assert r.idx.shape == (5, 2) and r.idx.dtype == torch.int64
        assert isinstance(r.info, syt.RouteInfo) and r.info.num_native_rows == 5
    assert torch.equal(plain.idx, grouped.idx)
    w, idx, info = plain  # a named tuple: unpacks as (weights, idx, info)
    assert w is plain.weights and idx is plain.idx and info is plain.info


def test_topk_route_keeps_leading_dims():
    r = syt.topk_route(torch.randn(2, 3, 8), _cfg())
    assert r.weights.shape == (2, 3, 2) and r.idx.shape == (2, 3, 2)


@pytest.mark.hostile(tried="topk_route(logits, cfg, replay_idx=ids) (the old flat keywords)",
                     gets="TypeError naming the group: inputs=switchyard.torch.RouteInputs("
                          "replay_idx=...)")
@pytest.mark.parametrize("kw,group,cls,field", [
    ("replay_idx", "inputs", "RouteInputs", "replay_idx"),
    ("expert_bias", "inputs", "RouteInputs", "expert_bias"),
    ("seq_length", "options", "RouteOptions", "seq_length"),
    ("aux_loss_grad_scale", "options", "RouteOptions", "aux_loss_grad_scale"),
    ("loss_comm", "comms", "RouteComms", "loss"),
    ("global_aux_loss_comm", "comms", "RouteComms", "global_aux_loss"),
])
def test_topk_route_old_flat_keyword_names_its_group(kw, group, cls, field):
    with pytest.raises(TypeError, match=rf"\[topk_route\] keyword '{kw}' moved into the {group} "
                                        rf"group: pass {group}=switchyard.torch.{cls}\({field}="):
        syt.topk_route(torch.zeros(2, 8), _cfg(), **{kw: None})


@pytest.mark.hostile(tried="topk_route(..., return_info=True)",
                     gets="TypeError: return_info was removed, the result is always "
                          "TopKRoute(weights, idx, info)")
def test_topk_route_return_info_is_refused():
    with pytest.raises(TypeError, match=r"return_info was removed: topk_route always returns a "
                                        r"TopKRoute\(weights, idx, info\)"):
        syt.topk_route(torch.zeros(2, 8), _cfg(), return_info=True)


@pytest.mark.hostile(tried="topk_route(logits, cfg, expert_bias, replay_idx) (the old positional "
                           "form)",
                     gets="TypeError: inputs must be a RouteInputs, naming the new form")
def test_topk_route_old_positional_form_is_refused():
    with pytest.raises(TypeError, match=r"\[topk_route\] inputs must be a switchyard.torch."
                                        r"RouteInputs or None, got Tensor"):
        syt.topk_route(torch.zeros(2, 8), _cfg(), torch.zeros(8))
    with pytest.raises(TypeError, match=r"options must be a switchyard.torch.RouteOptions or "
                                        r"None, got Tensor"):
        syt.topk_route(torch.zeros(2, 8), _cfg(), None, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"comms must be a switchyard.torch.RouteComms or None, "
                                        r"got str"):
        syt.topk_route(torch.zeros(2, 8), _cfg(), None, None, "native")


def test_route_groups_are_frozen():
    o = syt.RouteOptions(layer=2)
    with pytest.raises(Exception):
        o.layer = 3


def test_public_modules_hold_no_test_hooks():
    import switchyard._switchyard as extension
    import switchyard._testing as sy_testing
    for hook in ("_borrow_device", "_borrow_info", "_clone", "_full"):
        assert not hasattr(extension, hook), hook
    for probe in ("borrow_device", "borrow_info", "clone", "full"):
        assert callable(getattr(sy_testing, probe)), probe
        assert not hasattr(sy, probe) and not hasattr(syt, probe), probe


@pytest.mark.hostile(tried="handle.rank_expert_counts / handle.plan on a DispatchHandle (engine "
                           "internals)",
                     gets="AttributeError: the handle is opaque, read through its documented "
                          "accessors")
def test_dispatch_handle_is_opaque_with_documented_accessors():
    E, K, T, H = 4, 2, 6, 3
    z = torch.randn(T, E)
    w, idx, _ = syt.topk_route(z, sy.RouterConfig(num_experts=E, top_k=K))
    disp = syt.AllGatherDispatcher(num_experts=E)
    recv_x, recv_w, h = disp.dispatch(torch.randn(T, H), topk_weights=w, topk_idx=idx)
    assert h.num_recv_tokens == recv_x.shape[0] == T * K and h.num_tokens == T
    assert h.num_tokens_per_expert.dtype == torch.int64 and h.num_tokens_per_expert.shape == (E,)
    assert int(h.num_tokens_per_expert.sum()) == h.num_recv_tokens
    assert h.expert_offsets.shape == (E + 1,) and h.recv_src_token.shape == (T * K,)
    assert (h.kind, h.rank, h.world_size, h.num_local_experts) == ("all_gather", 0, 1, E)
    for internal in ("rank_expert_counts", "rank_expert_rows", "rank_num_tokens", "plan",
                     "num_pairs", "recv_gather_index", "layout_id"):
        with pytest.raises(AttributeError, match=f"'DispatchHandle' object has no attribute "
                                                 f"'{internal}'"):
            getattr(h, internal)
    with pytest.raises(AttributeError, match="'tokens_per_expert' was renamed"):
        h.tokens_per_expert
    with pytest.raises(AttributeError):
        h.num_recv_tokens = 3


# ---- the deliberate list of public names (issue 31) ----------------------------------------------
PUBLIC_NAMES = {
    "switchyard": ["BackendError", "DataError", "GlobalAuxLossState", "RouterConfig",
                   "RouterReplay", "built_with_cuda", "cpu_isa", "cuda_device_count",
                   "num_threads", "set_cpu_isa", "set_num_threads", "dist", "replay", "routes"],
    "switchyard.replay": ["POLICIES", "check_policy", "NATIVE", "REPLAYED", "INVALID", "MERGED",
                          "ReplayRows", "classify_rows", "ReplayCounts", "RouterReplay",
                          "ReplayDriver", "recompute_kind", "in_recompute", "will_recompute",
                          "raise_on_every_rank"],
    "switchyard.integrations": ["hf", "megatron", "trl", "verl"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC_NAMES))
def test_all_is_the_deliberate_list_and_true(module):
    import importlib
    import pathlib
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(PUBLIC_NAMES[module])
    here = pathlib.Path(mod.__file__).parent
    for name in mod.__all__:  # every name is there (a submodule: its file is)
        assert hasattr(mod, name) or (here / f"{name}.py").is_file() or \
            (here / name / "__init__.py").is_file(), f"{module}.{name}"


def test_each_public_object_has_one_spelling():
    # A re-export keeps its name (switchyard.RouterReplay is switchyard.replay.RouterReplay); no
    # object is public under two names.
    import switchyard.integrations.hf as syhf
    import switchyard.integrations.megatron as sym
    names = {}
    for mod in (sy, sy.replay, syt, sy.routes, sy.dist, syhf, sym):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if callable(obj):
                names.setdefault(id(obj), set()).add(name)
    assert all(len(v) == 1 for v in names.values()), [sorted(v) for v in names.values()
                                                      if len(v) > 1]


@pytest.mark.hostile(tried="sy.classify_replay_rows (a second spelling of "
                           "sy.replay.classify_rows) or megatron attach_replay(repeated_ids=) "
                           "(removed in 0.3.0)",
                     gets="AttributeError; TypeError naming invalid_replay_rows")
def test_removed_spellings_are_gone_or_name_the_one_spelling():
    assert not hasattr(sy, "classify_replay_rows")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import switchyard.integrations.megatron as sym
    with pytest.raises(TypeError, match=r"\[megatron.attach_replay\] keyword argument "
                                        r"'repeated_ids' was renamed 'invalid_replay_rows'"):
        sym.attach_replay(torch.nn.Linear(2, 2), repeated_ids="merge")
