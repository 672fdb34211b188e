"""switchyard.integrations.verl at 2 ranks: verl's FSDP engine (fsdp2 over gloo, on the CPU) with
data parallel 2 ("dp2") and Ulysses sequence parallel 2 ("sp2"), then verl's Megatron engine
with expert parallel 2 and what runs of TP 2 + sequence parallel (verl_megatron_ranks.py); two
processes started the way torchrun starts them (verl_ranks.py, once per rank; its results are
what these tests read).

Each rank's routes are checked by an observer independent of switchyard's counters: forward
pre-hooks on every MoE layer's experts module record the ids dispatched, compared with the rows
that rank must feed (worked out in verl_ranks.py from the batch, verl's micro-batch and Ulysses
cuts written out plainly). On the CPU verl patches flash attention only for Ulysses, so with sdpa
each SP rank attends within its own slice (the log-probs are not those of a whole-sequence
forward); the routes each rank replays, records and feeds are checked exactly."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = ("dp2", "sp2")
NUM_LAYERS, K = 2, 2
SUM_NAMES = ("router_replay/replayed_rows", "router_replay/native_rows")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """[rank 0's results, rank 1's results] of one 2-process run of verl_ranks.py."""
    out = tmp_path_factory.mktemp("verl_ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        for k in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES", "VERL_ENGINE_VENDOR"):
            env.pop(k, None)  # the worker sets its own (verl_cpu.setup)
        log = open(out / f"log{rank}", "w")
        procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, "verl_ranks.py"),
                                        str(out)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    try:
        codes = [p.wait(timeout=420) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = [(out / f"log{r}").read_text()[-4000:] for r in range(2)]
    assert codes == [0, 0], "\n".join(f"rank {r} (exit {c}):\n{t}"
                                      for r, (c, t) in enumerate(zip(codes, logs)))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_engines_span_both_ranks_in_each_layout(ranks):
    for lay, dp, sp in (("dp2", 2, 1), ("sp2", 1, 2)):
        for r, res in enumerate(ranks):
            e = res[lay]["engine"]
            assert e["type"] == "SwitchyardFSDPEngine" and e["mode"] == "R3"
            assert (e["dp_size"], e["sp"]) == (dp, sp)
            assert e["dp_rank"] == (r if dp == 2 else 0)


def test_the_ranks_got_different_data(ranks):
    # data parallel: each rank its own sequences
    d0, d1 = (res["dp2"]["data"] for res in ranks)
    assert d0 != d1
    # sequence parallel: the same sequences, each rank feeding its own half of the tokens
    s0, s1 = (res["sp2"] for res in ranks)
    assert s0["data"] == s1["data"]
    f0, f1 = (s["r3_infer"]["fed_ids"] for s in (s0, s1))
    assert f0 != f1
    rows = [s["r3_infer"]["observer"]["rows"] for s in (s0, s1)]
    assert rows[0] == rows[1] > 0  # verl pads the packed tokens to split them evenly


@pytest.mark.parametrize("layout", LAYOUTS)
def test_r3_log_prob_pass_replays_the_rollouts_routes_on_every_rank(ranks, layout):
    for res in ranks:
        obs = res[layout]["r3_infer"]["observer"]
        assert obs["replayed"] > 0 and obs["mismatch"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_with_replay_off_the_routes_differ_from_the_rollouts(ranks, layout):
    for res in ranks:
        off = res[layout]["off_infer"]
        assert off["observer"]["mismatch"] > 0
        assert off["metric_names"] == []  # native calls report no replay metrics


@pytest.mark.parametrize("layout", LAYOUTS)
def test_r3_update_replays_and_trains_the_routers_on_every_rank(ranks, layout):
    for res in ranks:
        upd = res[layout]["r3_train"]
        assert upd["observer"]["replayed"] > 0 and upd["observer"]["mismatch"] == 0
        assert upd["gate_changed"]  # the routers' gradients flowed, the optimizer stepped


@pytest.mark.parametrize("call", ["r3_infer", "r3_train"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logged_metrics_equal_the_observers_totals_over_all_ranks(ranks, layout, call):
    obs = [res[layout][call]["observer"] for res in ranks]
    mets = [res[layout][call]["metrics"] for res in ranks]
    assert mets[0] == mets[1]  # every rank reports the same, reduced, values
    m = mets[0]
    for name, key in zip(SUM_NAMES, ("replayed", "native")):
        want = sum(o[key] for o in obs)
        # what verl's TrainingWorker logs (Metric.aggregate_dp over the DP group)
        assert m[name]["logged"] == m[name]["aggregate"] == want
        assert m[name]["aggregation"] == "sum"
        per = [[mb[key] for mb in o["per_micro"]] for o in obs]  # [rank][micro-batch]
        assert m[name]["values"] == [sum(col) for col in zip(*per)]
        assert m[name + "/max_rank"]["values"] == [max(col) for col in zip(*per)]
        assert m[name + "/min_rank"]["values"] == [min(col) for col in zip(*per)]
        assert m[name + "/max_rank"]["logged"] == max(map(max, per))
        assert m[name + "/min_rank"]["logged"] == min(map(min, per))


def test_sp2_r2_records_the_whole_micro_batch_and_the_update_replays_it(ranks):
    recs = [res["sp2"]["r2_record"] for res in ranks]
    assert recs[0]["recorded"] == recs[1]["recorded"]  # gathered over the SP group
    rec = torch.tensor(recs[0]["recorded"])  # [tokens, L, K]
    offsets = recs[0]["offsets"]
    total = offsets[-1]
    assert rec.shape == (total, NUM_LAYERS, K)
    # what each SP rank's experts saw, micro-batch by micro-batch (2 sequences each), put back
    fed = [{int(k): torch.tensor(v) for k, v in r["fed_ids"].items()} for r in recs]
    cuts = offsets[::2]
    pos = [0, 0]
    for a, b in zip(cuts, cuts[1:]):
        n = b - a
        half = (n + n % 2) // 2
        for layer in range(NUM_LAYERS):
            whole = torch.cat([fed[r][layer][pos[r]:pos[r] + half] for r in range(2)])[:n]
            assert torch.equal(whole.sort(-1).values, rec[a:b, layer].sort(-1).values)
        pos = [p + half for p in pos]
    assert recs[0]["metrics"]["router_replay/recorded_rows"]["logged"] == total * NUM_LAYERS
    for res in ranks:
        upd = res["sp2"]["r2_train"]["observer"]
        assert upd["replayed"] > 0 and upd["mismatch"] == 0


@pytest.mark.hostile(tried="verl at DP 2: one rank's routed_experts has 3 layers for a 2-layer "
                     "model", gets="ValueError on both ranks before any forward (that rank: "
                     "the shape; the other: the ranks disagree on the routes' layers), no hang")
def test_bad_routes_on_one_rank_raise_on_every_rank(ranks):
    e0, e1 = (res["dp2"]["bad_routes_on_one_rank"] for res in ranks)
    assert e0["type"] == e1["type"] == "ValueError"
    assert "ranks disagree" in e0["message"] and "routes' layers" in e0["message"]
    assert "rank 0: 2, rank 1: 3" in e0["message"]
    assert "routed_experts must be" in e1["message"] and "num_hidden_layers=2" in e1["message"]


@pytest.mark.hostile(tried="verl at DP 2: one rank's routed_experts holds expert id 99 of 8",
                     gets="ValueError on both ranks before any forward (that rank: the id; the "
                     "other: the ranks disagree on whether the routes are valid), no hang")
def test_an_id_out_of_range_on_one_rank_raises_on_every_rank(ranks):
    e0, e1 = (res["dp2"]["bad_id_on_one_rank"] for res in ranks)
    assert e0["type"] == e1["type"] == "ValueError"
    assert "ranks disagree" in e0["message"] and "routes valid" in e0["message"]
    assert "99" in e1["message"], e1["message"]


@pytest.mark.hostile(tried="verl at DP 2: rank 0's call says enable_routing_replay=False, rank "
                     "1's replays", gets="the same ValueError on both ranks naming the call kind "
                     "and each rank's, no hang")
def test_ranks_that_disagree_on_replaying_raise_on_every_rank(ranks):
    e0, e1 = (res["dp2"]["call_kind_differs"] for res in ranks)
    assert e0 == e1 and e0["type"] == "ValueError"
    assert "call kind" in e0["message"] and "rank 0: 0, rank 1: 1" in e0["message"]


@pytest.mark.hostile(tried="verl at Ulysses SP 2: the two SP ranks handed different routes for "
                     "the same sequences", gets="the same ValueError on both ranks naming the "
                     "routes checksum, no hang")
def test_sp_ranks_with_different_routes_raise_on_every_rank(ranks):
    e0, e1 = (res["sp2"]["sp_routes_differ"] for res in ranks)
    assert e0 == e1 and e0["type"] == "ValueError"
    assert "sequence-parallel group" in e0["message"] and "routes checksum" in e0["message"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_after_the_errors_nothing_is_queued_and_the_next_call_replays(ranks, layout):
    for res in ranks:
        assert res[layout]["queued_after_errors"] == 0
        after = res[layout]["after_errors"]
        assert after["observer"]["mismatch"] == 0
        assert after["observer"] == res[layout]["r3_infer"]["observer"]
        assert after["metrics"] == res[layout]["r3_infer"]["metrics"]


# ---- verl's Megatron engine (verl_megatron_ranks.py) ------------------------------------------
def test_megatron_engine_ep2_replays_on_every_rank(ranks):
    """SwitchyardMegatronEngine from verl's registry, EP 2 (= DP 2) on gloo: each rank holds 4 of
    the 8 experts and its own sequences; verl's infer_batch (its schedule, BSHD preprocessing,
    the GPT forward, Megatron's all-to-all dispatcher sized by switchyard's patch) routes every
    routed token to the given experts (Megatron's routing_map, mismatch 0) and, with replay off,
    elsewhere; verl's own replay patch is never applied; nothing stays queued."""
    m0, m1 = (res["megatron"] for res in ranks)
    assert (m0["ep_size"], m0["ep_rank"], m1["ep_rank"]) == (2, 0, 1)
    assert m0["dp_size"] == 2 and m0["data"] != m1["data"]
    assert m0["local_experts"] == [0, 1, 2, 3] and m1["local_experts"] == [4, 5, 6, 7]
    for m in (m0, m1):
        assert m["r3"]["replayed"] > 0 and m["r3"]["mismatch"] == 0
        assert m["off"]["mismatch"] > 0
        assert m["verl_patch_applied"] is False and m["counts_cleared"] is True


def test_megatron_tp2_sequence_parallel_blocker_and_the_part_that_runs(ranks):
    """TP 2 + sequence parallel: Megatron-Core refuses to build a TransformerLayer on the CPU
    (torch LayerNorm, without Apex / Transformer Engine, has no SP); the exact error is pinned
    so that a Megatron release that lifts it shows up here. What runs: the engine, its parallel
    state TP 2, sets each micro-batch's targets for its TP rank's SP block on Megatron-Core MoE
    layers built alone, and their routers, gathered over the TP group, took the given routes."""
    for r, res in enumerate(ranks):
        m = res["megatron"]
        assert m["tp2_sp"] == {"type": "AssertionError", "message": "sequence parallel not "
                               "supported by torch LayerNorm when instantiating TransformerLayer",
                               "where": "torch_norm.py:50"}
        t = m["tp2_sp_targets"]
        assert (t["tp"], t["tp_rank"]) == (2, r)
        assert t["replayed"] > 0 and t["mismatch"] == 0
    # each TP rank replayed its own block: together, every routed row once
    assert sum(res["megatron"]["tp2_sp_targets"]["replayed_here"] for res in ranks) == \
        ranks[0]["megatron"]["tp2_sp_targets"]["replayed"]
