"""Packed-vs-unpacked equivalence: one training step both ways, every number compared.

The reference runs the same model on **each sequence alone** (its original attention, no
packing); the packed run goes through :func:`treepack.hf.forward`. Both compute the mean
next-token negative log-likelihood over every original prediction, backpropagate, and take
one AdamW step from identical copies. Compared: every mapped log-prob, the loss, every
parameter gradient, and every parameter after the step.

In float64 / float32 the two runs are compared directly: log-probs, loss and gradients within
``TOLERANCE`` (relative to each tensor's largest magnitude). The parameters after the step
pass when every element's difference is explained by its gradient's difference: AdamW's first
step is ``lr * g / (|g| + eps)``, whose sensitivity ``lr * eps / (|g| + eps)^2`` amplifies a
rounding-level gradient difference ~1/(4 eps) times where ``|g|`` is near ``eps``; the check
allows twice that first-order change plus two roundings of the parameter.

In a low-precision dtype (bfloat16, float16) both runs are compared against an unpacked
float32 reference, and packing passes when its error is at most twice the unpacked
low-precision run's own error, quantity by quantity. There errors are relative L2 norms per
tensor (a max over elements would hinge on single sign flips of AdamW's first step), and an
error below ``eps(dtype) / 16`` counts as rounding: a wrong reduction or denominator is off
by far more. The parameters after the step are compared where the step's direction is set by
the gradient, not by rounding: an element whose float32 gradient is within
``LOW_PRECISION_FACTOR`` times the unpacked low-precision run's largest gradient error of that
tensor moves by ``±lr`` on the sign of its rounding (AdamW's first step is about
``lr * sign(g)``), and in a tensor that starts at zero (a zero-centred norm's weight) one such
flip among 64 elements is a relative L2 error of 0.25, whichever run it falls in.

A vision-language model is verified with its images (``images=``, a :class:`treepack.hf.Images`):
the packed run encodes each distinct image once and places it in the pack's rows; the reference
gives each sequence alone its own images through the model's forward (``pixel_values``, and
``image_grid_thw`` and ``mm_token_type_ids`` where the model takes them), so the model computes
its own image features and multimodal positions. Every gradient is compared, the vision
tower's included.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from treepack.adapters import hf
from treepack.adapters.hf import compat
from treepack.adapters.hf.vision import BIDIRECTIONAL_FAMILIES
from treepack.core.checks import validate_sequences
from treepack.core.tree import TreePack

__all__ = ["verify", "VerifyReport", "Error", "TOLERANCE", "LOW_PRECISION_FACTOR", "FLOOR_FACTOR",
           "verification_batch", "verification_image_batch", "IMAGE_LAYOUT"]

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}  # max relative error, direct comparison
LOW_PRECISION_FACTOR = 2.0  # packed error <= this x unpacked error, against a float32 reference
FLOOR_FACTOR = 4.0  # float64: errors up to this x the spread of two unpacked runs
# float64 runs of a model that casts float64 values to float32 inside (its norms, rotary,
# routers): a value differing at float64's rounding between the two runs (a shared row's
# gradient sums its sequences in another order) can round to the neighbouring float32 at
# such a cast, so the floor is at least this many float32 roundings on the way to a log-prob
# or a gradient
INSIDE_ROUNDINGS = 16
# a gradient tensor is judged relative to at least this share of the model's largest gradient
SIGNIFICANT_GRADIENT = 1e-3
QUANTITIES = ("logprobs", "loss", "grads", "params")
ADAM_EPS = 1e-8


class Error(NamedTuple):
    """Largest absolute difference, and that over the reference's largest magnitude."""

    max_abs: float
    max_rel: float
    where: str = ""  # the worst parameter, for grads and params
    # params, direct comparison: the largest difference over its AdamW-derived allowance
    allowance_ratio: float | None = None


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    model: str
    backend: str
    dtype: str
    sequences: int
    original_tokens: int
    packed_rows: int
    errors: dict[str, Error]  # packed vs reference, per quantity
    # low precision only: the unpacked low-precision run against the same float32 reference
    unpacked_errors: dict[str, Error] | None
    tolerance: float  # relative tolerance (direct), or the allowed error factor (low precision)
    noise_floor: float = 0.0  # low precision: relative errors below this are rounding
    reference_attention: str = ""  # the attention implementation of the unpacked runs
    # float64: two unpacked implementations against each other (see verify)
    floor_errors: dict[str, Error] | None = None
    images: int = 0  # image occurrences in the sequences (0: text only)
    distinct_images: int = 0  # what the packed run encodes
    # float64: "float32" where the model's forward casts float64 values to it ("" if none)
    rounds_in: str = ""

    @property
    def inside_floor(self) -> float:
        """The floor that rounding inside sets: ``INSIDE_ROUNDINGS`` of ``rounds_in``'s."""
        if not self.rounds_in:
            return 0.0
        return INSIDE_ROUNDINGS * torch.finfo(getattr(torch, self.rounds_in)).eps

    def floor(self, quantity: str) -> float:
        """Direct comparison: the floor of ``quantity``'s error, the larger of the unpacked
        runs' measured spread and the float32 roundings inside."""
        measured = self.floor_errors[quantity].max_rel if self.floor_errors else 0.0
        return max(measured, self.inside_floor)

    def allowed(self, quantity: str) -> float:
        """Direct comparison: the largest relative error ``quantity`` may have."""
        return max(self.tolerance, FLOOR_FACTOR * self.floor(quantity))

    @property
    def passed(self) -> bool:
        if self.unpacked_errors is None:
            direct = all(self.errors[q].max_rel <= self.allowed(q) for q in QUANTITIES[:3])
            return direct and self.errors["params"].allowance_ratio <= 1.0
        return all(self.ratio(q) <= self.tolerance for q in QUANTITIES)

    def ratio(self, quantity: str) -> float:
        """Low precision: packed error over unpacked error (relative, against float32)."""
        packed, unpacked = self.errors[quantity].max_rel, self.unpacked_errors[quantity].max_rel
        return packed / max(unpacked, self.noise_floor, 1e-300)

    def __str__(self) -> str:
        low = self.unpacked_errors is not None
        images = (f" and {self.images} images ({self.distinct_images} distinct)" if self.images
                  else "")
        head = (f"treepack verify: {self.model}, backend={self.backend}, dtype={self.dtype}: "
                f"{self.sequences} sequences, {self.original_tokens} tokens{images} -> "
                f"{self.packed_rows} packed rows")
        ref = (f"packed ({self.dtype}) and unpacked ({self.dtype}) runs, each against an "
               "unpacked float32 run" if low else
               f"the packed run against every sequence alone, both {self.dtype}")
        alone = "every sequence alone" + (" with its own images" if self.images else "")
        lines = [head, f"  reference: {alone}, attention={self.reference_attention}",
                 f"  errors of {ref}:"]
        if low:
            lines.append(f"  {'':<10}{'packed':>12}{'unpacked':>12}{'ratio':>8}  "
                         "(relative L2 error per tensor; worst tensor)")
        else:
            floor = "  floor" if self.floor_errors else ""
            lines.append(f"  {'':<10}{'max abs':>12}{'max rel':>12}{'allowed':>10}{floor}"
                         "  (max rel: over the reference's largest magnitude)")
        for q in QUANTITIES:
            e = self.errors[q]
            if low:
                u = self.unpacked_errors[q]
                lines.append(f"  {q:<10}{e.max_rel:>12.2e}{u.max_rel:>12.2e}"
                             f"{self.ratio(q):>8.2f}  {e.where}")
            elif q == "params":
                lines.append(f"  {q:<10}{e.max_abs:>12.2e}{e.max_rel:>12.2e}{'':>10}  "
                             f"{e.allowance_ratio:.2f} of the AdamW allowance; {e.where}")
            else:
                extra = f"  {self.floor(q):.1e}" if self.floor_errors else ""
                lines.append(f"  {q:<10}{e.max_abs:>12.2e}{e.max_rel:>12.2e}"
                             f"{self.allowed(q):>10.1e}{extra}  {e.where}")
        if low:
            rule = (f"packed error <= {self.tolerance:g} x unpacked error; errors below "
                    f"{self.noise_floor:.1e} count as rounding")
        elif self.floor_errors:
            inside = (f", at least {INSIDE_ROUNDINGS} {self.rounds_in} roundings "
                      f"({self.inside_floor:.1e}): the model rounds to {self.rounds_in} inside"
                      if self.inside_floor else "")
            rule = (f"max rel <= max({self.tolerance:g}, {FLOOR_FACTOR:g} x the floor: the "
                    f"unpacked runs' own spread{inside}); params within the AdamW allowance")
        else:
            rule = f"max rel <= {self.tolerance:g}; params within the AdamW allowance"
        lines.append(f"  {'PASS' if self.passed else 'FAIL'} ({rule})")
        return "\n".join(lines)


