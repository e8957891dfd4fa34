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

Attention sinks (GPT-OSS: a learned logit per head in every softmax denominator) run as
:class:`SinkAttention`: the kernel's output and log-sum-exp, then ``out * exp(lse - lse')``
with ``lse' = logaddexp(lse, sink)``; its backward is the kernel's backward given that output
and ``lse'`` (the softmax with the sink as one more key of value zero), and the sink's
gradient ``-sum(exp(sink - lse') * rowsum(dO * out))``. PyTorch's varlen backward drops a
gradient through the log-sum-exp, so the sink is applied in this autograd function, not by
differentiating through the kernel's ``lse``. On a CPU the kernel is :func:`reference_lse` and
:func:`reference_backward`, exact loops over chains.
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


def check(q: Tensor, v: Tensor, *, softcap, dropout, sinks=None) -> None:
    """Raise ``RuntimeError`` listing every reason varlen cannot run these inputs."""
    reasons = unsupported(q, softcap=softcap, dropout=dropout, v=v)
    if sinks is not None and q.device.type == "cuda" and not _sink_kernels():
        reasons.append(f"torch {torch.__version__} has no varlen log-sum-exp output or no "
                       "varlen backward op (torch.ops.torch_attn._varlen_attn_backward) for "
                       "attention sinks; use backend='segment'")
    if reasons:
        raise RuntimeError("backend='varlen' cannot run here: " + "; ".join(reasons))


def attention(q, k, v, attend, *, scale, softcap, window, dropout, sinks=None,
              chunk=None, blocks=None) -> Tensor:
    check(q, v, softcap=softcap, dropout=dropout, sinks=sinks)
    if blocks is not None:
        return _both_ways(q, k, v, attend.block_index(window, blocks), scale=scale,
                          window=window)
    index = varlen_index(attend.pack, window, chunk)  # chunked: chains cut at chunk starts
    return attend_index(q, k, v, index, scale=scale, window=window, sinks=sinks)


def _both_ways(q, k, v, plan, *, scale, window) -> Tensor:
    """Attention with blocks of rows that see each other both ways (Gemma 3's image tokens) as
    two varlen calls (:class:`~treepack.attention.chains.BlockIndex`): the rows outside blocks
    causally, each block's rows against its ancestors and all of its own rows."""
    outs = []
    for index, rows, both_ways in ((plan.causal, plan.causal_rows, False),
                                   (plan.both_ways, plan.block_rows, True)):
        if index is not None:
            outs.append(attend_index(q.index_select(2, rows), k, v, index, scale=scale,
                                     window=window, both_ways=both_ways))
    return torch.cat(outs, 2).index_select(2, plan.order)


def attend_index(q, k, v, index, *, scale, window, sinks=None,
                 both_ways: bool = False) -> Tensor:
    """``q`` ``[1, Hq, Tq, D]`` against ``k``/``v`` ``[1, Hkv, Tk, D]`` by a varlen ``index``
    (a pack's chains, or a part's over its context's keys and its own), ``[1, Hq, Tq, D]``;
    the inputs checked by the caller (:func:`unsupported`). ``both_ways``: each query sees
    every key of its chain (no causal bound; a window's lower bound still holds)."""
    qf = q[0].transpose(0, 1)  # [Tq, Hq, D], a view: the rows are the queries as they are
    kf, vf = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [Tk, Hkv, D]
    if index.key_rows is not None:
        kf = gather_rows(kf, index.key_rows, 0)  # [K, Hkv, D]
        vf = gather_rows(vf, index.key_rows, 0)
    window_size = (-1 if window is None else window - 1, -1 if both_ways else 0)
    if sinks is not None:
        if q.device.type == "cuda" and q.shape[1] != k.shape[1] and not _varlen_attn()[1]:
            rep = q.shape[1] // k.shape[1]  # no native GQA: the repeat's backward sums heads
            kf, vf = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
        sinks = sinks.to(torch.promote_types(sinks.dtype, torch.float32))  # lse's precision
        out = SinkAttention.apply(qf, kf, vf, sinks, index, scale, window_size)
    elif q.device.type == "cuda":
        out = _flash(qf, kf, vf, index, scale=scale, window_size=window_size)
    else:
        out = reference(qf, kf, vf, index.cu_seq_q_host, index.cu_seq_k_host, scale=scale,
                        window_size=window_size)
    return out.transpose(0, 1)[None]  # [1, Hq, Tq, D]


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


@functools.cache
def _sink_kernels() -> bool:
    """Whether this torch has what :class:`SinkAttention` calls on CUDA."""
    try:
        import torch.nn.attention.varlen as module
    except ImportError:
        return False
    return hasattr(module, "AuxRequest") and hasattr(torch.ops.torch_attn,
                                                     "_varlen_attn_backward")


class SinkAttention(torch.autograd.Function):
    """Varlen attention with a sink logit per query head (the module doc): ``q`` ``[Tq, Hq,
    D]``, ``k``/``v`` ``[Tk, Hkv, D]`` (the gathered keys), ``sinks`` ``[Hq]`` (float32 at
    least)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, index, scale, window_size):
        out, lse = _forward_lse(q, k, v, index, scale=scale, window_size=window_size)
        lse_sink = torch.logaddexp(lse, sinks[:, None].to(lse.dtype))  # [Hq, Tq]
        out = out * torch.exp(lse - lse_sink).T[..., None].to(out.dtype)
        ctx.save_for_backward(q, k, v, out, lse_sink, sinks)
        ctx.index, ctx.scale, ctx.window_size = index, scale, window_size
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse_sink, sinks = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = _backward(grad, q, k, v, out, lse_sink, ctx.index, scale=ctx.scale,
                               window_size=ctx.window_size)
        row = (grad.to(lse_sink.dtype) * out.to(lse_sink.dtype)).sum(-1).T  # [Hq, Tq]
        d_sinks = -(torch.exp(sinks[:, None].to(lse_sink.dtype) - lse_sink) * row).sum(-1)
        return dq, dk, dv, d_sinks.to(sinks.dtype), None, None, None


def _forward_lse(q, k, v, index, *, scale, window_size) -> tuple[Tensor, Tensor]:
    """The kernel's output ``[Tq, Hq, D]`` and log-sum-exp ``[Hq, Tq]``."""
    if q.device.type != "cuda":
        return reference_lse(q, k, v, index.cu_seq_q_host, index.cu_seq_k_host, scale=scale,
                             window_size=window_size)
    from torch.nn.attention.varlen import AuxRequest

    varlen_attn, native_gqa = _varlen_attn()
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] and native_gqa else {}
    return varlen_attn(q, k, v, index.cu_seq_q, index.cu_seq_k, index.max_q, index.max_k,
                       scale=scale, window_size=window_size, return_aux=AuxRequest(lse=True),
                       **extra)


def _backward(grad, q, k, v, out, lse, index, *, scale, window_size):
    """The kernel's backward given ``out`` and ``lse`` (those of the softmax with the sink)."""
    if q.device.type != "cuda":
        return reference_backward(grad, q, k, v, out, lse, index.cu_seq_q_host,
                                  index.cu_seq_k_host, scale=scale, window_size=window_size)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: unused
    return torch.ops.torch_attn._varlen_attn_backward(
        grad, q, k, v, out, lse.float(), index.cu_seq_q, index.cu_seq_k, index.max_q,
        index.max_k, window_size == (-1, 0), rng_state, scale, list(window_size))


def _chains(cu_seq_q, cu_seq_k, window_size, device):
    """Per chain: its query rows, key rows and ``[nq, nk]`` mask (:func:`reference`'s rule)."""
    left, right = window_size
    if right not in (0, -1):
        raise ValueError(f"window_size={window_size}: only windows (left, 0) and (left, -1) "
                         "are used")
    for a, b, c, d in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(),
                          cu_seq_k[:-1].tolist(), cu_seq_k[1:].tolist()):
        t = torch.arange(b - a, device=device)[:, None] + (d - c) - (b - a)
        u = torch.arange(d - c, device=device)[None, :]
        mask = u <= t if right == 0 else torch.ones_like(u <= t)
        if left >= 0:
            mask &= u >= t - left
        yield slice(a, b), slice(c, d), mask


