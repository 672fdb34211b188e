"""The main job: a multi-step GRPO run with TRL's ``GRPOTrainer`` on the demo's Qwen3-MoE, rollouts
from an inference engine whose numerics differ from the trainer's and whose policy copy is stale.

Pieces (one room each):

* ``Task``: the verifiable reward. Prompts are ``BOS tag content...`` of one of the corpus's
  grammars (the model was pretrained on them); the reward of a completion is the share of its
  tokens that stay inside the prompt's grammar AND have an even id. The pretrained model stays in
  the grammar but is indifferent to parity, so the reward starts near half the in-grammar share and
  a policy can raise it by reweighting choices it already makes (the Markov chain's two successors,
  the mirror grammar's free first half, where to stop).
* ``Engine``: the rollout server. A bf16 copy of the policy (KV cache, sdpa, grouped-GEMM experts,
  vLLM's fused RMSNorm / SiLU-and-mul numerics from ``engine.py``, transformers' bf16 router or
  switchyard's FP32 router in fp32 mode) that is synced from the trainer only every
  ``sync_every`` generations, so its samples come from a stale policy as in a fully asynchronous
  run. Every generate() is captured by ``switchyard.integrations.hf`` in vLLM's
  ``routed_experts`` shape.
* ``rollout_func``: TRL's hook; returns prompt/completion ids, the engine's log-probs and the
  engine's routes (``ROUTES_FIELD``).
* ``trainer_class(mode)``: the seam where switchyard plugs into TRL. bf16 and fp32 are TRL's own
  trainer (fp32: the model's routers patched to FP32 before TRL sees it); R3 and R2 need
  ``switchyard.integrations.trl``.
* ``Probe``: the measurements that do not belong to any trainer: per generation, the trainer's
  routes in its old-log-prob forward against the rollout's (router mismatch), the trainer's
  old log-probs against the engine's (train/rollout KL, ratios outside the clip range), replayed
  and native rows; per optimizer step, TRL's own metrics (reward, clip ratio, loss)."""
import copy
import os
import dataclasses
import math
import time

import torch

from .model import BOS, EOS, GRAMMARS, NUM_SPECIAL, PAD

#: The router modes, in run order.
MODES = ("bf16", "fp32", "r3", "r2")
#: The rollout_func output field that carries the engine's routes (vLLM's routed_experts, one int32
#: [num_tokens - 1, num_hidden_layers, K] tensor per sequence).
ROUTES_FIELD = "routed_experts"


# ---- the task ------------------------------------------------------------------------------------
class Task:
    """Prompts and the verifiable reward (see the module docstring)."""

    def __init__(self, corpus, min_prompt_len=3, max_prompt_len=10):
        self.corpus = corpus
        self.min_prompt_len, self.max_prompt_len = min_prompt_len, max_prompt_len

    def prompts(self, n, seed):
        """n prompts as (grammar, token ids), grammars in turn, lengths varied (padded batches)."""
        g = torch.Generator().manual_seed(seed + 11)
        out = []
        for i in range(n):
            gr = i % len(GRAMMARS)
            k = int(torch.randint(self.min_prompt_len, self.max_prompt_len + 1, (1,), generator=g))
            out.append((gr, self.corpus.prompt(gr, k, g)))
        return out

    def reward(self, grammar, completion_ids):
        """Share of the completion's tokens (EOS and padding excluded) inside the grammar's slice
        with an even id; 0 for an empty completion."""
        lo, hi = self.corpus.slices[grammar]
        toks = [t for t in completion_ids if t not in (EOS, PAD)]
        if not toks:
            return 0.0
        return sum(1 for t in toks if lo <= t < hi and t % 2 == 0) / len(toks)


