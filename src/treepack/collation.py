"""Framework-neutral collation: rollouts in, per-rank micro-batches of packs out.

A rollout is a mapping with ``prompt`` and ``completion`` token ids, an optional ``group``
(e.g. the prompt's id in a GRPO group) and any other fields: per-token ones (one value per
completion token: old log-probs, reference log-probs, token-level advantages, a
``loss_mask``) or per-sequence ones (a scalar: an advantage, a reward)::

    rollouts = [{"prompt": p, "completion": c, "group": g, "advantage": a, "old_logps": lp}
                ...]
    step = treepack.collate(rollouts, max_tokens=16384, world_size=world)
    den = step.denominators(rank)                       # every pack of every rank
    for batch in step.batches(rank):
        logps = batch.pack.token_logprobs(hf.forward(model, batch.pack).logits[0])
        loss = losses.policy_loss(logps, batch.fields["old_logps"], batch.fields["advantage"],
                                  batch.mask, denominators=den).loss
        loss.backward()

Per-token fields come back in the pack's label-aligned ``[N, L]`` layout (the value of
completion token j of a rollout sits where that token is predicted, at position
``len(prompt) + j``), per-sequence fields as ``[N]``. ``batch.mask`` marks the completion
tokens (and'ed with a ``loss_mask`` field if there is one). ``batch.completion(x)`` maps any
``[N, L]`` tensor back to the completion layout ``[N, C]`` of verl- and TRL-style losses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from treepack.losses import Denominators, global_denominators
from treepack.planner import Plan, plan
from treepack.tree import TreePack

__all__ = ["collate", "Collated", "Batch", "rollouts_from_padded"]

_RESERVED = ("prompt", "completion", "group")


@dataclasses.dataclass
class Batch:
    """One micro-step: a pack and its rollouts' fields in the pack's layout."""

    pack: TreePack
    mask: Tensor  # [N, L] bool: the completion tokens to train on
    fields: dict[str, Tensor]  # per-token [N, L] (label-aligned), per-sequence [N]
    groups: list  # group of each of the pack's rollouts
    prompt_lengths: Tensor  # [N]
    completion_lengths: Tensor  # [N]

    def completion(self, values: Tensor) -> Tensor:
        """``[N, L]`` (label-aligned) -> ``[N, C]``: column j is completion token j (0 beyond
        each completion's length; C is the longest completion of the pack)."""
        width = int(self.completion_lengths.max()) if len(self.completion_lengths) else 0
        j = torch.arange(width, device=values.device)
        cols = (self.prompt_lengths[:, None] + j).clamp(max=values.shape[1] - 1)
        keep = j < self.completion_lengths[:, None]
        return torch.where(keep, values.gather(1, cols), values.new_zeros(()))


@dataclasses.dataclass
class Collated:
    """A planned step: ``batches(rank)`` for each rank (built on demand)."""

    plan: Plan
    _prompt_lengths: np.ndarray
    _completion_lengths: np.ndarray
    _per_token: dict[str, list[np.ndarray]]
    _per_sequence: dict[str, np.ndarray]
    _groups: list
    _device: torch.device | str | None

    def batches(self, rank: int = 0) -> list[Batch]:
        return [self._batch(pack) for pack in self.plan.packs(rank)]

    def denominators(self, rank: int = 0, *, group=None) -> Denominators:
        """The step's loss denominators over every pack of every rank (an all-reduce when
        torch.distributed is initialised: call it on every rank)."""
        return global_denominators([b.mask for b in self.batches(rank)], group=group)

    def _batch(self, pack: TreePack) -> Batch:
        ids = pack.seq_ids.cpu().numpy()
        n, width = pack.num_sequences, pack.max_length
        plen, clen = self._prompt_lengths[ids], self._completion_lengths[ids]
        pos = np.arange(width)
        in_completion = (pos >= plen[:, None]) & (pos < (plen + clen)[:, None])  # [N, L]
        dev = pack.device
        fields = {}
        for name, values in self._per_token.items():
            out = np.zeros((n, width), dtype=values[0].dtype if values else np.float32)
            if n:
                out[in_completion] = np.concatenate([values[i] for i in ids])
            fields[name] = torch.from_numpy(out).to(dev)
        for name, values in self._per_sequence.items():
            fields[name] = torch.from_numpy(values[ids]).to(dev)
        mask = torch.from_numpy(in_completion).to(dev) & pack.prediction_mask
        if "loss_mask" in fields:
            mask &= fields["loss_mask"].bool()
        return Batch(pack=pack, mask=mask, fields=fields, groups=[self._groups[i] for i in ids],
                     prompt_lengths=torch.from_numpy(plen).to(dev),
                     completion_lengths=torch.from_numpy(clen).to(dev))


def _ids(x, what: str) -> np.ndarray:
    arr = np.asarray(x.cpu() if isinstance(x, Tensor) else x)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got {arr.dtype} "
                         f"{arr.shape}")
    return arr.astype(np.int64, copy=False)


