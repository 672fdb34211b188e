"""switchyard.integrations.megatron against the real megatron-core (PyPI), on CPU with gloo.

The Megatron MoE layers run in spawned worker processes (python/tests/megatron_workers.py; the
CUDA-only calls on that path are shimmed there by megatron_shims.py, each with why). One process
group per world size runs every case, since importing Megatron-Core takes seconds.
EP=1 vs EP=n comparisons use a tolerance of atol 1e-6, rtol 1e-5 (fp32): the experts are
Megatron's SequentialMLP, whose GEMMs see different row counts per expert at different EP sizes
and torch's CPU GEMM is not batch invariant.
"""
import os
import sys
import types

import pytest
import torch

megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_workers as mw  # noqa: E402

import switchyard.integrations.megatron as sym  # noqa: E402

ATOL, RTOL = 1e-6, 1e-5
E, K = mw.E, mw.K


def _run(cases, world, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"megatron_ep{world}")
    res = mw.spawn(cases, world, str(d))
    for rank, per_case in enumerate(res):
        for case, r in per_case.items():
            assert "worker_error" not in r, f"rank {rank}, case {case}:\n{r['worker_error']}"
    return res


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    return _run(["seed", "fused", "mtp", "recompute", "bad", "engine", "datapath", "block"], 2,
                tmp_path_factory)


@pytest.fixture(scope="module")
def ep1(tmp_path_factory):
    return _run(["seed"], 1, tmp_path_factory)


@pytest.fixture(scope="module")
def ep4(tmp_path_factory):
    return _run(["seed", "bad"], 4, tmp_path_factory)


@pytest.fixture
def by_world(request):
    return request.getfixturevalue(f"ep{request.param}")


def _map(ids):
    return torch.zeros(ids.shape[0], E, dtype=torch.int32).scatter(1, ids.long(), 1).bool()


# ---- the seed bug ------------------------------------------------------------------------------
@pytest.mark.parametrize("by_world,expected", [
    (1, "split_with_sizes expects split_sizes to sum exactly to 24"),
    (2, "Split sizes doesn't match total dim 0 size"),
    (4, "Split sizes doesn't match total dim 0 size"),
], indirect=["by_world"])
def test_seed_unpatched_alltoall_fails_on_zero_filled_replay_rows(by_world, expected):
    # Megatron's own RouterReplay with rows [0, 0]: the routing map holds 21 pairs for 12 tokens,
    # the dispatcher sizes 24 (T * topk). EP=1 fails in the experts' split, EP>1 in the all-to-all.
    for rank in by_world:
        assert expected in rank["seed"]["unpatched_error"]


@pytest.mark.parametrize("by_world", [1, 2, 4], indirect=True)
def test_seed_patched_step_runs_and_equals_ep1(by_world):
    for rank in by_world:
        r = rank["seed"]
        torch.testing.assert_close(r["patched_out"], r["ref_out"], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["patched_grad"], r["ref_grad"], atol=ATOL, rtol=RTOL)
        # Megatron's own replay: the size rides the split-size copy, synced before permute 1.
        assert r["patched_sync_point"] == "before_permutation_1"


@pytest.mark.parametrize("by_world", [1, 2, 4], indirect=True)
def test_switchyard_replay_merges_repeated_ids_with_summed_weight(by_world):
    for rank in by_world:
        r = rank["seed"]
        assert r["sy_counts"] == {"calls": 1, "tokens": 12, "replayed": 12, "merged": 3,
                                  "native": 0, "invalid": 0}
        assert r["sy_num_out_tokens"] == 12 * K - 3  # host-known pair count reached the dispatcher
        assert r["sy_sync_point"] == r["native_sync_point"]  # and no sync point moved
        torch.testing.assert_close(r["sy_out"], r["sy_ref_out"], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["sy_grad"], r["sy_ref_grad"], atol=ATOL, rtol=RTOL)
        ids = r["ids"]
        assert torch.equal(r["sy_map"], _map(ids))
        for t in (2, 5, 9):  # softmax over two equal logits, summed: the whole weight
            assert r["sy_probs"][t, 0].item() == 1.0
            assert int(r["sy_map"][t].sum()) == 1
        # Rows without repeats: Megatron's softmax over the two replayed logits, summing to 1.
        torch.testing.assert_close(r["sy_probs"].sum(dim=1), torch.ones(12))


