"""Timing on a shared machine: steps interleaved round by round, ratios as medians with spread.

A load that comes and goes slows whatever runs at that moment. Timing every repeat of one
step, then every repeat of the next, lets a burst land on one step only and turn into a false
ratio (issue 18: on a machine at load 3-5 the tree step once read 3.9x slower than the padded
one). :func:`interleave` runs every step once per round instead, the starting step rotating
from round to round; a ratio is taken within each round, where both steps saw about the same
load, and reported by :func:`ratio` as the median over the rounds with its spread (min-max).
A ratio whose spread crosses 1 is :attr:`Spread.uncertain`: the rounds disagree on which step
is faster.

:func:`best_of` and :func:`measure` time one function alone (the fastest of a few calls), for
benchmarks of one path where the paths are far apart.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, NamedTuple

import torch

from treepack.face.benchmark.memory import peak_memory


def best_of(fn: Callable, repeats: int = 3):
    """``(fastest wall time in seconds, last result)`` of ``repeats`` calls of ``fn``."""
    times = []
    out = None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


class Spread(NamedTuple):
    """The median of some per-round values and their range."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values) -> Spread:
        values = list(values)
        return cls(statistics.median(values), min(values), max(values))

    @property
    def uncertain(self) -> bool:
        """For a ratio: some rounds put it below 1 and others above (which step is faster is
        not settled)."""
        return self.low < 1 < self.high


def synced(step: Callable, device: torch.device) -> Callable:
    """``step`` followed by a CUDA synchronisation, so its wall time covers its kernels."""
    if device.type != "cuda":
        return step

    def run():
        out = step()
        torch.cuda.synchronize(device)
        return out

    return run


def interleave(steps: dict[str, Callable], rounds: int, *,
               clock: Callable[[], float] = time.perf_counter, around: Callable | None = None,
               after_round: Callable[[int, dict[str, float]], None] | None = None,
               ) -> dict[str, list[float]]:
    """Time every step of ``steps`` once per round for ``rounds`` rounds: ``{name: [seconds of
    round 0, round 1, ...]}``.

    Round ``r`` starts at the ``r``-th step (mod their number) and goes round, so no step
    always runs first or always follows the same one. ``around(name)``, a context manager,
    wraps each timed call outside the clock (a memory measurement); ``after_round(r, {name:
    seconds})`` hears each finished round (progress). Warm-up is the caller's: every call here
    is timed.
    """
    names = list(steps)
    times = {name: [] for name in names}
    for r in range(rounds):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            with around(name) if around else contextlib.nullcontext():
                t = clock()
                steps[name]()
                times[name].append(clock() - t)
        if after_round:
            after_round(r, {name: times[name][-1] for name in names})
    return times


def ratio(times: dict[str, list[float]], top: str, bottom: str) -> Spread:
    """``top / bottom`` round by round (as :func:`interleave` timed them): median and range."""
    return Spread.of(t / b for t, b in zip(times[top], times[bottom], strict=True))


class Measurement(NamedTuple):
    seconds: float  # best of the timed repeats
    peak_bytes: int  # peak extra memory of one step
    loss: float


def measure(step: Callable[[], torch.Tensor], device: torch.device, repeats: int = 2,
            warmup: int = 1) -> Measurement:
    """Time ``step`` (which runs forward + backward and returns the loss) and its peak memory:
    the fastest and the smallest of ``repeats`` calls after ``warmup`` untimed ones."""
    losses = []
    run = synced(step, device)
    for _ in range(warmup):
        losses.append(run())
    peaks = []
    times = interleave({"step": lambda: losses.append(run())}, repeats,
                       around=lambda _: peak_memory(device, peaks))["step"]
    return Measurement(min(times), min(peaks), float(losses[-1]))
