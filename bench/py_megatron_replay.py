"""Side-by-side: what switchyard.integrations.megatron adds to one Megatron-Core TopKRouter forward
(real megatron-core, CPU, one gloo rank, 1 thread), at Qwen3-30B-A3B's router shape scaled to the
machine (H 2048, E 128, K 8, T tokens):

  megatron_native   Megatron's router forward, unpatched (gate GEMM, softmax top-k)
  megatron_replay   Megatron's own RouterReplay, REPLAY_FORWARD (no checks)
  sy_replay         the patched router replaying validated ids (keyed, merged rows, counts)
  sy_validate       set_replay_targets for one layer (the engine's host-side validation)
  sy_engine_replay  the same with apply(engine="cpu") (switchyard's FP32 gate + topk_route)

Prints medians and ratios to megatron_native, measured interleaved in the same process.

    PYTHONPATH=build/python python bench/py_megatron_replay.py [--tokens 4096] [--reps 15]
"""
import argparse
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "tests"))
from bench_machine import machine_line  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    s.close()
    dist.init_process_group("gloo", rank=0, world_size=1)
    import megatron_shims  # the tests' CPU shims for Megatron's CUDA-only calls
    megatron_shims.install()
    import megatron_workers as mw
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    import switchyard.integrations.megatron as sym
    from model_shapes import QWEN3_30B_A3B as q
    mw.E, mw.K, mw.H, mw.F = q.num_experts, q.top_k, q.hidden, 64  # F scaled down
    pg, _, _ = mw._groups(0, 1)
    cfg = mw._config(1, moe_enable_routing_replay=True)
    layer = mw._layer(cfg, pg)
    router = layer.router
    T = a.tokens
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, 1, mw.H, generator=g)
    ids = torch.stack([torch.randperm(mw.E, generator=g)[:mw.K] for _ in range(T)])
    ids[:T // 10] = 0  # a tenth zero-filled rows (merged)

    def megatron_native():
        router.router_replay.router_replay_action = None
        router(x)

    def megatron_replay():
        RouterReplay.set_replay_data([ids])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        router(x)
        RouterReplay.clear_global_router_replay_action()

    def sy_validate():
        sym.set_replay_targets(router, {1: ids})
        router._sy.replay.clear()

    def sy_replay():
        sym.set_replay_targets(router, {1: ids})
        router(x)

    times = {n: [] for n in ("megatron_native", "megatron_replay", "sy_validate", "sy_replay",
                             "sy_engine_replay")}
    with torch.no_grad():
        for _ in range(a.reps):
            for name, fn in (("megatron_native", megatron_native),
                             ("megatron_replay", megatron_replay)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            for engine, names in ((None, ("sy_validate", "sy_replay")),
                                  ("cpu", ("sy_engine_replay",))):
                with sym.patched(engine=engine):
                    router.router_replay = None
                    sym.attach_replay(router, invalid_replay_rows="merge")
                    sym.set_replay_action(router, "replay_forward")
                    for name in names:
                        fn = sy_validate if name == "sy_validate" else sy_replay
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
                    sym.detach_replay(router)
                    router.router_replay = RouterReplay.global_router_replay_instances[0]
    base = statistics.median(times["megatron_native"])
    print(machine_line())
    print(f"T={T} H={mw.H} E={mw.E} K={mw.K}, 1 thread, median of {a.reps}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:17s} {m * 1e3:8.2f} ms   x{m / base:5.2f} of megatron_native")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
