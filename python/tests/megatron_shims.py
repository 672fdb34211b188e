"""Test-only shims that let Megatron-Core's MoE layer run on CPU tensors with gloo.

Megatron-Core's MoE training path assumes a CUDA device in a few places that have nothing to do
with what these tests check (routing, replay, dispatch sizes). Each shim below replaces exactly
one such call, says why, and is installed only inside the test worker processes
(``install()``); nothing here is used by switchyard itself, and no Megatron code is copied.
"""
import contextlib

import torch


class _NoStream:
    """Stands in for torch.cuda.Stream / torch.cuda.Event on CPU: CPU work is synchronous, so
    waiting, recording and synchronising are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    def __hash__(self):
        return 0


def install():
    import megatron.core.tensor_parallel.random as tp_random
    from megatron.core.transformer.moe import token_dispatcher

    # Buffers are allocated with device=torch.cuda.current_device() (tensor_parallel.mappings,
    # router buffers, Router.gating moving its weight): on CPU the device is the CPU.
    torch.cuda.current_device = lambda: "cpu"
    # MoEAlltoAllTokenDispatcher creates a side stream for its device-to-host copies and waits
    # on it (_maybe_dtoh_and_synchronize): there is no stream on CPU.
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()

    # Megatron's device-to-host helper moves only CUDA tensors (and only then turns the split
    # sizes into numpy arrays); gloo's all_to_all_single needs the split sizes as host values
    # just as NCCL does after that helper, so the CPU copy does the same conversion.
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # Activation checkpointing saves and restores the CUDA RNG state: there is none on CPU
    # (the CPU RNG state is still saved and restored by Megatron's own code).
    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    # The CUDA RNG tracker's add() reads the CUDA RNG state to store it: on CPU a CPU state tensor
    # stands in as the stored value (these tests run with dropout 0, so nothing draws from it).
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    # parallel_state.initialize_model_parallel synchronises the device after building groups.
    torch.cuda.synchronize = lambda device=None: None


def install_fused_router_stand_in():
    """Megatron's moe_router_fusion path calls Transformer Engine's fused top-k kernel (CUDA only,
    TE not installed here). To run that code path on CPU, the kernel is stood in for by
    Megatron's own unfused function with the same arguments (same results by Megatron's
    contract); the replay logic under test is switchyard's, around the call."""
    from megatron.core.transformer.moe import moe_utils

    unfused = moe_utils.topk_routing_with_score_function

    def fused_topk_with_score_function(logits, topk, use_pre_softmax, num_groups, group_topk,
                                       scaling_factor, score_function, expert_bias):
        return unfused(logits, topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups,
                       group_topk=group_topk, scaling_factor=scaling_factor,
                       score_function=score_function, expert_bias=expert_bias, fused=False)

    moe_utils.HAVE_TE = True
    moe_utils.fused_topk_with_score_function = fused_topk_with_score_function