def test_apply_reports_and_remove_restores():
    import megatron.core.tensor_parallel as tp
    from megatron.core.transformer.moe import moe_layer, router, token_dispatcher as td
    before = (td.MoEAlltoAllTokenDispatcher.preprocess, router.TopKRouter.routing,
              td._DeepepManager.setup_metadata, moe_layer.MoELayer.route, tp.checkpoint)
    with sym.patched() as report:
        assert sym.is_applied()
        assert report.version.startswith("0.")
        assert report.tested == any(report.version.startswith(v) for v in sym.TESTED_VERSIONS)
        names = [t for t, _ in report.patched]
        for want in ("MoEAlltoAllTokenDispatcher.preprocess", "TopKRouter.routing",
                     "TopKRouter.forward", "_DeepepManager.setup_metadata",
                     "_NCCLEPManager.setup_metadata", "MoELayer.route",
                     "megatron.core.tensor_parallel.checkpoint"):
            assert any(n.endswith(want) for n in names), (want, names)
        assert sym.apply() is report  # idempotent
        assert td.MoEAlltoAllTokenDispatcher.preprocess is not before[0]
        assert "MoEAlltoAllTokenDispatcher.preprocess" in str(report)
    assert not sym.is_applied()
    after = (td.MoEAlltoAllTokenDispatcher.preprocess, router.TopKRouter.routing,
             td._DeepepManager.setup_metadata, moe_layer.MoELayer.route, tp.checkpoint)
    assert after == before


def test_apply_twice_with_another_engine_is_an_error():
    with sym.patched():
        with pytest.raises(ValueError, match=r"already applied with engine=None"):
            sym.apply(engine="cpu")


def test_attach_replay_needs_apply():
    with pytest.raises(RuntimeError, match=r"apply\(\) first"):
        sym.attach_replay(torch.nn.Linear(2, 2))


def test_apply_rejects_unknown_engine():
    with pytest.raises(ValueError, match=r"\[megatron.apply\] engine must be None or 'cpu'"):
        sym.apply(engine="gpu")


# ---- DeepEP / NCCL-EP metadata -----------------------------------------------------------------
@pytest.mark.parametrize("manager", ["_DeepepManager", "_NCCLEPManager"])
def test_ep_metadata_sends_no_token_to_a_zero_weight_expert(manager):
    from megatron.core.transformer.moe import token_dispatcher as td
    cls = getattr(td, manager)
    # A routing map as a merged replay row leaves it: token 1 goes to expert 0 only (weight 1).
    routing_map = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    probs = torch.tensor([[0, .3, 0, .7], [1., 0, 0, 0], [0, 0, .6, .4]])

    def meta():  # the manager's metadata step alone, on an object holding what it reads
        m = types.SimpleNamespace(num_experts=4, router_topk=2, capacity_factor=None,
                                  drop_and_pad=False)
        cls.setup_metadata(m, routing_map, probs)
        return m
    bug = meta()
    sent = [set(r.tolist()) for r in bug.token_indices]
    assert len(sent[1]) == 2 and 0 in sent[1]  # Megatron: a second expert, at weight 0
    with sym.patched():
        m = meta()
    for t in range(3):
        valid = m.token_indices[t] >= 0
        assert set(m.token_indices[t][valid].tolist()) == set(routing_map[t].nonzero().view(-1)
                                                               .tolist())
        torch.testing.assert_close(m.token_probs[t][valid].sum(), probs[t].sum())
    assert sorted(m.token_indices[1].tolist()) == [-1, 0]
    assert m.token_probs[1].tolist() in ([1.0, 0.0], [0.0, 1.0])


