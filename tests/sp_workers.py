"""Sequence-parallel workers (spawned processes import this module): each rank runs a list of
cases, with a group per case, and saves what it got; the tests compare with one process."""

import contextlib
import dataclasses

import torch
import torch.distributed as dist

import dist_workers

TEMPERATURES = (0.7, 1.0, 1.3)


def batch(kind: str, seed: int = 0):
    """The sequences of a case: the verification batch (GRPO forests, agent trajectories,
    duplicates, a prefix of another, a one-token sequence), or smaller ones."""
    from treepack import zoo
    from treepack.verification import verification_batch

    if kind == "verification":
        return verification_batch(zoo.VOCAB, seed=seed)
    if kind == "tiny":  # fewer rows than ranks
        return [torch.tensor([5, 6, 7])]
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, zoo.VOCAB, (13,), generator=g)
    return [torch.cat([prompt, torch.randint(3, zoo.VOCAB, (n,), generator=g)])
            for n in (5, 9, 2, 6)] + [prompt[:6].clone()]  # 35 rows: odd


def weights(shape, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), \
        torch.randn(shape, generator=g, dtype=torch.float64)


def model_for(case: dict):
    from treepack import hf, zoo

    model = zoo.tiny_model(case.get("family", "llama"), seed=1, dtype=torch.float64,
                           **case.get("config", {}))
    hf.prepare(model)
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def temperatures(n: int, case: dict):
    return [TEMPERATURES[s % 3] for s in range(n)] if case.get("temperatures") else 1.0


def run_case(case: dict, group, seed: int) -> dict:
    """One case on this rank: its outputs and its (group-averaged) gradients."""
    from treepack import TreePack, hf

    model = model_for(case)
    pack = TreePack.from_sequences(batch(case.get("batch", "verification"), seed))
    w, v = weights(tuple(pack.rows.shape))
    temps = temperatures(pack.num_sequences, case)
    call = case.get("call", "logprobs")
    common = dict(entropy=True, temperature=temps, align=case.get("align", "label"),
                  sequence_parallel=group)
    if call == "logprobs":
        out = hf.logprobs(model, pack, head=case.get("head", "auto"),
                          backend=case.get("backend", "auto"), **common)
        loss = (out.logprobs * w).sum() + (out.entropy * v).sum()
        loss.backward()
        logprobs, entropy = out.logprobs.detach(), out.entropy.detach()
    elif call == "backward":
        res = hf.backward_in_parts(
            model, pack, lambda o, m: ((o.logprobs * w).where(m, 0).sum()
                                       + (o.entropy * v).where(m, 0).sum()),
            max_tokens=case["budget"], **common)
        loss, logprobs, entropy = res.loss, res.logprobs, res.entropy
    elif call == "step":
        res = hf.step_in_parts(model, pack, lambda o: (o.logprobs * w).sum()
                               + (o.entropy * v).sum(), max_tokens=case["budget"], **common)
        loss, logprobs, entropy = res.loss, res.logprobs, res.entropy
    else:  # "score"
        out = hf.logprobs_in_parts(model, pack, max_tokens=case["budget"], **common)
        loss, logprobs, entropy = None, out.logprobs, out.entropy
    from treepack.adapters.hf.sequence_parallel import average_gradients

    average_gradients(model, case.get("average_over", group))
    return {"loss": None if loss is None else loss.detach(), "logprobs": logprobs,
            "entropy": entropy,
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()
                      if p.grad is not None}}


def reference(case: dict, seed: int = 0) -> dict:
    """The same loss in one process: the whole pack in one forward (``"pack"``), and every
    sequence run alone (``"alone"``, label-aligned cases)."""
    from treepack import TreePack, hf

    seqs = batch(case.get("batch", "verification"), seed)
    pack = TreePack.from_sequences(seqs)
    w, v = weights(tuple(pack.rows.shape))
    temps = temperatures(pack.num_sequences, case)
    results = {}
    model = model_for(case)
    out = hf.logprobs(model, pack, entropy=True, temperature=temps,
                      align=case.get("align", "label"), head="logits", backend="segment")
    results["pack"] = _result(model, out.logprobs, out.entropy, w, v)
    if case.get("align", "label") == "label":
        model = model_for(case)
        logps, ents = torch.zeros_like(w), torch.zeros_like(w)
        for s, seq in enumerate(seqs):
            t = temps[s] if isinstance(temps, list) else temps
            logp = (model(input_ids=seq[None], use_cache=False).logits[0] / t).log_softmax(-1)
            ent = -(logp.exp() * logp).sum(-1)
            at = (torch.tensor([s]), torch.arange(1, len(seq)))
            logps = logps.index_put(at, logp[:-1].gather(-1, seq[1:, None])[:, 0])
            ents = ents.index_put(at, ent[:-1])
        results["alone"] = _result(model, logps, ents, w, v)
    return results


