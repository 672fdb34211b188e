"""Hostile input under mpirun (issue 13; registered in ctest for -np 2 and -np 3): a check that fails
on ONE rank before the engine call (a Python-side check, a bad handle, requires_grad differing
across ranks) must raise on EVERY rank with an accurate message, never hang. The watchdog
(SWITCHYARD_COLLECTIVE_TIMEOUT, set here before the communicator is made) turns a regression into
an error instead of a hang. Exit code 0 only when every rank saw every expected error.
Run: mpirun -np 2 --oversubscribe env PYTHONPATH=build/python python3 python/tests/mpi_hostile.py"""
import os
import sys

os.environ.setdefault("SWITCHYARD_COLLECTIVE_TIMEOUT", "30")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import expect_error, run_mpi_main  # noqa: E402

import switchyard as sy  # noqa: E402
import switchyard.torch as syt  # noqa: E402

torch.set_num_threads(1)



def main():
    comm = sy.dist.world()
    rank, size = comm.rank, comm.size
    last = size - 1
    d = syt.AlltoAllDispatcher(num_experts=4 * size, ep_comm=comm)
    T, H = 5, 8
    x = torch.randn(T, H)
    idx = torch.stack([torch.randperm(4 * size)[:2] for _ in range(T)])
    w = torch.rand(T, 2)

    # 1. A Python-side dtype check failing on the last rank only.
    bad_w = w.to(torch.int32) if rank == last else w
    expect_error("int topk_weights on one rank", lambda: d.dispatch(x, bad_w, idx),
                 f"on rank {last}: [AlltoAllDispatcher.dispatch] topk_weights must have dtype")

    # 2. Not a DispatchHandle on the last rank only.
    rx, _, h = d.dispatch(x, w, idx)
    bad_h = object() if rank == last else h
    expect_error("bad handle on one rank", lambda: d.combine(rx, bad_h),
                 f"on rank {last}: [AlltoAllDispatcher.combine] handle must be the DispatchHandle")

    # 3. requires_grad differing across ranks: an accurate error in the forward, not a misleading
    # one (or a hang) in the backward.
    xg = x.clone().requires_grad_(rank != last)
    expect_error("requires_grad differing", lambda: d.dispatch(xg, w, idx),
                 "x.requires_grad must be the same on every rank")

    # The communicator is still in step.
    rx, _, h = d.dispatch(x, w, idx)
    y = d.combine(rx, h)
    assert torch.allclose(y, x * w.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
    comm.barrier()
    if rank == 0:
        print(f"mpi_hostile: {size} ranks, all checks passed")


if __name__ == "__main__":
    run_mpi_main(main)
