"""Mixture-of-experts router losses of the original tokens, from a pack's router logits."""

from __future__ import annotations

import torch
from torch import Tensor

from treepack.adapters.hf import compat
from treepack.adapters.hf.prepare import unwrap
from treepack.adapters.hf.routing import UnsupportedModel, text_config
from treepack.core import deprecation
from treepack.core.multiplicity import row_multiplicity  # noqa: F401 - hf.row_multiplicity

__all__ = ["row_multiplicity", "router_aux_loss", "batch_router_aux_loss",
           "weighted_router_aux_loss"]


def router_aux_loss(model, pack, router_logits) -> Tensor:
    """The MoE load-balancing loss of one pack's original tokens, from its router logits.

    Uses the model's own ``load_balancing_loss_func`` with every packed row weighted by the
    number of original tokens it stands for, which is what the unpacked batch computes.
    (A list of packs with a list of router logits is deprecated: use
    :func:`batch_router_aux_loss`.)

    Args:
        model: the MoE model (or wrapper).
        pack: the pack the router logits came from.
        router_logits: the model output's ``router_logits`` (one tensor per layer).

    Returns:
        A scalar loss tensor.

    Raises:
        UnsupportedModel: a model whose router loss treepack does not know how to weight.
    """
    if isinstance(pack, (list, tuple)):
        deprecation.warn("hf.router_aux_loss(model, packs, per_pack_router_logits)",
                         "hf.batch_router_aux_loss")
        return batch_router_aux_loss(model, pack, router_logits)
    return batch_router_aux_loss(model, [pack], [router_logits])


def batch_router_aux_loss(model, packs, router_logits) -> Tensor:
    """The load-balancing loss of a whole batch spread over several packs.

    Packs without tokens (``TreePack.empty``) contribute nothing; with no tokens at all the
    loss is a zero still connected to the router.

    Args:
        model: the MoE model (or wrapper).
        packs: the batch's packs.
        router_logits: for each pack, its per-layer router logits.

    Returns:
        The batch's loss (not a mean of per-pack losses), a scalar tensor.

    Raises:
        UnsupportedModel: as :func:`router_aux_loss`.
    """
    packs, per_pack = list(packs), list(router_logits)
    live = [(p, r) for p, r in zip(packs, per_pack) if p.num_original_tokens > 0]
    if not live:
        return sum(layer.sum() for r in per_pack for layer in r) * 0.0
    layers = tuple(torch.cat(per_layer) for per_layer in zip(*(r for _, r in live)))
    return weighted_router_aux_loss(model, layers, torch.cat([row_multiplicity(p)
                                                              for p, _ in live]))


def weighted_router_aux_loss(model, router_logits, weights: Tensor) -> Tensor:
    """The model's load-balancing loss over rows that each stand for ``weights`` tokens.

    Args:
        model: the MoE model (or wrapper).
        router_logits: per layer, ``[rows, experts]``, the same rows in every layer.
        weights: ``[rows]`` the original tokens each row stands for (0: none).

    Returns:
        A scalar loss tensor.

    Raises:
        UnsupportedModel: a model whose router loss treepack does not know how to weight.
    """
    weights = weights[None]  # [1, rows]: the attention mask the model's function reads
    model = unwrap(model)
    loss_fn = compat.model_function(model, "load_balancing_loss_func")
    if loss_fn is None:
        raise UnsupportedModel(
            f"{type(model).__name__} has an auxiliary router loss treepack does not know how to "
            "weight by original tokens; disable it (output_router_logits=False) or run unpacked"
        )
    config = text_config(model)
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    return loss_fn(tuple(router_logits), num_experts, config.num_experts_per_tok, weights)


def router_logits_on(model, kwargs: dict) -> bool:
    """Whether a forward of ``model`` with ``kwargs`` returns router logits (given, or on in
    its config)."""
    config = text_config(unwrap(model))
    return bool(kwargs.get("output_router_logits",
                           getattr(config, "output_router_logits", False)))
