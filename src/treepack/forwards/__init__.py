"""Forwards on a tree, framework-free: the token mixers every adapter's layers call
(:class:`TreeForward`: a whole pack, one part of a tree, a rank's slice of either), and a
tree larger than one forward run in parts that each compute their rows once (what a part
carries below, the order of a pass, each part's plans).

Imports core, attention, recurrent, lean and planning; the adapters (transformers,
megatron-core) build on it and give only what is theirs: how a model runs a forward.
"""

from treepack.forwards.carried import Carried, attend_part
from treepack.forwards.mixers import (PackForward, PartForward, ShardedForward, TreeForward,
                                      with_params)
from treepack.forwards.plans import part_predictions
from treepack.forwards.walk import PartsResult, Walk

__all__ = ["TreeForward", "PackForward", "PartForward", "ShardedForward", "with_params",
           "Carried", "attend_part", "Walk", "PartsResult", "part_predictions"]
