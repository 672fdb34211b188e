"""Hostile input on the TRL route paths (issue 35 items 1, 2, 6), through the real trl
GRPOTrainer: rollout routes with ids that a narrowing cast would wrap into range, entries that
are not arrays, odd shapes and dtypes, a routes_field that TRL reads itself; generation without
a KV cache; and a mismatch metric that routes placed at the wrong tokens cannot fool."""
import base64
import io

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

import switchyard.integrations.hf as syhf  # noqa: E402
import switchyard.integrations.trl as sytrl  # noqa: E402
import trl_models as tm  # noqa: E402
from test_trl import _NEAR_TIES, E, K, L, _kinds, _rollout_func, _trainer  # noqa: E402

WHO = r"\[trl.GRPOTrainer\] "


def _set(i, value):
    def broken(out):
        out["routed_experts"][i] = value(out["routed_experts"][i])
    return broken


def _npy_bytes(t):
    buf = io.BytesIO()
    np.save(buf, t.numpy())
    return buf.getvalue()


# ---- ids that a cast would wrap into range ------------------------------------------------------
def _wide(dtype, big):
    def value(t):
        a = t.numpy().astype(dtype)
        a[1, 0, 1] = big
        return a
    return value


@pytest.mark.hostile(tried="TRL rollout_func: int64 / uint32 / uint64 routes holding 2^32+5, "
                           "2^32-1 or 2^64-1 (expert 5 / -1 once cast to int32)",
                     gets="ValueError naming the field, sequence, token, layer and the value as "
                          "given (used to be replayed as expert 5)")
@pytest.mark.parametrize("dtype,big", [(np.int64, 2**32 + 5), (np.int64, 2**32 - 1),
                                       (np.uint32, 2**32 - 1), (np.uint64, 2**64 - 1),
                                       (np.int64, -2)])
def test_a_rollout_id_outside_the_experts_is_refused_in_every_dtype(tmp_path, dtype, big):
    tr = _trainer(tmp_path, rollout_func=_rollout_func(broken=_set(3, _wide(dtype, big))),
                  max_steps=1)
    name = np.dtype(dtype).name
    with pytest.raises(ValueError, match=WHO + r"rollout_func's 'routed_experts'\[3\] \(sequence "
                                         rf"3\): token 1, layer 0, slot 1 holds expert id {big} "
                                         rf"\({name}\), outside \[0, 8\)"):
        tr.train()
    assert tr.switchyard_records == []


@pytest.mark.hostile(tried="TRL rollout_func with a model patched invalid_replay_rows='native': an "
                           "int64 id 2^32+5 in the routes",
                     gets="that (token, layer) row is a counted invalid row, routed natively; the "
                          "other rows replay")
def test_under_the_native_policy_an_id_outside_the_experts_is_a_counted_invalid_row(tmp_path):
    model = tm.model()
    syhf.patch(model, invalid_replay_rows="native")
    tr = _trainer(tmp_path, model=model, rollout_func=_rollout_func(
        broken=_set(3, _wide(np.int64, 2**32 + 5))), max_steps=1)
    tr.train()
    (r,) = tr.switchyard_records
    # sequence 3 appears once in the batch; its token 1, layer 0 row is the one invalid row
    assert r["invalid_rows"] == 1
    assert r["replayed_rows"] == r["compared_rows"] - 1


# ---- entries that are not arrays, odd shapes ---------------------------------------------------
@pytest.mark.hostile(tried="TRL rollout_func: a route entry that is None, a base64 string, .npy "
                           "bytes, a bool tensor, the wrong K or layer count, or one tensor for "
                           "the whole batch",
                     gets="ValueError naming the field, the entry and what it must be (used to be "
                          "a raw TypeError / RuntimeError from torch)")
@pytest.mark.parametrize("broken,msg", [
    (_set(1, lambda t: None), r"'routed_experts'\[1\] is None: expected an integer array of "
                              r"expert ids"),
    (_set(1, lambda t: base64.b64encode(_npy_bytes(t)).decode()),
     r"'routed_experts'\[1\] is str \(\d+ long\), not an array of expert ids .*decode base64"),
    (_set(1, _npy_bytes), r"'routed_experts'\[1\] is bytes \(\d+ long\), not an array"),
    (_set(0, lambda t: t > 3), r"'routed_experts'\[0\] must have an integer dtype .*torch.bool"),
    (_set(2, lambda t: t[:, :, :1]), r"'routed_experts'\[2\] must be an integer array .* = "
                                     r"\[\d+, 2, 2\], got \[\d+, 2, 1\]"),
    (_set(2, lambda t: t[:, :1]), r"'routed_experts'\[2\] must be an integer array .* = "
                                  r"\[\d+, 2, 2\], got \[\d+, 1, 2\]"),
    (lambda out: out.update(routed_experts=torch.zeros(4, 3, L, K, dtype=torch.int32)),
     r"'routed_experts' must be a list with one array per sequence \(4, in completion_ids' "
     r"order\), got a Tensor of shape \[4, 3, 2, 2\]"),
])
def test_a_route_entry_that_is_not_an_id_array_is_refused_clearly(tmp_path, broken, msg):
    tr = _trainer(tmp_path, rollout_func=_rollout_func(broken=broken), max_steps=1)
    with pytest.raises(ValueError, match=WHO + ".*" + msg):
        tr.train()
    assert tr.switchyard_records == []


@pytest.mark.hostile(tried="TRL rollout_func: an empty completion (completion_ids[0] == [])",
                     gets="ValueError naming the sequence and what TRL needs (TRL itself raised an "
                          "IndexError reading the last token)")
