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
tokens (and'ed with a ``loss_mask`` field if there is one: per completion token, or one
scalar for the whole completion, e.g. ``loss_mask=0`` for a rollout to skip). ``batch.completion(x)`` maps any
``[N, L]`` tensor back to the completion layout ``[N, C]`` of verl- and TRL-style losses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from treepack.core.denominators import Denominators, global_denominators
from treepack.core.outputs import take_columns
from treepack.core.tree import TreePack
from treepack.planning.planner import Plan, plan

__all__ = ["collate", "Collated", "Batch", "rollouts_from_padded", "unpadded"]

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
        return take_columns(values, self.prompt_lengths[:, None] + j,
                            j < self.completion_lengths[:, None])


@dataclasses.dataclass
class Collated:
    """A planned step: ``batches(rank)`` for each rank (built on demand)."""

    plan: Plan
    _prompt_lengths: np.ndarray
    _completion_lengths: np.ndarray
    _per_token: dict[str, list[np.ndarray]]
    _per_sequence: dict[str, np.ndarray]
    _dtypes: dict[str, np.dtype]  # per-token fields: one dtype over every rollout
    _groups: list
    _device: torch.device | str | None

    def batches(self, rank: int = 0) -> list[Batch]:
        return [self._batch(pack) for pack in self.plan.packs(rank)]

    def denominators(self, rank: int = 0, *, group=None) -> Denominators:
        """The step's loss denominators over every pack of every rank.

        With torch.distributed initialised, each rank counts its own packs and the counts
        are all-reduced (call it on every rank); without it, this process counts the packs of
        every rank of the plan (one process running every rank's packs, whose losses then add
        up to the batch's)."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        ranks = [rank] if distributed else range(self.plan.world_size)
        masks = []
        for r in ranks:
            for p in self.plan.packs(r):
                ids, _, _, positions = self._completion(p)
                masks.append(self._train_mask(ids, positions) & p.prediction_mask.cpu().numpy())
        # without torch.distributed nothing averages gradients: world_size stays 1
        return global_denominators([torch.from_numpy(m) for m in masks], group=group)

    def _completion(self, pack: TreePack):
        """The pack's rollout indices, their prompt and completion lengths, and the [N, L]
        positions of their completion tokens."""
        ids = pack.seq_ids.cpu().numpy()
        plen, clen = self._prompt_lengths[ids], self._completion_lengths[ids]
        pos = np.arange(pack.max_length)
        return ids, plen, clen, (pos >= plen[:, None]) & (pos < (plen + clen)[:, None])

    def _scatter(self, name: str, ids, positions) -> np.ndarray:
        """Per-token field ``name`` of rollouts ``ids`` placed at ``positions`` [N, L]."""
        out = np.zeros(positions.shape, dtype=self._dtypes[name])
        if len(ids):
            out[positions] = np.concatenate([self._per_token[name][i] for i in ids])
        return out

    def _train_mask(self, ids, positions) -> np.ndarray:
        """Completion positions, and'ed with the ``loss_mask`` field if there is one."""
        if "loss_mask" in self._per_token:
            return self._scatter("loss_mask", ids, positions) != 0
        return positions

    def _batch(self, pack: TreePack) -> Batch:
        ids, plen, clen, positions = self._completion(pack)
        dev = pack.device
        arrays = {name: self._scatter(name, ids, positions) for name in self._per_token}
        fields = {name: torch.from_numpy(a).to(dev) for name, a in arrays.items()}
        for name, values in self._per_sequence.items():
            fields[name] = torch.from_numpy(values[ids]).to(dev)
        train = arrays["loss_mask"] != 0 if "loss_mask" in arrays else positions
        mask = torch.from_numpy(train).to(dev) & pack.prediction_mask
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
            device: torch.device | str | None = None, parts: bool = False,
            keys=None, routes=None) -> Collated:
    """Plan ``rollouts`` (see the module doc) into packs over ranks.

    Args:
        rollouts: mappings with ``prompt`` and ``completion`` token ids, an optional
            ``group`` and numeric fields: per completion token, or one scalar per rollout
            (``loss_mask`` as a scalar covers the whole completion).
        max_tokens: the row budget: packed rows per pack.
        world_size: data-parallel ranks.
        pad_to_multiple_of: pad each pack's rows to a multiple of this.
        device: where each batch's tensors go.
        parts: never split a tree (a GRPO group, a trajectory) over batches: a tree larger
            than ``max_tokens`` stays whole in one batch, to run in parts of at most
            ``max_tokens`` rows (``hf.backward_in_parts(model, batch.pack, ...,
            max_tokens=max_tokens)``), each row once; without, :func:`treepack.plan` splits
            it and every batch repeats the prefix above its cut.
        keys: per-token content keys of each rollout's prompt + completion, as for
            :meth:`TreePack.from_sequences` (``treepack.hf.Images(model, sequences, ...).keys``
            for rollouts with images): planned and packed over (id, key) pairs. Each batch's
            images are then ``images.select(batch.pack.seq_ids)``.
        routes: per-token routed experts of each rollout's prompt + completion
            (``[len, moe_layers, topk]``, the last a placeholder), as for
            :meth:`TreePack.from_sequences`: planned and packed where routes agree too.

    Returns:
        :class:`Collated`: ``batches(rank)`` gives each rank its :class:`Batch` list and
        ``denominators(rank)`` the step's counts.

    Raises:
        ValueError: no rollouts, a missing prompt or completion, an empty prompt, fields
            that differ between rollouts or do not match the completion's length, a
            non-numeric field, or a planning error (a rollout over the budget).
    """
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
        fields = sorted(k for k in r if k not in _RESERVED)
        if names is None:
            names = fields
        elif fields != names:
            raise ValueError(f"rollout {i} has fields {fields}, rollout 0 has {names}: every "
                             "rollout needs the same fields")
        for k in fields:
            v = _field(r[k], i, k)
            if k == "loss_mask" and v.ndim == 0:  # one value for the whole completion
                v = np.full(completion.size, v)
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
    if parts:  # a budget every tree fits, so that plan keeps each one whole
        if pad_to_multiple_of:
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} with parts=True: parts "
                             "build their own forwards from the whole tree; leave it unset")
        max_tokens = max(max_tokens, _largest_tree(sequences, keys, routes))
    p = plan(sequences, max_tokens=max_tokens, world_size=world_size,
             pad_to_multiple_of=pad_to_multiple_of, device=device, keys=keys, routes=routes)
    dtypes = {k: np.result_type(*v) for k, v in per_token.items()}
    return Collated(p, np.array(plen, dtype=np.int64), np.array(clen, dtype=np.int64),
                    per_token, {k: np.stack(v) for k, v in per_sequence.items()}, dtypes,
                    groups, device)


