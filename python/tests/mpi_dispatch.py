"""Dispatchers under mpirun (registered in ctest for -np 2 and -np 4): every rank rebuilds every
rank's inputs from the seed and checks its own results against the single-process pure-PyTorch
reference: received rows and their sources, weights, per-expert counts, combine (bitwise equal to
the ep-size-1 result), gradients of x, probs and the expert weights, skew, collective errors.
Run: mpirun -np 4 --oversubscribe env PYTHONPATH=build/python python3 python/tests/mpi_dispatch.py"""
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import switchyard as sy  # noqa: E402
import switchyard.torch as syt  # noqa: E402
import torch_ref as ref  # noqa: E402
from helpers import expert_weights, rank_inputs  # noqa: E402

torch.set_num_threads(1)


def expert_linear(rows, w):
    """rows [n, H] @ w [H, H'] with every output row a function of its own input row only.

    A peer GEMM (torch.mm / OpenBLAS) picks its blocking and kernels by the number of rows, so the
    same row can come out with different bits at EP 1 and EP 2 on some CPUs; the bitwise EP-size
    comparison below needs a block whose per-row result cannot depend on which other rows are
    present. switchyard's gate is that by construction (one fixed-order fp32 FMA chain per output,
    exact backward), so it serves as the expert's linear layer here."""
    return syt.router_gating_linear(rows, w.t()).to(rows.dtype)


def expert_block(disp, recv_x, handle, W):
    out, off = [], 0
    for i, e in enumerate(disp.local_expert_ids):
        n = int(handle.num_tokens_per_expert[i])
        out.append(expert_linear(recv_x[off:off + n], W[e]))
        off += n
    return torch.cat(out) if out else expert_linear(recv_x[:0], W[0])


def check_case(comm, cls, seed, H, E, K, tokens, dtype=torch.float32, skew=False):
    rank, ep = comm.rank, comm.size
    data = [rank_inputs(seed, s, tokens[s], H, E, K, dtype=dtype, skew=skew) for s in range(ep)]
    xs = [d[0] for d in data]
    idxs = [d[1] for d in data]
    ps = [d[2] for d in data]
    W = expert_weights(seed, E, H)
    x = xs[rank].clone().requires_grad_(True)
    p = ps[rank].clone().requires_grad_(True)
    Wl = W.clone().requires_grad_(True)
    disp = cls(num_experts=E, ep_comm=comm)
    recv_x, recv_p, h = disp.dispatch(x, p, idxs[rank])
    rows, ws, srank, stok, counts = ref.dispatch_rows(xs, idxs, ps, E, ep, rank)
    where = f"{cls.__name__} rank {rank}/{ep} seed {seed} T={tokens}"
    assert torch.equal(recv_x, rows), where
    assert torch.equal(recv_p, ws), where
    assert torch.equal(h.num_tokens_per_expert, counts), where
    assert torch.equal(h.recv_src_rank.to(torch.int64), srank), where
    assert torch.equal(h.recv_src_token.to(torch.int64), stok), where
    y = disp.combine(expert_block(disp, recv_x, h, Wl), h)
    # Bitwise the same as ep size 1 on this rank's tokens alone.
    d1 = cls(num_experts=E, ep_comm=sy.dist.local())
    rx1, _, h1 = d1.dispatch(xs[rank], ps[rank], idxs[rank])
    y1 = d1.combine(expert_block(d1, rx1, h1, W), h1)
    assert torch.equal(y.detach(), y1), where
    G = torch.randn(sum(tokens), H, generator=torch.Generator().manual_seed(seed + 5))
    lo = sum(tokens[:rank])
    (y.float() * G[lo:lo + tokens[rank]]).sum().backward()
    # Reference over all ranks' tokens in float64.
    xr = [xx.double().requires_grad_(True) for xx in xs]
    pr = [pp.double().requires_grad_(True) for pp in ps]
    Wr = W.double().requires_grad_(True)
    loss = 0
    for s in range(ep):
        yr = ref.moe_combine(xr[s], idxs[s], pr[s], lambda e, v: v @ Wr[e])
        loss = loss + (yr * G[sum(tokens[:s]):sum(tokens[:s + 1])].double()).sum()
    loss.backward()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=0.3)
    if tokens[rank]:
        torch.testing.assert_close(x.grad.double(), xr[rank].grad, **tol, msg=where)
        torch.testing.assert_close(p.grad.double(), pr[rank].grad, **tol, msg=where)
    else:
        assert x.grad is None or x.grad.numel() == 0, where
    # The expert-weight gradients of this rank's experts (others get none from this rank).
    # (bf16: W's gradient is a bf16 matmul over rows whose column 0 is ~1000*rank; not compared.)
    for e in (disp.local_expert_ids if dtype == torch.float32 else ()):
        torch.testing.assert_close(Wl.grad[e].double(), Wr.grad[e], **tol, msg=where)
    # Experts that apply the routing weights themselves (apply_weights=False): the probs' gradient
    # then flows through recv_probs, back to each row's source rank.
    p2 = ps[rank].clone().requires_grad_(True)
    recv_x2, recv_p2, h2 = disp.dispatch(xs[rank], p2, idxs[rank])
    y2 = disp.combine(expert_block(disp, recv_x2, h2, W) * recv_p2[:, None].to(recv_x2.dtype), h2,
                      apply_weights=False)
    (y2.float() * G[lo:lo + tokens[rank]]).sum().backward()
    torch.testing.assert_close(y2.double(), y.detach().double(), **tol, msg=where)
    if tokens[rank]:
        torch.testing.assert_close(p2.grad.double(), pr[rank].grad, **tol, msg=where)
    return h


def check_errors(comm, cls):
    rank = comm.rank
    E = 4 * comm.size
    x, idx, p = rank_inputs(2, rank, 6, 4, E, 2)
    if rank == comm.size - 1:
        idx[3, 1] = E  # a bad id on one rank only: every rank must raise, none may hang
    disp = cls(num_experts=E, ep_comm=comm)
    try:
        disp.dispatch(x, p, idx)
    except ValueError as e:
        assert f"topk_idx[3, 1]={E}" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: no error for a bad id on rank {comm.size - 1}")
    try:
        cls(num_experts=comm.size + 1 if comm.size > 1 else 0, ep_comm=comm)
    except ValueError:
        pass
    else:
        raise AssertionError("num_experts not divisible by the ep size was accepted")


def run(comm, label):
    ep = comm.size
    for cls in (syt.AlltoAllDispatcher, syt.AllGatherDispatcher):
        check_case(comm, cls, 11, 16, 4 * ep, 4, [9 + 5 * s for s in range(ep)])
        check_case(comm, cls, 12, 8, 2 * ep, 2, [0 if s == 1 else 13 for s in range(ep)])
        check_case(comm, cls, 13, 8, 8 * ep, 8, [17] * ep)          # K = E/ep
        check_case(comm, cls, 14, 8, 4 * ep, 3, [21] * ep, skew=True)  # one hot rank
        check_case(comm, cls, 15, 16, 2 * ep, 2, [10] * ep, dtype=torch.bfloat16)
        check_errors(comm, cls)
    comm.barrier()
    print(f"mpi_dispatch {label}: rank {comm.rank}/{ep} OK", flush=True)


def main():
    comm = sy.dist.world()
    run(comm, "sy.dist.world()")
    try:
        from mpi4py import MPI
    except ImportError:
        MPI = None
    if MPI is not None:
        run(sy.dist.as_communicator(MPI.COMM_WORLD), "mpi4py COMM_WORLD")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a failed rank must not leave the others waiting in a collective
