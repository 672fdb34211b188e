"""switchyard's verl Megatron engine (SwitchyardMegatronEngine): verl's Megatron micro-batch
(jagged routed_experts, THD packing) -> switchyard.integrations.megatron's keyed, validated replay
targets, applied to real Megatron-Core MoE layers on the CPU.

verl 0.9.1's Megatron engine itself cannot be initialised here: its initialize() builds the model
through Megatron-Bridge (`from megatron.bridge import AutoBridge`; use_mbridge must be True), which
is not installed (it needs Transformer Engine / CUDA). Its construction (device mesh on gloo) and
registry lookup are tested; the forward path is tested from the micro-batch on."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # megatron_shims / megatron_workers

import megatron_shims  # noqa: E402
import megatron_workers as mw  # noqa: E402

import switchyard.integrations.megatron as sym  # noqa: E402
import switchyard.integrations.verl as syverl  # noqa: E402

E, K, L = mw.E, mw.K, 2


@pytest.fixture(scope="module")
def layers():
    megatron_shims.install()  # Megatron-Core's MoE layer on CPU tensors (each shim says why)
    sym.apply()
    pg, _, _ = mw._groups(0, 1)
    cfg = mw._config(1, num_layers=L)
    ls = [mw._layer(cfg, pg, layer_number=n) for n in (1, 2)]
    sym.attach_replay(ls, invalid_replay_rows="merge")
    yield ls
    sym.detach_replay(ls)


def micro_batch(lengths=(5, 7, 4), short=(1,), seed=3):
    """verl's jagged micro-batch: input_ids and routed_experts int16 [B, tokens, L, K]; the
    sequences in ``short`` have one route row fewer (the rollout's unrouted last token), and one
    zero row (a token the rollout never routed)."""
    g = torch.Generator().manual_seed(seed)
    ids, routes = [], []
    for b, n in enumerate(lengths):
        ids.append(torch.randint(3, 97, (n,), generator=g))
        r = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * L)]).view(n, L, K)
        r[1] = 0
        routes.append(r[:n - 1] if b in short else r)
    nest = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    return nest(ids), nest([r.to(torch.int16) for r in routes]), routes


def _targets(input_ids, routed, **kw):
    return syverl.megatron_replay_targets(routed, input_ids, num_experts=E, num_layers=L,
                                          moe_layer_freq=1, keys=[1, 2], **kw)


def test_megatron_targets_are_the_micro_batchs_routes_in_thd_order():
    input_ids, routed, routes = micro_batch()
    t = _targets(input_ids, routed, tp_size=2)  # THD: each sequence padded to a multiple of 2
    want = []
    for r, n in zip(routes, input_ids.offsets().diff().tolist()):
        rows = torch.full((n + n % 2, L, K), -1, dtype=torch.int32)
        rows[:len(r)] = r.to(torch.int32)
        rows[1] = -1  # the zero row: no route
        want.append(rows)
    want = torch.cat(want)
    assert set(t) == {1, 2}
    for k in (1, 2):
        assert torch.equal(t[k], want[:, k - 1])


def test_megatron_targets_split_for_sequence_and_context_parallel_ranks():
    input_ids, routed, _ = micro_batch()
    # the whole packed micro-batch, each sequence padded to 2 * tp * cp = 8 rows as verl pads it
    full = _targets(input_ids, routed, tp_size=8)
    pieces = [_targets(input_ids, routed, tp_size=2, cp_size=2, cp_rank=c, sequence_parallel=True,
                       tp_rank=r) for c in range(2) for r in range(2)]
    n = full[1].shape[0]
    assert all(p[1].shape[0] == n // 4 for p in pieces)
    # the CP ranks' zigzag pieces, each cut in SP blocks, cover every packed row once
    import switchyard as sy
    cu = [0]
    for m in input_ids.offsets().diff().tolist():
        cu.append(cu[-1] + -(-m // 8) * 8)
    for k in (1, 2):
        cps = [sy.routes.sp_gather([pieces[2 * c + r][k].unsqueeze(1) for r in range(2)])
               for c in range(2)]
        assert torch.equal(sy.routes.cp_zigzag_gather(cps, cu)[:, 0], full[k])


def test_replayed_ids_on_megatron_moe_layers_equal_the_micro_batchs_routes(layers):
    input_ids, routed, routes = micro_batch()
    t = _targets(input_ids, routed)
    T = t[1].shape[0]
    sym.set_replay_targets(layers, t)
    sym.set_replay_action(layers, "replay_forward")
    x = mw._tokens(0, T)
    try:
        for n, layer in zip((1, 2), layers):
            _, routing_map = layer.router(x.view(T, -1))
            used = routing_map.nonzero()
            got = torch.full((T, K), -1, dtype=torch.int64)
            for row in range(T):
                got[row] = routing_map[row].nonzero().view(-1)
            rows = t[n][:, 0] >= 0
            assert rows.sum() == T - 3 - 1  # a zero row in 3 sequences, 1 missing last row
            # mismatch exactly 0: every replayed row routes to the rollout's experts
            assert torch.equal(got[rows].sort(1).values, t[n][rows].long().sort(1).values)
            assert used.shape[0] == T * K
        counts = sym.replay_counts(layers)
        assert counts[1].replayed == T - 4 and counts[1].native == 4
    finally:
        sym.set_replay_action(layers, None)
        sym.clear_replay(layers)


@pytest.mark.hostile(tried="verl Megatron micro-batch whose routed_experts has an expert id >= "
                     "num_experts", gets="ValueError naming the layer and row before any router "
                     "runs; the next micro-batch replays normally")
def test_megatron_routes_with_an_id_out_of_range_are_refused_before_any_state(layers):
    input_ids, routed, _ = micro_batch()
    bad = routed.values().clone()
    bad[4, 1, 0] = E
    bad = torch.nested.nested_tensor_from_jagged(bad, routed.offsets())
    with pytest.raises(ValueError, match=r"\[0, 8\)|num_experts|out of range"):
        sym.set_replay_targets(layers, _targets(input_ids, bad))
    # nothing was queued: the next micro-batch's forward takes its own targets, not the bad ones
    test_replayed_ids_on_megatron_moe_layers_equal_the_micro_batchs_routes(layers)


@pytest.mark.hostile(tried="verl Megatron micro-batch whose routed_experts has the wrong layer "
                     "count or one token too many", gets="ValueError naming routed_experts and "
                     "the shapes, before any target is queued")
def test_megatron_routes_of_the_wrong_shape_are_refused():
    input_ids, routed, routes = micro_batch()
    with pytest.raises(ValueError, match=r"routed_experts must be .*num_layers=3"):
        syverl.megatron_replay_targets(routed, input_ids, num_experts=E, num_layers=3,
                                       moe_layer_freq=1, keys=[1, 2])
    longer = torch.nested.as_nested_tensor(
        [torch.cat([r, r[:2]]).to(torch.int16) for r in routes], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"routed_experts must be .*lengths"):
        _targets(input_ids, longer)
    with pytest.raises(ValueError, match=r"integer expert ids"):
        _targets(input_ids, torch.nested.nested_tensor_from_jagged(
            routed.values().float(), routed.offsets()))


def test_the_registry_gives_switchyards_megatron_engine_without_verls_replay_patch(monkeypatch):
    from verl.workers.engine import EngineRegistry
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "switchyard")
    cls = EngineRegistry.get_engine_cls("language_model", "megatron")
    assert cls is syverl.SwitchyardMegatronEngine
    # verl's own replay flag reads False whatever verl's __init__ assigns to it
    obj = cls.__new__(cls)
    obj.enable_routing_replay = True
    assert obj.enable_routing_replay is False


def test_the_engine_replays_a_micro_batchs_routes_without_verls_replay_patch(layers, monkeypatch,
                                                                            tmp_path):
    """SwitchyardMegatronEngine built by verl's registry (R3; construction runs verl's own
    __init__: device mesh on gloo) does not apply verl's router_replay_patch, and its per-micro-
    batch step (what forward_step runs before verl's forward) queues the micro-batch's routes on
    the forwarded chunk's routers. initialize() needs Megatron-Bridge (see the module), so the
    model is the two Megatron-Core MoE layers of the fixture, given as the engine's config and
    chunk."""
    import verl_cpu
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (EngineRouterReplayConfig, HFModelConfig, McoreEngineConfig,
                                     McoreOptimizerConfig)
    from verl.workers.engine import EngineRegistry
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "switchyard")
    megatron_shims.install()  # the engine's __init__ seeds Megatron's CUDA RNG tracker
    path = verl_cpu.tiny_qwen3_moe(tmp_path / "m", num_hidden_layers=L)
    eng = EngineRegistry.new(
        model_type="language_model", backend="megatron",
        model_config=HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=True),
        engine_config=McoreEngineConfig(strategy="megatron",
                                        router_replay=EngineRouterReplayConfig(mode="R3")),
        optimizer_config=McoreOptimizerConfig(lr=1e-2), checkpoint_config=CheckpointConfig())
    assert type(eng) is syverl.SwitchyardMegatronEngine
    assert eng.router_replay_mode == "R3" and eng.enable_routing_replay is False
    # verl's .item() dispatcher patch (and its TopKRouter patch) were never applied
    assert not hasattr(MoEAlltoAllTokenDispatcher, "_preprocess_patched")
    eng.tf_config = layers[0].config
    input_ids, routed, _ = micro_batch()
    from tensordict import TensorDict
    batch = TensorDict({"input_ids": input_ids, "routed_experts": routed}, batch_size=[3])
    eng.set_micro_batch_targets(batch, layers)
    want = _targets(input_ids, routed)
    T = want[1].shape[0]
    x = mw._tokens(0, T)
    try:
        for n, layer in zip((1, 2), layers):
            _, routing_map = layer.router(x.view(T, -1))
            rows = want[n][:, 0] >= 0
            got = torch.stack([routing_map[r].nonzero().view(-1) for r in range(T)])
            assert torch.equal(got[rows].sort(1).values, want[n][rows].long().sort(1).values)
        del batch["routed_experts"]
        with pytest.raises(ValueError, match="no 'routed_experts'"):
            eng.set_micro_batch_targets(batch, layers)
    finally:
        sym.set_replay_action(layers, None)
        sym.clear_replay(layers)


# ---- verl's Megatron engine end to end (infer_batch -> forward_backward_batch -> forward_step) --
NL, HID, VOCAB = 2, 32, 97


def _cpu_engine(tmp_path, monkeypatch):
    """SwitchyardMegatronEngine from verl's registry (R3, padded layout) on a Megatron-Core GPT MoE
    model built in place of initialize() (verl_cpu.megatron_engine: its CPU shims undone after
    the test) -> (engine, {router key: its last routing map})."""
    import verl_cpu
    path = verl_cpu.tiny_qwen3_moe(tmp_path / "m", num_hidden_layers=NL)
    eng, maps, _ = verl_cpu.megatron_engine(path, num_layers=NL, hidden=HID, vocab=VOCAB,
                                            num_experts=E, top_k=K, monkeypatch=monkeypatch)
    return eng, maps


PROMPTS = [[5, 6, 7], [8, 9]]
RESPONSES = [[10, 11, 12], [13]]


def _used(maps, B, S, lengths):
    """The routes the engine's routers used, as verl's dense [B, S, L, K] (rows of real tokens)."""
    out = torch.zeros(B, S, NL, K, dtype=torch.int16)
    for n, m in maps.items():  # m: [S_pad * B, E], sequence-first
        Sp = m.shape[0] // B
        ids = torch.stack([r.nonzero().view(-1) for r in m]).view(Sp, B, K).transpose(0, 1)
        for b, length in enumerate(lengths):
            out[b, :length, n - 1] = ids[b, :length].to(torch.int16)
    return out


def _run(eng, maps, routed=None, **kw):
    import verl_cpu
    td, dense = verl_cpu.batch(PROMPTS, RESPONSES, num_hidden_layers=NL, top_k=K,
                               routed_experts=routed, use_remove_padding=False, **kw)
    maps.clear()
    out = eng.infer_batch(td)
    return out, dense


def test_megatron_engine_r3_replays_the_rollouts_routes_end_to_end(tmp_path, monkeypatch):
    """verl's Megatron engine (its forward_backward_batch, schedule, BSHD preprocessing and
    forward) with switchyard's replay: router mismatch exactly 0 against the routes given, and
    the log-probs of a replay of the native routes equal the native forward's."""
    eng, maps = _cpu_engine(tmp_path, monkeypatch)
    native, dense = _run(eng, maps, enable_routing_replay=False)
    mask = dense["attention_mask"]
    B, S = mask.shape
    lengths = mask.sum(1).tolist()
    used = _used(maps, B, S, lengths)  # routes of the native forward, per real token
    # as a rollout returns them: left-padded like the batch, zero at each sequence's last token
    routed = torch.zeros(B, S, NL, K, dtype=torch.int16)
    for b in range(B):
        real = mask[b].bool().nonzero().view(-1)
        routed[b, real[:-1]] = used[b, :lengths[b] - 1]
    same, _ = _run(eng, maps, routed)
    for a, b in zip(native["model_output"]["log_probs"].unbind(),
                    same["model_output"]["log_probs"].unbind()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # forced routes: every replayed token's experts are the given ones (mismatch 0)
    g = torch.Generator().manual_seed(5)
    forced = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S * NL)]).view(
        B, S, NL, K).to(torch.int16)
    forced[routed.eq(0).all(-1)] = 0  # padding and last tokens: no route
    out, _ = _run(eng, maps, forced)
    got = _used(maps, B, S, lengths)
    for b in range(B):
        n = lengths[b] - 1
        want = forced[b][mask[b].bool()][:n].long().sort(-1).values
        assert torch.equal(got[b, :n].long().sort(-1).values, want)
    # replay matters here: the forced routes change the log-probs
    assert any(not torch.allclose(a, c, atol=1e-3) for a, c in zip(
        native["model_output"]["log_probs"].unbind(), out["model_output"]["log_probs"].unbind()))


