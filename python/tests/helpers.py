"""Test data shared by the single-process and the mpirun tests: every rank can rebuild every rank's
inputs from the seed, so each rank checks its own results against a global reference."""
import struct

import torch


def rank_inputs(seed, rank, num_tokens, hidden, num_experts, top_k, dtype=torch.float32,
                skew=False):
    """x [T,H], topk_idx [T,K] int64 (some -1 slots, some repeated ids, one all -1 row),
    probs [T,K] fp32 for source rank `rank`. Column 0 of an fp32 x encodes (rank, token)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    T, H, E, K = num_tokens, hidden, num_experts, top_k
    x = torch.randn(T, H, generator=g)
    if H and dtype != torch.bfloat16:
        x[:, 0] = rank * 1000 + torch.arange(T, dtype=torch.float32)  # exact in fp32
    x = x.to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.int64)
    if skew and T:
        idx[:, 0] = 0  # every token to expert 0: one hot rank
    if T > 3 and K > 1:
        idx[1, 1] = -1        # a dropped slot
        idx[2, :] = -1        # a masked row
        idx[3, 1] = idx[3, 0]  # a repeated id: one pair, weights summed
    probs = torch.rand(T, K, generator=g) + 0.1
    return x, idx.to(torch.int64), probs


def expert_weights(seed, num_experts, hidden):
    """One [H,H] matrix per expert (the 'expert' of the tests is a linear map)."""
    g = torch.Generator().manual_seed(seed + 77)
    return torch.randn(num_experts, hidden, hidden, generator=g) / hidden**0.5


def expect_error(what, fn, piece):
    """Runs fn on this rank and asserts it raises a ValueError whose message holds `piece` (the
    mpirun hostile tests: every rank must see the same error, none may pass or hang)."""
    try:
        fn()
    except ValueError as e:
        if piece not in str(e):
            raise AssertionError(f"{what}: message {str(e)!r} lacks {piece!r}") from e
        return
    raise AssertionError(f"{what}: no error on this rank")


def run_mpi_main(main):
    """The mpirun scripts' entry point: a failure prints its traceback and exits 1 on that rank."""
    import sys
    import traceback
    try:
        main()
    except Exception:  # noqa: BLE001 - reported through the exit code
        traceback.print_exc()
        sys.stdout.flush()
        sys.exit(1)


def single_rank_gloo():
    """A one-rank gloo group for the tests that build Megatron-Core objects in this process (their
    process-group collection needs one): a file store in a fresh folder, so no TCP port is taken
    (a fixed or pid-derived port can collide with a concurrent test's)."""
    import tempfile
    import torch.distributed as dist
    if not dist.is_initialized():
        store = f"file://{tempfile.mkdtemp(prefix='sy_gloo_')}/store"
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)


def route_message(header, blocks):
    """A complete route file from the encoder's own header and (flags, tokens, raw, comp) blocks."""
    import xxhash  # only the route-file tests need it (they importorskip it)

    out = bytearray(header)
    entries = []
    for seq, (flags, tokens, raw_size, comp) in enumerate(blocks):
        h = struct.pack("<IIQQQQQ", 0x4B425953, flags, seq, tokens, raw_size, len(comp),
                        xxhash.xxh3_64_intdigest(comp))
        h += struct.pack("<Q", xxhash.xxh3_64_intdigest(h))
        entries.append((len(out), tokens, len(h) + len(comp)))
        out += h + comp
    ix = struct.pack("<IIQ", 0x58495953, 0, len(entries))
    for e in entries:
        ix += struct.pack("<QQQ", *e)
    ix += struct.pack("<Q", xxhash.xxh3_64_intdigest(ix))
    end = struct.pack("<Q", len(out))
    out += ix + end + struct.pack("<Q", xxhash.xxh3_64_intdigest(end)) + b"SYRTEND1"
    return bytes(out)
