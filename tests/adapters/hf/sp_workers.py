"""Sequence-parallel workers (spawned processes import this module): each rank runs a list of
cases, with a group per case, and saves what it got; the tests compare with one process."""

import contextlib
import dataclasses
import sys

import torch
import torch.distributed as dist

import launch

TEMPERATURES = (0.7, 1.0, 1.3)

_A, _B, _C = ("image", 0), ("image", 1), ("image", 2)  # 4, 6 and 6 placeholder rows
IMAGE_LAYOUT = [  # 43 rows: a rank boundary inside A at 2 ranks, inside all three at 4
    [1, 5, _A, 7, 8, 9],              # a GRPO group sharing image A ...
    [1, 5, _A, 7, 8, 10, 11],
    [1, 5, _A, 7, 12],
    [1, 5, _B, 7, 8, 9],              # ... the same text on image B
    [1, 5, _A, 7, 20, _C, 21, 22],    # an agent history: a screenshot C after a turn ...
    [1, 5, _A, 7, 20, _C, 21, 23, 4],  # ... and the next turn
    [1, 3, 9, 9, 9, 9, 9],            # text only (its rows come first)
]


def image_batch(family: str = "qwen2_vl"):
    """The images case's sequences and images, as a processor lays them out for ``family``
    (float64)."""
    from treepack import zoo

    return zoo.image_batch(IMAGE_LAYOUT, dtype=torch.float64, family=family)


def batch(kind: str, seed: int = 0, family: str = "qwen2_vl"):
    """The sequences of a case: the verification batch (GRPO forests, agent trajectories,
    duplicates, a prefix of another, a one-token sequence), or smaller ones."""
    from treepack import zoo
    from treepack.verification import verification_batch

    if kind == "verification":
        return verification_batch(zoo.VOCAB, seed=seed)
    if kind == "tiny":  # fewer rows than ranks
        return [torch.tensor([5, 6, 7])]
    if kind == "images":  # as many placeholders an image as the family's images take
        return [torch.tensor(seq) for seq in image_batch(family).sequences]
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, zoo.VOCAB, (13,), generator=g)
    return [torch.cat([prompt, torch.randint(3, zoo.VOCAB, (n,), generator=g)])
            for n in (5, 9, 2, 6)] + [prompt[:6].clone()]  # 35 rows: odd


def weights(shape, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), \
        torch.randn(shape, generator=g, dtype=torch.float64)


def model_for(case: dict, exact_scans=None):
    """A case's model, prepared; ``exact_scans`` (a ``pytest.MonkeyPatch``): with
    transformers' Gated DeltaNet kernels in float64 (reference.exact_kernel), patched before
    the model routes them."""
    from treepack import hf, zoo

    family = case.get("family", "llama")
    if family in ("gpt_oss", "llama4_text"):  # sinks; chunked attention (not zoo families)
        import tiny_models

        model = getattr(tiny_models, family)(torch.float64)
    elif family in zoo.VISION_FAMILIES:
        model = zoo.tiny_vision_model(family, seed=1, dtype=torch.float64)
    else:
        model = zoo.tiny_model(family, seed=1, dtype=torch.float64, **case.get("config", {}))
    if exact_scans is not None:
        from reference import exact_kernel

        exact_kernel(exact_scans, model)
    hf.prepare(model)
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def inputs(model, case: dict, seed: int):
    """A case's pack and the keyword arguments every call takes with it (its images)."""
    from treepack import TreePack, hf

    kind = case.get("batch", "verification")
    if kind != "images":
        return TreePack.from_sequences(batch(kind, seed)), {}
    b = image_batch(case.get("family", "qwen2_vl"))
    images = hf.Images(model, b.sequences, pixel_values=b.pixel_values,
                       image_grid_thw=b.image_grid_thw)
    return images.pack(), {"images": images}


