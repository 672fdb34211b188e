"""switchyard.integrations.trl against the real trl GRPOTrainer on the CPU (a tiny Qwen3-MoE):
R3 replays the rollout's routes in every log-prob forward (old, reference, policy) with router
mismatch exactly 0; the routes follow their sequences through TRL's padding and shuffling; R2
replays the old pass's routes in the updates; rollout_func supplies routes; bad input is refused
with the argument named."""
import copy
import warnings

import pytest
import torch

pytest.importorskip("trl")

import switchyard.integrations.hf as syhf  # noqa: E402
import switchyard.integrations.trl as sytrl  # noqa: E402
import trl_models as tm  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
E, K, L = 8, 2, 2  # the tiny model: experts, top-k, hidden layers (all MoE)
# The share of rows whose top-k may flip between the rollout's forward (KV cache, other shapes)
# and the trainer's on the same weights: near-ties of fp32 logits computed by different torch
# kernels (0 on the CPUs seen; a bound, not a value, since the kernels differ across CPUs).
_NEAR_TIES = 0.05


class _Checked(sytrl.GRPOTrainer):
    """Records every batch the loss sees (after TRL's shuffle and split)."""

    def _compute_loss(self, model, inputs):
        self.seen = getattr(self, "seen", []) + [{k: v for k, v in inputs.items()
                                                   if isinstance(v, torch.Tensor)}]
        return super()._compute_loss(model, inputs)


def _trainer(tmp_path, cls=_Checked, model=None, train_kw=None, **kw):
    targs = {k: kw.pop(k) for k in list(kw) if k in _CONFIG_KEYS}
    return cls(model=tm.model() if model is None else model, reward_funcs=tm.reward_len,
               args=tm.config(tmp_path, **targs), train_dataset=tm.dataset(),
               processing_class=tm.tokenizer(), **(train_kw or {}), **kw)


_CONFIG_KEYS = {"num_iterations", "steps_per_generation", "max_steps", "beta", "num_generations",
                "per_device_train_batch_size", "gradient_accumulation_steps", "use_vllm",
                "max_completion_length", "learning_rate", "pad_to_multiple_of",
                "eval_strategy", "eval_steps", "per_device_eval_batch_size", "sync_ref_model",
                "generation_kwargs"}


def _kinds(tr):
    out = {}
    for r in tr.switchyard_records:
        out.setdefault(r["kind"], []).append(r)
    return out


def _real_rows(inputs):
    """(B, P+C) bool: the real tokens of TRL's rows, and the rows that have a route (every real
    token except each sequence's last)."""
    m = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1).bool()
    last = m.flip(1).int().argmax(1)  # distance of the last real token from the end
    routed = m.clone()
    routed[torch.arange(m.shape[0]), m.shape[1] - 1 - last] = False
    return m, routed


# ---- R3 on TRL's own generate() ---------------------------------------------------------------
@pytest.mark.parametrize("pad_to", [None, 8])
def test_r3_replays_captured_routes_in_old_and_policy_forwards(tmp_path, pad_to):
    # steps_per_generation=2: a generation batch of 8 rows (4 prompts of different lengths) is
    # shuffled and split over two steps; num_iterations=2: TRL runs the old-log-prob pass;
    # pad_to_multiple_of=8: more left padding in generate() and in TRL's rows.
    tr = _trainer(tmp_path, num_generations=2, steps_per_generation=2, num_iterations=2,
                  max_steps=4, pad_to_multiple_of=pad_to)
    tr.train()
    kinds = _kinds(tr)
    assert set(kinds) == {"old", "policy"}
    assert len(kinds["policy"]) == 4
    for r in tr.switchyard_records:
        assert r["mode"] == "R3" and r["compared_rows"] > 0
        assert r["used_mismatch_rows"] == 0  # the experts received the rollout's ids
        assert r["replayed_rows"] == r["compared_rows"]  # every routed real token replayed
        assert r["invalid_rows"] == 0
    for r in kinds["old"]:  # the weights that generated: the router's own choice agrees
        assert r["mismatch_rows"] <= _NEAR_TIES * r["compared_rows"]
    for b in tr.seen:  # the routes are -1 exactly where TRL's rows have no routed token
        routes = b[sytrl.ROLLOUT_ROUTES_KEY]
        assert routes.shape[:2] == torch.cat([b["prompt_ids"], b["completion_ids"]], 1).shape
        _, routed = _real_rows(b)
        has = (routes >= 0).all(-1).all(-1)
        assert torch.equal(has, routed)
        assert torch.equal((routes < 0).all(-1).all(-1), ~routed)
    logged = [h for h in tr.state.log_history if "switchyard/policy/router_mismatch" in h]
    assert logged and all(0 <= h["switchyard/policy/router_mismatch"] <= 1 for h in logged)
    assert all(h["switchyard/policy/replayed_rows"] > 0 for h in logged)


