"""One replay contract, three paths (issue 23): the same behaviours, parametrised over

  engine    switchyard.RouterReplay driving switchyard.torch.TopKRouter (topk_route), two layers;
  hf        switchyard.integrations.hf.patch on a tiny OLMoE (python/tests/hf_models.py), two MoE
            layers;
  megatron  switchyard.integrations.megatron.apply + attach_replay on two Megatron-Core
            TopKRouters (layer numbers 1 and 2, one-rank gloo group, EP 1); at EP 2, real MoE
            layers on two spawned gloo ranks (replay_conformance_workers.py: merged rows against
            EP 1, an error mid-step then a retry),

each through its PUBLIC API: record -> replay (R2), targets with -1 and invalid rows (R3) and the
replayed / native / invalid counts, the activation-checkpoint recompute, an error mid-step then a
retry with new targets (no layer may keep the failed batch's ids), a rejected step then a retry,
and the gradients against a float64 reference (native rows, -1 rows, and partially repeated rows
under the merge policy).

Every path runs on the one replay core (switchyard.replay: the engine's row rule, the
all-or-nothing ReplayDriver, one invalid-row policy error / native / merge on every path). Integers are compared exactly; gradients within a bound derived from the
fp32 computation (see _grad_tolerance)."""
import pytest
import torch

import switchyard as sy
import switchyard.torch as syt

E, K, T = 8, 3, 6  # K = 3: a partially repeated row [a, a, c] has a weight that moves
U32 = 2.0**-24


def _sorted(ids):
    return ids.to(torch.int64).sort(dim=-1).values


def _map(ids):
    """[T, K] ids (values outside [0, E) ignored) -> [T, E] bool: the experts each row is sent to."""
    ok = (ids >= 0) & (ids < E)
    return torch.zeros(ids.shape[0], E + 1, dtype=torch.bool).scatter(
        1, torch.where(ok, ids.to(torch.int64), E), True)[:, :E]


