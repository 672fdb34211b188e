"""The one replay core (issue 23, items 1 and 5): the engine's row classifier bound to Python, one
policy vocabulary, the all-or-nothing ReplayDriver, the one recompute detector and the renamed
recompute. Engine-level here; the adapters' cases are in test_replay_conformance.py."""

import pytest
import torch
import torch.utils.checkpoint as ckpt

import switchyard as sy
import switchyard.replay as syr
import switchyard.torch as syt


def _ids(rows):
    return torch.tensor(rows, dtype=torch.int32)


# ---------------------------------------------------------------- the classifier
@pytest.mark.hostile(tried="asked which rows of a replay table are replayed, native or invalid",
                     gets="sy.replay.classify_rows: the engine's one row rule, kinds and counts")
def test_classify_replay_rows_is_the_engines_rule():
    ids = _ids([[1, 2, 3], [-1, -1, -1], [4, -1, -1], [5, 5, 2], [1, 9, 1]])
    rows = sy.replay.classify_rows(ids, 8, "native", layer=3)
    assert rows.kind.tolist() == [syr.REPLAYED, syr.NATIVE, syr.INVALID, syr.INVALID, syr.INVALID]
    assert (rows.num_replayed, rows.num_native, rows.num_invalid, rows.num_pairs) == (1, 4, 3, 3)
    # the same rule as topk_route's (its counts agree row for row)
    _, _, info = syt.topk_route(torch.zeros(5, 8), sy.RouterConfig(num_experts=8, top_k=3),
                                inputs=syt.RouteInputs(replay_idx=ids),
                                options=syt.RouteOptions(invalid_replay_rows="native"))
    assert (info.num_replayed_rows, info.num_native_rows, info.num_invalid_replay_rows) == \
        (rows.num_replayed, rows.num_native, rows.num_invalid)
    with pytest.raises(ValueError, match=r"\[replay\] layer 3, token 2: topk_idx row \[4, -1, -1\] "
                                         "mixes -1 and expert ids"):
        sy.replay.classify_rows(ids, 8, layer=3)


def test_classify_merge_merges_only_repeated_ids():
    rows = sy.replay.classify_rows(_ids([[5, 5, 2], [7, 3, 7], [4, 4, 4], [0, 1, 2]]), 8,
                                   "merge")
    assert rows.kind.tolist() == [syr.MERGED] * 3 + [syr.REPLAYED]
    assert (rows.num_replayed, rows.num_merged, rows.num_pairs) == (4, 3, 2 + 2 + 1 + 3)
    assert rows.replayed.all()
    with pytest.raises(ValueError, match=r"names expert 9 outside \[0, 8\)"):
        sy.replay.classify_rows(_ids([[1, 9, 1]]), 8, "merge")  # out of range wins over a repeat


# ---------------------------------------------------------------- one policy vocabulary
@pytest.mark.hostile(tried="invalid row policy spelled 'to_none' (the route importer's old word)",
                     gets="ValueError naming the new spelling 'native'")
@pytest.mark.parametrize("where", ["RouterReplay", "topk_route", "classify"])
def test_old_policy_spelling_names_the_new_one(where):
    with pytest.raises(ValueError, match="'to_none' is now spelled 'native'"):
        if where == "RouterReplay":
            sy.RouterReplay(2, invalid_replay_rows="to_none")
        elif where == "topk_route":
            syt.topk_route(torch.zeros(1, 4), sy.RouterConfig(num_experts=4, top_k=2),
                           options=syt.RouteOptions(invalid_replay_rows="to_none"))
        else:
            sy.replay.classify_rows(_ids([[0, 1]]), 4, "to_none")


@pytest.mark.hostile(tried="topk_route(options=RouteOptions(invalid_replay_rows='merge')) with a row "
                           "[1, 1]",
                     gets="the row is replayed: both slots keep id 1, each with its weight")
def test_topk_route_merge_keeps_repeated_slots():
    w, idx, info = syt.topk_route(torch.zeros(2, 4, dtype=torch.float64),
                                  sy.RouterConfig(num_experts=4, top_k=2),
                                  inputs=syt.RouteInputs(replay_idx=_ids([[1, 1], [0, 2]])),
                                  options=syt.RouteOptions(invalid_replay_rows="merge"))
    assert idx.tolist() == [[1, 1], [0, 2]]
    assert w.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert (info.num_replayed_rows, info.num_invalid_replay_rows) == (2, 0)


# ---------------------------------------------------------------- the driver: all or nothing
def _driver(n=3, E=8, K=2, policy="error"):
    reps = {l: sy.RouterReplay(K, layer=l, invalid_replay_rows=policy, num_experts=E)
            for l in range(n)}
    return syr.ReplayDriver(reps), reps


