"""Hostile route files and messages against the decoder and the CLI (issue 35 items 4 and 5).

Decode limits: every size a header declares is checked against the bytes present and against
``max_decoded_bytes`` before anything is allocated. The crafted messages are written here from the
format's spec (include/switchyard/route_file.h): every token repeats the first, so the payload is
one match bit per id, and those bits are zstd RLE blocks (4 bytes per 128 KiB): 460 bytes declare an
8M-token table of 256 MiB, which the decoder used to allocate and fill.

Verified reads: every ``switchyard routes`` command that reads a file refuses a cut or corrupted one
(exit 1, the file and the damaged record named, no output written); ``--salvage`` keeps what is
readable, says what was lost and still exits 1."""
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import switchyard as sy
import switchyard.routes as routes
from helpers import route_message

xxhash = pytest.importorskip("xxhash")

L, K, E = 2, 4, 8  # token 0 holds layer l's ids l*K .. l*K+K-1; every later token repeats it


def _bomb(tokens, blocks=1):
    """A complete, checksummed message of `blocks` blocks of `tokens` tokens each."""
    blob = routes.encode([], E, top_k=K, num_moe_layers=L).numpy().tobytes()
    out = bytearray(blob[:struct.unpack_from("<I", blob, 12)[0]])
    bitmap = tokens * L * K // 8
    raw_size = bitmap + L * K
    frame = struct.pack("<IBQ", 0xFD2FB528, 0xE0, raw_size)

    def block(kind, size, last):
        return struct.pack("<I", (size << 3) | (kind << 1) | int(last))[:3]

    frame += block(0, 1, False) + b"\x00"  # token 0: no matches
    left = bitmap - 1
    while left > 0:
        n = min(left, 1 << 17)
        frame += block(1, n, False) + b"\xff"  # RLE: every later id matches
        left -= n
    frame += block(0, L * K, True) + bytes(range(L * K))  # token 0's literals
    return route_message(bytes(out), [(4, tokens, raw_size, bytes(frame))] * blocks)


