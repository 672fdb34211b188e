"""Overhead of switchyard.integrations.trl at 2 ranks: TRL's GRPOTrainer under DDP (gloo, CPU),
the same training steps (HF generate, old log-probs with num_iterations=2, loss and backward with
DDP's gradient all-reduce, optimizer) with trl's own GRPOTrainer ("trl"), switchyard's subclass
with the fp32 router only (replay=None: route capture, the mismatch metric and its reduction over
the ranks still run: "fp32"), and with fp32 router + R3 ("fp32+R3"; each log-prob forward also
checks that the ranks agree). Run round-robin (order rotated each round) in one 2-rank job;
prints the CPU model, the best wall time per step (the ranks step together: rank 0's clock) and
the best CPU time per step of the busier rank, and the ratios (1.00 = no overhead).

    PYTHONPATH=build/python python bench/py_trl_ranks_overhead.py [--quick] [--ranks 2]
        [--hidden 128] [--layers 4] [--experts 16] [--batch 8] [--completion 16] [--steps 4]

Launches itself with ``python -m torch.distributed.run --standalone --nproc_per_node RANKS``
(one thread per rank). A tiny Qwen3-MoE (no download) in fp32 where the routers are a large share
of the work, so the ratio is an upper bound of the overhead on real model sizes.
"""
import os
import subprocess
import sys
import tempfile
import time
import warnings

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python", "tests_trl"))

from bench_machine import (best_of_rotated_rounds, machine_line, print_step_ratios,  # noqa: E402
                           trainer_step_args, trainer_step_parser, trl_trainer_kwargs)


def _parser():
    ap = trainer_step_parser(completion=16)
    ap.add_argument("--ranks", type=int, default=2)
    return ap


def run(variant, a, out):
    """(wall, process CPU) seconds for a.steps training steps of a fresh trainer (construction
    not timed): rank 0's wall clock between barriers, the largest CPU time of any rank."""
    import torch
    import torch.distributed as dist
    import transformers
    import trl
    import switchyard.integrations.trl as sytrl
    torch.manual_seed(0)
    kw = trl_trainer_kwargs(a, out)
    if variant == "trl":
        tr = trl.GRPOTrainer(**kw)
    else:
        tr = sytrl.GRPOTrainer(**kw, router_dtype=torch.float32,
                               replay="R3" if variant == "fp32+R3" else None)
    tr.remove_callback(transformers.PrinterCallback)  # the final summary line of each run
    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    tr.train()
    c = time.process_time() - c
    dist.barrier()
    w = time.perf_counter() - t
    cpu = torch.tensor([c], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    if variant == "fp32+R3":
        assert max(r["used_mismatch_rows"] for r in tr.switchyard_records) == 0
        assert tr.switchyard_records[-1]["world_size"] == a.ranks
    return w, float(cpu)


def worker(a):
    import trl
    rank = int(os.environ["RANK"])
    variants = ["trl", "fp32", "fp32+R3"]
    with tempfile.TemporaryDirectory() as out:
        run("trl", a, out)  # warm-up: imports, allocator, first-call costs, the process group
        if rank == 0:
            print(machine_line())
            print(f"trl {trl.__version__}; {a.ranks} ranks (DDP, gloo, CPU, 1 thread each); "
                  f"Qwen3-MoE hidden {a.hidden}, {a.layers} layers, {a.experts} experts top-2, "
                  f"fp32; batch {a.batch} per rank, completion {a.completion} tokens, {a.steps} "
                  f"steps (num_iterations=2), best of {a.rounds} rounds", flush=True)
        best = best_of_rotated_rounds(variants, a.rounds, lambda v: run(v, a, out))
    if rank == 0:
        print_step_ratios(best, a.steps, "trl")


def main():
    a = trainer_step_args(_parser())
    if "RANK" in os.environ:
        worker(a)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={a.ranks}", os.path.abspath(__file__), *sys.argv[1:]]
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
