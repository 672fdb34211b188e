"""switchyard.routes: route tables from Python (import, read, write, align, diff), as torch tensors.

A route table is an int32 tensor [tokens, moe_layers, K]: an expert id, or -1 for "no route"
(padding, the last sampled token, a dropped slot), never 0. Functions accept int32 or int64 tables;
``num_experts`` defaults to (largest id + 1) where a function needs it for validation.

    tables = sy.routes.read("routes.syr")                       # list of [T_i, L, K] int32
    sy.routes.write("routes.syr", tables, num_experts=128)
    tables, report = sy.routes.import_vllm(["seq0.npy"], num_experts=128, first_k_dense=1)
    packed, cu, cu_padded = sy.routes.pack_thd(tables, tp_size=2, cp_size=2)
    targets = sy.routes.add_padding(tables, attention_mask)     # [B, S, L, K], -1 at padding
    stats = sy.routes.drift(rollout_table, trainer_table)       # decision / token mismatch

vLLM route data, one entry point per input kind: files on disk (.npy, JSON / JSONL responses, a
recorded stream) -> ``import_vllm``; a response in memory (dict, JSON / JSONL / SSE text, a base64
``routed_experts`` string) -> ``import_vllm_response``; arrays in memory -> ``import_vllm_arrays``;
chunks of a live stream, as they arrive -> ``VllmRouteStream``. They share these options:

Options: num_experts E (every id must be -1 or in [0, E)); first_k_dense, moe_layer_freq,
num_mtp_layers: the layer map (which input layers are MoE, as Megatron-Core's options);
num_input_layers, top_k: checked against the data when given (0: taken from it); zero_rows:
"keep" (default), "to_none" or "error" for all-zero rows on MoE layers (zero-filled padding;
counted in the report either way); invalid_rows: the replay core's policy vocabulary
(switchyard.replay.POLICIES) for rows that repeat an id or mix -1 with ids: "error" (default)
or "native" (stored as -1, so replay routes them natively; counted in
report["num_invalid_rows"]), never stored as if valid; "merge" is refused (a table keeps K
ids per row: replay such rows with merge instead); "to_none" is a deprecated alias of
"native". prompt_start: the request's ``routed_experts_prompt_start`` (routes start at that
token; the tokens before it get -1 rows, so a table has one row per token); a response
record's own ``routed_experts_prompt_start`` field overrides it.

Returns (tables, report): one int32 tensor [seq_len, moe_layers, K] per sequence (the MoE
layers of the layer map; -1 rows for the tokens before prompt_start and for the last token,
which has no route) and a dict (num_sequences, num_tokens, num_input_layers, top_k,
moe_layers, num_zero_rows, first_zero_rows, num_invalid_rows, warnings, sources). Bad input:
ValueError naming the source, sequence, token, layer and value; nothing is returned.
"""
import warnings
from collections.abc import Sequence
from typing import Any

from . import _ids
from . import _switchyard as _C

__all__ = ["read", "write", "RouteFile", "RouteWriter", "verify", "encode", "decode", "import_vllm",
           "import_vllm_arrays", "import_vllm_response", "import_vllm_slot_buffer",
           "import_vllm_aux_blocks", "from_verl", "to_verl", "layer_targets", "import_sglang",
           "import_sglang_text", "import_trtllm", "import_trtllm_arrays",
           "import_flashinfer_replay", "VllmRouteStream", "moe_layer_indices", "moe_layer_freq_from_config",
           "parse_moe_layer_freq", "drop_padding",
           "add_padding", "routed_experts",
           "pack_thd", "unpack_thd", "cp_zigzag_split", "cp_zigzag_gather", "sp_split",
           "sp_gather", "slice_layers", "concat_layers", "concat_tokens", "pp_moe_layer_range",
           "drift", "row_mismatch", "expert_load"]


# Id dtypes the engine reads as they are (verl's int16, vLLM's uint8 / uint16): no widening copy.
_ENGINE_ID_DTYPES = _ids.ENGINE_ID_DTYPES


def _num_experts(tables, num_experts):
    if num_experts is not None:
        return int(num_experts)
    m = 0
    for t in tables:
        if t.numel():
            m = max(m, int(t.max()) + 1)
    return max(m, 1)


# ---- files ----------------------------------------------------------------------------------------
class RouteFile:
    """Random access to a route file: ``len(f)``, ``f[i]`` ([T_i, L, K] int32), ``f.info``
    (num_experts, top_k, num_moe_layers, moe_layers, id_width, version), ``f.complete`` and
    ``f.status`` (a file whose writer died opens in recovery with every complete sequence).

    ``max_decoded_bytes``: the most bytes one sequence (``f[i]``) may decode to (payloads + int32 tables),
    checked against every size a header declares before anything is allocated; None (default): the
    larger of 64 MiB and 1024 x the file's size (real routes decode to ~20x their stored size).
    Past it: switchyard.DataError naming the declared size, the bytes present and the limit."""

    def __init__(self, path, max_decoded_bytes=None):
        self._r = _C.RouteFileReader(str(path), _decode_limit(max_decoded_bytes))

    @classmethod
    def from_bytes(cls, data, max_decoded_bytes=None):
        """A route file held in memory (bytes-like, or a ``routes.encode`` message as bytes);
        corrupt data raises switchyard.DataError. ``max_decoded_bytes`` as for ``RouteFile``."""
        self = cls.__new__(cls)
        self._r = _C.RouteFileReader.from_bytes(bytes(data), _decode_limit(max_decoded_bytes))
        return self

    def __len__(self):
        return len(self._r)

    def __getitem__(self, i):
        n = len(self._r)
        if i < 0:
            i += n
        return self._r.read(i)  # IndexError beyond the end

    def __iter__(self):
        for i in range(len(self._r)):
            yield self._r.read(i)

    @property
    def info(self):
        """The header: num_experts, top_k, num_moe_layers, moe_layers (hidden-layer index of each
        MoE layer), num_hidden_layers, id_width (bytes per stored id), version."""
        return self._r.info

    @property
    def complete(self):
        """False for a file whose writer did not commit (opened in recovery)."""
        return self._r.complete

    @property
    def status(self):
        """What the reader found: complete, or what is missing (a partial block and its byte
        offset) in recovery."""
        return self._r.status

    @property
    def file_size(self):
        """Size of the file in bytes."""
        return self._r.file_size


def read(path, max_decoded_bytes=None):
    """Every sequence of a route file, as a list of int32 tensors [T_i, moe_layers, K].
    ``max_decoded_bytes`` bounds each sequence, as for ``RouteFile``. A file that is not complete
    (cut, its writer killed, its index damaged) raises switchyard.DataError naming the file and
    what the reader found, as a damaged sequence does: never some of the sequences. ``RouteFile``
    reads what is readable of such a file (``complete`` False)."""
    f = RouteFile(path, max_decoded_bytes)
    if not f.complete:
        raise _C.DataError(f"[routes.read] {path} is damaged ({len(f)} sequences readable before "
                           f"the damage): {f.status}; RouteFile(path) reads the readable ones")
    return list(f)


