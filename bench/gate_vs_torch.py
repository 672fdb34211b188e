#!/usr/bin/env python3
"""PyTorch eager doing the router gate the Megatron-Core way, timed on its own.

Megatron-Core's RouterGatingLinearFunction (router_dtype fp32): the forward upcasts the bf16
input and weight to fp32 and calls torch.mm(x, W.t()); the backward computes
grad_x = torch.mm(grad_logits, W).to(x.dtype) and grad_W = torch.mm(grad_logits.t(), x).to(W.dtype)
on the fp32 copies. This script times exactly that for Qwen3-30B-A3B's gate (T=4096, H=2048,
E=128) at 1 and 2 threads, so its numbers can be set beside bench_gate's (same session, same
machine):

    python bench/gate_vs_torch.py
    ./build/bench/bench_gate --benchmark_filter='Gate(Forward/bf16_fp32|Backward)'

Run with the project venv: PYTHONPATH=build/python $(bash scripts/env.sh)/bin/python.
"""
import argparse
import os
import subprocess
import sys
import time

import torch
from bench_machine import machine_line

from model_shapes import QWEN3_30B_A3B


def gate_forward(x, w):
    # Megatron-Core: inp.to(router_dtype), weight.to(router_dtype), torch.mm(inp, weight.t())
    xf, wf = x.to(torch.float32), w.to(torch.float32)
    return torch.mm(xf, wf.t()), xf, wf


def gate_backward(g, xf, wf, x_dtype, w_dtype):
    grad_x = torch.mm(g, wf).to(x_dtype)
    grad_w = torch.mm(g.t(), xf).to(w_dtype)
    return grad_x, grad_w


def best_ms(fn, reps, threads):
    """Best wall-clock ms and best process-CPU ms / threads over `reps` calls (the CPU figure is
    the stable one when other processes share the cores)."""
    fn()  # warm-up
    best, best_cpu = float("inf"), float("inf")
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, (time.process_time() - c0) / threads)
    return best * 1e3, best_cpu * 1e3


def run(T, H, E, n, reps):
    torch.set_num_threads(n)
    torch.manual_seed(0)
    x = torch.randn(T, H).to(torch.bfloat16)
    w = (torch.randn(E, H) * 0.02).to(torch.bfloat16)
    g = torch.randn(T, E)
    flops = 2.0 * T * H * E
    fwd, fwd_cpu = best_ms(lambda: gate_forward(x, w), reps, n)

    # Megatron-Core saves the bf16 inputs and upcasts again in backward; time that too.
    def bwd():
        xf2, wf2 = x.to(torch.float32), w.to(torch.float32)
        gate_backward(g, xf2, wf2, x.dtype, w.dtype)

    bwd_ms, bwd_cpu = best_ms(bwd, reps, n)
    print(f"{n:>7} {fwd:>9.2f} {flops / fwd / 1e6:>12.1f} {bwd_ms:>9.2f} "
          f"{2 * flops / bwd_ms / 1e6:>12.1f} {fwd + bwd_ms:>11.2f} {fwd_cpu:>11.2f} "
          f"{bwd_cpu:>11.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=QWEN3_30B_A3B.hidden)
    ap.add_argument("--experts", type=int, default=QWEN3_30B_A3B.num_experts)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    T, H, E = a.tokens, a.hidden, a.experts
    if a.child is not None:
        run(T, H, E, a.child, a.reps)
        return
    print(machine_line())
    print(f"torch {torch.__version__}, gate T={T} H={H} E={E}, x/W bf16, router fp32 "
          f"(Megatron-Core way)")
    print(f"{'threads':>7} {'fwd ms':>9} {'fwd GFLOP/s':>12} {'bwd ms':>9} {'bwd GFLOP/s':>12} "
          f"{'fwd+bwd ms':>11} {'cpu fwd ms':>11} {'cpu bwd ms':>11}", flush=True)
    for n in a.threads:
        # torch.set_num_threads does not reach the OpenBLAS thread pool behind torch.mm on Debian's
        # build (a "1-thread" run used both cores), so each thread count runs in a fresh process
        # with the pools sized by the environment.
        env = dict(os.environ, OMP_NUM_THREADS=str(n), OPENBLAS_NUM_THREADS=str(n))
        subprocess.run([sys.executable, __file__, "--child", str(n), "--tokens", str(T),
                        "--hidden", str(H), "--experts", str(E), "--reps", str(a.reps)],
                       env=env, check=True)


if __name__ == "__main__":
    main()
