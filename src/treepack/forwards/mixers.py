"""The token mixers of one tree forward: :class:`TreeForward`, the protocol every adapter's
layers call, and its two implementations over a pack's rows.

A model's token mixers (each attention layer, and a hybrid's short convolutions and recurrent
scans) run on a tree through the per-forward object the adapter hands them:

- :class:`PackForward`: the whole pack (``treepack.hf.logprobs``, ``treepack.megatron.logprobs``);
- :class:`PartForward`: one part of a tree run in parts, reading what the parts above it
  carry (:mod:`.carried`);
- :class:`ShardedForward`: one rank's slice of either (the transformers adapter's sequence
  parallelism, Megatron's context parallelism): the inputs exchanged to the rank's heads,
  then the forward it wraps.

Every one of them takes queries, keys and values as ``[1, heads, rows, d]`` (the forward's
rows, in order) and a mixer's inputs per row, so callers never branch on which forward runs.
The adapter counts the calls it routes (``calls``, ``windowed``, ``mixer_calls``) to prove that
every layer took the tree.
"""

from __future__ import annotations

import collections
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from treepack.attention import TreeAttention, dense
from treepack.attention.exchange import HeadExchange
from treepack.core.tree import TreePack
from treepack.forwards.carried import Carried, attend_part
from treepack.forwards.plans import conv_paths, scan_plan
from treepack.recurrent import level_scan, path_conv1d, scan_levels, tree_conv1d

__all__ = ["TreeForward", "PackForward", "PartForward", "ShardedForward", "with_params"]


