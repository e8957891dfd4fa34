"""Measuring a training step packed vs unpacked: FLOP model, timing, peak memory.

Used by ``bench/step.py`` and ``treepack bench``. Times are compared as ratios measured side
by side in one process (these machines are noisy); peak memory is the CUDA allocator's peak
on a GPU, and the rise of the process's resident-set high-water mark on a CPU.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, NamedTuple

import torch
from torch import nn

from treepack.tree import TreePack

__all__ = ["Flops", "step_flops", "Measurement", "measure", "unpacked_step", "packed_step"]


class Flops(NamedTuple):
    """Forward + backward FLOPs of one step (3x the forward), split by where they go."""

    linear: float  # every matmul with a weight, LM head included: proportional to tokens
    attention: float  # QK^T and PV: proportional to visible (query, key) pairs

    @property
    def total(self) -> float:
        return self.linear + self.attention


def _linear_params_per_token(model: nn.Module) -> tuple[int, int, int]:
    """(weights applied to every token, attention width heads x head_dim, layers)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = sum(m.weight.numel() for m in model.modules()
                 if isinstance(m, nn.Linear) and id(m.weight) not in embeddings)
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in embeddings:  # tied LM head is still a matmul
        linear += head.weight.numel()
    return linear, config.num_attention_heads * head_dim, config.num_hidden_layers


def step_flops(model: nn.Module, tokens: int, pairs: int) -> Flops:
    """FLOPs of a forward + backward over ``tokens`` rows with ``pairs`` visible pairs/layer."""
    linear, width, layers = _linear_params_per_token(model)
    return Flops(linear=3 * 2 * linear * tokens, attention=3 * 4 * width * layers * pairs)


class Measurement(NamedTuple):
    seconds: float  # best of the timed repeats
    peak_bytes: int  # peak extra memory of one step
    loss: float


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc), so the next step's peak shows in RSS."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def _peak_memory(device: torch.device, out: list):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield
        torch.cuda.synchronize(device)
        out.append(torch.cuda.max_memory_allocated(device) - base)
        return
    _release_freed_memory()
    base = _rss("VmRSS:")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the resident-set high-water mark
    except OSError:
        pass
    yield
    out.append(max(0, _rss("VmHWM:") - base))


def measure(step: Callable[[], torch.Tensor], device: torch.device, repeats: int = 2,
            warmup: int = 1) -> Measurement:
    """Time ``step`` (which runs forward + backward and returns the loss) and its peak memory."""
    loss = None
    for _ in range(warmup):
        loss = step()
    times, peaks = [], []
    for _ in range(repeats):
        with _peak_memory(device, peaks):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            loss = step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
    return Measurement(min(times), min(peaks), float(loss))


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


def packed_step(model: nn.Module, pack: TreePack, backend: str) -> Callable[[], torch.Tensor]:
    """One step on the pack: one forward, log-probs back in [N, L], the same mean NLL."""
    from treepack import hf

    def step():
        model.zero_grad(set_to_none=True)
        logits = hf.forward(model, pack, backend).logits[0]
        loss = -(pack.token_logprobs(logits) * pack.prediction_mask).sum() / pack.num_predictions
        loss.backward()
        return loss.detach()

    return step