def collate(rollouts: Sequence[Mapping], *, max_tokens: int, world_size: int = 1,
            pad_to_multiple_of: int | None = None,
            device: torch.device | str | None = None) -> Collated:
    """Plan ``rollouts`` (see the module doc) into packs of at most ``max_tokens`` rows over
    ``world_size`` ranks; each rank then takes ``collated.batches(rank)``."""
    rollouts = list(rollouts)
    if not rollouts:
        raise ValueError("collate needs at least one rollout")
    sequences, plen, clen, groups = [], [], [], []
    per_token: dict[str, list[np.ndarray]] = {}
    per_sequence: dict[str, list] = {}
    names = None
    for i, r in enumerate(rollouts):
        if "prompt" not in r or "completion" not in r:
            raise ValueError(f"rollout {i} needs 'prompt' and 'completion' token ids; it has "
                             f"{sorted(r)}")
        prompt, completion = _ids(r["prompt"], f"rollout {i}'s prompt"), _ids(
            r["completion"], f"rollout {i}'s completion")
        if not prompt.size:
            raise ValueError(f"rollout {i} has an empty prompt: the first completion token "
                             "needs a context to be predicted from")
        keys = sorted(k for k in r if k not in _RESERVED)
        if names is None:
            names = keys
        elif keys != names:
            raise ValueError(f"rollout {i} has fields {keys}, rollout 0 has {names}: every "
                             "rollout needs the same fields")
        for k in keys:
            v = r[k]
            v = v.detach().cpu().numpy() if isinstance(v, Tensor) else np.asarray(v)
            if v.ndim == 0:
                per_sequence.setdefault(k, []).append(v)
            elif v.shape == (completion.size,):
                per_token.setdefault(k, []).append(v)
            else:
                raise ValueError(
                    f"rollout {i}'s field {k!r} has shape {v.shape}: give one value per "
                    f"completion token ({completion.size}) or a scalar"
                )
            if k in per_sequence and k in per_token:
                raise ValueError(f"field {k!r} is per-token in some rollouts and a scalar in "
                                 "others")
        sequences.append(np.concatenate((prompt, completion)))
        plen.append(prompt.size)
        clen.append(completion.size)
        groups.append(r.get("group"))
    p = plan(sequences, max_tokens=max_tokens, world_size=world_size,
             pad_to_multiple_of=pad_to_multiple_of, device=device)
    return Collated(p, np.array(plen, dtype=np.int64), np.array(clen, dtype=np.int64),
                    per_token, {k: np.stack(v) for k, v in per_sequence.items()}, groups,
                    device)


def rollouts_from_padded(prompts: Tensor, prompt_mask: Tensor, completions: Tensor,
                         completion_mask: Tensor, **fields: Tensor) -> list[dict]:
    """Rollouts from the padded tensors verl and TRL keep: left-padded prompts ``[B, P]``,
    right-padded completions ``[B, C]``, their masks, and fields ``[B, C]`` (per completion
    token) or ``[B]`` (per sequence)."""
    out = []
    for b in range(prompts.shape[0]):
        pm, cm = prompt_mask[b].bool(), completion_mask[b].bool()
        n = int(cm.sum())
        r = {"prompt": prompts[b][pm], "completion": completions[b][cm]}
        for k, v in fields.items():
            r[k] = v[b][:n] if v.dim() == 2 else v[b]
        out.append(r)
    return out
