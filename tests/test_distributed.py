import socket

import pytest
import torch.distributed
import torch.multiprocessing as mp

import dist_workers

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int = 2) -> None:
    mp.spawn(fn, args=(world, free_port()), nprocs=world, join=True)


def test_global_denominators_sum_every_pack_of_every_rank():
    spawn(dist_workers.global_denominators_worker)
