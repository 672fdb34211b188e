#!/usr/bin/env python3
"""PyTorch peer for bench_router: the same routing work done the Megatron-Core way in eager torch
(CPU, fp32): softmax top-k routing weights, the switch load-balancing aux loss, the z-loss, forward
and backward. It then runs bench_router's forward+backward benchmark in the same session and prints
the ratio.

    python bench/router_peer.py [--bench build/bench/bench_router] [--threads 2]

Written from the published formulas (moe_utils.py: switch_load_balancing_loss_func, z_loss_func,
topk_routing_with_score_function); no Megatron code is imported or copied.
"""
import argparse
import json
import subprocess
import time

import torch
from bench_machine import machine_line


def megatron_like_route(logits, topk, aux_coeff, z_coeff):
    num_tokens, num_experts = logits.shape
    # z-loss: mean(logsumexp^2) * coeff
    z_loss = torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_coeff
    # post-softmax top-k routing
    top_logits, top_idx = torch.topk(logits, k=topk, dim=1)
    probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    # aux loss on softmax over all experts, counts from a plain top-k of those scores
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    _, aux_idx = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits).int().scatter(1, aux_idx, 1).bool()
    num_tokens_per_expert = routing_map.sum(dim=0)
    aux_loss = torch.sum(scores.sum(dim=0) * num_tokens_per_expert) * (
        num_experts * aux_coeff / (topk * num_tokens * num_tokens))
    return probs, top_idx, aux_loss, z_loss


def time_torch(T, E, K, reps):
    torch.manual_seed(0)
    base = torch.randn(T, E)
    grad = torch.full((T, K), 0.25)
    best = float("inf")
    for _ in range(reps):
        logits = base.clone().requires_grad_(True)
        t0 = time.perf_counter()
        probs, _, aux, z = megatron_like_route(logits, K, 1e-3, 1e-3)
        (probs * grad).sum().add(aux).add(z).backward()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="build/bench/bench_router")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    T, E, K = 4096, 128, 8
    t_torch = time_torch(T, E, K, args.reps)
    out = subprocess.run(
        [args.bench, "--benchmark_filter=BM_route_forward_backward/0", "--benchmark_format=json",
         "--benchmark_min_time=0.5"],
        check=True, capture_output=True, text=True,
        env={"OMP_NUM_THREADS": str(args.threads)}).stdout
    runs = [b for b in json.loads(out)["benchmarks"] if b.get("run_type", "iteration") == "iteration"]
    t_sy = min(b["real_time"] for b in runs) * 1e-6  # microseconds -> s
    print(machine_line())
    print(f"routing fwd+bwd T={T} E={E} K={K} (softmax, aux_loss, z_loss), {args.threads} threads")
    print(f"| implementation | time | tokens/s |")
    print(f"|---|---|---|")
    print(f"| PyTorch {torch.__version__} eager (Megatron formulas) | {t_torch * 1e3:.2f} ms | {T / t_torch / 1e3:.0f}k |")
    print(f"| switchyard topk_route + backward | {t_sy * 1e3:.2f} ms | {T / t_sy / 1e3:.0f}k |")
    print(f"speed-up over PyTorch: {t_torch / t_sy:.1f}x")


if __name__ == "__main__":
    main()
