"""Spawning the ranks of a multi-process test (imported by the tests of every folder)."""

import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, *args, world: int = 2, timeout: float | None = None) -> None:
    """``fn(rank, world, port, *args)`` on ``world`` processes; with ``timeout``, the ranks
    still running after that many seconds are killed and the test fails (a hang)."""
    if timeout is None:
        mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)
        return
    context = mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
            for p in context.processes:
                p.kill()
            pytest.fail(f"{fn.__name__}: ranks {alive} still running after {timeout:g} s "
                        "(a hang)")
