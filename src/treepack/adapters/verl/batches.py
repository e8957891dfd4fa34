"""What verl's language-model engines with tree packs share (:mod:`.fsdp_engine`,
:mod:`.megatron_engine`): reading verl's batches, the
reasons a batch keeps verl's stock path, the micro-batch budget, outputs back in the batch's
order, and the metrics of sharing.
"""

from __future__ import annotations

import numpy as np
import torch

from treepack.adapters.verl.compat import append_to_dict, get_device_id, tu
from treepack.adapters.verl.log import say_once
from treepack.planning import sharing

__all__ = ["verl_device", "host_sequences", "host_routes", "token_budget", "micro_batches",
           "collect", "output_refusal", "positions_refusal", "temperature_refusal",
           "text_positions", "IMAGE_INPUTS", "image_refusal", "image_inputs", "log_sharing",
           "turn_order", "note_pass"]


def verl_device() -> torch.device:
    """The device verl computes on (its parameters may be offloaded to the CPU)."""
    return torch.zeros(0).to(get_device_id()).device


def host_sequences(data) -> list[np.ndarray]:
    """The sequences' token ids on the host (one copy of the nested values, if on a
    device)."""
    ids = data["input_ids"]
    return np.split(ids.values().cpu().numpy(), ids.offsets()[1:-1].cpu().numpy())


def host_routes(data) -> list[np.ndarray]:
    """verl's rollout routes (R3: ``routed_experts``, nested ``[len or len - 1, layers,
    topk]`` per row) as :meth:`treepack.TreePack.from_sequences` takes them, one ``[len,
    layers, topk]`` array per row, aligned as verl's R3 replay aligns them: a row recorded
    without its last token gets a placeholder there (it predicts nothing of its row), and
    every token verl's replay mask leaves to the router (a row without response tokens: all
    of them; every row's last token) is -1, routed natively.

    Raises:
        ValueError: a row whose routes are neither as long as its tokens nor one shorter.
    """
    routes, ids = data["routed_experts"], data["input_ids"]
    lengths = ids.offsets().diff().cpu().numpy()
    answered = [bool(m.sum()) for m in data["response_mask"].unbind()]
    out = []
    for i, (r, n) in enumerate(zip(routes.unbind(), lengths)):
        r = r.cpu().numpy()
        if r.shape[0] not in (n - 1, n):
            raise ValueError(f"row {i} has {r.shape[0]} routes for {n} tokens: verl's R3 "
                             "records one per token, or one per token but the last")
        aligned = np.full((n, *r.shape[1:]), -1, dtype=np.int16)  # verl's replay mask:
        if answered[i]:  # never the last token, nothing of a row without a response
            aligned[:n - 1] = r[:n - 1]
        out.append(aligned)
    return out


def token_budget(data, ranks: int) -> int:
    """Packed rows per micro-batch, as verl budgets a micro-batch: ``max_token_len_per_gpu``
    times the ``ranks`` that split each one (Ulysses or context parallel), or without
    dynamic batch sizes ``micro_batch_size_per_gpu`` times the longest row."""
    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        return int(data["max_token_len_per_gpu"]) * int(ranks)
    longest = int(data["input_ids"].offsets().diff().max())
    return int(data["micro_batch_size_per_gpu"]) * longest


def micro_batches(planned) -> list[np.ndarray]:
    """The sequences of each of the rank's non-empty packs."""
    return [] if planned is None else [spec.seq_ids for spec in planned.specs[0]
                                        if len(spec.seq_ids)]


def collect(outputs: list[dict], micro: list[np.ndarray]) -> dict:
    """verl's ``postprocess_batch_func`` for tree micro-batches: model outputs back in the
    batch's row order, losses and metrics listed per micro-batch."""
    model_output: dict[str, list] = {}
    for out in outputs:
        for key, value in out.get("model_output", {}).items():
            model_output.setdefault(key, []).extend(value.unbind())
    order = np.argsort(np.concatenate(micro)) if micro else np.zeros(0, dtype=np.int64)
    for key, per_sequence in model_output.items():
        model_output[key] = torch.nested.as_nested_tensor([per_sequence[i] for i in order],
                                                          layout=torch.jagged)
    metrics: dict = {}
    for out in outputs:
        append_to_dict(metrics, out.get("metrics", {}))
    return {"model_output": model_output, "loss": [out["loss"] for out in outputs],
            "metrics": metrics}


