"""Linear attention with a decay per step and head: the kernel of families whose layers
compute it inline rather than through a function treepack can route (MiniMax's lightning
attention), so that a tree's scan can start a segment from its parent's state."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["decayed_linear_attention"]


def decayed_linear_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                             state: Tensor | None = None, chunk: int = 64
                             ) -> tuple[Tensor, Tensor]:
    """``S_t = exp(g_t) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` (no scaling), in chunks.

    Within a chunk the decays are cumulative log-decays ``G``: a query at i reads key j <= i
    with ``exp(G_i - G_j)`` and the chunk's starting state with ``exp(G_i)``. A step with
    ``g = 0`` and zero ``k``, ``v`` leaves the state as it was (a level's padding).

    Args:
        q, k: ``[B, L, H, Dk]``.
        v: ``[B, L, H, Dv]``.
        g: ``[B, L, H]`` log-decay of each step (non-positive).
        state: ``[B, H, Dk, Dv]`` starting state, or None for zeros.
        chunk: rows per chunk (sets how the sums are grouped, not what they are).

    Returns:
        (``[B, L, H, Dv]`` outputs, ``[B, H, Dk, Dv]`` final state).
    """
    B, L, H, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-L) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))  # [B,H,L',D]
    g = F.pad(g, (0, 0, 0, pad)).transpose(1, 2)  # [B, H, L']
    n = q.shape[2] // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    G = g.reshape(B, H, n, chunk).cumsum(-1)
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state.to(q.dtype)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    outs = []
    for i in range(n):  # chunks, not tokens
        Gi, qi, ki, vi = G[:, :, i], q[:, :, i], k[:, :, i], v[:, :, i]
        decay = torch.exp((Gi[..., :, None] - Gi[..., None, :]).masked_fill(~causal, -torch.inf))
        intra = ((qi @ ki.transpose(-1, -2)) * decay) @ vi
        inter = (qi * Gi.exp()[..., None]) @ S
        outs.append(intra + inter)
        last = Gi[..., -1:]  # [B, H, 1]
        S = S * last.exp()[..., None] + (ki * (last - Gi).exp()[..., None]).transpose(-1, -2) @ vi
    out = torch.cat(outs, dim=2)[:, :, :L].transpose(1, 2)  # [B, L, H, Dv]
    return out, S
