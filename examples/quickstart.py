"""switchyard in one page: FP32 router, router replay (R2), expert-parallel dispatch and a route file.
The PyTorch guide's example (docs/guides/pytorch.md) is this file; CI runs it against an
installed wheel."""
import os
import tempfile

import torch

import switchyard as sy
import switchyard.torch as syt

T, H, E, K = 64, 256, 16, 4
x = torch.randn(T, H).to(torch.bfloat16).requires_grad_(True)     # bf16 activations
weight = (torch.randn(E, H) * 0.05).to(torch.bfloat16).requires_grad_(True)

# 1. The FP32 router: bf16 inputs, fp32-accumulated gate (also under autocast), fp32 routing.
logits = syt.router_gating_linear(x, weight, router_dtype=torch.float32)      # [T, E] fp32
cfg = sy.RouterConfig(num_experts=E, top_k=K, score_function="softmax",
                      aux_loss_type="aux_loss", aux_loss_coeff=1e-3)
topk_weights, topk_idx, info = syt.topk_route(logits, cfg)  # [T, K], [T, K] int64, RouteInfo

# 2. Router replay (R2): record the experts of one pass, force them in the next.
router = syt.TopKRouter(hidden_size=H, config=cfg, router_dtype=torch.float32)
replay = sy.RouterReplay(top_k=K, layer=3)
router.replay = replay
replay.action = "record"
with torch.no_grad():
    _, old_idx = router(x)                         # old-log-prob pass: ids recorded
replay.action = "replay_forward"
w_new, new_idx = router(x)                         # update pass: same ids, live fp32 weights
assert torch.equal(old_idx, new_idx) and router.last_info.num_replayed_rows == T

# 3. Dispatch to the experts and combine (EP size 1 here; sy.dist.world() under mpirun).
disp = syt.AlltoAllDispatcher(num_experts=E, ep_comm=sy.dist.local())
recv_x, recv_topk_weights, handle = disp.dispatch(x, topk_weights, topk_idx)
expert_out = recv_x * 2                            # the experts (per-row: any module works)
y = disp.combine(expert_out, handle)               # [T, H]: weights applied in fp32, fixed order
(y.float().square().mean() + info.aux_loss).backward()
assert weight.grad is not None and x.grad.shape == x.shape

# 4. Route data: store the recorded routes compactly and read them back.
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "routes.syr")
    table = old_idx.to(torch.int32).view(T, 1, K)  # [tokens, moe_layers, K], -1 = no route
    sy.routes.write(path, [table], num_experts=E)
    assert torch.equal(sy.routes.read(path)[0], table)

print(f"quickstart ok: {T} tokens -> top-{K} of {E} experts, {handle.num_recv_tokens} rows "
      f"dispatched, kernels: {sy.cpu_isa()}")
