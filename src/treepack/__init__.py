"""treepack: exact prefix-tree packing for LLM training on prefix-sharing data.

Merge sequences that share prefixes into one forest, run the model once over it, and get
every original next-token log-prob back in the original ``[N, L]`` layout::

    pack = treepack.TreePack.from_sequences(token_ids)
    logps = pack.token_logprobs(logits[0])   # logits from the model run on the pack

Adapters for other libraries (``treepack.hf``) are imported lazily, never by
``import treepack``.
"""

from treepack.forest import ForestStats
from treepack.tree import HostLayout, Predictions, Segments, TreePack, forest_stats

__all__ = ["TreePack", "Segments", "Predictions", "HostLayout", "ForestStats", "forest_stats"]
__version__ = "0.1.0"
