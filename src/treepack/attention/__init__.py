"""Attention over a packed forest: ancestors and self only, windows counted in depth.

One signature for every backend::

    attend = TreeAttention(pack, backend="auto")
    out = attend(q, k, v, scale=..., softcap=None, window=None, dropout=0.0)

``q`` is ``[1, Hq, T', D]`` and ``k``/``v`` are ``[1, Hkv, T', D]`` with ``Hq`` a multiple of
``Hkv`` (grouped-query attention); the output is ``[1, Hq, T', D]``. Query row i sees key row
j iff ``j <= i < subtree_end[j]`` and, with a sliding ``window``, ``pos[i] - pos[j] < window``
(depths on the original sequence, never packed distance). ``softcap`` applies
``softcap * tanh(score / softcap)`` to the scaled scores (Gemma 2). ``blocks`` (``[T']``, -1
outside any block) makes rows of one block see each other both ways (Gemma 3's image tokens):
query i also sees key j iff ``blocks[i] == blocks[j] >= 0``, still within the window's lower
bound (``pos[i] - pos[j] < window``), as transformers composes them.

Backends:

``varlen``   one FlashAttention variable-length call per layer (``torch.nn.attention.varlen``):
             each chain's queries (contiguous packed rows) against its gathered ancestor path
             and its own rows, causal aligned bottom-right. GPU, float16 / bfloat16; on CPU an
             exact slow reference of the same index plan (for tests). Also sinks (through the
             kernel's log-sum-exp), chunks (chains cut at chunk starts) and blocks (two
             calls: :mod:`treepack.attention.varlen`, :mod:`treepack.attention.chains`).
``segment``  exact sparsity on standard SDPA kernels, forward and backward anywhere: chains of
             equal shape batched into one call each.
``flex``     FlexAttention with the pack's BlockMask, compiled for a few bucketed lengths;
             forward and backward on GPU, forward only on CPU (PyTorch has no CPU flex
             backward). Also sinks (through its differentiable log-sum-exp; on a GPU only:
             the compiled CPU kernel returns none) and blocks (one more ``mask_mod`` rule);
             not chunks.
``dense``    SDPA (or the eager formula, for soft-capping) with the dense T' x T' mask; the
             reference, for small packs.
``auto``     the default: on CUDA ``varlen`` where it applies, else ``flex``, else
             ``segment``; on CPU ``segment``. Never ``dense``. Chosen per call (a model may mix
             soft-capped, sliding, chunked and sink layers), logged once per choice
             (:func:`choose_backend`).

An explicit backend never falls back: if it cannot run, it raises and lists every reason.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from treepack.attention import dense, flex, segment, varlen
from treepack.core.checks import positive_int

if TYPE_CHECKING:
    from treepack.core.tree import TreePack

__all__ = ["TreeAttention", "Backend", "BACKENDS", "CHOICES", "choose_backend", "check_backend"]


class Backend(Protocol):
    """What every backend module's ``attention`` function is: checked inputs in (``q``
    ``[1, Hq, T', D]``, ``k``/``v`` ``[1, Hkv, T', D]``, the :class:`TreeAttention` with the
    pack), ``[1, Hq, T', D]`` out; it raises ``RuntimeError`` listing every reason it cannot
    run these inputs."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, attend: TreeAttention, *,
                 scale: float, softcap: float | None, window: int | None,
                 dropout: float) -> Tensor: ...


BACKENDS: dict[str, Backend] = {
    "segment": segment.attention,
    "varlen": varlen.attention,
    "flex": flex.attention,
    "dense": dense.attention,
}
CHOICES = ("auto", *BACKENDS)  # what a caller may pass as ``backend``

log = logging.getLogger("treepack")
_LOGGED: set[tuple] = set()


def log_once(message: str, *args) -> None:
    """``log.info(message, *args)`` the first time these arguments come (auto's choices)."""
    if (message, *args) not in _LOGGED:
        _LOGGED.add((message, *args))
        log.info(message, *args)


def check_backend(backend: str, what: str = "backend") -> str:
    """``backend`` if it is one of :data:`CHOICES`, else a ``ValueError`` naming them."""
    if backend not in CHOICES:
        raise ValueError(f"{what}={backend!r} is not a treepack attention backend: use one of "
                         f"{', '.join(map(repr, CHOICES))} ('auto' picks the fastest that "
                         "applies)")
    return backend