def _targets(seed, rows_minus1=(), rows_invalid=(), rows_repeated=()):
    """[T, 2, K] int32 replay targets: distinct random ids, some rows all -1, some mixing -1 and
    an id (invalid), some repeating an id (invalid unless merged)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
                     for _ in range(2)], dim=1).to(torch.int32)
    for r in rows_minus1:
        t[r] = -1
    for r in rows_invalid:
        t[r, :, 1] = -1
    for r in rows_repeated:
        t[r, :, 1] = t[r, :, 0]
    return t


# --------------------------------------------------------------------------------------------------
# The three paths behind one interface
# --------------------------------------------------------------------------------------------------
class _HiddenPath:
    """Paths whose routers take hidden states directly (engine, Megatron)."""

    def hidden(self, seed):
        return self.inputs(seed)

    def recompute_grads(self, targets, checkpointed):
        """Router weight and input gradients of one replayed step; with ``checkpointed`` the
        routers run under an activation checkpoint and are recomputed inside backward."""
        g = torch.Generator().manual_seed(5)
        x = self.hidden(4).requires_grad_(True)
        G = torch.randn(2, T, E, generator=g)
        for w in self.router_weights():
            w.grad = None
        self.set_targets(targets)
        if checkpointed:
            self.checkpointed_loss_backward(x, G)
        else:
            (torch.stack([d for d, _ in self.dense_and_ids(x)]) * G).sum().backward()
        return [w.grad.clone() for w in self.router_weights()] + [x.grad.clone()]


class _Engine(_HiddenPath):
    """Two switchyard TopKRouters (layers 1, 2) over the same hidden states, each with its own
    RouterReplay; a step's targets are queued with RouterReplay.set_step_targets."""
    name = "engine"
    H = 16

    def __init__(self, policy="error"):
        g = torch.Generator().manual_seed(3)
        cfg = sy.RouterConfig(num_experts=E, top_k=K)
        self.routers = [syt.TopKRouter(self.H, cfg, layer_number=n) for n in (1, 2)]
        with torch.no_grad():
            for r in self.routers:
                r.weight.copy_(torch.randn(E, self.H, generator=g) * 0.5)
        self.replays = [sy.RouterReplay(K, layer=n, invalid_replay_rows=policy) for n in (1, 2)]
        self._fail = None
        self._counts = []

    def inputs(self, seed):
        return torch.randn(T, self.H, generator=torch.Generator().manual_seed(seed))

    def set_action(self, action):
        for r in self.replays:
            r.action = action

    def set_targets(self, table):
        sy.RouterReplay.set_step_targets(self.replays, [table[:, m] for m in range(2)])
        self.set_action("replay_forward")

    def fail_once_before_layer(self, m):
        self._fail = m

    def _route(self, x):
        """-> [(dense [T, E] weights, ids [T, K]) per layer]."""
        out = []
        self._counts = []
        for m, (r, rep) in enumerate(zip(self.routers, self.replays)):
            if self._fail == m:
                self._fail = None
                raise RuntimeError("injected failure")
            w, idx = r(x, rep)
            out.append((torch.zeros(T, E, dtype=w.dtype).scatter_add(1, idx, w), idx))
            i = r.last_info
            self._counts.append((i.num_replayed_rows, i.num_native_rows,
                                 i.num_invalid_replay_rows))
        return out

    def forward(self, x):
        with torch.no_grad():
            return torch.stack([_sorted(ids) for _, ids in self._route(x)], dim=1)

    def counts(self):
        return self._counts

    def negate_routers(self):
        with torch.no_grad():
            for r in self.routers:
                r.weight.neg_()

    def router_weights(self):
        return [r.weight for r in self.routers]

    def dense_and_ids(self, x):
        return self._route(x)

    def checkpointed_loss_backward(self, x, G):
        """Both routers under torch.utils.checkpoint (non-reentrant); the recompute replays the
        queued ids with action "recompute" (the engine path's documented way)."""
        def fn(x):
            return torch.stack([d for d, _ in self._route(x)])
        dense = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)
        self.set_action("recompute")
        (dense * G).sum().backward()

    def pending(self):
        return [r.num_pending_recompute for r in self.replays]

    @staticmethod
    def weights64(z, ids, router):
        # topk_route's softmax (Megatron's default, pre_softmax=False): over the K selected logits.
        return torch.softmax(z.gather(1, ids), dim=-1)

    def close(self):
        pass


class _HF:
    """A tiny OLMoE (2 MoE layers) patched with router_dtype=fp32; its routers are called directly
    for the gradient cases, the whole model for the others (B=1, S=T)."""
    name = "hf"

    def __init__(self, policy="error"):
        pytest.importorskip("transformers")
        import switchyard.integrations.hf as syhf
        from hf_models import build
        self.model = build("olmoe", num_experts_per_tok=K)
        self.p = syhf.patch(self.model, invalid_replay_rows=policy)
        self.routers = [self.model.get_submodule(self.p.modules[l]) for l in self.p.layers]
        self.H = self.model.config.hidden_size

    def inputs(self, seed):
        from hf_models import tokens
        return tokens(1, T, seed=seed)

    def set_action(self, action):
        self.p.set_action(action)

    def set_targets(self, table):
        self.p.set_targets(table)

    def fail_once_before_layer(self, m):
        attn = self.model.model.layers[self.p.layers[m]].self_attn

        def hook(mod, args):
            h.remove()
            raise RuntimeError("injected failure")
        h = attn.register_forward_pre_hook(hook)

    def forward(self, ids):
        self.p.reset_counts()
        with self.p.capture() as cap, torch.no_grad():
            self.model(ids)
        return _sorted(cap.ids()[0][:, self.p.layers])

    def counts(self):
        return [(c["num_replayed_rows"], c["num_native_rows"], c["num_invalid_replay_rows"])
                for c in self.p.counts().values()]

    def negate_routers(self):
        with torch.no_grad():
            for r in self.routers:
                r.weight.neg_()

    def router_weights(self):
        return [r.weight for r in self.routers]

    def dense_and_ids(self, x):
        self.p.reset_counts()
        out = []
        for r in self.routers:
            _, w, idx = r(x)
            out.append((torch.zeros(T, E, dtype=w.dtype).scatter_add(1, idx, w.float()), idx))
        return out

    def hidden(self, seed):
        return torch.randn(T, self.H, generator=torch.Generator().manual_seed(seed))

    def recompute_grads(self, targets, checkpointed):
        """Router weight gradients of one replayed training step of the whole model; with
        ``checkpointed`` under activation checkpointing (non-reentrant), whose recompute the
        adapter detects."""
        from hf_models import tokens
        model = self.model
        model.train()
        model.zero_grad(set_to_none=True)
        if checkpointed:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        try:
            self.set_targets(targets)
            ids = tokens(1, T, seed=4)
            model(ids, labels=ids).loss.backward()
        finally:
            if checkpointed:
                model.activation_checkpointing_disable()
            model.eval()
        return [w.grad.clone() for w in self.router_weights()]

    def pending(self):
        return [r.num_pending_recompute for r in self.p.replays.values()]

    @staticmethod
    def weights64(z, ids, router):
        # OLMoE: softmax over all experts, the probabilities at the ids (renormalised if set).
        w = torch.softmax(z, dim=-1).gather(1, ids)
        if getattr(router, "norm_topk_prob", False):
            w = w / w.sum(dim=-1, keepdim=True)
        return w

    def close(self):
        self.p.unpatch()