def verification_batch(vocab: int, *, seed: int = 0, eos: int | None = 2) -> list[Tensor]:
    """A small batch with every edge case the equivalence spec names.

    Two GRPO groups (forks after a shared prompt, unequal response lengths, some ending in
    ``eos``), a multi-turn agent trajectory (each step a prefix of the next), an exact
    duplicate, a sequence that is a prefix of another, a one-token sequence, and an unrelated
    tree. Sequences run past 6 tokens, so the zoo's sliding windows are crossed.
    """
    from treepack.data.synthetic import agent_batch, grpo_batch

    g = torch.Generator().manual_seed(seed)
    batch = [torch.as_tensor(s) for s in
             grpo_batch(groups=2, rollouts=3, prompt_len=14, response_len=8, jitter=0.5,
                        vocab=vocab, seed=seed)]
    if eos is not None:
        batch = [torch.cat((s, s.new_tensor([eos]))) if i % 2 else s for i, s in enumerate(batch)]
    batch += [torch.as_tensor(s) for s in
              agent_batch(prompts=1, trajectories=2, steps=3, prompt_len=10, response_len=5,
                          tool_len=4, jitter=0.4, vocab=vocab, seed=seed + 1)]
    batch += [batch[0].clone(), batch[1][:9].clone(), batch[2][:1].clone(),
              torch.randint(3, vocab, (11,), generator=g)]
    return batch