def test_without_replay_the_mismatch_is_measured_and_nothing_is_replayed(tmp_path):
    tr = _trainer(tmp_path, replay=None, max_steps=1)
    tr.train()
    (r,) = tr.switchyard_records
    assert r["kind"] == "policy" and r["replayed_rows"] == 0 and r["compared_rows"] > 0
    assert r["native_rows"] > r["compared_rows"]
    # one rank: the counts "over all ranks" are this rank's, its share the largest rank's
    assert r["world_size"] == 1
    assert all(r["ranks"][n] == r["ranks"][n + "/max_rank"] == r["ranks"][n + "/min_rank"] ==
               r[n] for n in ("mismatch_rows", "compared_rows", "native_rows"))
    (h,) = [h for h in tr.state.log_history if "switchyard/policy/router_mismatch" in h]
    share = r["mismatch_rows"] / r["compared_rows"]
    assert h["switchyard/policy/router_mismatch"] == share
    assert h["switchyard/policy/router_mismatch/max_rank"] == pytest.approx(share, abs=1e-9)


def test_r3_in_evaluation_and_with_gradient_accumulation(tmp_path):
    # TRL's eval loop generates and scores its own batches (no buffering); the metrics go to the
    # eval split. gradient_accumulation_steps=2: two micro-batches per optimizer step.
    tr = _trainer(tmp_path, max_steps=1, gradient_accumulation_steps=2,
                  train_kw=dict(eval_dataset=tm.dataset(4)),
                  eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    tr.train()
    splits = {r["split"] for r in tr.switchyard_records}
    assert splits == {"train", "eval"}
    for r in tr.switchyard_records:
        assert r["used_mismatch_rows"] == 0 and r["replayed_rows"] == r["compared_rows"] > 0
    assert any("eval_switchyard/policy/router_mismatch" in h for h in tr.state.log_history)


def _save(tmp_path):
    path = tmp_path / "model"
    tm.model().save_pretrained(path)
    tm.tokenizer().save_pretrained(path)
    return str(path)


def test_r3_replays_the_reference_model_reloaded_by_trl(tmp_path):
    # beta > 0: TRL loads the reference model again from the path; it is patched too.
    tr = _trainer(tmp_path, model=_save(tmp_path), beta=0.1, max_steps=2)
    ref_patch = syhf.patch_of(tr.ref_model)
    assert ref_patch is not None and ref_patch is not tr.switchyard_patch
    tr.train()
    kinds = _kinds(tr)
    assert len(kinds["ref"]) == 2 and len(kinds["policy"]) == 2
    for r in kinds["ref"] + kinds["policy"]:
        assert r["used_mismatch_rows"] == 0 and r["replayed_rows"] == r["compared_rows"] > 0


def test_r3_replays_a_deep_copied_reference_model(tmp_path):
    tr = _trainer(tmp_path, model=_save(tmp_path), beta=0.1, max_steps=1)
    tr.ref_model = copy.deepcopy(tr.model)  # a patched copy: its own Patch, queues and counts
    assert syhf.patch_of(tr.ref_model) is not tr.switchyard_patch
    with torch.no_grad():  # make the copy route differently from the policy if not replayed
        for n, prm in tr.ref_model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                prm.mul_(-1)
    tr.train()
    (ref,) = _kinds(tr)["ref"]
    assert ref["used_mismatch_rows"] == 0 and ref["replayed_rows"] == ref["compared_rows"] > 0
    # the copy's own choice differs from the rollout's (negated gate): the metric says so
    assert ref["mismatch_rows"] > ref["compared_rows"] // 2


def test_a_reference_model_unpatched_after_construction_is_patched_on_first_use(tmp_path):
    tr = _trainer(tmp_path, model=_save(tmp_path), beta=0.1, max_steps=1)
    syhf.patch_of(tr.ref_model).unpatch()
    assert syhf.patch_of(tr.ref_model) is None
    tr.train()
    assert syhf.patch_of(tr.ref_model) is not None
    (ref,) = _kinds(tr)["ref"]
    assert ref["used_mismatch_rows"] == 0 and ref["replayed_rows"] == ref["compared_rows"] > 0


def test_a_reference_model_unpatched_between_steps_is_patched_again_not_left_stale(tmp_path):
    # The trainer keeps the Patch it found per model between forwards (finding it walks every
    # module): one undone since must not be used again (its routers no longer run it).
    import transformers

    class Unpatch(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                self.undone = syhf.patch_of(tr.ref_model)
                self.undone.unpatch()

    cb = Unpatch()
    tr = _trainer(tmp_path, model=_save(tmp_path), beta=0.1, max_steps=2,
                  train_kw=dict(callbacks=[cb]))
    tr.train()
    assert not cb.undone.active
    again = syhf.patch_of(tr.ref_model)
    assert again is not None and again is not cb.undone
    refs = _kinds(tr)["ref"]
    assert len(refs) == 2
    for ref in refs:
        assert ref["used_mismatch_rows"] == 0 and ref["replayed_rows"] == ref["compared_rows"] > 0


# ---- R2 ---------------------------------------------------------------------------------------
def test_r2_replays_the_old_pass_routes_in_every_update(tmp_path):
    # num_iterations=2, a large learning rate: the second update's native routes would drift.
    tr = _trainer(tmp_path, replay="R2", num_iterations=2, max_steps=4, learning_rate=0.5)
    tr.train()
    kinds = _kinds(tr)
    assert len(kinds["old"]) == 2 and len(kinds["policy"]) == 4
    for i, old in enumerate(kinds["old"]):
        assert old["replayed_rows"] == 0  # the old pass routes natively and records
        for pol in kinds["policy"][2 * i:2 * i + 2]:
            # every real token of the batch replayed with the old pass's ids (the last token
            # too: R2 recorded it), so the mismatch against the rollout is the old pass's
            assert pol["replayed_rows"] >= old["compared_rows"] > 0
            assert pol["used_mismatch_rows"] == old["mismatch_rows"]
    for b in tr.seen:
        r2 = b[sytrl.R2_ROUTES_KEY]
        real, _ = _real_rows(b)
        assert torch.equal((r2 >= 0).all(-1).all(-1), real)


# ---- rollout_func: routes from the user's rollout engine ----------------------------------------
def _route(tok, j, layer):
    """A synthetic route that encodes the token and its place in its sequence: far from what the
    model would pick, so only an aligned replay reproduces it."""
    e0 = (tok * 7 + j * 3 + layer) % E
    return [e0, (e0 + 1 + tok % (E - 1)) % E]


def _rollout_func(lengths=(1, 3, 2, 4), broken=None):
    tok = tm.tokenizer()

    def rollout(prompts, trainer):
        p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        c_ids = [[3 + (7 * i + k) % 90 for k in range(lengths[i % len(lengths)])]
                 for i in range(len(prompts))]
        routes = []
        for p, c in zip(p_ids, c_ids):
            full = p + c
            routes.append(torch.tensor([[_route(full[j], j, l) for l in range(L)]
                                        for j in range(len(full) - 1)], dtype=torch.int32))
        out = {"prompt_ids": p_ids, "completion_ids": c_ids,
               "logprobs": [[-1.0] * len(c) for c in c_ids], "routed_experts": routes}
        if broken is not None:
            broken(out)
        return out
    return rollout


@pytest.mark.parametrize("pad_to", [None, 8])
def test_rollout_func_routes_follow_their_sequence_through_padding_and_shuffle(tmp_path, pad_to):
    # 4 prompts of 2..5 words, completions of 1..4 tokens: TRL left-pads prompts and right-pads
    # completions, then shuffles 8 rows and splits them over 2 steps. Every carried route must
    # still be the one the rollout gave that token at that place (a right-padded prompt, or routes
    # left unshuffled, breaks it), and the replayed forward routes with exactly those ids.
    tr = _trainer(tmp_path, rollout_func=_rollout_func(), num_generations=2,
                  steps_per_generation=2, num_iterations=2, max_steps=4, pad_to_multiple_of=pad_to)
    tr.train()
    assert len(tr.seen) == 4
    if pad_to:
        assert all(b["prompt_ids"].shape[1] % pad_to == 0 for b in tr.seen)
    for b in tr.seen:
        ids = torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1)
        real, routed = _real_rows(b)
        routes = b[sytrl.ROLLOUT_ROUTES_KEY]
        for row in range(ids.shape[0]):
            pos = real[row].nonzero().flatten()
            for j, s in enumerate(pos.tolist()):
                want = [[-1] * K] * L if not routed[row, s] else \
                    [_route(int(ids[row, s]), j, l) for l in range(L)]
                assert routes[row, s].tolist() == want, (row, s)
    for r in tr.switchyard_records:
        assert r["used_mismatch_rows"] == 0 and r["replayed_rows"] == r["compared_rows"] > 0
        # the synthetic routes are far from the model's own choice: the mismatch shows it
        assert r["mismatch_rows"] > r["compared_rows"] // 2
    assert {r["kind"] for r in tr.switchyard_records} == {"old", "policy"}


def test_rollout_func_routes_are_measured_without_replay(tmp_path):
    # the same synthetic routes, not replayed: the model's own choice differs from most of them
    tr = _trainer(tmp_path, rollout_func=_rollout_func(), replay=None, max_steps=1)
    tr.train()
    (r,) = tr.switchyard_records
    assert r["replayed_rows"] == 0 and r["mismatch_rows"] > 0


def test_after_switchyard_unpatch_the_trainer_is_trls_own(tmp_path):
    tr = _trainer(tmp_path, rollout_func=_rollout_func(), max_steps=1)
    tr.switchyard_unpatch()
    assert syhf.patch_of(tr.model) is None
    tr.train()
    assert tr.switchyard_records == []
    assert sytrl.ROLLOUT_ROUTES_KEY not in tr.seen[0]
    assert not any(k.startswith("switchyard/") for h in tr.state.log_history for k in h)


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.hostile(tried="TRL: replay='R4', router_dtype=torch.bfloat16",
                     gets="ValueError naming the argument and value, before TRL builds anything")
@pytest.mark.parametrize("kw,msg", [(dict(replay="R4"), "replay='R4'"),
                                    (dict(router_dtype=torch.bfloat16), "router_dtype="),
                                    (dict(routes_field=""), "routes_field=''")])
def test_bad_switchyard_arguments_are_refused_before_anything_is_patched(tmp_path, kw, msg):
    model = tm.model()
    with pytest.raises(ValueError, match=msg):
        _trainer(tmp_path, model=model, **kw)
    assert syhf.patch_of(model) is None


@pytest.mark.hostile(tried="TRL: replay='R3' on a dense (non-MoE) model",
                     gets="ValueError naming the model, nothing patched")
def test_replay_on_a_dense_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\[trl.GRPOTrainer\] model: switchyard needs a "
                                         r"transformers MoE model"):
        _trainer(tmp_path, model=tm.dense_model())


