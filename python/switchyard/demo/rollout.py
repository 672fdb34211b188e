"""The rollout, as an inference server runs it: bf16 weights, transformers' default bf16 router,
batched ``generate`` with the KV cache and sampling, routes captured by switchyard.integrations.hf
in vLLM's ``routed_experts`` shape and imported through switchyard.routes into a route file."""
import dataclasses
import time

import torch

from .model import EOS, PAD


@dataclasses.dataclass
class Sample:
    """One rollout sequence: ``tokens`` = prompt + response (EOS included when sampled),
    ``rollout_logprobs`` of the response tokens (fp32, from the engine's logits), the rollout's
    route table ``[len(tokens), moe_layers, K]`` (last row -1) and the GRPO group and reward."""
    index: int
    group: int
    grammar: int
    prompt_len: int
    tokens: list
    rollout_logprobs: torch.Tensor
    reward: float = 0.0

    @property
    def response_len(self):
        return len(self.tokens) - self.prompt_len


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    num_prompts: int = 16
    group_size: int = 4
    batch_size: int = 16          # sequences per generate() call (the engine's batch)
    max_new_tokens: int = 32
    min_prompt_len: int = 3
    max_prompt_len: int = 10
    temperature: float = 1.0
    seed: int = 0


def make_prompts(corpus, rcfg):
    """num_prompts prompts (grammar, tokens), lengths varied so the engine's batches are padded."""
    g = torch.Generator().manual_seed(rcfg.seed + 11)
    prompts = []
    for i in range(rcfg.num_prompts):
        gr = i % 4
        n = int(torch.randint(rcfg.min_prompt_len, rcfg.max_prompt_len + 1, (1,), generator=g))
        prompts.append((gr, corpus.prompt(gr, n, g)))
    return prompts


def run_rollout(model, corpus, rcfg, moe_layers, route_path, progress=True):
    """Generates group_size samples per prompt in engine batches of batch_size sequences
    (left padded), captures the routes of each generate() (prefill + every decode step) with
    switchyard.integrations.hf and writes them, through switchyard.routes.import_vllm_arrays, to
    ``route_path``. ``model`` is the bf16 model, run with sdpa attention and grouped_mm experts.
    Returns (samples, info)."""
    from tqdm.auto import tqdm

    import switchyard.integrations.hf as syhf
    from switchyard import routes as syr

    model.set_attn_implementation("sdpa")
    model.set_experts_implementation("grouped_mm")
    prompts = make_prompts(corpus, rcfg)
    todo = [(p, j) for p in range(len(prompts)) for j in range(rcfg.group_size)]
    samples, vllm_arrays = [], []
    patch = syhf.patch(model, router_dtype=None)  # capture only: bitwise the unpatched router
    g = torch.Generator().manual_seed(rcfg.seed + 13)
    t0 = time.perf_counter()
    fed = 0
    bar = tqdm(total=len(todo), desc="rollout (generate, KV cache)", disable=not progress,
               unit="seq", leave=False)
    try:
        for start in range(0, len(todo), rcfg.batch_size):
            chunk = todo[start:start + rcfg.batch_size]
            plist = [prompts[p][1] for p, _ in chunk]
            S = max(len(t) for t in plist)
            ids = torch.full((len(chunk), S), PAD, dtype=torch.long)
            mask = torch.zeros((len(chunk), S), dtype=torch.long)
            for b, t in enumerate(plist):  # left padding, as generate() expects
                ids[b, S - len(t):] = torch.tensor(t)
                mask[b, S - len(t):] = 1
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
            with torch.no_grad(), patch.capture() as cap:
                out = model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=True,
                    temperature=rcfg.temperature, top_k=0, top_p=1.0,
                    max_new_tokens=rcfg.max_new_tokens, eos_token_id=EOS, pad_token_id=PAD,
                    output_logits=True, return_dict_in_generate=True)
            seqs = out.sequences
            new = seqs[:, S:]
            # Real tokens of the response: up to and including the first EOS.
            alive = torch.ones_like(new, dtype=torch.long)
            ended = torch.zeros(len(chunk), dtype=torch.bool)
            for s in range(new.shape[1]):
                alive[:, s] = (~ended).long()
                ended |= new[:, s] == EOS
            full_mask = torch.cat([mask, alive], dim=1)
            fed += int(full_mask.sum()) - len(chunk)
            arrays = cap.routed_experts(full_mask)
            logits = torch.stack(out.logits, dim=1).float()  # [B, new, V]
            logp_all = torch.log_softmax(logits / rcfg.temperature, dim=-1)
            for b, (p, j) in enumerate(chunk):
                n_new = int(alive[b].sum())
                resp = new[b, :n_new]
                lp = logp_all[b, :n_new].gather(1, resp[:, None])[:, 0]
                gr, ptoks = prompts[p]
                s = Sample(index=len(samples), group=p, grammar=gr, prompt_len=len(ptoks),
                           tokens=list(ptoks) + resp.tolist(), rollout_logprobs=lp.clone())
                s.reward = corpus.valid_share(gr, resp.tolist())
                if arrays[b].shape[0] != len(s.tokens) - 1:
                    raise RuntimeError(f"[demo] rollout sequence {s.index}: captured "
                                       f"{arrays[b].shape[0]} routes for {len(s.tokens)} tokens")
                samples.append(s)
                vllm_arrays.append(arrays[b])
            bar.update(len(chunk))
    finally:
        bar.close()
        patch.unpatch()
    seconds = time.perf_counter() - t0
    cfg = model.config
    tables, report = syr.import_vllm_arrays(
        vllm_arrays, cfg.num_experts, moe_layer_freq=[0 if i not in moe_layers else 1
                                                      for i in range(cfg.num_hidden_layers)],
        num_input_layers=cfg.num_hidden_layers, top_k=cfg.num_experts_per_tok)
    nbytes = syr.write(route_path, tables, cfg.num_experts, moe_layers=list(moe_layers))
    info = {"seconds": seconds, "num_sequences": len(samples), "fed_tokens": fed,
            "tokens_per_s": fed / seconds, "route_file": str(route_path),
            "route_file_bytes": int(nbytes), "vllm_array_shape_0": list(vllm_arrays[0].shape),
            "vllm_int32_bytes": int(sum(a.numel() * 4 for a in vllm_arrays)),
            "response_tokens": int(sum(s.response_len for s in samples)),
            "mean_reward": float(sum(s.reward for s in samples) / len(samples))}
    return samples, info