class _Megatron(_HiddenPath):
    """Two Megatron-Core TopKRouters (layer numbers 1 and 2) in one module, switchyard's replay
    attached (apply + attach_replay); one-rank gloo group, EP 1."""
    name = "megatron"
    H = 16

    def __init__(self, policy="error"):
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
        import torch.distributed as dist

        import switchyard.integrations.megatron as sym
        from helpers import single_rank_gloo
        single_rank_gloo()
        self._saved = torch.cuda.current_device  # router buffers: the current device = the CPU
        torch.cuda.current_device = lambda: "cpu"
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.transformer_config import TransformerConfig
        destroy_moe_metrics_tracker()
        W = dist.group.WORLD
        pg = ProcessGroupCollection(tp=W, cp=W, tp_cp=W, tp_dp_cp=W, dp=W, ep=W)
        cfg = TransformerConfig(num_layers=2, hidden_size=self.H, num_attention_heads=1,
                                params_dtype=torch.float32, moe_router_dtype="fp32",
                                add_bias_linear=False, num_moe_experts=E, moe_router_topk=K,
                                moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0)
        g = torch.Generator().manual_seed(3)
        routers = []
        for n in (1, 2):
            r = TopKRouter(cfg, pg_collection=pg)
            r.set_layer_number(n)
            with torch.no_grad():
                r.weight.copy_(torch.randn(E, self.H, generator=g) * 0.5)
            routers.append(r)
        self.model = torch.nn.ModuleList(routers)
        self.sym = sym
        self._cm = sym.patched()
        self._cm.__enter__()
        sym.attach_replay(self.model, invalid_replay_rows=policy)

    @property
    def routers(self):
        return list(self.model)

    def inputs(self, seed):
        return torch.randn(T, 1, self.H, generator=torch.Generator().manual_seed(seed))

    def set_action(self, action):
        self.sym.set_replay_action(self.model, action)

    def set_targets(self, table):
        self.sym.set_replay_targets(self.model, {1: table[:, 0], 2: table[:, 1]})
        self.set_action("replay_forward")

    def fail_once_before_layer(self, m):
        def hook(mod, args):
            h.remove()
            raise RuntimeError("injected failure")
        h = self.model[m].register_forward_pre_hook(hook)

    def _route(self, x):
        out = []
        for r in self.model:
            probs, rmap = r(x)
            ids = torch.where(rmap, torch.arange(E), E).sort(dim=1).values[:, :K]
            out.append((probs, ids))
        return out

    def forward(self, x):
        with torch.no_grad():
            return torch.stack([ids for _, ids in self._route(x)], dim=1)

    def counts(self):
        c = self.sym.replay_counts(self.model)
        return [(c[n].replayed, c[n].native, c[n].invalid) for n in (1, 2)]

    def negate_routers(self):
        with torch.no_grad():
            for r in self.model:
                r.weight.neg_()

    def router_weights(self):
        return [r.weight for r in self.model]

    def dense_and_ids(self, x):
        return self._route(x)

    def checkpointed_loss_backward(self, x, G):
        """Both routers under a reentrant checkpoint (Megatron's own kind); the adapter detects
        the recompute."""
        dense = torch.utils.checkpoint.checkpoint(
            lambda x: torch.stack([d for d, _ in self._route(x)]), x, use_reentrant=True)
        (dense * G).sum().backward()

    def pending(self):
        return [r.num_pending_recompute for r in self.sym.replays(self.model).values()]

    @staticmethod
    def weights64(z, ids, router):
        # Megatron's softmax top-k (pre_softmax=False): softmax over the K slots' logits; a
        # repeated id keeps its slots, merged by adding their weights at the expert.
        return torch.softmax(z.gather(1, ids), dim=-1)

    def close(self):
        self.sym.detach_replay(self.model)
        self._cm.__exit__(None, None, None)
        torch.cuda.current_device = self._saved


