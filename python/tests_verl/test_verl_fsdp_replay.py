"""switchyard.integrations.verl against the real verl package (0.9.1) on the CPU: verl's FSDP
engine (fsdp2, one gloo process) chosen by verl's EngineRegistry through VERL_ENGINE_VENDOR, fed
batches made by verl's own left_right_2_no_padding, compared with a plain transformers forward of
the same weights under the same forced routes (switchyard.integrations.hf)."""
import os
import subprocess
import sys
import tomllib

import pytest
import torch

import verl_cpu

NUM_LAYERS, E, K = 2, 8, 2
PROMPTS = [[5, 6, 7], [8, 9], [11, 12, 13, 14], [15, 16]]
RESPONSES = [[20, 21, 22, 23], [24, 25], [26, 27, 28], [29, 30, 31, 32, 33]]
TOKENS = sum(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return verl_cpu.tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe"))


_ENGINES = {}


def make_engine(model_path, vendor, *, mode=None, use_remove_padding=True, forward_only=False,
                cache=True):
    """An initialised engine from verl's registry with VERL_ENGINE_VENDOR=vendor (None: verl's)."""
    key = (vendor, mode, use_remove_padding, forward_only)
    if cache and key in _ENGINES:
        return _ENGINES[key]
    with verl_cpu.env(VERL_ENGINE_VENDOR=vendor, SWITCHYARD_VERL_ROUTER_REPLAY=mode):
        eng = verl_cpu.engine(model_path, use_remove_padding=use_remove_padding,
                              forward_only=forward_only)
    if cache:
        _ENGINES[key] = eng
    return eng


def forced_routes(seed=1):
    """verl's routed_experts for PROMPTS/RESPONSES: int16 [B, S, num_hidden_layers, K] over the
    left-padded prompt | right-padded response positions, random distinct ids at every real token
    but each sequence's last (which the rollout never routes), zeros elsewhere."""
    _, dense = verl_cpu.batch(PROMPTS, RESPONSES, num_hidden_layers=NUM_LAYERS, top_k=K)
    m = dense["attention_mask"].bool()
    B, S = m.shape
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S * NUM_LAYERS)])
    routed = ids.view(B, S, NUM_LAYERS, K).to(torch.int16)
    last = m.long().cumsum(1).eq(m.sum(1, keepdim=True)) & m
    routed[~m | last] = 0
    return routed, m, last


def verl_batch(routed=None, use_remove_padding=True, **kw):
    td, dense = verl_cpu.batch(PROMPTS, RESPONSES, num_hidden_layers=NUM_LAYERS, top_k=K,
                               routed_experts=routed, use_remove_padding=use_remove_padding, **kw)
    return td, dense


def hf_log_probs(model_path, routed=None):
    """A plain transformers forward of the same checkpoint on verl's padded batch, with the
    forced routes replayed by switchyard.integrations.hf (None: native routing); returns the
    per-sequence next-token log-probs at every real token but the last, and the routes used."""
    import switchyard.integrations.hf as syhf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa",
                                                 dtype=torch.float32)
    _, dense = verl_batch()
    m = dense["attention_mask"]
    with syhf.patch(model, router_dtype=None) as p, torch.no_grad():
        if routed is not None:
            targets, _ = p.targets_from_verl(routed, m)
            p.set_targets(targets)
        with p.capture() as cap:
            logits = model(input_ids=dense["input_ids"], attention_mask=m,
                           position_ids=dense["position_ids"], use_cache=False).logits
        used = cap.ids()
    lp = torch.log_softmax(logits.float(), -1)
    nxt = torch.gather(lp[:, :-1], -1, dense["input_ids"][:, 1:, None])[..., 0]
    out = []
    mb = m.bool()
    for b in range(m.shape[0]):
        idx = mb[b].nonzero()[:, 0]
        out.append(nxt[b, idx[:-1]])
    return out, used


def engine_log_probs(out):
    """Per sequence, the engine's log-probs at every real token but the last (whose label is
    the next sequence's first token in verl's rolled packing)."""
    lp = out["model_output"]["log_probs"]
    return [t[:-1] for t in lp.unbind()]


