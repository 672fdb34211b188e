"""The demo's model and corpus: a small Qwen3-MoE (transformers' own Qwen3MoeForCausalLM, built from
an embedded config, no download) trained briefly on synthetic token grammars so that its routers
are peaked the way trained models' routers are, with the checkpoint cached by config and seed."""
import dataclasses
import hashlib
import json
import math
import os
import time

import torch

PAD, BOS, EOS = 0, 1, 2
#: Token ids below this are special (pad, bos, eos, one tag per grammar).
NUM_SPECIAL = 8
GRAMMARS = ("count", "motif", "markov", "mirror")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the embedded Qwen3-MoE. Layer 0 is dense (``mlp_only_layers=[0]``), layers
    1..num_layers-1 are MoE (``decoder_sparse_step=1``), as in models whose first layers are
    dense."""
    vocab_size: int = 1024
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    num_experts: int = 32
    top_k: int = 4
    moe_intermediate_size: int = 128
    max_positions: int = 256

    def hf_config(self):
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            num_experts=self.num_experts, num_experts_per_tok=self.top_k,
            mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True,
            max_position_embeddings=self.max_positions, tie_word_embeddings=False,
            router_aux_loss_coef=0.01, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)

    @property
    def moe_layers(self):
        return list(range(1, self.num_layers))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 120
    batch_size: int = 16
    seq_len: int = 48
    lr: float = 3e-3
    seed: int = 0


def build_model(cfg: ModelConfig, experts_implementation: str = "grouped_mm",
                attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A freshly initialised Qwen3MoeForCausalLM (fp32) from the embedded config."""
    from transformers import Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM._from_config(cfg.hf_config(),
                                            experts_implementation=experts_implementation,
                                            attn_implementation=attn_implementation)