@contextlib.contextmanager
def exact_vision_rotary(model):
    """While it lasts, the vision tower's rotary runs in the model's dtype. transformers
    applies it in float32 even in a float64 model; its backward then rounds each rank's (each
    part's) share of a split image's gradient to float32 on its own, 1e-9 from the whole
    pack's here (test_vision's exact_kernel runs the Gated DeltaNet kernel in float64 alike)."""
    from treepack import hf

    visual = getattr(getattr(hf.unwrap(model), "model", None), "visual", None)
    module = sys.modules[type(visual).__module__] if visual is not None else None
    saved = getattr(module, "apply_rotary_pos_emb_vision", None)
    if saved is None:
        yield
        return

    def rotary(q, k, cos, sin):
        cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
        half = module.rotate_half
        return q * cos + half(q) * sin, k * cos + half(k) * sin

    module.apply_rotary_pos_emb_vision = rotary
    try:
        yield
    finally:
        module.apply_rotary_pos_emb_vision = saved


def alone_inputs(case: dict, s: int) -> dict:
    """The model's own keyword arguments for sequence ``s`` run alone: its images."""
    from treepack import zoo

    b = image_batch(case.get("family", "qwen2_vl")) if case.get("batch") == "images" else None
    if b is None or not b.images[s]:
        return {}
    first = sum(map(len, b.images[:s]))
    ids = torch.tensor(b.sequences[s])[None]
    if b.image_grid_thw is None:  # whole images; Gemma 3's tokens of one see each other
        return dict(pixel_values=b.pixel_values[first:first + len(b.images[s])],
                    token_type_ids=(ids == zoo.VISION_IDS["image_token_id"]).long())
    grid = b.image_grid_thw[first:first + len(b.images[s])]
    start = int(b.image_grid_thw[:first].prod(-1).sum())
    return dict(pixel_values=b.pixel_values[start:start + int(grid.prod(-1).sum())],
                image_grid_thw=grid,
                mm_token_type_ids=(ids == zoo.VISION_IDS["image_token_id"]).long())


def temperatures(n: int, case: dict):
    return [TEMPERATURES[s % 3] for s in range(n)] if case.get("temperatures") else 1.0


@contextlib.contextmanager
def case_model(case: dict):
    """A case's model while it lasts, with transformers' Gated DeltaNet kernels in float64:
    transformers runs them wholly in float32, in chunks that start elsewhere on each rank, in
    one process and alone, so that their parameters' gradients (A_log, dt_bias) differ by 2e-4
    of their size, which no float64 comparison can allow (test_hybrid does the same). Restored,
    and the kernels put back, at the end."""
    import pytest

    from treepack import hf

    patch = pytest.MonkeyPatch()
    model = None
    try:
        model = model_for(case, exact_scans=patch)
        with exact_vision_rotary(model):
            yield model
    finally:
        if model is not None:
            hf.restore(model)
        patch.undo()


def run_case(case: dict, group, seed: int) -> dict:
    """One case on this rank: its outputs and its (group-averaged) gradients."""
    with case_model(case) as model:
        return _run_case(model, case, group, seed)


def _run_case(model, case: dict, group, seed: int) -> dict:
    from treepack import hf

    pack, extra = inputs(model, case, seed)
    w, v = weights(tuple(pack.rows.shape))
    temps = temperatures(pack.num_sequences, case)
    call = case.get("call", "logprobs")
    common = dict(entropy=True, temperature=temps, align=case.get("align", "label"),
                  sequence_parallel=group, **extra)
    if call == "logprobs":
        out = hf.logprobs(model, pack, head=case.get("head", "auto"),
                          backend=case.get("backend", "auto"), **common, **router(case))
        loss = (out.logprobs * w).sum() + (out.entropy * v).sum() + aux_term(out, case)
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


def router(case: dict) -> dict:
    """The keywords that make an MoE case return its router logits (and its loss)."""
    return {"output_router_logits": True} if case.get("router") else {}


def aux_term(out, case: dict):
    """The router loss's share of a case's loss (0 without it)."""
    return 0.5 * out.aux_loss if case.get("router") else 0


def reference(case: dict, seed: int = 0) -> dict:
    """The same loss in one process: the whole pack in one forward (``"pack"``), and every
    sequence run alone (``"alone"``, label-aligned cases)."""
    from treepack import hf

    results = {}
    with case_model(case) as model:
        pack, extra = inputs(model, case, seed)
        w, v = weights(tuple(pack.rows.shape))
        temps = temperatures(pack.num_sequences, case)
        out = hf.logprobs(model, pack, entropy=True, temperature=temps,
                          align=case.get("align", "label"), head="logits", backend="segment",
                          **extra, **router(case))
        results["pack"] = _result(model, out.logprobs, out.entropy, w, v, aux_term(out, case))
    # with a router loss: test_hybrid / test_hf check the pack's against the padded batch's
    if case.get("align", "label") == "label" and not case.get("router"):
        with case_model(case) as model:
            results["alone"] = _alone(model, case, seed, temps, w, v)
    return results


