"""Per-occurrence log-probs and entropies from packed outputs, in the original layout.

Each packed row is normalised once, however many prediction occurrences read it, and in
backward every occurrence's gradient is added into the shared row. From logits
(:meth:`TreePack.token_logprobs`) the rows are normalised in chunks by
:mod:`treepack.softmax`; from hidden states (:func:`logprobs_from_hidden`) each chunk's
logits are also computed, and recomputed in backward, so no ``[T', V]`` tensor exists.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from treepack.core import checks
from treepack.core.checks import floating, positive_finite, positive_int
from treepack.core.softmax import default_chunk_size  # shared with the logits path
from treepack.core.tree import TreePack, derived_from_pack

__all__ = ["token_logprobs", "token_entropy", "logprobs_from_hidden",
           "logprobs_and_entropy_from_hidden", "row_logprobs_from_hidden", "TokenLogprobs",
           "RowLogprobs", "head_logits", "edges"]


def token_logprobs(pack: TreePack, logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """``[s, p] = log p(seq_s[p] | seq_s[:p])`` from packed logits [T', V]: the function form
    of :meth:`TreePack.token_logprobs`."""
    return pack.token_logprobs(logits, temperature=temperature)


def token_entropy(pack: TreePack, logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of each prediction's distribution: the function form of
    :meth:`TreePack.token_entropy`."""
    return pack.token_entropy(logits, temperature=temperature)


# ---------------------------------------------------------------------- lean log-probs


class TokenLogprobs(NamedTuple):
    """Log-probs and entropies in the pack's layout ([N, L], or [total] when flat)."""

    logprobs: Tensor  # [N, L]
    entropy: Tensor | None  # [N, L]


class RowLogprobs(NamedTuple):
    """Per packed row: the log-prob of the row's token given its parent row (0 at roots and
    padding), and the entropy of the next-token distribution at the row."""

    logprobs: Tensor  # [T']
    entropy: Tensor | None  # [T']

    def in_layout(self, pack: TreePack) -> TokenLogprobs:
        """These per-row values in ``pack``'s layout, label-aligned as
        :meth:`TreePack.token_logprobs` and :meth:`TreePack.token_entropy` are: ``[s, p]``
        holds the log-prob of token ``p`` (at its own row, ``rows[s, p]``) and the entropy of
        the distribution that predicted it (at the row before, ``rows[s, p - 1]``); 0 where
        nothing is predicted (position 0, padding). Indexing by ``pack.rows`` directly would
        shift the entropy by one position and read row -1 in a dense layout's padding.

        Args:
            pack: the pack these rows came from.

        Returns:
            :class:`TokenLogprobs` ``[N, L]`` (flat: ``[total]``); ``entropy`` is None when
            these rows have none. Autograd flows back to the row values.

        Raises:
            ValueError: row values whose length is not the pack's row count.
        """
        if self.logprobs.shape != (pack.num_rows,):
            raise ValueError(f"{tuple(self.logprobs.shape)} row values for a pack of "
                             f"{pack.num_rows} rows: use the pack they were computed on")
        p = pack.predictions
        logprobs = pack.place(self.logprobs[pack.rows.reshape(-1)[p.index]])
        entropy = None if self.entropy is None else pack.place(self.entropy[p.source])
        return TokenLogprobs(logprobs, entropy)


class _Edges(NamedTuple):
    """Every (parent row, child row) pair, sorted by parent, with chunk lookups on the host."""

    child: Tensor  # [E] child row (the target token's row)
    parent: Tensor  # [E] parent row (whose logits predict the child's token)
    token: Tensor  # [E] the child's token id
    parent_host: np.ndarray  # [E] for chunk boundaries without a device sync
    child_of_prediction: Tensor  # [M] rows[s, p] of every prediction occurrence


@derived_from_pack
def edges(pack: TreePack) -> _Edges:
    """Every (parent row, child row) pair of ``pack``, sorted by parent (cached per pack)."""
    parent = pack.host.parent_row
    child = np.flatnonzero(parent >= 0)
    order = np.argsort(parent[child], kind="stable")  # nearly sorted already (DFS order)
    child, par = child[order], parent[child][order]
    child_t = torch.from_numpy(np.ascontiguousarray(child)).to(pack.device)
    return _Edges(child_t, torch.from_numpy(np.ascontiguousarray(par)).to(pack.device),
                  pack.input_ids[child_t], par, pack.rows.reshape(-1)[pack.predictions.index])


def head_logits(h: Tensor, weight: Tensor, bias: Tensor | None = None, scale: float = 1.0,
                softcap: float | None = None, temperature: float = 1.0) -> Tensor:
    """Logits ``softcap(scale * (h W^T + b)) / temperature`` of hidden states ``h`` [C, H], in
    float32 at least (the matmul in the input dtype): exactly what
    :func:`logprobs_from_hidden` computes chunk by chunk."""
    z = h @ weight.T
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if bias is not None:
        z += bias.to(z.dtype)
    if scale != 1.0:
        z *= scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if temperature != 1.0:
        z /= temperature
    return z


class _LeanLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, edges, chunks, scale, softcap, temperature,
                with_entropy):
        rows = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        lse = hidden.new_zeros(rows, dtype=dtype)  # per parent row
        child_logp = hidden.new_zeros(rows, dtype=dtype)  # per child row
        entropy = hidden.new_zeros(rows, dtype=dtype) if with_entropy else None
        for a, b, lo, hi in chunks:
            z = head_logits(hidden[a:b], weight, bias, scale, softcap, temperature)  # [C, V]
            lse[a:b] = torch.logsumexp(z, dim=-1)
            if hi > lo:
                local = edges.parent[lo:hi] - a
                child_logp[edges.child[lo:hi]] = z[local, edges.token[lo:hi]] - lse[a:b][local]
            if with_entropy:
                p = torch.exp(z - lse[a:b, None])
                entropy[a:b] = lse[a:b] - (p * _finite(z)).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, lse, entropy)
        ctx.edges, ctx.chunks = edges, chunks
        ctx.scale, ctx.softcap, ctx.temperature = scale, softcap, temperature
        device = hidden.device.type  # backward recomputes under the same autocast state
        ctx.autocast = (device, torch.is_autocast_enabled(device),
                        torch.get_autocast_dtype(device))
        if with_entropy:
            return child_logp, entropy
        return child_logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return _LeanLogprobs._backward(ctx, grad_logp, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, lse, entropy = ctx.saved_tensors
        edges = ctx.edges
        # d logp(child) / d z[parent] = onehot(token) - softmax: every parent needs the sum
        # of its children's gradients.
        g_child = grad_logp[edges.child]  # [E]
        g_parent = torch.zeros_like(lse).index_add_(0, edges.parent, g_child)  # [T']
        device, autocast, autocast_dtype = ctx.autocast
        # The gradient matmuls run in the forward's matmul dtype (autocast's, else the head's)
        # and accumulate the weight gradient in one float32 buffer.
        mm_dtype = autocast_dtype if autocast else weight.dtype
        w_mm = weight.to(mm_dtype)
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=acc,
                                                          device=bias.device)
        grad_hidden = torch.zeros_like(hidden)  # padding rows predict nothing
        keep_z = ctx.softcap is not None or grad_entropy is not None
        for a, b, lo, hi in ctx.chunks:
            h = hidden[a:b]
            z = head_logits(h, weight, bias, ctx.scale, ctx.softcap, ctx.temperature)
            if keep_z:
                p = torch.exp(z - lse[a:b, None])  # [C, V]
                gz = p * -g_parent[a:b, None]
            else:  # z is not needed again: softmax and its gradient in place
                gz = z.sub_(lse[a:b, None]).exp_().mul_(-g_parent[a:b, None])
            if hi > lo:
                local = edges.parent[lo:hi] - a
                gz.index_put_((local, edges.token[lo:hi]), g_child[lo:hi], accumulate=True)
            if grad_entropy is not None:  # dH/dz = p * (E_p[z] - z), E_p[z] = lse - H
                mean_z = (lse[a:b] - entropy[a:b])[:, None]
                gz += grad_entropy[a:b, None] * p * (mean_z - _finite(z))
            if ctx.temperature != 1.0:
                gz /= ctx.temperature
            if ctx.softcap is not None:  # z = cap * tanh(u / cap): dz/du = 1 - (z / cap)^2
                capped = z * ctx.temperature / ctx.softcap
                gz *= 1 - capped * capped
            if ctx.scale != 1.0:
                gz *= ctx.scale
            if grad_bias is not None:
                grad_bias += gz.sum(0, dtype=acc)
            gz = gz.to(mm_dtype)
            with torch.autocast(device, enabled=False):
                grad_hidden[a:b] = gz @ w_mm
                _add_matmul(grad_weight, gz.T, h.to(mm_dtype))
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return (grad_hidden, grad_weight.to(weight.dtype), grad_bias,
                None, None, None, None, None, None)


