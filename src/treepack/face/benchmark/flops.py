"""The FLOP model: what one training step costs in arithmetic, split by where it goes.

Linear layers cost ``2 x weights`` per row (LM head included, tied or not); attention costs
``4 x heads x head_dim`` per visible (query, key) pair and attention layer; a hybrid's
recurrent layers (a gated-delta-rule or SSD scan) cost per row, not per pair: about
``4 x heads x key_dim x value_dim`` (read and update the state); backward is twice the
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


_ATTENDS = {"full_attention", "sliding_attention", "attention", "hybrid"}


def _scan_per_row(config) -> float:
    """FLOPs per row of every recurrent scan layer (0 for a model of attention only)."""
    types = getattr(config, "layer_types", None) or ()
    recurrent = sum(t in ("linear_attention", "mamba") for t in types) + sum(
        t == "hybrid" for t in types)  # Falcon-H1: attention and a scan in every layer
    if not recurrent:
        return 0.0
    heads = (getattr(config, "linear_num_value_heads", None)
             or getattr(config, "mamba_n_heads", None) or getattr(config, "mamba_num_heads", 0))
    key = (getattr(config, "linear_key_head_dim", None) or getattr(config, "mamba_d_state", None)
           or getattr(config, "ssm_state_size", 0))
    value = (getattr(config, "linear_value_head_dim", None)
             or getattr(config, "mamba_d_head", None) or getattr(config, "mamba_head_dim", 0))
    return 4.0 * heads * key * value * recurrent


def _linear_params_per_token(model: nn.Module) -> tuple[int, int, int]:
    """(weights applied to every token, attention width heads x head_dim, attention
    layers)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = sum(m.weight.numel() for m in model.modules()
                 if isinstance(m, nn.Linear) and id(m.weight) not in embeddings)
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in embeddings:  # tied LM head is still a matmul
        linear += head.weight.numel()
    types = getattr(config, "layer_types", None)
    layers = sum(t in _ATTENDS for t in types) if types else config.num_hidden_layers
    return linear, config.num_attention_heads * head_dim, layers


def step_flops(model: nn.Module, tokens: int, pairs: int) -> Flops:
    """FLOPs of a forward + backward over ``tokens`` rows with ``pairs`` visible pairs per
    attention layer (a hybrid's scans are counted with the rows)."""
    linear, width, layers = _linear_params_per_token(model)
    per_row = 2 * linear + _scan_per_row(model.config)
    return Flops(linear=3 * per_row * tokens, attention=3 * 4 * width * layers * pairs)