def _alone(model, case: dict, seed: int, temps, w, v) -> dict:
    """Every sequence run alone, with its images, through the model's own forward."""
    logps, ents = torch.zeros_like(w), torch.zeros_like(w)
    with exact_vision_rotary(model):
        for s, seq in enumerate(batch(case.get("batch", "verification"), seed,
                                      case.get("family", "qwen2_vl"))):
            t = temps[s] if isinstance(temps, list) else temps
            logits = model(input_ids=seq[None], use_cache=False,
                           **alone_inputs(case, s)).logits[0].to(w.dtype)  # Nemotron-H: fp32
            logp = (logits / t).log_softmax(-1)
            ent = -(logp.exp() * logp).sum(-1)
            at = (torch.tensor([s]), torch.arange(1, len(seq)))
            logps = logps.index_put(at, logp[:-1].gather(-1, seq[1:, None])[:, 0])
            ents = ents.index_put(at, ent[:-1])
        return _result(model, logps, ents, w, v)


def _result(model, logprobs, entropy, w, v, extra=0) -> dict:
    loss = (logprobs * w).sum() + (entropy * v).sum() + extra
    loss.backward()
    return {"loss": loss.detach(), "logprobs": logprobs.detach(), "entropy": entropy.detach(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()
                      if p.grad is not None}}


@contextlib.contextmanager
def broken(how: str | None):
    """A negative control: the sequence-parallel code with one thing broken."""
    from treepack.adapters.hf import packed
    from treepack.adapters.hf import sequence_parallel as sp
    from treepack.attention import exchange

    saved = exchange._Exchange.backward, sp.SequenceParallel.rows, sp.packed_forward
    vision_forward = packed.vision_forward
    try:
        if how == "no_return_backward":  # the exchange back passes no gradient
            def backward(ctx, grad):
                scatter, gather = ctx.dims
                if scatter == 2 or (scatter == 0 and gather == 1):  # rows -> heads: back
                    return torch.zeros_like(exchange._all_to_all(grad, gather, scatter,
                                                                 ctx.group)), None, None, None
                return saved[0](ctx, grad)
            exchange._Exchange.backward = staticmethod(backward)
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
                pack = dataclasses.replace(pack, position_ids=local)  # a new pack: its own cache
                return saved[2](model, pack, kwargs, rows=rows, mixers=mixers, output=output)
            sp.packed_forward = packed_forward
        elif how == "image_rows_from_zero":  # every rank places the image features, and
            # takes the mrope positions, of its slice's rows counted from 0 (rank 0's rows)
            def from_zero(model, pack, images, rows):
                return vision_forward(model, pack, images, rows - rows[0])
            packed.vision_forward = from_zero
        elif how == "image_depth_positions":  # features placed, positions the depths
            @contextlib.contextmanager
            def depths(model, pack, images, rows):
                with vision_forward(model, pack, images, rows):
                    yield None
            packed.vision_forward = depths
        yield
    finally:
        exchange._Exchange.backward, sp.SequenceParallel.rows, sp.packed_forward = saved
        packed.vision_forward = vision_forward


def cases_worker(rank: int, world: int, port: int, out: str, cases: dict) -> None:
    """Every case with groups of ``case["group"]`` consecutive ranks (default: all); a
    data-parallel group (ranks with the same place in their groups) gets the batch of its
    seed, and ``average_over="world"`` averages the gradients over every rank, as DDP."""
    launch.init(rank, world, port)
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
        launch.shutdown()


def refusals_worker(rank: int, world: int, port: int, out: str) -> None:
    """What sequence parallelism refuses, on every rank at once (no hang)."""
    from treepack import TreePack, hf, zoo

    launch.init(rank, world, port)
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
            moe = zoo.tiny_model("mixtral", seed=1, dtype=torch.float64)
            hf.prepare(moe)
            attempt("router", lambda: hf.logprobs_in_parts(moe, pack, max_tokens=8,
                                                           sequence_parallel=pair,
                                                           output_router_logits=True))
        torch.save(errors, f"{out}/rank{rank}.pt")
    finally:
        launch.shutdown()


