"""Hostile ids (issue 35 item 1): one id-range rule for every integer dtype at every Python entry
point (switchyard._ids). An id outside [0, E) is an error naming where it is and its value as
given, in whatever dtype it came (int8 ... int64, uint8 ... uint64, torch or numpy), never wrapped
into range by a narrowing cast; under the "native" policy it is a counted invalid row."""
import numpy as np
import pytest
import torch

import switchyard as sy
import switchyard.routes as syr

E, K = 8, 2
SIGNED = [torch.int8, torch.int16, torch.int32, torch.int64]
UNSIGNED = [torch.uint8, torch.uint16, torch.uint32, torch.uint64]
# Values that a cast to int32 (or to the narrower dtype) turns into an id in range or into -1.
WRAPPING = {torch.int64: [2**32 + 5, 2**32 - 1, -2**32 + 3], torch.uint32: [2**32 - 1, 2**31 + 5],
            torch.uint64: [2**64 - 1, 2**63 + 5, 2**32 + 5]}


def _table(dtype, T=3, L=2):
    t = torch.tensor([[[(t + m) % E, (t + m + 1) % E] for m in range(L)] for t in range(T)])
    return t.to(dtype)


def _np(dtype):
    return {torch.int64: np.int64, torch.uint32: np.uint32, torch.uint64: np.uint64}[dtype]


@pytest.mark.parametrize("dtype", SIGNED + UNSIGNED)
def test_every_integer_dtype_in_range_gives_the_int32_table(dtype):
    """The same ids in any integer dtype, torch or numpy, give the int32 table."""
    want = _table(torch.int32)
    got = syr.add_padding([_table(dtype)])
    assert torch.equal(got[0], want)
    rows = sy.replay.classify_rows(_table(dtype)[:, 0], E)
    assert torch.equal(rows.ids, want[:, 0]) and rows.num_replayed == 3


@pytest.mark.hostile(tried="an id that wraps into range when narrowed (int64 2^32+5, uint32 "
                           "2^32-1, uint64 2^64-1 ...) given to routes.add_padding, "
                           "hf Patch.targets_from_tables or the replay row rule",
                     gets="ValueError naming the argument, the position and the value as given "
                          "(never read as expert 5 or -1)")
@pytest.mark.parametrize("dtype,big", [(d, v) for d, vs in WRAPPING.items() for v in vs])
def test_an_id_that_wraps_when_narrowed_is_an_error_in_every_dtype(dtype, big):
    a = _table(torch.int64).numpy().astype(_np(dtype))
    a[2, 1, 0] = big  # numpy holds the value exactly in its own dtype
    t = torch.from_numpy(a)
    assert t.dtype == dtype
    with pytest.raises(ValueError, match=rf"\[routes.add_padding\] tables\[0\] holds {big} at "
                                         r"\[2, 1, 0\], outside int32"):
        syr.add_padding([t])
    with pytest.raises(ValueError, match=rf"\[replay\] layer 4, replay ids holds {big} at "
                                         r"\[2, 0\], outside int32"):
        sy.replay.classify_rows(t[:, 1], E, layer=4)


@pytest.mark.hostile(tried="the replay row rule under invalid_replay_rows='native' with an id "
                           "outside int32 (int64 2^32+5, uint64 2^64-1)",
                     gets="the row is a counted invalid row, routed natively (as an id outside "
                          "[0, E) in range of int32 is); the other rows replay")
@pytest.mark.parametrize("dtype,big", [(torch.int64, 2**32 + 5), (torch.int64, -2**40),
                                       (torch.uint64, 2**64 - 1), (torch.uint32, 2**32 - 1)])
def test_native_policy_counts_an_id_outside_int32_as_an_invalid_row(dtype, big):
    a = _table(torch.int64)[:, 0].numpy().astype(_np(dtype))
    a[1, 1] = big
    rows = sy.replay.classify_rows(torch.from_numpy(a), E, policy="native")
    assert rows.num_invalid == 1 and rows.num_replayed == 2
    assert rows.kind.tolist() == [sy.replay.REPLAYED, sy.replay.INVALID, sy.replay.REPLAYED]
    assert rows.resolved_ids()[1].tolist() == [-1, -1]


@pytest.mark.hostile(tried="replay ids as bool, float or complex tensors",
                     gets="ValueError listing the accepted integer dtypes (not the refused ones)")
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.float64, torch.complex64])
def test_a_non_integer_dtype_error_lists_what_is_accepted(dtype):
    with pytest.raises(ValueError, match=r"\[replay\] replay ids must have an integer dtype "
                                         r"\(int8, int16, int32, int64, uint8, uint16, uint32 or "
                                         rf"uint64\), got {dtype}"):
        sy.replay.classify_rows(torch.zeros(3, K, dtype=dtype), E)


