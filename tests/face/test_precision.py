"""``float64_throughout``: float32 asked for becomes float64 in the forward and in the backward
of custom autograd Functions (the engine calls those without the caller's modes), and
everything is put back after, an exception included."""

import pytest
import torch
from torch.autograd.function import BackwardCFunction

from treepack.face.benchmark.precision import float64_throughout


class Float32Inside(torch.autograd.Function):
    """Computes in float32 in both directions, as TRL's chunked log-prob head does."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        Float32Inside.seen.append(("forward", x.float().dtype))
        return x * 2

    @staticmethod
    def backward(ctx, g):
        Float32Inside.seen.append(("backward", g.float().dtype,
                                   torch.zeros(1, dtype=torch.float32).dtype))
        return g * 2


def test_float32_becomes_float64_in_the_forward_and_in_custom_backwards():
    Float32Inside.seen.clear()
    with float64_throughout():
        x = torch.ones(3, requires_grad=True)
        assert x.dtype == torch.float64  # no dtype given: the default
        Float32Inside.apply(x).sum().backward()
    assert Float32Inside.seen == [("forward", torch.float64),
                                  ("backward", torch.float64, torch.float64)]


def test_everything_is_put_back_after_an_exception():
    apply, default = BackwardCFunction.apply, torch.get_default_dtype()
    with pytest.raises(ValueError), float64_throughout():
        raise ValueError("inside")
    assert BackwardCFunction.apply is apply and torch.get_default_dtype() == default
    Float32Inside.seen.clear()
    x = torch.ones(3, requires_grad=True)
    Float32Inside.apply(x).sum().backward()
    assert Float32Inside.seen == [("forward", torch.float32),
                                  ("backward", torch.float32, torch.float32)]
