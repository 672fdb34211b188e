"""Pure-PyTorch references, written from the maths (float64), for every switchyard.torch function.

They implement the same semantics as DESIGN.md with plain torch ops and torch autograd, never the
engine's code, so a test comparing the two checks the engine against an independent reading."""
import math

import torch


def gating_linear(x, weight, bias=None):
    """logits = x·Wᵀ + b in float64 (bias applied in the forward)."""
    out = x.double() @ weight.double().t()
    if bias is not None:
        out = out + bias.double()
    return out