@pytest.mark.hostile(tried="verl Megatron engine fed a micro-batch whose routed_experts has an "
                     "expert id >= num_experts", gets="ValueError before any router runs; the "
                     "next batch replays its own routes")
def test_megatron_engine_refuses_bad_routes_before_any_forward(tmp_path, monkeypatch):
    eng, maps = _cpu_engine(tmp_path, monkeypatch)
    import verl_cpu
    _, dense = verl_cpu.batch(PROMPTS, RESPONSES, num_hidden_layers=NL, top_k=K,
                              use_remove_padding=False)
    mask = dense["attention_mask"].bool()
    B, S = mask.shape
    routed = torch.zeros(B, S, NL, K, dtype=torch.int16)
    routed[mask] = torch.tensor([[0, 1], [2, 3]], dtype=torch.int16)
    bad = routed.clone()
    bad[0, mask[0].nonzero()[0, 0], 1] = torch.tensor([E, 1], dtype=torch.int16)
    with pytest.raises(ValueError, match=r"\[0, 8\)|out of range|num_experts"):
        _run(eng, maps, bad)
    assert maps == {}  # no router ran
    with pytest.raises(ValueError, match="no 'routed_experts'"):
        _run(eng, maps)
    assert maps == {}
    _run(eng, maps, routed)  # the next batch replays its own routes
    lengths = mask.sum(1).tolist()
    got = _used(maps, B, S, lengths)
    for b in range(B):
        n = lengths[b] - 1  # the last token: routed natively
        assert torch.equal(got[b, :n].long().sort(-1).values,
                           routed[b][mask[b]][:n].long().sort(-1).values)


