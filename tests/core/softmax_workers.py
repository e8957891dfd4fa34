"""The ranks of test_softmax's vocabulary-parallel test (spawned processes import this
module)."""

import torch
import torch.distributed as dist

from launch import init, shutdown


def vocab_parallel_worker(rank: int, world: int, port: int, out: str) -> None:
    """A Head whose vocabulary is split over the ranks (Megatron's output layer under tensor
    parallelism) against the whole head in one process: picked log-probs, entropies and the
    gradients of hidden (each rank's share, summed here as the caller does) and of each
    rank's weight rows; a row of -inf logits (a zero head) and chunks of one row included."""
    import numpy as np

    from treepack.core.softmax import Head, normalise

    init(rank, world, port)
    try:
        g = torch.Generator().manual_seed(3)
        rows, hidden_size, vocab = 6, 5, 12
        hidden = torch.randn(rows, hidden_size, generator=g, dtype=torch.float64)
        weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)
        source_rows = np.array([0, 1, 1, 2, 4, 5])
        temperature = np.array([1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
        pick = np.array([0, 1, 2, 2, 3, 4, 5, 5])
        token = torch.tensor([0, 11, 5, 6, 3, 9, 0, 11])
        share = vocab // world
        results = {}
        for chunk in (1, 4, 100):
            mine_h = hidden.clone().requires_grad_()
            mine_w = weight[rank * share:(rank + 1) * share].clone().requires_grad_()
            logp, ent = normalise(Head(mine_h, mine_w, vocab_group=dist.group.WORLD,
                                       vocab_start=rank * share),
                                  source_rows, temperature, pick, token, entropy=True,
                                  chunk_size=chunk)
            whole_h = hidden.clone().requires_grad_()
            whole_w = weight.clone().requires_grad_()
            want_logp, want_ent = normalise(Head(whole_h, whole_w), source_rows, temperature,
                                            pick, token, entropy=True, chunk_size=chunk)
            wl, we = torch.linspace(-1, 1, len(pick), dtype=torch.float64), \
                torch.linspace(1, 2, len(source_rows), dtype=torch.float64)
            ((logp * wl).sum() + (ent * we).sum()).backward()
            ((want_logp * wl).sum() + (want_ent * we).sum()).backward()
            grad_h = mine_h.grad.clone()
            dist.all_reduce(grad_h)  # the caller's sum of every share's hidden gradient
            pairs = ((logp, want_logp), (ent, want_ent), (grad_h, whole_h.grad),
                     (mine_w.grad, whole_w.grad[rank * share:(rank + 1) * share]))
            results[chunk] = max(((a - b).abs().max() / b.abs().max()).item()
                                 for a, b in pairs)  # each relative to its size
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        shutdown()
