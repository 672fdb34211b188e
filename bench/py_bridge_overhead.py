"""Per-call cost of crossing between torch and the engine, beside torch's own cheapest calls.

In:  borrowing a contiguous CPU tensor (dtype/device checks, shape, data_ptr):
     `switchyard._testing.borrow_info(t)`.
Out: handing an engine-owned result to torch without a copy: `switchyard._testing.full(shape,
     dtype, v)` minus the engine's own allocation, timed beside `torch.full` of the same small shape.
Both are per call, for a small [4, 4] tensor (the cost is per call, not per byte: nothing is copied).

    PYTHONPATH=build/python $(bash scripts/env.sh)/bin/python bench/py_bridge_overhead.py
"""
import sys
import timeit

import torch

import switchyard as sy
import switchyard._testing as sy_testing
from bench_machine import machine_line


def per_call_us(stmt, number=20000, repeat=7):
    return min(timeit.repeat(stmt, number=number, repeat=repeat)) / number * 1e6


def main():
    torch.set_num_threads(1)
    print(f"{machine_line()}; python {sys.version.split()[0]}")
    print(f"{'dtype':<10} {'borrow (in) us':>15} {'result (out) us':>16} {'torch.full us':>14}"
          f" {'out / torch.full':>17}")
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.bool):
        t = torch.zeros(4, 4, dtype=dtype)
        t_in = per_call_us(lambda: sy_testing.borrow_info(t))
        t_out = per_call_us(lambda: sy_testing.full([4, 4], dtype, 1.0))
        t_ref = per_call_us(lambda: torch.full((4, 4), 1.0, dtype=dtype))
        print(f"{str(dtype).replace('torch.', ''):<10} {t_in:>15.2f} {t_out:>16.2f} {t_ref:>14.2f}"
              f" {t_out / t_ref:>16.2f}x")


if __name__ == "__main__":
    main()
