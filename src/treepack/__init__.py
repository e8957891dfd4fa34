"""treepack: exact prefix-tree packing for LLM training on prefix-sharing data.

Merge sequences that share prefixes into one forest, run the model once over it, and get
every original next-token log-prob back in the original ``[N, L]`` layout::

    pack = treepack.TreePack.from_sequences(token_ids)
    out = treepack.hf.forward(model, pack)
    logps = pack.token_logprobs(out.logits[0])

Every name below is imported on first use, so ``import treepack`` (and ``treepack --help``)
loads neither torch nor any optional package until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from treepack.version import __version__

_EXPORTS = {  # public name -> the module that defines it
    "TreePack": "treepack.tree", "Segments": "treepack.tree", "Predictions": "treepack.tree",
    "HostLayout": "treepack.tree", "forest_stats": "treepack.tree",
    "ForestStats": "treepack.forest",
    "logprobs_from_hidden": "treepack.logprobs", "TokenLogprobs": "treepack.logprobs",
    "logprobs_and_entropy_from_hidden": "treepack.logprobs",
    "plan": "treepack.planner", "Plan": "treepack.planner", "PackSpec": "treepack.planner",
    "collate": "treepack.collation",
    "verify": "treepack.verification", "VerifyReport": "treepack.verification",
}
_MODULES = {"hf", "hf_compat", "zoo", "synthetic", "benchmark", "trl", "attention", "losses",
            "mask", "forest", "tree", "logprobs", "planner", "collation", "verification", "cli",
            "checks", "denominators", "version"}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time names resolve lazily
    from treepack.collation import collate
    from treepack.forest import ForestStats
    from treepack.logprobs import (TokenLogprobs, logprobs_and_entropy_from_hidden,
                                   logprobs_from_hidden)
    from treepack.planner import PackSpec, Plan, plan
    from treepack.tree import HostLayout, Predictions, Segments, TreePack, forest_stats
    from treepack.verification import VerifyReport, verify


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _MODULES:
        return importlib.import_module(f"treepack.{name}")
    raise AttributeError(f"module 'treepack' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS, *_MODULES])
