"""Cross-rank config mismatches in the comm-taking router APIs under mpirun (issue 22; registered in
ctest for -np 2 and -np 4): topk_route(comms=RouteComms(loss=..., global_aux_loss=...)),
update_expert_bias(comm=...) and update_qb_beta(comm=...) called with a num_experts, top_k,
sequence count or loss type that differs on the last rank must raise the same ValueError on EVERY
rank, naming the setting and both values; so must a check before the engine that fails on one
rank only (a Python check, a binding conversion). Before, rank 0 got BackendError MPI_ERR_TRUNCATE naming
no argument while rank 1 returned a wrong aux loss, or every rank hung. The watchdog
(SWITCHYARD_COLLECTIVE_TIMEOUT, set here before the communicator is made) turns a regression into
an error instead of a hang. Exit code 0 only when every rank saw every expected error.
Run: mpirun -np 2 --oversubscribe env PYTHONPATH=build/python python3 python/tests/mpi_hostile_agree.py
"""
import os
import sys

os.environ.setdefault("SWITCHYARD_COLLECTIVE_TIMEOUT", "30")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import expect_error, run_mpi_main  # noqa: E402

import switchyard as sy  # noqa: E402
import switchyard.torch as syt  # noqa: E402

torch.set_num_threads(1)



def logits(T, E):
    return (torch.arange(T * E, dtype=torch.float32).reshape(T, E) % 37) * 0.01


def route(E, K, aux, T=6, seq_length=None, loss_comm=None, global_aux_loss_comm=None):
    cfg = sy.RouterConfig(num_experts=E, top_k=K, aux_loss_type=aux, aux_loss_coeff=0.01)
    return syt.topk_route(logits(T, E), cfg,
                          syt.RouteInputs(global_aux_loss_state=sy.GlobalAuxLossState()),
                          syt.RouteOptions(seq_length=seq_length),
                          syt.RouteComms(loss=loss_comm, global_aux_loss=global_aux_loss_comm))


def main():
    comm = sy.dist.world()
    rank, size = comm.rank, comm.size
    last = size - 1
    on_last = rank == last
    disagree = "[route] loss_comm ranks disagree: "

    # num_experts differing: was MPI_ERR_TRUNCATE on rank 0, a wrong aux loss on rank 1.
    expect_error("num_experts", lambda: route(16 if on_last else 8, 2, "aux_loss", loss_comm=comm),
                 f"{disagree}num_experts=8 on rank 0, 16 on rank {last}")
    # top_k differing (both groups given).
    expect_error("top_k", lambda: route(8, 3 if on_last else 2, "aux_loss", loss_comm=comm,
                                        global_aux_loss_comm=comm),
                 f"{disagree}top_k=2 on rank 0, 3 on rank {last}")
    # A seq_length giving a different sequence count: 12 tokens as 2 or 3 sequences.
    expect_error("sequence count",
                 lambda: route(8, 2, "seq_aux_loss", T=12, seq_length=4 if on_last else 6,
                               loss_comm=comm),
                 f"{disagree}num_sequences (num_tokens / seq_length)=2 on rank 0, 3 on rank {last}")
    # An aux loss on some ranks only: every rank hung.
    expect_error("aux loss on some ranks", lambda: route(8, 2, "none" if on_last else "aux_loss",
                                                         loss_comm=comm),
                 f"{disagree}aux_loss=true on rank 0, false on rank {last}")
    # global_aux_loss on some ranks, aux_loss on the others: every rank hung.
    expect_error("global vs aux", lambda: route(8, 2, "aux_loss" if on_last else "global_aux_loss",
                                                loss_comm=comm, global_aux_loss_comm=comm),
                 f"{disagree}aux_loss=false on rank 0, true on rank {last}")
    # Only the global group given, the same mismatch: named after that group.
    expect_error("global group only",
                 lambda: route(16 if on_last else 8, 2, "global_aux_loss",
                               global_aux_loss_comm=comm),
                 "[route] global_aux_loss_comm ranks disagree: num_experts=8 on rank 0, 16 on "
                 f"rank {last}")
    # A local error on the last rank only: the same message everywhere, naming that rank.
    expect_error("local error", lambda: route(8, 2, "seq_aux_loss", T=12,
                                              seq_length=5 if on_last else 6, loss_comm=comm),
                 f"[route] on rank {last}: [route] seq_aux_loss needs seq_length >= 1 dividing "
                 "num_tokens=12, got seq_length=5")

    # A check before the engine (Python's, or the binding's conversions) failing on the last rank
    # only: it joins the agreement, so the other ranks raise too instead of waiting.
    expect_error("logits not a tensor",
                 lambda: syt.topk_route(logits(6, 8).tolist() if on_last else logits(6, 8),
                                        sy.RouterConfig(num_experts=8, top_k=2),
                                        comms=syt.RouteComms(loss=comm)),
                 f"[route] on rank {last}: [topk_route] logits must be a torch.Tensor")
    expect_error("expert_bias not a tensor",
                 lambda: syt.topk_route(logits(6, 8), sy.RouterConfig(num_experts=8, top_k=2),
                                        inputs=syt.RouteInputs(
                                            expert_bias=[0.0] * 8 if on_last else torch.zeros(8)),
                                        comms=syt.RouteComms(loss=comm)),
                 f"[route] on rank {last}: [topk_route] expert_bias")
    expect_error("counts not a tensor",
                 lambda: syt.update_expert_bias(
                     torch.zeros(8), [0] * 8 if on_last else torch.zeros(8, dtype=torch.int64),
                     1e-3, comm=comm),
                 f"[update_expert_bias] on rank {last}: [update_expert_bias] num_tokens_per_expert")

    # The expert-bias and quantile-balancing updates.
    E = 16 if on_last else 8
    expect_error("update_expert_bias",
                 lambda: syt.update_expert_bias(torch.zeros(E), torch.zeros(E, dtype=torch.int64),
                                                1e-3, comm=comm),
                 "[update_expert_bias] comm ranks disagree: num_experts=8 on rank 0, 16 on rank "
                 f"{last}")
    expect_error("update_qb_beta",
                 lambda: syt.TopKRouter(4, sy.RouterConfig(
                     num_experts=E, top_k=2, aux_loss_type="quantile_balancing")).update_qb_beta(
                         0.5, comm=comm),
                 f"[update_qb_beta] comm ranks disagree: num_experts=8 on rank 0, 16 on rank {last}")

    # Still in step: the same call everywhere works. With the same tokens on every rank the counts
    # and token totals are size times the local ones and the score sums stay local, so the aux loss
    # is the local one / size (up to the rounding of a few double operations).
    _, _, info = route(8, 2, "aux_loss", loss_comm=comm, global_aux_loss_comm=comm)
    _, _, local = route(8, 2, "aux_loss")
    want = local.aux_loss / size
    assert abs(info.aux_loss - want) <= 1e-12 * abs(want), (info.aux_loss, want)
    comm.barrier()
    if rank == 0:
        print(f"mpi_hostile_agree: {size} ranks, all checks passed")


if __name__ == "__main__":
    run_mpi_main(main)
