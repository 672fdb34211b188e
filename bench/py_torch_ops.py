"""Per-call cost of switchyard's torch.library operators against the torch.autograd.Function path
they replaced (the same engine kernels, called through pybind either way), and a small MoE layer
built from them (TopKRouter -> permute -> per-expert MLP -> unpermute), forward + backward, eager
and compiled (torch.compile(fullgraph=True)), against the same layer with torch's own routing
(softmax + topk + index_select / index_add). Measured round-robin in one run; prints the CPU model,
the best time of each and the ratios.

    PYTHONPATH=build/python python bench/py_torch_ops.py [--quick] [--threads N]
        [--tokens 512] [--hidden 256] [--experts 8] [--top-k 2] [--backend inductor]

The patched vs unpatched transformers model (eager and compiled) is bench/py_compile_overhead.py.
"""
import argparse
import os
import sys
import time

_threads = next((a.split("=", 1)[1] if "=" in a else sys.argv[i + 2]
                 for i, a in enumerate(sys.argv[1:]) if a.startswith("--threads")), "1")
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _threads

import torch  # noqa: E402

import switchyard as sy  # noqa: E402
import switchyard.torch as syt  # noqa: E402
from bench_machine import machine_line  # noqa: E402


def best_of(fn, rounds):
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def per_call(args):
    """The route, permute and unpermute (forward + backward) through the operator and through the
    autograd.Function over the engine's saved RouteResult / RoutingPlan object."""
    T, E, K, H = args.tokens, args.experts, args.top_k, args.hidden
    cfg = sy.RouterConfig(num_experts=E, top_k=K, aux_loss_type="aux_loss", aux_loss_coeff=0.01)
    logits = torch.randn(T, E, requires_grad=True)
    g = torch.randn(T, K)

    def route_op():  # the operator (traced forwards; eager topk_route takes the Function)
        w, _, info = syt._topk_route(logits, cfg, None, None, None, operator=True)
        w.backward(g)
        return info.aux_loss

    def route_fn():
        box = []
        w, _ = syt._TopKRoute.apply(logits, cfg, None, None, None, None, "error", -1, 0, 1.0,
                                    False, (0, 0, True, None, None), None, box)
        w.backward(g)
        return syt.RouteInfo(box[0]).aux_loss

    w, idx, _ = syt.topk_route(logits.detach(), cfg)
    plan = syt.routing_plan(idx, w, E)
    x = torch.randn(T, H, requires_grad=True)
    wt = w.clone().requires_grad_()
    from switchyard import _switchyard as C

    def perm_op():
        y = syt.permute(x, plan)
        out = syt.unpermute(y, plan, wt)
        out.sum().backward()

    class _P(torch.autograd.Function):  # the replaced Function, as it was
        @staticmethod
        def forward(ctx, x):
            return C.permute(x.detach(), plan)

        @staticmethod
        def backward(ctx, gy):
            return C.permute_backward(gy.contiguous(), plan)

    class _U(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p, w):
            ctx.save_for_backward(p)
            return C.unpermute(p.detach(), plan, True)

        @staticmethod
        def backward(ctx, gy):
            (p,) = ctx.saved_tensors
            gp, gw = C.unpermute_backward(gy.contiguous(), p.detach(), plan, True)
            return gp, gw

    def perm_fn():
        out = _U.apply(_P.apply(x), wt)
        out.sum().backward()

    rows = []
    for name, a, b in (("topk_route fwd+bwd", route_op, route_fn),
                       ("permute+unpermute fwd+bwd", perm_op, perm_fn)):
        ta, tb = [], []
        for _ in range(3):  # round-robin
            ta.append(best_of(a, args.rounds))
            tb.append(best_of(b, args.rounds))
        rows.append((name, min(ta), min(tb)))
    print(f"\nper call, T {T}, E {E}, K {K}, H {H}: operator vs autograd.Function (best of "
          f"{args.rounds} x 3)")
    for name, ta, tb in rows:
        print(f"  {name:28s} op {ta * 1e6:9.1f} us   Function {tb * 1e6:9.1f} us   "
              f"op/Function {ta / tb:5.2f}")


class SyMoE(torch.nn.Module):
    def __init__(self, H, E, K, F):
        super().__init__()
        self.E = E
        self.router = syt.TopKRouter(H, sy.RouterConfig(num_experts=E, top_k=K))
        self.w1 = torch.nn.Parameter(torch.randn(E, H, F) * H ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(E, F, H) * F ** -0.5)

    def forward(self, x):
        w, idx = self.router(x)
        # Per-expert MLP over each token's K slots (dense over slots: no data-dependent sizes).
        h = torch.einsum("th,tkhf->tkf", x, self.w1[idx.clamp(min=0)])
        y = torch.einsum("tkf,tkfh->tkh", torch.relu(h), self.w2[idx.clamp(min=0)])
        return (y * w.unsqueeze(-1).to(y.dtype)).sum(1)


class TorchMoE(SyMoE):
    def forward(self, x):
        logits = x @ self.router.weight.t()
        w, idx = torch.softmax(logits.float(), -1).topk(self.router.config.top_k, -1)
        h = torch.einsum("th,tkhf->tkf", x, self.w1[idx])
        y = torch.einsum("tkf,tkfh->tkh", torch.relu(h), self.w2[idx])
        return (y * w.unsqueeze(-1).to(y.dtype)).sum(1)


def moe(args):
    T, E, K, H = args.tokens, args.experts, args.top_k, args.hidden
    x = torch.randn(T, H, requires_grad=True)
    fns = {}
    for name, cls in (("torch routing", TorchMoE), ("switchyard ops", SyMoE)):
        torch.manual_seed(0)
        m = cls(H, E, K, H // 2)
        fns[(name, "eager")] = m
        fns[(name, "compiled")] = torch.compile(m, fullgraph=True, backend=args.backend)
    times = {k: float("inf") for k in fns}
    for k, f in fns.items():
        f(x).sum().backward()  # compile outside the timing
    for _ in range(3):
        for k, f in fns.items():
            times[k] = min(times[k], best_of(lambda f=f: f(x).sum().backward(), args.rounds))
    print(f"\nsmall MoE layer fwd+bwd, T {T}, H {H}, E {E}, K {K}, F {H // 2}, backend "
          f"{args.backend}")
    for (name, mode), t in times.items():
        ref = times[("torch routing", mode)]
        print(f"  {name:15s} {mode:9s} {t * 1e3:8.3f} ms   / torch routing {t / ref:5.2f}   "
              f"compiled / eager {t / times[(name, 'eager')]:5.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes, few rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.rounds = 128, 64, 5
    torch.set_num_threads(args.threads)
    sy.set_num_threads(args.threads)
    print(machine_line())
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    per_call(args)
    moe(args)


if __name__ == "__main__":
    main()
