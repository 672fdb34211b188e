"""Tensors cross without copies (contiguous CPU in, engine-owned storage out), other layouts are
made contiguous once, wrong dtypes / devices / types raise ValueError naming the argument, and
engine exceptions map to ValueError / IndexError / RuntimeError with the engine's messages."""
import gc

import pytest
import torch

import switchyard as sy
import switchyard._testing as sy_testing
import switchyard.torch as syt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32,
                                   torch.int64, torch.uint8, torch.bool])
def test_borrow_is_zero_copy(dtype):
    t = torch.zeros(3, 5, dtype=dtype)
    addr, shape, _ = sy_testing.borrow_info(t)
    assert addr == t.data_ptr() and shape == [3, 5]
    view = t[1:]  # contiguous view with an offset: still borrowed in place
    assert sy_testing.borrow_info(view)[0] == view.data_ptr()


def test_non_contiguous_made_contiguous():
    t = torch.randn(4, 6).t()
    addr, shape, _ = sy_testing.borrow_info(t)
    assert addr != t.data_ptr() and shape == [6, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_results_share_engine_storage(dtype):
    src = (torch.randn(7, 3) * 10).to(dtype)
    out = sy_testing.clone(src)
    assert out.dtype == dtype and torch.equal(out, src)
    # The result is writable and stays valid after the engine's handle is gone.
    gc.collect()
    out.view(-1)[0] = out.view(-1)[1]
    assert out.shape == (7, 3)
    empty = sy_testing.full([0, 4], torch.float32, 1.0)
    assert empty.shape == (0, 4)


def test_argument_errors_name_the_argument():
    cfg = sy.RouterConfig(num_experts=4, top_k=2)
    with pytest.raises(ValueError, match=r"\[topk_route\] logits must be a torch.Tensor, got list"):
        syt.topk_route([[1.0] * 4], cfg)
    with pytest.raises(ValueError, match=r"\[topk_route\] logits: dtype must be one of .*complex"):
        syt.topk_route(torch.zeros(2, 4, dtype=torch.complex64), cfg)
    with pytest.raises(ValueError, match=r"replay_idx.*int32 or int64|replay_idx"):
        syt.topk_route(torch.zeros(2, 4), cfg, inputs=syt.RouteInputs(replay_idx=torch.zeros(2, 2)))
    with pytest.raises(ValueError, match=r"replay_idx holds 4294967296"):
        syt.topk_route(torch.zeros(2, 4), cfg,
                       inputs=syt.RouteInputs(replay_idx=torch.full((2, 2), 2**32)))


def test_exception_mapping():
    r = sy.RouterReplay(top_k=2)
    with pytest.raises(IndexError):  # std::out_of_range
        r.pop_recorded()
    with pytest.raises(ValueError, match=r"\[route\] top_k"):  # std::invalid_argument
        sy.RouterConfig(num_experts=4, top_k=9)
    assert issubclass(sy.BackendError, RuntimeError) and issubclass(sy.DataError, RuntimeError)
    with pytest.raises(sy.BackendError):  # environment failure: file cannot be opened
        sy.routes.read("/nonexistent/dir/routes.syr")


def test_threads_do_not_change_results():
    x = torch.randn(64, 96)
    w = torch.randn(32, 96)
    cfg = sy.RouterConfig(num_experts=32, top_k=4, score_function="sigmoid")
    n = sy.num_threads()
    try:
        out = []
        for k in (1, 2):
            sy.set_num_threads(k)
            out.append(syt.topk_route(syt.router_gating_linear(x, w), cfg))
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    finally:
        sy.set_num_threads(n)