_A, _B, _C = ("image", 0), ("image", 1), ("image", 2)
IMAGE_LAYOUT = (  # zoo.image_batch items: ints are text tokens, ("image", k) distinct image k
    (1, 5, _A, 7, 8, 9, 2),               # a GRPO group sharing image A (one ending in eos) ...
    (1, 5, _A, 7, 8, 10, 11),
    (1, 5, _A, 7, 12),
    (1, 5, _B, 7, 8, 9, 2),               # ... the same text on image B: never merged with A's
    (1, 6, 6, _A, 3),                     # A after another context: its own rows, one encoding
    (1, 5, _A, 7, 20, _C, 21, 22),        # an agent history with a screenshot C mid-way ...
    (1, 5, _A, 7, 20, _C, 21, 23, _B, 4),  # ... and its next turn, with B further on
    (1, 5, 9, 9, 2),                      # text only
)


def verification_image_batch(family: str, *, seed: int = 0, dtype=None):
    """The images counterpart of :func:`verification_batch`, for a tiny vision-language model.

    The sequences of :data:`IMAGE_LAYOUT`: a GRPO group sharing an image, the same text on
    another image, that image after another context, an agent history with a screenshot
    mid-way (and its next turn), and a text-only sequence.

    Args:
        family: a key of ``treepack.zoo.VISION_FAMILIES`` (the pixels' layout).
        seed: the pixels' random seed.
        dtype: the pixels' dtype (default float32).

    Returns:
        A ``treepack.zoo.ImageBatch`` (``sequences``, ``pixel_values``, ``image_grid_thw``)
        for :class:`treepack.hf.Images`.
    """
    from treepack.data import zoo

    return zoo.image_batch(IMAGE_LAYOUT, seed=seed, dtype=dtype, family=family)