def assert_close_lists(a, b, atol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=0)


# fp32 model, a 2-layer d=32 forward: the packed (flash-style) and padded (masked sdpa) layouts
# and the different GEMM shapes differ by a few float32 ulps of O(1) logits.
ATOL = 1e-4


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_r3_log_probs_equal_plain_hf_with_the_same_forced_routes(model_path, use_remove_padding):
    routed, m, last = forced_routes()
    eng = make_engine(model_path, "switchyard", use_remove_padding=use_remove_padding)
    assert type(eng).__name__ == "SwitchyardFSDPEngine"
    p = eng.router_patch
    td, _ = verl_batch(routed, use_remove_padding)  # two micro-batches of 2
    with eng.eval_mode():
        out = eng.infer_batch(td)
    ref, _ = hf_log_probs(model_path, routed)
    assert_close_lists(engine_log_probs(out), ref, ATOL)

    # R3 mismatch exactly 0: every routed token of the engine's forward used the rollout's ids
    # (one micro-batch of 4, so that the capture holds one forward).
    td, _ = verl_batch(routed, use_remove_padding, micro_batch_size=4)
    with eng.eval_mode(), p.capture() as cap:
        eng.infer_batch(td)
    used = cap.ids()  # [1, T, L, K] packed or [B, max_len, L, K] padded
    lengths = m.sum(1)
    if use_remove_padding:
        used = used[0, :int(lengths.sum())]
    else:
        used = used[torch.arange(used.shape[1])[None] < lengths[:, None]]
    want = routed[m]
    routed_rows = ~last[m]
    assert torch.equal(used[routed_rows].sort(-1).values.to(torch.int64),
                       want[routed_rows].sort(-1).values.to(torch.int64))
    mets = out["metrics"]
    assert mets["router_replay/replayed_rows"].aggregate() == int(routed_rows.sum()) * NUM_LAYERS
    assert mets["router_replay/native_rows"].aggregate() == len(PROMPTS) * NUM_LAYERS  # last tokens

    # ...and replay changed the result: verl's own engine (native routing) differs.
    plain = make_engine(model_path, None, use_remove_padding=use_remove_padding)
    assert type(plain).__name__ == "FSDPEngineWithLMHead"
    td, _ = verl_batch(routed, use_remove_padding)
    with plain.eval_mode():
        native = engine_log_probs(plain.infer_batch(td))
    native_ref, _ = hf_log_probs(model_path)
    assert_close_lists(native, native_ref, ATOL)
    assert max((a - b).abs().max() for a, b in zip(native, ref)) > 100 * ATOL


def test_r3_with_verls_static_padding_replays_the_real_tokens_and_routes_the_pad_natively(
        model_path):
    # verl's pad_to_length: a packed micro-batch is fed padded to a multiple of the bucket (16);
    # the rollout's routes go to the real tokens, the pad rows route natively and are not
    # counted; the log-probs are the unpadded engine's.
    routed, m, last = forced_routes(seed=3)
    with verl_cpu.env(VERL_ENGINE_VENDOR="switchyard"):
        eng = verl_cpu.engine(model_path, pad_to_length_bucket=16)
    td, _ = verl_batch(routed)  # two micro-batches of 2
    with eng.eval_mode():
        out = eng.infer_batch(td)
    ref, _ = hf_log_probs(model_path, routed)
    assert_close_lists(engine_log_probs(out), ref, ATOL)
    mets = out["metrics"]
    routed_rows = int((m & ~last).sum())
    assert mets["router_replay/replayed_rows"].aggregate() == routed_rows * NUM_LAYERS
    assert mets["router_replay/native_rows"].aggregate() == len(PROMPTS) * NUM_LAYERS
    # one micro-batch of 4 (TOKENS = 25 real tokens fed as 32 rows): the forward's ids
    td, _ = verl_batch(routed, micro_batch_size=4)
    with eng.eval_mode(), eng.router_patch.capture() as cap:
        eng.infer_batch(td)
    fed = cap.ids()
    assert TOKENS == 25 and eng._get_packed_pad_size(TOKENS) == 7 and fed.shape[:2] == (1, 32)
    real = ~last[m]
    assert torch.equal(fed[0, :TOKENS][real].sort(-1).values.to(torch.int64),
                       routed[m][real].sort(-1).values.to(torch.int64))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # fsdp2 parameters are DTensors