def test_an_empty_completion_is_refused_clearly(tmp_path):
    tr = _trainer(tmp_path, rollout_func=_rollout_func(lengths=(0, 3, 2, 4)), max_steps=1)
    with pytest.raises(ValueError, match=WHO + r"rollout_func's completion_ids\[0\] is empty: "
                                         r"TRL's GRPOTrainer needs at least one completion token"):
        tr.train()
    assert tr.switchyard_records == []


def test_non_contiguous_and_numpy_routes_replay_like_int32_tensors(tmp_path):
    def strided(t):  # the same ids as a non-contiguous view of a wider int64 array
        wide = torch.stack([t.to(torch.int64), t.to(torch.int64)], dim=-1)
        return wide[..., 0]

    def as_numpy(t):
        return t.numpy().astype(np.uint8)

    def broken(out):
        out["routed_experts"][0] = strided(out["routed_experts"][0])
        out["routed_experts"][1] = as_numpy(out["routed_experts"][1])
    assert not strided(torch.zeros(2, L, K, dtype=torch.int32)).is_contiguous()
    tr = _trainer(tmp_path, rollout_func=_rollout_func(broken=broken), max_steps=1)
    tr.train()
    (r,) = tr.switchyard_records
    assert r["invalid_rows"] == 0 and r["replayed_rows"] == r["compared_rows"] > 0
    assert r["used_mismatch_rows"] == 0


@pytest.mark.hostile(tried="TRL: routes_field='completion_ids' (a key TRL reads from "
                           "rollout_func's output)",
                     gets="ValueError at construction naming the field and TRL's keys (used to "
                          "surface as TRL's 'rollout_func must return keys' error mid-training)")
@pytest.mark.parametrize("field", ["completion_ids", "prompt_ids", "logprobs", "env_mask"])
def test_a_routes_field_that_collides_with_a_trl_key_is_refused(tmp_path, field):
    model = tm.model()
    with pytest.raises(ValueError, match=WHO + rf"routes_field='{field}' is a key TRL reads from "
                                         r"rollout_func's output \(prompt_ids, completion_ids, "
                                         r"logprobs, env_mask\)"):
        _trainer(tmp_path, model=model, rollout_func=_rollout_func(), routes_field=field)
    assert syhf.patch_of(model) is None


# ---- generation without a KV cache; a metric misaligned routes cannot fool ----------------------
@pytest.mark.hostile(tried="TRL generation with generation_kwargs={'use_cache': False} under R3",
                     gets="captured routes aligned with the tokens (each step's re-fed history is "
                          "not captured twice); used to misalign them while reporting 0 mismatch")
def test_r3_with_uncached_generation_captures_routes_aligned_with_the_tokens(tmp_path):
    runs = {}
    for use_cache in (True, False):
        tr = _trainer(tmp_path / str(use_cache), num_iterations=2, max_steps=2,
                      generation_kwargs={"use_cache": use_cache, "do_sample": False})
        tr.train()
        runs[use_cache] = tr
        for r in _kinds(tr)["old"]:  # the weights that generated: the router agrees
            assert r["compared_rows"] > 0
            assert r["mismatch_rows"] <= _NEAR_TIES * r["compared_rows"]
            assert r["used_mismatch_rows"] == 0 and r["replayed_rows"] == r["compared_rows"]
    # greedy: the same sequences and the same carried routes with and without the cache
    a, b = (runs[u].seen[0] for u in (True, False))
    assert torch.equal(a["completion_ids"], b["completion_ids"])
    differ = (a[sytrl.ROLLOUT_ROUTES_KEY] != b[sytrl.ROLLOUT_ROUTES_KEY]).any(-1)
    assert int(differ.sum()) <= _NEAR_TIES * differ.numel()


def _own_routes_rollout(shift):
    """A rollout_func whose routes are the model's own (a forward of each whole sequence under
    capture), placed ``shift`` tokens off (0: aligned)."""
    tok = tm.tokenizer()

    def rollout(prompts, trainer):
        p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        c_ids = [[3 + (5 * i + k) % 90 for k in range(4)] for i in range(len(prompts))]
        routes = []
        for p, c in zip(p_ids, c_ids):
            full = torch.tensor([p + c])
            with torch.no_grad(), trainer.switchyard_patch.capture() as cap:
                trainer.model(full[:, :-1])
            own = cap.routed_experts()[0]
            routes.append(own.roll(shift, dims=0))
        return {"prompt_ids": p_ids, "completion_ids": c_ids,
                "logprobs": [[-1.0] * len(c) for c in c_ids], "routed_experts": routes}
    return rollout


@pytest.mark.hostile(tried="TRL R3 with rollout routes placed one token off (the model's own "
                           "routes, shifted)",
                     gets="router_mismatch reports most rows (the routers' own choice against the "
                          "rollout's route per token); used to report 0 under R3")
def test_the_mismatch_metric_reports_routes_placed_at_the_wrong_tokens(tmp_path):
    share = {}
    for shift in (0, 1):
        tr = _trainer(tmp_path / str(shift), rollout_func=_own_routes_rollout(shift),
                      num_iterations=2, max_steps=1)
        tr.train()
        (old,) = _kinds(tr)["old"]
        assert old["replayed_rows"] == old["compared_rows"] > 0
        share[shift] = old["mismatch_rows"] / old["compared_rows"]
        logged = [h["switchyard/old/router_mismatch"] for h in tr.state.log_history
                  if "switchyard/old/router_mismatch" in h]
        assert logged == [share[shift]]
    assert share[0] <= _NEAR_TIES
    assert share[1] >= 0.5
