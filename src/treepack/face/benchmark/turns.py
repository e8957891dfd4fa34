"""Two runs in two processes taking their steps in turn (:func:`run_in_turn`), so a load that
comes and goes on the machine lands on both, each run drawing from its own random state.

Processes, not threads: on a CPU a thread that has used torch and waits slowed the running
one about 2x (measured: one ``generate`` 0.41 s alone, 0.70-0.87 s beside such a thread); a
waiting process does not.

Nothing here waits without bound: a run that fails stops the other at its next turn, a run
whose process dies is named as soon as its exit is seen, and the runs end when their parent
does.
"""

from __future__ import annotations

import gc
import multiprocessing
import queue
import traceback
from typing import Callable

__all__ = ["Baton", "Stopped", "run_in_turn"]

POLL = 0.5  # seconds between checks while waiting
STOPPED = "the other run failed; this one stops"


class Stopped(RuntimeError):
    """The other run failed, or the parent process is gone: this run ends."""


class Baton:
    """Only its holder runs. A run hands it to the other at the end of each step
    (:meth:`give`) and waits for it back; a run that finishes hands it over for good, and the
    other then runs on alone."""

    def __init__(self, context, names: tuple[str, str]):
        self.names = tuple(names)
        self.go = {name: context.Semaphore(0) for name in names}
        self.done = context.Array("b", len(names))
        self.stop = context.Event()  # a run failed: every wait ends
        self.over = context.Event()  # both runs reported: their processes may end

    def _check(self) -> None:
        if self.stop.is_set():
            raise Stopped(STOPPED)
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            raise Stopped("the parent process ended; this run stops")

    def take(self, name: str) -> None:
        """Wait for the baton."""
        while not self.go[name].acquire(timeout=POLL):
            self._check()

    def give(self, name: str, *, finished: bool = False) -> None:
        """Hand the baton to the other run; unless ``finished``, wait for it back."""
        index = self.names.index(name)
        other = self.names[1 - index]
        if finished:
            self.done[index] = 1
            self.go[other].release()
        elif not self.done[1 - index]:
            self.go[other].release()
            self.take(name)
        else:  # the other run ended: this one goes on alone, unless it failed
            self._check()

    def wait_over(self) -> None:
        """Wait until the parent has both runs' reports (a finished run's process ending is
        work the other run's last steps would be timed against)."""
        while not self.over.wait(POLL):
            parent = multiprocessing.parent_process()
            if parent is not None and not parent.is_alive():
                return


def _child(name: str, prepare: Callable, run: Callable, args: tuple, baton: Baton,
           results) -> None:
    """One run's process: ``prepare(name, *args)`` (imports, data), ``("ready", ...)``, then
    ``run(prepared, baton)`` from the first turn on: ``("run", name, result)`` or ``("error",
    name, traceback)``."""
    try:
        prepared = prepare(name, *args)
        results.put(("ready", name, None))
        baton.take(name)
        results.put(("run", name, run(prepared, baton)))
    except Stopped as e:
        results.put(("error", name, str(e)))
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        results.put(("error", name, traceback.format_exc()))
    finally:
        gc.collect()  # freed while this run holds the baton: not timed against the other's
        baton.give(name, finished=True)
        baton.wait_over()


def run_in_turn(names: tuple[str, str], prepare: Callable, run: Callable, args: tuple = (),
                *, join_seconds: float = 30.0) -> dict:
    """Run ``run(prepare(name, *args), baton)`` for both ``names``, each in a spawned process,
    ``names[0]`` first, the two taking turns wherever ``run`` calls ``baton.give(name)`` (at
    the end of each step). ``prepare`` and ``run`` must be importable (module-level).

    Returns:
        ``{name: what run returned}``.

    Raises:
        RuntimeError: naming the run that failed (its traceback), or whose process ended
            without a result; the other run is stopped at its next turn.
    """
    context = multiprocessing.get_context("spawn")  # a fresh process: no inherited state
    baton = Baton(context, names)
    results = context.Queue()
    workers = {name: context.Process(target=_child, name=f"treepack-{name}",
                                     args=(name, prepare, run, args, baton, results))
               for name in names}
    for w in workers.values():
        w.start()
    ready, out, errors = set(), {}, {}
    try:
        while len(out) + len(errors) < len(names):
            try:
                kind, name, payload = results.get(timeout=POLL)
            except queue.Empty:
                for name, w in workers.items():
                    if name not in out and name not in errors and not w.is_alive():
                        errors[name] = (f"its process ended (exit code {w.exitcode}) without "
                                        "a result")
                        baton.stop.set()
                continue
            if kind == "ready":
                ready.add(name)
                if len(ready) == len(names):  # both imported what they need: go
                    baton.go[names[0]].release()
            elif kind == "run":
                out[name] = payload
            else:  # the other run stops at its next turn
                errors.setdefault(name, payload)
                baton.stop.set()
    finally:
        baton.over.set()
        for w in workers.values():
            w.join(join_seconds)
            if w.is_alive():
                w.terminate()
    if errors:  # the run that failed, rather than the one it stopped
        stopped = [n for n, e in errors.items() if e.startswith(STOPPED)]
        name = next((n for n in errors if n not in stopped), stopped[0])
        also = "".join(f"\n(the {n} run stopped at its next turn)" for n in stopped if n != name)
        raise RuntimeError(f"the {name} run failed:\n{errors[name]}{also}")
    return out