# ---- replay ------------------------------------------------------------------------------------
def test_replay_on_fused_unfused_and_sinkhorn_router_paths(ep2):
    for rank in ep2:
        r = rank["fused"]
        want = _map(r["ids"])
        assert torch.equal(r["megatron_unfused_map"], want)
        assert not torch.equal(r["megatron_fused_map"], want)  # Megatron skips replay when fused
        assert not torch.equal(r["megatron_sinkhorn_map"], want)  # and with sinkhorn
        for tag in ("unfused", "fused", "sinkhorn"):
            assert torch.equal(r[f"sy_{tag}_map"], want)
            assert r[f"sy_{tag}_counts"]["replayed"] == 12
            assert torch.equal(r[f"r2_{tag}_replayed"], r[f"r2_{tag}_recorded"])
        assert torch.equal(r["sy_fused_probs"], r["sy_unfused_probs"])
        # Sinkhorn's weights at the replayed ids: Megatron's activation (softmax over E for K>1).
        sm = torch.softmax(r["sinkhorn_logits"], dim=-1)
        torch.testing.assert_close(r["sy_sinkhorn_probs"], sm * want, atol=0, rtol=0)


def test_mtp_layers_do_not_shift_replay(ep2):
    for rank in ep2:
        r = rank["mtp"]
        assert r["keys"] == sorted(["1", "2", "('mtp', 1)"])
        # Megatron's positional list hands the second table to the MTP router built before l2.
        assert torch.equal(r["megatron_l2_map"], _map(r["a"]))
        assert torch.equal(r["sy_l1_map"], _map(r["a"]))
        assert torch.equal(r["sy_l2_map"], _map(r["b"]))
        assert r["sy_counts"]["('mtp', 1)"]["native"] == 12
        assert r["sy_counts"]["2"]["replayed"] == 12
        assert "no attached router has the key 3" in r["bad_key"]
        assert r["vpp_keys"] == r["keys"]
        assert torch.equal(r["vpp_l2_map"], _map(r["b"]))
        assert "two routers have the key 1" in r["dup_key"]


def test_replay_recompute_reuses_ids(ep2):
    for rank in ep2:
        r = rank["recompute"]
        assert r["moe_layer_recompute"]
        assert r["pending_after_forward_only"] == 0  # forward-only passes queue nothing
        assert r["pending_after_backward"] == 0
        assert r["router_calls"] == 3  # forward-only, checkpointed forward, recompute
        fwd, recompute = r["maps"]
        assert torch.equal(fwd, _map(r["ids"]))
        assert torch.equal(recompute, fwd)
        assert r["rc_total"]["replayed"] == 36 and r["rc_total"]["merged"] == 3
        torch.testing.assert_close(r["rc_out"], r["plain_out"], atol=0, rtol=0)
        torch.testing.assert_close(r["rc_grad"], r["plain_grad"], atol=0, rtol=0)


def test_replay_backward_queue_is_bounded(ep2):
    for rank in ep2:
        r = rank["recompute"]
        assert r["bound_errors"][:2] == [None, None]
        assert "2 checkpointed forwards are waiting for their backward (max_pending_backward=2)" \
            in r["bound_errors"][2]
        assert r["pending_at_bound"] == 2 and r["pending_after_clear"] == 0


@pytest.mark.parametrize("by_world", [2, 4], indirect=True)
@pytest.mark.parametrize("name,message", [
    ("repeat", "token 3: topk_idx row [0, 0] repeats expert 0"),
    ("range", "token 6: topk_idx row"),
    ("mixed", "token 1: topk_idx row [-1, "),
    ("shape", "replay ids must be [num_tokens, 2], got [12, 1]"),
    ("dtype", "replay ids must have an integer dtype"),
    ("tokens", "the replay tensor has 11 tokens, the router gets 12"),
])
def test_bad_replay_tensor_same_error_on_every_rank(by_world, name, message):
    world = len(by_world)
    errors = [rank["bad"][f"err_{name}"] for rank in by_world]
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("ValueError: [")
    assert message in errors[0]
    assert f"(on rank {world - 1} of the group)" in errors[0]


