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
* ``trainer_class(mode)``: the seam where switchyard plugs into TRL:
  ``switchyard.integrations.trl.GRPOTrainer`` with the mode's router dtype and replay (bf16 and
  fp32 without replay, R3, R2). Route capture, carrying and replay live there, not here.
* ``Probe``: per generation, the integration's record of TRL's old-log-prob forward (router
  mismatch against the rollout, replayed and native rows) and the trainer's old log-probs against
  the engine's (train/rollout KL, ratios outside the clip range); per optimizer step, the record
  of the loss forward and TRL's own metrics (reward, clip ratio, loss)."""
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
        return {"prompt_ids": ids, "completion_ids": comps, "logprobs": lps,
                ROUTES_FIELD: routes}

    return rollout_func


# ---- the trainer seam ----------------------------------------------------------------------------
#: Per mode: switchyard.integrations.trl.GRPOTrainer's router_dtype and replay. bf16 is TRL's own
#: routing (router_dtype=None is bitwise transformers' router), measured but not replayed.
MODE_ARGS = {"bf16": dict(router_dtype=None, replay=None),
             "fp32": dict(router_dtype=torch.float32, replay=None),
             "r3": dict(router_dtype=None, replay="R3"),
             "r2": dict(router_dtype=None, replay="R2")}


def trainer_class(mode, disable_replay=False):
    """switchyard's GRPOTrainer (TRL's, with route capture, carrying and replay: all of it lives in
    switchyard.integrations.trl, never here) and its switchyard arguments for ``mode``.
    ``disable_replay`` (tests only): the mode's router, no replay."""
    from switchyard.integrations import trl as sytrl
    kw = dict(MODE_ARGS[mode], routes_field=ROUTES_FIELD)
    if disable_replay:
        kw["replay"] = None
    return sytrl.GRPOTrainer, kw


def _k3(lr):
    return float((torch.exp(lr) - 1 - lr).mean()) if lr.numel() else 0.0


def _share(rec):
    # The ids the trainer's routers used (replayed ones included) against the rollout's: what the
    # demo compares across modes (the integration's router_mismatch metric is each router's own
    # choice, which R3 then overrides).
    return rec["used_mismatch_rows"] / rec["compared_rows"] if rec["compared_rows"] else 0.0


class Probe:
    """Per generation: the integration's record of TRL's old-log-prob forward (router mismatch
    against the rollout, replayed and native rows) and the trainer's old log-probs against the
    engine's (train/rollout KL, ratios outside the clip range). ``rows`` holds one dict per
    generation."""

    def __init__(self, clip):
        self.clip = clip
        self.rows = []
        self.staleness = None

    def measure(self, out, record, step):
        old, samp = out.get("old_per_token_logps"), out.get("sampling_per_token_logps")
        if old is None or samp is None:
            raise RuntimeError("[demo] TRL returned no old-log-prob pass or no rollout log-probs "
                               "(num_iterations must be > 1)")
        m = out["completion_mask"].bool()
        lr = (old - samp)[m].double()
        ratio = torch.exp(lr)
        row = {
            "step": step,
            "router_mismatch": _share(record),
            # The trainer's own router against the rollout's (before replay overrides it): what
            # R3 corrects; equal to router_mismatch in the modes without replay.
            "router_mismatch_native": (record["mismatch_rows"] / record["compared_rows"]
                                       if record["compared_rows"] else 0.0),
            "mismatch_rows": int(record["used_mismatch_rows"]),
            "compared_rows": int(record["compared_rows"]),
            "train_rollout_k3_kl": _k3(lr),
            "train_rollout_max_abs_log_ratio": float(lr.abs().max()) if lr.numel() else 0.0,
            "rollout_ratio_outside_clip": float(((ratio < 1 - self.clip) |
                                                 (ratio > 1 + self.clip)).double().mean())
            if lr.numel() else 0.0,
            "replayed_rows": int(record["replayed_rows"]),
            "native_rows": int(record["native_rows"]),
            "staleness": self.staleness,
        }
        self.rows.append(row)
        return row


def instrumented(base, probe):
    """``base`` with the probe after each generation's scoring (TRL's old-log-prob pass, whose
    record the integration has just added)."""

    class Instrumented(base):
        def _generate_and_score_completions(self, inputs):
            n = len(self.switchyard_records)
            out = super()._generate_and_score_completions(inputs)
            old = [r for r in self.switchyard_records[n:] if r["kind"] == "old"]
            if len(old) != 1:
                raise RuntimeError(f"[demo] expected one old-log-prob forward per generation, "
                                   f"the integration recorded {len(old)}")
            row = probe.measure(out, old[0], self.state.global_step)
            for k in ("train_rollout_k3_kl", "rollout_ratio_outside_clip"):
                self._metrics["train"][f"demo/{k}"].append(float(row[k]))
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
             disable_replay=False, vllm=None):
    """Trains a fresh copy of the pretrained model for cfg.steps optimizer steps in ``mode``.
    ``disable_replay`` (tests only): R3 / R2 on TRL's plain trainer, whose routes are not replayed.
    ``vllm``: a ``vllm_engine.VLLMServer`` generating the rollouts instead of ``Engine`` (its
    router is vLLM's own in every mode: the fp32 mode's FP32 router is then the trainer's only).
    Returns (per-generation probe rows, per-step records of the policy (loss) forward, per-step
    TRL logs, seconds, engine seconds, CPU seconds)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    t0, c0 = time.perf_counter(), time.process_time()
    torch.manual_seed(cfg.seed)
    model = copy.deepcopy(model_fp32).float().train()
    for p in model.parameters():
        p.requires_grad_(True)
    model.set_attn_implementation("sdpa")
    # grouped_mm: faster on the CPU than transformers' eager per-expert loop (notes/demo.md).
    model.set_experts_implementation("grouped_mm")
    router_dtype = MODE_ARGS[mode]["router_dtype"]  # the engine's router is the trainer's
    if vllm is not None:
        engine = vllm.session(cfg.max_new_tokens, cfg.temperature, cfg.seed)
    else:
        engine = Engine(model_fp32, router_dtype, cfg.engine_batch, cfg.max_new_tokens,
                        cfg.temperature, cfg.seed)
    probe = Probe(cfg.clip)
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

    base, extra = trainer_class(mode, disable_replay)
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

    cls = instrumented(base, probe)
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
    policy = [dict(step=r["global_step"] + 1, router_mismatch=_share(r),
                   router_mismatch_native=(r["mismatch_rows"] / r["compared_rows"]
                                           if r["compared_rows"] else 0.0),
                   mismatch_rows=r["used_mismatch_rows"], compared_rows=r["compared_rows"],
                   replayed_rows=r["replayed_rows"], native_rows=r["native_rows"])
              for r in trainer.switchyard_records if r["kind"] == "policy"]
    trainer.switchyard_unpatch()
    return (probe.rows, policy, steps_log, time.perf_counter() - t0, engine.seconds,
            time.process_time() - c0)
