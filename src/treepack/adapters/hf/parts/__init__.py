"""A tree larger than one forward, run in parts that each compute their rows once.

:func:`treepack.planning.parts.split` cuts the tree into parts of at most ``max_tokens``
rows. A part's forward (the one packed forward, :mod:`treepack.adapters.hf.packed`) runs its
own rows only; each layer reads what it needs of the part's ancestor rows (its context) from
the parts that computed them, kept per layer: an attention layer their keys and values, a
short convolution the inputs of the K - 1 rows above each path's cut, a recurrent scan its
state after the row a root chain continues from. In training what a part keeps goes to the
parts below it as detached leaves: each of those parts' backward adds its gradient into
them, and the part's own backward runs once, after all of them, with its loss and those
gradients. So the loss and every gradient are those of one forward over the whole tree (and
of every sequence alone), while each forward holds one part's activations.

The package's files are its concerns:

- :mod:`.calls`: the public calls (:func:`backward_in_parts` for a loss that is a sum over
  predictions, :func:`step_in_parts` for any loss of the whole batch, :func:`logprobs_in_parts`
  without gradients), and what they take (sequences, a pack, or built :class:`Parts`);
- :mod:`.run`: a part's forward through the one packed forward, and each part's
  predictions placed in the pack's layout (the pass itself, what a part carries below and
  each part's plans are framework-free: :mod:`treepack.forwards`);
- :mod:`.sync`: DDP, FSDP2 and FSDP1 around a step in parts.
"""

from treepack.adapters.hf.parts.calls import (PartsResult, backward_in_parts, check_model,
                                              logprobs_in_parts, step_in_parts, surrogate,
                                              tree_parts)
from treepack.planning.parts import Parts, split

__all__ = ["backward_in_parts", "step_in_parts", "logprobs_in_parts", "PartsResult",
           "check_model", "surrogate", "tree_parts", "Parts", "split"]
