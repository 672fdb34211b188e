"""Hostile use of the distributed pieces in one process (issue 22): a dispatcher over a huge number
of experts, a Megatron replay table of the wrong length. The cross-rank cases are in
mpi_hostile_agree.py (under mpirun)."""
import subprocess
import sys
import textwrap

import pytest

E_HUGE = 2**24
MIB = 1024 * 1024

# One dispatch + combine of 4 tokens at E = 2^24 in a fresh process (so the peak is this call's):
# the peak-RSS growth in MiB.
_DISPATCH_PEAK = textwrap.dedent(f"""
    import resource
    import torch
    import switchyard.torch as syt
    torch.set_num_threads(1)
    E = {E_HUGE}
    d = syt.AlltoAllDispatcher(num_experts=E)
    x = torch.randn(4, 8)
    idx = torch.tensor([[0, E - 1], [5, E // 2], [E - 3, 1], [7, 9]])
    w = torch.rand(4, 2)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rx, rw, h = d.dispatch(x, w, idx)
    y = d.combine(rx, h)
    assert torch.allclose(y, x * w.sum(1, keepdim=True))
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
""")


@pytest.mark.hostile(tried="AlltoAllDispatcher(num_experts=2**24) dispatching 4 tokens",
                     gets="the O(E) count exchange and the handle's per-expert arrays only: "
                          "~0.6 GiB peak growth (was 1.5-3 GB and 262k page faults per call)")
def test_dispatch_memory_does_not_grow_beyond_the_count_exchange_with_huge_num_experts():
    # What a dispatch at E experts must hold, one int64 per expert each: the plan's counts and
    # offsets, the exchanged count matrix, the handle's per-local-expert counts and offsets (one
    # rank: L = E). 8 such arrays is the bound; the old dispatch also staged the counts, copied
    # the matrix, and built a table of every rank's receive layout three times per call.
    out = subprocess.run([sys.executable, "-c", _DISPATCH_PEAK], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    grew_mib = float(out.stdout.strip().splitlines()[-1])
    bound_mib = 8 * E_HUGE * 8 / MIB
    assert grew_mib < bound_mib, f"peak RSS grew {grew_mib:.0f} MiB (bound {bound_mib:.0f} MiB)"