def _decode_under_cap(path, headroom):
    """Decodes the message in `path` in a child whose address space may grow by `headroom` bytes
    (RLIMIT_AS): returns what happened ("DataError: ...", "MemoryError", "decoded")."""
    code = textwrap.dedent(f"""
        import resource, sys
        import switchyard as sy, switchyard.routes as routes
        data = open({str(path)!r}, "rb").read()
        vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1])
        cap = vm * 1024 + {headroom}
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        try:
            routes.decode(data)
            print("decoded")
        except sy.DataError as e:
            print("DataError:", e)
        except MemoryError:
            print("MemoryError")
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.hostile(tried="routes.decode of a 460-byte checksummed message declaring one 8M-token "
                           "table (256 MiB: match bits as zstd RLE blocks)",
                     gets="DataError naming the declared bytes, the bytes present and the limit "
                          "(default: the larger of 64 MiB and 1024 x the message), before any "
                          "allocation: it fits in 64 MiB of address space (it used to allocate "
                          "and decode 264 MiB)")
def test_a_460_byte_message_declaring_256_mib_is_refused_before_allocating(tmp_path):
    bomb = _bomb(8 << 20)
    assert len(bomb) == 460
    (tmp_path / "bomb.syr").write_bytes(bomb)
    got = _decode_under_cap(tmp_path / "bomb.syr", 64 << 20)
    assert got.startswith("DataError: [route_file] <wire>: blocks 0..0 of 1 declare 8388608 tokens "
                          "x 2 layers x top_k 4 (268435456 bytes of int32 ids)"), got
    assert ("from a message of 460 bytes, more than max_decoded_bytes=67108864 (the default: the "
            "larger of 67108864 bytes and 1024 x the 460 bytes present); if the data is trusted, "
            "raise the limit (C++ RouteDecodeOptions::max_decoded_bytes, Python "
            "max_decoded_bytes=, CLI --max-decoded-bytes)") in got


@pytest.mark.hostile(tried="routes.decode of a 42 KB message of 300 blocks, each 1M tokens (33 MiB, "
                           "under the limit one by one; 9.9 GB in all)",
                     gets="DataError for the whole message before the first block is decompressed")
def test_many_small_bombs_in_one_message_are_refused_as_a_whole():
    bomb = _bomb(1 << 20, blocks=300)
    assert len(bomb) < 45_000
    with pytest.raises(sy.DataError, match=r"blocks 0\.\.1 of 300 declare 2097152 tokens"):
        routes.decode(bomb)


@pytest.mark.hostile(tried="routes.decode / RouteFile / read / verify of a message just past the "
                           "default limit, with max_decoded_bytes raised",
                     gets="the exact tables (every token equal to the first); without it a "
                          "DataError, and verify lists the sequence as a problem")
def test_a_raised_limit_decodes_the_message_exactly(tmp_path):
    T = 2 << 20  # 64 MiB of ids + 2 MiB of payload: just over the default 64 MiB
    bomb = _bomb(T)
    want = torch.arange(L * K, dtype=torch.int32).view(1, L, K).expand(T, L, K)
    with pytest.raises(sy.DataError, match="more than max_decoded_bytes=67108864"):
        routes.decode(bomb)
    tables, meta = routes.decode(bomb, max_decoded_bytes=100_000_000)
    assert meta["num_tokens"] == [T] and torch.equal(tables[0], want)
    path = tmp_path / "bomb.syr"
    path.write_bytes(bomb)
    with pytest.raises(sy.DataError, match=r"block 0 \(sequence 0\) at byte offset 48: declares "
                                           r"2097152 tokens"):
        routes.read(path)
    with pytest.raises(sy.DataError, match="more than max_decoded_bytes=67108864"):
        routes.RouteFile.from_bytes(bomb)[0]
    assert torch.equal(routes.RouteFile(path, max_decoded_bytes=100_000_000)[0], want)
    assert torch.equal(routes.read(path, max_decoded_bytes=100_000_000)[0], want)
    v = routes.verify(path)
    assert not v["ok"] and v["num_readable"] == 0
    assert "more than max_decoded_bytes=67108864" in v["problems"][0]
    assert routes.verify(path, max_decoded_bytes=100_000_000)["ok"]


def test_a_negative_limit_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"\[route_file\] max_decoded_bytes must be > 0 \(or 0 for "
                                         r"the default limit\), got -1"):
        routes.decode(_bomb(8), max_decoded_bytes=-1)
    # Real routes decode under the default limit.
    g = torch.Generator().manual_seed(35)
    tables = [torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(T * 4)]).view(T, 4, 8)
              .to(torch.int32) for T in (1, 7, 1031)]
    out, _ = routes.decode(routes.encode(tables, 128))
    assert all(torch.equal(a, b) for a, b in zip(out, tables))


# ---- the CLI ---------------------------------------------------------------------------------------
def _cli():
    """The `switchyard` program: beside the built module (build/python -> build/tools), or
    installed on PATH."""
    built = Path(routes._C.__file__).resolve().parents[2] / "tools" / "switchyard"
    found = str(built) if built.exists() else shutil.which("switchyard")
    if found is None:
        pytest.skip("the switchyard program is not built here (SWITCHYARD_BUILD_TOOLS=OFF)")
    return found


def _run(*args):
    return subprocess.run([_cli(), *map(str, args)], capture_output=True, text=True, timeout=120)


def _blocks(data):
    """(offset, stored bytes) of every block of a route file, walked from the header."""
    at, out = struct.unpack_from("<I", data, 12)[0], []
    while data[at:at + 4] == b"SYBK":
        stored = 56 + struct.unpack_from("<Q", data, at + 32)[0]
        out.append((at, stored))
        at += stored
    return out


@pytest.fixture
def damaged(tmp_path):
    """in.syr (3 sequences, a layer map), cut.syr (cut inside block 2), flipped.syr (a byte of
    block 1's payload flipped, the index intact)."""
    g = torch.Generator().manual_seed(4)
    tables = [torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T * 3)]).view(T, 3, 2)
              .to(torch.int32) for T in (5, 6, 7)]
    routes.write(tmp_path / "in.syr", tables, 8, moe_layers=[1, 2, 3])
    data = (tmp_path / "in.syr").read_bytes()
    blocks = _blocks(data)
    (tmp_path / "cut.syr").write_bytes(data[:blocks[2][0] + blocks[2][1] - 3])
    flipped = bytearray(data)
    flipped[blocks[1][0] + 60] ^= 0x20
    (tmp_path / "flipped.syr").write_bytes(bytes(flipped))
    return tmp_path, blocks


