"""The route importers and the replay core share one row rule (src/cpu/row_rule.h) and one
invalid-row vocabulary (error / native, with merge refused): a row the replay core calls invalid
is invalid to every importer, for the same reason."""
import pytest
import torch

import switchyard as sy
import switchyard.routes as syr

ROWS = [[1, 2, 3], [-1, -1, -1], [4, -1, -1], [5, 5, 2], [-1, 3, 3], [1, 6, 1]]


def _import(rows, **kw):
    return syr.import_vllm_arrays([torch.tensor(rows, dtype=torch.int32)[:, None, :]],
                                  num_experts=8, **kw)


@pytest.mark.hostile(tried="imported a row that mixes -1 and a repeated id ([-1, 3, 3])",
                     gets="the replay core's verdict (mixes -1 and ids), not a second rule's")
def test_importer_and_replay_core_name_the_same_problem():
    for row in ROWS:
        rows = sy.replay.classify_rows(torch.tensor([row], dtype=torch.int32), 8, "native")
        if rows.num_invalid == 0:
            tables, _ = _import([row])
            assert tables[0][0].tolist() == [row]  # (the last token has no route: -1)
            continue
        why = "mixes -1 and" if -1 in row else "repeats expert"
        with pytest.raises(ValueError, match=why):
            sy.replay.classify_rows(torch.tensor([row], dtype=torch.int32), 8)
        with pytest.raises(ValueError, match=why):
            _import([row])


def test_importer_counts_invalid_rows_as_the_replay_core_does():
    rows = sy.replay.classify_rows(torch.tensor(ROWS, dtype=torch.int32), 8, "native")
    _, rep = _import(ROWS, invalid_rows="native")
    assert rep["num_invalid_rows"] == rows.num_invalid == 4


@pytest.mark.hostile(tried="invalid_rows='native' on an importer (the replay core's word)",
                     gets="rows stored as -1 and counted; the importers speak replay's vocabulary")
def test_importers_take_the_replay_cores_policy_words():
    tables, rep = _import([[5, 5, 2], [1, 2, 3]], invalid_rows="native")
    assert tables[0][:2].tolist() == [[[-1, -1, -1]], [[1, 2, 3]]]
    assert rep["num_invalid_rows"] == 1
    mask = torch.ones(1, 2, dtype=torch.bool)
    verl = torch.tensor([[[[5, 5, 2]], [[1, 2, 3]]]], dtype=torch.int16)
    tables, rep = syr.from_verl(verl, mask, num_experts=8, invalid_rows="native")
    assert tables[0].tolist() == [[[-1, -1, -1]], [[1, 2, 3]]] and rep["num_invalid_rows"] == 1


@pytest.mark.hostile(tried="invalid_rows='to_none' (the importers' old word)",
                     gets="DeprecationWarning naming 'native'; the same result as 'native'")
def test_old_invalid_rows_spelling_warns_and_means_native():
    with pytest.warns(DeprecationWarning, match="spell it 'native'"):
        tables, rep = _import([[5, 5, 2]], invalid_rows="to_none")
    assert tables[0][0].tolist() == [[-1, -1, -1]] and rep["num_invalid_rows"] == 1


@pytest.mark.hostile(tried="invalid_rows='merge' on an importer",
                     gets="ValueError: a table keeps K ids per row, import with error/native")
def test_importers_refuse_merge_with_the_reason():
    with pytest.raises(ValueError, match=r"\[import\] invalid_rows must be error or native, got "
                                         r"merge \(a route table keeps K ids per row"):
        _import([[5, 5, 2]], invalid_rows="merge")
    with pytest.raises(ValueError, match="invalid_rows must be error or native, got merge"):
        syr.from_verl(torch.zeros(1, 1, 1, 2, dtype=torch.int16), torch.ones(1, 1, dtype=torch.bool),
                      num_experts=8, invalid_rows="merge")
    with pytest.raises(ValueError, match="invalid_rows must be 'error' or 'native', got 'drop'"):
        _import([[5, 5, 2]], invalid_rows="drop")


# ---------------------------------------------------------------- one vLLM entry point per kind
def _sse(num_experts=8):
    import base64
    import io
    import json

    import numpy as np
    buf = io.BytesIO()
    np.save(buf, np.array([[[1, 2]], [[3, 4]]], dtype=np.uint8))
    chunk = {"request_id": "r", "choices": [{"index": 0, "token_ids": [7, 8],
                                             "routed_experts": base64.b64encode(buf.getvalue())
                                             .decode(), "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
    return "data: " + json.dumps(chunk) + "\n\ndata: [DONE]\n"


@pytest.mark.hostile(tried="a recorded vLLM stream (SSE) given to import_vllm / import_vllm_response",
                     gets="the same tables as the deprecated import_vllm_stream, which now warns")
def test_a_recorded_stream_is_one_more_kind_of_file_or_response(tmp_path):
    pytest.importorskip("numpy")
    text = _sse()
    (tmp_path / "s.sse").write_text(text)
    from_file, _ = syr.import_vllm([tmp_path / "s.sse"], num_experts=8)
    from_text, _ = syr.import_vllm_response(text, num_experts=8)
    with pytest.warns(DeprecationWarning, match="import_vllm_stream is deprecated"):
        old, _ = syr.import_vllm_stream(text, num_experts=8)
    assert [t.tolist() for t in from_file] == [t.tolist() for t in from_text] == \
        [t.tolist() for t in old]
    assert from_file[0][:2].tolist() == [[[1, 2]], [[3, 4]]]
    assert "import_vllm_stream" not in syr.__all__
