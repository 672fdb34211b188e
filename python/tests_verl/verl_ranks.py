"""Worker for test_verl_two_ranks.py: verl's FSDP engine (fsdp2, gloo) with switchyard's router
replay at 2 ranks on the CPU, data parallel 2 ("dp2") and Ulysses sequence parallel 2 ("sp2");
then verl_megatron_ranks.py's Megatron engine cases ("megatron": EP 2, TP 2 + SP).

Launched once per rank with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
``python -m torch.distributed.run --nproc_per_node 2 verl_ranks.py OUT_DIR``, torchrun, works
the same); every rank runs every case
and writes what it saw to OUT_DIR/rank{r}.json, the pytest side asserts on it.

The observer is independent of switchyard: a forward pre-hook on every MoE layer's ``experts``
module records the expert ids the layer actually dispatched to, and the expected ids of each row
this rank fed are worked out here from the batch (micro-batches of 2 consecutive sequences, the
packed tokens padded to a multiple of the SP size and cut in equal consecutive blocks, one per SP
rank: verl's rule, written out plainly rather than called).
"""
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import verl_cpu  # noqa: E402

verl_cpu.setup(external_modules=["switchyard.integrations.verl"])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

NUM_LAYERS, E, K, B, MICRO = 2, 8, 2, 4, 2
NAMES = ("router_replay/replayed_rows", "router_replay/native_rows",
         "router_replay/recorded_rows")


def sequences(data_index):
    """B prompts and responses of varied lengths; a different set per data index."""
    g = torch.Generator().manual_seed(100 + data_index)
    def seqs(lo, hi):
        return [torch.randint(3, 97, (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                              generator=g).tolist() for _ in range(B)]
    return seqs(2, 5), seqs(2, 7)


def forced_routes(prompts, responses, seed):
    """verl's routed_experts int16 [B, S, L, K]: random distinct ids at every real token but
    each sequence's last, zeros elsewhere."""
    _, dense = verl_cpu.batch(prompts, responses, num_hidden_layers=NUM_LAYERS, top_k=K)
    m = dense["attention_mask"].bool()
    Bn, S = m.shape
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(Bn * S * NUM_LAYERS)])
    routed = ids.view(Bn, S, NUM_LAYERS, K).to(torch.int16)
    last = m.long().cumsum(1).eq(m.sum(1, keepdim=True)) & m
    routed[~m | last] = 0
    return routed


def make_batch(prompts, responses, routed=None, **kw):
    td, dense = verl_cpu.batch(prompts, responses, num_hidden_layers=NUM_LAYERS, top_k=K,
                               routed_experts=routed, micro_batch_size=MICRO, **kw)
    return td, dense


def expected_rows(dense, routed, sp, sp_rank):
    """Per micro-batch, [rows this rank feeds, L, K] int64: the routes each fed row must take;
    -1 rows: no route (a sequence's last token), -2 rows: padding."""
    m = dense["attention_mask"].bool()
    out = []
    for start in range(0, m.shape[0], MICRO):
        rows = []
        for b in range(start, start + MICRO):
            r = routed[b][m[b]].to(torch.int64)  # [n, L, K]
            none = r.eq(0).all(-1, keepdim=True).expand_as(r)
            rows.append(torch.where(none, -1, r))
        t = torch.cat(rows)
        pad = (-t.shape[0]) % sp
        t = torch.cat([t, torch.full((pad, NUM_LAYERS, K), -2, dtype=torch.int64)])
        n = t.shape[0] // sp
        out.append(t[sp_rank * n:(sp_rank + 1) * n])
    return out


