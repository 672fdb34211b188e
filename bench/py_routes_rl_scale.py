"""Route data at RL scale: switchyard.routes' batch functions against torch doing the corresponding
single tensor op on the same bytes, and the wire format (routes.encode / decode) against the layouts
rollout engines ship (verl's padded int16 tensor, vLLM's uint8 arrays, int32 tables).

    PYTHONPATH=build/python python bench/py_routes_rl_scale.py [--sequences 256] [--scale 1.0]
        [--threads 1] [--repeat 3] [--seed 0]

The batch (Qwen3-30B-A3B routing: 48 MoE layers, E 128, K 8; `--sequences` rows):
- prompt lengths: log-normal (median 350 tokens, sigma 0.9), clipped to [16, max_prompt];
- response lengths: log-normal (median 900, sigma 1.0) and 15% of the responses hit the
  max_response cap (truncated generations: the mass at the cap real RL batches show);
  max_prompt 1024 and max_response 3072 (x `--scale`), so verl's tensor is [B, 4096, 48, 8];
- verl's layout: prompts left-padded to max_prompt, responses right-padded to max_response,
  padding and the last sampled token (never routed) 0, as verl's routed_experts holds them;
- expert ids: per layer a Zipf-like popularity (p(rank r) ~ 1/(r+1)^1.1 over a random permutation
  of the experts, so each layer has its own hot experts) and token-to-token correlation: each
  layer has a pool of rows built as a random walk (row i+1 = row i with 1-3 of its K slots replaced
  by fresh Zipf draws, ids distinct within a row, slot order kept like a top-k's); a token continues
  the walk from the previous token (sharing 5-7 of its 8 experts) with probability 0.6, else jumps
  to a random pool row. Every row is a valid top-k row (distinct ids).

Every timing is the best of `--repeat` runs, switchyard and torch side by side in the same process on
the same input, with the same thread count (switchyard.set_num_threads and torch.set_num_threads).
With one thread the time is the process's CPU time (time.process_time): on a machine shared with
other jobs, wall time also counts the time the process waits for a core (the wall time is printed
beside it); with more threads it is wall time. MB/s is of the op's input bytes as the caller holds
them. Ratio = switchyard time / torch time (< 1: switchyard faster). Decoding's peak memory is
measured in a subprocess: the growth of its peak RSS (VmHWM, reset through /proc/self/clear_refs
once the encoded bytes are loaded) while decoding, against the size of the decoded tables.
"""
import argparse
import os
import sys

_threads = next((a.split("=", 1)[1] if "=" in a else sys.argv[i + 2]
                 for i, a in enumerate(sys.argv[1:]) if a.startswith("--threads")), "1")
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _threads

import math  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import switchyard as sy  # noqa: E402
import switchyard.routes as routes  # noqa: E402
from bench_machine import machine_line  # noqa: E402

H, E, K = 48, 128, 8  # Qwen3-30B-A3B: every decoder layer is MoE


# ---- the batch -----------------------------------------------------------------------------------
def _zipf_p(rng, s=1.1):
    p = 1.0 / np.arange(1, E + 1) ** s
    p /= p.sum()
    out = np.empty(E)
    out[rng.permutation(E)] = p  # this layer's hot experts
    return out


def _walk_pool(rng, p, n):
    """n rows of K distinct ids; row i+1 replaces 1-3 slots of row i with fresh Zipf draws."""
    draws = rng.choice(E, size=(n * 8 + 64,), p=p)
    d = 0
    row = list(dict.fromkeys(rng.choice(E, size=4 * K, p=p)))[:K]
    while len(row) < K:
        row.append(next(e for e in range(E) if e not in row))
    pool = np.empty((n, K), dtype=np.int16)
    for i in range(n):
        pool[i] = row
        m = 1 + (draws[d] % 3)
        d += 1
        for _ in range(m):
            slot = draws[d] % K
            d += 1
            for _try in range(16):
                e = draws[d % len(draws)]
                d += 1
                if e not in row:
                    row[slot] = e
                    break
    return pool


