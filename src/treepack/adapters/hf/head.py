"""The LM head as the lean log-probs read it: weight, bias, and what the model does to the
logits after it."""

from __future__ import annotations

import weakref

import torch

from treepack.adapters.hf.prepare import eval_no_grad, unwrap
from treepack.adapters.hf.routing import UnsupportedModel, text_config
from treepack.core.softmax import head_logits

__all__ = ["lm_head", "lm_head_kwargs"]


_LM_HEAD_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lm_head(model, *, check: bool = True) -> dict:
    """The LM head of ``model`` as keyword arguments of :func:`treepack.logprobs_from_hidden`.

    ``weight`` and ``bias`` of the output projection, plus what the model does to the logits
    after it: ``softcap`` (Gemma 2's ``final_logit_softcapping``) and ``scale`` (Cohere's
    ``logit_scale``, Granite's ``1 / logits_scaling``, Falcon-H1's ``lm_head_multiplier``)::

        hidden = hf.forward_hidden(model, pack).last_hidden_state[0]
        logps = treepack.logprobs_from_hidden(pack, hidden, **hf.lm_head(model))

    A sharded (FSDP2) head weight is gathered.

    Args:
        model: a transformers causal LM (or wrapper).
        check: the first call per model runs one 3-token forward and compares these
            keywords' logits with the model's own.

    Returns:
        ``dict(weight=..., bias=..., [softcap=...], [scale=...])``.

    Raises:
        UnsupportedModel: an output layer that is not ``Linear``, or a logit transform
            treepack does not know (the check failed).
    """
    model = unwrap(model)
    kwargs = lm_head_kwargs(model)
    if check and model not in _LM_HEAD_CHECKED:
        _check_lm_head(model, kwargs)
        _LM_HEAD_CHECKED[model] = True
    return kwargs


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_lm_head(model, kwargs: dict) -> None:

    device = kwargs["weight"].device
    ids = torch.tensor([[1, 2, 3]], device=device) % text_config(model).vocab_size
    with eval_no_grad(model):
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[-1][0]
        if not torch.is_autocast_enabled(device.type):
            hidden = hidden.to(kwargs["weight"].dtype)
        z = head_logits(hidden, kwargs["weight"], kwargs.get("bias"),
                          kwargs.get("scale", 1.0), kwargs.get("softcap"), 1.0)
    logits = out.logits[0].to(z.dtype)
    tol = (1e-2 if kwargs["weight"].dtype in (torch.bfloat16, torch.float16) else 1e-4)
    if not torch.allclose(z, logits, rtol=tol, atol=tol * float(logits.abs().max())):
        raise UnsupportedModel(
            f"{type(model).__name__} transforms its logits after the LM head in a way "
            "treepack.hf.lm_head does not know (it knows final_logit_softcapping, logit_scale, "
            "logits_scaling and lm_head_multiplier): log-probs from hidden states would be wrong. Use "
            "pack.token_logprobs(hf.forward(model, pack).logits[0]) for this model"
        )


def lm_head_kwargs(model, gather: bool = True) -> dict:
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise UnsupportedModel(
            f"{type(model).__name__}'s output layer is a {type(head).__name__}, not a Linear "
            "layer; compute log-probs from out.logits with pack.token_logprobs instead"
        )
    config = text_config(model)
    full = _full if gather else (lambda t: t)
    kwargs = {"weight": full(head.weight), "bias": None if head.bias is None else full(head.bias)}
    if getattr(config, "final_logit_softcapping", None):
        kwargs["softcap"] = float(config.final_logit_softcapping)
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    if getattr(config, "lm_head_multiplier", None) is not None:  # Falcon-H1
        scale *= float(config.lm_head_multiplier)
    if scale != 1.0:
        kwargs["scale"] = scale
    return kwargs
