"""Overhead of switchyard.integrations.trl on TRL's GRPOTrainer: the same training steps (HF
generate, old log-probs with num_iterations=2, loss and backward, optimizer) with trl's own
GRPOTrainer ("trl"); trl's GRPOTrainer on a model patched with hf.patch (fp32 router, nothing
else: "patch"); switchyard's subclass with the family's own router dtypes and R3
(router_dtype=None: replay alone, "R3"); with the fp32 router only (replay=None: route capture in
generation and the mismatch metric still run: "fp32"); and with fp32 router + R3 ("fp32+R3").
Every variant's trainer is built first, then all train in one process, one step at a time in turn
(threads passing a baton at each step's end, a shuffled order each round: bench_machine.StepBaton),
so a slow period of the shared machine falls on every variant alike. Prints the CPU model, each
variant's median step (thread CPU time, one thread, and wall) and the median over 2-step cycles
(a generation step and its reuse step, num_iterations=2) of its CPU time / trl's in the same cycle
(1.00 = no overhead), with the interquartile range.

    PYTHONPATH=build/python python bench/py_trl_overhead.py [--quick] [--threads N]
        [--hidden 128] [--layers 4] [--experts 16] [--batch 8] [--completion 16] [--steps 40]
        [--variants R3,fp32+R3]

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

from bench_machine import (StepBaton, machine_line, print_paired_ratios,  # noqa: E402
                           trainer_step_args, trainer_step_parser, trl_trainer_kwargs)
import switchyard.integrations.hf as syhf  # noqa: E402
import switchyard.integrations.trl as sytrl  # noqa: E402


VARIANTS = ["trl", "patch", "R3", "fp32", "fp32+R3"]


def trainer(variant, a, out, callbacks=()):
    """A fresh trainer of ``variant`` (seeded; construction is never timed)."""
    torch.manual_seed(0)
    kw = trl_trainer_kwargs(a, out)
    model = kw["model"]
    if variant in ("trl", "patch"):
        if variant == "patch":  # the routers alone: hf.patch, no capture, replay or metrics
            syhf.patch(model, router_dtype=torch.float32)
        return trl.GRPOTrainer(**kw, callbacks=list(callbacks))
    return sytrl.GRPOTrainer(**kw, callbacks=list(callbacks),
                             router_dtype=None if variant == "R3" else torch.float32,
                             replay=None if variant == "fp32" else "R3")


def check(variant, tr):
    if variant in ("R3", "fp32+R3"):  # every replayed row used the rollout's ids
        assert max(r["used_mismatch_rows"] for r in tr.switchyard_records) == 0


def run(variant, a, out):
    """(wall, process CPU) seconds for a.steps training steps of a fresh trainer, alone
    (construction not timed; bench/py_trl_step_profile.py's measure)."""
    tr = trainer(variant, a, out)
    t, c = time.perf_counter(), time.process_time()
    tr.train()
    dt = (time.perf_counter() - t, time.process_time() - c)
    check(variant, tr)
    return dt


def interleaved(variants, a, out):
    """{variant: [(wall, thread CPU) per step]}: the variants' trainers stepping in turn."""
    import gc
    import threading
    baton = StepBaton(variants)
    trainers = {v: trainer(v, a, os.path.join(out, v.replace("+", "_")), [baton.callback(v)])
                for v in variants}
    # Python's cyclic GC runs in whichever step allocates and walks every trainer's objects:
    # those built so far are frozen out of its generations, so a collection costs what the
    # steps themselves allocated.
    gc.collect()
    gc.freeze()
    errors = []

    def body(v):
        try:
            baton.run(v, trainers[v].train)
            check(v, trainers[v])
        except BaseException as e:  # reported by the main thread
            errors.append((v, e))
    threads = [threading.Thread(target=body, args=(v,)) for v in variants]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"variant {errors[0][0]} failed") from errors[0][1]
    return baton.times


def main():
    ap = trainer_step_parser(completion=16, steps=40)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated subset of " + ",".join(VARIANTS) + " (trl is always run)")
    a = trainer_step_args(ap)
    variants = ["trl"] + [v for v in a.variants.split(",") if v and v != "trl"]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    if a.quick:
        a.steps = 8
    torch.set_num_threads(int(a.threads))
    print(machine_line())
    print(f"trl {trl.__version__}; Qwen3-MoE hidden {a.hidden}, {a.layers} layers, {a.experts} "
          f"experts top-2, fp32; batch {a.batch}, completion {a.completion} tokens, {a.steps} "
          f"steps each (num_iterations=2), interleaved, {a.threads} thread(s)")
    with tempfile.TemporaryDirectory() as out:
        times = interleaved(variants, a, out)
    print_paired_ratios(times, "trl", cycle=2, skip=2)


if __name__ == "__main__":
    main()