def make_batch(B, max_prompt, max_response, seed, pool_rows=2048):
    """verl's (routed_experts int16 [B, S, H, K], attention_mask int64 [B, S]) and the lengths."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(350), 0.9, B), 16, max_prompt).astype(np.int64)
    resp = np.clip(rng.lognormal(np.log(900), 1.0, B), 1, max_response).astype(np.int64)
    resp[rng.random(B) < 0.15] = max_response
    S = max_prompt + max_response
    pools = np.stack([_walk_pool(rng, _zipf_p(rng), pool_rows) for _ in range(H)])  # [H, P, K]
    ids = np.zeros((B, S, H, K), dtype=np.int16)
    mask = np.zeros((B, S), dtype=np.int64)
    offs = rng.integers(0, pool_rows, H)
    for b in range(B):
        n = int(prompt[b] + resp[b])
        lo = max_prompt - int(prompt[b])
        mask[b, lo:lo + n] = 1
        # Token-to-token correlation: continue the walk (idx + 1) or jump somewhere new.
        jump = rng.random(n) >= 0.6
        jump[0] = True
        start = rng.integers(0, pool_rows, n)
        seg = np.cumsum(jump) - 1
        first = np.flatnonzero(jump)
        idx = start[first][seg] + (np.arange(n) - first[seg])
        rows = (idx[:, None] + offs[None, :]) % pool_rows  # [n, H]
        ids[b, lo:lo + n] = pools[np.arange(H)[None, :], rows]
        ids[b, lo + n - 1] = 0  # the last sampled token: never routed
    return torch.from_numpy(ids), torch.from_numpy(mask), prompt, resp


def _block_kinds(blob):
    """How many blocks of the message are set-coded (format version 3) or token-delta."""
    b = blob.numpy().tobytes()
    n_ix = int.from_bytes(b[-24:-16], "little")  # the index's start
    count = int.from_bytes(b[n_ix + 8:n_ix + 16], "little")
    kinds = {"set": 0, "token-delta": 0}
    for i in range(count):
        off = int.from_bytes(b[n_ix + 16 + 24 * i:n_ix + 24 + 24 * i], "little")
        flags = int.from_bytes(b[off + 4:off + 8], "little")
        kinds["set" if flags & 8 else "token-delta"] += 1
    return kinds


SIZES = []


# ---- timing -------------------------------------------------------------------------------------
CPU_CLOCK = True  # set in main(): process CPU time with one thread, wall time with more
WALL = {}


def best(fn, repeat, key=None):
    fn()  # warm (allocator, page cache)
    t = w = float("inf")
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        c1, t1 = time.process_time(), time.perf_counter()
        t = min(t, (c1 - c0) if CPU_CLOCK else (t1 - t0))
        w = min(w, t1 - t0)
    if key:
        WALL[key] = w
    return t


ROWS = []


def row(name, nbytes, sy_fn, peer_name, peer_fn, repeat):
    ts = best(sy_fn, repeat, name)
    tp = best(peer_fn, repeat, name + "/peer")
    ROWS.append((name, nbytes, ts, peer_name, tp))
    print(f"  {name:<22} {ts * 1e3:9.1f} ms {nbytes / ts / 1e6:8.0f} MB/s | {peer_name:<40} "
          f"{tp * 1e3:8.1f} ms | ratio {ts / tp:5.2f} | wall {WALL[name] * 1e3:.1f} / "
          f"{WALL[name + '/peer'] * 1e3:.1f} ms", flush=True)


def contracts(re, maskb, rep):
    """Import throughput of each engine contract in the engine's own layout and dtype, against
    numpy's own conversion of the same payload to int32 (what a caller without switchyard does,
    validation excluded); rows/s counts token rows of the imported tables."""
    import base64
    import io
    import json
    print("\n## import per engine contract (switchyard vs numpy, same payload)")
    B = re.shape[0]
    seqs = [re[b][maskb[b]][:-1].numpy() for b in range(B)]
    nrows = sum(a.shape[0] + 1 for a in seqs)
    for dt in (np.uint8, np.uint16, np.int16, np.int32):  # vLLM's numpy arrays, by release
        arrays = [a.astype(dt) for a in seqs]
        nb = sum(a.nbytes for a in arrays)
        name = f"vllm arrays {np.dtype(dt).name}"
        row(name, nb, lambda: routes.import_vllm_arrays(arrays, E, zero_rows="to_none"),
            "np.concatenate(arrays).astype(int32)",
            lambda: np.concatenate(arrays).astype(np.int32), rep)
        print(f"  {'':<22} {nrows / WALL[name] / 1e6:9.2f} M rows/s (wall)")
    # vLLM HTTP (>= 0.22): choices[i].routed_experts = base64 of the .npy bytes (uint8)
    def npy(a):
        buf = io.BytesIO()
        np.save(buf, a)
        return buf.getvalue()
    resp = json.dumps({"choices": [{"index": i, "routed_experts": base64.b64encode(
        npy(a.astype(np.uint8))).decode()} for i, a in enumerate(seqs)]})

    def numpy_http():
        return [np.load(io.BytesIO(base64.b64decode(c["routed_experts"]))).astype(np.int32)
                for c in json.loads(resp)["choices"]]
    row("vllm http (b64 .npy)", len(resp),
        lambda: routes.import_vllm_response(resp, E, zero_rows="to_none"),
        "json + b64decode + np.load + astype(int32)", numpy_http, rep)
    print(f"  {'':<22} {nrows / WALL['vllm http (b64 .npy)'] / 1e6:9.2f} M rows/s (wall)")
    # SGLang: meta_info.routed_experts = base64 of flat int32 (today) or uint8 / uint16 (proposed
    # in sgl-project/sglang#31219, read with routed_experts_dtype)
    L, K = seqs[0].shape[1], seqs[0].shape[2]
    for wire in ("<i4", "u1", "<u2"):
        dt = np.dtype(wire)
        text = "\n".join(json.dumps({"meta_info": {"routed_experts": base64.b64encode(
            a.astype(dt).tobytes()).decode()}}) for a in seqs)

        def numpy_sglang(text=text, dt=dt):
            return [np.frombuffer(base64.b64decode(json.loads(line)["meta_info"]["routed_experts"]),
                                  dt).reshape(-1, L, K).astype(np.int32)
                    for line in text.splitlines()]
        name = f"sglang (b64 {dt.name})"
        row(name, len(text),
            lambda text=text, dt=dt: routes.import_sglang_text(
                text, E, L, K, zero_rows="to_none", routed_experts_dtype=dt.name),
            "json + b64decode + np.frombuffer + astype(int32)", numpy_sglang, rep)
        print(f"  {'':<22} {nrows / WALL[name] / 1e6:9.2f} M rows/s (wall)")


def decode_peak_rss(blob_path):
    """Peak RSS growth of decoding in a fresh process (the encoded bytes already loaded)."""
    code = (
        "import sys, torch\n"
        "import switchyard.routes as routes\n"
        "def kb(key):\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith(key):\n"
        "            return int(line.split()[1])\n"
        "blob = torch.from_numpy(__import__('numpy').fromfile(sys.argv[1], dtype='uint8'))\n"
        "open('/proc/self/clear_refs', 'w').write('5')  # peak RSS := current RSS\n"
        "before = kb('VmRSS')\n"
        "tables, meta = routes.decode(blob)\n"
        "peak = kb('VmHWM')\n"
        "n = sum(t.numel() * t.element_size() for t in tables)\n"
        "print(before, peak, n)\n")
    out = subprocess.run([sys.executable, "-c", code, blob_path], check=True, capture_output=True,
                         text=True, env=os.environ).stdout.split()
    before, peak, n = (int(v) for v in out)
    return (peak - before) * 1024, n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies max prompt/response")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated op names to run (default: all)")
    args = ap.parse_args()
    global CPU_CLOCK
    CPU_CLOCK = args.threads == 1
    sy.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    only = set(filter(None, args.only.split(",")))
    want = (lambda name: not only or name in only)
    print(machine_line())
    max_prompt, max_response = int(1024 * args.scale), int(3072 * args.scale)
    t0 = time.perf_counter()
    re, mask, prompt, resp = make_batch(args.sequences, max_prompt, max_response, args.seed)
    B, S = mask.shape
    lengths = mask.sum(1)
    ntok = int(lengths.sum())
    print(f"batch: {B} sequences, verl tensor {list(re.shape)} int16 ({re.nbytes / 1e6:.0f} MB), "
          f"{ntok} real tokens ({ntok / (B * S):.0%} of the positions), prompt median "
          f"{int(np.median(prompt))} / max {int(prompt.max())}, response median "
          f"{int(np.median(resp))}, {int((resp == max_response).sum())} at the cap "
          f"({time.perf_counter() - t0:.1f} s to generate); threads {args.threads}")
    maskb = mask.bool()
    rep = args.repeat

    print("\n## alignment (switchyard vs torch, same input)")
    if want("from_verl"):
        row("from_verl", re.nbytes, lambda: routes.from_verl(re, mask, num_experts=E),
            "re[mask.bool()] (int16 mask-select)", lambda: re[maskb], rep)
    tables, report = routes.from_verl(re, mask, num_experts=E)
    moe_layers = report["moe_layers"]
    tab_bytes = sum(t.nbytes for t in tables)
    if want("to_verl"):
        flat16 = re[maskb]

        def peer_to_verl():
            out = torch.zeros_like(re)
            out[maskb] = flat16
            return out

        row("to_verl", tab_bytes,
            lambda: routes.to_verl(tables, moe_layers, H, attention_mask=mask, num_experts=E),
            "zeros + out[mask.bool()] = rows (int16)", peer_to_verl, rep)
    if want("drop_padding"):
        re32 = re.to(torch.int32)
        row("drop_padding", re32.nbytes, lambda: routes.drop_padding(re32, mask, num_experts=E),
            "re32[mask.bool()] (int32 mask-select)", lambda: re32[maskb], rep)
        del re32
    if want("import_vllm_arrays"):
        # vLLM >= 0.22: one uint8 [seq_len - 1, H, K] array per sequence.
        arrays = [re[b][maskb[b]][:-1].to(torch.uint8) for b in range(B)]
        nb = sum(a.nbytes for a in arrays)
        row("import_vllm_arrays", nb,
            lambda: routes.import_vllm_arrays(arrays, E, zero_rows="to_none"),
            "torch.cat(arrays).to(int32)", lambda: torch.cat(arrays).to(torch.int32), rep)
        del arrays
    if want("contracts"):
        contracts(re, maskb, rep)
    packed, cu, cu_pad = routes.pack_thd(tables, tp_size=2, cp_size=2, num_experts=E)
    if want("pack_thd"):
        row("pack_thd", tab_bytes,
            lambda: routes.pack_thd(tables, tp_size=2, cp_size=2, num_experts=E),
            "torch.cat(tables)", lambda: torch.cat(tables), rep)
    if want("cp_zigzag_split"):
        idx = []
        for i in range(len(cu_pad) - 1):
            c = (cu_pad[i + 1] - cu_pad[i]) // 4
            for ch in (0, 3):
                idx.append(torch.arange(cu_pad[i] + ch * c, cu_pad[i] + (ch + 1) * c))
        idx = torch.cat(idx)
        row("cp_zigzag_split", packed.nbytes,
            lambda: routes.cp_zigzag_split(packed, cu_pad, 2, 0, num_experts=E),
            "packed.index_select(0, rows)", lambda: packed.index_select(0, idx), rep)
    if want("sp_split"):
        n = packed.shape[0] // 2
        row("sp_split", packed.nbytes, lambda: routes.sp_split(packed, 2, 1, num_experts=E),
            "packed[n:2n].clone()", lambda: packed[n:2 * n].clone(), rep)
    if want("layer_targets"):
        keys = [h + 1 for h in moe_layers]
        row("layer_targets", packed.nbytes,
            lambda: routes.layer_targets(packed, moe_layers, keys),
            "[packed[:, l] for l in layers]", lambda: [packed[:, m] for m in range(H)], rep)

    print("\n## wire format (routes.encode / decode)")
    i16_real = ntok * H * K * 2
    verl_bytes = re.nbytes
    vllm_u8 = (ntok - B) * H * K
    int32_bytes = tab_bytes
    if hasattr(routes, "encode"):
        blob = routes.encode(tables, E, moe_layers=moe_layers, num_hidden_layers=H)
        te = best(lambda: routes.encode(tables, E, moe_layers=moe_layers, num_hidden_layers=H), rep)
        td = best(lambda: routes.decode(blob), rep)
        out, meta = routes.decode(blob)
        assert all(torch.equal(a, b) for a, b in zip(out, tables)), "decode(encode(t)) != t"
        with tempfile.NamedTemporaryFile(suffix=".syw", delete=False) as f:
            blob.numpy().tofile(f)
        try:
            grow, nout = decode_peak_rss(f.name)
        finally:
            os.unlink(f.name)
        wire = blob.numel()
        # The information limit the issue names: each layer's order-0 entropy of the routed ids
        # over the batch, and that less log2(K!)/K bits per id (a top-k set carries no order).
        routed, h_bits = 0, 0.0
        for m in range(H):
            ids = torch.cat([t[:, m].reshape(-1) for t in tables])
            ids = ids[ids >= 0]
            c = torch.bincount(ids.long(), minlength=E).double()
            c = c[c > 0]
            h_bits += float(-(c * torch.log2(c / c.sum())).sum())
            routed += int(ids.numel())
        h0 = h_bits / routed
        set_bound = h0 - math.log2(math.factorial(K)) / K
        bits = wire * 8 / routed
        blocks = _block_kinds(blob)
        print(f"  bits per routed id: {bits:.2f} (order-0 entropy {h0:.2f}, set bound "
              f"{set_bound:.2f}: {bits / set_bound:.2f}x the bound); {verl_bytes / wire:.2f}x "
              f"smaller than verl's int16 tensor; blocks {blocks}")
        SIZES.append((bits, h0, set_bound, verl_bytes / wire, int32_bytes / te / 1e9,
                      int32_bytes / td / 1e9))
        print(f"  encoded: {wire / 1e6:.1f} MB; encode {te * 1e3:.1f} ms "
              f"({i16_real / te / 1e9:.2f} GB/s of int16-equivalent input, "
              f"{int32_bytes / te / 1e9:.2f} GB/s of int32 tables), decode {td * 1e3:.1f} ms "
              f"({i16_real / td / 1e9:.2f} GB/s int16-equivalent, {int32_bytes / td / 1e9:.2f} "
              f"GB/s int32)")
        print(f"  decode peak RSS growth {grow / 1e6:.0f} MB for {nout / 1e6:.0f} MB of tables "
              f"({grow / max(nout, 1):.2f}x the decoded size: the tables themselves plus "
              f"{max(grow - nout, 0) / 1e6:.0f} MB of scratch)")
        ROWS.append(("encode", i16_real, te, None, None))
        ROWS.append(("decode", i16_real, td, None, None))
        sizes = [("verl routed_experts int16 (padded, every layer)", verl_bytes),
                 ("vLLM uint8 arrays", vllm_u8), ("int16, real tokens", i16_real),
                 ("int32 route tables", int32_bytes), ("switchyard wire format", wire)]
    else:
        wire = None
        sizes = [("verl routed_experts int16 (padded, every layer)", verl_bytes),
                 ("vLLM uint8 arrays", vllm_u8), ("int32 route tables", int32_bytes)]

    print("\n## Markdown\n")
    clock = "process CPU time" if CPU_CLOCK else "wall time"
    print(f"{machine_line()}; {B} sequences, {ntok} tokens, threads {args.threads}, best of "
          f"{rep} ({clock}).\n")
    print("| op | switchyard ms | MB/s (input) | torch peer | torch ms | switchyard / torch |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for name, nb, ts, pn, tp in ROWS:
        if pn is None:
            print(f"| routes.{name} | {ts * 1e3:.1f} | {nb / ts / 1e6:.0f} (int16-equivalent) "
                  f"| | | |")
        else:
            print(f"| routes.{name} | {ts * 1e3:.1f} | {nb / ts / 1e6:.0f} | `{pn}` | "
                  f"{tp * 1e3:.1f} | {ts / tp:.2f} |")
    print("\n| layout | MB | x wire format |")
    print("| --- | ---: | ---: |")
    for name, nb in sizes:
        x = f"{nb / wire:.1f}" if wire else "-"
        print(f"| {name} | {nb / 1e6:.1f} | {x} |")
    for bits, h0, set_bound, x_verl, enc, dec in SIZES:
        print(f"\nwire format: {bits:.2f} bits per routed id; bound {set_bound:.2f} (order-0 "
              f"entropy {h0:.2f} less log2(K!)/K): {bits / set_bound:.2f}x the bound; "
              f"{x_verl:.2f}x smaller than verl's tensor; encode {enc:.2f} / decode {dec:.2f} "
              f"GB/s of int32 tables")
    print(f"\npeak RSS of this process: "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB")


if __name__ == "__main__":
    main()
