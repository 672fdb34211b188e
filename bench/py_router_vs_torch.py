"""Side-by-side: the switchyard.torch router (gate + top-k routing, forward + backward) against a
pure-PyTorch router doing the same work in the same process (Megatron-Core's fp32 router: inputs
upcast to fp32, torch.mm, torch.topk, softmax over the selected logits, aux loss on the full
softmax), with the same thread count. Prints times and ratios (torch / switchyard: > 1 means
switchyard is faster).

    PYTHONPATH=build/python python bench/py_router_vs_torch.py [--quick] [--threads N] [--reps N]
"""
import argparse
import os
import statistics
import sys
import time

# torch.set_num_threads does not bound the BLAS pool of Debian's torch build: size every thread pool
# from --threads before torch is imported, so both sides really get the same number of cores.
_threads = next((a.split("=", 1)[1] if "=" in a else sys.argv[i + 2]
                 for i, a in enumerate(sys.argv[1:]) if a.startswith("--threads")), "1")
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _threads

import torch

import switchyard as sy
from bench_machine import machine_line
from model_shapes import DEEPSEEK_V3, QWEN3_30B_A3B
import switchyard.torch as syt


def torch_router(x, w, K, aux_coeff):
    """Pure PyTorch: fp32 gate, softmax over the top-k logits, Megatron's switch aux loss."""
    logits = torch.mm(x.to(torch.float32), w.to(torch.float32).t())
    top, idx = torch.topk(logits, K, dim=-1)
    probs = torch.softmax(top, dim=-1)
    aux = None
    if aux_coeff:
        T, E = logits.shape
        scores = torch.softmax(logits, dim=-1)
        routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, torch.topk(scores, K).indices,
                                                                   True)
        num_tokens_per_expert = routing_map.sum(0)
        aux = (scores.sum(0) * num_tokens_per_expert).sum() * (E * aux_coeff / (K * T * T))
    return probs, idx, aux


def sy_router(x, w, cfg):
    logits = syt.router_gating_linear(x, w, router_dtype=torch.float32)
    probs, idx, _ = syt.topk_route(logits, cfg)
    return probs, idx, None


