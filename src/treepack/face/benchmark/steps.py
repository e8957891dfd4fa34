"""The compared training steps: padded, padding-free and tree-packed, on a random model.

Each maker returns a function that runs one step (zero the gradients, forward, mean NLL over
every original prediction, backward) and returns the loss, so every step computes the same
loss and the same gradients, and any two can be timed and checked against each other.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from treepack.core.tree import TreePack

STEPS = {  # what each compared step is, for tables and docs
    "padded": "right-padded micro-batches, SDPA, full logits (the usual unpacked step)",
    "padding_free": "every sequence its own chain (share_prefixes=False), packed in order "
                    "up to 32,768 tokens a forward (or the tree pack's rows, where more), lean "
                    "log-probs: padding-free packing through the same kernels",
    "tree_logits": "the prefix-tree pack, log-probs from full [T', V] logits",
    "tree": "the prefix-tree pack, lean log-probs from hidden states",
}


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    z = logits.float()
    return z.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(z, dim=-1)


def unpacked_step(model: nn.Module, sequences: list[torch.Tensor], micro_batch: int,
                  ) -> Callable[[], torch.Tensor]:
    """One step the usual way: right-padded micro-batches (similar lengths together), SDPA
    causal attention with the padding mask, mean NLL over every original prediction."""
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batches = []
    for i in range(0, len(order), micro_batch):
        chunk = [sequences[j] for j in order[i:i + micro_batch]]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(chunk):
            ids[r, : len(s)], mask[r, : len(s)] = torch.as_tensor(s), 1
        batches.append((ids.to(device), mask.to(device)))
    predictions = sum(len(s) - 1 for s in sequences)

    def step():
        model.zero_grad(set_to_none=True)
        total = 0.0
        for ids, mask in batches:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            logp = _logprobs_of(logits[:, :-1], ids[:, 1:]) * mask[:, 1:]
            loss = -logp.sum() / predictions
            loss.backward()
            total += loss.detach()
        return total

    return step


def padding_free_packs(sequences: list, max_tokens: int, *, device=None,
                       pad_to_multiple_of: int | None = None) -> list[TreePack]:
    """Padding-free packing as trainers do it: the sequences in order, each its own chain
    (``share_prefixes=False``), a new pack whenever the next would pass ``max_tokens`` (a
    longer sequence gets a pack of its own)."""
    packs, current, size = [], [], 0
    for s in sequences:
        if current and size + len(s) > max_tokens:
            packs.append(current)
            current, size = [], 0
        current.append(s)
        size += len(s)
    packs.append(current)
    return [TreePack.from_sequences(p, share_prefixes=False, device=device,
                                    pad_to_multiple_of=pad_to_multiple_of) for p in packs]


def packed_step(model: nn.Module, packs: TreePack | list[TreePack], backend: str, *,
                lean: bool = False) -> Callable[[], torch.Tensor]:
    """One step on the packs, one forward and backward each: log-probs back in [N, L], the
    same mean NLL over every pack's predictions.

    With ``lean`` the log-probs come from hidden states (``logprobs_from_hidden``), never
    materialising the [T', V] logits."""
    from treepack.adapters import hf
    from treepack.lean.logprobs import logprobs_from_hidden

    packs = [packs] if isinstance(packs, TreePack) else list(packs)
    predictions = sum(p.num_predictions for p in packs)

    def step():
        model.zero_grad(set_to_none=True)
        total = 0.0
        for pack in packs:
            if lean:
                hidden = hf.forward_hidden(model, pack, backend).last_hidden_state[0]
                logps = logprobs_from_hidden(pack, hidden, **hf.lm_head(model))
            else:
                logps = pack.token_logprobs(hf.forward(model, pack, backend).logits[0])
            loss = -(logps * pack.prediction_mask).sum() / predictions
            loss.backward()
            total += loss.detach()
        return total

    return step


def bench_model(preset: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """A random-weight model of the ``preset`` shape (see ``treepack.zoo.MODELS``), prepared
    for tree forwards (:func:`treepack.hf.prepare`; padded batches run as before)."""
    import transformers

    from treepack.adapters import hf
    from treepack.data import zoo

    if preset not in zoo.MODELS:
        raise ValueError(f"model={preset!r}: choose one of {sorted(zoo.MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            zoo.MODELS[preset](), attn_implementation="sdpa", dtype=dtype).to(device)
    return hf.prepare(model)