def _result(model, logprobs, entropy, w, v) -> dict:
    loss = (logprobs * w).sum() + (entropy * v).sum()
    loss.backward()
    return {"loss": loss.detach(), "logprobs": logprobs.detach(), "entropy": entropy.detach(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()
                      if p.grad is not None}}


@contextlib.contextmanager
def broken(how: str | None):
    """A negative control: the sequence-parallel code with one thing broken."""
    from treepack.adapters.hf import sequence_parallel as sp

    saved = sp._Exchange.backward, sp.SequenceParallel.rows, sp.packed_forward
    try:
        if how == "no_return_backward":  # the exchange back passes no gradient
            def backward(ctx, grad):
                scatter, gather = ctx.dims
                if scatter == 2 or (scatter == 0 and gather == 1):  # rows -> heads: back
                    return torch.zeros_like(sp._all_to_all(grad, gather, scatter, ctx.group)), \
                        None, None, None
                return saved[0](ctx, grad)
            sp._Exchange.backward = staticmethod(backward)
        elif how == "same_rows":  # every rank computes rank 0's rows
            def rows(self, rows):
                rank, self.rank = self.rank, 0
                try:
                    return saved[1](self, rows)
                finally:
                    self.rank = rank
            sp.SequenceParallel.rows = rows
        elif how == "slice_positions":  # each rank numbers its rows from 0
            def packed_forward(model, pack, kwargs, *, rows, mixers, output):
                width = rows.shape[0]
                local = torch.arange(pack.num_rows) % width
                pack = dataclasses.replace(pack, position_ids=local, _derived={})
                return saved[2](model, pack, kwargs, rows=rows, mixers=mixers, output=output)
            sp.packed_forward = packed_forward
        yield
    finally:
        sp._Exchange.backward, sp.SequenceParallel.rows, sp.packed_forward = saved


def cases_worker(rank: int, world: int, port: int, out: str, cases: dict) -> None:
    """Every case with groups of ``case["group"]`` consecutive ranks (default: all); a
    data-parallel group (ranks with the same place in their groups) gets the batch of its
    seed, and ``average_over="world"`` averages the gradients over every rank, as DDP."""
    dist_workers.init(rank, world, port)
    try:
        sizes = sorted({case.get("group", world) for case in cases.values()})
        groups = {size: [dist.new_group(list(range(g, g + size)))
                         for g in range(0, world, size)] for size in sizes}
        results = {}
        for name, case in cases.items():
            size = case.get("group", world)
            group = groups[size][rank // size]
            over = dist.group.WORLD if case.get("average_over") == "world" else group
            with broken(case.get("broken")):
                try:
                    results[name] = run_case({**case, "average_over": over}, group,
                                             rank // size)
                except Exception as e:  # noqa: BLE001 - the test reads what was raised
                    results[name] = {"error": f"{type(e).__name__}: {e}"}
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist_workers.shutdown()


def refusals_worker(rank: int, world: int, port: int, out: str) -> None:
    """What sequence parallelism refuses, on every rank at once (no hang)."""
    from treepack import TreePack, hf, zoo

    dist_workers.init(rank, world, port)
    errors = {}
    try:
        group = dist.new_group(list(range(world)))
        model = model_for({})
        seqs = batch("small")

        def attempt(name, fn):
            try:
                fn()
                errors[name] = None
            except Exception as e:  # noqa: BLE001
                errors[name] = f"{type(e).__name__}: {e}"

        mine = TreePack.from_sequences(seqs if rank == 0 else seqs[:-1])
        attempt("different packs", lambda: hf.logprobs(model, mine, sequence_parallel=group))
        attempt("parts, different packs", lambda: hf.logprobs_in_parts(
            model, mine, max_tokens=8, sequence_parallel=group))
        pack = TreePack.from_sequences(seqs)
        if world == 3:  # three ranks cannot split four heads
            attempt("heads", lambda: hf.logprobs(model, pack, sequence_parallel=group))
        alone = dist.new_group([0])
        attempt("not a member", lambda: hf.logprobs(model, pack, sequence_parallel=alone))
        attempt("not a group", lambda: hf.logprobs(model, pack, sequence_parallel=[0, 1]))
        pair = dist.new_group([0, 1])  # two ranks split the models' heads and channels
        if rank < 2:
            bamba = zoo.tiny_model("bamba", seed=1, dtype=torch.float64)
            hf.prepare(bamba)
            attempt("mamba2", lambda: hf.logprobs(bamba, pack, sequence_parallel=pair))
            moe = zoo.tiny_model("mixtral", seed=1, dtype=torch.float64)
            hf.prepare(moe)
            attempt("router", lambda: hf.logprobs(moe, pack, sequence_parallel=pair,
                                                  output_router_logits=True))
        torch.save(errors, f"{out}/rank{rank}.pt")
    finally:
        dist_workers.shutdown()