PATHS = ["engine", "hf", "megatron"]
_MAKE = {"engine": _Engine, "hf": _HF, "megatron": _Megatron}


@pytest.fixture
def make():
    made = []

    def build(name, policy="error"):
        made.append(_MAKE[name](policy))
        return made[-1]
    yield build
    for m in made:
        m.close()


# --------------------------------------------------------------------------------------------------
# record -> replay (R2)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_record_then_replay_routes_with_the_recorded_ids(make, path):
    m = make(path)
    x = m.inputs(1)
    m.set_action("record")
    recorded = m.forward(x)
    assert m.counts() == [(0, T, 0)] * 2
    m.negate_routers()  # native routing would now pick other experts
    m.set_action(None)
    assert not torch.equal(m.forward(x), recorded)
    m.set_action("replay_forward")
    assert torch.equal(m.forward(x), recorded)
    assert m.counts() == [(T, 0, 0)] * 2


# --------------------------------------------------------------------------------------------------
# targets (R3): -1 rows routed natively, invalid rows by policy, the counts
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_targets_replay_valid_rows_and_route_minus1_rows_natively(make, path):
    m = make(path)
    x = m.inputs(2)
    m.set_action(None)
    native = m.forward(x)
    t = _targets(20, rows_minus1=(1, 4))
    m.set_targets(t)
    used = m.forward(x)
    rep = torch.ones(T, dtype=torch.bool)
    rep[[1, 4]] = False
    assert torch.equal(used[rep], _sorted(t)[rep])
    assert torch.equal(used[~rep], native[~rep])
    assert m.counts() == [(T - 2, 2, 0)] * 2


@pytest.mark.parametrize("path", PATHS)
def test_invalid_rows_under_the_native_policy_route_natively_and_are_counted(make, path):
    m = make(path, policy="native")
    x = m.inputs(3)
    m.set_action(None)
    native = m.forward(x)
    t = _targets(21, rows_minus1=(0,), rows_invalid=(2,), rows_repeated=(5,))
    m.set_targets(t)
    used = m.forward(x)
    rep = torch.tensor([False, True, False, True, True, False])
    assert torch.equal(used[rep], _sorted(t)[rep])
    assert torch.equal(used[~rep], native[~rep])
    assert m.counts() == [(T - 3, 3, 2)] * 2


