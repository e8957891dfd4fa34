"""The flex backend: FlexAttention with the pack's BlockMask, compiled for bucketed lengths.

A compiled kernel is specialised to the sequence length, so a training run whose packs all
differ in length would recompile every step. The backend therefore runs each pack at a
*bucket* length: its rows rounded up to whole blocks and then to one of 8 steps per doubling
(at most 1/8 extra rows, see :func:`bucket_length`). The extra rows are padding that sees
only itself, so they add one diagonal block per padding block and change no real row. A
planner budget of one size thus compiles a handful of lengths, once each per process.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from treepack.core import mask as _mask
from treepack.attention.chains import geometric_bucket
from treepack.core.derived import derived_from_pack

RECOMPILE_LIMIT = 32  # flex compiles one process may make (per bucket length, dtype, head
# layout, window, soft-cap, sinks, blocks and grad mode)


def bucket_length(rows: int, block_size: int) -> int:
    """The length flex runs ``rows`` rows at: whole blocks, the block count rounded up to one
    of 8 steps per doubling past 16 blocks (:func:`geometric_bucket`: at most 1/8 more)."""
    return geometric_bucket(-(-rows // block_size)) * block_size


@functools.cache
def compiled_flex():
    """``torch.compile(flex_attention)`` for static shapes, shared by every pack and layer.

    Each distinct bucket length compiles once. Dynamic shapes would avoid even that, but
    PyTorch 2.13's CPU flex template miscompiles them for some lengths (an undeclared
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


@derived_from_pack
def bucket_block_mask(pack, block_size: int, window: int | None, length: int):
    """The pack's BlockMask over ``length >= T'`` rows, the extra rows padding (see module)."""
    return _bucket_block_mask(pack, block_size, window, length)


def _bucket_block_mask(pack, block_size: int, window: int | None, length: int,
                       blocks: Tensor | None = None):
    """:func:`bucket_block_mask`, with ``blocks`` (``[T']`` block ids, -1 outside) the rows of
    a block also seeing each other both ways (:func:`treepack.core.mask.tree_mask_mod`)."""
    h = pack.host
    extra = np.arange(pack.num_rows, length)
    ends = np.concatenate((h.subtree_end, extra + 1))
    pos = np.concatenate((h.position_ids, np.zeros_like(extra)))
    ids = None if blocks is None else np.concatenate(
        (blocks.cpu().numpy(), np.full(extra.shape, -1, dtype=np.int64)))
    device = pack.device
    mask_mod = _mask.tree_mask_mod(torch.from_numpy(ends).to(device),
                                   torch.from_numpy(pos).to(device), window,
                                   None if ids is None else torch.from_numpy(ids).to(device))
    return _mask.block_mask(ends, block_size=block_size, device=device, mask_mod=mask_mod,
                            position_ids=pos, window=window, blocks=ids)


def _run(attend, q, k, v, *, scale, softcap, window, sinks=None, blocks=None) -> Tensor:
    import torch._dynamo

    pack, block_size = attend.pack, attend.block_size
    rows = q.shape[2]
    length = bucket_length(rows, block_size)
    if blocks is None:
        block_mask = bucket_block_mask(pack, block_size, window, length)
    else:  # per blocks tensor, on the attention object (as varlen's block plans)
        block_mask = attend.with_blocks(
            blocks, ("flex", block_size, window, length),
            lambda: _bucket_block_mask(pack, block_size, window, length, blocks))
    if length > rows:
        q, k, v = (F.pad(x, (0, 0, 0, length - rows)) for x in (q, k, v))
    score_mod = None if softcap is None else _softcap_score_mod(softcap)
    extra = {}
    if sinks is not None:  # the log-sum-exp takes the sink: FlexAttention differentiates it
        from torch.nn.attention.flex_attention import AuxRequest

        extra["return_aux"] = AuxRequest(lse=True)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                    fail_on_recompile_limit_hit=True):
        try:
            out = compiled_flex()(
                q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                enable_gqa=q.shape[1] != k.shape[1], **extra,
            )
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise RuntimeError(
                f"backend='flex' has compiled {RECOMPILE_LIMIT} times in this process (one "
                "compile per bucket length, dtype, head layout, window, soft-cap, sinks, "
                "blocks and grad mode); running more would fall back to the unfused path "
                "(T' x T' scores). Keep pack lengths in a narrower range (a planner budget), "
                "use fewer model variants per process, or use backend='varlen' / 'segment'"
            ) from e
    if sinks is not None:
        out, aux = out
        out = with_sinks(out, aux.lse, sinks)
    return out[:, :, :rows]


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Attention ``out`` ``[1, H, T, D]`` with log-sum-exp ``lse`` ``[1, H, T]`` renormalised
    for one more logit per head, ``sinks`` ``[H]``, that attends to nothing: ``out *
    exp(lse - logaddexp(lse, sink)) = out * sigmoid(lse - sink)``, the factor computed in
    float32 at least and applied in ``out``'s dtype."""
    acc = torch.promote_types(lse.dtype, torch.float32)
    gate = torch.sigmoid(lse.to(acc) - sinks.to(acc)[None, :, None])
    return out * gate[..., None].to(out.dtype)


def unsupported(q: Tensor, k: Tensor, v: Tensor, *, dropout: float,
                sinks: Tensor | None = None, chunk: int | None = None) -> list[str]:
    """Why FlexAttention cannot run these inputs (empty when it can)."""
    reasons = []
    if chunk is not None:
        reasons.append("chunked attention (a query sees the keys of its own chunk of depths) "
                       "runs on segment / dense / varlen (flex has no chunked attention); use "
                       "backend='varlen' on a GPU, 'segment' elsewhere (or 'auto', which picks)")
    if sinks is not None and q.device.type == "cpu":
        reasons.append("FlexAttention's compiled CPU kernel returns no log-sum-exp, which "
                       "attention sinks need; use backend='segment' on a CPU")
    if q.device.type == "cpu" and torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
    ):
        reasons.append(
            "PyTorch has no FlexAttention backward on CPU: run the forward under "
            "torch.no_grad() (scoring, inference) or train with backend='segment'"
        )
    if q.device.type == "cpu" and q.dtype == torch.float64:
        reasons.append("FlexAttention's compiled CPU kernel does not take float64; use "
                       "backend='segment' (or 'dense') for float64")
    if dropout:
        reasons.append(
            f"FlexAttention has no attention dropout (got dropout={dropout}); set the model's "
            "attention dropout to 0 or use backend='segment'"
        )
    return reasons


def attention(q, k, v, attend, *, scale, softcap, window, dropout, sinks=None, chunk=None,
              blocks=None) -> Tensor:
    reasons = unsupported(q, k, v, dropout=dropout, sinks=sinks, chunk=chunk)
    if reasons:
        raise RuntimeError("backend='flex' cannot run here: " + "; ".join(reasons))
    return _run(attend, q, k, v, scale=scale, softcap=softcap, window=window, sinks=sinks,
                blocks=blocks)