def make_tokenizer(vocab_size):
    """A word-level tokenizer over the demo's ids ("t<id>"), for TRL's decoding and padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    names = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>"}
    vocab = {names.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<pad>")


def encode(ids):
    return " ".join(f"t{i}" for i in ids)


def decode(text):
    return [int(w[1:]) for w in text.split()]


# ---- the rollout engine --------------------------------------------------------------------------
class Engine:
    """The inference server's copy of the policy (bf16, see the module docstring). ``sync`` loads
    the trainer's weights (rounded to bf16); ``generate`` samples one completion per prompt."""

    def __init__(self, model, router_dtype, batch_size, max_new_tokens, temperature, seed):
        import switchyard.integrations.hf as syhf
        self.model = copy.deepcopy(model).to(torch.bfloat16).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.model.set_attn_implementation("sdpa")
        self.model.set_experts_implementation("grouped_mm")
        self.patch = syhf.patch(self.model, router_dtype=router_dtype)
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        self.temperature = temperature
        self.gen = torch.Generator().manual_seed(seed + 13)
        self.synced_at = None   # the trainer's global step of the weights held
        self.seconds = 0.0

    def sync(self, trainer_model, step):
        with torch.no_grad():
            for dst, src in zip(self.model.parameters(), trainer_model.parameters()):
                dst.copy_(src.detach())
        self.synced_at = step

    def generate(self, prompts):
        """prompts: token-id lists. Returns (completions, log-probs, routes) per prompt: the sampled
        ids (EOS included when sampled), their fp32 log-probs under the engine's logits at the
        sampling temperature, and vLLM's routed_experts
        [len(prompt + completion) - 1, layers, K]."""
        from .engine import engine_kernels
        t0 = time.perf_counter()
        comps, lps, routes = [], [], []
        for start in range(0, len(prompts), self.batch_size):
            plist = prompts[start:start + self.batch_size]
            S = max(len(t) for t in plist)
            ids = torch.full((len(plist), S), PAD, dtype=torch.long)
            mask = torch.zeros((len(plist), S), dtype=torch.long)
            for b, t in enumerate(plist):  # left padding, as generate() expects
                ids[b, S - len(t):] = torch.tensor(t)
                mask[b, S - len(t):] = 1
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=self.gen)))
            with torch.no_grad(), engine_kernels(self.model), self.patch.capture() as cap:
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                    eos_token_id=EOS, pad_token_id=PAD, output_logits=True,
                    return_dict_in_generate=True, do_sample=True, temperature=self.temperature,
                    top_k=0, top_p=1.0)
            new = out.sequences[:, S:]
            alive = torch.ones_like(new)
            ended = torch.zeros(len(plist), dtype=torch.bool)
            for s in range(new.shape[1]):  # real tokens: up to and including the first EOS
                alive[:, s] = (~ended).long()
                ended |= new[:, s] == EOS
            arrays = cap.routed_experts(torch.cat([mask, alive], dim=1))
            logp = torch.log_softmax(torch.stack(out.logits, dim=1).float() / self.temperature,
                                     dim=-1)
            for b in range(len(plist)):
                n = int(alive[b].sum())
                resp = new[b, :n]
                comps.append(resp.tolist())
                lps.append(logp[b, :n].gather(1, resp[:, None])[:, 0].tolist())
                routes.append(arrays[b])
        self.seconds += time.perf_counter() - t0
        return comps, lps, routes


def make_rollout_func(engine, sync_every, log_staleness):
    """TRL's rollout_func: syncs the engine every ``sync_every``-th call (the first call included),
    generates one completion per prompt and returns the engine's log-probs and routes."""
    state = {"calls": 0}

    def rollout_func(prompts, trainer):
        step = trainer.state.global_step
        if state["calls"] % sync_every == 0:
            engine.sync(trainer.model, step)
        state["calls"] += 1
        log_staleness(step - engine.synced_at)
        ids = [decode(p) for p in prompts]
        comps, lps, routes = engine.generate(ids)
        engine.last = {"prompt_ids": ids, "completion_ids": comps, "routes": routes}
        return {"prompt_ids": ids, "completion_ids": comps, "logprobs": lps,
                ROUTES_FIELD: routes}

    return rollout_func


