"""Spawning the ranks of a multi-process test, and each rank's process group (imported by
the tests and workers of every folder)."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_python(code: str, timeout: float = 600) -> str:
    """``code`` in a fresh Python with this one's import path (Ray and TransferQueue, say,
    kept out of the test process); its stdout. Fails the test, with stderr's tail, where it
    fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-5000:]
    return done.stdout


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


def shutdown() -> None:
    """Tear down in order: every rank done, wrappers (and their gloo threads) collected, then
    the process group; exiting with a live group can abort a gloo thread."""
    import gc

    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def init(rank: int, world: int, port: int, timeout=None) -> None:
    """The gloo group of a spawned test (``timeout``: how long a collective waits before it
    raises, for tests where a hang is the failure)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **({} if timeout is None else {"timeout": timeout}))