@pytest.mark.hostile(tried="TRL: replay='R3' with use_vllm=True and no rollout_func",
                     gets="ValueError: the vLLM path returns no routes")
def test_r3_with_trl_vllm_and_no_rollout_func_is_refused(tmp_path):
    model = tm.model()
    with pytest.raises(ValueError, match="replay='R3' with use_vllm=True"):
        _trainer(tmp_path, model=model, use_vllm=True)
    assert syhf.patch_of(model) is None


def test_a_model_trl_refuses_is_left_unpatched(tmp_path):
    model = tm.model()
    # TRL's own check, late in its __init__: no reference model (beta=0) to synchronise
    with pytest.raises(ValueError, match="sync_ref_model=True"):
        _trainer(tmp_path, model=model, sync_ref_model=True)
    assert syhf.patch_of(model) is None


def test_trl_arguments_given_positionally_reach_the_checks(tmp_path):
    from trl import GRPOConfig
    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, use_cpu=True, bf16=False,
                      report_to=[])
    with pytest.raises(ValueError, match="replay='R3' with use_vllm=True"):
        sytrl.GRPOTrainer(tm.model(), tm.reward_len, args)


def _drop_last_row(out):
    out["routed_experts"][1] = out["routed_experts"][1][:-1]


def _float_routes(out):
    out["routed_experts"][0] = out["routed_experts"][0].float()