# ---- the trainer seam ----------------------------------------------------------------------------
def trainer_class(mode):
    """TRL's GRPOTrainer for bf16 / fp32; switchyard's for R3 / R2 (route capture and replay live
    in switchyard.integrations.trl, never here)."""
    from trl import GRPOTrainer
    if mode in ("bf16", "fp32"):
        return GRPOTrainer, {}
    try:
        from switchyard.integrations import trl as sytrl
    except ImportError as e:
        raise RuntimeError(f"[demo] mode {mode!r} needs switchyard.integrations.trl, which this "
                           f"build lacks ({e})") from None
    return sytrl.GRPOTrainer, {"replay": mode}


def _k3(lr):
    return float((torch.exp(lr) - 1 - lr).mean()) if lr.numel() else 0.0


class Probe:
    """Measures one generation (see the module docstring); ``rows`` holds one dict per
    generation, ``steps`` TRL's logs per optimizer step."""

    def __init__(self, model_config, moe_layers, clip):
        self.num_experts = model_config.num_experts
        self.moe_layers = list(moe_layers)
        self.num_hidden_layers = model_config.num_layers
        self.clip = clip
        self.rows, self.steps = [], []
        self.staleness = None

    def measure(self, out, rollout, trainer_ids, counts, step):
        """out: TRL's generation batch (rows in rollout order); rollout: the engine's last call;
        trainer_ids: [B, P+C, layers, K] routes of the trainer's old-log-prob forward; counts:
        the patch's per-layer counts of that forward."""
        from switchyard import routes as syr
        pm, cm = out["prompt_mask"], out["completion_mask"]
        P = pm.shape[1]
        ref, got, lr = [], [], []
        old, samp = out.get("old_per_token_logps"), out.get("sampling_per_token_logps")
        for b, (p, c, r) in enumerate(zip(rollout["prompt_ids"], rollout["completion_ids"],
                                          rollout["routes"])):
            n = len(p) + len(c)
            cols = torch.arange(P - len(p), P + len(c))[: n - 1]
            ref.append(self._table(r))
            got.append(self._table(trainer_ids[b, cols]))
            if old is not None and samp is not None:
                k = int(cm[b].sum())
                lr.append((old[b, :k] - samp[b, :k]).double())
        d = syr.drift(ref, got, self.num_experts)
        lr = torch.cat(lr) if lr else torch.zeros(0, dtype=torch.float64)
        ratio = torch.exp(lr)
        row = {
            "step": step,
            "router_mismatch": float(d["decision_mismatch"]),
            "token_mismatch": float(d["token_mismatch"]),
            "compared_decisions": int(d["num_decisions"]),
            "train_rollout_k3_kl": _k3(lr),
            "train_rollout_max_abs_log_ratio": float(lr.abs().max()) if lr.numel() else 0.0,
            "rollout_ratio_outside_clip": float(((ratio < 1 - self.clip) |
                                                 (ratio > 1 + self.clip)).double().mean())
            if lr.numel() else 0.0,
            "replayed_rows": int(sum(c["num_replayed_rows"] for c in counts.values())),
            "native_rows": int(sum(c["num_native_rows"] for c in counts.values())),
            "staleness": self.staleness,
        }
        self.rows.append(row)
        return row

    def _table(self, vllm_rows):
        """vLLM rows [n - 1, hidden layers, K] -> a route table [n, moe_layers, K] (last row -1)."""
        t = vllm_rows[:, self.moe_layers, :].to(torch.int32)
        return torch.cat([t, torch.full((1, *t.shape[1:]), -1, dtype=torch.int32)])


def instrumented(base, probe, engine):
    """``base`` (a GRPOTrainer class) with the probe around each generation's scoring: the
    trainer's routes are captured during TRL's old-log-prob forward (the only forward of the
    policy inside ``_generate_and_score_completions``: generation runs in the engine)."""
    import switchyard.integrations.hf as syhf

    class Instrumented(base):
        def _generate_and_score_completions(self, inputs):
            p = syhf.patch_of(self.model)
            p.reset_counts()
            with p.capture() as cap:
                out = super()._generate_and_score_completions(inputs)
            if cap.num_forwards != 1:
                raise RuntimeError(f"[demo] expected one old-log-prob forward of the policy per "
                                   f"generation, captured {cap.num_forwards}")
            row = probe.measure(out, engine.last, cap.ids(), p.counts(), self.state.global_step)
            for k in ("router_mismatch", "train_rollout_k3_kl", "rollout_ratio_outside_clip",
                      "replayed_rows", "native_rows"):
                self._metrics["train"][f"switchyard/{k}"].append(float(row[k]))
            return out

    return Instrumented