def choose_backend(q: Tensor, k: Tensor, v: Tensor, *, softcap: float | None, dropout: float,
                   sinks: Tensor | None = None, chunk: int | None = None,
                   blocks: Tensor | None = None) -> tuple[str, str]:
    """What ``backend="auto"`` runs for these inputs: one layer's choice.

    Args:
        q, k, v: the attention inputs (their device, dtype and head size decide).
        softcap: logit soft-capping of the layer, or None.
        dropout: attention dropout probability.
        sinks, chunk, blocks: the layer's attention sinks, chunk size and blocks of rows
            that see each other both ways, as :class:`TreeAttention` takes them (only
            whether each is given matters).

    Returns:
        ``(backend, why)``: ``"varlen"``, ``"flex"`` or ``"segment"``, and why the faster
        ones do not apply (never ``"dense"``).

    ``varlen`` runs chunks; its sinks (a private PyTorch backward op) and blocks (a
    non-causal window) wait for a GPU run of ``bench/gpu.py`` to check them, so ``auto``
    runs those two on ``flex`` (public FlexAttention; it differentiates the log-sum-exp a
    sink needs, and blocks are one more ``mask_mod`` rule). Flex has no chunks.
    """
    if q.device.type != "cuda":
        return "segment", f"on {q.device.type}, where varlen and flex cannot train"
    skipped = varlen.unsupported(q, softcap=softcap, dropout=dropout, v=v)
    if sinks is not None:
        skipped.append("attention sinks on varlen are not yet checked on a GPU (explicit "
                       "backend='varlen' runs them)")
    if blocks is not None:
        skipped.append("blocks on varlen are not yet checked on a GPU (explicit "
                       "backend='varlen' runs them)")
    if not skipped:
        return "varlen", "FlashAttention varlen applies"
    why = "not varlen: " + "; ".join(skipped)
    flex_skipped = flex.unsupported(q, k, v, dropout=dropout, sinks=sinks, chunk=chunk)
    if not flex_skipped:
        return "flex", why
    return "segment", why + "; not flex: " + "; ".join(flex_skipped)


