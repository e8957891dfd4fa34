"""Worker functions for the torch.distributed tests (spawned processes import this module)."""

import torch

from launch import init, shutdown
from tolerance import FLOAT32_RELATIVE, assert_within, rounding


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
    logps = alone_logprobs(model, seqs, mask.shape)
    loss = step_loss(logps, torch.arange(len(seqs)), mask, old_shift, adv,
                     losses.Denominators.of(mask))
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


def alone_logprobs(model, seqs, shape):
    """[N, L] label-aligned log-probs of every sequence run by itself."""
    logps = torch.zeros(shape)
    for s, seq in enumerate(seqs):
        logp = model(input_ids=seq[None], use_cache=False).logits[0].log_softmax(-1)
        logps = logps.index_put((torch.tensor([s]), torch.arange(1, len(seq))),
                                logp[:-1].gather(-1, seq[1:, None])[:, 0])
    return logps


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


def sharded_model():
    """A prepared tiny Llama under FSDP2: each layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    from treepack import hf, zoo

    model = hf.prepare(zoo.tiny_model("llama", seed=1))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import contextlib

    init(rank, world, port)
    try:
        model = sharded_model()

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


# ---------------------------------------------------------------------- parts under DDP

def parts_loss(mask, old_shift, adv):
    """seq-mean-token-mean of a clipped policy loss as a sum over predictions: each token
    weighted by 1 / (its sequence's loss tokens x the batch's sequences), counted on the whole
    batch's mask, so any part's share adds up to the step's loss."""
    lengths = mask.sum(-1, keepdim=True).clamp_min(1)
    weight = mask / lengths / mask.any(-1).sum()

    def loss_fn(seq_ids):
        def part(out, part_mask):
            w, a = weight[seq_ids][:, :part_mask.shape[1]], adv[seq_ids][:, :part_mask.shape[1]]
            old = out.logprobs.detach() + old_shift[seq_ids][:, :part_mask.shape[1]]
            ratio = (out.logprobs - old).exp()
            clipped = torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
            return -(clipped * w).where(part_mask, 0).sum()
        return part
    return loss_fn


def parts_reference_grads():
    """Single process, every sequence alone, the same loss."""
    from treepack import zoo

    from treepack import TokenLogprobs

    seqs, mask, old_shift, adv = step_batch()
    model = zoo.tiny_model("llama", seed=1)
    out = TokenLogprobs(alone_logprobs(model, seqs, mask.shape))
    parts_loss(mask, old_shift, adv)(torch.arange(len(seqs)))(out, mask).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def ddp_parts_worker(rank: int, world: int, port: int, out: str) -> None:
    """Each rank its own trees (a plan's), in parts of at most 12 rows, under DDP; the loss
    is DDP's: averaged over ranks, so each rank's share is scaled by the world size."""
    import numpy as np
    from torch.nn.parallel import DistributedDataParallel as DDP

    import treepack
    from treepack import hf, zoo

    init(rank, world, port)
    try:
        core = hf.prepare(zoo.tiny_model("llama", seed=1))
        model = DDP(core)
        seqs, mask, old_shift, adv = step_batch()
        plan = treepack.plan(seqs, max_tokens=60, world_size=world)
        mine = np.concatenate([p.seq_ids for p in plan.specs[rank]])
        loss = parts_loss(mask, old_shift, adv)(torch.from_numpy(mine))
        step = hf.backward_in_parts(model, [seqs[i] for i in mine],
                                    lambda o, m: loss(o, m) * world, max_tokens=12)
        assert step.parts > 1
        if rank == 0:
            torch.save({k: p.grad for k, p in core.named_parameters()}, out)
        model = core = None
    finally:
        shutdown()


