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


def make_prompts(corpus, rcfg: RolloutConfig) -> "list[tuple[int, list[int]]]":
    """num_prompts prompts (grammar, tokens), lengths varied so the engine's batches are padded."""
    g = torch.Generator().manual_seed(rcfg.seed + 11)
    prompts = []
    for i in range(rcfg.num_prompts):
        gr = i % 4
        n = int(torch.randint(rcfg.min_prompt_len, rcfg.max_prompt_len + 1, (1,), generator=g))
        prompts.append((gr, corpus.prompt(gr, n, g)))
    return prompts


class _ForceTokens:
    """A logits processor that makes generate() emit given tokens (teacher forcing): the engine's
    own computation (same batches, padding, KV cache, decode steps) over tokens already sampled."""

    def __init__(self, prompt_width, forced):
        self.S = prompt_width
        self.forced = forced  # [B, max_new] long

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.S
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(scores.shape[0]), self.forced[:, step]] = 0.0
        return out


def engine_pass(model: torch.nn.Module, corpus, rcfg: RolloutConfig,
                router_dtype: "torch.dtype | None" = None, forced: "list[Sample] | None" = None,
                progress: bool = True, desc: str = "") -> "tuple[list[Sample], list, dict]":
    """The inference engine: group_size samples per prompt in engine batches of batch_size
    sequences (left padded), generate() with the KV cache, the routes of every generate() (prefill
    and each decode step) captured by switchyard.integrations.hf in vLLM's routed_experts shape.
    ``model`` is the bf16 model, run with sdpa attention and grouped_mm experts.
    ``router_dtype``: None = transformers' bf16 router; torch.float32 = switchyard's FP32 router.
    ``forced``: samples of an earlier pass whose responses are replayed token for token
    (teacher forcing, greedy over a forced distribution) instead of sampled: the same engine run
    with another router, scored on the same tokens. Returns (samples, vllm arrays, info)."""
    from tqdm.auto import tqdm

    import switchyard.integrations.hf as syhf

    from .engine import engine_kernels

    model.set_attn_implementation("sdpa")
    model.set_experts_implementation("grouped_mm")
    prompts = make_prompts(corpus, rcfg)
    todo = [(p, j) for p in range(len(prompts)) for j in range(rcfg.group_size)]
    samples, vllm_arrays = [], []
    patch = syhf.patch(model, router_dtype=router_dtype)
    g = torch.Generator().manual_seed(rcfg.seed + 13)
    t0 = time.perf_counter()
    fed = 0
    bar = tqdm(total=len(todo), desc=desc, disable=not progress, unit="seq", leave=False)
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
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
            kw = dict(do_sample=True, temperature=rcfg.temperature, top_k=0, top_p=1.0)
            if forced is not None:
                fz = torch.full((len(chunk), rcfg.max_new_tokens), EOS, dtype=torch.long)
                for b in range(len(chunk)):
                    f = forced[start + b]
                    resp = f.tokens[f.prompt_len:]
                    fz[b, :len(resp)] = torch.tensor(resp)
                steps = max(len(forced[start + b].tokens) - forced[start + b].prompt_len
                            for b in range(len(chunk)))
                kw = dict(do_sample=False, logits_processor=[_ForceTokens(S, fz)],
                          temperature=None, top_k=None, top_p=None)
            torch.manual_seed(seed)
            with torch.no_grad(), engine_kernels(model), patch.capture() as cap:
                out = model.generate(
                    input_ids=ids, attention_mask=mask,
                    max_new_tokens=rcfg.max_new_tokens if forced is None else steps,
                    eos_token_id=EOS, pad_token_id=PAD, output_logits=True,
                    return_dict_in_generate=True, **kw)
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
                if forced is not None and s.tokens != forced[s.index].tokens:
                    raise RuntimeError(f"[demo] teacher-forced sequence {s.index} came out "
                                       "different from the one it replays")
                samples.append(s)
                vllm_arrays.append(arrays[b])
            bar.update(len(chunk))
    finally:
        bar.close()
        patch.unpatch()
    seconds = time.perf_counter() - t0
    info = {"seconds": seconds, "num_sequences": len(samples), "fed_tokens": fed,
            "tokens_per_s": fed / seconds,
            "response_tokens": int(sum(s.response_len for s in samples)),
            "mean_reward": float(sum(s.reward for s in samples) / len(samples)),
            "vllm_array_shape_0": list(vllm_arrays[0].shape),
            "vllm_int32_bytes": int(sum(a.numel() * 4 for a in vllm_arrays))}
    return samples, vllm_arrays, info


def import_routes(model: torch.nn.Module, vllm_arrays: list,
                  moe_layers: "list[int]") -> "list[torch.Tensor]":
    """vLLM routed_experts arrays -> switchyard route tables (switchyard.routes.import_vllm_arrays
    with the model's layer map: dense layer 0 dropped, a -1 row for each last token)."""
    from switchyard import routes as syr
    cfg = model.config
    freq = [1 if i in moe_layers else 0 for i in range(cfg.num_hidden_layers)]
    tables, _ = syr.import_vllm_arrays(vllm_arrays, cfg.num_experts, moe_layer_freq=freq,
                                       num_input_layers=cfg.num_hidden_layers,
                                       top_k=cfg.num_experts_per_tok)
    return tables


def run_rollout(model: torch.nn.Module, corpus, rcfg: RolloutConfig, moe_layers: "list[int]",
                route_path: str, progress: bool = True) -> "tuple[list[Sample], dict]":
    """The rollout with transformers' bf16 router; its routes imported and written to
    ``route_path`` (switchyard.routes.write). Returns (samples, info)."""
    from switchyard import routes as syr
    samples, arrays, info = engine_pass(model, corpus, rcfg, None, progress=progress,
                                        desc="rollout (generate, KV cache)")
    tables = import_routes(model, arrays, moe_layers)
    nbytes = syr.write(route_path, tables, model.config.num_experts, moe_layers=list(moe_layers))
    info.update(route_file=str(route_path), route_file_bytes=int(nbytes))
    return samples, info