def _error(got: Tensor, ref: Tensor, where: str = "", l2: bool = False,
           at_least: float = 0.0) -> Error:
    """Max abs difference, and the difference relative to the reference: in max norm (each
    over the tensor's largest magnitude, or ``at_least``), or with ``l2`` in L2 norm."""
    if ref.numel() == 0:  # nothing compared (no element of a tensor settled): no error
        return Error(0.0, 0.0, where)
    diff = got.double() - ref.double()
    max_abs = diff.abs().max().item()
    num, den = (diff.norm(), ref.double().norm()) if l2 else (max_abs, ref.double().abs().max())
    num, den = float(num), max(float(den), at_least)
    rel = num / den if den > 0 else (0.0 if num == 0 else float("inf"))
    return Error(max_abs, rel, where)


def _worst(errors: list[Error]) -> Error:
    worst = max(errors, key=lambda e: e.max_rel)
    return Error(max(e.max_abs for e in errors), worst.max_rel, worst.where)


def _check_deterministic(model: nn.Module) -> None:
    if not model.training:
        return
    active = [f"{name or type(model).__name__} (p={m.p})" for name, m in model.named_modules()
              if isinstance(m, nn.Dropout) and m.p > 0]
    config = getattr(model, "config", None)
    # a vision-language model nests its language model's and vision tower's configs
    configs = {"config": config}
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            configs[f"config.{sub}"] = getattr(config, sub)
    for where, c in configs.items():
        for key in ("attention_dropout", "attn_pdrop"):
            if getattr(c, key, 0) and getattr(c, key) > 0:
                active.append(f"{where}.{key}={getattr(c, key)}")
    if active:
        raise ValueError(
            f"dropout is on in training mode ({', '.join(active[:4])}): verification needs "
            "deterministic forwards, so both runs see the same network. Call model.eval() "
            "(dropout off; gradients still flow) or set the dropout probabilities to 0"
        )


class _Step(NamedTuple):
    logprobs: Tensor  # [M] every prediction, in pack.predictions order
    loss: Tensor
    grads: dict[str, Tensor]
    before: dict[str, Tensor]
    params: dict[str, Tensor]  # after one AdamW step


def _train_step(model, lr: float, loss_fn) -> _Step:
    params = dict(model.named_parameters())
    before = {k: p.detach().clone() for k, p in params.items()}
    model.zero_grad(set_to_none=True)
    logprobs, loss = loss_fn(model)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
    _adamw_step(list(params.values()), lr)
    after = {k: p.detach() for k, p in params.items()}
    return _Step(logprobs.detach(), loss.detach(), grads, before, after)


def _adamw_step(params: list[Tensor], lr: float) -> None:
    """One AdamW step. float16 parameters step on float32 master copies, as mixed-precision
    training does: in float16 AdamW's eps (1e-8) rounds to 0 and its first step divides 0 by
    0 wherever a gradient is 0, so both runs would end in NaN and every verdict FAIL."""
    if all(p.dtype != torch.float16 for p in params):
        torch.optim.AdamW(params, lr=lr, eps=ADAM_EPS).step()
        return
    masters = [p.detach().float().requires_grad_() for p in params]
    for master, p in zip(masters, params):
        master.grad = None if p.grad is None else p.grad.float()
    torch.optim.AdamW(masters, lr=lr, eps=ADAM_EPS).step()
    with torch.no_grad():
        for master, p in zip(masters, params):
            p.copy_(master)


def _own_images(model, images, s: int, ids: Tensor) -> dict:
    """Sequence ``s``'s own images as the model's forward takes them, alone: its pixels in
    placeholder order, with their grids and image-token types where the model takes them."""
    videos = getattr(images, "videos_of", None)
    if images is None or not (len(images.images_of[s]) or (videos and len(videos[s]))):
        return {}

    def rows_of(items):
        distinct = images.occurrence[items]
        pixels = torch.cat([images.pixel_values[images.patch_start[u]:images.patch_start[u + 1]]
                            for u in distinct])
        grid = None if images.grid is None else images.grid[torch.as_tensor(distinct)]
        return pixels.to(ids.device), grid

    out = {}
    if len(images.images_of[s]):
        out["pixel_values"], grid = rows_of(images.images_of[s])
        if grid is not None:
            out["image_grid_thw"] = grid.to(ids.device)
    kinds = (ids == images.image_token_id).long()[None]
    if videos and len(videos[s]):
        out["pixel_values_videos"], grid = rows_of(videos[s])
        out["video_grid_thw"] = grid.to(ids.device)
        if images.second_per_grid_ts is not None:
            out["second_per_grid_ts"] = images.second_per_grid_ts[
                torch.as_tensor(videos[s]) - images.image_count].to(ids.device)
        kinds = kinds + 2 * (ids == images.video_token_id).long()[None]
    takes = inspect.signature(hf.unwrap(model).forward).parameters
    if "mm_token_type_ids" in takes:
        out["mm_token_type_ids"] = kinds
    if images.family in BIDIRECTIONAL_FAMILIES and "token_type_ids" in takes:
        out["token_type_ids"] = (ids == images.image_token_id).long()[None]  # its blocks
    return out