def output_refusal(data, served=()) -> str | None:
    """Why verl asks this batch for outputs a tree forward does not produce (fused kernels,
    distillation, sum of squared probabilities; less the flags an engine ``served``), or
    None."""
    flags = {k: tu.get_non_tensor_data(data=data, key=k, default=False)
             for k in ("use_fused_kernels", "distillation_use_topk", "distillation_only",
                       "calculate_sum_pi_squared") if k not in served}
    if any(flags.values()):
        return f"{[k for k, v in flags.items() if v]} (outputs treepack does not produce)"
    return None


def positions_refusal(positions) -> str | None:
    """Why nested text position ids keep a batch on verl's stock path (ids other than
    ``0 .. length - 1`` in a row, which a tree's depths would not reproduce), or None."""
    pos, offsets = positions.values(), positions.offsets()
    start = torch.repeat_interleave(offsets[:-1], offsets.diff())
    if not torch.equal(pos, torch.arange(len(pos), device=pos.device) - start):
        return "position ids that are not 0 .. length - 1 in every row"
    return None


def temperature_refusal(data) -> str | None:
    """Why the batch's temperature keeps it on verl's stock path (not finite and > 0), or
    None."""
    t = torch.as_tensor(data["temperature"], dtype=torch.float32)
    if not bool((torch.isfinite(t) & (t > 0)).all()):
        return f"temperature {t.tolist()} (verl clamps it to 1e-8; treepack needs > 0)"
    return None


def text_positions(positions):
    """Row 0 (the text positions) of verl's nested ``[rows, 4, length]`` mrope ids, nested."""
    values, offsets = positions.values(), positions.offsets()
    return torch.nested.nested_tensor_from_jagged(values[0], offsets)


# what verl's multi_modal_inputs carry for an image model (images_seqlens: verl's own count)
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "images_seqlens")


def image_refusal(inputs: dict) -> str | None:
    """Why a batch with these multi-modal inputs (verl's, joined) keeps the stock path on a
    model that packs images (videos, audio: inputs other than :data:`IMAGE_INPUTS`), or
    None."""
    other = sorted(set(inputs) - set(IMAGE_INPUTS))
    if other:
        return f"multi-modal inputs {other} (treepack packs images: {list(IMAGE_INPUTS)})"
    return None


def image_inputs(data) -> dict | None:
    """The batch's images as its rows carry them (each row's ``multi_modal_inputs``, ``{}``
    for a row without): ``pixel_values`` and ``image_grid_thw`` of every row in order (None
    where no row has one) and ``num_images`` per row, the keyword arguments of
    ``treepack.hf.Images`` and ``treepack.megatron.Images``; None for a batch without images.
    """
    stack = data.get("multi_modal_inputs", None)
    per_row = [] if stack is None else [r or {} for r in stack.tolist()]
    if not any(r.get("pixel_values") is not None for r in per_row):
        return None

    def joined(key):
        values = [r[key] for r in per_row if r.get(key) is not None]
        return torch.cat(values) if values else None

    return dict(pixel_values=joined("pixel_values"), image_grid_thw=joined("image_grid_thw"),
                num_images=[_image_count(r) for r in per_row])


def _image_count(inputs: dict) -> int:
    """Images of one row's ``multi_modal_inputs``: its grids (Qwen-VL), else its pixel
    tensors (one ``[C, H, W]`` an image)."""
    if inputs.get("pixel_values") is None:
        return 0
    grids = inputs.get("image_grid_thw")
    return len(inputs["pixel_values"] if grids is None else grids)


