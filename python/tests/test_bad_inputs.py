"""Bad inputs across the Python API (switchyard, switchyard.torch, switchyard.routes): each row is one
call with one thing wrong, the exception type it must raise and a piece of its message. These rows
are the Python part of the README's table of bad inputs (notes/reliability.md); with
SY_BAD_INPUT_TABLE_PY=<file> set, the test writes that table from the messages it actually got."""
import os

import pytest
import torch

import switchyard as sy
import switchyard.routes as syr
import switchyard.torch as syt


def _cfg(E=8, K=2, **kw):
    return sy.RouterConfig(num_experts=E, top_k=K, **kw)


def _route_file(tmp_path):
    p = tmp_path / "small.syr"
    syr.write(str(p), [torch.full((3, 1, 2), -1, dtype=torch.int32)], num_experts=8)
    return str(p)


def _nan_x():
    x = torch.zeros(3, 4)
    x[1, 2] = float("nan")
    return x


def _inf_logits():
    lg = torch.zeros(2, 8)
    lg[1, 3] = float("inf")
    return lg


def _combine_inf():
    d = syt.AlltoAllDispatcher(8)
    rx, _, h = d.dispatch(torch.zeros(2, 4), torch.full((2, 2), 0.5), torch.tensor([[0, 1], [3, 2]]))
    return d.combine(torch.full_like(rx, float("inf")), h)


def _two_writers(tmp_path):
    with syr.RouteWriter(tmp_path / "w.syr", num_experts=8, top_k=2, num_moe_layers=1):
        syr.RouteWriter(tmp_path / "w.syr", num_experts=8, top_k=2, num_moe_layers=1)


def _dup_npy(tmp_path):
    import numpy as np
    p = tmp_path / "dup.npy"
    np.save(p, np.array([[[3, 3]]], dtype=np.int32))
    return p