def _largest_tree(sequences, keys=None, routes=None) -> int:
    """Rows of the largest tree of the forest ``sequences`` (keyed by ``keys`` and
    ``routes``) make."""
    forest = TreePack.from_sequences(sequences, keys=keys, routes=routes)
    h, n = forest.host, forest.num_packed_rows
    roots = np.flatnonzero(h.parent_row[:n] < 0)
    return int((h.subtree_end[roots] - roots).max())


def _field(value, i: int, name: str) -> np.ndarray:
    """A rollout field as a numeric numpy array (bfloat16 / float16 tensors become float32)."""
    if isinstance(value, Tensor):
        value = value.detach().cpu()
        if value.dtype in (torch.bfloat16, torch.float16):
            value = value.float()
        value = value.numpy()
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise ValueError(
            f"rollout {i}'s field {name!r} is {arr.dtype}, not numeric: fields become tensors "
            "in the pack's layout; keep labels such as ids in 'group' or outside the rollouts"
        )
    return arr


def rollouts_from_padded(prompts: Tensor, prompt_mask: Tensor, completions: Tensor,
                         completion_mask: Tensor, *, loss_mask: Tensor | None = None,
                         **fields: Tensor) -> list[dict]:
    """Rollouts from the padded tensors verl and TRL keep.

    ``completion_mask`` marks padding only (a prefix of each row): every completion token is
    context for the next. Tokens the loss should skip (tool outputs in a multi-turn response,
    verl's ``response_mask``) go in ``loss_mask``.

    Args:
        prompts: [B, P] left-padded prompt ids; ``prompt_mask`` [B, P] their real tokens.
        completions: [B, C] right-padded completion ids; ``completion_mask`` [B, C] their
            real tokens (a prefix of each row).
        loss_mask: [B, C] completion tokens the loss counts (optional).
        **fields: [B, C] per completion token or [B] per rollout (advantages, old
            log-probs, ...).

    Returns:
        One rollout dict per row, for :func:`collate`.

    Raises:
        ValueError: shapes that do not match (``prompts`` / ``prompt_mask`` [B, P],
            ``completions`` / ``completion_mask`` / ``loss_mask`` [B, C], each field [B, C] or
            [B]), or a mask row with holes (a ``completion_mask`` that is not a prefix of its
            row, a ``prompt_mask`` that is not a suffix).
    """
    B, P = prompts.shape
    C = completions.shape[1]
    if prompt_mask.shape != (B, P) or completion_mask.shape != (B, C) or len(completions) != B:
        raise ValueError(
            f"prompts {tuple(prompts.shape)} and prompt_mask {tuple(prompt_mask.shape)} must be "
            f"[B, P], completions {tuple(completions.shape)} and completion_mask "
            f"{tuple(completion_mask.shape)} [B, C], with one B")
    if loss_mask is not None:
        fields = {**fields, "loss_mask": loss_mask}
    for k, v in fields.items():
        if tuple(v.shape) not in ((B, C), (B,)):
            raise ValueError(
                f"field {k!r} has shape {tuple(v.shape)}: give [B, C] = [{B}, {C}] (one value "
                f"per completion token) or [B] = [{B}] (one per rollout); slice a [B, P + C] "
                "field to its completion columns first")
    _check_contiguous(prompt_mask.flip(1), "prompt_mask", "left-padded: real tokens last")
    _check_contiguous(completion_mask, "completion_mask", "right-padded: real tokens first")
    out = []
    for b in range(B):
        pm, cm = prompt_mask[b].bool(), completion_mask[b].bool()
        n = int(cm.sum())
        r = {"prompt": prompts[b][pm], "completion": completions[b][:n]}
        for k, v in fields.items():
            r[k] = v[b][:n] if v.dim() == 2 else v[b]
        out.append(r)
    return out


