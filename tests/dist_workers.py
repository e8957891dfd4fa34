"""Worker functions for the torch.distributed tests (spawned processes import this module)."""

import os

import torch
import torch.distributed as dist


def init(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def rank_masks(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.rand(3 + rank + k, 9, generator=g) < 0.5 for k in range(2)]


def global_denominators_worker(rank: int, world: int, port: int) -> None:
    from treepack import losses

    init(rank, world, port)
    try:
        den = losses.global_denominators(rank_masks(rank))
        every = [m for r in range(world) for m in rank_masks(r)]
        assert den.world_size == world
        assert den.tokens == float(sum(m.sum() for m in every)), den
        assert den.sequences == float(sum(m.any(-1).sum() for m in every)), den
    finally:
        dist.destroy_process_group()
