"""Overhead of switchyard.integrations.trl on TRL's GRPOTrainer: the same training steps (HF
generate, old log-probs with num_iterations=2, loss and backward, optimizer) with trl's own
GRPOTrainer ("trl"); trl's GRPOTrainer on a model patched with hf.patch (fp32 router, nothing
else: "patch"); switchyard's subclass with the fp32 router only (replay=None: route capture in
generation and the mismatch metric still run: "fp32"); and with fp32 router + R3 ("fp32+R3").
Runs round-robin (order rotated each round) in one process on the CPU; prints the CPU model, the
best process CPU time (the steadier measure on a shared machine: one thread) and wall time per
variant, and the ratios (1.00 = no overhead).

    PYTHONPATH=build/python python bench/py_trl_overhead.py [--quick] [--threads N]
        [--hidden 128] [--layers 4] [--experts 16] [--batch 8] [--completion 16] [--steps 4]

A tiny Qwen3-MoE (no download) in fp32 where the routers are a large share of the work, so the
ratio is an upper bound of the overhead on real model sizes.
"""
import os
import sys
import tempfile
import time
import warnings

_threads = next((a.split("=", 1)[1] if "=" in a else sys.argv[i + 2]
                 for i, a in enumerate(sys.argv[1:]) if a.startswith("--threads")), "1")
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _threads
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python", "tests_trl"))

import torch  # noqa: E402
import trl  # noqa: E402

from bench_machine import (best_of_rotated_rounds, machine_line, print_step_ratios,  # noqa: E402
                           trainer_step_args, trainer_step_parser, trl_trainer_kwargs)
import switchyard.integrations.hf as syhf  # noqa: E402
import switchyard.integrations.trl as sytrl  # noqa: E402


def run(variant, a, out):
    """(wall, process CPU) seconds for a.steps training steps of a fresh trainer (construction
    not timed)."""
    torch.manual_seed(0)
    kw = trl_trainer_kwargs(a, out)
    model = kw["model"]
    if variant in ("trl", "patch"):
        if variant == "patch":  # the routers alone: hf.patch, no capture, replay or metrics
            syhf.patch(model, router_dtype=torch.float32)
        tr = trl.GRPOTrainer(**kw)
    else:
        tr = sytrl.GRPOTrainer(**kw, router_dtype=torch.float32,
                               replay="R3" if variant == "fp32+R3" else None)
    t, c = time.perf_counter(), time.process_time()
    tr.train()
    dt = (time.perf_counter() - t, time.process_time() - c)
    if variant == "fp32+R3":
        assert max(r["used_mismatch_rows"] for r in tr.switchyard_records) == 0
    return dt


def main():
    ap = trainer_step_parser(completion=16)
    a = trainer_step_args(ap)
    torch.set_num_threads(int(a.threads))
    print(machine_line())
    print(f"trl {trl.__version__}; Qwen3-MoE hidden {a.hidden}, {a.layers} layers, {a.experts} "
          f"experts top-2, fp32; batch {a.batch}, completion {a.completion} tokens, {a.steps} "
          f"steps (num_iterations=2), {a.threads} thread(s), best of {a.rounds} rounds")
    variants = ["trl", "patch", "fp32", "fp32+R3"]
    with tempfile.TemporaryDirectory() as out:
        run("trl", a, out)  # warm-up: imports, allocator, first-call costs
        best = best_of_rotated_rounds(variants, a.rounds, lambda v: run(v, a, out))
    print_step_ratios(best, a.steps, "trl")


if __name__ == "__main__":
    main()
