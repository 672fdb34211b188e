"""The importers' options, bound once: ``_switchyard.RouteImportOptions`` (the engine's
RouteImportOptions, include/switchyard/route_import.h) is the one object every import binding
takes; ``check_import_options`` names the bad field and its value; switchyard.routes builds the
object in one place from the keyword arguments users pass."""
import base64
import io
import json

import numpy as np
import pytest
import torch

from switchyard import _switchyard as _C
from switchyard import routes

FIELDS = dict(num_experts=8, first_k_dense=1, moe_layer_freq=[], num_mtp_layers=0,
              num_input_layers=3, top_k=2, zero_rows="to_none", invalid_rows="native",
              prompt_start=2, routed_experts_dtype="uint16")


def test_options_round_trip_through_their_fields_and_as_dict():
    o = _C.RouteImportOptions(**FIELDS)
    for k, v in FIELDS.items():
        assert getattr(o, k) == v, k
    assert o.as_dict() == FIELDS
    assert _C.RouteImportOptions(**o.as_dict()) == o
    freq = _C.RouteImportOptions(num_experts=4, moe_layer_freq=[0, 1, 1], num_mtp_layers=1)
    assert freq.moe_layer_freq == [0, 1, 1] and freq.num_mtp_layers == 1
    assert "moe_layer_freq=[0, 1, 1]" in repr(freq)
    o2 = _C.RouteImportOptions(**FIELDS)
    o2.top_k = 4
    assert o2 != o and o2.as_dict()["top_k"] == 4


def test_defaults_are_the_importers_defaults():
    assert _C.RouteImportOptions().as_dict() == dict(
        num_experts=0, first_k_dense=0, moe_layer_freq=[], num_mtp_layers=0, num_input_layers=0,
        top_k=0, zero_rows="keep", invalid_rows="error", prompt_start=0,
        routed_experts_dtype="int32")
    assert routes._options(8).as_dict() == dict(_C.RouteImportOptions(num_experts=8).as_dict())


def test_the_routes_builder_maps_the_keyword_arguments_in_one_place():
    o = routes._options(8, first_k_dense=1, moe_layer_freq="1x0,2x1", num_mtp_layers=1,
                        num_input_layers=4, top_k=2, zero_rows="error", invalid_rows="native",
                        prompt_start=5)
    assert o.as_dict() == dict(num_experts=8, first_k_dense=1, moe_layer_freq=[0, 1, 1],
                               num_mtp_layers=1, num_input_layers=4, top_k=2, zero_rows="error",
                               invalid_rows="native", prompt_start=5,
                               routed_experts_dtype="int32")
    with pytest.warns(DeprecationWarning, match="'native'"):
        assert routes._options(8, invalid_rows="to_none").invalid_rows == "native"


@pytest.mark.parametrize("field,value,message", [
    ("num_experts", 0, r"\[import\] num_experts must be >= 1, got 0"),
    ("num_experts", -3, r"num_experts must be >= 1, got -3"),
    ("num_input_layers", -1, r"num_input_layers must be >= 0, got -1"),
    ("top_k", -2, r"top_k must be >= 0, got -2"),
    ("prompt_start", -1, r"prompt_start must be in \[0, 2\^24\], got -1"),
    ("prompt_start", (1 << 24) + 1, r"prompt_start must be in \[0, 2\^24\], got 16777217"),
    ("first_k_dense", -1, r"first_k_dense must be >= 0, got -1"),
    ("num_mtp_layers", -2, r"num_mtp_layers must be >= 0, got -2"),
    ("moe_layer_freq", [0, 2, 1], r"moe_layer_freq entries must be 0 or 1, got 2 at layer 1"),
    ("invalid_rows", "merge", r"invalid_rows must be error or native, got merge"),
])
def test_check_import_options_names_the_bad_field_and_its_value(field, value, message):
    o = _C.RouteImportOptions(num_experts=8)
    _C.check_import_options(o)  # the good ones pass
    setattr(o, field, value)
    with pytest.raises(ValueError, match=message):
        _C.check_import_options(o)


@pytest.mark.parametrize("field,value", [("zero_rows", "drop"), ("invalid_rows", "skip"),
                                         ("routed_experts_dtype", "int16")])
