"""Two runs in two processes taking turns (``treepack.benchmark.turns``): the order, and every
way a run can fail ends the pair promptly, naming the run, instead of hanging."""

import os
import time

import pytest

from treepack.face.benchmark.turns import run_in_turn

STEPS = 3


def prepare(name, fail_at=None, how=None):
    if how == "prepare" and name == "b":
        raise ValueError("b could not prepare")
    return name, fail_at, how


def run(prepared, baton):
    """``STEPS`` steps (``a``: 100 when ``b`` fails), each one's start time; run ``b`` fails at
    ``fail_at`` as ``how`` says."""
    name, fail_at, how = prepared
    steps = 100 if name == "a" and fail_at is not None else STEPS
    began = []
    for step in range(steps):
        began.append(time.time())
        if name == "b" and step == fail_at:
            if how == "raise":
                raise ValueError(f"b failed at step {step}")
            os._exit(3)  # the process dies: no report, no finally
        time.sleep(0.05)
        if step < steps - 1:
            baton.give(name)
    return began


def test_the_runs_take_their_steps_in_turn():
    out = run_in_turn(("a", "b"), prepare, run)
    began = [t for a, b in zip(out["a"], out["b"]) for t in (a, b)]
    assert len(began) == 2 * STEPS and began == sorted(began)


@pytest.mark.parametrize("how, message", [
    ("raise", "ValueError: b failed at step 1"),
    ("exit", "exit code 3"),
    ("prepare", "ValueError: b could not prepare"),
])
def test_a_failing_run_ends_the_pair_and_is_named(how, message):
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="the b run failed") as caught:
        run_in_turn(("a", "b"), prepare, run, (1, how))
    assert message in str(caught.value)
    # the other run stops at its next turn instead of running its 100 steps alone
    assert "the a run stopped at its next turn" in str(caught.value)
    assert time.perf_counter() - started < 60