def _loss(model_output, data, dp_group=None):
    return -model_output["log_probs"].values().mean(), {}


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_r3_update_forward_replays_and_trains(model_path, use_remove_padding):
    routed, m, last = forced_routes(seed=2)
    eng = make_engine(model_path, "switchyard", use_remove_padding=use_remove_padding,
                      cache=False)
    ref, _ = hf_log_probs(model_path, routed)  # the checkpoint's weights = the engine's before
    td, _ = verl_batch(routed, use_remove_padding, return_model_output=True)
    before = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
    with eng.train_mode():
        out = eng.train_batch(td, loss_function=_loss)
    assert_close_lists(engine_log_probs(out), ref, ATOL)
    routed_rows = int((m & ~last).sum())
    assert out["metrics"]["router_replay/replayed_rows"].aggregate() == routed_rows * NUM_LAYERS
    # verl's default activation checkpointing: the last micro-batch's backward recomputed every
    # row it fed with the ids its forward used (switchyard.integrations.hf's recompute queue).
    lens = [len(p) + len(r) for p, r in zip(PROMPTS[2:], RESPONSES[2:])]
    fed = sum(lens) if use_remove_padding else len(lens) * max(lens)
    assert sum(c["num_recomputed_rows"] for c in eng.router_patch.counts().values()) == \
        fed * NUM_LAYERS
    after = eng.module.state_dict()
    gate = [k for k in before if k.endswith("mlp.gate.weight")]
    assert gate and all(not torch.equal(_full(before[k]), _full(after[k]))
                        for k in gate)  # the routers' gradients flowed through replayed ids


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_r2_log_prob_pass_returns_its_routes_and_the_update_replays_them(model_path,
                                                                         use_remove_padding):
    eng = make_engine(model_path, "switchyard", mode="R2", use_remove_padding=use_remove_padding,
                      cache=False)
    td, _ = verl_batch(use_remove_padding=use_remove_padding)
    with eng.eval_mode():
        out = eng.infer_batch(td)
    rec = out["model_output"]["routed_experts"]
    assert rec.is_nested and rec.dtype == torch.int16
    ref, used = hf_log_probs(model_path)  # native routing
    _, m, _ = forced_routes()
    native = used[m]  # [tokens, L, K]
    assert torch.equal(rec.values().to(torch.int64).sort(-1).values,
                       native.to(torch.int64).sort(-1).values)
    assert_close_lists(engine_log_probs(out), ref, ATOL)
    assert out["metrics"]["router_replay/recorded_rows"].aggregate() == TOKENS * NUM_LAYERS

    # The trainer merges model_output["routed_experts"] into the batch; the update replays them.
    td, _ = verl_batch(use_remove_padding=use_remove_padding, return_model_output=True)
    td["routed_experts"] = rec
    with eng.train_mode():
        upd = eng.train_batch(td, loss_function=_loss)
    n_rows = TOKENS - len(PROMPTS)  # each sequence's last token: no route in verl's layout
    assert upd["metrics"]["router_replay/replayed_rows"].aggregate() == n_rows * NUM_LAYERS
    assert_close_lists(engine_log_probs(upd), engine_log_probs(out), 1e-5)