class Observer:
    """Forward pre-hooks on each MoE layer's experts module: the ids it dispatched, per call."""

    def __init__(self, module):
        self.calls = {}  # layer -> [ids [T, K]]
        self.handles = []
        for name, mod in module.named_modules():
            if name.endswith("mlp.experts"):
                layer = int(name.split("layers.")[1].split(".")[0])
                self.calls[layer] = []
                self.handles.append(mod.register_forward_pre_hook(
                    lambda mod, args, layer=layer: self.calls[layer].append(
                        args[1].detach().to(torch.int64).clone())))
        assert len(self.calls) == NUM_LAYERS, sorted(self.calls)

    def clear(self):
        for v in self.calls.values():
            v.clear()

    def compare(self, expected):
        """{"mismatch", "replayed", "native", "rows"} over micro-batches and layers (real tokens
        only), plus per micro-batch replayed / native counts."""
        res = {"mismatch": 0, "replayed": 0, "native": 0, "rows": 0, "per_micro": []}
        for layer, calls in self.calls.items():
            assert len(calls) == len(expected), (layer, len(calls), len(expected))
        for i, want in enumerate(expected):
            mb = {"replayed": 0, "native": 0}
            for layer, calls in self.calls.items():
                got, w = calls[i], want[:, layer]
                assert got.shape == w.shape, (got.shape, w.shape)
                routed = w[:, 0] >= 0
                differ = (got.sort(-1).values != w.sort(-1).values).any(-1)
                res["mismatch"] += int((differ & routed).sum())
                mb["replayed"] += int(routed.sum())
                mb["native"] += int((w[:, 0] == -1).sum())
                res["rows"] += got.shape[0]
            res["replayed"] += mb["replayed"]
            res["native"] += mb["native"]
            res["per_micro"].append(mb)
        return res

    def ids(self):
        """{layer: [ids of every call, concatenated]} as lists."""
        return {str(k): torch.cat(v).tolist() for k, v in self.calls.items()}


def metrics_of(out, dp_group):
    """Each switchyard metric: this rank's per-micro-batch values, its aggregate, and what verl's
    TrainingWorker logs (allgather over the DP group, Metric.aggregate_dp)."""
    from verl.utils.metric import Metric
    from verl.utils.torch_functional import allgather_dict_into_dict
    mets = {k: v for k, v in out["metrics"].items() if k.startswith("router_replay/")}
    gathered = allgather_dict_into_dict(mets, group=dp_group)
    res = {}
    for k, v in mets.items():
        assert isinstance(v, Metric), (k, type(v))
        res[k] = {"values": [int(x) for x in v.values], "aggregate": int(v.aggregate()),
                  "logged": int(Metric.aggregate_dp(gathered[k])),
                  "aggregation": v.aggregation.value}
    return res


def loss_fn(model_output, data, dp_group=None):
    return -model_output["log_probs"].values().mean(), {}


def catch(fn):
    try:
        fn()
    except ValueError as e:
        return {"type": "ValueError", "message": str(e)}
    except Exception as e:  # noqa: BLE001 - reported, the test fails on it
        return {"type": type(e).__name__, "message": str(e) + traceback.format_exc()}
    return None