class RouteWriter:
    """Appends sequences to a route file; use as a context manager.

    The file is committed atomically: sequences go to ``<path>.partial`` (same directory, locked
    against a second writer of the same path, which raises ``switchyard.BackendError``), and
    ``close()`` writes the index, fsyncs and renames it over ``path``. Until then an existing file
    at ``path`` is untouched. Leaving the ``with`` block by an exception (KeyboardInterrupt
    included) calls ``abort()``: ``path`` stays as it was and ``<path>.partial`` keeps the sequences
    appended so far, readable in recovery (``RouteFile(...).complete`` is False) until the next
    writer of ``path``. ``moe_layers``: hidden-layer index of every MoE layer (optional).
    One writer may be shared by threads: its calls are serialised (each append lands whole, in
    the order the appends took the writer's lock; an append after close() raises ValueError)."""

    def __init__(self, path, num_experts, top_k, num_moe_layers, moe_layers=None,
                 compression_level=3):
        self.num_experts = int(num_experts)
        self._w = _C.RouteFileWriter(str(path), self.num_experts, int(top_k), int(num_moe_layers),
                                     list(moe_layers or []), int(compression_level))

    @staticmethod
    def partial_path(path):
        """Where a writer of ``path`` writes until it commits (``path + ".partial"``)."""
        return _C.RouteFileWriter.partial_path(str(path))

    def append(self, table):
        """Appends one sequence: ``table`` [T, num_moe_layers, top_k] int32/int64, ids in
        [0, num_experts) or -1 (no route); durable on its own once it returns."""
        self._w.append(table, self.num_experts)

    def close(self):
        """Commits the file (index, fsync, atomic rename over the path)."""
        self._w.close()

    def abort(self):
        """Stops without committing; the partial file stays for recovery."""
        self._w.abort()

    def discard(self):
        """Stops without committing and removes the partial file."""
        self._w.discard()

    @property
    def num_sequences(self):
        """Sequences appended so far."""
        return self._w.num_sequences

    @property
    def bytes_written(self):
        """Bytes written so far (the file's size once closed)."""
        return self._w.bytes_written

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


def write(path, tables, num_experts, moe_layers=None, compression_level=3):
    """Writes tables ([T_i, L, K] int32/int64, same L and K) to a route file, committed
    atomically (see RouteWriter); returns the number of bytes written. On any error the file at
    ``path`` is untouched and no partial file is left behind."""
    tables = _ids.table_list(tables, "routes.write")
    if not tables:
        raise ValueError("[routes.write] tables must hold at least one table")
    L, K = tables[0].shape[1], tables[0].shape[2]
    w = RouteWriter(path, num_experts, K, L, moe_layers, compression_level)
    try:
        for t in tables:
            w.append(t)
    except BaseException:
        w.discard()
        raise
    w.close()
    return w.bytes_written


# ---- wire format ------------------------------------------------------------------------------------
def encode(tables, num_experts, moe_layers=None, num_hidden_layers=0, compression_level=1,
           top_k=None, num_moe_layers=None):
    """Route tables -> one ``torch.uint8`` 1-D tensor to send (torch.distributed, Ray, a queue).

    tables: [T_i, moe_layers, K] int32/int64 (-1 = no route), same layers and K. The bytes are a
    complete route file built in memory (the file's codec: ids in the narrowest width, one match bit
    per id for "same as the previous token's", the others as per-layer popularity ranks, zstd,
    XXH3 checksums; versioned, older versions still decode): self-describing (num_experts, K, the layer
    map ``moe_layers`` / ``num_hidden_layers`` when given, every sequence's length), readable by
    ``decode``, ``RouteFile.from_bytes`` and, saved to disk, by ``read`` and the CLI. Tables are
    encoded on the engine's threads (switchyard.set_num_threads); the bytes do not depend on the
    thread count. ``top_k`` / ``num_moe_layers`` are only needed when ``tables`` is empty."""
    tables = _ids.table_list(tables, "routes.encode")
    if tables and getattr(tables[0], "dim", lambda: 3)() != 3:
        raise ValueError(f"[routes.encode] tables[0] must be [T, moe_layers, K], got shape "
                         f"{list(tables[0].shape)}")
    if tables:
        num_moe_layers, top_k = int(tables[0].shape[1]), int(tables[0].shape[2])
    elif top_k is None or num_moe_layers is None:
        raise ValueError("[routes.encode] an empty batch needs top_k and num_moe_layers")
    return _C.routes_encode(tables, int(num_experts), int(top_k), int(num_moe_layers),
                            [int(m) for m in (moe_layers or [])], int(num_hidden_layers),
                            int(compression_level))


def decode(data, max_decoded_bytes=None):
    """The inverse of ``encode``: ``data`` is the uint8 tensor (read in place, CPU) or bytes-like.
    Returns (tables, meta): the int32 tables [T_i, moe_layers, K] exactly as encoded, and meta
    {num_experts, top_k, num_moe_layers, moe_layers, num_hidden_layers, id_width, version,
    num_tokens (per sequence)}. Anything but a complete, intact message (a flipped byte, a cut,
    trailing bytes, an unknown version) raises switchyard.DataError naming what is wrong.

    ``max_decoded_bytes``: the most bytes the whole message may decode to (payloads + int32 tables),
    checked against every size a header declares before anything is allocated; None (default): the
    larger of 64 MiB and 1024 x the message's size (real routes decode to ~20x their stored size).
    Past it: switchyard.DataError naming the declared size, the bytes present and the limit."""
    return _C.routes_decode(data, _decode_limit(max_decoded_bytes))


def verify(path, max_decoded_bytes=None):
    """Decodes every block; returns {ok, num_sequences, num_readable, num_tokens, problems}.
    ``max_decoded_bytes`` bounds each sequence, as for ``RouteFile`` (a block past it is a
    problem)."""
    return _C.routes_verify(str(path), _decode_limit(max_decoded_bytes))


def _decode_limit(max_decoded_bytes):
    """None -> 0, the engine's word for its default limit; the engine checks the rest."""
    return 0 if max_decoded_bytes is None else max_decoded_bytes


# ---- import -----------------------------------------------------------------------------------------
def _freq(moe_layer_freq):
    if moe_layer_freq is None:
        return []
    if isinstance(moe_layer_freq, str):
        return _C.routes_parse_moe_layer_freq(moe_layer_freq)
    return [int(v) for v in moe_layer_freq]


def _invalid_rows(policy):
    """The importers' invalid_rows in the replay core's vocabulary (switchyard.replay.POLICIES):
    "error" or "native" ("merge" is refused by the engine). "to_none", the old word for "native",
    still works with a DeprecationWarning."""
    if policy == "to_none":
        warnings.warn("invalid_rows='to_none' is deprecated, spell it 'native' (the same meaning: "
                      "the row is stored as -1 and replay routes it natively)", DeprecationWarning,
                      stacklevel=4)
        return "native"
    return policy


def _options(num_experts, first_k_dense=0, moe_layer_freq=None, num_mtp_layers=0,
             num_input_layers=0, top_k=0, zero_rows="keep", invalid_rows="error", prompt_start=0,
             routed_experts_dtype="int32"):
    """The one place the importers' keyword arguments become the engine's options object
    (``_switchyard.RouteImportOptions``, include/switchyard/route_import.h). Every importer checks
    it in the engine first (``check_import_options``: a ValueError naming the field and its value),
    so the checks are not repeated here."""
    return _C.RouteImportOptions(int(num_experts), int(first_k_dense), _freq(moe_layer_freq),
                                 int(num_mtp_layers), int(num_input_layers), int(top_k),
                                 str(zero_rows), _invalid_rows(invalid_rows), int(prompt_start),
                                 str(routed_experts_dtype))


