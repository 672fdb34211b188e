"""Where switchyard's time goes in a TRL GRPOTrainer step: the per-step CPU time of the patched
router's pieces (gate, routing, capture, hooks) and of the TRL adapter's per-forward work (targets,
capture, metrics), against the router TRL runs without switchyard, in the same run as
bench/py_trl_overhead.py (same tiny router-heavy Qwen3-MoE, same steps). Each piece is wrapped
with a process-CPU-time counter (about 1 us per call, so pieces called thousands of times per step
read a little high); nested pieces are included in their callers.

    PYTHONPATH=build/python python bench/py_trl_step_profile.py [--quick] [--variant fp32+R3]

Prints, per variant, ms per step and calls per step of every piece, best of the rounds.
"""
import importlib
import os
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import py_trl_overhead as b  # noqa: E402  (sets the threads, imports trl and the model)

import torch  # noqa: E402
import trl  # noqa: E402

from bench_machine import PieceTimes  # noqa: E402

_times = PieceTimes(time.process_time)


def _instrument():
    patch = importlib.import_module("switchyard.integrations.hf.patch")
    fams = importlib.import_module("switchyard.integrations.hf.families")
    cap = importlib.import_module("switchyard.integrations.hf.capture")
    sytrl = importlib.import_module("switchyard.integrations.trl")
    qwen = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    for owner, name, label in [
            (qwen.Qwen3MoeTopKRouter, "forward", "router forward (trl's own)"),
            (patch._Layer, "forward", "router forward (patched)"),
            (patch, "_gate", "  gate"),
            (fams.Family, "native_logits", "  gate (the family's own)"),
            (patch._Layer, "_route", "  routing + replay + capture"),
            (patch._Layer, "_take", "    replay rows taken from the queue"),
            (fams.Family, "route", "    family routing"),
            (fams, "_ids", "      ids (live top-k, replayed merged)"),
            (patch._Layer, "_after_forward", "    capture / record / recompute queue"),
            (cap.Capture, "append", "      capture append"),
            (fams.Family, "outputs", "    family outputs"),
            (patch._Layer, "_pre_hook", "decoder-layer pre-hook"),
            (cap.ExpertsCapture, "_on_experts", "experts capture hook"),
            (patch.Patch, "_step_begins", "model forward begin hook"),
            (patch.Patch, "_step_ends", "model forward end hook"),
            (trl.GRPOTrainer, "_generate_single_turn", "generation (whole)"),
            (sytrl.GRPOTrainer, "_get_per_token_logps_and_entropies",
             "adapter: log-prob forward (whole)"),
            (trl.GRPOTrainer, "_get_per_token_logps_and_entropies", "  trl's log-prob forward"),
            (patch.Patch, "set_targets", "  adapter: set_targets"),
            (patch.Patch, "capture", "adapter: capture start"),
            (sytrl.GRPOTrainer, "_sy_record_generation", "adapter: routes of a generation"),
            (sytrl.GRPOTrainer, "_sy_batch_routes", "adapter: rollout routes -> batch")]:
        _times.wrap(owner, name, label)


def main():
    ap = b.trainer_step_parser(completion=16)
    ap.add_argument("--variant", default="fp32+R3", choices=["patch", "R3", "fp32", "fp32+R3"])
    a = b.trainer_step_args(ap)
    torch.set_num_threads(int(a.threads))
    print(b.machine_line())
    _instrument()
    with tempfile.TemporaryDirectory() as out:
        b.run("trl", a, out)  # warm-up
        for r in range(a.rounds):
            for v in (["trl", a.variant] if r % 2 == 0 else [a.variant, "trl"]):
                _times.round(v, a.steps, lambda: b.run(v, a, out)[1])
    _times.print(("trl", a.variant), a.steps, f"{a.rounds} rounds")


if __name__ == "__main__":
    main()
