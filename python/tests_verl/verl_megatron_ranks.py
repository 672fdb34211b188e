"""Worker for test_verl_two_ranks.py's Megatron part: switchyard's verl Megatron engine
(SwitchyardMegatronEngine from verl's registry, R3) at 2 ranks on the CPU over gloo, expert
parallel 2 (DP 2: each rank its own sequences; the experts split over the ranks, tokens exchanged
by Megatron's all-to-all dispatcher, sized by switchyard's patch without ``.item()``).

As in test_verl_megatron_replay.py, verl's initialize() (Megatron-Bridge) cannot run here: the
engine's own __init__ builds Megatron's parallel state (EP 2 on gloo), and a Megatron-Core GPT MoE
model built here stands in for initialize()'s. The observer: forward hooks on every router
recording Megatron's routing_map (the experts each token is sent to), compared with the routes
given. Run by verl_ranks.py after its FSDP cases ("megatron"), or alone (writes
OUT_DIR/megatron_rank{r}.json), started with torchrun's environment.

TP 2 with sequence parallelism cannot build the model on the CPU (Megatron-Core's torch_norm.py:
"sequence parallel not supported by torch LayerNorm", Apex / Transformer Engine absent); the
error is written down, and the part that runs is tested: the engine (its parallel state TP 2)
sets each micro-batch's targets for its TP rank's sequence-parallel block on Megatron-Core MoE
layers built alone, whose routers then route that block by them.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # megatron_shims

import verl_cpu  # noqa: E402

verl_cpu.setup(external_modules=["switchyard.integrations.verl"])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


NL, HID, VOCAB, E, K = 2, 32, 128, 8, 2  # VOCAB: the Megatron model's, divisible by TP


def engine(path, ep, tp=1, holder=None):
    return verl_cpu.megatron_engine(path, ep=ep, tp=tp, num_layers=NL, hidden=HID, vocab=VOCAB,
                                    num_experts=E, top_k=K, holder=holder)


def used(maps, B, lengths):
    """The experts each real token was sent to: [B, S, L, K] (sequence-first rows)."""
    S = max(lengths)
    out = torch.zeros(B, S, NL, K, dtype=torch.int64)
    for n, m in maps.items():
        Sp = m.shape[0] // B
        ids = torch.stack([r.nonzero().view(-1) for r in m]).view(Sp, B, K).transpose(0, 1)
        for b, length in enumerate(lengths):
            out[b, :length, n - 1] = ids[b, :length]
    return out


def tp2_targets(eng, forced, prompts, responses, mask):
    """TP 2 + SP: set_micro_batch_targets on 2 Megatron-Core MoE layers (the TP groups of the
    engine's parallel state), each router fed this TP rank's block of the micro-batch's tokens;
    the experts it picks, gathered over the TP group, equal the routes given (bshd, padded)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from tensordict import TensorDict

    import megatron_workers as mw
    import switchyard.integrations.megatron as sym
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    cfg = mw._config(1, num_layers=NL, tensor_model_parallel_size=tp, sequence_parallel=True,
                     num_attention_heads=tp,
                     expert_model_parallel_size=1)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    torch.manual_seed(0)  # the same router weights on both TP ranks
    layers = []
    for n in range(1, NL + 1):  # the experts TP-split (random weights: routing is what counts)
        layers.append(spec(config=cfg, layer_number=n, pg_collection=pg))
        layers[-1].set_layer_number(n)
    sym.attach_replay(layers, invalid_replay_rows="merge")
    eng.tf_config = cfg
    td, _ = verl_cpu.batch(prompts, responses, num_hidden_layers=NL, top_k=K,
                           routed_experts=forced, use_remove_padding=False)
    batch = TensorDict({"input_ids": td["input_ids"], "routed_experts": td["routed_experts"]},
                       batch_size=[len(prompts)])
    eng.set_micro_batch_targets(batch, layers)
    B = len(prompts)
    lengths = mask.sum(1).tolist()
    Sp = max(lengths) + max(lengths) % tp  # verl's bshd length, aligned to TP
    n_local = Sp // tp * B  # this rank's SP block: [Sp / tp, B] sequence-first
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n_local, cfg.hidden_size, generator=g)
    picked = []
    try:
        for layer in layers:
            _, routing_map = layer.router(x)
            ids = torch.stack([r.nonzero().view(-1) for r in routing_map])  # [n_local, K]
            parts = [torch.empty_like(ids) for _ in range(tp)]
            dist.all_gather(parts, ids.contiguous(), group=mpu.get_tensor_model_parallel_group())
            picked.append(torch.cat(parts).view(Sp, B, K).transpose(0, 1))  # [B, Sp, K]
        counts = sym.replay_counts(layers)
    finally:
        sym.set_replay_action(layers, None)
        sym.clear_replay(layers)
    replayed = mismatch = 0
    for b in range(B):
        n = lengths[b] - 1
        want = forced[b][mask[b]][:n].long().sort(-1).values  # [n, L, K]
        for layer in range(NL):
            got = picked[layer][b, :n].sort(-1).values
            mismatch += int((got != want[:, layer]).any(-1).sum())
            replayed += n
    return {"tp": tp, "tp_rank": tp_rank, "rows_per_rank": n_local, "replayed": replayed,
            "mismatch": mismatch, "replayed_here": sum(int(c.replayed) for c in counts.values())}