def _missing(out):
    del out["routed_experts"]


@pytest.mark.hostile(tried="TRL rollout_func: routes one row short, float routes, or none with R3",
                     gets="ValueError naming the field, the sequence and the shape wanted")
@pytest.mark.parametrize("broken,msg", [
    (_drop_last_row, r"'routed_experts'\[1\] must be an integer array .* = \[\d+, 2, 2\], got"),
    (_float_routes, r"'routed_experts'\[0\] must have an integer dtype \(int8, int16, int32, "
                    r"int64, uint8, uint16, uint32 or uint64\), got torch.float32"),
    (_missing, r"replay='R3' needs the rollout's routes: rollout_func returned no "
               r"'routed_experts' field")])
def test_bad_rollout_routes_are_refused_before_any_replay(tmp_path, broken, msg):
    tr = _trainer(tmp_path, rollout_func=_rollout_func(broken=broken), max_steps=1)
    with pytest.raises(ValueError, match=msg):
        tr.train()
    assert tr.switchyard_records == []
    assert all(c["num_calls"] == 0 for c in tr.switchyard_patch.counts().values())


@pytest.mark.hostile(tried="TRL rollout_func: an out-of-range expert id in the routes",
                     gets="ValueError naming the field, sequence, token, layer and value")
def test_rollout_routes_with_an_expert_id_out_of_range_are_refused(tmp_path):
    def bad(out):
        out["routed_experts"][2][0, 1, 0] = E
    tr = _trainer(tmp_path, rollout_func=_rollout_func(broken=bad), max_steps=1)
    with pytest.raises(ValueError, match=r"\[trl.GRPOTrainer\] rollout_func's "
                                         r"'routed_experts'\[2\] \(sequence 2\): token 0, layer "
                                         r"1, slot 0 holds expert id 8 \(int32\), outside "
                                         r"\[0, 8\) or -1 \(no route\)"):
        tr.train()
    assert tr.switchyard_records == []


