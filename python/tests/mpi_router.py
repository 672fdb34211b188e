"""syt.topk_route / syt.TopKRouter with cross-rank loss statistics under mpirun (registered in ctest
for -np 2 and -np 4): the world communicator as Megatron's tp_cp and tp_dp_cp groups. Every rank
rebuilds the global batch from the seed, routes its own uneven slice, and checks against one
process routing the whole batch: ids and weights of its rows, the gradient rows (bitwise), the
global aux-loss state, and that the per-rank aux losses sum to the one-process loss; then that a
bad argument on one rank raises on every rank. Also the quantile-balancing update averaged over
the ranks (check_qb_beta_over_ranks).
Run: mpirun -np 4 --oversubscribe env PYTHONPATH=build/python python3 python/tests/mpi_router.py"""
import math
import sys
import traceback

import torch

import switchyard as sy
import switchyard.torch as syt

torch.set_num_threads(1)


def main():
    comm = sy.dist.world()
    rank, size = comm.rank, comm.size
    T, E, K = 61, 16, 2
    g = torch.Generator().manual_seed(1451)
    z = torch.randn(T, E, generator=g, dtype=torch.float64) * 1.5
    gw = torch.randn(T, K, generator=g, dtype=torch.float64)
    shares = size * (size + 1) // 2
    bounds = [0]
    for r in range(size):
        bounds.append(T if r == size - 1 else bounds[-1] + T * (r + 1) // shares)
    b, e = bounds[rank], bounds[rank + 1]
    cfg = sy.RouterConfig(num_experts=E, top_k=K, score_function="sigmoid",
                          aux_loss_type=["aux_loss", "global_aux_loss"],
                          aux_loss_coeff=[0.3, 0.2])
    s_one, s_part = sy.GlobalAuxLossState(), sy.GlobalAuxLossState()
    for _ in range(2):
        z1 = z.clone().requires_grad_(True)
        w1, i1, info1 = syt.topk_route(z1, cfg, inputs=syt.RouteInputs(global_aux_loss_state=s_one))
        zp = z[b:e].clone().requires_grad_(True)
        wp, ip, infop = syt.topk_route(zp, cfg,
                                       inputs=syt.RouteInputs(global_aux_loss_state=s_part),
                                       comms=syt.RouteComms(loss=comm, global_aux_loss=comm))
        assert torch.equal(ip, i1[b:e]) and torch.equal(wp, w1[b:e])
        (w1 * gw).sum().backward()
        (wp * gw[b:e]).sum().backward()
        assert torch.equal(zp.grad, z1.grad[b:e]), "gradient rows differ"
        assert s_part.steps == s_one.steps
        assert torch.equal(s_part.num_tokens_per_expert, s_one.num_tokens_per_expert)
        total = sum_over(comm, infop.aux_loss)
        assert math.isclose(total, info1.aux_loss, rel_tol=1e-12), (total, info1.aux_loss)
    # TopKRouter passes its communicators through.
    r = syt.TopKRouter(8, cfg, loss_comm=comm, global_aux_loss_comm=comm)
    r(torch.randn(5, 8, generator=g))
    assert r.global_aux_loss_state.steps == 1
    # Expert-bias update with counts summed over the ranks: the same bias everywhere, equal to
    # one update on the summed counts.
    rb = syt.TopKRouter(8, sy.RouterConfig(num_experts=E, top_k=K, score_function="sigmoid"),
                        enable_expert_bias=True)
    x_all = torch.randn(8 * size, 8, generator=g)
    with torch.no_grad():
        rb.weight.normal_(generator=torch.Generator().manual_seed(3))
    total = torch.zeros(E, dtype=torch.float64)
    for r_ in range(size):
        _, idx_r = rb(x_all[8 * r_:8 * (r_ + 1)])
        total += torch.bincount(idx_r.flatten(), minlength=E).double()
        if r_ != rank:  # keep only this rank's own counts
            rb.local_tokens_per_expert -= torch.bincount(idx_r.flatten(), minlength=E).double()
    want = syt.update_expert_bias(rb.expert_bias.clone(), total, 1e-3)
    rb.update_expert_bias(1e-3, comm=comm)
    assert torch.equal(rb.expert_bias, want)
    check_qb_beta_over_ranks(comm, rank, size)
    # A bad argument on rank 0 raises on every rank (no rank left in a collective).
    bad = torch.zeros(4, E)
    if rank == 0:
        bad[1, 2] = float("nan")
    try:
        syt.topk_route(bad, cfg,
                       inputs=syt.RouteInputs(global_aux_loss_state=sy.GlobalAuxLossState()),
                       comms=syt.RouteComms(loss=comm))
        raise AssertionError(f"rank {rank}: no error")
    except ValueError as err:
        want = "[route] on rank 0: [route] logits must be finite"  # the same on every rank
        assert want in str(err), str(err)
    syt.topk_route(torch.zeros(4, E), cfg,
                   inputs=syt.RouteInputs(global_aux_loss_state=sy.GlobalAuxLossState()),
                   comms=syt.RouteComms(loss=comm))


def check_qb_beta_over_ranks(comm, rank, size):
    """Quantile balancing's global-batch update averaged over the ranks (Megatron's dp_cp mean of
    each rank's accum / count): rank r accumulates r + 1 micro-batches of its own data, so the
    mean of the per-rank means differs from the pooled mean. Every rank rebuilds every rank's
    accumulators, and the result must equal a double-precision reference on every rank and be
    bitwise the same everywhere; a bad ema on rank 0 raises on every rank."""
    H, E, K, T, ema = 8, 8, 2, 16, 0.25
    cfg = sy.RouterConfig(num_experts=E, top_k=K, aux_loss_type="quantile_balancing")
    beta0 = torch.randn(E, generator=torch.Generator().manual_seed(77)) * 0.05
    avgs = []
    mine = None
    for r_ in range(size):
        rt = syt.TopKRouter(H, cfg)
        with torch.no_grad():
            rt.weight.normal_(generator=torch.Generator().manual_seed(5))
            rt.qb_beta.copy_(beta0)
        gx = torch.Generator().manual_seed(1000 + r_)
        for _ in range(r_ + 1):
            rt(torch.randn(T, H, generator=gx) * 3)
        assert int(rt.qb_beta_count) == r_ + 1
        avgs.append(rt.qb_beta_accum.double() / (r_ + 1))
        if r_ == rank:
            mine = rt
    avg = sum(avgs) / size
    new = ema * beta0.double() + (1 - ema) * avg
    want = new - new.mean()
    mine.update_qb_beta(ema, comm=comm)
    torch.testing.assert_close(mine.qb_beta.double(), want, rtol=1e-6, atol=1e-7)
    assert int(mine.qb_beta_count) == 0 and not mine.qb_beta_accum.any()
    # Bitwise the same on every rank: the max and min of every element's bits agree.
    import struct
    bits = [struct.unpack("<i", struct.pack("<f", float(v)))[0] for v in mine.qb_beta]
    assert comm.allreduce_max(bits) == [-v for v in comm.allreduce_max([-b for b in bits])]
    try:
        syt_r = syt.TopKRouter(H, cfg)
        syt_r.update_qb_beta(2.0 if rank == 0 else ema, comm=comm)
        raise AssertionError(f"rank {rank}: no error")
    except ValueError as err:
        want_msg = "[update_qb_beta] on rank 0: [update_qb_beta] ema must be in [0, 1], got ema=2"
        assert want_msg in str(err), str(err)


def sum_over(comm, value):
    """Sum of a float over the ranks, added in rank order: each rank puts the float's bits in its
    own slot, the others hold INT64_MIN, and allreduce_max gathers every slot."""
    import struct
    slots = [-2**63] * comm.size
    slots[comm.rank] = struct.unpack("<q", struct.pack("<d", value))[0]
    return sum(struct.unpack("<d", struct.pack("<q", v))[0] for v in comm.allreduce_max(slots))


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001 - every rank reports its own failure, then all exit nonzero
        traceback.print_exc()
        sys.exit(1)
    print(f"mpi_router: rank {sy.dist.world().rank} ok")
