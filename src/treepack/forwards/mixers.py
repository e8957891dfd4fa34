"""The token mixers of one tree forward: :class:`TreeForward`, the protocol every adapter's
layers call, and its two implementations over a pack's rows.

A model's token mixers (each attention layer, and a hybrid's short convolutions and recurrent
scans) run on a tree through the per-forward object the adapter hands them:

- :class:`PackForward`: the whole pack (``treepack.hf.logprobs``, ``treepack.megatron.logprobs``);
- :class:`PartForward`: one part of a tree run in parts, reading what the parts above it
  carry (:mod:`.carried`);
- and, in the transformers adapter, one rank's slice of either
  (:class:`treepack.adapters.hf.sequence_parallel.ShardedForward`: the inputs exchanged to
  the rank's heads, then the forward it wraps).

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
from treepack.core.tree import TreePack
from treepack.forwards.carried import Carried, attend_part
from treepack.forwards.plans import conv_paths, scan_plan
from treepack.recurrent import level_scan, path_conv1d, scan_levels, tree_conv1d

__all__ = ["TreeForward", "PackForward", "PartForward", "with_params"]


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
    """

    depths = None

    def __init__(self, carried: Carried, index: int, error: type[Exception] = ValueError):
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
                           chunk=chunk)

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


def with_params(kernel, params: dict | None):
    """``kernel`` whose batch also holds ``params`` (per-head tensors, not per row)."""
    if not params:
        return kernel
    return lambda batch, state: kernel({**batch, **params}, state)
