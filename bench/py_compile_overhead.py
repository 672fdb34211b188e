"""Cost of switchyard's patch under torch.compile: forward + backward of a training step of a small
transformers Qwen3-MoE, unpatched / patched with the family's own router math (router_dtype=None) /
patched with the fp32 engine gate (torch.ops.switchyard.router_gating_linear), each eager and
compiled (torch.compile(fullgraph=True), inductor), measured round-robin in one run. Prints the CPU
model, the best time of each and the ratios against the unpatched model in the same mode (1.00 =
no overhead) and compiled against eager.

    PYTHONPATH=build/python python bench/py_compile_overhead.py [--quick] [--threads N]
        [--hidden 256] [--batch 4] [--seq 128] [--backend inductor]

The model is small (2 layers, 8 experts, top 2), so the router is a large share of the work and the
ratios are an upper bound of the overhead on real model sizes. Compiling takes a minute or more on
2 cores (three models, forward and backward).
"""
import argparse
import os
import sys
import time

_threads = next((a.split("=", 1)[1] if "=" in a else sys.argv[i + 2]
                 for i, a in enumerate(sys.argv[1:]) if a.startswith("--threads")), "1")
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _threads
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "tests"))

import torch  # noqa: E402

import switchyard as sy  # noqa: E402
import switchyard.integrations.hf as syhf  # noqa: E402
from bench_machine import machine_line  # noqa: E402
import hf_models  # noqa: E402  (the tests' tiny model configs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes, few rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.seq, args.rounds = 64, 32, 5
    torch.set_num_threads(args.threads)
    sy.set_num_threads(args.threads)
    print(machine_line())
    print(f"torch {torch.__version__}, Qwen3-MoE hidden {args.hidden}, 2 layers, E 8, K 2, "
          f"batch {args.batch} x seq {args.seq}, fwd+bwd, backend {args.backend}, "
          f"{args.threads} thread(s)")
    shape = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                 moe_intermediate_size=args.hidden // 2, head_dim=args.hidden // 4)
    x = hf_models.tokens(args.batch, args.seq)
    variants = {}
    for name, rd in (("unpatched", "none"), ("patched native", None),
                     ("patched fp32", torch.float32)):
        for mode in ("eager", "compiled"):
            model = hf_models.build("qwen3_moe", **shape).train()
            if rd != "none":
                syhf.patch(model, router_dtype=rd)
            fn = model if mode == "eager" else torch.compile(model, fullgraph=True,
                                                             backend=args.backend)

            def step(fn=fn, model=model):
                loss = fn(x, labels=x, use_cache=False).loss
                loss.backward()
                model.zero_grad(set_to_none=True)
            variants[(name, mode)] = step
    t0 = time.perf_counter()
    for f in variants.values():  # warm-up: compiles
        f()
        f()
    print(f"warm-up (compiles) {time.perf_counter() - t0:.1f} s")
    times = {k: [] for k in variants}
    for _ in range(args.rounds):
        for k, f in variants.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    print(f"{'model':<16} {'eager ms':>9} {'compiled ms':>12} {'eager/unpatched':>16} "
          f"{'compiled/unpatched':>19} {'compiled/eager':>15}")
    for name in ("unpatched", "patched native", "patched fp32"):
        e, c = best[(name, "eager")], best[(name, "compiled")]
        print(f"{name:<16} {e * 1e3:>9.2f} {c * 1e3:>12.2f} "
              f"{e / best[('unpatched', 'eager')]:>16.2f} "
              f"{c / best[('unpatched', 'compiled')]:>19.2f} {c / e:>15.2f}")


if __name__ == "__main__":
    main()