def _unpacked_loss(sequences: list[Tensor], images=None):
    """Every sequence alone through the model, with its own images: log-probs [M] in
    (sequence, position) order."""
    predictions = sum(len(s) - 1 for s in sequences)

    def run(model):
        parts = []
        for s, seq in enumerate(sequences):
            logits = model(input_ids=seq[None], use_cache=False,
                           **_own_images(model, images, s, seq)).logits[0]  # [len, V]
            logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
            parts.append(logp[:-1].gather(-1, seq[1:, None])[:, 0])
        # pack.predictions are ordered by (sequence, position): so is this concatenation.
        logprobs = torch.cat(parts)
        return logprobs, -logprobs.sum() / max(predictions, 1)

    return run


def _batched_loss(sequences: list[Tensor]):
    """Every sequence in one right-padded batch, without a mask: under causal attention a
    position never sees the padding after it, so these are each sequence's own log-probs,
    through other matmul shapes than one sequence at a time. A model that rounds to float32
    inside (norms, rotary, routers) shows there the spread that packing's shapes give it too."""
    predictions = sum(len(s) - 1 for s in sequences)
    width = max(len(s) for s in sequences)

    def run(model):
        ids = sequences[0].new_zeros((len(sequences), width))
        for s, seq in enumerate(sequences):
            ids[s, :len(seq)] = seq
        logits = model(input_ids=ids, use_cache=False).logits
        logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
        logprobs = torch.cat([logp[s, :len(seq) - 1].gather(-1, seq[1:, None])[:, 0]
                              for s, seq in enumerate(sequences)])
        return logprobs, -logprobs.sum() / max(predictions, 1)

    return run


def _alone_through_dense(sequences: list[Tensor], images=None):
    """Every sequence alone, as a one-sequence pack through treepack's dense attention: plain
    causal attention with the softmax in the model's dtype (no sharing, nothing packed)."""
    predictions = sum(len(s) - 1 for s in sequences)

    def run(model):
        parts = []
        for s, seq in enumerate(sequences):
            own = None if images is None else images.select([s])
            pack = _pack([seq], own, device=seq.device)
            logps = pack.token_logprobs(hf.forward(model, pack, "dense", images=own).logits[0])
            parts.append(logps[0, 1:])
        logprobs = torch.cat(parts)
        return logprobs, -logprobs.sum() / max(predictions, 1)

    return run


def _pack(sequences, images, **kwargs) -> TreePack:
    """The pack of ``sequences``, keyed by their images' contents where they have images."""
    return TreePack.from_sequences(sequences, keys=None if images is None else images.keys,
                                   **kwargs)


def _packed_loss(pack: TreePack, backend: str, images=None):
    def run(model):
        logits = hf.forward(model, pack, backend=backend, images=images).logits[0]
        flat = pack.token_logprobs(logits).reshape(-1)[pack.predictions.index]  # [M]
        return flat, -flat.sum() / pack.num_predictions

    return run


def _missing(got: dict, ref: dict) -> Error | None:
    """A parameter with a gradient in one run only is a failure, not a number."""
    odd = sorted(set(got) ^ set(ref))
    return Error(float("inf"), float("inf"), f"no gradient in one run: {odd[0]}", float("inf")) if odd else None