def _check_contiguous(mask: Tensor, name: str, rule: str) -> None:
    """Raise unless every row of ``mask`` is real tokens then padding (a prefix)."""
    m = mask.bool()
    holes = (m[:, 1:] & ~m[:, :-1]).any(-1)
    if holes.any():
        b = int(holes.nonzero()[0])
        raise ValueError(
            f"{name} row {b} has holes ({mask[b].int().tolist()}): it must mark padding only "
            f"({rule}), since masked tokens would vanish from the context of the tokens after "
            "them; pass tokens to skip in the loss as loss_mask")


def unpadded(ids, mask, ids_name: str = "ids", mask_name: str = "mask") -> list[np.ndarray]:
    """The real tokens of each row of a padded batch, on the host.

    Args:
        ids: ``[B, width]`` token ids (a tensor on any device, or an array).
        mask: ``[B, width]`` which of them are real (an attention or completion mask).
        ids_name, mask_name: their names, for the message.

    Returns:
        B int arrays (one copy of the batch to the host, one split).

    Raises:
        ValueError: shapes that are not both ``[B, width]``.
    """
    ids, mask = _host(ids), _host(mask).astype(bool)
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(f"{ids_name} {ids.shape} and {mask_name} {mask.shape} must both be "
                         "[B, width]")
    return np.split(ids[mask], np.cumsum(mask.sum(1))[:-1])


def _host(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)