# ----------------------------------------------------------- agreement across the group


def lora_head_model(dropout: float = 0.1):
    """A tiny Qwen2 with a PEFT LoRA adapter on its LM head, in train mode: with dropout on
    the adapter, treepack cannot read the head as one matrix."""
    import peft

    from treepack import hf

    torch.manual_seed(0)
    model = peft.get_peft_model(
        model_for({}), peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=dropout,
                                       init_lora_weights=False))
    hf.prepare(model)
    return model.train()


def mismatch_cases(rank: int):
    """Calls that differ between the ranks of a group, or that one rank refuses, by name:
    each a function of (model, pack, group) run on every rank."""
    from treepack import TreePack, hf, zoo

    r = rank
    seqs = batch("small")  # 35 rows
    loss = lambda o, m: o.logprobs.where(m, 0).sum()  # noqa: E731
    scored = lambda o: o.logprobs.sum()  # noqa: E731
    return {
        "parts budgets 9 vs 10 (backward)": lambda m, p, g: hf.backward_in_parts(
            m, p, loss, max_tokens=9 + r, sequence_parallel=g),
        "parts budgets 9 vs 10 (step)": lambda m, p, g: hf.step_in_parts(
            m, p, scored, max_tokens=9 + r, sequence_parallel=g),
        "parts budgets 9 vs 10 (scores)": lambda m, p, g: hf.logprobs_in_parts(
            m, p, max_tokens=9 + r, sequence_parallel=g),
        "parts budgets 6 vs 9": lambda m, p, g: hf.logprobs_in_parts(
            m, p, max_tokens=6 + 3 * r, sequence_parallel=g),
        "recompute": lambda m, p, g: hf.backward_in_parts(
            m, p, loss, max_tokens=9, recompute=bool(r), sequence_parallel=g),
        "call": lambda m, p, g: (hf.logprobs(m, p, sequence_parallel=g) if r == 0 else
                                 hf.logprobs_in_parts(m, p, max_tokens=9, sequence_parallel=g)),
        "temperature": lambda m, p, g: hf.logprobs(m, p, temperature=1.0 - r / 2,
                                                   sequence_parallel=g),
        "align": lambda m, p, g: hf.logprobs(m, p, align=("label", "prediction")[r],
                                             sequence_parallel=g),
        "entropy": lambda m, p, g: hf.logprobs(m, p, entropy=bool(r), sequence_parallel=g),
        "head": lambda m, p, g: hf.logprobs(m, p, head=("auto", "logits")[r],
                                            sequence_parallel=g),
        "head_dtype": lambda m, p, g: hf.logprobs(m, p, head_dtype=(None, torch.float64)[r],
                                                  sequence_parallel=g),
        "a bad keyword on one rank": lambda m, p, g: hf.logprobs(
            m, p, sequence_parallel=g, **({"output_attentions": True} if r else {})),
        "a bad temperature on one rank": lambda m, p, g: hf.logprobs(
            m, p, temperature=(1.0, -1.0)[r], sequence_parallel=g),
        "no gradients on one rank": lambda m, p, g: _maybe_no_grad(
            r == 0, lambda: hf.logprobs(m, p, sequence_parallel=g)),
        "weights seeded per rank": lambda m, p, g: hf.logprobs(
            hf.prepare(zoo.tiny_model("qwen2", seed=r, dtype=torch.float64)), p,
            sequence_parallel=g),
        "packs alike in size": lambda m, p, g: hf.logprobs(
            m, TreePack.from_sequences(seqs if r == 0 else seqs[::-1]), sequence_parallel=g),
        "images left out on one rank": lambda m, p, g: _images_call(r, g),
    }


def _maybe_no_grad(off: bool, fn):
    with torch.no_grad() if off else contextlib.nullcontext():
        return fn()


def _images_call(rank: int, group):
    from treepack import hf

    model = model_for({"family": "qwen2_vl"})
    pack, extra = inputs(model, {"batch": "images"}, 0)
    return hf.logprobs(model, pack, sequence_parallel=group, **(extra if rank == 0 else {}))


