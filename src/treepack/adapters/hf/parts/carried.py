"""The token mixers of one part of a tree in a transformers forward: each reads what the parts
above it carry (:mod:`treepack.adapters.carried`, shared with megatron-core's parts).
"""

from __future__ import annotations

import collections

import torch

from treepack.adapters.carried import Carried, attend_part, conv_paths, scan_plan
from treepack.adapters.hf.routing import TreeForward, UnsupportedModel, with_params
from treepack.recurrent import path_conv1d, scan_levels

__all__ = ["Carried", "PartForward", "reentrant_checkpoint"]


def reentrant_checkpoint() -> UnsupportedModel:
    """The refusal of a layer that runs without gradients during a training step."""
    return UnsupportedModel(
        "a layer ran its forward without gradients during a training step: reentrant "
        "activation checkpointing, whose backward would not see the gradients the parts below "
        "add to this part's keys and values. Use model.gradient_checkpointing_enable("
        "gradient_checkpointing_kwargs={'use_reentrant': False})")


class PartForward(TreeForward):
    """The per-forward object of one part: every token mixer over the part's context and
    own rows."""

    def __init__(self, carried: Carried, index: int):
        self.pack = carried.parts.pack
        self.carried, self.index = carried, index
        self.budget = carried.parts.max_rows
        self.calls = 0
        self.windowed = 0
        self.mixer_calls: collections.Counter = collections.Counter()
        self.layer = None  # the recurrent layer under way: its convolution's weight

    def attend(self, module, query, key, value, *, scale, softcap, window, dropout,
               sinks=None, chunk=None):
        return attend_part(self.carried, self.index, module, query, key, value, scale=scale,
                           softcap=softcap, window=window, dropout=dropout, sinks=sinks,
                           chunk=chunk)

    def dense_mask(self):
        raise UnsupportedModel("a layer that builds its own mask of the pack (DeepSeek sparse "
                               "attention's indexer) in parts: a part holds some of the rows. "
                               "Raise max_tokens so the tree runs in one forward")

    def set_blocks(self, blocks):
        raise UnsupportedModel(
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
            raise UnsupportedModel("a recurrent scan ran before its layer's convolution: "
                                   "treepack cannot tell which layer's state to carry")
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