def test_an_unknown_policy_word_is_refused_when_set(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be .*got '{value}'"):
        _C.RouteImportOptions(**{field: value})
    o = _C.RouteImportOptions()
    with pytest.raises(ValueError, match=rf"{field} must be .*got '{value}'"):
        setattr(o, field, value)


def _npy(a):
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


# One sequence, 2 hidden layers (layer 0 dense), K = 2, E = 8: the input of every importer below.
ROWS = np.array([[[0, 0], [3, 1]], [[0, 0], [2, 5]]], dtype=np.int32)
WANT = torch.tensor([[[3, 1]], [[2, 5]], [[-1, -1]]], dtype=torch.int32)


def _importers(tmp_path):
    """Every import binding, called with one options object."""
    npy = tmp_path / "s.npy"
    npy.write_bytes(_npy(ROWS))
    b64 = base64.b64encode(_npy(ROWS)).decode()
    http = json.dumps({"choices": [{"routed_experts": b64}]})
    chunk = {"request_id": "r",
             "choices": [{"index": 0, "routed_experts": b64, "finish_reason": "stop"}]}
    sse = "data: " + json.dumps(chunk) + "\n"
    sg = json.dumps({"meta_info": {"routed_experts": base64.b64encode(ROWS.tobytes()).decode()}})
    sgf = tmp_path / "s.json"
    sgf.write_text(sg)
    trt = tmp_path / "t.npy"
    trt.write_bytes(_npy(np.ascontiguousarray(ROWS[:, 1:])))
    verl = torch.zeros(1, 3, 2, 2, dtype=torch.int16)
    verl[0, :2] = torch.from_numpy(ROWS)
    mask = torch.ones(1, 3, dtype=torch.int64)

    def stream(o):
        s = _C.VllmRouteStream(o)
        s.add_sse(sse)
        return s.finish("r/0")

    return {
        "vllm": lambda o: _C.routes_import_vllm([str(npy)], o),
        "vllm_arrays": lambda o: _C.routes_import_vllm_arrays([torch.from_numpy(ROWS)], o),
        "vllm_http_text": lambda o: _C.routes_import_vllm_http_text(http, o),
        "vllm_npy_base64": lambda o: _C.routes_import_vllm_npy_base64(b64, o),
        "vllm_stream_text": lambda o: _C.routes_import_vllm_stream_text(sse, o),
        "VllmRouteStream": stream,
        "sglang": lambda o: _C.routes_import_sglang([str(sgf)], o),
        "sglang_text": lambda o: _C.routes_import_sglang_text(sg, o),
        "trtllm": lambda o: _C.routes_import_trtllm([str(trt)], o),
        "trtllm_arrays": lambda o: _C.routes_import_trtllm_arrays(
            [torch.from_numpy(np.ascontiguousarray(ROWS[:, 1:]))], o),
        "flashinfer_replay": lambda o: _C.routes_import_flashinfer_replay(
            [torch.from_numpy(np.ascontiguousarray(ROWS[:, 1]))], [0, 2], o),
        "from_verl": lambda o: _C.routes_from_verl(verl, mask, o),
    }


IMPORTERS = ["vllm", "vllm_arrays", "vllm_http_text", "vllm_npy_base64", "vllm_stream_text",
             "VllmRouteStream", "sglang", "sglang_text", "trtllm", "trtllm_arrays",
             "flashinfer_replay", "from_verl"]


@pytest.mark.parametrize("name", IMPORTERS)
def test_every_importer_takes_the_options_object(tmp_path, name):
    moe_only = name.startswith(("trtllm", "flashinfer"))
    o = _C.RouteImportOptions(num_experts=8, first_k_dense=1, top_k=2,
                              num_input_layers=1 if moe_only else 2,
                              zero_rows="to_none" if name == "from_verl" else "keep")
    tables, report = _importers(tmp_path)[name](o)
    want = WANT[:2] if name == "flashinfer_replay" else WANT  # every routed token, no last row
    assert len(tables) == 1 and torch.equal(tables[0], want), name
    assert report["moe_layers"] == [1]


@pytest.mark.parametrize("name", IMPORTERS)
def test_every_importer_checks_the_options_before_reading_anything(tmp_path, name):
    o = _C.RouteImportOptions(num_experts=8, first_k_dense=-1)
    with pytest.raises(ValueError, match=r"first_k_dense must be >= 0, got -1"):
        _importers(tmp_path)[name](o)


def test_the_public_functions_keep_their_keyword_arguments():
    (t,), rep = routes.import_vllm_arrays([ROWS], num_experts=8, first_k_dense=1)
    assert torch.equal(t, WANT) and rep["moe_layers"] == [1]
    with pytest.raises(ValueError, match=r"num_experts must be >= 1, got 0"):
        routes.import_vllm_arrays([ROWS], num_experts=0)