# ---- multi-turn: TRL's tool-call loop -----------------------------------------------------------
def test_tool_call_turns_give_each_sequence_the_routes_of_its_latest_turn(tmp_path, monkeypatch):
    # TRL's own _tool_call_loop, driven with a tool call in sequences 1 and 3 (a tiny random model
    # emits none): the tool turn re-feeds prompt + completion + tool result and generates more;
    # those sequences' routes must come from that turn (the first turn's cannot cover them).
    import trl.trainer.grpo_trainer as grpo
    tr = _trainer(tmp_path, max_steps=1)

    def add(a: int) -> int:
        return a + 1
    B, calls = 4, (1, 3)
    tr.tools = [add]
    tr._sync_tool_dicts, tr._async_tool_dicts = [{"add": add}] * B, [{}] * B
    tr._get_tool_suffix_ids = lambda messages: [40, 41, 42]  # the tool result's tokens
    monkeypatch.setattr(grpo, "parse_response",  # the post-tool turn calls no further tool
                        lambda tokenizer, ids, prefix=None, tools=None: {"role": "assistant"})
    prompt_ids = [[5, 6], [7, 8, 9], [10], [11, 12, 13, 14]]
    tr._sy_gen = sytrl._GenState()
    with torch.no_grad():
        completion_ids, _ = tr._generate_single_turn(prompt_ids, None, {}, 1)
    first = [r.clone() for _, r in tr._sy_gen.seqs]
    completions = [[{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
        if i in calls else None}] for i in range(B)]
    tr.max_completion_length = 40  # room for the tool result and the post-tool turn
    tool_mask, _, completion_ids, _, n_calls, n_fail, _ = tr._tool_call_loop(
        [[{"role": "user", "content": "q"}] for _ in range(B)], prompt_ids,
        [list(c) for c in completion_ids], completions, None, None, {})
    assert (n_calls, n_fail) == (2, 0)
    routes = tr._sy_batch_routes(prompt_ids, completion_ids)
    P = max(len(p) for p in prompt_ids)
    for i in range(B):
        n = len(prompt_ids[i]) + len(completion_ids[i])
        rows = routes[i][P - len(prompt_ids[i]):P - len(prompt_ids[i]) + n]
        assert bool((rows[:-1] >= 0).all()) and bool((rows[-1] < 0).all())
        assert int((routes[i] >= 0).all(-1).all(-1).sum()) == n - 1
        if i in calls:
            assert 0 in tool_mask[i] and n - 1 > first[i].shape[0]
        else:
            assert torch.equal(rows[:-1], first[i][:n - 1])
    tr._sy_gen = None


