"""One training step of a model each way of :data:`STEPS`, side by side: times, peak memory,
exactness, and the FLOP-ratio limit beside the time ratios.

Per workload: a warm-up round runs every step once and checks its loss and gradients against
the padded step's; then ``repeats`` rounds run every step once more each, interleaved
(:func:`~treepack.face.benchmark.timing.interleave`), with each call's peak memory. A step's
time is its median over the rounds; a ratio is the median of the per-round ratios, with the
range as its spread and an ``uncertain`` flag where that range crosses 1.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from treepack.core.forest import causal_pairs
from treepack.core.tree import TreePack
from treepack.face.benchmark.flops import step_flops
from treepack.face.benchmark.memory import peak_memory
from treepack.face.benchmark.steps import (STEPS, bench_model, packed_step, padding_free_packs,
                                           unpacked_step)
from treepack.face.benchmark.timing import Spread, interleave, ratio, synced
from treepack.face.benchmark.workloads import Workload, claw_r1_scenarios

# Tokens a padding-free forward holds (or the tree pack's rows, where more): twice verl's
# default dynamic-batch budget (ppo_max_token_len_per_gpu=16384), so the baseline runs as
# few, as large forwards as memory allows
PADDING_FREE_TOKENS = 32768


def _grads(model) -> dict:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _grad_error(grads: dict, reference: dict) -> float:
    """The largest gradient difference over the model's largest reference gradient. Not over
    each tensor's own: one whose gradient is zero in exact arithmetic (a key bias, which
    softmax's shift invariance cancels) holds only rounding in both runs, and its own scale
    would call that rounding a 300 % error (``treepack verify`` judges tensors one by one)."""
    scale = max(g.float().abs().max() for g in reference.values()).clamp_min(1e-30)
    return max(((grads[k].float() - g.float()).abs().max() / scale).item()
               for k, g in reference.items())


def _spread_fields(key: str, spread: Spread, *, flag: bool) -> dict:
    """``{key: median, key_spread: [low, high]}``, and ``key_uncertain`` for a ratio."""
    out = {key: spread.median, f"{key}_spread": [spread.low, spread.high]}
    if flag:
        out[f"{key}_uncertain"] = spread.uncertain
    return out


def compare_step(model: nn.Module, work: Workload, *, backend: str = "auto", repeats: int = 3,
                 micro_batch: int = 4, steps=("padded", "padding_free", "tree_logits", "tree"),
                 progress: Callable | None = None) -> dict:
    """One training step of ``model`` on ``work`` each way of :data:`STEPS`, side by side.

    Returns per step the median time over ``repeats`` interleaved rounds with its spread and
    every round's time, the peak memory, the loss and its gradient error against the padded
    step; the token ratio, the FLOP-ratio limit (tree / unpacked FLOPs), and the tree step's
    time over each baseline's as the median of per-round ratios with spread and flag.
    ``progress`` hears a line before the warm-up round and after every timed round."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time at least one round")
    if unknown := sorted(set(steps) - set(STEPS)):
        raise ValueError(f"steps={unknown}: choose from {list(STEPS)}")
    say = progress or (lambda msg: None)
    device = next(model.parameters()).device
    seqs = [torch.as_tensor(s) for s in work.sequences]
    tree = TreePack.from_sequences(seqs, pad_to_multiple_of=128, device=device)
    # packed to a token budget, as trainers pack: one pack of every sequence ran out of
    # memory where the tree fit (96k tokens of a 0.5B model on an H200)
    budget = max(PADDING_FREE_TOKENS, tree.num_rows, max(map(len, seqs)))
    padding_free = padding_free_packs(seqs, budget, device=device, pad_to_multiple_of=128)
    unpacked_pairs = int(causal_pairs(tree.host.lengths).sum())
    tree_pairs = tree.visible_pairs
    limit = (step_flops(model, tree.num_packed_rows, tree_pairs).total  # padding excluded:
             / step_flops(model, tree.num_original_tokens, unpacked_pairs).total)  # the ideal
    makers = {
        "padded": lambda: unpacked_step(model, seqs, micro_batch),
        "padding_free": lambda: packed_step(model, padding_free, backend, lean=True),
        "tree_logits": lambda: packed_step(model, tree, backend, lean=False),
        "tree": lambda: packed_step(model, tree, backend, lean=True),
    }
    names = ["padded", *(s for s in STEPS if s in steps and s != "padded")]
    timed = {name: synced(makers[name](), device) for name in names}

    say(f"{work.name}: warm-up round, every step checked against the padded one")
    runs, reference = {}, None
    for name in names:
        loss = float(timed[name]())
        grads = _grads(model)
        reference = reference or grads
        runs[name] = dict(loss=loss, grad_max_rel_error=_grad_error(grads, reference))
    del grads, reference

    def heard(r, seconds):
        say(f"{work.name}: round {r + 1} of {repeats}: "
            + ", ".join(f"{name} {s:.2f} s" for name, s in seconds.items()))

    peaks = {name: [] for name in names}
    times = interleave(timed, repeats, around=lambda name: peak_memory(device, peaks[name]),
                       after_round=heard)
    base = runs["padded"]
    for name, r in runs.items():
        r.update(_spread_fields("seconds", Spread.of(times[name]), flag=False),
                 round_seconds=times[name], peak_mb=min(peaks[name]) / 2**20,
                 loss_rel_error=abs(r["loss"] - base["loss"]) / abs(base["loss"]))
    out = dict(workload=work.name, description=work.description, sequences=len(seqs),
               original_tokens=tree.num_original_tokens, packed_rows=tree.num_packed_rows,
               token_ratio=tree.token_ratio, flop_ratio_limit=limit, steps=runs)
    if "tree" in runs:
        for baseline in ("padded", "padding_free"):
            if baseline in runs:
                out.update(_spread_fields(f"tree_vs_{baseline}", ratio(times, "tree", baseline),
                                          flag=True))
        out["over_limit"] = out["tree_vs_padded"] / limit
    return out


def run_bench(works: list[Workload], *, device: torch.device, model: str = "qwen2-40m",
              dtype: torch.dtype = torch.float32, backend: str = "auto", repeats: int = 3,
              micro_batch: int = 4, steps=tuple(STEPS), progress: Callable | None = None
              ) -> dict:
    """:func:`compare_step` on each workload with a random ``model`` preset; one result."""
    import transformers

    say = progress or (lambda msg: None)
    say("building the model")
    net = bench_model(model, device, dtype)
    results = [compare_step(net, w, backend=backend, repeats=repeats, micro_batch=micro_batch,
                            steps=steps, progress=progress) for w in works]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads"
    return dict(device=where, torch=torch.__version__, transformers=transformers.__version__,
                model=model, model_params=sum(p.numel() for p in net.parameters()),
                dtype=str(dtype).removeprefix("torch."), backend=backend,
                micro_batch=micro_batch, repeats=repeats, workloads=results,
                claw_r1=claw_r1_scenarios())
