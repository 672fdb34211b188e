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
    src_rank [R], src_token [R], num_tokens_per_expert [L])."""
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


# --------------------------------------------------------------------------------------------------
# Top-k routing (Megatron-Core TopKRouter semantics, DESIGN.md "Semantics")
# --------------------------------------------------------------------------------------------------
NORM_EPS = 1e-20


def _scores(z, score_function):
    if score_function == "sigmoid":
        return torch.sigmoid(z)
    if score_function == "sqrtsoftplus":
        return torch.sqrt(torch.nn.functional.softplus(z))
    raise ValueError(score_function)


def _select(key, K, num_groups, group_topk):
    """Top-K ids of one row's key (descending; ties lower id), group-limited when asked."""
    E = key.shape[0]
    allowed = torch.ones(E, dtype=torch.bool)
    if num_groups:
        per = E // num_groups
        m = K // group_topk
        gs = torch.stack([key[g * per:(g + 1) * per].topk(m).values.sum()
                          for g in range(num_groups)])
        best = sorted(range(num_groups), key=lambda g: (-float(gs[g]), g))[:group_topk]
        allowed[:] = False
        for g in best:
            allowed[g * per:(g + 1) * per] = True
    cand = [e for e in range(E) if allowed[e]]
    cand.sort(key=lambda e: (-float(key[e]), e))
    return cand[:K]


def topk_route(logits, num_experts, topk, score_function="softmax", pre_softmax=False,
               num_groups=None, group_topk=None, topk_scaling_factor=None, capacity_factor=None,
               token_drop_policy="probs", aux_loss_type=None, aux_loss_coeff=0.0,
               z_loss_coeff=0.0, expert_bias=None, replay_idx=None, invalid_replay_rows="error",
               padding_mask=None, seq_length=None, global_counts=None):
    """Returns (probs [T,K] float64 differentiable to logits, topk_idx [T,K] int64,
    aux_loss (tensor, coefficient included), z_loss (tensor), info dict). Written from the maths:
    scores, selection, weights at the ids, capacity, Megatron-Core's loss formulas."""
    z = logits.double()
    T, E = z.shape
    K = topk
    scale = 1.0 if topk_scaling_factor is None else topk_scaling_factor
    softmax = score_function == "softmax"
    s = None if softmax else _scores(z, score_function)
    p_all = torch.softmax(z, dim=-1) if softmax else None
    pad = padding_mask if padding_mask is not None else torch.zeros(T, dtype=torch.bool)
    ids_rows, w_rows = [], []
    counts = dict(replayed=0, native=0, padded=0, invalid=0)
    for t in range(T):
        if pad[t]:
            ids_rows.append([-1] * K)
            w_rows.append(torch.zeros(K, dtype=torch.float64))
            counts["padded"] += 1
            continue
        ids = None
        if replay_idx is not None:
            row = [int(v) for v in replay_idx[t]]
            if any(v != -1 for v in row):
                bad = (any(v == -1 for v in row) or len(set(row)) != K or
                       any(v < 0 or v >= E for v in row))
                if not bad:
                    ids = row
                    counts["replayed"] += 1
                elif invalid_replay_rows == "native":
                    counts["invalid"] += 1
                else:
                    raise ValueError(f"token {t}")
        if ids is None:
            counts["native"] += 1
            key = (z[t] if not pre_softmax else p_all[t]) if softmax else s[t]
            key = key.detach()
            if expert_bias is not None:
                key = key + expert_bias.double()
            ids = _select(key, K, num_groups, group_topk)
        idx = torch.tensor(ids)
        if softmax and not pre_softmax:
            w = torch.softmax(z[t, idx], dim=-1)
        elif softmax:
            w = p_all[t, idx]
        else:
            w = s[t, idx]
            if K > 1:
                w = w / (w.sum() + NORM_EPS)
        ids_rows.append(ids)
        w_rows.append(w * scale)
    topk_idx = torch.tensor(ids_rows, dtype=torch.int64).reshape(T, K)
    probs = torch.stack(w_rows) if T else z.new_zeros(0, K) + 0 * z.sum()
    # Capacity: per expert, keep the highest weights (ties: lower token) or the first tokens.
    dropped = 0
    if capacity_factor is not None:
        cap = math.ceil(T * K / E * capacity_factor)
        keep = torch.ones(T, K, dtype=torch.bool)
        for e in range(E):
            slots = [(t, k) for t in range(T) for k in range(K) if int(topk_idx[t, k]) == e]
            if token_drop_policy == "probs":
                slots.sort(key=lambda tk: (-float(probs[tk[0], tk[1]]), tk[0]))
            for (t, k) in slots[cap:]:
                keep[t, k] = False
                dropped += 1
        topk_idx = torch.where(keep, topk_idx, torch.full_like(topk_idx, -1))
        probs = probs * keep
    num_tokens_per_expert = torch.zeros(E, dtype=torch.int64)
    for e in topk_idx[topk_idx >= 0].tolist():
        num_tokens_per_expert[e] += 1
    valid = ~pad
    n = int(valid.sum())
    aux = torch.zeros((), dtype=torch.float64)
    if aux_loss_type is not None and aux_loss_coeff > 0 and n > 0:
        # Scores for the aux loss over all E and their own plain top-k (Megatron's
        # compute_routing_scores_for_aux_loss).
        if softmax:
            P = torch.softmax(z, dim=-1)
        else:
            P = s / (s.sum(-1, keepdim=True) + NORM_EPS)
        amap = torch.zeros(T, E, dtype=torch.float64)
        for t in range(T):
            if valid[t]:
                for e in _select(P[t].detach(), K, None, None):
                    amap[t, e] = 1.0
        Pv = P * valid[:, None]
        if aux_loss_type == "seq_aux_loss":
            B = T // seq_length
            c = amap.view(seq_length, B, E).sum(0)          # [B, E]
            psum = Pv.view(seq_length, B, E).sum(0)          # [B, E]
            nt = n / B
            aux = (c * psum).sum() * E * aux_loss_coeff / (K * nt * nt) / B
        else:
            c = amap.sum(0)
            if aux_loss_type == "global_aux_loss":
                global_counts["sum"] = global_counts.get("sum", torch.zeros(E, dtype=torch.float64)) + c
                global_counts["steps"] = global_counts.get("steps", 0) + 1
                c = global_counts["sum"] / global_counts["steps"]
            aux = (Pv.sum(0) * c).sum() * E * aux_loss_coeff / (K * n * n)
    zl = torch.zeros((), dtype=torch.float64)
    if z_loss_coeff > 0:
        lse = torch.logsumexp(z, dim=-1)
        zl = (lse.square() * valid).sum() / max(n, 1) * z_loss_coeff
    info = dict(num_tokens_per_expert=num_tokens_per_expert, num_dropped=dropped, **counts)
    return probs, topk_idx, aux, zl, info