def run_layout(layout, model_path, rank, world):
    from verl.utils import tensordict_utils as tu
    sp = 2 if layout == "sp2" else 1
    dp_rank, sp_rank = rank // sp, rank % sp
    res = {}
    with verl_cpu.env(VERL_ENGINE_VENDOR="switchyard", SWITCHYARD_VERL_ROUTER_REPLAY="R3"):
        eng = verl_cpu.engine(model_path, micro_batch_size=MICRO, gradient_checkpointing=False,
                              ulysses_sequence_parallel_size=sp)
    res["engine"] = {"type": type(eng).__name__, "mode": eng.router_replay_mode,
                     "dp_rank": eng.get_data_parallel_rank(),
                     "dp_size": eng.get_data_parallel_size(), "sp": sp}
    dp_group = eng.get_data_parallel_group()
    obs = Observer(eng.module)
    prompts, responses = sequences(dp_rank)  # DP ranks: their own data; SP ranks: the same
    routed = forced_routes(prompts, responses, seed=10 + dp_rank)
    res["data"] = {"prompts": prompts, "responses": responses}
    td, dense = make_batch(prompts, responses, routed)
    want = expected_rows(dense, routed, sp, sp_rank)

    # R3, the log-prob pass
    obs.clear()
    with eng.eval_mode():
        out = eng.infer_batch(td)
    res["r3_infer"] = {"observer": obs.compare(want), "metrics": metrics_of(out, dp_group),
                       "fed_ids": obs.ids()}
    # replay off (verl's enable_routing_replay=False): native routing, no replay metrics
    td, _ = make_batch(prompts, responses, routed)
    tu.assign_non_tensor(td, enable_routing_replay=False)
    obs.clear()
    with eng.eval_mode():
        out = eng.infer_batch(td)
    res["off_infer"] = {"observer": obs.compare(want),
                        "metric_names": sorted(k for k in out["metrics"]
                                               if k.startswith("router_replay/"))}
    # R3, the update: forward + backward + optimizer step across the ranks
    td, _ = make_batch(prompts, responses, routed)
    gate = next(p for n, p in eng.module.named_parameters() if n.endswith("mlp.gate.weight"))
    before = gate.detach().clone()
    obs.clear()
    with eng.train_mode():
        out = eng.train_batch(td, loss_function=loss_fn)
    res["r3_train"] = {"observer": obs.compare(want), "metrics": metrics_of(out, dp_group),
                       "gate_changed": not torch.equal(before, gate.detach())}

    # ranks that disagree: ValueError on every rank, nothing left queued, the next call replays
    def bad_call(td):
        with eng.eval_mode():
            eng.infer_batch(td)
    if layout == "dp2":
        # rank 1's routes have 3 layers for the 2-layer model
        bad = torch.cat([routed, routed[:, :, :1]], dim=2) if rank == 1 else routed
        td, _ = make_batch(prompts, responses, bad)
        res["bad_routes_on_one_rank"] = catch(lambda: bad_call(td))
        # rank 1's routes hold an expert id out of range (found by the per-row check)
        bad = routed.clone()
        if rank == 1:
            bad[dense["attention_mask"].bool()] = 99
        td, _ = make_batch(prompts, responses, bad)
        res["bad_id_on_one_rank"] = catch(lambda: bad_call(td))
        # rank 0 turns replay off for the call, rank 1 replays
        td, _ = make_batch(prompts, responses, routed)
        if rank == 0:
            tu.assign_non_tensor(td, enable_routing_replay=False)
        res["call_kind_differs"] = catch(lambda: bad_call(td))
    else:
        # the SP ranks were handed different routes for the same sequences
        other = forced_routes(prompts, responses, seed=99) if rank == 1 else routed
        td, _ = make_batch(prompts, responses, other)
        res["sp_routes_differ"] = catch(lambda: bad_call(td))
    res["queued_after_errors"] = sum(r.num_targets for r in eng.router_patch.replays.values())
    td, _ = make_batch(prompts, responses, routed)
    obs.clear()
    with eng.eval_mode():
        out = eng.infer_batch(td)
    res["after_errors"] = {"observer": obs.compare(want), "metrics": metrics_of(out, dp_group)}
    for h in obs.handles:
        h.remove()

    if layout == "sp2":  # R2: the log-prob pass records (gathered over SP), the update replays
        with verl_cpu.env(VERL_ENGINE_VENDOR="switchyard", SWITCHYARD_VERL_ROUTER_REPLAY="R2"):
            r2 = verl_cpu.engine(model_path, micro_batch_size=MICRO,
                                 gradient_checkpointing=False, ulysses_sequence_parallel_size=sp)
        obs = Observer(r2.module)
        td, _ = make_batch(prompts, responses)
        with r2.eval_mode():
            out = r2.infer_batch(td)
        rec = out["model_output"]["routed_experts"]
        res["r2_record"] = {"recorded": rec.values().tolist(),
                            "offsets": rec.offsets().tolist(), "fed_ids": obs.ids(),
                            "metrics": metrics_of(out, dp_group)}
        # the update replays the records: as verl does, they go back into a dense batch
        m = dense["attention_mask"].bool()
        routed2 = torch.zeros_like(routed)
        for b, seq in enumerate(rec.unbind()):
            routed2[b][m[b]] = seq.to(torch.int16)
        last = m.long().cumsum(1).eq(m.sum(1, keepdim=True)) & m
        routed2[last] = 0  # verl's layout: the last token has no route
        td, _ = make_batch(prompts, responses, routed2)
        obs.clear()
        with r2.train_mode():
            out = r2.train_batch(td, loss_function=loss_fn)
        res["r2_train"] = {"observer": obs.compare(expected_rows(dense, routed2, sp, sp_rank)),
                           "metrics": metrics_of(out, dp_group)}
    return res


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # rank 0 saves the checkpoint (transformers writes on the main process only), all load it
    model_path = os.path.join(out_dir, "model")
    if rank == 0:
        verl_cpu.tiny_qwen3_moe(model_path, num_hidden_layers=NUM_LAYERS)
    dist.barrier()
    result = {"rank": rank, "world": world}
    for layout in sys.argv[2:] or ("dp2", "sp2", "megatron"):
        t = time.perf_counter()
        # an error ends the process (its traceback on stderr); the peer's next collective fails
        if layout == "megatron":  # last: its CPU shims replace torch.cuda functions
            import verl_megatron_ranks
            result[layout] = verl_megatron_ranks.run(out_dir, rank)
        else:
            result[layout] = run_layout(layout, model_path, rank, world)
        result[layout + "_seconds"] = time.perf_counter() - t
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