@runtime_checkable
class TreeForward(Protocol):
    """What every token mixer of a tree forward receives.

    Attributes:
        pack: the whole pack (a part or a slice computes some of its rows).
        depths: ``[rows]`` the depths of the forward's rows, in order (set by the adapter's
            forward; Llama 4's temperature tuning reads them).
        calls, windowed, mixer_calls: the attention calls, those with a sliding window, and
            the recurrent calls per role, as the adapter counts them.
    """

    pack: TreePack
    depths: Tensor | None
    calls: int
    windowed: int
    mixer_calls: collections.Counter

    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, *, scale,
               softcap=None, window=None, dropout: float = 0.0, sinks: Tensor | None = None,
               chunk: int | None = None) -> Tensor:
        """One attention layer (``module`` names it): ``[1, heads, rows, d]`` in and out."""

    def dense_mask(self) -> Tensor:
        """``[rows, rows]`` which rows each row sees, for a layer that masks by itself."""

    def set_blocks(self, blocks: Tensor) -> None:
        """``[T']`` blocks of rows that see each other both ways (-1 elsewhere)."""

    def conv(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """One short causal convolution along each row's path, ``x`` ``[rows, C]``."""

    def scan(self, kernel, inputs: dict[str, Tensor], per_head: dict | None = None,
             shared: tuple[str, ...] = (), layer: Tensor | None = None) -> Tensor:
        """One recurrent scan over every path, each segment from its parent's state."""


class PackForward:
    """:class:`TreeForward` over every row of a pack: the attention backend's tree, the
    convolutions and scans of :mod:`treepack.recurrent`."""

    depths = None
    blocks = None  # [T'] rows that see each other both ways (Gemma 3's images), -1 elsewhere

    def __init__(self, pack: TreePack, backend: str, block_size: int = 128):
        self.pack = pack
        self.attention = TreeAttention(pack, backend, block_size=block_size)
        self.calls = 0
        self.windowed = 0
        self.mixer_calls: collections.Counter = collections.Counter()

    def attend(self, module, query, key, value, **kwargs):
        if self.blocks is not None:
            kwargs["blocks"] = self.blocks
        return self.attention(query, key, value, **kwargs)

    def dense_mask(self) -> Tensor:
        return dense.visible(self.pack, None)  # built once per pack

    def set_blocks(self, blocks: Tensor) -> None:
        self.blocks = blocks

    def conv(self, x, weight, bias):
        return tree_conv1d(self.pack, x, weight, bias)

    def scan(self, kernel, inputs, per_head=None, shared=(), layer=None):
        """``per_head``: the layer's per-head parameters (Mamba2's ``A`` and ``D``), which
        reach the kernel in its batch; ``shared``: the inputs of one head that every head
        reads whole (Mamba's ``B`` and ``C``; a sequence-parallel rank gathers them rather
        than splits them); ``layer``: a weight of a layer that runs no convolution first
        (MiniMax's lightning attention), which names its state in parts."""
        return level_scan(self.pack, with_params(kernel, per_head), inputs)


class PartForward:
    """:class:`TreeForward` over one part of a tree in parts: every mixer over the part's
    context (what the parts above it carry) and its own rows.

    Args:
        carried: what the parts run so far carry.
        index: the part.
        error: the adapter's refusal type (what this forward cannot run is raised as it).
        backend: how the part attends (:func:`~treepack.forwards.carried.attend_part`).
    """

    depths = None

    def __init__(self, carried: Carried, index: int, error: type[Exception] = ValueError,
                 backend: str = "segment"):
        self.backend = backend  # attend_part's: "varlen", "auto" or the segment calls
        self.pack = carried.parts.pack
        self.carried, self.index, self.error = carried, index, error
        self.budget = carried.parts.max_rows
        self.calls = 0
        self.windowed = 0
        self.mixer_calls: collections.Counter = collections.Counter()
        self.layer = None  # the recurrent layer under way: its convolution's weight

    def attend(self, module, query, key, value, *, scale, softcap=None, window=None,
               dropout=0.0, sinks=None, chunk=None):
        return attend_part(self.carried, self.index, module, query, key, value, scale=scale,
                           softcap=softcap, window=window, dropout=dropout, sinks=sinks,
                           chunk=chunk, backend=self.backend)

    def dense_mask(self):
        raise self.error("a layer that builds its own mask of the pack (DeepSeek sparse "
                         "attention's indexer) in parts: a part holds some of the rows. Raise "
                         "max_tokens so the tree runs in one forward")

    def set_blocks(self, blocks):
        raise self.error(
            "image tokens that see each other both ways (Gemma 3) in parts: a part's rows "
            "cannot see rows a later part computes. Raise max_tokens so the tree runs in one "
            "forward, or run these sequences unpacked")

    def conv(self, x, weight, bias):
        # a layer's convolution weight names it, in every forward and recompute of the step
        self.layer = ("conv", weight.data_ptr())
        self.scans = 0  # the layer's scans so far (Zamba scans once per Mamba head)
        self.carried.put(self.index, self.layer, x)
        paths = conv_paths(self.pack, self.budget, self.index, weight.shape[1])
        context = self.carried.gather(self.layer, paths.context, 0)
        if context is not None:
            x = torch.cat((x, *context))
        return path_conv1d(x, paths.index, weight, bias)

    def scan(self, kernel, inputs, per_head=None, shared=(), layer=None):
        kernel = with_params(kernel, per_head)
        if layer is not None:  # a layer without a convolution names itself
            self.layer, self.scans = ("mixer", layer.data_ptr()), 0
        if self.layer is None:
            raise self.error("a recurrent scan ran before its layer's convolution: treepack "
                             "cannot tell which layer's state to carry")
        key = ("scan", self.layer[1], self.scans)
        self.scans += 1
        plan = scan_plan(self.pack, self.budget, self.index)
        initial = None
        if plan.carried:  # root chains continuing another part's state; the others from zeros
            states = [self.carried.leaves[j][key][0].index_select(0, position)
                      for j, position, _ in plan.carried]
            which = torch.cat([chains for _, _, chains in plan.carried])
            initial = states[0].new_zeros((plan.roots, *states[0].shape[1:]))
            initial = initial.index_copy(0, which, torch.cat(states))
        out, finals = scan_levels(plan.levels, kernel, inputs, initial)
        if plan.picks:
            exported = torch.cat([finals[d].index_select(0, hit) for d, hit in plan.picks])
            self.carried.put(self.index, key, exported.index_select(0, plan.reorder))
        return out


class ShardedForward:
    """The token mixers (a :class:`TreeForward`) of one rank's slice of a forward's rows:
    every mixer's inputs exchanged to (all rows, this rank's heads or channels), ``inner``'s
    mixer over all rows, and back. The transformers adapter's sequence parallelism and
    Megatron's context parallelism (its recurrent layers) run on it.

    Args:
        inner: the mixers over all the forward's rows (the pack's :class:`PackForward`, or a
            part's :class:`PartForward`).
        exchange: the rows' exchange over the group
            (:class:`treepack.attention.exchange.HeadExchange`, its ``error`` the adapter's
            refusal type).
    """

    def __init__(self, inner: TreeForward, exchange: HeadExchange):
        self.inner, self.exchange, self.pack = inner, exchange, inner.pack
        self.total = exchange.total
        self.calls = 0
        self.windowed = 0
        self.mixer_calls = type(inner.mixer_calls)()

    def attend(self, module, query, key, value, **kwargs):
        if kwargs.get("sinks") is not None:  # this rank's heads' sink logits
            kwargs["sinks"] = kwargs["sinks"].chunk(self.exchange.size)[self.exchange.rank]
        return self.exchange.attend(
            query, key, value, lambda q, k, v: self.inner.attend(module, q, k, v, **kwargs),
            type(module).__name__)

    def set_blocks(self, blocks):
        self.inner.set_blocks(blocks)  # the inner forward attends over every row

    def dense_mask(self):
        raise self.exchange.error(
            "a layer that builds its own mask of the pack (DeepSeek sparse attention's "
            "indexer) with the rows split over ranks (sequence or context parallelism): each "
            "rank holds a slice of them. Run it without a group")

    def conv(self, x, weight, bias):
        lo, hi = self.exchange.split(x.shape[1], "channels", "a short convolution")
        out = self.inner.conv(self.exchange.to_heads(x, 1, 0), weight[lo:hi],
                              None if bias is None else bias[lo:hi])
        return self.exchange.to_rows(out, 0, 1)

    def scan(self, kernel, inputs, per_head=None, shared=(), layer=None):
        # every head reads a shared input whole (Mamba's B and C): each rank gathers all
        # rows of it, one copy per rank through the same exchange
        whole = {k: self.exchange.to_heads(inputs[k].expand(-1, self.exchange.size,
                                                            *inputs[k].shape[2:]), 1, 0)
                 for k in shared}
        inputs = {k: t for k, t in inputs.items() if k not in whole}
        # a Gated DeltaNet scan repeats its query / key heads up to the value heads inside
        # the kernel (transformers 5.11 on): repeated here instead, so that a rank's heads
        # are whole
        counts = sorted({t.shape[1] for t in inputs.values()})
        heads = counts[-1]
        if any(heads % c for c in counts):
            raise self.exchange.error(
                f"a recurrent scan whose inputs have {counts} heads: sequence or context "
                "parallelism splits a scan by heads")
        lo, hi = self.exchange.split(heads, "heads", "a recurrent scan")
        inputs = {k: self.exchange.to_heads(t if t.shape[1] == heads else
                                            t.repeat_interleave(heads // t.shape[1], 1), 1, 0)
                  for k, t in inputs.items()}
        per_head = {k: t[lo:hi] for k, t in (per_head or {}).items()}  # this rank's heads
        return self.exchange.to_rows(self.inner.scan(kernel, inputs | whole, per_head,
                                                     layer=layer), 0, 1)


def with_params(kernel, params: dict | None):
    """``kernel`` whose batch also holds ``params`` (per-head tensors, not per row)."""
    if not params:
        return kernel
    return lambda batch, state: kernel({**batch, **params}, state)