def _probabilities(q, k, mask, lse, scale):
    """``exp(scores - lse)`` of one chain, ``[Hq, nq, nk]``, zero where masked."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    return torch.exp(scores - lse[..., None]).masked_fill(~mask, 0.0)


def reference_lse(q, k, v, cu_seq_q, cu_seq_k, *, scale, window_size):
    """:func:`reference` and its log-sum-exp ``[Hq, Tq]``: exact, one chain at a time."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out, lse = torch.zeros_like(q), q.new_zeros(q.shape[1], q.shape[0])
    for rows, keys, mask in _chains(cu_seq_q, cu_seq_k, window_size, q.device):
        scores = torch.einsum("qhd,khd->hqk", q[rows], k[keys]) * scale
        lse[:, rows] = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1)
        p = _probabilities(q[rows], k[keys], mask, lse[:, rows], scale)
        out[rows] = torch.einsum("hqk,khd->qhd", p, v[keys])
    return out, lse


def reference_backward(grad, q, k, v, out, lse, cu_seq_q, cu_seq_k, *, scale, window_size):
    """FlashAttention's backward given ``out`` and ``lse``, one chain at a time: ``dS = P *
    (dO V^T - rowsum(dO * out))`` with ``P = exp(S - lse)``. With the log-sum-exp and output
    of a softmax that has more terms (a sink), it is that softmax's backward."""
    heads, kv_heads = q.shape[1], k.shape[1]
    rep = heads // kv_heads
    kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kr), torch.zeros_like(vr)
    for rows, keys, mask in _chains(cu_seq_q, cu_seq_k, window_size, q.device):
        p = _probabilities(q[rows], kr[keys], mask, lse[:, rows], scale)
        dv[keys] = torch.einsum("hqk,qhd->khd", p, grad[rows])
        dp = torch.einsum("qhd,khd->hqk", grad[rows], vr[keys])
        ds = p * (dp - (grad[rows] * out[rows]).sum(-1).T[..., None])
        dq[rows] = torch.einsum("hqk,khd->qhd", ds, kr[keys]) * scale
        dk[keys] = torch.einsum("hqk,qhd->khd", ds, q[rows]) * scale

    def per_kv_head(x):  # the query heads of one key head, summed
        return x.view(x.shape[0], kv_heads, rep, x.shape[-1]).sum(2)

    return dq, per_kv_head(dk), per_kv_head(dv)


