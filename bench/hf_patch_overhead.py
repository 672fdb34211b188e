"""Overhead of switchyard.integrations.hf.patch on tiny transformers MoE models, per family:
forward + backward of a training step and a greedy generate(), unpatched against patched with the
fp32 router (switchyard's engine gate on CPU) and against patched with the family's own dtypes
(router_dtype=None: replay/capture machinery only), measured alternately in one run. Prints the
CPU model, times and ratios (patched / unpatched: 1.00 = no overhead).

    PYTHONPATH=build/python python bench/hf_patch_overhead.py [--quick] [--threads N]
        [--hidden 32] [--batch 4] [--seq 64] [--families qwen3_moe,gpt_oss]
    PYTHONPATH=build/python python bench/hf_patch_overhead.py --shapes [--quick]

--shapes: one bf16 MoE layer with a real model's router shape (Qwen3-30B-A3B: H 2048, E 128, K 8;
DeepSeek-V3: H 7168, E 256, K 8, groups 8 / 4), forward + backward of batch x seq tokens, unpatched
against the patched fp32 router; the experts' width is cut to 16 (and attention to 4 heads of 8) so
the layer fits the machine, which makes the router's share, and so the ratio, an upper bound.

The models are the test suite's tiny configs (python/tests/hf_models.py: 2-3 layers, 8 experts),
where the router is a large share of the work, so the ratios are an upper bound of the overhead
on real model sizes.
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
from bench_machine import machine_line  # noqa: E402
import switchyard.integrations.hf as syhf  # noqa: E402
import hf_models  # noqa: E402  (the tests' tiny model configs)


def timed(fns, reps):
    """Best time of each function over reps, run round-robin (machine load hits all alike; on a
    shared machine the minimum is the least disturbed measurement)."""
    for f in fns:
        f()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            ts[i].append(time.perf_counter() - t0)
    return [min(t) for t in ts]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--families", default=",".join(hf_models.FAMILIES))
    ap.add_argument("--shapes", action="store_true")
    args = ap.parse_args()
    if args.shapes:
        return shapes(args)
    torch.set_num_threads(args.threads)
    sy.set_num_threads(args.threads)
    reps = 3 if args.quick else 15
    print(f"{machine_line()}; threads {args.threads}; "
          f"transformers {__import__('transformers').__version__}")
    print(f"tiny models: hidden {args.hidden}, batch {args.batch} x seq {args.seq} for fwd+bwd, "
          f"generate {args.new_tokens} new tokens from batch 2 x 16; one router fwd+bwd on "
          f"{args.batch * args.seq} tokens; fp32 parameters; best of {reps}")
    print("unp = unpatched, fp32 = patched router_dtype=torch.float32 (engine gate), own = "
          "patched router_dtype=None")
    print(f"{'family':<16} {'fwd+bwd ms':>10} {'fp32/unp':>9} {'own/unp':>8} "
          f"{'generate ms':>11} {'fp32/unp':>9} {'own/unp':>8} {'router us':>10} "
          f"{'fp32':>7} {'own':>7}")
    for fam in args.families.split(","):
        over = {} if args.hidden == 32 else dict(hidden_size=args.hidden,
                                                 intermediate_size=2 * args.hidden)
        # Three copies with the same weights: unpatched, patched fp32, patched with own dtypes
        # (patched once, outside the timed region).
        models = [hf_models.build(fam, torch.float32, **over) for _ in range(3)]
        syhf.patch(models[1], router_dtype=torch.float32)
        syhf.patch(models[2], router_dtype=None)
        ids = hf_models.tokens(args.batch, args.seq, seed=1)
        prompts = hf_models.tokens(2, 16, seed=2)

        def step(model):
            def run():
                model.zero_grad(set_to_none=True)
                model.train()
                model(ids, labels=ids).loss.backward()
            return run

        def gen(model):
            def run():
                model.eval()
                with torch.no_grad():
                    model.generate(prompts, max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens, do_sample=False,
                                   pad_token_id=0)
            return run

        # The router alone: first MoE layer's router, forward + backward on the step's tokens.
        x = torch.randn(args.batch * args.seq, models[0].config.hidden_size,
                        generator=torch.Generator().manual_seed(3)).requires_grad_()
        moe = syhf.patch(models[0], router_dtype=None)
        name = moe.modules[moe.layers[0]]
        moe.unpatch()

        def router(model):
            r = model.get_submodule(name)

            def run():
                out = r(x)
                (out[0].float().sum() + out[1].float().sum()).backward()
            return run

        t_step = timed([step(m) for m in models], reps)
        t_gen = timed([gen(m) for m in models], max(3, reps // 2))
        t_r = timed([router(m) for m in models], 20 * reps)
        print(f"{fam:<16} {1e3 * t_step[0]:>10.2f} {t_step[1] / t_step[0]:>9.2f} "
              f"{t_step[2] / t_step[0]:>8.2f} {1e3 * t_gen[0]:>11.2f} "
              f"{t_gen[1] / t_gen[0]:>9.2f} {t_gen[2] / t_gen[0]:>8.2f} {1e6 * t_r[0]:>10.0f} "
              f"{1e6 * t_r[1]:>7.0f} {1e6 * t_r[2]:>7.0f}", flush=True)


SHAPES = {  # real router shapes, experts cut to width 16, one layer
    "Qwen3-30B-A3B": ("qwen3_moe", dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8,
                                        moe_intermediate_size=16, intermediate_size=16,
                                        num_hidden_layers=1)),
    "DeepSeek-V3": ("deepseek_v3", dict(hidden_size=7168, n_routed_experts=256,
                                        num_experts_per_tok=8, n_group=8, topk_group=4,
                                        moe_intermediate_size=16, intermediate_size=16,
                                        first_k_dense_replace=0, num_hidden_layers=1)),
}


def shapes(args):
    torch.set_num_threads(args.threads)
    sy.set_num_threads(args.threads)
    reps = 3 if args.quick else 10
    print(f"{machine_line()}; threads {args.threads}; "
          f"transformers {__import__('transformers').__version__}")
    print(f"one bf16 MoE layer, fwd+bwd of {args.batch} x {args.seq} tokens, best of {reps}; "
          "fp32 = patched router_dtype=torch.float32 (engine gate)")
    print(f"{'shape':<16} {'unpatched ms':>12} {'fp32 ms':>9} {'fp32/unp':>9}")
    ids = hf_models.tokens(args.batch, args.seq, seed=1)
    for label, (fam, over) in SHAPES.items():
        models = [hf_models.build(fam, torch.bfloat16, **over) for _ in range(2)]
        syhf.patch(models[1], router_dtype=torch.float32)

        def step(model):
            def run():
                model.zero_grad(set_to_none=True)
                model.train()
                model(ids, labels=ids).loss.backward()
            return run
        t = timed([step(m) for m in models], reps)
        print(f"{label:<16} {1e3 * t[0]:>12.2f} {1e3 * t[1]:>9.2f} {t[1] / t[0]:>9.2f}",
              flush=True)
        del models


if __name__ == "__main__":
    main()