def empty_rank_parts_worker(rank: int, world: int, port: int, out: str,
                            wrapper: str = "ddp") -> None:
    """Rank 0 holds every tree, rank 1 the empty pack plan() gives a rank with none, under
    DDP or FSDP2: the empty rank's step computes nothing and still takes part in every
    collective, so the averaged gradients are rank 0's trees' alone."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import treepack
    from treepack import hf, zoo

    init(rank, world, port)
    try:
        seqs, mask, old_shift, adv = step_batch()
        # what plan() gives the rank without a tree, when there is one tree for two ranks
        empty = treepack.plan(seqs[:1], max_tokens=10_000, world_size=world).packs(1)[0]
        assert empty.num_sequences == 0
        core = hf.prepare(zoo.tiny_model("llama", seed=1)) if wrapper == "ddp" else None
        model = DDP(core) if wrapper == "ddp" else sharded_model()
        loss = parts_loss(mask, old_shift, adv)(torch.arange(len(seqs)))
        batch = seqs if rank == 0 else empty
        for _ in range(2):  # twice: the empty rank leaves the wrapper as it found it
            model.zero_grad()
            step = hf.backward_in_parts(model, batch, lambda o, m: loss(o, m) * world,
                                        max_tokens=12)
        assert (step.parts > 1) if rank == 0 else (step.parts == 0)
        hf.logprobs_in_parts(model, batch, max_tokens=12)
        grads = {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for k, p in (core or model).named_parameters()}
        if rank == 0:
            torch.save(grads, out)
        model = core = None
    finally:
        shutdown()


def sharded_parts_steps(model, rank: int, world: int) -> None:
    """Two steps of this rank's trees in parts (12 + rank rows a forward; twice: the module
    is left as FSDP expects, sharded and synced), then the no-grad pass at another budget."""
    import numpy as np

    import treepack
    from treepack import hf

    seqs, mask, old_shift, adv = step_batch()
    plan = treepack.plan(seqs, max_tokens=60, world_size=world)
    mine = np.concatenate([p.seq_ids for p in plan.specs[rank]])
    loss = parts_loss(mask, old_shift, adv)(torch.from_numpy(mine))
    for _ in range(2):
        model.zero_grad()
        step = hf.backward_in_parts(model, [seqs[i] for i in mine],
                                    lambda o, m: loss(o, m) * world, max_tokens=12 + rank)
    assert step.parts > 1
    old = hf.logprobs_in_parts(model, [seqs[i] for i in mine], max_tokens=9 + rank)
    # a float32 model, in parts at two budgets
    assert_within(old.logprobs, step.logprobs, FLOAT32_RELATIVE)


def fsdp_parts_worker(rank: int, world: int, port: int, out: str) -> None:
    """The same under FSDP2 (fully_shard per layer and at the root): its gradients are
    averaged over ranks too."""
    init(rank, world, port)
    try:
        model = sharded_model()
        sharded_parts_steps(model, rank, world)
        grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, out)
        model = None
    finally:
        shutdown()


def fsdp1_parts_worker(rank: int, world: int, port: int, out: str) -> None:
    """The same under FSDP1 (FullyShardedDataParallel, each layer then the root, flat
    parameters, use_orig_params=True here, False in the verl tests): its handles are
    gathered once for the step, then reduce-scattered."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from treepack import hf, zoo

    init(rank, world, port)
    try:
        model = FSDP(hf.prepare(zoo.tiny_model("llama", seed=1)),
                     auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                     device_id=torch.device("cpu"), use_orig_params=True)
        sharded_parts_steps(model, rank, world)
        with FSDP.summon_full_params(model, with_grads=True):
            grads = {k.replace("_fsdp_wrapped_module.", ""): p.grad.clone()
                     for k, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, out)
        model = None
    finally:
        shutdown()


def average_gradients_worker(rank: int, world: int, port: int) -> None:
    """The DDP parts path's gradient averaging in small buckets, over parameters of two
    dtypes, one frozen and one without a gradient on this rank: every gradient the mean of
    the ranks'."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from treepack.adapters.fsdp.sync import average_gradients

    init(rank, world, port)
    try:
        module = torch.nn.Module()
        module.a = torch.nn.Parameter(torch.zeros(5, 3))
        module.b = torch.nn.Parameter(torch.zeros(7, dtype=torch.float64))
        module.frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        module.c = torch.nn.Parameter(torch.zeros(4, 2))
        module.forward = lambda: None
        model = DDP(module)

        def grads(r):
            g = torch.Generator().manual_seed(r)
            return {"a": torch.randn(5, 3, generator=g),
                    "b": torch.randn(7, generator=g, dtype=torch.float64),
                    "c": torch.randn(4, 2, generator=g) if r == 0 else None}

        for name, grad in grads(rank).items():
            getattr(module, name).grad = grad
        average_gradients(module, model.process_group, zeros_for_missing=True,
                          bucket_bytes=40)  # a bucket a parameter or two
        for name in ("a", "b", "c"):
            each = [grads(r)[name] for r in range(world)]
            want = sum(torch.zeros_like(each[0]) if g is None else g for g in each) / world
            # the mean of `world` values, summed in another order: a rounding an addition
            torch.testing.assert_close(getattr(module, name).grad, want, rtol=0,
                                       atol=rounding(want.dtype, want, steps=world + 1))
        assert module.frozen.grad is None
        model = module = None
    finally:
        shutdown()
