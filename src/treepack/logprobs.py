"""Per-occurrence log-probs and entropies from packed outputs, in the original layout.

Each packed row is normalised once; the M prediction occurrences then read their source
row by plain advanced indexing, so in backward every occurrence's gradient is added into
the shared row (autograd accumulates repeated indices).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from treepack.tree import TreePack

__all__ = ["token_logprobs", "token_entropy"]


def _scaled_logits(pack: TreePack, logits: Tensor, temperature: float, what: str) -> Tensor:
    if logits.dim() != 2 or logits.shape[0] != pack.num_rows:
        hint = (
            "; for a model output of shape [1, T', V] pass out.logits[0]"
            if logits.dim() == 3 and logits.shape[0] == 1
            else ""
        )
        raise ValueError(
            f"{what} expects logits of shape [T'={pack.num_rows}, V], got "
            f"{tuple(logits.shape)}{hint}"
        )
    if logits.device != pack.device:
        raise ValueError(
            f"logits are on {logits.device} but the pack is on {pack.device}; move the pack "
            f"with pack.to({str(logits.device)!r})"
        )
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [T', V]
    return z if temperature == 1.0 else z / temperature


def _to_layout(pack: TreePack, values: Tensor) -> Tensor:
    """Place per-occurrence values [M] at their [N, L] positions, 0 elsewhere."""
    n, L = pack.rows.shape
    out = values.new_zeros(n * L).index_put((pack.predictions.index,), values)
    return out.view(n, L)


def token_logprobs(pack: TreePack, logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """``[s, p] = log p(seq_s[p] | seq_s[:p])`` from packed logits [T', V], as [N, L]."""
    z = _scaled_logits(pack, logits, temperature, "token_logprobs")
    lse = torch.logsumexp(z, dim=-1)  # [T'] once per packed row
    src, tgt = pack.predictions.source, pack.predictions.target  # [M]
    return _to_layout(pack, z[src, tgt] - lse[src])


def token_entropy(pack: TreePack, logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of each prediction's next-token distribution, in the [N, L] layout."""
    z = _scaled_logits(pack, logits, temperature, "token_entropy")
    logp = torch.log_softmax(z, dim=-1)  # [T', V]
    # A -inf logit (a masked-out token) has p = 0 and contributes 0, in value and gradient.
    ent = -(logp.exp() * logp.masked_fill(logp.isneginf(), 0)).sum(-1)  # [T']
    return _to_layout(pack, ent[pack.predictions.source])
