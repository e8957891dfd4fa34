"""The LM head as the lean log-probs read it: weight, bias, and what the model does to the
logits after it."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from treepack.adapters.hf.prepare import eval_no_grad, unwrap
from treepack.adapters.hf.routing import UnsupportedModel, text_config
from treepack.core.softmax import head_logits

__all__ = ["HEADS", "check_head", "lm_head", "check_lm_head", "lm_head_kwargs",
           "logit_transforms", "head_refusal", "head_weights", "head_after"]


HEADS = ("auto", "inside", "hidden", "logits")  # hf.logprobs' head=


def check_head(head: str, head_dtype) -> None:
    """Refuse a ``head`` that is not one of :data:`HEADS`, and ``head_dtype`` with the
    model's own head."""
    if head not in HEADS:
        raise ValueError(f"head={head!r} must be one of {HEADS}")
    if head_dtype is not None and head == "logits":
        raise ValueError("head_dtype applies to the lean head (head='inside' or 'hidden'); "
                         "with head='logits' the model's own head runs in its own dtype")


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
    if check:
        check_lm_head(model)
    return lm_head_kwargs(model)


def check_lm_head(model) -> None:
    """Once per model: one 3-token forward whose logits :func:`lm_head`'s keywords must give
    (a logit transform treepack does not know fails it).

    Raises:
        UnsupportedModel: a head treepack cannot read, or a failed check.
    """
    model = unwrap(model)
    if model not in _LM_HEAD_CHECKED:
        _check_lm_head(model, lm_head_kwargs(model))
        _LM_HEAD_CHECKED[model] = True


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
            "logits_scaling and lm_head_multiplier): log-probs from hidden states would be "
            "wrong. Use "
            "pack.token_logprobs(hf.forward(model, pack).logits[0]) for this model"
        )


def head_refusal(head) -> str | None:
    """Why treepack cannot compute ``head``'s logits from its weights (as one matrix and
    bias), or None: a ``Linear``, or peft's LoRA ``Linear`` around one (its weight then
    ``W + scaling * B @ A`` per active adapter) without a variant (DoRA) or active dropout."""
    if isinstance(head, torch.nn.Linear):
        return None
    name = f"{type(head).__module__}.{type(head).__qualname__}"
    if not _is_lora(head):
        return (f"the output layer is a {name}, not a torch.nn.Linear (nor peft's LoRA Linear "
                "around one)")
    if head.disable_adapters and head.merged:
        return ("its LoRA adapter is merged into the output layer and disabled: unmerge it "
                "(model.unmerge_adapter()) first")
    for adapter in _active(head):
        if head.lora_variant.get(adapter) is not None:
            return (f"its LoRA adapter {adapter!r} on the output layer is a variant "
                    f"({type(head.lora_variant[adapter]).__name__}, e.g. DoRA), not plain LoRA")
        dropout = head.lora_dropout[adapter]
        if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and dropout.training:
            return (f"its LoRA adapter {adapter!r} on the output layer (lm_head) has "
                    f"lora_dropout={dropout.p:g} in training, which drops the head's input "
                    "for the adapter only; use head='logits' (the model's own head), or "
                    "lora_dropout=0 for the head")
    return None


def head_weights(head, full=lambda t: t) -> tuple[Tensor, Tensor | None]:
    """``(weight [V, H], bias [V] or None)`` with which ``head`` computes its logits
    (:func:`head_refusal` says which heads), each tensor through ``full`` first (an FSDP2
    gather). Autograd flows back to the base weight and to every LoRA matrix.

    Raises:
        UnsupportedModel: a head :func:`head_refusal` refuses.
    """
    refusal = head_refusal(head)
    if refusal is not None:
        raise UnsupportedModel(refusal)
    if isinstance(head, torch.nn.Linear):
        return full(head.weight), None if head.bias is None else full(head.bias)
    base = head.base_layer
    weight, bias = full(base.weight), None if base.bias is None else full(base.bias)
    if head.disable_adapters or head.merged:
        return weight, bias
    for adapter in _active(head):
        a, b = head.lora_A[adapter], head.lora_B[adapter]
        scaling = head.scaling[adapter]
        delta = full(b.weight) @ full(a.weight)
        weight = weight + (delta * scaling).to(weight.dtype)
        if b.bias is not None:  # lora_bias
            extra = (full(b.bias) * scaling).to(weight.dtype)
            bias = extra if bias is None else bias + extra
    return weight, bias


def _is_lora(module) -> bool:
    """peft's LoRA ``Linear`` (duck-typed: peft is optional) around a ``torch.nn.Linear``."""
    return all(hasattr(module, k) for k in ("base_layer", "lora_A", "lora_B", "scaling",
                                            "lora_dropout", "active_adapters")) \
        and isinstance(module.base_layer, torch.nn.Linear)


def _active(head) -> list[str]:
    return [a for a in head.active_adapters if a in head.lora_A.keys()]


def lm_head_kwargs(model, gather: bool = True) -> dict:
    head = model.get_output_embeddings()
    refusal = head_refusal(head)
    if refusal is not None:
        raise UnsupportedModel(
            f"{type(model).__name__} cannot give log-probs from hidden states: {refusal}. "
            "Use head='logits' (hf.logprobs), or pack.token_logprobs(hf.forward(model, "
            "pack).logits[0])")
    weight, bias = head_weights(head, _full if gather else (lambda t: t))
    return {"weight": weight, "bias": bias, **logit_transforms(model)}


def logit_transforms(model) -> dict:
    """What ``model`` does to its logits after the output layer, as keywords of the lean
    head: ``softcap`` (Gemma 2's ``final_logit_softcapping``) and ``scale`` (Cohere's
    ``logit_scale``, Granite's ``1 / logits_scaling``, Falcon-H1's ``lm_head_multiplier``)."""
    config = text_config(model)
    kwargs = {}
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


def head_after(model) -> str:
    """Where the log-probs of a forward over some of a pack's rows (a part, a
    sequence-parallel slice) come from: ``"hidden"``, the LM head on the rows' hidden states,
    where treepack can read the head (:func:`lm_head`); else ``"logits"``, the model's own
    logits of the rows (a head it cannot read, a LoRA head with dropout)."""
    if head_refusal(unwrap(model).get_output_embeddings()) is not None:  # as it is now
        return "logits"
    try:
        check_lm_head(model)
    except UnsupportedModel:
        return "logits"
    return "hidden"
