"""One vocabulary: the Python API speaks the engine's names (top_k, topk_idx, topk_weights,
num_tokens_per_expert), and the names earlier releases used fail with an error naming the new one.
Plus the run-time CPU kernel choice as Python sees it."""
import os
import subprocess
import sys

import pytest
import torch

import switchyard as sy
import switchyard._testing as sy_testing
import switchyard.torch as syt


def test_router_config_uses_top_k():
    cfg = sy.RouterConfig(num_experts=8, top_k=2)
    assert cfg.top_k == 2 and "top_k=2" in repr(cfg)
    with pytest.raises(TypeError, match=r"\[RouterConfig\] keyword argument 'topk' was renamed "
                                        r"'top_k'"):
        sy.RouterConfig(num_experts=8, topk=2)
    with pytest.raises(AttributeError, match="'topk' was renamed 'top_k'"):
        cfg.topk


def test_results_use_num_tokens_per_expert():
    cfg = sy.RouterConfig(num_experts=8, top_k=2)
    w, idx, info = syt.topk_route(torch.randn(5, 8), cfg)
    assert int(info.num_tokens_per_expert.sum()) == 10
    with pytest.raises(AttributeError, match="'tokens_per_expert' was renamed "
                                             "'num_tokens_per_expert'"):
        info.tokens_per_expert
    disp = syt.AlltoAllDispatcher(num_experts=8)
    _, _, h = disp.dispatch(torch.randn(5, 4), w, idx)
    assert int(h.num_tokens_per_expert.sum()) == 10
    with pytest.raises(AttributeError, match="'tokens_per_expert' was renamed"):
        h.tokens_per_expert
    state = sy.GlobalAuxLossState()
    with pytest.raises(AttributeError, match="'tokens_per_expert' was renamed"):
        state.tokens_per_expert


def test_dispatch_keywords_are_topk_weights_and_apply_weights():
    cfg = sy.RouterConfig(num_experts=4, top_k=2)
    x = torch.randn(6, 3)
    w, idx, _ = syt.topk_route(torch.randn(6, 4), cfg)
    disp = syt.AllGatherDispatcher(num_experts=4)
    recv_x, recv_w, h = disp.dispatch(x, topk_weights=w, topk_idx=idx)
    y = disp.combine(recv_x * recv_w[:, None], h, apply_weights=False)
    torch.testing.assert_close(y, disp.combine(recv_x, h))
    with pytest.raises(TypeError, match="'probs' was renamed 'topk_weights'"):
        disp.dispatch(x, probs=w, topk_idx=idx)
    with pytest.raises(TypeError, match="'apply_probs' was renamed 'apply_weights'"):
        disp.combine(recv_x, h, apply_probs=False)


def test_cpu_isa_choice_and_override():
    assert sy.cpu_isa() in ("avx512", "avx2", "scalar")
    saved = sy.cpu_isa()
    try:
        sy.set_cpu_isa("scalar")
        assert sy.cpu_isa() == "scalar"
        if saved == "avx512":  # the widest variant is the default; each narrower one can be chosen
            sy.set_cpu_isa("avx2")
            assert sy.cpu_isa() == "avx2"
    finally:
        sy.set_cpu_isa(saved)
    with pytest.raises(ValueError, match=r"\[set_cpu_isa\] isa must be 'scalar', 'avx2' or "
                                         r"'avx512', got 'sse'"):
        sy.set_cpu_isa("sse")


def test_cpu_isa_environment_variable_is_checked():
    env = dict(os.environ, SWITCHYARD_CPU_ISA="avx9000")
    p = subprocess.run([sys.executable, "-c", "import switchyard as sy; sy.cpu_isa()"], env=env,
                       capture_output=True, text=True)
    assert p.returncode != 0
    assert ("[cpu_isa] SWITCHYARD_CPU_ISA must be auto, scalar, avx2 or avx512, got 'avx9000'"
            in p.stderr)
    env["SWITCHYARD_CPU_ISA"] = "scalar"
    p = subprocess.run([sys.executable, "-c", "import switchyard as sy; print(sy.cpu_isa())"],
                       env=env, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "scalar", p.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int32,
                                   torch.int64, torch.uint8, torch.bool])
def test_results_come_back_through_dlpack_without_numpy(dtype):
    # Engine-owned results reach torch through DLPack: right dtype, writable, contiguous.
    out = sy_testing.full([3, 2], dtype, 1.0)
    assert out.dtype == dtype and out.is_contiguous() and out.shape == (3, 2)
    assert bool((out == torch.ones(3, 2, dtype=dtype)).all())
    out[0, 0] = 0
    assert not bool(out[0, 0])


def test_float16_is_rejected_with_the_fix_named():
    with pytest.raises(ValueError, match="float16"):
        syt.router_gating_linear(torch.randn(4, 8, dtype=torch.float16),
                                 torch.randn(3, 8, dtype=torch.float16))
