"""The trainer, as verl's FSDP actor runs it: the rollout's tokens re-scored by the same bf16
weights on packed (THD) micro-batches that differ from the rollout's batches, with transformers' per-expert
("eager") experts and the packed block-diagonal attention, in four router modes:

bf16  transformers' default router (bf16 gate GEMM, bf16 logits);
fp32  switchyard.integrations.hf's FP32 router (gate GEMM and routing math in fp32);
r2    R2: the old-log-prob pass records its routes, one optimizer step, the update pass replays
      them;
r3    R3: the rollout's routes, read back from the route file, replayed in the trainer."""
import dataclasses
import time

import torch

from .model import PAD

MODES = ("bf16", "fp32", "r2", "r3")


@dataclasses.dataclass
class MicroBatch:
    """Sequences packed end to end (one row, THD), each padded to the pack alignment with PAD
    tokens whose positions continue the sequence (Megatron-Core's cu_seqlens_padded layout)."""
    samples: list
    input_ids: torch.Tensor      # [1, T_padded]
    position_ids: torch.Tensor   # [1, T_padded]
    cu_seqlens: list
    cu_seqlens_padded: list
    targets: torch.Tensor        # [T_padded, moe_layers, K] int32 rollout routes, -1 = none

    @property
    def num_tokens(self):
        return int(self.input_ids.shape[1])


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    micro_batch_tokens: int = 640   # token budget of one packed micro-batch (verl's dynamic bsz)
    pack_align: int = 8             # pad every sequence to a multiple of this (tp_size in pack_thd)
    update_lr: float = 1e-4         # Adam step of the R2 / R3 GRPO update
    clip: float = 0.2
    seed: int = 0