@pytest.mark.hostile(tried="set_step_targets where only the last layer's table has a bad row",
                     gets="ValueError naming that layer and token; no layer queues a table")
def test_step_targets_are_validated_for_every_layer_before_any_is_queued():
    reps = [sy.RouterReplay(2, layer=l, num_experts=8) for l in range(3)]
    good = _ids([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"layer 2, token 1: topk_idx row \[4, 4\] repeats"):
        sy.RouterReplay.set_step_targets(reps, [good, good, _ids([[0, 1], [4, 4]])])
    assert [r.num_targets for r in reps] == [0, 0, 0]


@pytest.mark.hostile(tried="a step fails after layer 0 queued its ids for the checkpoint "
                           "recompute; the trainer retries with new ids and runs backward",
                     gets="the failed step's tables are dropped: the recompute gets the retry's ids")
def test_failed_step_leaves_no_layer_a_previous_batch_ids():
    d, reps = _driver()
    old, new = _ids([[0, 1], [2, 3]]), _ids([[4, 5], [6, 7]])
    for r in reps.values():
        r.action = "replay_forward"
    d.set_step_targets([old, old, old])
    d.begin_step()
    rows = d.take_forward(0, 2)
    d.queue_recompute(0, rows.ids)  # layer 0 ran, checkpointed
    d.end_step(failed=True)  # layer 1 failed: 1 and 2 never took their targets
    assert all(r.num_targets == 0 and r.num_pending_recompute == 0 for r in reps.values())
    d.set_step_targets([new, new, new])
    d.begin_step()
    for k in reps:
        d.queue_recompute(k, d.take_forward(k, 2).ids)
    d.end_step()
    assert all(torch.equal(d.take_recompute(k, 2).ids, new) for k in reps)


def test_take_forward_takes_the_table_even_when_the_token_count_is_wrong():
    d, reps = _driver(n=1)
    reps[0].action = "replay_forward"
    d.set_step_targets({0: _ids([[0, 1]] * 4)})
    with pytest.raises(ValueError, match="has 4 tokens, the router got 3"):
        d.take_forward(0, 3)
    assert reps[0].num_targets == 0  # the retry never replays the failed step's ids


# ---------------------------------------------------------------- one recompute detector
@pytest.mark.parametrize("reentrant", [False, True])
def test_recompute_kind_tells_the_checkpoint_recompute(reentrant):
    seen = []

    def f(x):
        seen.append(syr.recompute_kind())
        return x.sin()  # saves x: the recompute runs

    x = torch.ones(3, requires_grad=True)
    ckpt.checkpoint(f, x, use_reentrant=reentrant).sum().backward()
    assert seen == [None, "reentrant" if reentrant else "non_reentrant"]


# ---------------------------------------------------------------- one word: recompute
@pytest.mark.hostile(tried="RouterReplay action 'replay_backward' / replay_backward() / "
                           "num_pending_backward (names removed in 0.3.0)",
                     gets="ValueError / AttributeError naming 'recompute' / recompute() / "
                          "num_pending_recompute")
def test_replay_backward_names_say_recompute():
    r = sy.RouterReplay(2)
    r.replay_forward(_ids([[0, 1]]))
    with pytest.raises(ValueError, match=r"\[replay\] action 'replay_backward' was renamed "
                                         r"'recompute'"):
        r.action = "replay_backward"
    assert r.action is None  # nothing changed
    with pytest.raises(AttributeError, match="'replay_backward' was renamed 'recompute'"):
        r.replay_backward(1)
    with pytest.raises(AttributeError, match="'num_pending_backward' was renamed "
                                             "'num_pending_recompute'"):
        r.num_pending_backward
    r.action = "recompute"
    assert r.recompute(1).tolist() == [[0, 1]] and r.num_pending_recompute == 0


# ---------------------------------------------------------------- one count record
def test_replay_counts_of_rows_and_sums():
    rows = sy.replay.classify_rows(_ids([[0, 1], [-1, -1], [2, 2], [3, 4]]), 8, "merge")
    c = sy.replay.ReplayCounts.of_rows(rows)
    assert (c.calls, c.tokens, c.replayed, c.merged, c.native, c.invalid) == (1, 4, 3, 1, 1, 0)
    assert c.replayed + c.native == c.tokens
    n = sy.replay.ReplayCounts.of_native(5)
    assert (n.calls, n.tokens, n.native, n.replayed) == (1, 5, 5, 0)
    # Every field is summed (a field added later must be added by add() too).
    import dataclasses
    fields = [f.name for f in dataclasses.fields(sy.replay.ReplayCounts)]
    a = sy.replay.ReplayCounts(*range(1, len(fields) + 1))
    total = sy.replay.ReplayCounts.summed([a, a, a])
    assert [getattr(total, f) for f in fields] == [3 * (i + 1) for i in range(len(fields))]
