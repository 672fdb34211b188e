"""Side-by-side: the switchyard.torch dispatchers (dispatch + combine) against pure-PyTorch versions
of the same work in the same process, and a memcpy ceiling (copying the T*K rows dispatched into a ready buffer).

Single process (ep size 1): switchyard vs torch permute (argsort + index_select) / unpermute
(weighted index_add), forward and forward+backward.
Under mpirun (ep size > 1): switchyard's AlltoAll / AllGather dispatchers vs torch + mpi4py
Alltoallv doing the same exchange (sort by expert, Alltoallv rows and weights, regroup by local
expert; combine: Alltoallv back, weighted index_add), forward only.

    PYTHONPATH=build/python python bench/py_dispatch_vs_torch.py [--quick]
    mpirun -np 2 --oversubscribe env PYTHONPATH=build/python /usr/bin/python3 \
        bench/py_dispatch_vs_torch.py [--quick]
Ratio = torch / switchyard (> 1: switchyard faster).
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
import switchyard.torch as syt
from bench_machine import machine_line
from model_shapes import MIXTRAL_8X7B, QWEN3_30B_A3B


def routes(T, E, K, g):
    idx = torch.rand(T, E, generator=g).topk(K, dim=-1).indices  # distinct ids per row
    probs = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    return idx, probs


# ---- pure PyTorch, one process -------------------------------------------------------------------
def torch_permute(x, probs, idx):
    T, K = idx.shape
    flat = idx.reshape(-1)
    token = torch.arange(T).repeat_interleave(K)
    order = torch.argsort(flat * T + token)  # expert-major, tokens ascending (ids are distinct)
    tok = token[order]
    return x.index_select(0, tok), probs.reshape(-1)[order], tok


def torch_unpermute(rows, w, tok, T):
    out = torch.zeros(T, rows.shape[1], dtype=torch.float32)
    out.index_add_(0, tok, rows.float() * w[:, None])
    return out.to(rows.dtype)


# ---- torch + mpi4py, ep ranks -----------------------------------------------------------------------
class TorchMPIDispatch:
    def __init__(self, comm, E):
        from mpi4py import MPI
        self.MPI, self.comm, self.E = MPI, comm, E
        self.ep = comm.Get_size()
        self.L = E // self.ep

    def _a2av(self, send, send_counts, recv_counts, width):
        recv = torch.empty((int(sum(recv_counts)),) + tuple(send.shape[1:]), dtype=send.dtype)
        s = send.contiguous().view(torch.uint8).numpy() if send.numel() else bytearray(0)
        r = recv.view(torch.uint8).numpy() if recv.numel() else bytearray(0)
        sc = [c * width for c in send_counts]
        rc = [c * width for c in recv_counts]
        sd = [sum(sc[:i]) for i in range(self.ep)]
        rd = [sum(rc[:i]) for i in range(self.ep)]
        self.comm.Alltoallv([s, sc, sd, self.MPI.BYTE], [r, rc, rd, self.MPI.BYTE])
        return recv

    def dispatch(self, x, probs, idx):
        T, K = idx.shape
        H = x.shape[1]
        flat = idx.reshape(-1)
        token = torch.arange(T).repeat_interleave(K)
        order = torch.argsort(flat * T + token)
        tok, exp = token[order], flat[order]
        per_rank = torch.bincount(exp // self.L, minlength=self.ep).tolist()
        recv_counts = self.comm.alltoall(per_rank)
        esz = x.element_size()
        rows = self._a2av(x.index_select(0, tok), per_rank, recv_counts, H * esz)
        w = self._a2av(probs.reshape(-1)[order].float(), per_rank, recv_counts, 4)
        e = self._a2av(exp.to(torch.int32), per_rank, recv_counts, 4)
        regroup = torch.argsort(e.to(torch.int64), stable=True)  # local expert, then rank, token
        h = dict(tok=tok, per_rank=per_rank, recv_counts=recv_counts, regroup=regroup, T=T,
                 H=H, esz=esz)
        return rows.index_select(0, regroup), w[regroup], h

    def combine(self, y, w, h):
        back = torch.empty_like(y)
        back[h["regroup"]] = y * w[:, None].to(y.dtype)
        rows = self._a2av(back, h["recv_counts"], h["per_rank"], h["H"] * h["esz"])
        out = torch.zeros(h["T"], h["H"], dtype=torch.float32)
        out.index_add_(0, h["tok"], rows.float())
        return out.to(y.dtype)


def timeit_pair(fa, fb, reps, barrier=lambda: None):
    fa()
    fb()
    ta, tb = [], []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        barrier()
        t2 = time.perf_counter()
        fb()
        t3 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t3 - t2)
    return statistics.median(ta), statistics.median(tb)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sy.set_num_threads(args.threads)
    reps = 3 if args.quick else 9
    mpi_comm = None
    try:
        import os
        if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
            from mpi4py import MPI
            mpi_comm = MPI.COMM_WORLD
    except ImportError:
        mpi_comm = None
    comm = sy.dist.from_mpi4py(mpi_comm) if mpi_comm is not None else sy.dist.local()
    ep, rank = comm.size, comm.rank
    say = print if rank == 0 else (lambda *a, **k: None)
    barrier = comm.barrier
    # Qwen3-30B-A3B (H 2048, E 128, K 8) and Mixtral (H 4096, E 8, K 2), tokens per rank scaled.
    q, m = QWEN3_30B_A3B, MIXTRAL_8X7B
    cases = [("qwen3-30b-a3b", q.hidden, q.num_experts, q.top_k, 512 if args.quick else 2048),
             ("mixtral", m.hidden, m.num_experts, m.top_k, 512 if args.quick else 4096)]
    say(machine_line())
    say(f"ep={ep} threads={args.threads} (median of {reps}; ratio = torch / switchyard)")
    say("| model | dtype | T/rank | H | E | K | dispatcher | pass | switchyard ms | torch ms | "
        "ratio | memcpy ms |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(rank)
    for name, H, E, K, T in cases:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(T, H, generator=g).to(dtype)
            idx, probs = routes(T, E, K, g)
            copy_src = torch.ones(T * K, H, dtype=dtype)
            copy_dst = torch.empty_like(copy_src)
            t_copy = timeit_pair(lambda: copy_dst.copy_(copy_src), lambda: None, reps)[0]
            dn = "bf16" if dtype == torch.bfloat16 else "fp32"
            for cls in (syt.AlltoAllDispatcher, syt.AllGatherDispatcher):
                disp = cls(num_experts=E, ep_comm=comm)

                def ours_fwd():
                    with torch.no_grad():
                        rx, rp, h = disp.dispatch(x, probs, idx)
                        return disp.combine(rx, h)

                if ep == 1:
                    def peer_fwd():
                        with torch.no_grad():
                            rows, w, tok = torch_permute(x, probs, idx)
                            return torch_unpermute(rows, w, tok, T)
                else:
                    tm = TorchMPIDispatch(mpi_comm, E)

                    def peer_fwd():
                        with torch.no_grad():
                            rows, w, h = tm.dispatch(x, probs, idx)
                            return tm.combine(rows, w, h)

                y0, y1 = ours_fwd(), peer_fwd()
                agree = torch.allclose(y0.float(), y1.float(), rtol=2e-2, atol=2e-2)
                t_sy, t_pt = timeit_pair(ours_fwd, peer_fwd, reps, barrier)
                say(f"| {name} | {dn} | {T} | {H} | {E} | {K} | {cls.kind} | fwd | "
                    f"{t_sy * 1e3:.2f} | {t_pt * 1e3:.2f} | {t_pt / t_sy:.2f} | {t_copy * 1e3:.2f} |"
                    + ("" if agree else " (results differ)"), flush=True)
                if ep == 1:
                    gy = torch.randn(T, H, generator=g).to(dtype)

                    def ours_bwd():
                        xx = x.detach().requires_grad_(True)
                        pp = probs.detach().requires_grad_(True)
                        rx, rp, h = disp.dispatch(xx, pp, idx)
                        (disp.combine(rx, h) * gy).sum().backward()

                    def peer_bwd():
                        xx = x.detach().requires_grad_(True)
                        pp = probs.detach().requires_grad_(True)
                        rows, w, tok = torch_permute(xx, pp, idx)
                        (torch_unpermute(rows, w, tok, T) * gy).sum().backward()

                    t_sy, t_pt = timeit_pair(ours_bwd, peer_bwd, reps)
                    say(f"| {name} | {dn} | {T} | {H} | {E} | {K} | {cls.kind} | fwd+bwd | "
                        f"{t_sy * 1e3:.2f} | {t_pt * 1e3:.2f} | {t_pt / t_sy:.2f} | |", flush=True)


if __name__ == "__main__":
    main()
