"""Where switchyard's time goes in a verl FSDP trainer step: the per-step CPU time of the patched
router's pieces (gate, routing, replay, hooks) and of the verl adapter's per-micro-batch work
(targets, set_targets, metrics), against verl's own engine, on bench/py_verl_overhead.py's step
(same tiny router-heavy Qwen3-MoE, same batches: the old-log-prob pass, then the update with
verl's activation checkpointing). Each piece is wrapped with a thread-CPU-time counter (about
1 us per call, so pieces called thousands of times per step read a little high); nested pieces
are included in their callers.

    VV=$(bash scripts/env.sh verl)
    PYTHONPATH=build/python $VV/bin/python bench/py_verl_step_profile.py [--quick]
        [--variant R3|fp32+R3] [--steps 20] [--rounds N] [--routes random|own]

Prints, per variant, ms per step and calls per step of every piece, best of the rounds (each
round runs both engines' steps in turn).
"""
import importlib
import os
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import py_verl_overhead as b  # noqa: E402  (sets the threads, verl's CPU shims and the model)

import torch  # noqa: E402
import verl_cpu  # noqa: E402

from bench_machine import PieceTimes  # noqa: E402

_times = PieceTimes(time.thread_time)


def _instrument():
    patch = importlib.import_module("switchyard.integrations.hf.patch")
    fams = importlib.import_module("switchyard.integrations.hf.families")
    syverl = importlib.import_module("switchyard.integrations.verl")
    qwen = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    engine = syverl.SwitchyardFSDPEngine.__mro__[1]  # verl's FSDPEngineWithLMHead
    for owner, name, label in [
            (engine, "prepare_model_inputs", "verl: prepare_model_inputs (its own)"),
            (engine, "forward_step", "verl: forward_step (its own, the forward inside)"),
            (qwen.Qwen3MoeTopKRouter, "forward", "router forward (the model's own)"),
            (patch._Layer, "forward", "router forward (patched)"),
            (patch, "_gate", "  gate"),
            (fams.Family, "native_logits", "  gate (the family's own)"),
            (patch._Layer, "_route", "  routing + replay"),
            (patch._Layer, "_take", "    replay rows taken from the queue"),
            (fams.Family, "route", "    family routing"),
            (fams, "_ids", "      ids (replayed merged with the live top-k)"),
            (patch._Layer, "_after_forward", "    record / recompute queue"),
            (fams.Family, "outputs", "    family outputs"),
            (patch._Layer, "_pre_hook", "decoder-layer pre-hook"),
            (patch.Patch, "_step_begins", "model forward begin hook"),
            (patch.Patch, "_step_ends", "model forward end hook"),
            (syverl.SwitchyardFSDPEngine, "prepare_model_inputs",
             "adapter: prepare_model_inputs (whole)"),
            (syverl.SwitchyardFSDPEngine, "_rows", "  adapter: packed rows"),
            (syverl.SwitchyardFSDPEngine, "_targets", "  adapter: targets"),
            (patch.Patch, "targets_from_verl_packed", "    targets_from_verl_packed"),
            (patch.Patch, "set_targets", "  adapter: set_targets"),
            (syverl.SwitchyardFSDPEngine, "_check_ranks", "  adapter: ranks' check"),
            (syverl.SwitchyardFSDPEngine, "forward_step", "adapter: forward_step (whole)"),
            (patch.Patch, "replay_counts", "  adapter: replay counts"),
            (syverl, "replay_metrics", "  adapter: replay metrics")]:
        _times.wrap(owner, name, label)


def main():
    ap = b.trainer_step_parser(micro=4, prompt=8, response=24, steps=20)
    ap.add_argument("--variant", default="R3", choices=["R3", "fp32+R3"])
    ap.add_argument("--routes", choices=["random", "own"], default="random",
                    help="the rollout's routes (bench/py_verl_overhead.py's --routes)")
    a = b.trainer_step_args(ap)
    if a.quick:
        a.steps, a.rounds = 4, 2
    torch.set_num_threads(int(a.threads))
    print(b.machine_line())
    tmp = tempfile.TemporaryDirectory()  # kept until the end: verl holds the model's path
    path = verl_cpu.tiny_qwen3_moe(
        tmp.name, num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        head_dim=a.hidden // 4, num_experts=a.experts, moe_intermediate_size=a.hidden // 2,
        initializer_range=0.02)
    variants = ["verl", a.variant]
    _instrument()  # before the engines: the patch binds the router forward and hooks it installs
    engines = {v: b.make_engine(v, path, a) for v in variants}
    infer, update, routed_rows = b.make_batches(a, path)
    for v in variants:  # warm-up
        b.run(engines[v], v, infer, update, routed_rows)
    for r in range(a.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            def steps(v=v):
                for _ in range(a.steps):
                    b.run(engines[v], v, infer, update, routed_rows)
            _times.round(v, a.steps, steps)
    _times.print(variants, a.steps, f"{a.rounds} rounds of {a.steps} steps")
    tmp.cleanup()


if __name__ == "__main__":
    main()
