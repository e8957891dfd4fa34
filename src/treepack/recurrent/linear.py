"""Linear attention with a decay per step and head: the kernel of families whose layers
compute it inline rather than through a function treepack can route (MiniMax's lightning
attention), and of Mamba2's SSD where no kernel of the family's takes a starting state on
the device (megatron-core's Mamba2 layers on a CPU), so that a tree's scan can start a
segment from its parent's state."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["decayed_linear_attention", "ssd_scan"]


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


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
             state: Tensor | None = None, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """Mamba2's state space duality (SSD) scan, in chunks, from a starting state:
    ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t h_t + D x_t`` per head.

    It is :func:`decayed_linear_attention` with ``C`` as the queries, ``B`` as the keys,
    ``dt x`` as the values and ``dt A`` as the log-decay, computed at float32 or the inputs'
    precision if wider (Mamba2's kernels compute in float32). A step with ``dt = 0`` and
    zero ``x`` leaves the state as it was (a level's padding).

    Args:
        x: ``[b, L, heads, P]``.
        dt: ``[b, L, heads]`` step sizes, after the bias and softplus.
        A: ``[heads]`` (negative).
        B, C: ``[b, L, groups, N]``; head ``h`` reads group ``h // (heads / groups)``.
        D: ``[heads]`` or ``[heads, P]`` skip weights, or None.
        state: ``[b, heads, N, P]`` starting state, or None for zeros.
        chunk: rows per chunk.

    Returns:
        (``[b, L, heads, P]`` outputs at the computing precision, ``[b, heads, N, P]``
        final state).
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    heads = x.shape[2]
    B, C = (t.repeat_interleave(heads // t.shape[2], 2) if t.shape[2] != heads else t
            for t in (B, C))
    x, dt = x.to(compute), dt.to(compute)
    out, final = decayed_linear_attention(C.to(compute), B.to(compute), x * dt[..., None],
                                          dt * A.to(compute), state, chunk)
    if D is not None:
        out = out + x * (D[:, None] if D.dim() == 1 else D).to(compute)
    return out, final