def test_uint8_255_is_an_id_not_a_missing_route():
    """An unsigned dtype has no -1: 255 in uint8 (what -1 becomes when cast) is an id outside
    [0, E), an invalid row, never "route natively"."""
    t = torch.tensor([[0, 1], [255, 255]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\[replay\] token 1: .*255"):
        sy.replay.classify_rows(t, E)
    rows = sy.replay.classify_rows(t, E, policy="native")
    assert rows.num_invalid == 1 and rows.num_native == 1


# ---- route writers given one table; importers given arrays that are not id arrays ---------------
@pytest.mark.hostile(tried="routes.encode / routes.write given one [T, L, K] table instead of a "
                           "list of tables (torch or numpy)",
                     gets="ValueError saying to pass [table] (used to be an IndexError from "
                          "reading the table's rows as tables); no file written")
@pytest.mark.parametrize("as_numpy", [False, True])
def test_a_single_table_given_as_the_list_of_tables_is_refused(tmp_path, as_numpy):
    t = _table(torch.int32)
    one = t.numpy() if as_numpy else t
    kind = "ndarray" if as_numpy else "Tensor"
    for op, call in (("routes.encode", lambda: syr.encode(one, E)),
                     ("routes.write", lambda: syr.write(tmp_path / "r.syr", one, E))):
        with pytest.raises(ValueError, match=rf"\[{op}\] tables must be a list with one table "
                                             rf"per sequence, got one {kind} of shape "
                                             r"\[3, 2, 2\]: pass \[table\] for a single sequence"):
            call()
    assert not list(tmp_path.iterdir())
    assert torch.equal(syr.decode(syr.encode([t], E))[0][0], t)


@pytest.mark.hostile(tried="routes.import_vllm_arrays / import_trtllm_arrays with float, bool or "
                           "None arrays, or uint32 / uint64 ids",
                     gets="ValueError listing the accepted integer dtypes (used to list the dtypes "
                          "the bridge knows, floats and bool included); uint32 / uint64 ids in "
                          "range import as int32 ids")
def test_importers_name_the_accepted_dtypes_and_take_every_integer_dtype():
    acc = r"\(int8, int16, int32, int64, uint8, uint16, uint32 or uint64\)"
    for bad, got in ((torch.zeros(3, 2, K), "torch.float32"), (np.zeros((3, 2, K), bool),
                                                               "torch.bool")):
        with pytest.raises(ValueError, match=rf"\[import\] arrays\[0\] must have an integer dtype "
                                             rf"{acc}, got {got}"):
            syr.import_vllm_arrays([bad], E)
        with pytest.raises(ValueError, match=rf"\[routes.import\] arrays\[0\] must have an "
                                             rf"integer dtype {acc}, got {got}"):
            syr.import_trtllm_arrays([bad], E)
    with pytest.raises(ValueError, match=r"\[import\] arrays\[0\] is None: expected an integer "
                                         r"array of expert ids"):
        syr.import_vllm_arrays([None], E)
    want, _ = syr.import_vllm_arrays([_table(torch.int32)], E)
    for dtype in UNSIGNED + SIGNED:
        got, _ = syr.import_vllm_arrays([_table(dtype)], E)
        assert torch.equal(got[0], want[0]), dtype


# ---- generated ids: the rule holds for every dtype and value (hypothesis, bounded) --------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_NP = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
       torch.uint8: np.uint8, torch.uint16: np.uint16, torch.uint32: np.uint32,
       torch.uint64: np.uint64}


@st.composite
def _id_arrays(draw):
    """A [T, L, K] numpy array of any integer dtype, ids mostly in range, some anywhere in the
    dtype (its extremes included), some -1 rows for signed dtypes."""
    dtype = draw(st.sampled_from(list(_NP)))
    info = np.iinfo(_NP[dtype])
    T, L = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    vals = st.one_of(st.integers(0, E - 1), st.integers(0, E - 1), st.integers(0, E - 1),
                     st.integers(int(info.min), int(info.max)),
                     st.sampled_from([int(info.min), int(info.max), E]))
    a = np.array(draw(st.lists(vals, min_size=T * L * K, max_size=T * L * K)),
                 dtype=object).reshape(T, L, K)
    if info.min < 0 and draw(st.booleans()):
        a[draw(st.integers(0, T - 1))] = -1
    return dtype, a.astype(_NP[dtype])


@settings(derandomize=True, max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_id_arrays())
def test_the_vllm_importer_takes_every_dtype_and_never_wraps_an_id(case):
    """import_vllm_arrays of any integer array: the tables of the same values as int64 when
    every id is -1 or in [0, E), else a ValueError that names the op -- never tables with a
    value that was not in the input."""
    dtype, a = case
    values = [int(v) for v in a.reshape(-1).tolist()]
    in_range = all(0 <= v < E or (v == -1 and dtype not in UNSIGNED) for v in values)
    try:
        tables, _ = syr.import_vllm_arrays([a], E)
    except ValueError as e:
        assert str(e).startswith("[import]"), e
        if in_range:  # only a row rule (-1 mixed with ids, a repeated id) may refuse it, or the
            # all-zero payload rule (issue 34: an engine that returned no routes)
            assert "repeats" in str(e) or "mixes" in str(e) or (
                "is all zeros" in str(e) and not a.any()), e
        return
    assert in_range, (values, tables)
    ref, _ = syr.import_vllm_arrays([torch.tensor(values, dtype=torch.int64).view(a.shape)], E)
    assert torch.equal(tables[0], ref[0])