def import_vllm(paths, num_experts, first_k_dense=0, moe_layer_freq=None, num_mtp_layers=0,
                num_input_layers=0, top_k=0, zero_rows="keep", invalid_rows="error",
                prompt_start=0):
    """vLLM route files -> (tables, report). Each path is, told apart by content: a .npy file
    (one sequence's ``routed_experts`` [seq_len-1-prompt_start, num_hidden_layers(+MTP), K]:
    int32, or uint8 / uint16 from vLLM 0.22 on), a JSON / JSONL file of HTTP responses (every
    ``choices[i].routed_experts``, base64 of .npy bytes, is one sequence), or a recorded stream
    (SSE text, one ``data: {...}`` chunk per line; one table per request, in the order they
    finished; a request without its finish_reason chunk is a ValueError).

    Returns (tables, report): one int32 tensor [seq_len, moe_layers, K] per sequence (-1 = no
    route) and a dict of counts; options (layer map, zero_rows, invalid_rows, prompt_start) as in
    the module docstring."""
    return _C.routes_import_vllm([str(p) for p in paths],
                                 _options(num_experts, first_k_dense, moe_layer_freq,
                                          num_mtp_layers, num_input_layers, top_k, zero_rows,
                                          invalid_rows, prompt_start))


def import_vllm_response(response, num_experts, first_k_dense=0, moe_layer_freq=None,
                         num_mtp_layers=0, num_input_layers=0, top_k=0, zero_rows="keep",
                         invalid_rows="error", prompt_start=0):
    """vLLM responses in memory -> (tables, report). ``response``: a parsed HTTP response (dict)
    or a list of them, their JSON / JSONL text (str or bytes; one table per choice), a recorded
    stream's SSE text (``data: {...}`` lines; one table per request), or one choice's
    ``routed_experts`` string itself (base64 of .npy bytes, [seq_len-1-prompt_start, layers, K]
    uint8 / uint16 / int32).

    Returns (tables, report): one int32 tensor [seq_len, moe_layers, K] per sequence (-1 = no
    route) and a dict of counts; options (layer map, zero_rows, invalid_rows, prompt_start) as in
    the module docstring."""
    import json
    o = _options(num_experts, first_k_dense, moe_layer_freq, num_mtp_layers, num_input_layers,
                 top_k, zero_rows, invalid_rows, prompt_start)
    if isinstance(response, (dict, list, tuple)):
        return _C.routes_import_vllm_http_text(json.dumps(response), o)
    if isinstance(response, (bytes, bytearray)):
        response = bytes(response).decode()
    if not isinstance(response, str):
        raise ValueError("[routes.import_vllm_response] response must be a dict, a list, JSON text "
                         f"or a base64 routed_experts string, got {type(response).__name__}")
    head = response.lstrip()
    if head[:1] in ("{", "["):
        return _C.routes_import_vllm_http_text(response, o)
    if not head or head.startswith("data:"):  # a recorded stream (empty: nothing recorded)
        return _C.routes_import_vllm_stream_text(response, o)
    return _C.routes_import_vllm_npy_base64(response, o)


def import_vllm_arrays(arrays, num_experts, first_k_dense=0, moe_layer_freq=None,
                       num_mtp_layers=0, num_input_layers=0, top_k=0, zero_rows="keep",
                       invalid_rows="error", prompt_start=0):
    """vLLM route arrays in memory -> (tables, report): one ``routed_experts`` array per sequence,
    [seq_len-1-prompt_start, num_hidden_layers(+MTP), K], a torch tensor or numpy array of int32,
    int64, int16, uint16 or uint8 (int8 is widened). Validation included, at memory speed (one
    pass; threads across sequences).

    Returns (tables, report): one int32 tensor [seq_len, moe_layers, K] per sequence (-1 = no
    route) and a dict of counts; options (layer map, zero_rows, invalid_rows, prompt_start) as in
    the module docstring."""
    import torch
    ts = []
    for i, a in enumerate(_ids.table_list(arrays, "import", "arrays")):
        t = _ids.as_tensor(a, "import", f"arrays[{i}]")
        # The engine reads int16, uint16, uint8, int32 and int64 as they are (and checks their
        # range itself); int8 is widened, uint32 / uint64 narrowed by the one checked narrowing.
        if t.dtype not in _ENGINE_ID_DTYPES and t.dtype != torch.int64:
            t = _ids.to_int32(t, "import", f"arrays[{i}]")
        ts.append(t.contiguous())
    return _C.routes_import_vllm_arrays(ts, _options(num_experts, first_k_dense, moe_layer_freq,
                                                     num_mtp_layers, num_input_layers, top_k,
                                                     zero_rows, invalid_rows, prompt_start))


