"""The varlen backend: tree attention as one FlashAttention variable-length call per layer.

Queries are the packed rows as they are (a chain's rows are contiguous, so ``cu_seq_q`` is the
chain boundaries); keys and values are one gather of every chain's context rows and own rows
(``cu_seq_k``), whose backward sums repeated rows in float32. Causal attention in FlashAttention
aligns bottom-right when a chain has more keys than queries, which is exactly "ancestors, then
the chain causally" (:mod:`treepack.attention.chains`); a sliding window of ``W`` positions is
``window_size=(W - 1, 0)``, counted in depth because a chain's keys are its path in depth
order.

On CUDA the call is ``torch.nn.attention.varlen.varlen_attn`` (PyTorch's FlashAttention
kernel; no extra dependency), in float16 / bfloat16. Elsewhere the same index plan runs
through :func:`reference`, a slow exact loop over chains implementing the same contract, so
CPU tests cover the plan every backend shares.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch
from torch import Tensor

from treepack.attention.chains import gather_rows, varlen_index
from treepack.attention.dense import sdpa

FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@functools.cache
def _varlen_attn():
    """PyTorch's varlen FlashAttention and whether it takes ``enable_gqa`` (None if absent)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def unsupported(q: Tensor, *, softcap, dropout, v: Tensor | None = None) -> list[str]:
    """Why the varlen kernel cannot run these inputs (empty when it can)."""
    reasons = []
    if v is not None and v.shape[-1] != q.shape[-1] and q.device.type == "cuda":
        reasons.append(f"values {v.shape[-1]} wide and queries {q.shape[-1]} (multi-latent "
                       "attention): FlashAttention's varlen kernel takes one head size; use "
                       "backend='flex'")
    if softcap is not None:
        reasons.append(f"FlashAttention's varlen kernel has no logit soft-capping (softcap="
                       f"{softcap}); use backend='flex' on a GPU or 'segment'")
    if dropout:
        reasons.append(f"it has no attention dropout (got dropout={dropout}); set the model's "
                       "attention dropout to 0 or use backend='segment'")
    if q.device.type != "cuda":
        return reasons  # the CPU reference takes any dtype and head size
    if _varlen_attn()[0] is None:
        reasons.append(f"torch {torch.__version__} has no torch.nn.attention.varlen (PyTorch >= "
                       "2.10 does); use backend='flex' or 'segment'")
    if q.dtype not in FLASH_DTYPES:
        reasons.append(f"FlashAttention runs float16 / bfloat16, not {q.dtype}; run the model "
                       "in bfloat16 (or under autocast) or use backend='flex' / 'segment'")
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        reasons.append(f"head_dim={head_dim}: FlashAttention needs a multiple of 8 up to "
                       f"{MAX_HEAD_DIM}")
    if _capability(q.device.index) < (8, 0):
        reasons.append("FlashAttention needs a GPU of compute capability 8.0 or newer")
    return reasons


def attention(q, k, v, attend, *, scale, softcap, window, dropout) -> Tensor:
    reasons = unsupported(q, softcap=softcap, dropout=dropout, v=v)
    if reasons:
        raise RuntimeError("backend='varlen' cannot run here: " + "; ".join(reasons))
    index = varlen_index(attend.pack, window)
    qf = q[0].transpose(0, 1)  # [T', Hq, D], a view: the rows are the queries as they are
    kf, vf = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [T', Hkv, D]
    if index.key_rows is not None:
        kf = gather_rows(kf, index.key_rows, 0)  # [K, Hkv, D]
        vf = gather_rows(vf, index.key_rows, 0)
    window_size = (-1, 0) if window is None else (window - 1, 0)
    if q.device.type == "cuda":
        out = _flash(qf, kf, vf, index, scale=scale, window_size=window_size)
    else:
        out = reference(qf, kf, vf, index.cu_seq_q_host, index.cu_seq_k_host, scale=scale,
                        window_size=window_size)
    return out.transpose(0, 1)[None]  # [1, Hq, T', D]


def _flash(q, k, v, index, *, scale, window_size) -> Tensor:
    varlen_attn, native_gqa = _varlen_attn()
    rep = q.shape[1] // k.shape[1]
    extra = {}
    if rep > 1 and native_gqa:
        extra["enable_gqa"] = True
    elif rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, index.cu_seq_q, index.cu_seq_k, index.max_q, index.max_k,
                       scale=scale, window_size=window_size, **extra)


def reference(q: Tensor, k: Tensor, v: Tensor, cu_seq_q: np.ndarray, cu_seq_k: np.ndarray, *,
              scale: float, window_size: tuple[int, int]) -> Tensor:
    """FlashAttention's varlen contract, one chain at a time: slow, exact, any device.

    ``q`` is ``[Tq, Hq, D]``, ``k``/``v`` ``[Tk, Hkv, D]``; chain ``i`` has queries
    ``cu_seq_q[i] .. cu_seq_q[i+1]`` and keys ``cu_seq_k[i] .. cu_seq_k[i+1]``. With
    ``window_size=(left, 0)``, query ``t`` of ``nq`` sees key ``u`` of ``nk`` iff
    ``u <= nk - nq + t`` (bottom-right causal) and, unless ``left == -1``,
    ``u >= nk - nq + t - left``.
    """
    left, right = window_size
    if right != 0:
        raise ValueError(f"window_size={window_size}: only causal windows (left, 0) are used")
    outs = []
    for a, b, c, d in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(),
                          cu_seq_k[:-1].tolist(), cu_seq_k[1:].tolist()):
        t = torch.arange(b - a, device=q.device)[:, None] + (d - c) - (b - a)
        u = torch.arange(d - c, device=q.device)[None, :]
        mask = u <= t
        if left >= 0:
            mask &= u >= t - left
        qi, ki, vi = (x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d]))
        out = sdpa(qi, ki, vi, mask, scale=scale, softcap=None, dropout=0.0)
        outs.append(out[0].transpose(0, 1))  # [nq, Hq, D]
    return torch.cat(outs)
