"""Overhead of switchyard.integrations.verl at 2 ranks: the trainer step of bench/py_verl_overhead.py
(old-log-prob pass + update on the same micro-batches carrying routed_experts) on verl's FSDP
engine over 2 gloo processes on the CPU, data parallel 2 ("dp2") and Ulysses sequence parallel 2
("sp2"), with verl's own FSDPEngineWithLMHead ("verl", native routing) and switchyard's
SwitchyardFSDPEngine with R3 ("R3": replay, the per-micro-batch rank checks and the metrics
reduced over the ranks). Prints the CPU model, rank 0's best process CPU and wall time per step,
and the ratios R3 / verl per layout (1.00 = no overhead).

    VV=$(bash scripts/env.sh verl)
    PYTHONPATH=build/python $VV/bin/python bench/py_verl_ranks_overhead.py [--quick]
        [--hidden 128] [--layers 4] [--experts 16] [--batch 8] [--steps 4] [--rounds 4]

Started plainly, it starts itself twice (ranks 0 and 1, torchrun's environment variables, one
thread each); both ranks run every variant in the same rotated order (the steps are collective).
Both ranks get the same sequences (bench/py_verl_overhead.py's make_batches): under SP that is
what verl does; under DP it only keeps the ranks' work equal. On a 2-core machine the 2 ranks
share the cores with nothing else to do; a loaded machine inflates both columns alike (best of the
rounds is kept).
"""
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def launch():
    """Starts 2 ranks of this script and returns rank 0's exit code (rank 0 prints)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                                      env=env, stdout=None if rank == 0 else subprocess.DEVNULL,
                                      stderr=None if rank == 0 else subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    return max(codes)


if "RANK" not in os.environ:
    if __name__ == "__main__":
        sys.exit(launch())

sys.path.insert(0, HERE)
import py_verl_overhead as pvo  # noqa: E402  (sets up verl on the CPU: verl_cpu.setup)

import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import verl  # noqa: E402

from bench_machine import (best_of_rotated_rounds, machine_line, print_step_ratios,  # noqa: E402
                           trainer_step_args, trainer_step_parser)

LAYOUTS = {"dp2": 1, "sp2": 2}  # name: ulysses_sequence_parallel_size
VENDORS = {"verl": None, "R3": "switchyard"}


def make_engine(vendor, sp, model_path, a):
    with pvo.verl_cpu.env(VERL_ENGINE_VENDOR=vendor, SWITCHYARD_VERL_ROUTER_REPLAY="R3"):
        torch.manual_seed(0)
        eng = pvo.verl_cpu.engine(model_path, micro_batch_size=a.micro, lr=1e-4,
                                  ulysses_sequence_parallel_size=sp)
    want = "FSDPEngineWithLMHead" if vendor is None else "SwitchyardFSDPEngine"
    assert type(eng).__name__ == want, (vendor, type(eng).__name__)
    return eng


def run(eng, variant, infer, update, steps, want_rows):
    """(wall, process CPU) seconds of ``steps`` trainer steps; the ranks start together."""
    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        old, upd = pvo.step(eng, infer, update)
    dt = (time.perf_counter() - t, time.process_time() - c)
    if variant.endswith("R3"):  # every routed row of both passes, over both ranks, replayed
        for out in (old, upd):
            assert out["metrics"]["router_replay/replayed_rows"].aggregate() == want_rows
    return dt


def main():
    ap = trainer_step_parser(micro=4, prompt=8, response=24)
    a = trainer_step_args(ap)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if rank == 0:
        print(machine_line())
        print(f"verl {verl.__version__} FSDP engine (fsdp2), 2 gloo processes x 1 thread; "
              f"Qwen3-MoE hidden {a.hidden}, {a.layers} layers, {a.experts} experts top-2, "
              f"fp32; batch {a.batch} per DP rank (micro {a.micro}), prompts <= {a.prompt}, "
              f"responses <= {a.response} tokens; step = log-prob pass + update; {a.steps} "
              f"steps, best of {a.rounds} rounds; rank 0's times")
    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, "m")
    if rank == 0:  # transformers saves on the main process only; both ranks load it
        pvo.verl_cpu.tiny_qwen3_moe(
            path, num_hidden_layers=a.layers, hidden_size=a.hidden,
            intermediate_size=2 * a.hidden, head_dim=a.hidden // 4, num_experts=a.experts,
            moe_intermediate_size=a.hidden // 2, initializer_range=0.02)
    obj = [path]
    dist.broadcast_object_list(obj, src=0)
    path = obj[0]
    infer, update, routed_rows = pvo.make_batches(a)
    for layout, sp in LAYOUTS.items():
        engines = {f"{layout} {v}": make_engine(vendor, sp, path, a)
                   for v, vendor in VENDORS.items()}
        # DP: both ranks replay their (equal) batch, the metric sums both; SP: the halves sum
        want = routed_rows * (2 if sp == 1 else 1)
        variants = list(engines)
        for v in variants:  # warm-up: first-call costs of each engine
            run(engines[v], v, infer, update, 1, want)
        best = best_of_rotated_rounds(
            variants, a.rounds, lambda v: run(engines[v], v, infer, update, a.steps, want))
        if rank == 0:
            print(f"{layout} (DP {2 // sp} x SP {sp}):")
            print_step_ratios(best, a.steps, f"{layout} verl")
        del engines
    dist.barrier()
    tmp.cleanup() if rank == 0 else None


if __name__ == "__main__":
    main()