def test_megatron_engine_update_forward_replays_and_the_router_gets_gradients(tmp_path,
                                                                              monkeypatch):
    """The update pass (forward_backward_batch, forward_only=False: verl's schedule runs the
    backward) replays the routes too, and the routers' gradients flow through the replayed ids;
    the replay queues are empty afterwards (nothing left for the next call)."""
    eng, maps = _cpu_engine(tmp_path, monkeypatch)
    import verl_cpu
    td, dense = verl_cpu.batch(PROMPTS, RESPONSES, num_hidden_layers=NL, top_k=K,
                               use_remove_padding=False)
    mask = dense["attention_mask"].bool()
    B, S = mask.shape
    g = torch.Generator().manual_seed(9)
    routed = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S * NL)]).view(
        B, S, NL, K).to(torch.int16)
    routed[~mask] = 0
    td, _ = verl_cpu.batch(PROMPTS, RESPONSES, num_hidden_layers=NL, top_k=K,
                           routed_experts=routed, use_remove_padding=False)
    model = eng.module[0]
    model.train()
    model.zero_grad()

    def loss_fn(model_output, data, dp_group=None):
        return -model_output["log_probs"].values().mean(), {}
    maps.clear()
    eng.forward_backward_batch(td, loss_function=loss_fn, forward_only=False)
    lengths = mask.sum(1).tolist()
    got = _used(maps, B, S, lengths)
    for b in range(B):
        n = lengths[b]  # every row has a route here (none zero): all replayed
        assert torch.equal(got[b, :n].long().sort(-1).values,
                           routed[b][mask[b]][:n].long().sort(-1).values)
    grads = [m.weight.grad for m in model.modules() if getattr(m, "_sy", None) is not None]
    assert len(grads) == NL and all(gr is not None and gr.abs().sum() > 0 for gr in grads)
    counts = sym.replay_counts(eng.module, total=True)
    assert counts == {} or all(c.calls == 0 for c in counts.values())  # cleared after the call
