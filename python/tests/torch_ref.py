"""Pure-PyTorch references, written from the maths (float64), for every switchyard.torch function.

They implement the same semantics as DESIGN.md with plain torch ops and torch autograd, never the
engine's code, so a test comparing the two checks the engine against an independent reading."""
import math

import torch


def gating_linear(x, weight, bias=None):
    """logits = x·Wᵀ + b in float64 (bias applied in the forward)."""
    out = x.double() @ weight.double().t()
    if bias is not None:
        out = out + bias.double()
    return out


# --------------------------------------------------------------------------------------------------
# Dispatch / combine
# --------------------------------------------------------------------------------------------------
def merged_pairs(topk_idx, probs):
    """Distinct valid (token, expert) pairs of each row, in the order of the expert's first slot,
    with the weight summed over repeated slots in fp32, k ascending. Returns a list per token of
    (expert, weight_fp32, first_k)."""
    out = []
    for t in range(topk_idx.shape[0]):
        row = {}
        order = []
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            p = probs[t, k].to(torch.float32)
            if e in row:
                row[e] = (row[e] + p).to(torch.float32)
            else:
                row[e] = p
                order.append(e)
        out.append([(e, row[e], None) for e in order])
    return out


def capacity_keep(topk_idx, probs, num_experts, capacity_factor, policy):
    """Which distinct pairs survive a per-expert capacity C = ceil(T*K/E*capacity_factor): the
    highest merged weights (ties: lower token) or the first tokens. Returns a set of (t, e)."""
    T, K = topk_idx.shape
    cap = math.ceil(T * K / num_experts * capacity_factor)
    pairs = merged_pairs(topk_idx, probs)
    keep = set()
    for e in range(num_experts):
        cands = [(t, float(w)) for t in range(T) for (ee, w, _) in pairs[t] if ee == e]
        if policy == "probs":
            cands.sort(key=lambda c: (-c[1], c[0]))
        for t, _ in cands[:cap]:
            keep.add((t, e))
    return keep


def dispatch_rows(xs, idxs, probs, num_experts, ep, rank, keep=None):
    """Rows rank `rank` receives: local experts ascending, then source rank, then token.
    xs/idxs/probs are lists over source ranks. Returns (rows [R,H], weights [R] fp32,
    src_rank [R], src_token [R], tokens_per_expert [L])."""
    L = num_experts // ep
    rows, ws, srank, stok, counts = [], [], [], [], [0] * L
    merged = [merged_pairs(idxs[s], probs[s]) for s in range(ep)]
    for e in range(rank * L, (rank + 1) * L):
        for s in range(ep):
            for t in range(idxs[s].shape[0]):
                for (ee, w, _) in merged[s][t]:
                    if ee == e and (keep is None or (t, e) in keep[s]):
                        rows.append(xs[s][t])
                        ws.append(w)
                        srank.append(s)
                        stok.append(t)
                        counts[e - rank * L] += 1
    H = xs[0].shape[1]
    rows = torch.stack(rows) if rows else torch.zeros(0, H, dtype=xs[0].dtype)
    ws = torch.stack(ws) if ws else torch.zeros(0, dtype=torch.float32)
    return rows, ws, torch.tensor(srank, dtype=torch.int64), torch.tensor(stok, dtype=torch.int64), \
        torch.tensor(counts, dtype=torch.int64)


def moe_combine(x, topk_idx, probs, expert_fn, keep=None):
    """y_t = Σ_k p_{t,k} · expert_fn(e_{t,k}, x_t) over valid (kept) slots, in float64 with torch
    autograd (a repeated expert contributes once per slot, which equals the merged weight)."""
    T, K = topk_idx.shape
    ys = []
    for t in range(T):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(K):
            e = int(topk_idx[t, k])
            if e < 0 or (keep is not None and (t, e) not in keep):
                continue
            acc = acc + probs[t, k].double() * expert_fn(e, x[t].double())
        ys.append(acc)
    return torch.stack(ys) if ys else torch.zeros(0, x.shape[1], dtype=torch.float64)