def reference(q: Tensor, k: Tensor, v: Tensor, cu_seq_q: np.ndarray, cu_seq_k: np.ndarray, *,
              scale: float, window_size: tuple[int, int]) -> Tensor:
    """FlashAttention's varlen contract, one chain at a time: slow, exact, any device.

    ``q`` is ``[Tq, Hq, D]``, ``k``/``v`` ``[Tk, Hkv, D]``; chain ``i`` has queries
    ``cu_seq_q[i] .. cu_seq_q[i+1]`` and keys ``cu_seq_k[i] .. cu_seq_k[i+1]``. With
    ``window_size=(left, 0)``, query ``t`` of ``nq`` sees key ``u`` of ``nk`` iff
    ``u <= nk - nq + t`` (bottom-right causal) and, unless ``left == -1``,
    ``u >= nk - nq + t - left``; with ``(left, -1)`` the causal bound is off.
    """
    outs = []
    for rows, keys, mask in _chains(cu_seq_q, cu_seq_k, window_size, q.device):
        qi, ki, vi = (x.transpose(0, 1)[None] for x in (q[rows], k[keys], v[keys]))
        out = sdpa(qi, ki, vi, mask, scale=scale, softcap=None, dropout=0.0)
        outs.append(out[0].transpose(0, 1))  # [nq, Hq, D]
    return torch.cat(outs)