ROWS = [
    # call, input tried, exception, message piece, thunk(tmp_path)
    ("sy.set_num_threads", "0 threads", ValueError, "n must be >= 1",
     lambda t: sy.set_num_threads(0)),
    ("sy.set_num_threads", "100000 threads (the OpenMP runtime crashed)", ValueError,
     "n must be <= 1024", lambda t: sy.set_num_threads(100000)),
    ("syt.topk_route", "RouterConfig with an unknown score function", ValueError, "softmx",
     lambda t: syt.topk_route(torch.zeros(2, 8), _cfg(score_function="softmx"))),
    ("syt.router_gating_linear", "hidden of x and weight differ", ValueError, "[router_gating_linear]",
     lambda t: syt.router_gating_linear(torch.zeros(3, 4), torch.zeros(8, 5))),
    ("syt.router_gating_linear", "NaN in x", ValueError, "non-finite value nan at token 1, hidden 2",
     lambda t: syt.router_gating_linear(_nan_x(), torch.zeros(8, 4))),
    ("syt.router_gating_linear", "x is a list", (ValueError, TypeError), "x",
     lambda t: syt.router_gating_linear([[1.0]], torch.zeros(8, 1))),
    ("syt.topk_route", "top_k > num_experts", ValueError, "top_k",
     lambda t: syt.topk_route(torch.zeros(2, 4), _cfg(E=4, K=5))),
    ("syt.topk_route", "logits of 8 experts for a 6-expert config", ValueError, "logits must have shape [*, 6], got [2, 8]",
     lambda t: syt.topk_route(torch.zeros(2, 8), _cfg(E=6, K=2))),
    ("syt.topk_route", "+inf logit", ValueError, "token 1",
     lambda t: syt.topk_route(_inf_logits(), _cfg())),
    ("syt.topk_route", "int64 logits", ValueError, "logits",
     lambda t: syt.topk_route(torch.zeros(2, 8, dtype=torch.int64), _cfg())),
    ("syt.topk_route", "replay id 9 with 8 experts", ValueError, "token 1: topk_idx row [2, 9] names expert 9 outside [0, 8)",
     lambda t: syt.topk_route(torch.zeros(2, 8), _cfg(),
                              inputs=syt.RouteInputs(replay_idx=torch.tensor([[0, 1], [2, 9]])))),
    ("syt.topk_route", "config is a dict", ValueError, "config must be a switchyard.RouterConfig",
     lambda t: syt.topk_route(torch.zeros(2, 8), dict(num_experts=8, top_k=2))),
    ("syt.AlltoAllDispatcher", "num_experts 0", ValueError, "num_experts must be a positive multiple",
     lambda t: syt.AlltoAllDispatcher(0)),
    ("AlltoAllDispatcher.dispatch", "id 8 with 8 experts", ValueError, "topk_idx",
     lambda t: syt.AlltoAllDispatcher(8).dispatch(torch.zeros(2, 4), torch.full((2, 2), 0.5),
                                                   torch.tensor([[0, 1], [8, 2]]))),
    ("AlltoAllDispatcher.dispatch", "int topk_weights", ValueError, "topk_weights must have dtype",
     lambda t: syt.AlltoAllDispatcher(8).dispatch(torch.zeros(2, 4), torch.ones(2, 2, dtype=torch.int32),
                                                   torch.tensor([[0, 1], [3, 2]]))),
    ("syt.AlltoAllDispatcher", "capacity_factor -1 (meant no capacity)", ValueError,
     "capacity_factor must be None (no capacity) or a finite number > 0",
     lambda t: syt.AlltoAllDispatcher(8, capacity_factor=-1.0)),
    ("AlltoAllDispatcher.dispatch", "NaN in x", ValueError, "x has a non-finite value nan at token 1",
     lambda t: syt.AlltoAllDispatcher(8).dispatch(_nan_x(), torch.full((3, 2), 0.5),
                                                   torch.tensor([[0, 1], [3, 2], [4, 5]]))),
    ("AlltoAllDispatcher.combine", "inf in expert_out", ValueError,
     "expert_y has a non-finite value inf at row 0", lambda t: _combine_inf()),
    ("syr.RouteWriter", "a second writer on the same path", sy.BackendError,
     "is being written by another RouteFileWriter", lambda t: _two_writers(t)),
    ("syr.import_vllm", "a row that repeats an id", ValueError, "row [3, 3] at token 0, hidden layer 0 repeats expert 3",
     lambda t: syr.import_vllm([_dup_npy(t)], num_experts=8)),
    ("syr.parse_moe_layer_freq", "entry 2", ValueError, "[layer_map]",
     lambda t: syr.parse_moe_layer_freq("1,2")),
    ("syr.RouteFile", "missing file", sy.BackendError, "no_such.syr",
     lambda t: syr.RouteFile(str(t / "no_such.syr"))),
    ("syr.RouteFile.from_bytes", "100 bytes of text", sy.DataError, "not a route file",
     lambda t: syr.RouteFile.from_bytes(b"x" * 100)),
    ("syr.RouteFile.__getitem__", "sequence index past the end", IndexError, "out of range",
     lambda t: syr.RouteFile(_route_file(t))[5]),
    ("syr.import_sglang_text", "record without meta_info", ValueError, "meta_info",
     lambda t: syr.import_sglang_text('{"text": "hi"}\n', num_experts=8, num_input_layers=1, top_k=1)),
    ("syr.import_vllm_response", "a choice without routes", ValueError, "is missing or null",
     lambda t: syr.import_vllm_response({"choices": [{"routed_experts": None}]}, num_experts=8)),
    ("syr.to_verl", "padding_side 'top'", ValueError, "padding_side must be 'left' or 'right'",
     lambda t: syr.to_verl([torch.full((2, 1, 2), -1, dtype=torch.int32)], [0], 1,
                           padding_side="top")),
    ("syr.pack_thd", "tp_size 0", ValueError, "tp_size must be >= 1",
     lambda t: syr.pack_thd([torch.zeros(2, 1, 1, dtype=torch.int32)], tp_size=0, num_experts=4)),
]


def test_every_row_raises_its_type_with_its_message(tmp_path):
    table = ["| call | input tried | exception | message |", "|---|---|---|---|"]
    failures = []
    for call, tried, exc, piece, fn in ROWS:
        try:
            fn(tmp_path)
            got, msg = None, "no exception"
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            got, msg = e, str(e)
        if got is None or not isinstance(got, exc) or piece not in msg:
            failures.append(f"{call} ({tried}): got {type(got).__name__}: {msg!r}, want {exc} with {piece!r}")
        msg = msg.replace(str(tmp_path) + "/", "")
        name = type(got).__name__ if got is not None else "none"
        if isinstance(got, (sy.BackendError, sy.DataError)):
            name = "switchyard." + name
        table.append(f"| `{call}` | {tried} | `{name}` | {msg.splitlines()[0].replace('|', chr(92) + '|')} |")
    out = os.environ.get("SY_BAD_INPUT_TABLE_PY")
    if out:
        with open(out, "w") as f:
            f.write("\n".join(table) + "\n")
    assert not failures, "\n".join(failures)