def timeit_pair(fa, fb, reps, warmup=1):
    """Median wall and CPU (process) times of fa and fb, run alternately (a shared machine's load
    hits both alike). CPU time counts what the process's threads ran, so another process holding
    a core inflates it less than the wall clock; it also counts OpenMP spin-waits."""
    for _ in range(warmup):
        fa()
        fb()
    ta, tb, ca, cb = [], [], [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fa()
        c1, t1 = time.process_time(), time.perf_counter()
        fb()
        c2, t2 = time.process_time(), time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
        ca.append(c1 - c0)
        cb.append(c2 - c1)
    med = statistics.median
    return med(ta), med(tb), med(ca), med(cb)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    # One thread by default: on a shared 2-core machine two OpenMP pools (torch's and ours) each
    # waiting at barriers for a descheduled thread turn timings into scheduler noise.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=0,
                    help="alternated repetitions per row (default 9, 3 with --quick); the medians "
                         "settle with more on a machine whose speed drifts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sy.set_num_threads(args.threads)
    reps = args.reps or (3 if args.quick else 9)
    # Qwen3-30B-A3B router (H 2048, E 128, K 8) and DeepSeek-V3's (H 7168, E 256, K 8, groups 8/4,
    # sigmoid) with the token count scaled to this machine.
    q, d = QWEN3_30B_A3B, DEEPSEEK_V3
    cases = [("qwen3-30b-a3b", q.hidden, q.num_experts, q.top_k, {},
              4096 if not args.quick else 512),
             ("deepseek-v3", d.hidden, d.num_experts, d.top_k,
              dict(score_function=d.score_function, num_groups=d.num_groups,
                   group_topk=d.group_topk), 1024 if not args.quick else 128)]
    print(machine_line())
    print(f"threads={args.threads}  (median of {reps}; ratio = torch / switchyard, wall clock and "
          f"process CPU time)")
    print("| model | dtype x/W | T | H | E | K | pass | switchyard ms | torch ms | ratio | "
          "switchyard CPU ms | torch CPU ms | CPU ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, H, E, K, extra, T in cases:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(T, H, generator=g).to(dtype)
            w = (torch.randn(E, H, generator=g) * 0.02).to(dtype)
            cfg = sy.RouterConfig(num_experts=E, top_k=K, **extra)
            gp = torch.randn(T, K, generator=g)

            def fwd(impl):
                with torch.no_grad():
                    impl()

            def fwd_bwd(impl):
                xx = x.detach().requires_grad_(True)
                ww = w.detach().requires_grad_(True)
                p, _, aux = impl(xx, ww)
                loss = (p * gp).sum()
                loss.backward()

            if extra:  # group-limited sigmoid routing: the torch peer below is softmax-only.
                def peer(xx=x, ww=w):
                    logits = torch.mm(xx.to(torch.float32), ww.to(torch.float32).t())
                    s = torch.sigmoid(logits)
                    gs = s.view(T, 8, -1).topk(2, dim=-1).values.sum(-1)
                    gi = gs.topk(4, dim=-1).indices
                    mask = torch.zeros(T, 8, dtype=torch.bool).scatter_(1, gi, True)
                    masked = s.masked_fill(~mask.repeat_interleave(E // 8, dim=1), float("-inf"))
                    idx = masked.topk(K, dim=-1).indices
                    p = s.gather(1, idx)
                    return p / (p.sum(-1, keepdim=True) + 1e-20), idx, None
            else:
                def peer(xx=x, ww=w):
                    return torch_router(xx, ww, K, 0.0)

            def ours(xx=x, ww=w):
                return sy_router(xx, ww, cfg)

            # Same ids (the fp32 gate is deterministic in both; ties are measure-zero here).
            with torch.no_grad():
                same = torch.equal(ours()[1], peer()[1])
            # Routing alone on ready fp32 logits (no gate GEMM), forward + backward.
            lg0 = torch.mm(x.float(), w.float().t())

            def route_only(impl):
                lg = lg0.detach().requires_grad_(True)
                p = impl(lg)[0]
                (p * gp).sum().backward()

            if extra:
                def peer_route(lg):
                    s = torch.sigmoid(lg)
                    gs = s.view(T, 8, -1).topk(2, dim=-1).values.sum(-1)
                    gi = gs.topk(4, dim=-1).indices
                    mask = torch.zeros(T, 8, dtype=torch.bool).scatter_(1, gi, True)
                    masked = s.masked_fill(~mask.repeat_interleave(E // 8, dim=1), float("-inf"))
                    idx = masked.topk(K, dim=-1).indices
                    p = s.gather(1, idx)
                    return p / (p.sum(-1, keepdim=True) + 1e-20), idx
            else:
                def peer_route(lg):
                    top, idx = torch.topk(lg, K, dim=-1)
                    return torch.softmax(top, dim=-1), idx

            runs = (("fwd", lambda f: fwd(f)), ("fwd+bwd", lambda f: fwd_bwd(f)),
                    ("route only fwd+bwd", None))
            for label, run in runs:
                if run is None:
                    if dtype != torch.float32:
                        continue
                    t_sy, t_pt, c_sy, c_pt = timeit_pair(
                        lambda: route_only(lambda lg: syt.topk_route(lg, cfg)),
                        lambda: route_only(peer_route), reps)
                    print(f"| {name} | fp32 logits | {T} | {H} | {E} | {K} | {label} | "
                          f"{t_sy * 1e3:.2f} | {t_pt * 1e3:.2f} | {t_pt / t_sy:.2f} | "
                          f"{c_sy * 1e3:.2f} | {c_pt * 1e3:.2f} | {c_pt / c_sy:.2f} |", flush=True)
                    continue
                t_sy, t_pt, c_sy, c_pt = timeit_pair(lambda: run(ours), lambda: run(peer), reps)
                dn = "bf16" if dtype == torch.bfloat16 else "fp32"
                print(f"| {name} | {dn} | {T} | {H} | {E} | {K} | {label} | {t_sy * 1e3:.2f} | "
                      f"{t_pt * 1e3:.2f} | {t_pt / t_sy:.2f} | {c_sy * 1e3:.2f} | "
                      f"{c_pt * 1e3:.2f} | {c_pt / c_sy:.2f} |" + ("" if same else " (ids differ)"),
                      flush=True)


if __name__ == "__main__":
    main()