def log_sharing(collected: dict, data, sequences, pack_of, group, keys=None,
                routes=None) -> None:
    """Where this update's sharing was lost (:func:`treepack.sharing.report`), summed over
    the data-parallel ranks: ``treepack/{ideal,achievable,achieved}_ratio`` (each rank's
    mini-batch as one forest; as computed), ``treepack/lost_rows/false_forks`` (rollouts
    of one ``uid`` whose prompts differ within the uid's shortest) and
    ``treepack/lost_rows/split_and_repeat`` (the rank's mini-batch cut into packs, one per
    micro-batch). Rows lost across ranks and mini-batches are the trainer's
    (``treepack/groups_split_*``). With images, rows are counted over (id, image) pairs
    (``keys``), as the packs are built; with routing replay (``routes``), over (id, route)
    pairs, and ``treepack/lost_rows/differing_routes`` counts the rows that rollouts routed
    differently fork.

    Rows that carry verl v1's ``session_id`` (every agent-loop row in TransferQueue does)
    are read as sessions ``{uid}_{session_id}`` (``sessions=`` of the report), and
    ``treepack/session_forks/sessions`` and ``treepack/session_forks/rows`` report the
    sessions in which a later turn does not extend the previous turn's ids (a re-rendered
    history) and the rows their forests would save had every turn extended the last;
    outside ``lost_rows``, summed over the ranks (each session's turns on this rank)."""
    fields = set(data.keys())
    uid = list(data["uid"]) if "uid" in fields else None
    prompts = data["prompts"] if "prompts" in fields else None
    plen = (prompts.offsets().diff().cpu().numpy()
            if prompts is not None and prompts.is_nested else None)
    sessions = (None if uid is None or "session_id" not in fields else
                [f"{u}_{s}" for u, s in zip(uid, data["session_id"])])
    if sessions is not None:  # each session's turns in order, on the rows it holds
        order = turn_order(sessions, plen)  # (a session is within one uid: uid stays)
        sequences, sessions = [sequences[i] for i in order], [sessions[i] for i in order]
        plen = None if plen is None else plen[order]
        pack_of = pack_of[order]
        keys = None if keys is None else [keys[i] for i in order]
        routes = None if routes is None else [routes[i] for i in order]
    # rows over (id, image) and (id, route) pairs, as the packs are built
    lost = sharing.report(sequences, groups=uid, prompt_lengths=plen, packs=pack_of,
                          keys=keys, sessions=sessions, routes=routes)
    forked = [sum(f.rows for f in lost.session_forks), len(lost.session_forks),
              int(sessions is not None)]
    counts = torch.tensor(lost.counts() + forked, dtype=torch.float64, device=verl_device())
    torch.distributed.all_reduce(counts, group=group)
    counts = counts.tolist()
    for name, value in sharing.metrics_from_counts(counts[:-3], lost.measured).items():
        collected["metrics"][name] = [value]
    rows, forks, measured = counts[-3:]
    if measured:  # every rank reads the same fields
        collected["metrics"]["treepack/session_forks/sessions"] = [forks]
        collected["metrics"]["treepack/session_forks/rows"] = [rows]


def turn_order(sessions: list, plen) -> np.ndarray:
    """A permutation of the rows that puts each session's turns in order on the positions
    its rows hold (so every other row, and the ``uid`` of every position, stays put): by
    prompt length, as a turn's prompt holds every earlier turn (verl's rows carry no turn
    index; ``actor.shuffle=true`` mixes them), ties in batch order."""
    si = np.unique(sessions, return_inverse=True)[1].reshape(-1)  # keys: strings
    length = np.zeros(len(sessions), dtype=np.int64) if plen is None else plen
    order = np.empty(len(sessions), dtype=np.int64)
    order[np.argsort(si, kind="stable")] = np.lexsort((length, si))
    return order


def note_pass(engine, collected: dict, forward_only: bool, ratio: float) -> None:
    """verl's trainer drops a log-prob pass's metrics: an engine keeps the pass's token ratio
    (its packed rows / tokens) and an update reports the last one as
    ``treepack/log_prob_token_ratio``."""
    if forward_only:
        engine._log_prob_token_ratio = ratio
    elif getattr(engine, "_log_prob_token_ratio", None) is not None:
        collected["metrics"]["treepack/log_prob_token_ratio"] = [engine._log_prob_token_ratio]


def in_parts(planned, cannot: str | None, group=None) -> bool:
    """Whether a step runs its trees in parts (every row once): some rank's plan repeats rows
    (a tree larger than the budget) and no rank refuses parts (``cannot``: this rank's
    reason); decided over ``group`` (None: every rank). A step that wants parts but cannot
    have them says why once."""
    wants = planned is not None and planned.packed_rows > planned.min_rows
    flags = torch.tensor([int(wants), int(cannot is not None)], device=verl_device())
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
    if flags[0].item() and flags[1].item():
        say_once("a tree is larger than the token budget and is split, its prefix repeated in "
                 "every pack: " + (cannot or "another rank cannot run trees in parts"))
    return bool(flags[0].item()) and not flags[1].item()