def test_reference_engine_and_disabled_calls_route_natively(model_path):
    routed, _, _ = forced_routes()
    # The reference policy's engine (forward_only; verl builds it in bf16): never replays.
    ref_eng = make_engine(model_path, "switchyard", forward_only=True)
    assert type(ref_eng).__name__ == "SwitchyardFSDPEngine"
    assert ref_eng.router_replay_mode == "disabled" and ref_eng.router_patch is None
    td, _ = verl_batch(routed)
    with ref_eng.eval_mode():
        out = ref_eng.infer_batch(td)
    assert "router_replay/replayed_rows" not in out["metrics"]
    # verl's own flag (its Megatron / VeOmni workers set it False for the reference pass).
    from verl.utils import tensordict_utils as tu
    native, _ = hf_log_probs(model_path)
    eng = make_engine(model_path, "switchyard")
    td, _ = verl_batch(routed)
    tu.assign_non_tensor(td, enable_routing_replay=False)
    with eng.eval_mode():
        out = eng.infer_batch(td)
    assert_close_lists(engine_log_probs(out), native, ATOL)
    assert "router_replay/replayed_rows" not in out["metrics"]


def _no_state(p):
    return all(r.num_targets == 0 and r.num_recorded == 0 for r in p.replays.values())


def _bad(routed, model_path, train=False):
    eng = make_engine(model_path, "switchyard")
    p = eng.router_patch
    p.reset_counts()
    td, _ = verl_batch(routed, return_model_output=True)
    before = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
    with pytest.raises(ValueError) as e:
        if train:
            with eng.train_mode():
                eng.train_batch(td, loss_function=_loss)
        else:
            with eng.eval_mode():
                eng.infer_batch(td)
    assert _no_state(p)
    assert all(c["num_calls"] == 0 for c in p.counts().values())  # no router ran
    after = eng.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return str(e.value)


@pytest.mark.hostile(tried="verl batch whose routed_experts has the wrong number of layers",
                     gets="ValueError naming routed_experts, the expected and the given shape; "
                     "nothing queued, no forward, no update")
@pytest.mark.parametrize("train", [False, True], ids=["log_prob", "update"])
def test_routed_experts_of_the_wrong_shape_is_refused_before_any_forward(model_path, train):
    routed, _, _ = forced_routes()
    wrong = torch.cat([routed, routed[:, :, :1]], dim=2)  # 3 layers for a 2-layer model
    msg = _bad(wrong, model_path, train)
    mb0 = sum(len(p) + len(r) for p, r in zip(PROMPTS[:2], RESPONSES[:2]))  # 1st micro-batch
    assert "routed_experts" in msg and "num_hidden_layers=2" in msg and f"[{mb0}, 3, 2]" in msg
    msg = _bad(routed[..., :1].contiguous(), model_path, train)  # K=1 for a top-2 model
    assert "routed_experts" in msg and "K=2" in msg and f"[{mb0}, 2, 1]" in msg
    # the retry with good routes replays them, nothing of the refused batch left behind
    eng = make_engine(model_path, "switchyard")
    td, _ = verl_batch(routed)
    with eng.eval_mode():
        out = eng.infer_batch(td)
    assert_close_lists(engine_log_probs(out), hf_log_probs(model_path, routed)[0], ATOL)


@pytest.mark.hostile(tried="verl batch whose routed_experts holds an expert id >= num_experts",
                     gets="ValueError naming the id and num_experts; nothing queued, no forward")
@pytest.mark.parametrize("train", [False, True], ids=["log_prob", "update"])
def test_routed_experts_with_an_id_out_of_range_is_refused_before_any_forward(model_path, train):
    routed, m, _ = forced_routes()
    bad = routed.clone()
    b, s = m.nonzero()[1].tolist()
    bad[b, s, 1, 0] = 99
    msg = _bad(bad, model_path, train)
    assert "99" in msg and "8" in msg, msg


@pytest.mark.hostile(tried="R3 on a verl batch that carries no routed_experts",
                     gets="ValueError saying the micro-batch has no routed_experts (never a silent "
                     "native forward)")
def test_r3_without_routed_experts_is_an_error_not_a_silent_native_forward(model_path):
    msg = _bad(None, model_path)
    assert "no 'routed_experts'" in msg and "R3" in msg


@pytest.mark.hostile(tried="float routed_experts in a verl batch",
                     gets="ValueError naming routed_experts and the dtype")
