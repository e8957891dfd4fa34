"""The FLOP model: what one training step costs in arithmetic, split by where it goes.

Linear layers cost ``2 x weights`` per row (LM head included, tied or not); attention costs
``4 x heads x head_dim`` per visible (query, key) pair and layer; backward is twice the
forward. The FLOP-ratio limit of the step benchmark is the tree step's FLOPs over the
unpacked step's: the time ratio a perfect implementation would reach.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn


class Flops(NamedTuple):
    """Forward + backward FLOPs of one step (3x the forward), split by where they go."""

    linear: float  # every matmul with a weight, LM head included: proportional to tokens
    attention: float  # QK^T and PV: proportional to visible (query, key) pairs

    @property
    def total(self) -> float:
        return self.linear + self.attention


def _linear_params_per_token(model: nn.Module) -> tuple[int, int, int]:
    """(weights applied to every token, attention width heads x head_dim, layers)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = sum(m.weight.numel() for m in model.modules()
                 if isinstance(m, nn.Linear) and id(m.weight) not in embeddings)
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in embeddings:  # tied LM head is still a matmul
        linear += head.weight.numel()
    return linear, config.num_attention_heads * head_dim, config.num_hidden_layers


def step_flops(model: nn.Module, tokens: int, pairs: int) -> Flops:
    """FLOPs of a forward + backward over ``tokens`` rows with ``pairs`` visible pairs/layer."""
    linear, width, layers = _linear_params_per_token(model)
    return Flops(linear=3 * 2 * linear * tokens, attention=3 * 4 * width * layers * pairs)
