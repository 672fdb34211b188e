#!/usr/bin/env python3
"""permute + unpermute: switchyard (bench_permute) against PyTorch doing the same work, same shapes,
same thread count, run one after the other in one command.

PyTorch's version: permute = x.index_select(0, row_token) (rows in expert-major order, the same
routing-plan order); unpermute = zeros.index_add_(0, row_token, Y * w[:, None]) (weights applied,
summed per token). Routes: K distinct uniformly random experts per token, as in bench_permute.

  python bench/permute_vs_torch.py [--bench build/bench/bench_permute] [--threads 2]
"""
import argparse
import json
import os
import subprocess
import time

import torch
from bench_machine import machine_line

from model_shapes import QWEN3_30B_A3B


def torch_times(T, H, E, K, dtype, iters, threads):
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    x = torch.randn(T, H).to(dtype)
    idx = torch.rand(T, E).argsort(dim=1)[:, :K]  # K distinct experts per token
    w = torch.full((T, K), 1.0 / K)
    # The routing plan's order: expert-major, tokens ascending (stable sort on expert id).
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    row_token = order // K
    row_w = w.reshape(-1)[order].to(dtype)
    Y = x.index_select(0, row_token)
    y = torch.zeros(T, H, dtype=dtype)

    P = torch.empty_like(Y)  # outputs reused, as bench_permute's permute_into/unpermute_into do

    def permute():
        return torch.index_select(x, 0, row_token, out=P)

    def unpermute():
        y.zero_()
        y.index_add_(0, row_token, Y * row_w[:, None])
        return y

    def both():
        torch.index_select(x, 0, row_token, out=P)
        y.zero_()
        y.index_add_(0, row_token, P * row_w[:, None])
        return y

    out = {}
    for name, fn in (("permute", permute), ("unpermute", unpermute), ("permute+unpermute", both)):
        fn()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = sorted(ts)[len(ts) // 2]  # median
    return out


def ours(bench, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    res = subprocess.run([bench, "--benchmark_format=json", f"--benchmark_filter=T:4096/H:{QWEN3_30B_A3B.hidden}",
                          "--benchmark_repetitions=3", "--benchmark_report_aggregates_only=true"],
                         env=env, check=True, capture_output=True, text=True)
    times = {}
    for b in json.loads(res.stdout)["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        label = b["label"]  # e.g. "permute bf16"
        times[label] = b["real_time"] * {"ms": 1e-3, "us": 1e-6, "ns": 1e-9}[b["time_unit"]]
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="build/bench/bench_permute")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    q = QWEN3_30B_A3B
    T, H, E, K = 4096, q.hidden, q.num_experts, q.top_k
    ours_t = ours(a.bench, a.threads)
    print(machine_line())
    print(f"T={T} H={H} E={E} K={K}, {a.threads} threads; torch {torch.__version__}")
    print("medians; switchyard from bench_permute (3 repetitions), torch over --iters runs")
    print(f"{'op':<20}{'dtype':<7}{'torch ms':>10}{'switchyard ms':>15}{'speedup':>9}")
    for dtype, dname in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        tt = torch_times(T, H, E, K, dtype, a.iters, a.threads)
        for op in ("permute", "unpermute", "permute+unpermute"):
            o = ours_t.get(f"{op} {dname}")
            if o is None:
                continue
            print(f"{op:<20}{dname:<7}{tt[op]*1e3:>10.2f}{o*1e3:>15.2f}{tt[op]/o:>8.1f}x")


if __name__ == "__main__":
    main()