def data(index):
    """(prompts, responses, forced routes int16 [B, S, L, K] in verl's layout, attention mask)."""
    g = torch.Generator().manual_seed(40 + index)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (3, 2, 4, 2)]
    responses = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (3, 1, 2, 4)]
    _, dense = verl_cpu.batch(prompts, responses, num_hidden_layers=NL, top_k=K,
                              use_remove_padding=False)
    mask = dense["attention_mask"].bool()
    B, S = mask.shape
    forced = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S * NL)]).view(
        B, S, NL, K).to(torch.int16)
    last = mask.long().cumsum(1).eq(mask.sum(1, keepdim=True)) & mask
    forced[~mask | last] = 0
    return prompts, responses, forced, mask


def run(out_dir, rank):
    """Every Megatron case at 2 ranks; returns this rank's findings."""
    path = os.path.join(out_dir, "megatron_model")
    if rank == 0:
        verl_cpu.tiny_qwen3_moe(path, num_hidden_layers=NL)
    dist.barrier()
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    eng, maps, model = engine(path, ep=2)
    res = {"rank": rank, "ep_size": mpu.get_expert_model_parallel_world_size(),
           "ep_rank": mpu.get_expert_model_parallel_rank(),
           "dp_size": mpu.get_data_parallel_world_size(),
           "verl_patch_applied": hasattr(MoEAlltoAllTokenDispatcher, "_preprocess_patched"),
           "local_experts": [int(i) for i in
                             next(m for m in model.modules()
                                  if hasattr(m, "local_expert_indices")).local_expert_indices]}
    prompts, responses, forced, mask = data(rank)  # EP 2 = DP 2: each rank its own sequences
    res["data"] = [prompts, responses]
    B = mask.shape[0]
    lengths = mask.sum(1).tolist()

    def infer(routed, **kw):
        td, _ = verl_cpu.batch(prompts, responses, num_hidden_layers=NL, top_k=K,
                               routed_experts=routed, use_remove_padding=False,
                               micro_batch_size=B, **kw)
        maps.clear()
        out = eng.infer_batch(td)
        return out, used(maps, B, lengths)

    def compare(got):
        replayed = mismatch = 0
        for b in range(B):
            n = lengths[b] - 1  # the last token has no route: routed natively
            want = forced[b][mask[b]][:n].long().sort(-1).values
            mismatch += int((got[b, :n].sort(-1).values != want).any(-1).sum())
            replayed += n * NL
        return {"replayed": replayed, "mismatch": mismatch}

    _, got = infer(forced)
    res["r3"] = compare(got)
    _, got = infer(forced, enable_routing_replay=False)
    res["off"] = compare(got)
    import switchyard.integrations.megatron as sym
    res["counts_cleared"] = all(c.calls == 0 for c in
                                sym.replay_counts(eng.module, total=True).values())
    # TP 2 with sequence parallelism (verl's default for TP > 1): the model cannot be built on the
    # CPU; the exact error is written down
    mpu.destroy_model_parallel()
    holder = {}
    try:
        engine(path, ep=1, tp=2, holder=holder)
        res["tp2_sp"] = None
    except Exception as e:  # noqa: BLE001
        import traceback
        tb = traceback.extract_tb(e.__traceback__)[-1]
        res["tp2_sp"] = {"type": type(e).__name__, "message": str(e),
                         "where": f"{os.path.basename(tb.filename)}:{tb.lineno}"}
    # ...what runs: the engine (its parallel state: TP 2 on gloo) sets each micro-batch's
    # targets for this TP rank's sequence-parallel block on Megatron-Core MoE layers built alone
    # (no TransformerLayer, so no norm), and their routers route this rank's tokens by them
    # (the TP ranks of a DP rank share its data: the same sequences and routes on both)
    prompts, responses, forced, mask = data(0)
    res["tp2_sp_targets"] = tp2_targets(holder["eng"], forced, prompts, responses, mask)
    mpu.destroy_model_parallel()
    return res


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    rank = dist.get_rank()
    res = run(out_dir, rank)
    with open(os.path.join(out_dir, f"megatron_rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