def _reading_commands(d, name):
    return {
        "inspect": ["routes", "inspect", d / name],
        "stats": ["routes", "stats", d / name],
        "diff": ["routes", "diff", d / name, d / "in.syr"],
        "align": ["routes", "align", d / name, "-o", d / "out.syr", "--tp", "2"],
        "export": ["routes", "export", "--format", "verl", d / name, "-o", d / "out",
                   "--num-hidden-layers", "4"],
    }


@pytest.mark.hostile(tried="switchyard routes inspect / stats / diff / align / export --format verl "
                           "on a .syr cut inside its last block",
                     gets="exit 1 naming the file and the damaged block with its byte offset; no "
                          "output file and no .partial (align and export used to write 2 of 3 "
                          "sequences and exit 0)")
def test_every_reading_command_refuses_a_cut_file_and_writes_nothing(damaged):
    d, blocks = damaged
    before = sorted(os.listdir(d))
    for name, args in _reading_commands(d, "cut.syr").items():
        r = _run(*args)
        assert r.returncode == 1, (name, r.stderr)
        assert (f"error: [routes {name}] {d / 'cut.syr'} is damaged (2 sequences readable before "
                f"the damage)") in r.stderr, r.stderr
        assert f"block 2 at byte offset {blocks[2][0]}: truncated block" in r.stderr, r.stderr
        assert "rerun with --salvage" in r.stderr
        assert sorted(os.listdir(d)) == before, name


@pytest.mark.hostile(tried="switchyard routes stats / diff / align / export on a .syr with one "
                           "flipped byte in block 1 (index intact)",
                     gets="exit 1: '<file>: sequence 1 cannot be read: ... payload checksum "
                          "mismatch'; no output file")
def test_a_corrupt_block_fails_every_command_that_decodes_it(damaged):
    d, _ = damaged
    before = sorted(os.listdir(d))
    for name, args in _reading_commands(d, "flipped.syr").items():
        if name == "inspect":  # header and index only: intact
            continue
        r = _run(*args)
        assert r.returncode == 1, (name, r.stderr)
        assert f"{d / 'flipped.syr'}: sequence 1 cannot be read: [route_file]" in r.stderr, r.stderr
        assert "payload checksum mismatch" in r.stderr
        assert sorted(os.listdir(d)) == before, name


@pytest.mark.hostile(tried="switchyard routes align / export --salvage on a cut or corrupted .syr",
                     gets="the readable sequences written, stderr says how many were recovered and "
                          "lost (each lost sequence and why; the unreadable bytes after a cut), "
                          "exit 1")
def test_salvage_keeps_the_readable_sequences_and_still_exits_1(damaged):
    d, blocks = damaged
    r = _run("routes", "align", d / "cut.syr", "-o", d / "out.syr", "--salvage")
    assert r.returncode == 1, r.stderr
    assert (f"[routes align] salvaged {d / 'cut.syr'}: recovered 2 of the 2 sequences found, lost 0 "
            f"damaged, and the file is incomplete") in r.stderr, r.stderr
    assert f"unreadable bytes follow byte offset {blocks[2][0]}" in r.stderr
    assert routes.verify(d / "out.syr")["ok"]
    r = _run("routes", "export", "--format", "verl", d / "flipped.syr", "-o", d / "out",
             "--num-hidden-layers", "4", "--salvage")
    assert r.returncode == 1, r.stderr
    assert "recovered 2 of the 3 sequences found, lost 1 damaged" in r.stderr, r.stderr
    assert "lost sequence 1: [route_file]" in r.stderr
    import numpy as np
    assert np.load(d / "out.routed_experts.npy").shape == (2, 7, 4, 2)


@pytest.mark.hostile(tried="routes.read of a .syr cut inside its last block",
                     gets="DataError naming the file and the damaged block, pointing to RouteFile "
                          "for the readable sequences (it used to return 2 of the 3 tables)")
def test_routes_read_of_a_cut_file_raises_instead_of_returning_part_of_it(damaged):
    d, blocks = damaged
    with pytest.raises(sy.DataError, match=rf"\[routes.read\] .*cut.syr is damaged \(2 sequences "
                                           rf"readable before the damage\): .*block 2 at byte "
                                           rf"offset {blocks[2][0]}: truncated block"):
        routes.read(d / "cut.syr")
    f = routes.RouteFile(d / "cut.syr")  # the recovery reader: what is complete, said so
    assert not f.complete and len(f) == 2
    assert len(routes.read(d / "in.syr")) == 3
