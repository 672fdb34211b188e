"""The HF and Megatron adapters over the one replay core (issue 23 item 1): a failed step leaves no
layer holding that step's ids -- neither an untaken target (Megatron had no step rule at all) nor a
table queued for the checkpoint recompute (HF and Megatron kept it, so the retry's backward
recomputed with the failed batch's ids)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import switchyard.integrations.hf as syhf  # noqa: E402
from hf_models import build, tokens  # noqa: E402
from test_hostile_hf import _fails_once  # noqa: E402

try:  # Megatron's TopKRouter factory (a fixture); the Megatron test skips without megatron-core
    from test_router_megatron_parity import mcore  # noqa: E402,F401
except (ImportError, pytest.skip.Exception):
    mcore = None


def _const(p, T, ids):
    return torch.tensor(ids, dtype=torch.int32).expand(T, len(p.layers), p.top_k).clone()


@pytest.mark.hostile(tried="HF with gradient checkpointing: a training forward fails in layer 1 "
                           "after layer 0 queued its ids for the recompute; set_targets again, "
                           "retry, backward",
                     gets="the failed step's recompute tables are dropped: the backward "
                          "recomputes with the retry's ids (gradients equal a clean step's)")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_hf_failed_step_drops_its_recompute_tables(reentrant):
    model = build("olmoe")
    model.train()
    p = syhf.patch(model)
    ids = tokens(1, 6, seed=3)
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": reentrant})

    def step():
        model.zero_grad(set_to_none=True)
        p.set_targets(_const(p, 6, [2, 3]))
        model(ids, labels=ids).loss.backward()
        return {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}

    ref = step()
    p.set_targets(_const(p, 6, [0, 1]))
    _fails_once(model.model.layers[1].self_attn)
    with pytest.raises(RuntimeError, match="injected failure"):
        model(ids, labels=ids)
    assert all(r.num_targets == 0 and r.num_pending_recompute == 0
               for r in p.replays.values())
    got = step()
    assert all(r.num_pending_recompute == 0 for r in p.replays.values())
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    p.unpatch()


@pytest.fixture
def two_routers(request):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    make = request.getfixturevalue("mcore")

    class Two(torch.nn.Module):
        """Two Megatron routers (layers 1 and 2) run in one forward, like two MoE layers."""

        def __init__(self):
            super().__init__()
            self.r1 = make(16, num_moe_experts=8, moe_router_topk=2)
            self.r2 = make(16, num_moe_experts=8, moe_router_topk=2)
            self.r2.set_layer_number(2)
            self.mid = torch.nn.Identity()

        def forward(self, x):
            a = self.r1(x)
            return a, self.r2(self.mid(x))
    return Two()


@pytest.mark.hostile(tried="Megatron: a forward fails between MoE layers 1 and 2; "
                           "set_replay_targets again and retry",
                     gets="layer 2 dropped the failed step's target: the retry replays its own "
                          "ids in both layers")
def test_megatron_failed_step_leaves_no_layer_the_old_ids(two_routers):
    from switchyard.integrations import megatron as sym
    m = two_routers
    old = torch.tensor([[0, 1]] * 6, dtype=torch.int32)
    new = torch.tensor([[4, 5]] * 6, dtype=torch.int32)
    x = torch.randn(6, 1, 16, generator=torch.Generator().manual_seed(0))
    with sym.patched():
        sym.attach_replay(m)
        sym.set_replay_action(m, "replay_forward")
        sym.set_replay_targets(m, {1: old, 2: old})
        _fails_once(m.mid)
        with pytest.raises(RuntimeError, match="injected failure"):
            m(x)
        assert all(r.num_targets == 0 for r in sym.replays(m).values())
        sym.set_replay_targets(m, {1: new, 2: new})
        (_, map1), (_, map2) = m(x)
        sym.detach_replay(m)
    want = torch.zeros(6, 8, dtype=torch.bool)
    want[:, 4:6] = True
    assert torch.equal(map1, want) and torch.equal(map2, want)
