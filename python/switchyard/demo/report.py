"""The demo's outputs: the terminal table, report.md, summary.json and the PNG charts."""
import json
import os

MODE_TITLES = {"bf16": "bf16 router (HF default)", "fp32": "fp32 router (switchyard)",
               "r2": "R2 replay (old-log-prob routes)", "r3": "R3 replay (rollout routes)"}


def _pct(x):
    return f"{100 * x:.2f}%"


def table_rows(summary):
    rows = []
    for mode, m in summary["modes"].items():
        rows.append([mode, _pct(m["router_mismatch"]), _pct(m["token_mismatch"]),
                     f"{m['k3_kl']:.2e}", f"{m['max_abs_log_ratio']:.3f}",
                     _pct(m["ratio_outside_clip"]), str(m["replayed_rows"]),
                     str(m["native_rows"]), f"{m['tokens_per_s']:.0f}"])
    return rows


HEADER = ["mode", "router mismatch", "token mismatch", "k3 KL", "max |log ratio|",
          "ratio outside [0.8,1.2]", "replayed rows", "native rows", "tokens/s"]


def terminal_table(summary: dict) -> str:
    rows = table_rows(summary)
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    line = "  ".join(h.rjust(w[i]) if i else h.ljust(w[i]) for i, h in enumerate(HEADER))
    out = [line, "-" * len(line)]
    for r in rows:
        out.append("  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)))
    return "\n".join(out)


def markdown_table(summary: dict) -> str:
    rows = table_rows(summary)
    out = ["| " + " | ".join(h.replace("|", "\\|") for h in HEADER) + " |",
           "|" + "---|" * len(HEADER)]
    for r in rows:
        out.append("| " + " | ".join(r) + " |")
    return "\n".join(out)


def charts(summary: dict, load_counts, out_dir: str) -> "list[str]":
    """mismatch_per_layer.png, kl_per_mode.png, expert_load.png; returns their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = list(summary["modes"])
    layers = summary["model"]["moe_layers"]
    colors = {"bf16": "#d62728", "fp32": "#ff7f0e", "r2": "#9467bd", "r3": "#2ca02c"}
    names = []

    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=110)
    width = 0.8 / len(modes)
    x = np.arange(len(layers))
    for i, mode in enumerate(modes):
        v = [100 * f for f in summary["modes"][mode]["layer_mismatch"]]
        ax.bar(x + (i - (len(modes) - 1) / 2) * width, v, width, label=MODE_TITLES[mode],
               color=colors[mode])
    ax.set_xticks(x, [f"layer {layer}" for layer in layers])
    ax.set_ylabel("router decisions differing\nfrom the rollout (%)")
    ax.set_title("Router mismatch against the rollout, per MoE layer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "mismatch_per_layer.png"))
    plt.close(fig)
    names.append("mismatch_per_layer.png")

    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.5), dpi=110)
    kl = [summary["modes"][m]["k3_kl"] for m in modes]
    clip = [100 * summary["modes"][m]["ratio_outside_clip"] for m in modes]
    axes[0].bar(modes, kl, color=[colors[m] for m in modes])
    if min(kl) > 0:
        axes[0].set_yscale("log")
    axes[0].set_ylabel("mean k3 KL(rollout || trainer)")
    axes[0].set_title("Train/rollout log-prob mismatch")
    axes[1].bar(modes, clip, color=[colors[m] for m in modes])
    axes[1].set_ylabel("tokens with ratio outside [0.8, 1.2] (%)")
    axes[1].set_title("PPO clip range left")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "kl_per_mode.png"))
    plt.close(fig)
    names.append("kl_per_mode.png")

    c = load_counts.double()
    share = (c / c.sum(dim=1, keepdim=True).clamp_min(1)).numpy() * 100
    fig, ax = plt.subplots(figsize=(8.5, 2.8), dpi=110)
    im = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(layers)), [f"layer {layer}" for layer in layers])
    ax.set_xlabel("expert")
    ax.set_title("Expert load in the rollout (share of a layer's assignments, %)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "expert_load.png"))
    plt.close(fig)
    names.append("expert_load.png")
    return names


def write_summary(summary: dict, out_dir: str) -> str:
    path = os.path.join(out_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=False)
    return path


def write_markdown(summary: dict, chart_names: "list[str]", out_dir: str) -> str:
    s = summary
    m = s["model"]
    ent = s["routing_entropy"]
    r = s["rollout"]
    st = s["r3_update"]
    r2 = s["modes"]["r2"]
    lines = [
        "# switchyard demo: rollout vs trainer routing on a Qwen3-MoE",
        "",
        f"Model: transformers' `Qwen3MoeForCausalLM`, hidden {m['hidden_size']}, {m['num_layers']} "
        f"layers (layer 0 dense, MoE layers {m['moe_layers']}), {m['num_experts']} experts, "
        f"top-{m['top_k']}, vocabulary {m['vocab_size']}; {m['num_parameters'] / 1e6:.1f} M "
        f"parameters. Trained {s['train']['steps']} steps on four synthetic token grammars "
        f"({'cached checkpoint' if s['train']['cached'] else 'trained in this run'}).",
        "",
        f"Routing entropy (mean over tokens and MoE layers, nats): {ent['trained_mean']:.3f} "
        f"after training, {ent['init_mean']:.3f} at initialisation, uniform log E = "
        f"{ent['uniform']:.3f}.",
        "",
        f"Rollout: {r['num_sequences']} sequences ({s['config']['rollout']['num_prompts']} prompts "
        f"x {s['config']['rollout']['group_size']}) in engine batches of "
        f"{s['config']['rollout']['batch_size']}, left padded, `generate` with the KV cache, "
        f"sampling at temperature {s['config']['rollout']['temperature']}, bf16 weights, sdpa "
        f"attention, grouped_mm experts, the engine's fused-kernel numerics (RMSNorm and "
        f"SiLU-and-mul in fp32 with one rounding), transformers' bf16 router. Routes captured in vLLM's "
        f"`routed_experts` shape ({r['vllm_array_shape_0']} for the first sequence), imported "
        f"into `{os.path.basename(r['route_file'])}`: {r['route_file_bytes']} bytes "
        f"(int32 arrays: {r['vllm_int32_bytes']} bytes).",
        "",
        f"Trainer: the same bf16 weights, the sequences shuffled and packed (THD, each padded to a "
        f"multiple of {s['config']['trainer']['pack_align']}) into "
        f"{s['trainer']['num_micro_batches']}"
        f" micro-batches of at most {s['config']['trainer']['micro_batch_tokens']} tokens, one "
        f"forward over each packed row (block-diagonal causal attention from the position ids), "
        f"transformers' per-expert (eager) experts, no KV cache.",
        "",
        "## Per mode (against the rollout)",
        "",
        markdown_table(s),
        "",
        "Router mismatch: share of (token, layer, expert) decisions of the rollout that the "
        "trainer's router did not make; token mismatch: share of tokens with any differing layer "
        "(every token with a rollout route, prompt included). k3 KL, |log ratio| and the clip "
        "range are over the response tokens, ratio = pi_trainer / pi_rollout. Replayed / native "
        "rows: router rows (token x MoE layer) replayed or routed live in the measured pass.",
        "",
        f"fp32: the FP32 router is a remedy for both engines, so the fp32 row compares the "
        f"trainer's fp32 router with the engine's own computation (same batches, KV cache and "
        f"decode steps) over the same tokens with the fp32 router (teacher forced). With the fp32 "
        f"router in the trainer only, against the bf16 rollout: router mismatch "
        f"{_pct(s['modes']['fp32']['trainer_only']['router_mismatch'])}, token mismatch "
        f"{_pct(s['modes']['fp32']['trainer_only']['token_mismatch'])}, k3 KL "
        f"{s['modes']['fp32']['trainer_only']['k3_kl']:.2e}: the engine's bf16 rounding of the "
        f"logits is then itself a source of mismatch, so a trainer-side FP32 router alone does "
        f"not bring the trainer closer to a bf16 engine.",
        "",
        f"R2: the old-log-prob pass routes like bf16; after one optimizer step (AdamW, lr "
        f"{s['config']['trainer']['update_lr']}) the update pass without replay would route "
        f"{_pct(r2['step_drift_native'])} of decisions differently from the recorded ones; with "
        f"R2 {_pct(r2['step_drift_replayed'])}. R2 keeps the update consistent with the "
        f"old-log-prob pass; it does not remove the train/rollout mismatch (its numbers above "
        f"are those of the update pass after the step, so they include the step itself).",
        "",
        f"R3 GRPO update step (rollout routes replayed, clipped surrogate, group-normalised "
        f"rewards): loss {st['loss']:.4f}, router gradient norm {st['router_grad_norm']:.3e} "
        f"(all parameters {st['grad_norm']:.3e}): replay keeps gradients flowing to the router "
        f"because only the expert ids are replayed, the weights come from the live logits.",
        "",
        "## Why R3 still has a KL",
        "",
        s["residual_explanation"],
        "",
        f"Of the bf16 router's KL ({s['modes']['bf16']['k3_kl']:.2e}), R3 removes "
        f"{_pct(1 - s['modes']['r3']['k3_kl'] / s['modes']['bf16']['k3_kl'])}: the part that "
        f"flipped experts cause. The fp32 row comes close to R3 ({s['modes']['fp32']['k3_kl']:.2e} "
        f"against {s['modes']['r3']['k3_kl']:.2e}) because an FP32 router in both engines also "
        f"removes the bf16 rounding of the routing weights, which R3 with transformers' bf16 "
        f"routing math keeps; in a model this small, flipped experts are a small share of the KL, "
        f"and the two can swap places with another sample (see notes/demo.md).",
        "",
        "## Expected outcome",
        "",
    ]
    for name, ok in s["checks"].items():
        lines.append(f"- {'PASS' if ok else 'FAIL'}: {name}")
    lines += ["", "## Phases", "", "| phase | seconds |", "|---|---|"]
    for k, v in s["timings"].items():
        lines.append(f"| {k} | {v:.2f} |")
    lines += ["", "## Charts", ""]
    for n in chart_names:
        lines.append(f"![{n}]({n})")
        lines.append("")
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path
