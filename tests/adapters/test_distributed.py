import socket

import pytest
import torch
import torch.distributed
import torch.multiprocessing as mp

import dist_workers

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")


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
    import time

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


def test_global_denominators_sum_every_pack_of_every_rank():
    spawn(dist_workers.global_denominators_worker)


def test_parts_average_gradients_in_buckets_as_ddp_would():
    spawn(dist_workers.average_gradients_worker)


def rank_zero_grads_equal(worker, reference, tmp_path):
    """Run ``worker`` on 2 ranks; rank 0's gradients equal ``reference()``'s, to float32
    rounding of the reductions."""
    pytest.importorskip("transformers")
    out = tmp_path / "grads.pt"
    spawn(getattr(dist_workers, worker), str(out))
    got = torch.load(out)
    expect = reference()
    assert got.keys() == expect.keys()
    for k, g in expect.items():
        torch.testing.assert_close(got[k], g, rtol=0, atol=1e-5 * g.abs().max().item(), msg=k)


@pytest.mark.parametrize("worker", ["ddp_worker", "fsdp_worker"])
def test_one_step_over_a_plan_equals_the_unpacked_batch(worker, tmp_path):
    rank_zero_grads_equal(worker, dist_workers.reference_grads, tmp_path)


@pytest.mark.parametrize("worker", ["ddp_parts_worker", "fsdp_parts_worker",
                                    "fsdp1_parts_worker"])
def test_parts_under_ddp_and_fsdp2_equal_every_sequence_alone(worker, tmp_path):
    """Two ranks, each its own trees run in parts (more than one forward each, different
    counts), under DDP and FSDP2: the averaged gradients equal one process running every
    sequence alone."""
    rank_zero_grads_equal(worker, dist_workers.parts_reference_grads, tmp_path)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_a_rank_with_an_empty_pack_keeps_the_collectives_in_step(wrapper, tmp_path):
    """A rank with no trees runs a no-op step in parts beside a rank that runs many: nothing
    hangs, and the gradients equal every sequence run alone."""
    pytest.importorskip("transformers")
    out = tmp_path / "grads.pt"
    spawn(dist_workers.empty_rank_parts_worker, str(out), wrapper)
    got, expect = torch.load(out), dist_workers.parts_reference_grads()
    for k, g in expect.items():
        torch.testing.assert_close(got[k], g, rtol=0, atol=1e-5 * g.abs().max().item(), msg=k)
