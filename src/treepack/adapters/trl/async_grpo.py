"""``TreepackAsyncGRPOTrainer``: TRL's asynchronous GRPO trainer whose training forward is one
treepack pack per process.

TRL's ``AsyncGRPOTrainer`` (``trl.AsyncGRPOTrainer`` from 1.18, ``trl.experimental.async_grpo``
in 1.16) takes rollouts from a worker's queue; on rank 0 a planner deals each micro-batch into
one row per process (``TreeRow``: a trie keyed on (token, next token)) and the collator packs
each row; every process runs its row through the model with TRL's ``tree_fa3`` attention (an
FA3 kernel) and takes one loss term per sample per trained token. Here:

1. **Collate.** TRL's collator, plus four keys, one padded row per process (dim 0, which the
   dispatcher slices): each row's samples laid end to end (``treepack_tokens``), their lengths
   (``treepack_lengths``), and each loss term's sample and position in it, in TRL's term order
   (``TreeRow.pack``: sample by sample, positions 1.. whose ``completion_mask`` is 1;
   ``treepack_term_sample``, ``treepack_term_position``). O(tokens) on rank 0.
2. **Forward.** Each process merges its samples into a :class:`~treepack.TreePack` and runs
   :func:`treepack.hf.logprobs` once (``entropy=True``, the trainer's temperature); term ``k``
   is ``logprobs[sample_k, position_k]`` (``align="label"``: the log-prob of that token given
   the sample before it, as the rollout's ``old_log_probs[position]``). The rebuilt term order
   is checked against TRL's ``segment_id`` every step.
3. **Loss.** TRL's own ``compute_loss``, called with a stand-in for the model that runs step 2
   and returns the per-term values, and ``token_index`` replaced by ``0 .. M-1``: TRL's gather
   ``outputs.log_probs.flatten()[token_index]`` then returns them in order, and the clipped
   objective, its normalisation, the router loss and every metric are TRL's code.

The model is loaded with transformers' default attention instead of ``tree_fa3`` (which needs
the FA3 CUDA kernel) and prepared (:func:`treepack.hf.prepare`): the tree runs through
treepack's backends, so the forks are exact (each sample sees exactly its own prefix), and
hybrids (Gated DeltaNet, Mamba2, short convolutions, Falcon-H1) and attention sinks
(GPT-OSS), which TRL refuses for its tree mode, run; TRL's refusal is bypassed only while
``__init__`` runs and only for a model treepack prepared. The MoE load-balancing loss counts
every original token (:func:`treepack.hf.logprobs` weights each packed row by the tokens it
stands for), as the unpacked run does; TRL's counts each unique trie token once.

Every TRL internal this touches is listed in :mod:`.compat` (:func:`~.compat.async_symbols`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import Tensor

from treepack.adapters import hf
from treepack.adapters.trl import compat
from treepack.attention import check_backend
from treepack.core.checks import positive_int
from treepack.core.compat import replaced
from treepack.core.tree import TreePack

__all__ = ["TreepackAsyncGRPOTrainer"]

AsyncGRPOTrainer, _trainer_module = compat.async_grpo()

# the collator's keys, [P, *] on rank 0 and [1, *] on each process
TOKENS = "treepack_tokens"  # the row's samples end to end (pad 0)
LENGTHS = "treepack_lengths"  # their lengths (pad 0)
TERM_SAMPLE = "treepack_term_sample"  # each loss term's sample in the row (pad -1)
TERM_POSITION = "treepack_term_position"  # its position in that sample (pad -1)
TOKEN_RATIO = "treepack/token_ratio"


class RankSamples(NamedTuple):
    """One process's micro-batch, rebuilt from the collator's keys."""

    sequences: list[Tensor]  # N 1-D token tensors (host), in TreeRow.samples order
    term_sample: Tensor  # [M] the sample of each loss term, in TRL's term order
    term_position: Tensor  # [M] the position of its token in that sample (>= 1)


class PerTerm(NamedTuple):
    """What one process's forward gives TRL's loss: read by TRL as the model's outputs
    (``log_probs``, ``entropy``, ``aux_loss``), one value per loss term."""

    log_probs: Tensor  # [M] log p(token | the sample before it) at the trainer's temperature
    entropy: Tensor  # [M] the entropy of the distribution that predicted it
    aux_loss: Tensor | None  # the router load-balancing loss (MoE), over the original tokens
    packed_rows: int  # T: rows the forward computed
    original_tokens: int  # the samples' tokens


def rank_keys(rows) -> dict[str, Tensor]:
    """The collator's extra keys for TRL's rank rows (``TreeRow`` objects), ``[P, *]``."""
    tokens, lengths, term_sample, term_position = [], [], [], []
    for row in rows:
        ids = [torch.as_tensor(s["input_ids"], dtype=torch.long) for s in row.samples]
        trained = [torch.nonzero(torch.as_tensor(s["completion_mask"])[1:]).flatten() + 1
                   for s in row.samples]  # TreeRow.pack's terms: p = 1 .. with mask[p]
        empty = torch.zeros(0, dtype=torch.long)
        tokens.append(torch.cat(ids) if ids else empty)
        lengths.append(torch.tensor([len(i) for i in ids], dtype=torch.long))
        term_sample.append(torch.cat([torch.full_like(p, i) for i, p in enumerate(trained)])
                           if trained else empty)
        term_position.append(torch.cat(trained) if trained else empty)

    def pad(per_rank, value):
        return torch.nn.utils.rnn.pad_sequence(per_rank, batch_first=True, padding_value=value)

    return {TOKENS: pad(tokens, 0), LENGTHS: pad(lengths, 0), TERM_SAMPLE: pad(term_sample, -1),
            TERM_POSITION: pad(term_position, -1)}


class _RolloutCollator(_trainer_module.DataCollatorForRollout):
    """TRL's rollout collator, plus each rank row's samples and loss terms (:func:`rank_keys`)."""

    def torch_call(self, examples):
        batch = super().torch_call(examples)
        (rows,) = examples  # one micro-batch: one TreeRow per process
        batch.update(rank_keys(rows))
        return batch


def rank_samples(inputs: dict) -> RankSamples:
    """This process's samples and loss terms, from the collator's keys of its ``[1, *]`` row."""
    lengths = inputs[LENGTHS][0]
    lengths = lengths[lengths > 0].tolist()  # host ints: the split sizes
    tokens = inputs[TOKENS][0, :sum(lengths)].cpu()  # one copy: the pack is built on the host
    term_sample = inputs[TERM_SAMPLE][0]
    kept = term_sample >= 0
    return RankSamples(list(torch.split(tokens, lengths)), term_sample[kept],
                       inputs[TERM_POSITION][0][kept])


class _Settings(NamedTuple):
    backend: str
    pad_to_multiple_of: int | None


class TreepackAsyncGRPOTrainer(AsyncGRPOTrainer):
    """TRL's asynchronous GRPO trainer whose training forward is one treepack pack per
    process (the module doc says how).

    Takes TRL's arguments (``model`` a path or hub id, as TRL), and:

    Args:
        treepack_backend: the tree attention backend (``"auto"``, ``"segment"``,
            ``"varlen"``, ``"flex"``, ``"dense"``).
        treepack_pad_to_multiple_of: pad each pack's rows to a multiple of this.

    The model is loaded with transformers' default attention instead of TRL's ``tree_fa3``
    and prepared (:func:`treepack.hf.prepare`); hybrids and attention sinks, which TRL refuses
    for its tree mode, train (treepack refuses, with :class:`treepack.hf.UnsupportedModel`,
    what it cannot run exactly). ``use_liger_kernel`` stays refused, as TRL refuses it. Each
    logging step reports ``treepack/token_ratio``: packed rows / original tokens of its
    training forwards, summed over micro-batches and processes. TRL's ``batch/*`` packing
    metrics and ``token_budget`` still describe TRL's trie (a treepack forest of the same
    samples has at most as many rows: TRL's trie costs one row more per fork).

    Raises:
        ValueError: an unknown ``treepack_backend`` or a ``treepack_pad_to_multiple_of`` that
            is not a positive int; TRL's own refusals.
        UnsupportedModel: a model treepack cannot run exactly.
        NotImplementedError: ``use_liger_kernel`` (TRL's refusal).
    """

    def __init__(self, *args, treepack_backend: str = "auto",
                 treepack_pad_to_multiple_of: int | None = None, **kwargs):
        check_backend(treepack_backend, "treepack_backend")
        if treepack_pad_to_multiple_of is not None:
            positive_int(treepack_pad_to_multiple_of, "treepack_pad_to_multiple_of",
                         hint=" (or None for no padding)")
        with _loaded_for_treepack():
            super().__init__(*args, **kwargs)
        self._treepack = _Settings(treepack_backend, treepack_pad_to_multiple_of)
        hf.prepare(self.model)  # done at load already; a PEFT wrapper: held again

    def get_train_dataloader(self):
        """TRL's dataloader, whose collator adds each rank row's samples and loss terms."""
        with replaced(_trainer_module, "DataCollatorForRollout", _RolloutCollator):
            return super().get_train_dataloader()  # looks the collator up as a module global

    def _treepack_per_term(self, model, rank: RankSamples) -> PerTerm:
        """One packed forward over this process's samples: each loss term's log-prob and
        entropy, in TRL's term order (a test's unpacked reference overrides this)."""
        pack = TreePack.from_sequences(rank.sequences, device=rank.term_position.device,
                                       pad_to_multiple_of=self._treepack.pad_to_multiple_of)
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        out = hf.logprobs(model, pack, entropy=True, temperature=self.temperature,
                          backend=self._treepack.backend, **router)
        return PerTerm(out.logprobs[rank.term_sample, rank.term_position],
                       out.entropy[rank.term_sample, rank.term_position], out.aux_loss,
                       pack.num_packed_rows, pack.num_original_tokens)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss on this process's loss terms, computed from one packed forward."""
        rank = rank_samples(inputs)
        selected = inputs["token_index"] >= 0
        _check_term_order(inputs["segment_id"][selected], rank.term_sample)
        forward = _Forward(lambda: self._treepack_per_term(model, rank))
        # TRL gathers outputs.log_probs.flatten()[token_index[selected]]: make it 0 .. M-1
        order = selected.flatten().cumsum(0).view_as(selected) - 1
        identity = {**inputs, "token_index": torch.where(selected, order, -1)}
        try:
            loss = super().compute_loss(forward, identity, return_outputs, num_items_in_batch)
        except AttributeError as e:
            if not isinstance(getattr(e, "obj", None), PerTerm):
                raise
            raise RuntimeError(
                f"TRL's {AsyncGRPOTrainer.__name__}.compute_loss read outputs.{e.name}, which "
                f"treepack's forward does not give (it gives {', '.join(PerTerm._fields[:3])}): "
                f"treepack's async adapter was written against TRL {compat.WRITTEN_AGAINST}; "
                "install that TRL, or a treepack written for this one") from e
        if forward.calls != 1:
            raise RuntimeError(
                f"TRL's {AsyncGRPOTrainer.__name__}.compute_loss called the model "
                f"{forward.calls} times, not once: treepack's async adapter was written "
                f"against TRL {compat.WRITTEN_AGAINST}; install that TRL, or a treepack "
                "written for this one")
        counts = torch.tensor([forward.result.packed_rows, forward.result.original_tokens],
                              dtype=torch.float64, device=selected.device)
        rows, tokens = self.accelerator.reduce(counts, reduction="sum").tolist()
        self._metrics["train"][TOKEN_RATIO].append((rows, tokens))  # logged as sum / sum
        return loss


