"""The flex backend: FlexAttention with the pack's BlockMask, compiled once per process."""

from __future__ import annotations

import functools

import torch
from torch import Tensor



@functools.cache
def compiled_flex():
    """``torch.compile(flex_attention)``, shared by every pack and layer."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _softcap_score_mod(softcap: float):
    def softcap_score(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return softcap_score


def attention(q, k, v, ctx, *, scale, softcap, window, dropout) -> Tensor:
    reasons = []
    if q.device.type == "cpu" and torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
    ):
        reasons.append(
            "PyTorch has no FlexAttention backward on CPU: run the forward under "
            "torch.no_grad() (scoring, inference) or train with backend='segment'"
        )
    if dropout:
        reasons.append(
            f"FlexAttention has no attention dropout (got dropout={dropout}); set the model's "
            "attention dropout to 0 or use backend='segment'"
        )
    if reasons:
        raise RuntimeError("backend='flex' cannot run here: " + "; ".join(reasons))
    pack = ctx.pack
    block_mask = ctx.cached(
        ("flex", ctx.block_size, window), lambda: pack.block_mask(ctx.block_size, window=window)
    )
    score_mod = None if softcap is None else _softcap_score_mod(softcap)
    return compiled_flex()(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