@pytest.mark.parametrize("multiple", [None, 1, 4, 5])
def test_the_adapters_padding_masks_are_trls_pad(multiple):
    from trl.trainer.utils import pad
    for seqs in ([[1, 2], [3, 4, 5, 6, 7], [8]], [[1, 2, 3, 4]], [[1] * 5, [2] * 5]):
        for side in ("left", "right"):
            want = pad([torch.ones(len(x), dtype=torch.long) for x in seqs], 0, side, multiple)
            got = sytrl._pad_mask(seqs, side, multiple)
            assert got.dtype == want.dtype and torch.equal(got, want), (seqs, side, multiple)


def test_a_single_turn_is_read_in_trls_rows_as_the_per_sequence_path_reads_it(tmp_path):
    # _sy_batch_routes reads one captured turn straight into TRL's rows; the per-sequence path
    # (vLLM's layout per sequence, then the importer) is the reference: equal tensors for
    # prompts of every length, completions that ended early (their EOS and padding were fed),
    # one that filled every generated step (its last token never fed), and rows holding an id
    # outside [0, E) (both give the invalid-row marker).
    tr = _trainer(tmp_path, max_steps=1)
    g = torch.Generator().manual_seed(3)
    prompts = [[5, 6], [7, 8, 9, 10, 11], [12], [13, 14, 15]]
    completions = [[20, 21, 22, 23, 24, 25], [26], [27, 28, 29], [30, 31, 32, 33, 34, 35]]
    B, P, G = len(prompts), 5, 6
    ids = torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)])
                       for _ in range(B * (P + G - 1))]).view(B, P + G - 1, L, K).to(torch.int32)
    ids[1, 4, 0, 1] = E      # inside sequence 1's prompt (its last prompt token)
    ids[2, 6, 1, 0] = E + 7  # sequence 2's second completion token
    pm = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        pm[b, P - len(p):] = 1
    turn = (ids, pm, prompts, completions)
    out = []
    for direct in (True, False):
        st = sytrl._GenState()
        st.turn = turn
        if not direct:
            assert st.seqs is not None and st.turn is None  # the per-sequence tables, made now
        tr._sy_gen = st
        out.append(tr._sy_batch_routes(prompts, completions))
        assert (st.turn is not None) == direct  # the direct read made no per-sequence tables
    tr._sy_gen = None
    fast, ref = out
    assert fast.dtype == ref.dtype == torch.int32 and fast.shape == ref.shape == (B, P + G, L, K)
    assert torch.equal(fast, ref)
    assert int((ref == sytrl._INT32_MAX).all(-1).sum()) == 2
    # each sequence: a row at each real token but the last one (the invalid ones included)
    assert [int((ref[b] != -1).all(-1).all(-1).sum()) for b in range(B)] == \
        [len(p) + len(c) - 1 for p, c in zip(prompts, completions)]
    # a batch that is not the captured turn's sequences: left to the per-sequence path
    assert tr._sy_turn_routes(turn, prompts, completions[:3] + [[30]], pm,
                              torch.ones(B, P + G)) is None


@pytest.mark.hostile(tried="TRL: switchyard's GRPOTrainer with a trl older than 1.16",
                     gets="RuntimeError naming the version needed and found")
def test_an_older_trl_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sytrl._trl, "__version__", "1.15.2")
    model = tm.model()
    with pytest.raises(RuntimeError, match=r"needs trl >= 1.16.0, found 1.15.2"):
        _trainer(tmp_path, model=model)
    assert syhf.patch_of(model) is None