class _Forward:
    """Stands in for the model in TRL's ``compute_loss``: called (once) with TRL's packed-row
    arguments, which it ignores, it runs treepack's forward, so TRL's forward timer times
    it, and returns the per-term values as the outputs TRL reads."""

    def __init__(self, run):
        self.run, self.calls, self.result = run, 0, None

    def __call__(self, **trl_inputs) -> PerTerm:
        self.calls += 1
        self.result = self.run()
        return self.result


def _check_term_order(trl_sample: Tensor, ours: Tensor) -> None:
    """TRL's loss terms (``segment_id``) are those :func:`rank_keys` rebuilt, in order."""
    if trl_sample.shape != ours.shape or not torch.equal(trl_sample, ours):
        raise RuntimeError(
            f"TRL's loss terms ({trl_sample.numel()}, by sample {trl_sample.tolist()[:12]}...) "
            f"are not laid out as treepack rebuilt them ({ours.numel()}, "
            f"{ours.tolist()[:12]}...; TreeRow.pack in TRL {compat.WRITTEN_AGAINST}: sample "
            "by sample, positions 1 .. whose completion_mask is 1): install TRL "
            f"{compat.WRITTEN_AGAINST}, or a treepack written for this one")


@contextlib.contextmanager
def _loaded_for_treepack():
    """While TRL's ``__init__`` runs: its model loads with transformers' default attention
    (not ``tree_fa3``, whose FA3 kernel treepack never calls) and is prepared, so a model
    treepack cannot run is refused there; what treepack routes (recurrent layers, attention
    sinks) is hidden from TRL's tree-packing check on that model, and shown again when TRL
    adds its fused head, the next thing it does after the check."""
    hidden = contextlib.ExitStack()
    create = _trainer_module.create_model_from_path
    fused = _trainer_module.add_fused_lm_head

    def create_model_from_path(model_id, *args, **kwargs):
        kwargs.pop("attn_implementation", None)  # TRL's tree_fa3
        model = create(model_id, *args, **kwargs)
        hf.prepare(model)  # raises UnsupportedModel for what treepack cannot run
        hidden.enter_context(_hidden_from_trls_check(model))
        return model

    def add_fused_lm_head(model, *args, **kwargs):
        hidden.close()
        return fused(model, *args, **kwargs)

    with hidden, replaced(_trainer_module, "create_model_from_path", create_model_from_path), \
            replaced(_trainer_module, "add_fused_lm_head", add_fused_lm_head):
        yield