def agreement_worker(rank: int, world: int, port: int, out: str) -> None:
    """Every mismatch case on every rank (each must raise on every rank, none hang), the
    collectives an agreeing call runs before its first exchange, and head_dtype with a head
    treepack cannot read."""
    import datetime

    from treepack import TreePack, hf

    launch.init(rank, world, port, timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        group = dist.new_group(list(range(world)))
        model = model_for({})
        pack = TreePack.from_sequences(batch("small"))
        for name, call in mismatch_cases(rank).items():
            try:
                call(model, pack, group)
                results[name] = None
            except Exception as e:  # noqa: BLE001 - the test reads what was raised
                results[name] = (type(e).__name__, str(e))
        results["collectives"] = _collectives_of(
            lambda: hf.logprobs(model, pack, entropy=True, sequence_parallel=group))
        lora = lora_head_model()
        for name, g in (("head_dtype, lora head, alone", None),
                        ("head_dtype, lora head, sequence parallel", group)):
            try:
                hf.logprobs(lora, pack, head_dtype=torch.float32, sequence_parallel=g)
                results[name] = None
            except Exception as e:  # noqa: BLE001
                results[name] = (type(e).__name__, str(e))
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        launch.shutdown()


def _collectives_of(fn) -> dict:
    """How many of each collective ``fn`` ran before its first all-to-all."""
    counts = {"all_gather": 0, "all_gather_object": 0, "before_exchange": None}
    saved = {k: getattr(dist, k) for k in ("all_gather", "all_gather_object",
                                            "all_to_all_single")}

    def counted(name):
        def call(*args, **kwargs):
            if counts["before_exchange"] is None:
                counts[name] += 1
            return saved[name](*args, **kwargs)
        return call

    def exchange(*args, **kwargs):
        if counts["before_exchange"] is None:
            counts["before_exchange"] = counts["all_gather"] + counts["all_gather_object"]
        return saved["all_to_all_single"](*args, **kwargs)

    dist.all_gather, dist.all_gather_object = counted("all_gather"), counted("all_gather_object")
    dist.all_to_all_single = exchange
    try:
        fn()
    finally:
        for k, f in saved.items():
            setattr(dist, k, f)
    return counts


# ---------------------------------------------------------------- dropout under SP


def dropout_model():
    """A tiny GPT-2 with dropout on its embeddings, residuals and attention, in train mode."""
    from treepack import hf, zoo

    model = zoo.tiny_model("gpt2", seed=1, dtype=torch.float64, resid_pdrop=0.3,
                           embd_pdrop=0.3, attn_pdrop=0.3)
    hf.prepare(model)
    return model.train()


def dropout_worker(rank: int, world: int, port: int, out: str) -> None:
    """Under sequence parallelism with every rank seeded alike (what set_seed does): the
    embedding dropout masks of each rank's rows, and gradients that recomputation must
    replay exactly (activation checkpointing; parts recomputed or not; step_in_parts'
    second pass)."""
    from treepack import TreePack, hf

    launch.init(rank, world, port)
    results = {}
    try:
        group = dist.new_group(list(range(world)))
        model = dropout_model()
        pack = TreePack.from_sequences(batch("small"))
        w, _ = weights(tuple(pack.rows.shape))
        masks = []
        hook = model.transformer.drop.register_forward_hook(
            lambda module, args, output: masks.append((output == 0) & (args[0] != 0)))
        torch.manual_seed(0)
        hf.logprobs(model, pack, sequence_parallel=group)
        hook.remove()
        results["mask"] = masks[-1][0]  # the first is check_lm_head's own 3-token forward

        def grads(fn):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            fn()
            return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

        linear = lambda o, m: (o.logprobs * w).where(m, 0).sum()  # noqa: E731
        whole = lambda: (hf.logprobs(model, pack, sequence_parallel=group).logprobs  # noqa: E731
                         * w).sum().backward()
        results["whole"] = grads(whole)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        results["whole, checkpointed"] = grads(whole)
        model.gradient_checkpointing_disable()
        for recompute in (False, True):
            results[f"parts, recompute={recompute}"] = grads(lambda: hf.backward_in_parts(
                model, pack, linear, max_tokens=9, recompute=recompute, sequence_parallel=group))
        results["step in parts"] = grads(lambda: hf.step_in_parts(
            model, pack, lambda o: (o.logprobs * w).sum(), max_tokens=9,
            sequence_parallel=group))
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        launch.shutdown()
