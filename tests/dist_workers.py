"""Worker functions for the torch.distributed tests (spawned processes import this module)."""

import os

import torch
import torch.distributed as dist


def shutdown() -> None:
    """Tear down in order: every rank done, wrappers (and their gloo threads) collected, then
    the process group; exiting with a live group can abort a gloo thread."""
    import gc

    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


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
        shutdown()


# ---------------------------------------------------------------------- one training step

def step_batch():
    """The global batch every rank plans from, and its per-occurrence data [N, L]."""
    from treepack import zoo
    from treepack.verification import verification_batch

    seqs = verification_batch(zoo.VOCAB)
    n, width = len(seqs), max(len(s) for s in seqs)
    g = torch.Generator().manual_seed(7)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for s, seq in enumerate(seqs):
        mask[s, min(5, len(seq) - 1):len(seq)] = True
    mask[:, 0] = False
    old_shift = torch.randn(n, width, generator=g) * 0.2  # old logps = logps + shift
    adv = torch.randn(n, width, generator=g)
    return seqs, mask, old_shift, adv


def step_loss(logps, rows, mask, old_shift, adv, den):
    from treepack import losses

    width = logps.shape[1]
    m = mask[rows][:, :width]
    return losses.policy_loss(logps, logps.detach() + old_shift[rows][:, :width],
                              adv[rows][:, :width], m, clip=0.2, clip_high=0.28,
                              mode="seq-mean-token-mean", denominators=den).loss


def reference_grads():
    """Single process, whole batch, every sequence alone."""
    from treepack import losses, zoo

    seqs, mask, old_shift, adv = step_batch()
    model = zoo.tiny_model("llama", seed=1)
    logps = torch.zeros(mask.shape)
    for s, seq in enumerate(seqs):
        logp = model(input_ids=seq[None], use_cache=False).logits[0].log_softmax(-1)
        logps = logps.index_put((torch.tensor([s]), torch.arange(1, len(seq))),
                                logp[:-1].gather(-1, seq[1:, None])[:, 0])
    loss = step_loss(logps, torch.arange(len(seqs)), mask, old_shift, adv,
                     losses.Denominators.of(mask))
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


def _rank_step(model, rank, world, set_sync):
    import treepack
    from treepack import hf, losses

    seqs, mask, old_shift, adv = step_batch()
    plan = treepack.plan(seqs, max_tokens=60, world_size=world)
    packs = plan.packs(rank)
    assert plan.packs_per_rank >= 2  # accumulation over several packs on every rank
    den = losses.global_denominators([mask[p.seq_ids][:, :p.max_length] for p in packs])
    for i, pack in enumerate(packs):
        last = i == len(packs) - 1
        with set_sync(last):
            logps = pack.token_logprobs(hf.forward(model, pack).logits[0])
            step_loss(logps, pack.seq_ids, mask, old_shift, adv, den).backward()


def ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    import contextlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    from treepack import hf, zoo

    init(rank, world, port)
    try:
        core = hf.prepare(zoo.tiny_model("llama", seed=1))
        model = DDP(core)
        _rank_step(model, rank, world,
                   lambda last: contextlib.nullcontext() if last else model.no_sync())
        if rank == 0:
            torch.save({k: p.grad for k, p in core.named_parameters()}, out)
        model = core = None  # release the wrapper (and its gloo state) before shutdown
    finally:
        shutdown()


def fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import contextlib

    from torch.distributed.fsdp import fully_shard

    from treepack import hf, zoo

    init(rank, world, port)
    try:
        model = hf.prepare(zoo.tiny_model("llama", seed=1))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)

        @contextlib.contextmanager
        def set_sync(last):
            model.set_requires_gradient_sync(last)
            yield

        _rank_step(model, rank, world, set_sync)
        grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, out)
        model = None  # release the sharded module before shutdown
    finally:
        shutdown()