# ---- one mode ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RLConfig:
    steps: int = 40               # optimizer steps per mode
    prompts_per_step: int = 8     # prompts per generation (one GRPO group each)
    num_generations: int = 4      # completions per prompt
    num_iterations: int = 2       # TRL updates per generation (R2 needs > 1; every mode the same)
    sync_every: int = 2           # engine syncs every this many generations
    max_new_tokens: int = 16
    temperature: float = 1.0
    lr: float = 2e-4
    clip: float = 0.2
    engine_batch: int = 32
    seed: int = 0


def run_mode(mode, model_fp32, corpus, mcfg, cfg: RLConfig, out_dir, progress=True,
             disable_replay=False):
    """Trains a fresh copy of the pretrained model for cfg.steps optimizer steps in ``mode``.
    ``disable_replay`` (tests only): R3 / R2 on TRL's plain trainer, whose routes are not replayed.
    Returns (per-generation probe rows, per-step TRL logs, seconds, engine seconds)."""
    import switchyard.integrations.hf as syhf
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    t0, c0 = time.perf_counter(), time.process_time()
    torch.manual_seed(cfg.seed)
    model = copy.deepcopy(model_fp32).float().train()
    for p in model.parameters():
        p.requires_grad_(True)
    model.set_attn_implementation("sdpa")
    model.set_experts_implementation(os.environ.get("SY_DEMO_TRAIN_EXPERTS", "grouped_mm"))
    router_dtype = torch.float32 if mode == "fp32" else None
    # The trainer's routers: FP32 in fp32 mode, else transformers' own math (patched for capture).
    syhf.patch(model, router_dtype=router_dtype)
    engine = Engine(model_fp32, router_dtype, cfg.engine_batch, cfg.max_new_tokens,
                    cfg.temperature, cfg.seed)
    probe = Probe(mcfg, mcfg.moe_layers, cfg.clip)
    task = Task(corpus)
    gens = math.ceil(cfg.steps / cfg.num_iterations)
    prompts = task.prompts(gens * cfg.prompts_per_step, cfg.seed)
    ds = Dataset.from_dict({"prompt": [encode(t) for _, t in prompts],
                            "grammar": [gr for gr, _ in prompts]})

    def reward_fn(prompts, completions, completion_ids, grammar, **kw):
        return [task.reward(gr, ids) for gr, ids in zip(grammar, completion_ids)]
    reward_fn.__name__ = "in_grammar_even"

    def set_staleness(s):
        probe.staleness = s

    base, extra = trainer_class("bf16" if disable_replay else mode)
    batch = cfg.prompts_per_step * cfg.num_generations
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, "trl"), use_cpu=True, bf16=True, report_to=[],
        max_steps=cfg.steps, learning_rate=cfg.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=cfg.num_generations,
        num_iterations=cfg.num_iterations, max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature, epsilon=cfg.clip, beta=0.0, loss_type="dapo",
        logging_steps=1, save_strategy="no", seed=cfg.seed, data_seed=cfg.seed,
        shuffle_dataset=False, disable_tqdm=not progress, dataloader_num_workers=0)
    steps_log = []

    class Keep(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs is not None and "loss" in logs:
                steps_log.append(dict(logs, step=state.global_step))

    cls = instrumented(base, probe, engine)
    trainer = cls(model=model, reward_funcs=[reward_fn], args=args, train_dataset=ds,
                  processing_class=make_tokenizer(mcfg.vocab_size),
                  rollout_func=make_rollout_func(engine, cfg.sync_every, set_staleness),
                  callbacks=[Keep()], **extra)
    # TRL prints every step's log dict; the demo prints its own lines (and keeps the bar).
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class Bar(ProgressCallback):
        def on_log(self, *a, **kw):
            pass

    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(Bar())
    trainer.train()
    return (probe.rows, steps_log, time.perf_counter() - t0, engine.seconds,
            time.process_time() - c0)
