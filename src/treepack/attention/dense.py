"""The dense reference backend: the T' x T' mask, SDPA or the eager formula."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from treepack.core.derived import derived_from_pack


def window_mask(pos_q: Tensor, pos_kv: Tensor, window: int | None) -> Tensor | None:
    """[..., Lq, Lk] True where the query is fewer than ``window`` positions past the key."""
    if window is None:
        return None
    return pos_q[..., :, None] - pos_kv[..., None, :] < window


def math_attention(q, k, v, mask, *, scale, softcap, dropout) -> Tensor:
    """The eager formula (as transformers' eager attention): scores in the input dtype,
    soft-capping, the mask, softmax in float32 at least, dropout, values."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32))
    probs = probs.to(q.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)


def sdpa(q, k, v, mask, *, scale, softcap, dropout) -> Tensor:
    """SDPA with a boolean mask or attention bias, or the eager formula for soft-capping
    (which needs a boolean mask).

    Under autocast the inputs are cast to autocast's dtype here, as autocast casts SDPA's:
    an attention bias (``causal_lower_right``) checks their dtypes before autocast would,
    and a model's rotary embedding returns float32 queries and keys beside lower-precision
    values."""
    if softcap is not None:
        return math_attention(q, k, v, mask, scale=scale, softcap=softcap, dropout=dropout)
    kind = q.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


@derived_from_pack
def visible(pack, window: int | None, chunk: int | None = None) -> Tensor:
    """BoolTensor [T', T']: the pack's dense mask, cut to ``window`` and to ``chunk``s of
    depth (a query sees the keys of its own chunk only), cached per pack."""
    mask = pack.dense_mask()
    win = window_mask(pack.position_ids, pack.position_ids, window)
    if chunk is not None:
        block = pack.position_ids // chunk
        mask = mask & (block[:, None] == block[None, :])
    return mask if win is None else mask & win


def attention(q, k, v, attend, *, scale, softcap, window, dropout, sink=False,
              chunk=None, blocks=None) -> Tensor:
    mask = visible(attend.pack, window, chunk)
    if blocks is not None:  # a block's rows see each other, within the window's lower bound
        same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
        pos = attend.pack.position_ids
        win = window_mask(pos, pos, window)
        mask = mask | (same if win is None else same & win)
    if sink:  # one more key, seen by every query (treepack.attention.sink_channel)
        k, v = with_sink_key(k, v, 2)
        mask = torch.cat((mask, mask.new_ones((mask.shape[0], 1))), 1)
    return sdpa(q, k, v, mask, scale=scale, softcap=softcap, dropout=dropout)


def with_sink_key(k: Tensor, v: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``k`` (its last channel the sink's) and ``v`` with the sink key appended along ``dim``:
    1 in that channel and 0 elsewhere, and a zero value."""
    shape = list(k.shape)
    shape[dim] = 1
    key = k.new_zeros(shape)
    key[..., -1] = 1
    shape[-1] = v.shape[-1]
    return torch.cat((k, key), dim), torch.cat((v, v.new_zeros(shape)), dim)