def import_vllm_slot_buffer(buffer, requests, block_size, num_experts, **options):
    """vLLM's per-KV-slot route buffer (vLLM 0.30's ``RoutedExpertsManager.routed_experts_by_slot``,
    [num_blocks * block_size, num_hidden_layers, K], uint8 up to 256 experts else uint16, zero
    where no token was forwarded) -> (tables, report), one table per request.

    ``requests``: one (block_ids, num_tokens) or (block_ids, num_tokens, token_start) per request,
    as the engine's scheduler holds them: the request's KV blocks of its attention group, the
    tokens forwarded (``request.num_tokens - 1``: the last sampled token has none) and the rows to
    skip (``routed_experts_prompt_start``). Token t of a request lives in slot
    ``block_ids[t // block_size] * block_size + t % block_size`` (prefix-cached tokens share the
    slots of the request that filled them, so they carry its ids). The gathered rows go through
    ``import_vllm_arrays`` with ``options`` (the layer map, policies; ``prompt_start`` is taken from
    each request's token_start). ValueError naming the request when its blocks cannot hold its
    tokens or a block id is outside the buffer."""
    import numpy as np
    buf = buffer.numpy() if hasattr(buffer, "numpy") and not isinstance(buffer, np.ndarray) \
        else np.asarray(buffer)
    if buf.ndim != 3:
        raise ValueError("[routes.import_vllm_slot_buffer] buffer must be [slots, layers, K], got "
                         f"shape {list(buf.shape)}")
    if int(block_size) < 1 or buf.shape[0] % int(block_size):
        raise ValueError(f"[routes.import_vllm_slot_buffer] block_size must be >= 1 and divide "
                         f"the buffer's {buf.shape[0]} slots, got {block_size}")
    bs, num_blocks = int(block_size), buf.shape[0] // int(block_size)
    options.pop("prompt_start", None)
    tables, report = [], None
    for i, req in enumerate(requests):
        blocks, n = np.asarray(req[0], dtype=np.int64), int(req[1])
        start = int(req[2]) if len(req) > 2 else 0
        if n < 0 or not 0 <= start <= n or n > blocks.size * bs:
            raise ValueError(f"[routes.import_vllm_slot_buffer] request {i}: {n} tokens from "
                             f"token_start {start} do not fit its {blocks.size} blocks of {bs}")
        if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
            raise ValueError(f"[routes.import_vllm_slot_buffer] request {i}: block id "
                             f"{int(blocks.max() if blocks.max() >= num_blocks else blocks.min())}"
                             f" is outside the buffer's [0, {num_blocks}) blocks")
        slots = (blocks[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)[start:n]
        (t,), rep = import_vllm_arrays([buf[slots]], num_experts, prompt_start=start, **options)
        tables.append(t)
        if report is None:
            report = rep
        else:
            for k in ("num_sequences", "num_tokens", "num_zero_rows", "num_invalid_rows"):
                report[k] += rep[k]
    return tables, report


def import_vllm_aux_blocks(blocks, num_tokens, num_input_layers, top_k, num_experts,
                           dtype="uint8", token_start=0, **options):
    """vLLM >= 0.31's aux-output connector payloads of one request -> (tables, report).

    Written from vLLM's source (``vllm/distributed/aux_output_connector``), untested against a
    live engine (it needs Model Runner V2, which does not run on the CPU: docs/guides/vllm.md).
    There the capture is stored per full KV hash block under ``vllm-artifact/<namespace>/<block
    hash hex>``: each object is the C-order bytes of ``[block_size, num_input_layers, top_k]`` ids
    (uint8 up to 256 experts, else uint16); a request's routes are its blocks' payloads
    concatenated in block order, the first ``num_tokens`` rows. ``blocks``: those payloads (bytes
    or numpy arrays), in the request's block order; ``token_start``: rows to skip
    (``routed_experts_prompt_start``; those tokens get -1 rows). The rows then go through
    ``import_vllm_arrays`` (layer map and policies in ``options``). ValueError naming the
    expected and actual contract when a payload's size is not whole rows of that shape and dtype,
    or the blocks hold fewer than num_tokens rows."""
    import numpy as np
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise ValueError("[routes.import_vllm_aux_blocks] dtype must be uint8 or uint16 (the "
                         f"capturer's output dtype), got {dt.name}")
    row = int(num_input_layers) * int(top_k) * dt.itemsize
    if row < 1:
        raise ValueError("[routes.import_vllm_aux_blocks] num_input_layers and top_k must be >= 1,"
                         f" got {num_input_layers} and {top_k}")
    parts = []
    for i, b in enumerate(blocks):
        raw = b.tobytes(order="C") if isinstance(b, np.ndarray) else bytes(b)
        if len(raw) == 0 or len(raw) % row:
            raise ValueError(f"[routes.import_vllm_aux_blocks] block {i}: {len(raw)} bytes is not "
                             f"whole rows of [{num_input_layers} layers, top_k {top_k}] {dt.name} "
                             f"({row} bytes a row)")
        parts.append(raw)
    # a bytearray, so the array is writable (torch.from_numpy warns on read-only memory)
    rows = np.frombuffer(bytearray().join(parts), dtype=dt)
    rows = rows.reshape(-1, int(num_input_layers), int(top_k))
    n, start = int(num_tokens), int(token_start)
    if not 0 <= start <= n <= rows.shape[0]:
        raise ValueError(f"[routes.import_vllm_aux_blocks] expected {n} token rows from "
                         f"token_start {start}, the blocks hold {rows.shape[0]}")
    options.pop("prompt_start", None)
    return import_vllm_arrays([rows[start:n]], num_experts, num_input_layers=num_input_layers,
                              top_k=top_k, prompt_start=start, **options)


def from_verl(routed_experts, attention_mask, num_experts, first_k_dense=0, moe_layer_freq=None,
              num_mtp_layers=0, zero_rows="to_none", invalid_rows="error"):
    """verl's ``routed_experts`` batch tensor -> one route table per sequence, -1 for "no route".

    routed_experts: [batch, seq, num_hidden_layers, K] integers (verl stores int16), padded
    (left or right) and zero-filled where the rollout saw no token; attention_mask [batch, seq]
    (nonzero = real token). Padding is removed by the mask (``drop_padding``); the MoE layers of
    the layer map are kept (``moe_layer_indices``: first_k_dense, moe_layer_freq, MTP layers
    excluded); all-zero rows on MoE layers (tokens the rollout never routed, e.g. the last
    sampled one) become -1 with zero_rows="to_none" (default; "keep" or "error" as in
    import_vllm; with K = 1 a 0 is a real route and is kept); rows that repeat an id or mix -1
    with ids: invalid_rows as in import_vllm. Returns (tables [T_i, moe_layers,
    K] int32, report) with the importer's report (moe_layers, num_zero_rows, ...)."""
    import torch

    ids = routed_experts
    if not isinstance(ids, torch.Tensor) or ids.dtype not in _ENGINE_ID_DTYPES:
        ids = _ids.to_int32(ids, "routes.from_verl", "routed_experts")  # int64 checked
    if ids.dim() != 4:
        raise ValueError("[routes.from_verl] routed_experts must be [batch, seq, layers, K], got "
                         f"{list(ids.shape)}")
    if ids.dtype not in (torch.int16, torch.int32, torch.int64, torch.uint8,
                         getattr(torch, "uint16", torch.int16)):
        ids = ids.to(torch.int32)
    # One engine call for the batch: padding dropped by the mask, MoE layers kept, every row
    # checked (drop_padding + the vLLM importer's rules, without its appended last-token row).
    return _C.routes_from_verl(ids.contiguous(), attention_mask,
                               _options(num_experts, first_k_dense, moe_layer_freq,
                                        num_mtp_layers, zero_rows=zero_rows,
                                        invalid_rows=invalid_rows))


def to_verl(tables, moe_layers, num_hidden_layers, attention_mask=None, padding_side="left",
            seq_len=None, num_experts=None):
    """Route tables -> verl's batch layout, the inverse of from_verl: returns (routed_experts
    int16 [batch, seq, num_hidden_layers, K], attention_mask int64 [batch, seq]).

    Table b ([T_b, moe_layers, K], -1 = no route) fills batch row b; its column m goes to hidden
    layer ``moe_layers[m]`` (the importer's report["moe_layers"]); dense layers, padding and -1
    rows are 0 (verl's convention: the last sampled token has no route). Without
    ``attention_mask`` the rows are padded on ``padding_side`` ("left", verl's default, or
    "right") to ``seq_len`` columns (None = the longest table); with it ([batch, seq], nonzero =
    real token, any pattern) row b's real positions, which must number T_b, receive the table. A
    row mixing -1 with ids has no place in verl's layout (ValueError). from_verl(to_verl(t)) == t
    for tables whose rows are valid top-k rows or all -1; with K = 1 a -1 row comes back as a
    route to expert 0 (verl's 0 cannot tell them apart)."""
    tables = list(tables)
    ids, mask = _C.routes_to_verl(tables, _num_experts(tables, num_experts),
                                  [int(m) for m in moe_layers], int(num_hidden_layers),
                                  attention_mask, str(padding_side),
                                  0 if seq_len is None else int(seq_len))
    return ids, mask  # int16 from the engine


def layer_targets(table, moe_layers, keys, batch_size=None):
    """Per-layer replay targets from a route table [T, moe_layers, K] in the router's token order
    (e.g. after pack_thd / sp_split / cp_zigzag_split): {key: [T, K]} for the keys of this
    pipeline stage's routers (switchyard.integrations.megatron.attach_replay keys: Megatron's
    1-based ``layer_number``; hidden layer = layer_number - 1). ``moe_layers``: hidden-layer
    index of every column of the table (the importer's report["moe_layers"]). Keys that are not
    ints (MTP layers) get no target. ``batch_size``: for a BSHD micro-batch given batch-first
    ([B*S] rows, sequence b's tokens contiguous), the rows are put in the router's
    sequence-first order (Megatron flattens [S, B] hidden states: token s*B + b)."""
    if batch_size is not None:
        B = int(batch_size)
        if B < 1 or table.shape[0] % B:
            raise ValueError(f"[routes.layer_targets] batch_size must divide the {table.shape[0]} "
                             f"rows, got batch_size={batch_size}")
        S = table.shape[0] // B
        table = table.reshape(B, S, *table.shape[1:]).transpose(0, 1).reshape(S * B,
                                                                             *table.shape[1:])
    col = {int(h): i for i, h in enumerate(moe_layers)}
    views = table.unbind(1)  # every layer's [T, K] view in one call (no copy)
    out = {}
    for k in keys:
        if not isinstance(k, int):
            continue
        if k - 1 not in col:
            raise ValueError(f"[routes.layer_targets] layer {k} (hidden layer {k - 1}) is not a "
                             f"MoE layer of the table (moe_layers={list(moe_layers)})")
        out[k] = views[col[k - 1]]
    return out


def import_sglang(paths, num_experts, num_input_layers, top_k, first_k_dense=0,
                  moe_layer_freq=None, num_mtp_layers=0, zero_rows="keep", invalid_rows="error",
                  start_len=0, routed_experts_dtype="int32"):
    """SGLang responses (JSON / JSONL with meta_info.routed_experts, base64) -> (tables, report).
    A response with ``meta_info.routed_experts_start_len`` covers tokens [start_len, seq_len - 1):
    the tokens before it get -1 rows (one row per token); ``start_len`` is used for records
    without that field. OpenAI-compatible /v1/completions and /v1/chat/completions responses
    (``choices[i].sgl_ext.routed_experts``, or ``choices[i].routed_experts`` on older servers) give
    one table per choice; their ``routed_experts_start_len`` is the request's (saved next to the
    response as a top-level field, else ``start_len``). ``routed_experts_dtype``: the payload's
    id width, "int32" (SGLang today) or the narrow "uint8" / "uint16" proposed in
    sgl-project/sglang#31219 (a wrapped -1 is an id outside [0, num_experts) and refused)."""
    return _C.routes_import_sglang([str(p) for p in paths],
                                   _options(num_experts, first_k_dense, moe_layer_freq,
                                            num_mtp_layers, num_input_layers, top_k, zero_rows,
                                            invalid_rows, start_len, routed_experts_dtype))


def import_sglang_text(text, num_experts, num_input_layers, top_k, first_k_dense=0,
                       moe_layer_freq=None, num_mtp_layers=0, zero_rows="keep",
                       invalid_rows="error", start_len=0, routed_experts_dtype="int32"):
    """The same as import_sglang over a string."""
    return _C.routes_import_sglang_text(text, _options(num_experts, first_k_dense, moe_layer_freq,
                                                       num_mtp_layers, num_input_layers, top_k,
                                                       zero_rows, invalid_rows, start_len,
                                                       routed_experts_dtype))


# ---- engine layouts beyond vLLM / SGLang (notes/routes.md, "Engine layouts") ---------------------
def _widened(a, name):
    """A CPU int32/int64/uint8 tensor for the engine: int16 / uint16 / int8 widened to int32."""
    import torch
    t = _ids.as_tensor(a, "routes.import", name)
    if t.dtype not in (torch.int32, torch.int64, torch.uint8):
        t = _ids.to_int32(t.to("cpu"), "routes.import", name)  # checked, never wrapped
    elif t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def import_trtllm(paths, num_experts, first_k_dense=0, moe_layer_freq=None, num_mtp_layers=0,
                  num_input_layers=0, top_k=0, zero_rows="keep", invalid_rows="error",
                  prompt_start=0):
    """TensorRT-LLM ``CompletionOutput.routed_experts`` saved as .npy (one file per sequence)
    -> (tables, report). The arrays are ``[seq_len-1, num_moe_layers, K]`` logical (pre-EPLB) ids:
    the layer axis holds only MoE layers, so nothing is dropped; the layer map (first_k_dense or
    moe_layer_freq) only names each column's hidden layer (report["moe_layers"]), and
    num_mtp_layers trailing columns are left out. A -1 row is appended for the last token."""
    return _C.routes_import_trtllm([str(p) for p in paths],
                                   _options(num_experts, first_k_dense, moe_layer_freq,
                                            num_mtp_layers, num_input_layers, top_k, zero_rows,
                                            invalid_rows, prompt_start))


def import_trtllm_arrays(arrays, num_experts, first_k_dense=0, moe_layer_freq=None,
                         num_mtp_layers=0, num_input_layers=0, top_k=0, zero_rows="keep",
                         invalid_rows="error", prompt_start=0):
    """The same as import_trtllm over arrays in memory (torch or numpy, any integer dtype; int16
    is widened), e.g. ``[o.routed_experts for o in request_output.outputs]``."""
    ts = [_widened(a, f"arrays[{i}]") for i, a in enumerate(arrays)]
    return _C.routes_import_trtllm_arrays(ts, _options(num_experts, first_k_dense,
                                                       moe_layer_freq, num_mtp_layers,
                                                       num_input_layers, top_k, zero_rows,
                                                       invalid_rows, prompt_start))


def import_flashinfer_replay(layers, cu_seqlens, num_experts, first_k_dense=0,
                             moe_layer_freq=None, num_mtp_layers=0, top_k=0, zero_rows="keep",
                             invalid_rows="error"):
    """FlashInfer fused-MoE ``routing_replay_out`` buffers of one batch -> (tables, report).

    layers: one int16 ``[N, top_k]`` buffer per MoE layer, in layer order (then num_mtp_layers
    MTP layers, left out), or all of them stacked as ``[num_moe_layers, N, top_k]``; CUDA
    tensors are copied to the host. cu_seqlens: ``[0, n_0, n_0 + n_1, ...]`` splits the batch's
    tokens into sequences (rows past its end, e.g. of an oversized buffer, are ignored). Each
    table has exactly its sequence's rows: every token of the batch was routed. Ids, rows and
    the layer map as in import_trtllm."""
    import torch
    if isinstance(layers, torch.Tensor) and layers.dim() == 3:
        layers = list(layers.unbind(0))
    ts = [_widened(a, f"layers[{i}]") for i, a in enumerate(layers)]
    cu = [int(v) for v in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
    return _C.routes_import_flashinfer_replay(ts, cu, _options(num_experts, first_k_dense,
                                                               moe_layer_freq, num_mtp_layers,
                                                               len(ts), top_k, zero_rows,
                                                               invalid_rows))


class VllmRouteStream:
    """Assembles vLLM routes that arrive in pieces (streamed responses), per request.

    vLLM's streaming ``/inference/v1/generate`` chunks carry ``choices[i].routed_experts`` (base64
    .npy, or null) next to the chunk's delta ``token_ids``: either once, on the chunk where the
    engine has them (the whole array), or per chunk, sliced to the tokens it emits. Each piece is
    validated as it arrives (layer count and K against the first piece, ids and rows as
    import_vllm, token positions: a gap or an overlap is a ValueError naming the request and the
    chunk), and a piece that fails changes nothing.

        stream = routes.VllmRouteStream(num_experts=128, first_k_dense=1)
        for line in sse_lines:
            for key, (table, report) in stream.add_chunk(line).items():
                ...                                  # key = "<request_id>/<choice index>"

    Layer-map arguments as in import_vllm; prompt_start: routed_experts_prompt_start of every
    request (set_prompt_start sets one request's)."""

    def __init__(self, num_experts, first_k_dense=0, moe_layer_freq=None, num_mtp_layers=0,
                 num_input_layers=0, top_k=0, zero_rows="keep", invalid_rows="error",
                 prompt_start=0):
        self._s = _C.VllmRouteStream(_options(num_experts, first_k_dense, moe_layer_freq,
                                              num_mtp_layers, num_input_layers, top_k, zero_rows,
                                              invalid_rows, prompt_start))

    def add(self, request_id, routes, start=None, new_tokens=None, prompt_tokens=None):
        """One piece of ``request_id``: routes ``[rows, layers, K]`` (tensor / ndarray, or a base64
        .npy string / .npy bytes as vLLM sends them) of tokens [start, start + rows); start None:
        right after the previous piece. new_tokens: tokens the chunk emitted; prompt_tokens: the
        prompt length (both optional; with them the piece's end is checked against vLLM's
        invariant: routes cover tokens [prompt_start, prompt + generated - 1))."""
        args = (-1 if start is None else int(start), -1 if new_tokens is None else int(new_tokens),
                -1 if prompt_tokens is None else int(prompt_tokens))
        if isinstance(routes, str):
            import base64
            import binascii
            try:
                routes = base64.b64decode(routes, validate=True)
            except binascii.Error as e:
                raise ValueError(f"[import] request '{request_id}': routed_experts is not base64: "
                                 f"{e}") from None
        if isinstance(routes, (bytes, bytearray, memoryview)):
            self._s.add_npy(str(request_id), bytes(routes), *args)
        else:
            self._s.add(str(request_id), _widened(routes, "routes"), *args)

    def add_tokens(self, request_id, new_tokens, prompt_tokens=None):
        """Tokens a chunk emitted without routes."""
        self._s.add_tokens(str(request_id), int(new_tokens),
                           -1 if prompt_tokens is None else int(prompt_tokens))

    def set_prompt_start(self, request_id, prompt_start):
        """The request's ``routed_experts_prompt_start``: its routes begin at that token, and the
        tokens before it get -1 rows in the finished table."""
        self._s.set_prompt_start(str(request_id), int(prompt_start))

    def add_chunk(self, chunk):
        """One streamed chunk: a parsed dict, or the SSE event text (``data: {...}``; ``[DONE]`` is
        ignored). Returns {key: (table, report)} for the requests this chunk finished
        (``finish_reason`` set); key = "<request_id>/<choice index>"."""
        import json
        if isinstance(chunk, dict):
            chunk = json.dumps(chunk)
        elif isinstance(chunk, (bytes, bytearray)):
            chunk = bytes(chunk).decode()
        done = self._s.add_sse(chunk)
        return {key: self.finish(key) for key in done}

    def finish(self, request_id):
        """Ends a request: (table [tokens, moe_layers, K] int32, report)."""
        tables, report = self._s.finish(str(request_id))
        return tables[0], report

    def pending(self):
        """Requests with pieces and no finish yet."""
        return list(self._s.pending())


def import_vllm_stream(source, num_experts, **options):
    """Deprecated: a recorded stream is one more kind of file / response. Use
    ``import_vllm([path], ...)`` for a file and ``import_vllm_response(text, ...)`` for SSE text
    in memory (same tables, same report, same errors)."""
    import os
    warnings.warn("switchyard.routes.import_vllm_stream is deprecated: use import_vllm([path]) "
                  "for a file, import_vllm_response(text) for SSE text in memory",
                  DeprecationWarning, stacklevel=2)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                           and os.path.isfile(source)):
        return import_vllm([source], num_experts, **options)
    if isinstance(source, (bytes, bytearray)):
        source = bytes(source).decode()
    return _C.routes_import_vllm_stream_text(source, _options(num_experts, **options))


def moe_layer_indices(num_input_layers, first_k_dense=0, moe_layer_freq=None, num_mtp_layers=0):
    """Hidden-layer indices of the MoE layers (Megatron-Core's layer map), a list of ints.
    ``num_input_layers``: the routes' layer count (the hidden layers, then ``num_mtp_layers`` MTP
    layers, which are never included); a hidden layer is MoE when ``moe_layer_freq`` (a 0/1 per
    hidden layer, or "3x0,45x1") says 1, else when its index is >= ``first_k_dense``."""
    return _C.routes_moe_layer_indices(int(first_k_dense), _freq(moe_layer_freq),
                                       int(num_mtp_layers), int(num_input_layers))


def moe_layer_freq_from_config(config):
    """A model config -> ``moe_layer_freq``: one 0 (dense MLP) or 1 (MoE) per hidden layer, the
    layer map every importer takes. ``config``: a transformers ``PretrainedConfig`` (its text
    config is used for multimodal models) or a dict of its fields. Read, first found:
    ``mlp_layer_types`` ("sparse" / "moe" = 1; transformers 5's per-layer list); ``moe_layers``
    (a list of MoE layer indices, Llama 4);
    ``first_k_dense_replace`` with ``moe_layer_freq`` (DeepSeek-V2/V3, GLM-4.5, Kimi: layer i is
    MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0, or the list's entry);
    ``mlp_only_layers`` with ``decoder_sparse_step`` (Qwen2/3-MoE: MoE unless listed, and when
    (i + 1) % step == 0); ``interleave_moe_layer_step`` (Llama 4: MoE when (i + 1) % step == 0);
    else every layer is MoE. ValueError when the config has no ``num_hidden_layers``, a per-layer
    list of another length or a layer index out of range.

    The one place switchyard reads the MoE / dense layer pattern of a config: pass the result as
    ``moe_layer_freq`` to the importers (routes with every hidden layer on their layer axis, as
    vLLM and SGLang return them) or to ``moe_layer_indices``."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    if not isinstance(config, dict) and callable(getattr(config, "get_text_config", None)):
        text = config.get_text_config()
        get = lambda k, d=None: getattr(text, k, d)  # noqa: E731
    n = get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise ValueError("[routes.moe_layer_freq_from_config] config.num_hidden_layers must be an "
                         f"int >= 1, got {n!r}")

    def per_layer(name, values):
        if len(values) != n:
            raise ValueError(f"[routes.moe_layer_freq_from_config] config.{name} has {len(values)} "
                             f"entries, expected num_hidden_layers={n}")
        return values

    if get("mlp_layer_types") is not None:
        kinds = per_layer("mlp_layer_types", list(get("mlp_layer_types")))
        return [1 if str(k).lower() in ("sparse", "moe") else 0 for k in kinds]
    if isinstance(get("moe_layers"), (list, tuple)):
        moe = {int(i) for i in get("moe_layers")}
        if any(i < 0 or i >= n for i in moe):
            raise ValueError("[routes.moe_layer_freq_from_config] config.moe_layers "
                             f"{sorted(moe)} names a layer outside [0, num_hidden_layers={n})")
        return [1 if i in moe else 0 for i in range(n)]
    if get("first_k_dense_replace") is not None:
        k = int(get("first_k_dense_replace"))
        freq = get("moe_layer_freq", 1)
        if isinstance(freq, (list, tuple)):
            freq = per_layer("moe_layer_freq", [int(v) for v in freq])
            return [1 if i >= k and freq[i] else 0 for i in range(n)]
        return [1 if i >= k and i % int(freq or 1) == 0 else 0 for i in range(n)]
    if get("mlp_only_layers") is not None or get("decoder_sparse_step") is not None:
        dense = set(int(i) for i in (get("mlp_only_layers") or ()))
        step = int(get("decoder_sparse_step") or 1)
        return [1 if i not in dense and (i + 1) % step == 0 else 0 for i in range(n)]
    if get("interleave_moe_layer_step") is not None:
        step = int(get("interleave_moe_layer_step") or 1)
        return [1 if (i + 1) % step == 0 else 0 for i in range(n)]
    return [1] * n


def parse_moe_layer_freq(text):
    """"3x0,45x1" -> [0, 0, 0, 1, ...]."""
    return _C.routes_parse_moe_layer_freq(text)


# ---- align ------------------------------------------------------------------------------------------
def drop_padding(topk_idx, attention_mask, num_experts=None):
    """[batch, seq, L, K] ids (int16, uint16, uint8, int32 read as they are; int64 / int8
    narrowed / widened first) and a [batch, seq] mask (nonzero = real) -> one int32 table per
    row; ids must be -1 or in [0, num_experts)."""
    import torch

    ids = topk_idx
    if not isinstance(ids, torch.Tensor) or ids.dtype not in _ENGINE_ID_DTYPES:
        ids = _ids.to_int32(ids, "routes.drop_padding", "topk_idx")
    return _C.routes_drop_padding(ids, attention_mask, _num_experts([ids], num_experts))


# ---- batch layout (trainer-side targets, captured routes) -----------------------------------------
def add_padding(tables, attention_mask=None, padding_side=None, seq_len=None):
    """Route tables -> one padded batch, the inverse of drop_padding: int32 [batch, seq, L, K],
    -1 (no route: the router routes natively) at padding.

    ``tables``: one [T_b, L, K] table per sequence (int32, or int64 / int16 / uint8 checked and
    narrowed or widened; every table the same L and K), in batch order. With ``attention_mask``
    ([batch, seq], nonzero = real token, any pattern: left, right or inner padding) row b's real
    positions, which must number T_b, receive table b's rows in order; the mask decides where the
    padding is, so ``padding_side`` and ``seq_len`` must be None. Without it, ``padding_side``
    "left" or "right" pads every row to ``seq_len`` columns (None = the longest table), and
    ``padding_side=None`` (default) takes tables of one length as they are (stacked)."""
    import torch

    op = "routes.add_padding"
    tables = [_ids.to_int32(_ids.as_tensor(t, op, f"tables[{i}]"), op, f"tables[{i}]").to("cpu")
              for i, t in enumerate(_ids.table_list(tables, op))]
    if not tables:
        raise ValueError(f"[{op}] tables must hold at least one table, got none")
    for i, t in enumerate(tables):
        if t.dim() != 3 or t.shape[1:] != tables[0].shape[1:]:
            raise ValueError(f"[{op}] tables must be [T, L, K] with the L and K of tables[0] "
                             f"({list(tables[0].shape[1:])}), got tables[{i}] of shape "
                             f"{list(t.shape)}")
    L, K = tables[0].shape[1:]
    lengths = [t.shape[0] for t in tables]
    if attention_mask is not None:
        if padding_side is not None or seq_len is not None:
            raise ValueError(f"[{op}] with an attention_mask the mask places the rows: "
                             f"padding_side and seq_len must be None, got padding_side="
                             f"{padding_side!r}, seq_len={seq_len!r}")
        m = torch.as_tensor(attention_mask).to("cpu").bool()
        if m.dim() != 2 or m.shape[0] != len(tables):
            raise ValueError(f"[{op}] attention_mask must be [{len(tables)}, S], got "
                             f"{list(m.shape)}")
        out = torch.full((m.shape[0], m.shape[1], L, K), -1, dtype=torch.int32)
        for b, t in enumerate(tables):
            n = int(m[b].sum())
            if n != t.shape[0]:
                raise ValueError(f"[{op}] sequence {b}: the attention mask has {n} real tokens, "
                                 f"the routes {t.shape[0]}")
            out[b][m[b]] = t
        return out
    if padding_side is None:
        if seq_len is not None or len(set(lengths)) != 1:
            raise ValueError(f"[{op}] sequences of different lengths {sorted(set(lengths))} (or "
                             "a seq_len) need an attention_mask [B, S] or a padding_side "
                             "('left' / 'right') to place them")
        return torch.stack(tables)
    if padding_side not in ("left", "right"):
        raise ValueError(f"[{op}] padding_side must be None, 'left' or 'right', got "
                         f"{padding_side!r}")
    S = max(lengths) if seq_len is None else int(seq_len)
    if S < max(lengths):
        raise ValueError(f"[{op}] seq_len={S} is shorter than the longest table "
                         f"({max(lengths)} rows)")
    out = torch.full((len(tables), S, L, K), -1, dtype=torch.int32)
    for b, t in enumerate(tables):
        n = t.shape[0]
        if padding_side == "left":
            out[b, S - n:] = t
        else:
            out[b, :n] = t
    return out


def routed_experts(ids, attention_mask=None, final_token_fed=False):
    """Routes of every fed token -> vLLM's ``routed_experts`` per sequence: a list of int32
    tensors [num_tokens - 1, num_hidden_layers, K] (vLLM routes every token but the last).

    ``ids``: [B, S, num_hidden_layers, K] int32 (int64 checked), row b's s-th fed token at
    [b, s] (what a capture over ``generate()`` holds: the prefill, then one column per decode
    step), dense layers 0. ``attention_mask`` (nonzero = real token): [B, S + 1] over the
    generated sequences (prompt + new tokens; the last column was never fed), or [B, S] over the
    fed tokens; None = every fed token is real and the final token of each sequence was not fed
    (all S rows).

    Which row is a sequence's last token (no route, dropped): with the [B, S + 1] mask, a sequence
    real at the last column has its final token there (never fed: every fed real row is kept); one
    that ended earlier fed its last token too, and that row is dropped. With the [B, S] mask and
    ``final_token_fed=False`` (a generate() capture: the final column's token was generated, never
    fed), a sequence real at the last fed column goes on past it (every real row kept) and one
    that ended earlier drops its last real row. ``final_token_fed=True`` (a capture of plain
    forwards over whole sequences) drops every sequence's last real row."""
    import torch

    op = "routes.routed_experts"
    ids = _ids.to_int32(ids, op, "ids", (torch.int64, torch.int32)).to("cpu")
    if ids.dim() != 4:
        raise ValueError(f"[{op}] ids must be [B, S, num_hidden_layers, K], got "
                         f"{list(ids.shape)}")
    B, S = ids.shape[:2]
    if attention_mask is None:
        return [ids[b] for b in range(B)]
    m = torch.as_tensor(attention_mask).to("cpu")
    if m.dim() != 2 or m.shape[0] != B or m.shape[1] not in (S, S + 1):
        raise ValueError(f"[{op}] attention_mask must be [{B}, {S + 1}] (generated sequences) "
                         f"or [{B}, {S}] (fed tokens), got {list(m.shape)}")
    m = m.bool()
    generated = m.shape[1] == S + 1
    out = []
    for b in range(B):
        rows = ids[b][m[b, :S]]
        # No route for a sequence's last token: drop the last fed real token's route unless the
        # sequence goes on to the unfed final column.
        goes_on = bool(m[b, S]) if generated else (not final_token_fed and bool(m[b, S - 1]))
        if not goes_on:
            rows = rows[:-1]
        out.append(rows.contiguous())
    return out


def pack_thd(tables, tp_size=1, cp_size=1, fp8_align=0, num_experts=None):
    """Packs tables end to end (THD), each padded with -1 rows to Megatron-Core's alignment.

    tables: [T_i, L, K] int32/int64. The per-sequence padding multiple is ``tp_size`` (cp 1) or
    ``2 * tp_size * cp_size``, then the lcm with ``fp8_align`` (0 = none, 16 or 128). Returns
    (packed int32 [sum of padded T_i, L, K], cu_seqlens, cu_seqlens_padded): the cumulative real and
    padded lengths, lists of len(tables) + 1 ints starting at 0."""
    tables = list(tables)
    return _C.routes_pack_thd(tables, _num_experts(tables, num_experts), int(tp_size),
                              int(cp_size), int(fp8_align))


def unpack_thd(packed, cu_seqlens, cu_seqlens_padded, num_experts=None):
    """Inverse of pack_thd: packed [N, L, K] and its cu_seqlens / cu_seqlens_padded -> the real
    rows of each sequence, a list of int32 [T_i, L, K]."""
    return _C.routes_unpack_thd(packed, list(cu_seqlens), list(cu_seqlens_padded),
                                _num_experts([packed], num_experts))


def cp_zigzag_split(packed, cu_seqlens_padded, cp_size, cp_rank, num_experts=None):
    """Context-parallel zigzag piece of a packed table for cp_rank: each padded sequence of
    ``packed`` [N, L, K] (cu_seqlens_padded from pack_thd) is cut into 2 * cp_size chunks and rank r
    keeps chunks r and 2 * cp_size - 1 - r. Returns int32 [N / cp_size, L, K]."""
    return _C.routes_cp_zigzag_split(packed, list(cu_seqlens_padded), int(cp_size), int(cp_rank),
                                     _num_experts([packed], num_experts))


def cp_zigzag_gather(pieces, cu_seqlens_padded, num_experts=None):
    """Inverse of cp_zigzag_split: pieces (int32 [N / cp, L, K], indexed by cp rank) -> the packed
    table int32 [N, L, K]."""
    pieces = list(pieces)
    return _C.routes_cp_zigzag_gather(pieces, list(cu_seqlens_padded),
                                      _num_experts(pieces, num_experts))


def sp_split(table, tp_size, tp_rank, num_experts=None):
    """Sequence-parallel piece: the tp_rank-th of tp_size contiguous blocks of the tokens of
    ``table`` [T, L, K] (T divisible by tp_size, as pack_thd pads). Returns int32 [T / tp_size, L,
    K]."""
    return _C.routes_sp_split(table, int(tp_size), int(tp_rank), _num_experts([table], num_experts))


def sp_gather(pieces, num_experts=None):
    """Inverse of sp_split: the pieces ([T / tp, L, K], in tp-rank order) end to end, int32
    [T, L, K]."""
    pieces = list(pieces)
    return _C.routes_sp_gather(pieces, _num_experts(pieces, num_experts))


def slice_layers(table, begin, end, num_experts=None):
    """MoE layers [begin, end) of ``table`` [T, L, K] (e.g. from pp_moe_layer_range): int32
    [T, end - begin, K]."""
    return _C.routes_slice_layers(table, int(begin), int(end), _num_experts([table], num_experts))


def concat_layers(pieces, num_experts=None):
    """Inverse of slice_layers: pieces [T, L_i, K] of the same tokens side by side, int32
    [T, sum L_i, K]."""
    pieces = list(pieces)
    return _C.routes_concat_layers(pieces, _num_experts(pieces, num_experts))


def concat_tokens(pieces, num_experts=None):
    """Tables [T_i, L, K] end to end (no padding): int32 [sum T_i, L, K]."""
    pieces = list(pieces)
    return _C.routes_concat_tokens(pieces, _num_experts(pieces, num_experts))


def pp_moe_layer_range(moe_layers, num_hidden_layers, pp_size=1, pp_rank=0, vpp_size=1,
                       vpp_rank=0, first_stage_layers=0, last_stage_layers=0):
    """MoE-layer range (begin, end) that a (virtual) pipeline chunk owns: the hidden layers are
    split evenly over pp_size * vpp_size chunks (chunk vpp_rank * pp_size + pp_rank; or uneven
    first / last stage sizes), and a chunk owns the MoE layers among its hidden layers.
    ``moe_layers``: hidden-layer index of each MoE layer. Use with slice_layers."""
    return _C.routes_pp_moe_layer_range(list(moe_layers), int(num_hidden_layers), int(pp_size),
                                        int(pp_rank), int(vpp_size), int(vpp_rank),
                                        int(first_stage_layers), int(last_stage_layers))


# ---- statistics -------------------------------------------------------------------------------------
def drift(a, b, num_experts=None):
    """Mismatch between two routings of the same tokens: ``a`` and ``b`` are tables [T, L, K] (or
    lists of them) of the same shape. Rows compare as sets where both have a route. Returns a
    dict: num_tokens, num_rows, num_decisions, num_differing_decisions / rows / tokens,
    num_skipped_rows, decision_mismatch, token_mismatch (floats in [0, 1]),
    mean_differing_layers, layer_mismatch (one float per layer)."""
    if isinstance(a, (list, tuple)):
        return _C.routes_drift_many(list(a), list(b), _num_experts(list(a) + list(b), num_experts))
    return _C.routes_drift(a, b, _num_experts([a, b], num_experts))


def row_mismatch(reference: Any, tables: Sequence[Any], token_mask: Any = None,
                 top_ks: Sequence[int] | None = None) -> tuple[int, list[int]]:
    """A router mismatch metric: for each of ``tables``, the rows (token, layer) whose expert set
    differs from ``reference``'s, in one engine pass (no sort of the tables as tensors).

    A row is compared where every one of the reference's K slots holds an id (a row with any
    negative id is not a route) and ``token_mask`` keeps its token; a compared row differs where
    its K ids differ from the reference row's as multisets (each row sorted, then compared slot by
    slot; the order of a top-k row does not change which experts run). Ids are not checked against
    an expert count: any value compares (an id outside int32 saturates to int32's range, which no
    router's id equals).

    Args:
        reference: [..., L, K] integer ids (any integer dtype and device), e.g. a rollout's routes
            [B, S, L, K].
        tables: a list of integer id tensors of the reference's shape, e.g. the trainer routers'
            own choice and the ids they used (``hf.Capture.moe_ids``).
        token_mask: None (every token), or the reference's leading dimensions ([B, S] for a
            [B, S, L, K] reference: an attention mask), nonzero = compared.
        top_ks: None (every layer routes to K experts), or one K_l in [1, K] per layer: layer l's
            rows are their first K_l slots (tables as wide as the largest K hold -1 past a
            smaller layer's own: HunYuan's per-layer ``moe_topk``).

    Returns:
        (compared rows, [differing rows per table]), ints.

    Raises:
        ValueError: for a reference that is not [..., L, K], a table of another shape, a mask of
            another shape, a non-integer dtype or top_ks of another length or outside [1, K],
            naming the argument.
    """
    import torch
    op = "row_mismatch"
    ref = _ids.as_tensor(reference, op, "reference")
    if ref.dim() < 2:
        raise ValueError(f"[{op}] reference must be [..., L, K], got shape {list(ref.shape)}")
    L, K = ref.shape[-2], ref.shape[-1]

    def host32(t, name):
        return _ids.to_int32(t.detach().to("cpu"), op, name, saturate=True).reshape(-1, L, K)
    tabs = []
    for i, t in enumerate(_ids.table_list(tables, op)):
        t = _ids.as_tensor(t, op, f"tables[{i}]")
        if t.shape != ref.shape:
            raise ValueError(f"[{op}] tables[{i}] must have the reference's shape "
                             f"{list(ref.shape)}, got {list(t.shape)}")
        tabs.append(host32(t, f"tables[{i}]"))
    mask = None
    if token_mask is not None:
        mask = torch.as_tensor(token_mask)
        if mask.shape != ref.shape[:-2]:
            raise ValueError(f"[{op}] token_mask must have the reference's leading dimensions "
                             f"{list(ref.shape[:-2])}, got {list(mask.shape)}")
        mask = mask.detach().to("cpu").reshape(-1)
        if mask.dtype != torch.bool:
            mask = mask != 0
    ks = [] if top_ks is None else [int(k) for k in top_ks]
    compared, differing = _C.routes_row_mismatch(host32(ref, "reference"), tabs, mask, ks)
    return int(compared), [int(d) for d in differing]


def expert_load(tables, num_experts=None):
    """Per-layer expert load of tables [T_i, L, K]: (counts int64 [L, E], all -1 rows per layer,
    max/mean load per layer)."""
    if not isinstance(tables, (list, tuple)):
        tables = [tables]
    return _C.routes_expert_load(list(tables), _num_experts(tables, num_experts))