def test_bad_replay_queues_nothing_and_native_rows_are_counted(ep2):
    for rank in ep2:
        r = rank["bad"]
        assert r["queued_after_errors"] == 0
        assert r["native_counts"] == {"calls": 1, "tokens": 12, "replayed": 11, "merged": 0,
                                      "native": 1, "invalid": 0}
        assert "the replay tensor has 5 tokens, the router got 12" in r["err_forward_tokens"]
        # repeated_ids="native": row 3 ([0, 0]) routed natively and counted as invalid.
        assert r["invalid_native_counts"] == {"calls": 1, "tokens": 12, "replayed": 11,
                                              "merged": 0, "native": 1, "invalid": 1}
        ids = r["repeat_ids"]
        keep = torch.ones(12, dtype=torch.bool)
        keep[3] = False
        assert torch.equal(r["invalid_native_map"][keep], _map(ids[keep]))
        assert int(r["invalid_native_map"][3].sum()) == K  # routed natively: K experts


# ---- the rollout data path into the model ------------------------------------------------------
def test_verl_routes_replay_into_the_layers_they_belong_to(ep2):
    for rank in ep2:
        r = rank["datapath"]
        packed = r["packed"]
        assert r["moe_layers"] == [1, 2]
        assert r["cu"] == [0, 4, 10]  # sequences of 4 and 6 real tokens
        T = r["cu_padded"][-1]  # padded to Megatron's THD alignment for tp_size 4
        num_none = (T - 10) + 2  # alignment padding, and each sequence's unrouted last token
        for col, key in enumerate((2, 3)):
            ids = packed[:, col, :]
            none = (ids < 0).all(dim=1)
            assert int(none.sum()) == num_none and ids.shape[0] == T
            assert r["counts"][key] == {"calls": 1, "tokens": T, "replayed": T - num_none,
                                        "merged": 0, "native": num_none, "invalid": 0}
            assert torch.equal(r["maps"][key][~none], _map(ids[~none]))
            assert bool((r["maps"][key][none].sum(dim=1) == K).all())


def test_transformer_block_full_recompute_replays_verl_routes_by_layer_number(ep2):
    for rank in ep2:
        r = rank["block"]
        assert r["moe_layers"] == [1, 2]
        for name in ("plain", "full"):
            assert r[f"{name}_keys"] == [2, 3]  # TransformerLayer numbers; layer 1 is dense
            assert r[f"{name}_pending"] == {2: 0, 3: 0}
        for col, key in enumerate((2, 3)):
            ids = r["table"][:, col, :]
            routed = ~(ids < 0).all(dim=1)
            assert int(routed.sum()) == 11  # the last token had no route: native, counted
            plain, full = r["plain_maps"][key], r["full_maps"][key]
            assert len(plain) == 1 and len(full) == 2  # checkpointed forward + recompute
            assert torch.equal(full[0], full[1])
            assert torch.equal(full[0], plain[0])
            assert torch.equal(plain[0][routed], _map(ids[routed]))
            assert r["full_counts"][key] == {"calls": 2, "tokens": 24, "replayed": 22,
                                             "merged": 0, "native": 2, "invalid": 0}
        torch.testing.assert_close(r["full_out"], r["plain_out"], atol=0, rtol=0)
        torch.testing.assert_close(r["full_grad"], r["plain_grad"], atol=0, rtol=0)


# ---- engine="cpu" --------------------------------------------------------------------------
def test_engine_cpu_router_matches_megatron_and_is_batch_invariant(ep2):
    for rank in ep2:
        r = rank["engine"]
        assert "Router.gating" in r["report"]
        assert torch.equal(r["engine_map"], r["megatron_map"])
        torch.testing.assert_close(r["engine_probs"], r["megatron_probs"], atol=ATOL, rtol=RTOL)
        # The FP32 gate's fixed reduction order: a token's weights do not depend on the batch.
        assert torch.equal(r["engine_probs_first5"], r["engine_probs"][:5])
        assert torch.equal(r["engine_replay_map"], _map(r["ids"]))
        for t in (4, 11):
            assert r["engine_replay_probs"][t, 0].item() == 1.0
        assert r["engine_counts"]["merged"] == 2 and r["engine_counts"]["replayed"] == 20
        torch.testing.assert_close(r["engine_out"], r["megatron_out"], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["engine_grad"], r["megatron_grad"], atol=ATOL, rtol=RTOL)