_FUSED_ACCUMULATE: dict[torch.device, bool] = {}  # addmm(out_dtype=float32) works there


def _add_matmul(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` in place, with ``out`` float32 and ``a``, ``b`` possibly lower.

    Same dtypes: ``addmm_``. Lower-precision inputs on CUDA: cuBLAS writes the float32 sum
    straight into ``out`` (``addmm(..., out_dtype=float32)``, PyTorch >= 2.8), so no [V, H]
    product is rounded to bfloat16 or copied; elsewhere the product is added in place.
    """
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    if out.is_cuda and _FUSED_ACCUMULATE.get(out.device, True):
        try:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            _FUSED_ACCUMULATE[out.device] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _FUSED_ACCUMULATE[out.device] = False  # this torch lacks it: the plain way
    out.add_(a @ b)


def _finite(z: Tensor) -> Tensor:
    """``z`` with -inf logits (tokens masked out) as 0: they have p = 0 and must add 0."""
    return z.masked_fill(z.isneginf(), 0)


def logprobs_from_hidden(
    pack: TreePack,
    hidden: Tensor,
    weight: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    softcap: float | None = None,
    scale: float = 1.0,
) -> Tensor:
    """Label-aligned log-probs [N, L] from hidden states [T', H] and the LM head weight [V, H].

    Equals ``pack.token_logprobs(hidden @ weight.T + bias, temperature=temperature)`` without
    materialising the [T', V] logits: chunk by chunk over packed rows it computes one
    log-sum-exp per row and the logit of each row's child tokens only (a row's children have
    distinct tokens, so one value per distinct prefix serves every occurrence). Backward
    recomputes each chunk, so memory is O(chunk_size x V) plus the [V, H] weight gradient,
    whatever T'. The weight gradient is accumulated in one float32 buffer (on CUDA by cuBLAS
    directly, without a per-chunk [V, H] product). The matmul runs in the head's dtype (hidden
    states are cast to it), or under autocast in autocast's; the rest in float32 at least.
    Backward recomputes under the forward's autocast state, so its gradient is that of the
    computed forward.

    Args:
        pack: the pack the hidden states were computed on.
        hidden: [T', H] the input of the LM head (``hf.forward_hidden(...)
            .last_hidden_state[0]``).
        weight: [V, H] the LM head's weight; ``bias`` [V] its bias, if any.
        temperature: logits are divided by it (finite, > 0).
        chunk_size: rows per chunk; default :func:`default_chunk_size` (1 GiB of float32
            logits per chunk on CUDA, 64 MiB elsewhere).
        with_entropy: kept for earlier releases; use
            :func:`logprobs_and_entropy_from_hidden`.
        softcap, scale: what models do to logits after the head (Gemma 2's
            ``final_logit_softcapping``; Cohere's ``logit_scale``): logits are
            ``softcap(scale * (hidden @ weight.T + bias)) / temperature``; see
            :func:`treepack.hf.lm_head`. ``softcap`` None or 0: none.

    Returns:
        [N, L] log-probs (flat layout: [total]), 0 where :attr:`TreePack.prediction_mask` is
        False.

    Raises:
        ValueError: shapes, devices or dtypes that do not fit the pack, a token id beyond V,
            or a bad number (the message names it).
    """
    if with_entropy:
        return logprobs_and_entropy_from_hidden(
            pack, hidden, weight, bias=bias, temperature=temperature, chunk_size=chunk_size,
            softcap=softcap, scale=scale)
    return _from_hidden(pack, hidden, weight, bias, temperature, chunk_size, softcap, scale,
                        with_entropy=False).logprobs


def logprobs_and_entropy_from_hidden(
    pack: TreePack,
    hidden: Tensor,
    weight: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    softcap: float | None = None,
    scale: float = 1.0,
) -> TokenLogprobs:
    """:func:`logprobs_from_hidden` and the entropy of each prediction's distribution.

    Both come from the same chunks, in the same layout.

    Args:
        pack, hidden, weight, bias, temperature, chunk_size, softcap, scale: as
            :func:`logprobs_from_hidden`.

    Returns:
        :class:`TokenLogprobs` ``(logprobs, entropy)``, each [N, L] (flat: [total]).

    Raises:
        As :func:`logprobs_from_hidden`.
    """
    return _from_hidden(pack, hidden, weight, bias, temperature, chunk_size, softcap, scale,
                        with_entropy=True)


def row_logprobs_from_hidden(pack: TreePack, hidden: Tensor, weight: Tensor, *,
                             with_entropy: bool = False, **head) -> RowLogprobs:
    """The lean head's outputs per packed row, before they are placed in the pack's layout.

    For layouts other than the pack's own (verl's prediction-aligned one): row ``r``'s
    ``logprobs[r]`` is what every occurrence of its token reads, and ``entropy[r]`` is the
    entropy at the row itself, leaves included (the layouts place it at the row's children).

    Args:
        pack, hidden, weight: as :func:`logprobs_from_hidden`.
        with_entropy: also compute the entropies.
        **head: ``bias``, ``temperature``, ``chunk_size``, ``softcap``, ``scale``, as
            :func:`logprobs_from_hidden`.

    Returns:
        :class:`RowLogprobs` ``(logprobs [T'], entropy [T'] or None)``.

    Raises:
        TypeError: a keyword that is not one of those.
        ValueError: as :func:`logprobs_from_hidden`.
    """
    unknown = set(head) - {"bias", "temperature", "chunk_size", "softcap", "scale"}
    if unknown:
        raise TypeError(f"row_logprobs_from_hidden got unknown keywords {sorted(unknown)}")
    return _rows_from_hidden(pack, hidden, weight, head.get("bias"), head.get("temperature", 1.0),
                             head.get("chunk_size"), head.get("softcap"), head.get("scale", 1.0),
                             with_entropy=with_entropy)


def _rows_from_hidden(pack, hidden, weight, bias, temperature, chunk_size, softcap, scale, *,
                      with_entropy: bool) -> RowLogprobs:
    if hidden.dim() != 2 or hidden.shape[0] != pack.num_rows:
        hint = "; for a model output [1, T', H] pass out.last_hidden_state[0]" if (
            hidden.dim() == 3 and hidden.shape[0] == 1) else ""
        raise ValueError(f"hidden must be [T'={pack.num_rows}, H], got {tuple(hidden.shape)}"
                         f"{hint}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[1]}] (the LM head's), got "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V={weight.shape[0]}], got {tuple(bias.shape)}")
    pack.check_device(hidden, "hidden")
    pack.check_device(weight, "weight (the LM head)")
    floating(hidden, "hidden")
    floating(weight, "weight (the LM head)")
    if bias is not None:
        floating(bias, "bias")
    temperature = checks.temperature(temperature)
    scale = positive_finite(scale, "scale") if scale != 1.0 else 1.0
    softcap = None if softcap in (None, 0) else positive_finite(
        softcap, "softcap", hint=" (or None / 0 for no soft-capping)")
    pack.check_vocabulary(weight.shape[0])
    chunk = default_chunk_size(weight.shape[0], hidden.device) if chunk_size is None else \
        positive_int(chunk_size, "chunk_size", hint=" (rows per chunk)")
    if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        hidden = hidden.to(weight.dtype)  # the head's dtype decides (e.g. an fp32 LM head)
    pair = edges(pack)
    bounds = np.searchsorted(pair.parent_host, np.arange(0, pack.num_packed_rows + chunk, chunk))
    chunks = [(a, min(a + chunk, pack.num_packed_rows), int(bounds[i]), int(bounds[i + 1]))
              for i, a in enumerate(range(0, pack.num_packed_rows, chunk))]
    out = _LeanLogprobs.apply(hidden, weight, bias, pair, chunks, scale, softcap,
                              temperature, with_entropy)
    return RowLogprobs(*(out if with_entropy else (out, None)))


def _from_hidden(pack, *args, with_entropy: bool) -> TokenLogprobs:
    rows = _rows_from_hidden(pack, *args, with_entropy=with_entropy)
    logps = pack.place(rows.logprobs[edges(pack).child_of_prediction])
    return TokenLogprobs(logps, None if rows.entropy is None else
                         pack.place(rows.entropy[pack.predictions.source]))