class TreeAttention:
    """Tree attention for one pack with one backend (``"auto"`` chooses per call).

    Structures derived from the pack (chain plans, block masks, dense masks) are built on
    first use for each window size and cached on the pack (each by its one accessor, e.g.
    :func:`treepack.attention.chains.chains`), so a model with full and sliding layers builds
    each once per pack, however many forwards run over it.
    """

    def __init__(self, pack: TreePack, backend: str = "auto", *, block_size: int = 128):
        if backend not in CHOICES:
            raise ValueError(
                f"backend={backend!r} is not a treepack attention backend; choose one of "
                f"{list(CHOICES)} ('auto' picks the fastest that applies; 'varlen' is "
                "FlashAttention on a GPU, 'segment' runs forward and backward anywhere, 'flex' "
                "is FlexAttention, 'dense' the small-pack reference)"
            )
        self.pack = pack
        self.backend = backend
        self.block_size = block_size

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        window: int | None = None,
        dropout: float = 0.0,
        sinks: Tensor | None = None,
        chunk: int | None = None,
        blocks: Tensor | None = None,
    ) -> Tensor:
        rows = self.pack.num_rows
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(
                f"expected q, k, v of shape [1, heads, T'={rows}, head_dim], got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if q.shape[0] != 1 or q.shape[2] != rows or k.shape[2] != rows or v.shape[2] != rows:
            raise ValueError(
                f"a pack is one sequence of T'={rows} rows: expected batch 1 and length {rows}, "
                f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if q.shape[1] % k.shape[1] != 0 or k.shape[1] != v.shape[1]:
            raise ValueError(
                f"query heads ({q.shape[1]}) must be a multiple of key/value heads "
                f"({k.shape[1]}, {v.shape[1]})"
            )
        self.pack.check_device(q, "the attention input q")
        if window is not None:  # one rule for every backend
            window = positive_int(window, "window", hint=" (positions a query sees, itself "
                                  "included; None for no window)")
        if scale is None:
            scale = q.shape[-1] ** -0.5
        softcap = softcap or None
        if chunk is not None:
            chunk = positive_int(chunk, "chunk", hint=" (depths per attention chunk: a query "
                                 "sees the keys of its own chunk only; None for no chunks)")
        if blocks is not None:
            self._check_blocks(blocks, sinks, chunk)
        if sinks is not None:
            _check_sinks(sinks, q.shape[1], softcap)
        backend = self.backend
        if backend == "auto":
            backend, why = choose_backend(q, k, v, softcap=softcap, dropout=dropout, sinks=sinks,
                                          chunk=chunk, blocks=blocks)
            log_once("treepack attention backend='auto' runs %r (%s)", backend, why)
        kw = dict(scale=scale, softcap=softcap, window=window, dropout=dropout)
        if backend == "varlen":
            return varlen.attention(q, k, v, self, **kw, sinks=sinks, chunk=chunk,
                                    blocks=blocks)
        if backend == "flex":
            return flex.attention(q, k, v, self, **kw, sinks=sinks, chunk=chunk, blocks=blocks)
        if sinks is not None:  # one more key: the sink channel
            q, k = sink_channel(q, k, sinks, scale)
            kw["sink"] = True
        if chunk is not None:
            kw["chunk"] = chunk
        if blocks is not None:
            kw["blocks"] = blocks
        return BACKENDS[backend](q, k, v, self, **kw)

    def _check_blocks(self, blocks: Tensor, sinks, chunk) -> None:
        rows = self.pack.num_rows
        if blocks.shape != (rows,) or blocks.dtype != torch.long:
            raise ValueError(f"blocks must be an int64 [T'={rows}] tensor of block ids (-1 "
                             f"outside any block), got {blocks.dtype} {tuple(blocks.shape)}")
        if sinks is not None or chunk is not None:
            raise ValueError("blocks with attention sinks or chunked attention: no model has "
                             "both, and treepack composes neither with them")
        self.pack.check_device(blocks, "blocks")

    def with_blocks(self, blocks: Tensor, key: tuple, build):
        """``build()`` once per ``blocks`` tensor and ``key``: every layer of a forward passes
        the same blocks, and only the latest tensor's structures are kept (a forward builds
        its blocks anew, so older ones would only pile up on a reused pack)."""
        cached = getattr(self, "_block_plans", None)
        if cached is None or cached[0] is not blocks:
            cached = self._block_plans = (blocks, {})
        if key not in cached[1]:
            cached[1][key] = build()
        return cached[1][key]

    def block_index(self, window: int | None, blocks: Tensor):
        """The two varlen calls of ``blocks`` (:func:`treepack.attention.chains.block_index`),
        built once per blocks tensor and window (:meth:`with_blocks`)."""
        from treepack.attention.chains import block_index

        return self.with_blocks(blocks, ("varlen", window),
                                lambda: block_index(self.pack, window, blocks.cpu().numpy()))


def _check_sinks(sinks: Tensor, heads: int, softcap) -> None:
    """Attention sinks: a learned logit per query head (GPT-OSS's ``s_aux``; zeros for
    off-by-one attention), a term ``exp(sinks[h])`` in every softmax denominator that attends
    to nothing. On ``varlen`` and ``flex`` the kernel's log-sum-exp takes it
    (:class:`treepack.attention.varlen.SinkAttention`, :func:`treepack.attention.flex.
    with_sinks`); on the masked backends it is one more key every query sees whatever its
    window (:func:`sink_channel`)."""
    if sinks.shape != (heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}: one logit per query head "
                         f"({heads},) expected")
    if softcap is not None:
        raise ValueError(f"softcap={softcap} with attention sinks: no model caps its scores "
                         "and has sinks, and the sink's own score must not be capped")


def sink_channel(q: Tensor, k: Tensor, sinks: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``q`` and ``k`` with the sink channel: ``sinks[h] / scale`` appended to every query of
    head ``h``, 0 to every key; a masked backend (segment, dense) run with ``sink=True`` adds
    one more key that every query sees whatever its window, 1 in that channel and 0
    elsewhere, with a zero value. Its score is ``sinks[h]``, every other score is unchanged,
    and the sink's gradient flows through the queries' extra channel."""
    sink = (sinks.to(q.dtype) / scale)[None, :, None, None].expand(1, q.shape[1], q.shape[2], 1)
    return torch.cat((q, sink), -1), torch.cat((k, k.new_zeros((*k.shape[:3], 1))), -1)