def make_micro_batches(samples: list, tables: list, num_experts: int,
                       tcfg: TrainerConfig) -> "list[MicroBatch]":
    """Shuffles the sequences (a trainer sees them in another order than the engine produced them)
    and packs them greedily into micro-batches of at most micro_batch_tokens padded tokens, with
    switchyard.routes.pack_thd's alignment; the packed rollout routes ride along as R3 targets."""
    from switchyard import routes as syr
    g = torch.Generator().manual_seed(tcfg.seed + 17)
    order = torch.randperm(len(samples), generator=g).tolist()
    a = tcfg.pack_align
    groups, cur, cur_tokens = [], [], 0
    for i in order:
        n = -(-len(samples[i].tokens) // a) * a
        if cur and cur_tokens + n > tcfg.micro_batch_tokens:
            groups.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += n
    if cur:
        groups.append(cur)
    mbs = []
    for grp in groups:
        packed, cu, cu_pad = syr.pack_thd([tables[i] for i in grp], tp_size=a,
                                          num_experts=num_experts)
        T = int(cu_pad[-1])
        ids = torch.full((1, T), PAD, dtype=torch.long)
        pos = torch.zeros((1, T), dtype=torch.long)
        for j, i in enumerate(grp):
            toks = samples[i].tokens
            s, e = int(cu_pad[j]), int(cu_pad[j + 1])
            ids[0, s:s + len(toks)] = torch.tensor(toks)
            pos[0, s:e] = torch.arange(e - s)
        mbs.append(MicroBatch([samples[i] for i in grp], ids, pos, list(cu), list(cu_pad),
                              packed))
    return mbs


def _response_logprobs(logits, mb):
    """Per sequence: log-probs (fp32) of its response tokens from the packed logits [T, V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for j, s in enumerate(mb.samples):
        base = mb.cu_seqlens_padded[j]
        pos = torch.arange(base + s.prompt_len - 1, base + len(s.tokens) - 1)
        tok = mb.input_ids[0, pos + 1]
        out.append(logp[pos, tok])
    return out


def _unpack_routes(ids, mb, moe_layers):
    """Captured [1, T_padded, num_hidden_layers, K] ids -> one [n, moe_layers, K] table per
    sequence (the rollout has no route for a sequence's last token: -1 there, as in the file)."""
    t = ids[0][:, moe_layers, :]
    out = []
    for j, s in enumerate(mb.samples):
        base = mb.cu_seqlens_padded[j]
        r = t[base:base + len(s.tokens)].clone()
        r[-1] = -1
        out.append(r)
    return out


def trainer_pass(model: torch.nn.Module, patch, mbs: "list[MicroBatch]", moe_layers: "list[int]",
                 targets: "list[torch.Tensor] | None" = None, progress: bool = True,
                 desc: str = "", grad: bool = False) -> tuple:
    """One pass over the micro-batches: per sequence the response log-probs and the routes the
    router used (captured by the patch). ``targets``: one [T_padded, moe_layers, K] table per
    micro-batch to replay (R2 / R3), or None. Returns (logprobs, routes, seconds, tokens)."""
    from tqdm.auto import tqdm
    logprobs, routes = [], []
    seconds, tokens = 0.0, 0
    bar = tqdm(mbs, desc=desc, disable=not progress, unit="mb", leave=False)
    for k, mb in enumerate(bar):
        if targets is not None:
            patch.set_targets(targets[k])
        t0 = time.perf_counter()
        with torch.set_grad_enabled(grad), patch.capture() as cap:
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
        seconds += time.perf_counter() - t0
        tokens += mb.num_tokens
        logprobs.extend(_response_logprobs(out.logits[0], mb))
        routes.extend(_unpack_routes(cap.ids(), mb, moe_layers))
        if targets is not None:
            patch.set_action(None)
    bar.close()
    return logprobs, routes, seconds, tokens


def record_pass(model: torch.nn.Module, patch, mbs: "list[MicroBatch]",
                progress: bool = True) -> tuple:
    """R2's old-log-prob pass: every MoE layer's RouterReplay records the ids of each micro-batch
    (action "record"); the recorded tables are then taken off the replay queues and kept with the
    micro-batches, as verl keeps them in the batch for the update. Returns (logprobs, routes,
    seconds, tokens, recorded [T_padded, moe_layers, K] per micro-batch)."""
    patch.set_action("record")
    try:
        lp, routes, seconds, tokens = trainer_pass(model, patch, mbs, patch.layers,
                                                   progress=progress,
                                                   desc="trainer r2   (old log-probs, record)")
    finally:
        patch.set_action(None)
    recorded = []
    for _ in mbs:
        recorded.append(torch.stack([patch.replays[layer].pop_recorded()
                                     for layer in patch.layers], dim=1))
    return lp, routes, seconds, tokens, recorded


class MasterAdam:
    """AdamW over fp32 master copies of the bf16 parameters (FSDP mixed precision): gradients come
    from the bf16 model, the step runs on the masters, which are then rounded into the model."""

    def __init__(self, model, lr):
        self.params = [p for p in model.parameters()]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=0.0)

    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
                p.grad = None


def advantages(samples: list) -> "dict[int, float]":
    """GRPO: each reward normalised within its prompt's group."""
    by = {}
    for s in samples:
        by.setdefault(s.group, []).append(s.reward)
    out = {}
    for s in samples:
        r = torch.tensor(by[s.group], dtype=torch.float64)
        std = float(r.std()) if len(r) > 1 else 0.0
        out[s.index] = (s.reward - float(r.mean())) / (std + 1e-6)
    return out


def grpo_step(model: torch.nn.Module, patch, mbs: "list[MicroBatch]", old_logprobs: list,
              targets: "list[torch.Tensor]", lr: float, clip: float = 0.2, progress: bool = True,
              desc: str = "") -> tuple:
    """One GRPO-style update: the clipped policy-gradient loss (token mean over the batch) with
    the given replay targets, backward per micro-batch, one AdamW step on fp32 masters. Returns
    (loss, grad norms: router, all, per MoE layer router)."""
    from tqdm.auto import tqdm
    for p in model.parameters():
        p.requires_grad_(True)
        p.grad = None
    adv = advantages([s for mb in mbs for s in mb.samples])
    total = sum(s.response_len for mb in mbs for s in mb.samples)
    old = {s.index: lp for s, lp in zip([s for mb in mbs for s in mb.samples], old_logprobs)}
    loss_sum = 0.0
    bar = tqdm(mbs, desc=desc, disable=not progress, unit="mb", leave=False)
    for k, mb in enumerate(bar):
        patch.set_targets(targets[k])
        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
        patch.set_action(None)
        lps = _response_logprobs(out.logits[0], mb)
        loss = 0.0
        for s, lp in zip(mb.samples, lps):
            ratio = torch.exp(lp - old[s.index].detach())
            a = adv[s.index]
            surr = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
            loss = loss - surr.sum() / total
        loss.backward()
        loss_sum += float(loss.detach())
    bar.close()
    routers = [model.model.layers[layer].mlp.gate.weight for layer in patch.layers]
    per_layer = {layer: float(w.grad.float().norm()) if w.grad is not None else 0.0
                 for layer, w in zip(patch.layers, routers)}
    router_norm = float(torch.sqrt(sum(torch.tensor(v) ** 2 for v in per_layer.values())))
    all_norm = float(torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters()
                                    if p.grad is not None)))
    MasterAdam(model, lr).step()
    for p in model.parameters():
        p.requires_grad_(False)
    return loss_sum, router_norm, all_norm, per_layer