def _where(got: Tensor, ref: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    return (got, ref) if keep is None else (got[keep], ref[keep])


def _settled(unpacked: _Step, reference: _Step) -> dict[str, Tensor]:
    """Per parameter with a gradient, the elements whose AdamW step the gradient decides:
    its float32 gradient is larger than ``LOW_PRECISION_FACTOR`` times the low-precision
    unpacked run's largest error on that tensor (module doc)."""
    out = {}
    for k, g in reference.grads.items():
        if k in unpacked.grads:
            noise = (unpacked.grads[k].double() - g.double()).abs().max()
            out[k] = g.double().abs() > LOW_PRECISION_FACTOR * noise
    return out


def _adam_allowance(before: Tensor, grad: Tensor, grad_diff: Tensor, lr: float) -> Tensor:
    """Per element: twice AdamW's first-step sensitivity times the gradient difference, plus
    rounding: the step (decay, sqrt, + eps, divide, x lr, subtract) rounds about six times,
    each by at most half an ulp of operands up to |p| + lr, in each of the two runs."""
    g = grad.double().abs()
    sensitivity = lr * ADAM_EPS / (g + ADAM_EPS) ** 2
    rounding = 6 * torch.finfo(before.dtype).eps * (before.double().abs() + lr)
    return 2 * sensitivity * grad_diff + rounding


def _compare(got: _Step, ref: _Step, lr: float | None = None, l2: bool = False,
             settled: dict[str, Tensor] | None = None) -> dict[str, Error]:
    """Errors of ``got`` against ``ref``; with ``lr``, params also get their AdamW allowance;
    with ``settled`` (per parameter, the elements whose step the gradient decides), params
    are compared there only."""
    # each gradient tensor is judged relative to its largest magnitude or a thousandth of the
    # model's largest gradient, whichever is larger: a tensor whose gradient is rounding next
    # to the model's (a key bias without rotary, zero by algebra under the softmax: LLaVA's
    # CLIP tower) would otherwise fail the step or, as the floor, widen every other tensor's
    # allowance (to 3.3 relative, measured on LLaVA)
    scale = max((float(g.double().abs().max()) for g in ref.grads.values()), default=0.0)
    grads = _missing(got.grads, ref.grads) or _worst(
        [_error(got.grads[k], g, k, l2, at_least=SIGNIFICANT_GRADIENT * scale)
         for k, g in ref.grads.items()])
    params = _worst([_error(*_where(got.params[k], p, (settled or {}).get(k)), k, l2)
                     for k, p in ref.params.items()])
    if lr is not None and grads.max_abs != float("inf"):
        ratios = []
        for k, p in ref.params.items():
            diff = (got.params[k].double() - p.double()).abs()
            before = ref.before[k]
            if k in ref.grads:
                grad_diff = (got.grads[k].double() - ref.grads[k].double()).abs()
                allowed = _adam_allowance(before, ref.grads[k], grad_diff, lr)
            else:
                allowed = 6 * torch.finfo(p.dtype).eps * (before.double().abs() + lr)
            ratios.append(((diff / allowed.clamp_min(1e-300)).max().item(), k))
        worst, name = max(ratios)
        params = params._replace(allowance_ratio=worst, where=name)
    elif lr is not None:  # a gradient missing in one run: no allowance can explain the step
        params = params._replace(allowance_ratio=float("inf"))
    return {
        "logprobs": _error(got.logprobs, ref.logprobs, l2=l2),
        "loss": _error(got.loss, ref.loss),
        "grads": grads,
        "params": params,
    }


def _reference_attention(model) -> str:
    """The attention implementation that computes the model's real function unpacked: its
    own, except that soft-capped attention (Gemma 2) needs the eager formula, which SDPA and
    the flash kernels leave out."""
    current = hf.original_attention(model)
    config = compat.text_config(hf.unwrap(model).config)
    if getattr(config, "attn_logit_softcapping", None) and current != "eager":
        return "eager"
    return current


def verify(model: nn.Module, sequences, *, backend: str = "auto", dtype=None,
           lr: float = 1e-3, pad_to_multiple_of: int | None = None,
           images: hf.Images | None = None) -> VerifyReport:
    """One training step packed and unpacked from identical copies of ``model``; compare.

    Args:
        model: a transformers causal LM, or a vision-language model with ``images`` (not
            modified: the runs use copies).
        sequences: token-id sequences sharing prefixes (as for ``TreePack.from_sequences``).
            The unpacked reference runs on these ids as given (validated), never on ids
            read back from the pack.
        backend: the attention backend of the packed run.
        dtype: the dtype both runs use (default: the model's). For bfloat16 / float16 an
            unpacked float32 copy is the reference and packing must stay within
            ``LOW_PRECISION_FACTOR`` x the unpacked error. In float64 the tolerance is at
            least ``FLOOR_FACTOR`` x the spread between two unpacked implementations (the
            model's attention and eager; or, for a model that needs eager, treepack's dense
            attention on one-sequence packs), and where the packed run exceeds that, the
            spread of one right-padded batch of the sequences (the same values through
            other matmul shapes, as packing gives): transformers computes norms, rotary
            tables and routers in float32 inside float64 models (Llama 4, MiniCPM3, Gemma),
            so float64 is float32-accurate there. A float64 model whose ordinary forward
            casts float64 values to float32 (watched op by op) has a floor of at least
            ``INSIDE_ROUNDINGS`` float32 roundings: a value that differs at float64's
            rounding between the runs can round to a neighbouring float32 at such a cast, a
            matter of which values sit near a float32 boundary, not of packing.
        lr: AdamW learning rate of the compared step (float16 parameters step on float32
            master copies).
        pad_to_multiple_of: pad the pack's rows to a multiple of this.
        images: the images of ``sequences`` (a :class:`treepack.hf.Images` built over these
            sequences). The pack is keyed by their contents and the packed run encodes each
            distinct image once; the reference runs each sequence alone with its own images
            through the model's forward (``pixel_values``, and ``image_grid_thw`` and
            ``mm_token_type_ids`` where the model takes them), so the model computes its own
            image features and multimodal positions. Gradients include the vision tower's.

    Returns:
        A :class:`VerifyReport` (``.passed``, ``str(report)`` for the table).

    Raises:
        ValueError: dropout on in training mode, bad sequences, sequences with nothing to
            predict (one token each), or ``images`` of other sequences.
        TypeError: ``images`` that is not a :class:`treepack.hf.Images`.
    """
    _check_deterministic(model)
    dtype = dtype or next(model.parameters()).dtype
    device = next(model.parameters()).device
    ids = validate_sequences(sequences)
    if images is not None:
        _check_images_match(images, ids)
    seqs = [torch.as_tensor(a, device=device) for a in ids]
    pack = _pack(seqs, images, pad_to_multiple_of=pad_to_multiple_of, device=device)
    if len(pack.predictions.index) == 0:
        raise ValueError(f"each of the {len(seqs)} sequences has one token: nothing to predict, "
                         "so nothing to compare; give verify sequences of 2 or more tokens")
    reference_attention = _reference_attention(model)

    def run(loss_fn, run_dtype, attention=None, tree=False):
        copy_ = copy.deepcopy(model).to(run_dtype)
        if attention is not None:
            hf.restore(copy_)
            compat.set_attn_implementation(hf.unwrap(copy_).config, attention)
        if tree:
            hf.prepare(copy_)
        return _train_step(copy_, lr, loss_fn)

    packed = run(_packed_loss(pack, backend, images), dtype, tree=True)
    alone = _unpacked_loss(seqs, images)
    low_precision = dtype in (torch.bfloat16, torch.float16)
    floor_errors = None
    if low_precision:
        reference = run(alone, torch.float32, reference_attention)
        unpacked = run(alone, dtype, reference_attention)
        settled = _settled(unpacked, reference)
        unpacked_errors = _compare(unpacked, reference, l2=True, settled=settled)
        tolerance = LOW_PRECISION_FACTOR
    else:
        reference = run(alone, dtype, reference_attention)
        unpacked_errors = None
        tolerance = TOLERANCE.get(dtype, 1e-5)
        coarser = reference.logprobs.dtype  # a head that casts its logits (Nemotron-H's,
        if coarser != dtype and coarser in TOLERANCE:  # Falcon-Mamba's .float()): that far
            tolerance = max(tolerance, TOLERANCE[coarser])
        if dtype in (torch.float64, torch.float32):  # the spread of two unpacked runs
            with compat.other_scan(hf.unwrap(model)):  # a hybrid's scan token by token too
                if reference_attention == "eager":
                    other = run(_alone_through_dense(seqs, images), dtype, tree=True)
                else:
                    other = run(alone, dtype, "eager")
            floor_errors = _compare(other, reference)
    inside = _rounds_in(model, dtype, device) if floor_errors is not None else dtype
    report = VerifyReport(
        model=type(hf.unwrap(model)).__name__,
        backend=backend,
        dtype=str(dtype).removeprefix("torch."),
        sequences=pack.num_sequences,
        original_tokens=pack.num_original_tokens,
        packed_rows=pack.num_packed_rows,
        errors=_compare(packed, reference, None if low_precision else lr, l2=low_precision,
                        settled=settled if low_precision else None),
        unpacked_errors=unpacked_errors,
        tolerance=tolerance,
        noise_floor=torch.finfo(dtype).eps / 16 if low_precision else 0.0,
        reference_attention=reference_attention,
        floor_errors=floor_errors,
        rounds_in="" if inside == dtype else str(inside).removeprefix("torch."),
        images=0 if images is None else sum(map(len, images.images_of)),
        distinct_images=0 if images is None else images.num_images,
    )
    if floor_errors is not None and images is None and not report.passed:
        # the floor's other unpacked run: one padded batch (other shapes, same values); only
        # asked for when the packed run fails the first floor, which it can only widen
        try:
            batched = _compare(run(_batched_loss(seqs), dtype, reference_attention),
                               reference)
        except Exception:  # noqa: BLE001 - a model that cannot batch keeps the first floor
            batched = None
        if batched is not None:
            floor_errors = {q: max(e, batched[q], key=lambda x: x.max_rel)
                            for q, e in floor_errors.items()}
            report = dataclasses.replace(report, floor_errors=floor_errors)
    return report


def _rounds_in(model: nn.Module, dtype: torch.dtype, device) -> torch.dtype:
    """float32 where a float64 copy of ``model`` casts float64 values down to float32 on an
    ordinary 4-token forward (every op watched: an op with a float64 input and a float32
    output; RMSNorm's variance, Llama 4's complex rotary), else ``dtype``: a float32 table
    built from integers is the same in both runs and rounds nothing that differs; a run in
    another dtype, or a forward that fails, derives no floor."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    if dtype != torch.float64:
        return dtype
    casts = []

    def floats(tree):
        return {t.dtype for t in tree_leaves(tree)
                if isinstance(t, torch.Tensor) and t.is_floating_point()}

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if torch.float32 in floats(out) and torch.float64 in floats((args, kwargs)):
                casts.append(func.overloadpacket.__name__)
            return out

    copy_ = copy.deepcopy(hf.unwrap(model)).to(dtype)
    hf.restore(copy_)
    ids = torch.tensor([[3, 4, 5, 6]], device=device)
    try:
        with torch.no_grad(), Watch():
            copy_(input_ids=ids, use_cache=False)
    except Exception:  # noqa: BLE001 - a model that needs more inputs: the measured floor only
        return dtype
    return torch.float32 if casts else dtype


def _check_images_match(images, ids: list) -> None:
    """``images`` must be those of these sequences, in this order."""
    if not isinstance(images, hf.Images):
        raise TypeError(f"images must be a treepack.hf.Images, got {type(images).__name__}: "
                        "build it with hf.Images(model, sequences, pixel_values=...)")
    if images.num_sequences != len(ids):
        raise ValueError(f"images holds {images.num_sequences} sequences but verify was given "
                         f"{len(ids)}: build them with hf.Images(model, sequences, ...) over "
                         "the same sequences")
    for s, (a, b) in enumerate(zip(images.sequences, ids)):
        if not np.array_equal(a, b):
            raise ValueError(f"sequence {s} is not the images' sequence {s}: build them with "
                             "hf.Images(model, sequences, ...) over the same sequences, in order")
