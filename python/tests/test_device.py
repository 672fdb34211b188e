"""Tensors cross the bridge on the device their DLPack protocol names (``__dlpack_device__``):
kDLCPU is borrowed as host memory, kDLCUDA as CUDA memory in a CUDA build and, in a build without
CUDA, is refused with a ValueError naming the argument and the fix, never read as host memory."""
import pytest
import torch

import switchyard as sy
import switchyard._testing as sy_testing
import switchyard.torch as syt


class _ClaimsCuda(torch.Tensor):
    """A CPU tensor whose DLPack device is CUDA device 0 (or ``index``): a CPU-only torch cannot
    make a real CUDA tensor, and the bridge must go by DLPack (what a consumer of the memory
    trusts), not by reading the pointer."""

    index = 0

    def __dlpack_device__(self):
        return (2, self.index)  # kDLCUDA


class _ClaimsCuda1(_ClaimsCuda):
    index = 1


def test_cpu_tensors_are_borrowed_on_the_cpu():
    assert sy_testing.borrow_device(torch.zeros(2, 3)) == "cpu"
    assert sy_testing.clone(torch.ones(2)).device.type == "cpu"


def test_parameters_take_the_plain_tensor_path_and_their_subclasses_dlpack():
    # A CPU nn.Parameter (every router weight) is host memory like a plain tensor; a subclass of
    # Parameter is asked its DLPack device, as any other subclass is.
    w = torch.nn.Parameter(torch.randn(3, 8))
    assert sy_testing.borrow_device(w) == "cpu"
    x = torch.randn(4, 8)
    assert torch.equal(syt.router_gating_linear(x, w), syt.router_gating_linear(x, w.detach()))

    class _CudaParam(torch.nn.Parameter):
        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

    if not sy.built_with_cuda():
        with pytest.raises(ValueError, match=r"\[borrow\] t is a CUDA tensor \(device cuda:0\)"):
            sy_testing.borrow_device(_CudaParam(torch.randn(3, 8)))
    with pytest.raises(ValueError, match=r"\[borrow\] t must be a CPU tensor, got device meta"):
        sy_testing.borrow_device(torch.nn.Parameter(torch.zeros(2, device="meta")))


def test_build_reports_its_cuda_backend():
    assert isinstance(sy.built_with_cuda(), bool)
    if not sy.built_with_cuda():
        assert sy.cuda_device_count() == 0


@pytest.mark.skipif(sy.built_with_cuda(), reason="this build has the CUDA backend")
@pytest.mark.parametrize("cls, name", [(_ClaimsCuda, "cuda:0"), (_ClaimsCuda1, "cuda:1")])
def test_cuda_tensor_in_a_cpu_build_names_the_argument_and_the_fix(cls, name):
    x = torch.zeros(4, 8).as_subclass(cls)
    assert x.__dlpack_device__() == (2, cls.index)
    with pytest.raises(ValueError, match=(
            rf"\[borrow\] t is a CUDA tensor \(device {name}\), but this switchyard was built "
            r"without CUDA: pass a CPU tensor \(tensor.cpu\(\)\) or rebuild with "
            r"-DSWITCHYARD_CUDA=ON")):
        sy_testing.borrow_device(x)


@pytest.mark.skipif(sy.built_with_cuda(), reason="this build has the CUDA backend")
def test_public_ops_refuse_a_cuda_argument_by_name():
    x = torch.randn(4, 8).as_subclass(_ClaimsCuda)
    with pytest.raises(ValueError, match=r"\[router_gating_linear\] x is a CUDA tensor"):
        syt.router_gating_linear(x, torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"\[router_gating_linear\] weight is a CUDA tensor"):
        syt.router_gating_linear(torch.randn(4, 8), torch.randn(3, 8).as_subclass(_ClaimsCuda))


def test_a_device_without_dlpack_is_refused():
    with pytest.raises(ValueError, match=r"\[borrow\] t must be a CPU tensor, got device meta"):
        sy_testing.borrow_device(torch.zeros(2, device="meta"))
