"""The flex backend: FlexAttention with the pack's BlockMask, compiled per pack shape."""

from __future__ import annotations

import functools

import torch
from torch import Tensor


RECOMPILE_LIMIT = 32  # distinct pack shapes one process may compile flex for


@functools.cache
def compiled_flex():
    """``torch.compile(flex_attention)`` for static shapes, shared by every pack and layer.

    Each distinct pack length compiles once. Dynamic shapes would avoid that, but PyTorch
    2.13's CPU flex template miscompiles them for some lengths (an undeclared
    ``cur_qSplitSize`` in the generated C++). Past dynamo's recompile limit a compiled
    function silently runs the unfused path, which materialises T' x T' scores; ``_run``
    raises instead (see RECOMPILE_LIMIT).
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _softcap_score_mod(softcap: float):
    def softcap_score(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return softcap_score


def _run(pack, q, k, v, *, block_size, scale, softcap, window) -> Tensor:
    import torch._dynamo

    block_mask = pack.derived(("attention", "flex", block_size, window),
                              lambda: pack.block_mask(block_size, window=window))
    score_mod = None if softcap is None else _softcap_score_mod(softcap)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                    fail_on_recompile_limit_hit=True):
        try:
            return compiled_flex()(
                q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise RuntimeError(
                f"backend='flex' has compiled for {RECOMPILE_LIMIT} distinct pack shapes in this "
                "process; running more would fall back to the unfused path (T' x T' scores). "
                "Pad packs to a few lengths (pad_to_multiple_of=1024 or a planner budget that is "
                "a multiple of it) or use backend='segment'"
            ) from e


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
    return _run(ctx.pack, q, k, v, block_size=ctx.block_size, scale=scale, softcap=softcap,
                window=window)
