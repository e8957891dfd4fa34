"""Float64 all the way through: :func:`float64_throughout`, under which ``treepack bench --e2e
--dtype float64`` runs both of its runs (and the tests compare runs to float64's rounding).

A float64 model is not float64 throughout by itself: transformers computes norms, gates, scans
and eager softmax in float32, and TRL 1.16's chunked log-prob head casts every tile to float32
(``trl/kernels/chunked_logprob.py``), so a float64 run of stock TRL carries float32 rounding
in its log-probs."""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["float64_throughout"]


def _f64(x):
    return torch.float64 if x is torch.float32 else x


class _Float64(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(_f64(a) for a in args)
        kwargs = {k: _f64(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _in_backward():
    """The mode in the backward of every custom autograd Function too: the autograd engine
    calls their backward without the caller's torch function modes, so its float32 would stay
    float32. While it lasts, process-wide."""
    from torch.autograd.function import BackwardCFunction

    original = BackwardCFunction.apply

    def apply(self, *args):
        with _Float64():
            return original(self, *args)

    BackwardCFunction.apply = apply
    try:
        yield
    finally:
        BackwardCFunction.apply = original


@contextlib.contextmanager
def float64_throughout():
    """While it lasts, whatever asks for float32 gets float64: a float64 model's norms, gates,
    scans and eager softmax, which transformers computes in float32 even in a float64 model,
    and the backward of custom autograd Functions (TRL's chunked log-prob head is one), stay
    float64, so that two runs compare to float64's rounding (tolerance.FLOAT64_EXACT;
    tolerance.inside sees it). Tensors made without a dtype are float64 too.

    The default dtype and the custom Functions' backward are the process's, the mode is the
    calling thread's: one thread at a time. Gradient checkpointing's recompute runs outside
    the mode: run float64 comparisons without it."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64(), _in_backward():
            yield
    finally:
        torch.set_default_dtype(default)