# ---- corpus --------------------------------------------------------------------------------------
class Corpus:
    """Four structured token grammars, each over its own slice of the vocabulary and opened by its
    own tag token, so the experts can specialise (what makes trained routers peaked):

    count   an arithmetic progression a, a+s, a+2s, ... within the slice (s in 1..3);
    motif   a random motif of 2..4 tokens repeated;
    markov  a sparse Markov chain: every token has two successors (a stochastic continuation);
    mirror  random tokens, then the same tokens in reverse order.

    A sequence is ``BOS tag content... EOS``. ``valid_share`` scores a continuation (the reward of
    the GRPO step): the share of its tokens inside the grammar's slice (EOS counts as valid)."""

    def __init__(self, vocab_size, seed=0):
        g = torch.Generator().manual_seed(seed + 7919)
        span = (vocab_size - NUM_SPECIAL) // len(GRAMMARS)
        if span < 8:
            raise ValueError(f"[demo] vocab_size must be >= {NUM_SPECIAL + 8 * len(GRAMMARS)}, got "
                             f"vocab_size={vocab_size}")
        self.vocab_size = vocab_size
        self.slices = [(NUM_SPECIAL + i * span, NUM_SPECIAL + (i + 1) * span)
                       for i in range(len(GRAMMARS))]
        lo, hi = self.slices[2]
        self.markov_next = torch.randint(lo, hi, (hi - lo, 2), generator=g)

    def tag(self, grammar):
        return 3 + grammar

    def sequence(self, grammar, length, g):
        """``length`` content tokens of one grammar (a list of ints)."""
        lo, hi = self.slices[grammar]
        n = hi - lo
        r = lambda k: int(torch.randint(0, k, (1,), generator=g))  # noqa: E731
        if grammar == 0:
            a, s = r(n), 1 + r(3)
            return [lo + (a + i * s) % n for i in range(length)]
        if grammar == 1:
            motif = [lo + r(n) for _ in range(2 + r(3))]
            return [motif[i % len(motif)] for i in range(length)]
        if grammar == 2:
            t = [lo + r(n)]
            while len(t) < length:
                t.append(int(self.markov_next[t[-1] - lo, r(2)]))
            return t
        half = [lo + r(n) for _ in range((length + 1) // 2)]
        return (half + half[::-1])[:length]

    def batch(self, batch_size, seq_len, g):
        """[batch_size, seq_len] training sequences: BOS tag content... EOS (EOS where it fits)."""
        out = torch.full((batch_size, seq_len), PAD, dtype=torch.long)
        for b in range(batch_size):
            gr = int(torch.randint(0, len(GRAMMARS), (1,), generator=g))
            n = int(torch.randint(seq_len // 2, seq_len - 2, (1,), generator=g))
            toks = [BOS, self.tag(gr)] + self.sequence(gr, n, g) + [EOS]
            out[b, :len(toks)] = torch.tensor(toks)
        return out

    def prompt(self, grammar, length, g):
        return [BOS, self.tag(grammar)] + self.sequence(grammar, length, g)

    def valid_share(self, grammar, tokens):
        lo, hi = self.slices[grammar]
        if not tokens:
            return 0.0
        return sum(1 for t in tokens if lo <= t < hi or t == EOS) / len(tokens)


# ---- training and the cached checkpoint -----------------------------------------------------------
def cache_key(cfg: ModelConfig, tcfg: TrainConfig) -> str:
    blob = json.dumps({"model": dataclasses.asdict(cfg), "train": dataclasses.asdict(tcfg),
                       "corpus": list(GRAMMARS), "v": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def routing_entropy(model: torch.nn.Module, input_ids: torch.Tensor,
                    attention_mask: "torch.Tensor | None" = None) -> "dict[int, float]":
    """Mean entropy (nats) of the router's softmax over the experts, per MoE layer, over the real
    tokens of a batch (the uniform router has log E)."""
    ent = {}
    hooks = []
    mask = None if attention_mask is None else attention_mask.reshape(-1).bool()

    def hook(layer):
        def f(mod, args, out):
            logits = out[0].float()
            p = torch.softmax(logits, dim=-1)
            h = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
            ent[layer] = float(h[mask].mean() if mask is not None else h.mean())
        return f

    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            hooks.append(gate.register_forward_hook(hook(i)))
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for h in hooks:
            h.remove()
    return ent


def train_or_load(cfg: ModelConfig, tcfg: TrainConfig, out_dir: str, progress: bool = True,
                  log=print) -> "tuple[torch.nn.Module, Corpus, dict]":
    """The trained fp32 model: loaded from ``out_dir/model-<key>.pt`` when it exists for this
    config and seed, else trained (AdamW, next-token loss plus transformers' load-balancing loss,
    grouped_mm experts) and saved. Returns (model, info dict)."""
    from tqdm.auto import tqdm
    key = cache_key(cfg, tcfg)
    path = os.path.join(out_dir, f"model-{key}.pt")
    torch.manual_seed(tcfg.seed)
    model = build_model(cfg)
    corpus = Corpus(cfg.vocab_size, tcfg.seed)
    g_eval = torch.Generator().manual_seed(tcfg.seed + 1)
    eval_ids = corpus.batch(32, tcfg.seq_len, g_eval)
    eval_mask = (eval_ids != PAD).long()
    info = {"checkpoint": path, "cache_key": key}
    info["entropy_init"] = routing_entropy(model, eval_ids, eval_mask)
    t0 = time.perf_counter()
    if os.path.exists(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        info.update(cached=True, train_losses=state["losses"], train_seconds=state["seconds"])
        log(f"[demo] model: loaded the cached checkpoint {path}")
    else:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 *
            (1 + math.cos(math.pi * s / max(tcfg.steps, 1))))
        g = torch.Generator().manual_seed(tcfg.seed + 2)
        losses = []
        bar = tqdm(range(tcfg.steps), desc="train  (synthetic corpus)", disable=not progress,
                   unit="step", leave=False)
        for _ in bar:
            ids = corpus.batch(tcfg.batch_size, tcfg.seq_len, g)
            mask = (ids != PAD).long()
            labels = ids.masked_fill(mask == 0, -100)
            out = model(input_ids=ids, attention_mask=mask, labels=labels,
                        output_router_logits=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.close()
        model.eval()
        seconds = time.perf_counter() - t0
        os.makedirs(out_dir, exist_ok=True)
        tmp = path + ".tmp"
        torch.save({"model": model.state_dict(), "losses": losses, "seconds": seconds,
                    "config": dataclasses.asdict(cfg), "train": dataclasses.asdict(tcfg)}, tmp)
        os.replace(tmp, path)
        info.update(cached=False, train_losses=losses, train_seconds=seconds)
        trained = (f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else
                   "no training (random routers)")
        log(f"[demo] model: trained {tcfg.steps} steps in {seconds:.1f} s, {trained}; saved "
            f"{path}")
    model.eval()
    info["entropy"] = routing_entropy(model, eval_ids, eval_mask)
    info["entropy_uniform"] = math.log(cfg.num_experts)
    return model, corpus, info
