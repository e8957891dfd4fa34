"""treepack: exact prefix-tree packing for LLM training on prefix-sharing data.

Merge sequences that share prefixes into one forest, run the model once over it, and get
every original next-token log-prob back in the original ``[N, L]`` layout::

    pack = treepack.TreePack.from_sequences(token_ids)
    out = treepack.hf.forward(model, pack)
    logps = pack.token_logprobs(out.logits[0])

Adapters for other libraries (``treepack.hf``, ``treepack.zoo``) are imported lazily, on
first use, never by ``import treepack``.
"""

import importlib

from treepack.collation import collate
from treepack.forest import ForestStats
from treepack.logprobs import TokenLogprobs, logprobs_from_hidden
from treepack.planner import PackSpec, Plan, plan
from treepack.tree import HostLayout, Predictions, Segments, TreePack, forest_stats
from treepack.verification import VerifyReport, verify

__all__ = ["TreePack", "Segments", "Predictions", "HostLayout", "ForestStats", "forest_stats",
           "logprobs_from_hidden", "TokenLogprobs", "plan", "Plan", "PackSpec", "collate",
           "verify", "VerifyReport"]
__version__ = "0.1.0"

_LAZY = {"hf", "zoo", "synthetic", "benchmark", "trl"}


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"treepack.{name}")
    raise AttributeError(f"module 'treepack' has no attribute {name!r}")