def test_float_routed_experts_are_refused(model_path):
    routed, _, _ = forced_routes()
    msg = _bad(routed.float(), model_path)
    assert "routed_experts" in msg and "torch.float32" in msg


@pytest.mark.hostile(tried="SWITCHYARD_VERL_ROUTER_REPLAY=R4",
                     gets="ValueError naming the variable, the allowed modes and 'R4'")
def test_an_unknown_replay_mode_is_refused_when_the_engine_is_made(model_path, monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "switchyard")
    monkeypatch.setenv("SWITCHYARD_VERL_ROUTER_REPLAY", "R4")
    from verl.workers.engine import EngineRegistry
    cls = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    import switchyard.integrations.verl as syverl
    with pytest.raises(ValueError, match=r"SWITCHYARD_VERL_ROUTER_REPLAY must be one of "
                       r"\['R3', 'R2', 'disabled'\], got 'R4'"):
        syverl._mode_of(None)
    assert cls is syverl.SwitchyardFSDPEngine


def test_verl_loads_the_plugin_through_the_entry_point_switchyard_declares(tmp_path):
    """pyproject.toml's verl.plugins entry point, installed as a dist-info the way pip would, is
    what a bare `import verl` loads; EngineRegistry then resolves VERL_ENGINE_VENDOR=switchyard."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]["verl.plugins"]
    assert eps == {"switchyard": "switchyard.integrations.verl"}
    dist = tmp_path / "switchyard-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: switchyard\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[verl.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    code = ("import verl\n"
            "from verl.workers.engine.base import EngineRegistry\n"
            "c = EngineRegistry.get_engine_cls('language_model', 'fsdp2')\n"
            "print(c.__module__ + '.' + c.__name__)\n")
    env = dict(os.environ, VERL_ENGINE_VENDOR="switchyard", VERL_ENGINE_DEVICE="cuda",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    for k in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES"):  # a bare process: no test shim
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == \
        "switchyard.integrations.verl.SwitchyardFSDPEngine"


def test_dynamic_batch_size_reorders_sequences_and_routes_together(model_path):
    """verl's default use_dynamic_bsz packs sequences into token-budget micro-batches in another
    order and restores it after: R3 targets and R2 records follow their sequences."""
    from verl.utils import tensordict_utils as tu
    routed, m, _ = forced_routes()
    eng = make_engine(model_path, "switchyard")
    td, _ = verl_batch(routed)
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=12)
    with eng.eval_mode():
        out = eng.infer_batch(td)
    # more, reordered micro-batches
    assert len(out["metrics"]["router_replay/replayed_rows"].values) > 2
    assert_close_lists(engine_log_probs(out), hf_log_probs(model_path, routed)[0], ATOL)

    r2 = make_engine(model_path, "switchyard", mode="R2", cache=False)
    td, _ = verl_batch()
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=12)
    with r2.eval_mode():
        rec = r2.infer_batch(td)["model_output"]["routed_experts"]
    _, used = hf_log_probs(model_path)
    assert torch.equal(rec.values().to(torch.int64).sort(-1).values,
                       used[m].to(torch.int64).sort(-1).values)


def test_the_engine_configs_router_replay_mode_selects_the_mode(model_path, monkeypatch):
    """verl's own config field (engine router_replay.mode, the one its Megatron / VeOmni engines
    read) wins over SWITCHYARD_VERL_ROUTER_REPLAY; "disabled" there defers to the variable."""
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "switchyard")
    monkeypatch.setenv("SWITCHYARD_VERL_ROUTER_REPLAY", "R3")
    eng = verl_cpu.engine(model_path, router_replay_mode="R2")
    assert eng.router_replay_mode == "R2" and eng.router_patch is not None
    eng = verl_cpu.engine(model_path, router_replay_mode="disabled")
    assert eng.router_replay_mode == "R3"
    monkeypatch.setenv("SWITCHYARD_VERL_ROUTER_REPLAY", "disabled")
    eng = verl_cpu.engine(model_path)
    assert eng.router_replay_mode == "disabled" and eng.router_patch is None