# --------------------------------------------------------------------------------------------------
# the activation-checkpoint recompute
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_checkpoint_recompute_replays_the_forward_ids(make, path):
    """The recompute inside backward routes with the ids its forward replayed (not the live
    top-k, which the targets differ from): the gradients are those of the same step without
    checkpointing, and no table is left queued."""
    m = make(path)
    t = _targets(22, rows_minus1=(3,))
    got = m.recompute_grads(t, checkpointed=True)
    assert m.pending() == [0, 0]
    ref = m.recompute_grads(t, checkpointed=False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The targets are not the native routes: a recompute that routed natively would differ.
    m.set_action(None)
    with torch.no_grad():
        native = torch.stack([_sorted(ids) for _, ids in m.dense_and_ids(m.hidden(4))], dim=1)
    assert not torch.equal(native, _sorted(t))


@pytest.mark.parametrize("path", PATHS)
def test_a_replayed_step_without_recompute_leaves_nothing_queued(make, path):
    """A replayed forward and backward without activation checkpointing queues no table for a
    recompute that will never come (the engine path's replay_forward queues one every time)."""
    m = make(path)
    m.recompute_grads(_targets(29), checkpointed=False)
    assert m.pending() == [0, 0]


# --------------------------------------------------------------------------------------------------
# an error mid-step, then a retry with new targets
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_error_mid_step_then_retry_replays_the_new_targets_in_every_layer(make, path):
    m = make(path)
    x = m.inputs(6)
    old, new = _targets(23), _targets(24)
    m.set_targets(old)
    m.fail_once_before_layer(1)
    with pytest.raises(RuntimeError, match="injected failure"):
        m.forward(x)
    m.set_targets(new)
    assert torch.equal(m.forward(x), _sorted(new))
    assert m.counts() == [(T, 0, 0)] * 2


@pytest.mark.parametrize("path", PATHS)
def test_rejected_step_then_retry_replays_the_new_targets_in_every_layer(make, path):
    m = make(path)
    x = m.inputs(7)
    bad, new = _targets(25), _targets(26)
    bad[2, 1, 1] = -1  # layer 1, token 2: mixes an id and -1
    with pytest.raises(ValueError, match=r"token 2"):
        m.set_targets(bad)
        m.forward(x)
    m.set_targets(new)
    assert torch.equal(m.forward(x), _sorted(new))
    assert m.counts() == [(T, 0, 0)] * 2


# --------------------------------------------------------------------------------------------------
# gradients against float64
# --------------------------------------------------------------------------------------------------
def _grad_tolerance(x64, w64, gz, G):
    """|fp32 gradient - float64 gradient| bound: the fp32 gate's logits are within
    b = 2 H u sum|x w| (+ a few ulps) of the exact ones, the weights are smooth in the logits
    (second derivative <= 4), so dL/dlogits moves by at most |G|max (8 b + 64 u); the fp32
    backward GEMMs add n u sum|a||b| (as test_replay_parity_fixes derives it)."""
    H = x64.shape[1]
    dots = x64.abs() @ w64.abs().t()
    b = 2 * H * U32 * float(dots.max()) + 8 * U32 * float((x64 @ w64.t()).abs().max())
    eps_g = float(G.abs().max()) * (8 * b + 64 * U32)
    tol_x = eps_g * w64.abs().sum(0) + E * U32 * (gz.abs() @ w64.abs())
    tol_w = eps_g * x64.abs().sum(0) + T * U32 * (gz.abs().t() @ x64.abs())
    return tol_x, tol_w


def _check_gradients(m, targets, seed):
    g = torch.Generator().manual_seed(seed)
    x = m.hidden(seed)
    G = torch.randn(2, T, E, generator=g)
    for w in m.router_weights():
        w.grad = None
    xg = x.clone().requires_grad_(True)
    m.set_targets(targets)
    out = m.dense_and_ids(xg)
    (torch.stack([d.float() for d, _ in out]) * G).sum().backward()
    gx64 = torch.zeros(T, m.H, dtype=torch.float64)
    x64 = x.reshape(T, m.H).double()
    for layer, ((dense, ids), w, router) in enumerate(zip(out, m.router_weights(), m.routers)):
        minus1 = (targets[:, layer] < 0).all(dim=1)
        # Replayed rows use the targets as given; -1 rows the native top-k of the live logits.
        assert torch.equal(_map(ids)[~minus1], _map(targets[:, layer])[~minus1])
        w64 = w.detach().double()
        z64 = (x64 @ w64.t()).requires_grad_(True)
        used = torch.where(minus1[:, None], torch.topk(z64.detach(), K, dim=-1)[1],
                           targets[:, layer].to(torch.int64))
        dense64 = torch.zeros(T, E, dtype=torch.float64).scatter_add(
            1, used, m.weights64(z64, used, router))
        torch.testing.assert_close(dense.detach().double(), dense64.detach(), rtol=0, atol=1e-5)
        (dense64 * G[layer].double()).sum().backward()
        gz = z64.grad
        tol_x, tol_w = _grad_tolerance(x64, w64, gz, G[layer])
        err_w = (w.grad.double() - gz.t() @ x64).abs()
        assert bool((err_w <= tol_w).all()), f"layer {layer}: router weight grad off by " \
                                             f"{float(err_w.max()):.3g}"
        gx64 += gz @ w64
        tol_x_sum = tol_x if layer == 0 else tol_x_sum + tol_x
    err_x = (xg.grad.reshape(T, m.H).double() - gx64).abs()
    assert bool((err_x <= tol_x_sum).all()), f"input grad off by {float(err_x.max()):.3g}"


@pytest.mark.parametrize("path", PATHS)
def test_gradients_of_replayed_native_and_minus1_rows_match_float64(make, path):
    m = make(path)
    _check_gradients(m, _targets(27, rows_minus1=(0, 3)), seed=8)


@pytest.mark.parametrize("path", PATHS)
def test_gradients_of_merged_repeated_rows_match_float64(make, path):
    """Rows that repeat an id under the merge policy: the pair is sent once with the summed
    weight, and the gradient is the derivative of that sum (Megatron since the merge fix; the
    engine and HF paths have no merge policy until the replay driver's error / native / merge)."""
    m = make(path, policy="merge")
    t = _targets(28, rows_minus1=(4,), rows_repeated=(1, 2))
    _check_gradients(m, t, seed=9)
    assert m.counts() == [(T - 1, 1, 0)] * 2


# --------------------------------------------------------------------------------------------------
# Megatron at EP 2: real MoE layers (alltoall dispatcher) on two gloo ranks, one process start for
# both cases (python/tests/replay_conformance_workers.py)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import replay_conformance_workers as rw
    res = rw.spawn(["merge_grad", "mid_step"], 2, str(tmp_path_factory.mktemp("conformance_ep2")))
    for rank, per_case in enumerate(res):
        for case, r in per_case.items():
            assert "worker_error" not in r, f"rank {rank}, case {case}:\n{r['worker_error']}"
    return res


def test_megatron_ep2_merged_rows_match_ep1(ep2):
    """Partially repeated rows under merge, a -1 row, K = 3: the EP 2 layer's outputs, input and
    router weight gradients are the EP 1 layer's (whose router gradients the float64 test above
    checks); atol 1e-6, rtol 1e-5 as test_megatron (the experts' CPU GEMMs see different row
    counts at EP 1 and 2)."""
    for r in (rank["merge_grad"] for rank in ep2):
        assert r["ep_counts"] == r["ref_counts"] == (11, 3, 1, 0)
        for k in ("out", "xgrad", "wgrad"):
            torch.testing.assert_close(r[f"ep_{k}"], r[f"ref_{k}"], atol=1e-6, rtol=1e-5)


def test_megatron_ep2_error_mid_step_then_retry_replays_the_new_targets_in_every_layer(ep2):
    for r in (rank["mid_step"] for rank in ep2):
        assert r["error"] == "injected failure"
        for n, rmap in zip((1, 2), r["retry_maps"]):
            assert torch.equal(rmap, _map(r["new"][n])), f"layer {n} replayed other ids"