ATTENTION_LAYERS = {"full_attention", "sliding_attention"}  # what TRL's tree mode routes


@contextlib.contextmanager
def _hidden_from_trls_check(model):
    """``model``'s non-attention ``layer_types`` and ``*.sinks`` parameters, hidden from TRL's
    check (which reads ``get_text_config().layer_types`` and ``named_parameters()``)."""
    with contextlib.ExitStack() as stack:
        text = model.config.get_text_config()
        if set(getattr(text, "layer_types", None) or ()) - ATTENTION_LAYERS:
            stack.enter_context(_without_layer_types(text))
        if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
            named = model.named_parameters

            def named_parameters(*args, **kwargs):
                return ((n, p) for n, p in named(*args, **kwargs) if not n.endswith(".sinks"))

            stack.enter_context(replaced(model, "named_parameters", named_parameters))
        yield


@contextlib.contextmanager
def _without_layer_types(config):
    """``config.layer_types`` reads None (a plain attribute or one mapped to a property, as
    Falcon-H1's and Bamba's): its class is swapped for a subclass that says so."""
    cls = type(config)
    config.__class__ = _NO_LAYER_TYPES.get(cls) or _NO_LAYER_TYPES.setdefault(cls, type(
        cls.__name__, (cls,), {
            "__module__": cls.__module__, "layer_types": property(lambda self: None),
            "attribute_map": {k: v for k, v in getattr(cls, "attribute_map", {}).items()
                              if k != "layer_types"}}))
    try:
        yield
    finally:
        config.__class__ = cls


_NO_LAYER_TYPES: dict[type, type] = {}
