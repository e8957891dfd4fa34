"""Trees larger than one forward, run in parts (treepack.planning.parts, treepack.hf.parts):
every row computed once, log-probs and gradients those of one forward over the whole tree
(float64, to rounding) and of every sequence alone."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import forests

from treepack import hf, zoo
from treepack.planning.parts import split
from treepack.planner import plan
from treepack.tree import TreePack

from reference import exact_kernel
from tolerance import (
    FLOAT32_INSIDE,
    assert_within,
    inside,
    negative_control,
    rounding,
    within,
)


def check_parts(pack, max_rows):
    parts = split(pack, max_rows)
    h = pack.host
    seen = np.zeros(pack.num_rows, dtype=int)
    for i, part in enumerate(parts.parts):
        assert 0 < part.rows.shape[0] <= max_rows
        assert (np.diff(part.rows) > 0).all()
        seen[part.rows] += 1
        # every row's parent was computed by this part or one above it in the part tree
        above = {i}
        j = part.parent
        while j >= 0:
            above.add(j)
            j = parts.parts[j].parent
        assert j == -1
        parents = h.parent_row[part.rows]
        assert all(parts.part_of[r] in above for r in parents[parents >= 0])
        assert part.parent < i  # a parent part runs first
    assert (seen == 1).all()
    assert parts.rows_computed == pack.num_rows
    return parts


@settings(max_examples=150, deadline=None)
@given(forests(max_sequences=10, max_len=20), st.integers(1, 30))
def test_every_row_in_one_part_under_its_ancestors(seqs, max_rows):
    check_parts(TreePack.from_sequences(seqs), max_rows)


def test_a_long_context_group_is_computed_once_not_per_pack():
    """The issue's shape: an 8,192-token prompt and 16 responses of 2-4k at 16,384 rows a
    forward. Splitting repeats the prompt in every pack; parts compute the tree's rows."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 1000, 8192)
    seqs = [np.concatenate([prompt, rng.integers(3, 1000, rng.integers(2048, 4097))])
            for _ in range(16)]
    pack = TreePack.from_sequences(seqs)
    parts = check_parts(pack, 16384)
    repeated = plan(seqs, max_tokens=16384).packed_rows
    assert parts.rows_computed == pack.num_rows < 0.6 * repeated
    trunk = parts.parts[0]
    assert trunk.rows.shape[0] == 8192 and trunk.parent == -1
    assert all(p.parent == 0 for p in parts.parts[1:])


def test_a_trajectory_longer_than_a_forward_is_a_chain_of_parts():
    steps, history, seqs = 6, [1, 2, 3], []
    rng = np.random.default_rng(1)
    for _ in range(steps):
        history = history + rng.integers(3, 50, 9).tolist()
        seqs.append(history + rng.integers(3, 50, 3).tolist())  # a side branch per step
    parts = check_parts(TreePack.from_sequences(seqs), 12)
    depth = []
    for part in parts.parts:
        d, j = 0, part.parent
        while j >= 0:
            d, j = d + 1, parts.parts[j].parent
        depth.append(d)
    assert max(depth) >= 3  # cuts three levels deep


def test_split_refuses_padding_and_bad_budgets():
    with pytest.raises(ValueError, match="padding rows"):
        split(TreePack.from_sequences([[1, 2, 3]], pad_to_multiple_of=8), 4)
    with pytest.raises(ValueError, match="max_rows=0"):
        split(TreePack.from_sequences([[1, 2, 3]]), 0)


# ------------------------------------------------------------------------ on a model

def batches():
    """Forests with 1, 2 and 3 levels of cuts at the budgets used: GRPO groups with a
    prompt longer than the budget's share, agent steps extending each other, duplicates,
    a sequence that is a prefix of another, a single token."""
    g = np.random.default_rng(2)

    def tokens(n):
        return g.integers(3, 90, n).tolist()

    prompt = tokens(26)
    grpo = [prompt + tokens(int(g.integers(1, 14))) for _ in range(6)]
    grpo += [grpo[0], prompt[:9], [7]]
    history, agent = tokens(8), []
    for _ in range(4):
        history = history + tokens(7)
        agent.append(history + tokens(int(g.integers(1, 5))))
    return grpo + agent


def model_of(family):
    model = zoo.tiny_model(family, layers=2).double()
    return hf.prepare(model)


def whole_tree(model, seqs, weights):
    pack = TreePack.from_sequences(seqs)
    model.zero_grad()
    out = hf.logprobs(model, pack, entropy=True, head="hidden")
    loss = loss_of(weights)(out, pack.prediction_mask)
    loss.backward()
    return out, loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def loss_of(weights):
    def loss_fn(out, mask):  # a sum over predictions, as gradient accumulation needs
        return (-(out.logprobs * weights) + 0.01 * out.entropy).where(mask, 0).sum() / 100
    return loss_fn


def loss_tolerance(rel, want, weights):
    """loss_of's sum, each term ``rel`` of the log-probs' (entropies') size off: ``rel`` of
    its terms' total size."""
    size = (want.logprobs.abs().max() * weights.abs() + 0.01 * want.entropy.abs().max()).sum()
    return rel * float(size.detach()) / 100


def relative(got, want):
    return max(float((got[k] - w).abs().max() / w.abs().max().clamp_min(1e-300))
               for k, w in want.items())


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "llama"])
@pytest.mark.parametrize("max_tokens", [1000, 40, 16, 7])
def test_parts_equal_one_forward_over_the_tree(family, max_tokens):
    """qwen2 has a sliding window on one layer, gemma2 windows and soft-capping; 1000 rows
    is one part, 7 cuts the GRPO prompt and the agent history into chains of parts."""
    model = model_of(family)
    got, want_grads = parts_against_one_forward(model, max_tokens)
    assert (got.parts == 1) == (max_tokens == 1000)
    grads = {k: p.grad for k, p in model.named_parameters()}
    # the models' RMSNorm computes in float32 even in a float64 model: its backward rounds
    # every gradient through it to float32, and Gemma's weights' gradients sum rows in float32,
    # grouped by part
    assert within(relative(grads, want_grads), inside(model, grads=True))


@pytest.mark.parametrize("max_tokens", [40, 7])
def test_attention_sinks_in_parts_equal_one_forward(max_tokens):
    """GPT-OSS: its sinks (s_aux) are one more key each part adds to its own attention (the
    sink is no row: nothing carries it), across its sliding and full layers and its MoE."""
    import tiny_models

    model = hf.prepare(tiny_models.gpt_oss(torch.float64))
    got, want_grads = parts_against_one_forward(model, max_tokens)
    assert got.parts > 2
    grads = {k: p.grad for k, p in model.named_parameters()}
    assert within(relative(grads, want_grads), inside(model, grads=True))
    assert all(layer.self_attn.sinks.grad.abs().min() > 0 for layer in model.model.layers)


@pytest.mark.parametrize("family, max_tokens", [("qwen2", 40), ("llama", 7), ("gpt_oss", 7),
                                                 ("qwen3_5", 7)])
def test_parts_on_varlen_equal_one_forward(family, max_tokens, monkeypatch):
    """backend="varlen": each part's chains against its context's keys and its own in one
    varlen call (its exact CPU reference here): a sliding window (qwen2), GPT-OSS's sinks
    through the kernel's log-sum-exp, a Gated DeltaNet hybrid's attention layers. Soft-capping
    (Gemma 2) is refused by name."""
    import tiny_models

    if family == "gpt_oss":
        model = hf.prepare(tiny_models.gpt_oss(torch.float64))
    elif family == "qwen3_5":
        model = hybrid_of(family, monkeypatch)
    else:
        model = model_of(family)
    got, want_grads = parts_against_one_forward(model, max_tokens, backend="varlen")
    assert got.parts > 1
    if family == "qwen3_5":
        check_hybrid_gradients(model, want_grads)
    else:
        grads = {k: p.grad for k, p in model.named_parameters()}
        assert within(relative(grads, want_grads), inside(model, grads=True))
    with pytest.raises(RuntimeError, match="no logit soft-capping"):
        hf.logprobs_in_parts(model_of("gemma2"), batches(), max_tokens=7, backend="varlen")
    with pytest.raises(ValueError, match="backend='fast' is not a treepack attention backend"):
        hf.logprobs_in_parts(model, batches(), max_tokens=7, backend="fast")


def test_parts_log_what_auto_attends_on_once(caplog):
    import logging

    from treepack import attention

    attention._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="treepack"):
        hf.logprobs_in_parts(model_of("llama"), batches(), max_tokens=7)
    assert [r.getMessage() for r in caplog.records].count(
        "treepack parts: backend='auto' attends on 'segment' (on cpu, where varlen and flex "
        "cannot train)") == 1


@pytest.mark.parametrize("max_tokens, backend", [(40, "auto"), (7, "auto"), (7, "varlen")])
def test_chunked_attention_in_parts_equals_one_forward(max_tokens, backend, monkeypatch):
    """Llama 4: chunked attention within chunks of 5 depths and the no-rope layer's
    temperature at each row's depth, in parts: on segment the chains hold whole ancestries;
    on varlen they are cut at chunk starts, their context from their chunk's first depth."""
    import tiny_models

    tiny_models.llama4_in_float64(monkeypatch)
    model = hf.prepare(tiny_models.llama4_text(torch.float64))
    got, want_grads = parts_against_one_forward(model, max_tokens, backend=backend)
    assert got.parts > 2
    grads = {k: p.grad for k, p in model.named_parameters()}
    assert within(relative(grads, want_grads), inside(model, grads=True))


def parts_against_one_forward(model, max_tokens, rel=None, backend="auto"):
    """backward_in_parts and logprobs_in_parts on :func:`batches` against one forward over
    the whole tree: log-probs, entropies and loss to rounding (``rel`` of their size; by
    default ``tolerance.inside(model)``), every row once. Returns the parts' result (their
    gradients in the model) and the whole tree's gradients."""
    rel = inside(model) if rel is None else rel
    seqs = batches()
    weights = torch.randn(TreePack.from_sequences(seqs).rows.shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(3))
    want, want_loss, want_grads = whole_tree(model, seqs, weights)
    model.zero_grad()
    got = hf.backward_in_parts(model, seqs, loss_of(weights), max_tokens=max_tokens,
                               entropy=True, backend=backend)
    assert got.rows == TreePack.from_sequences(seqs).num_packed_rows
    assert_within(got.logprobs, want.logprobs.detach(), rel)
    assert_within(got.entropy, want.entropy.detach(), rel)
    torch.testing.assert_close(got.loss, want_loss, rtol=0, atol=loss_tolerance(rel, want, weights))
    forward_only = hf.logprobs_in_parts(model, seqs, max_tokens=max_tokens, entropy=True,
                                        backend=backend)
    assert_within(forward_only.logprobs, want.logprobs.detach(), rel)
    return got, want_grads


def test_parts_take_one_temperature_per_sequence():
    """Duplicates and siblings at different temperatures: each normalised once per
    (row, temperature), as one forward over the tree."""
    model, seqs = model_of("llama"), batches()
    temps = 0.5 + torch.arange(len(seqs)) % 3 / 2
    pack = TreePack.from_sequences(seqs)
    want = hf.logprobs(model, pack, entropy=True, head="hidden", temperature=temps)
    got = hf.logprobs_in_parts(model, seqs, max_tokens=7, entropy=True, temperature=temps)
    assert_within(got.logprobs, want.logprobs.detach(), inside(model))
    assert_within(got.entropy, want.entropy.detach(), inside(model))


def test_parts_in_verls_alignment_equal_one_forward():
    """align="prediction": at p the log-prob of token p + 1, and the entropy at every
    position, the last one's from its own row; the loss sees every position."""
    model, seqs = model_of("qwen2"), batches()
    pack = TreePack.from_sequences(seqs)
    weights = torch.randn(pack.rows.shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(6))
    model.zero_grad()
    want = hf.logprobs(model, pack, entropy=True, head="hidden", align="prediction")
    valid = pack.rows >= 0
    loss_of(weights)(want, valid).backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    masks = []
    got = hf.backward_in_parts(model, seqs, lambda o, m: masks.append(m) or loss_of(weights)(o, m),
                               max_tokens=7, entropy=True, align="prediction")
    assert torch.equal(sum(m.int() for m in masks), valid.int())  # every position once
    assert_within(got.logprobs, want.logprobs.detach(), inside(model))
    assert_within(got.entropy, want.entropy.detach(), inside(model))
    assert within(relative({k: p.grad for k, p in model.named_parameters()}, want_grads),
                  inside(model, grads=True))


def test_parts_equal_every_sequence_alone_and_step_alike():
    """Against the model run on each sequence by itself (its own attention), and one SGD
    step on each: the parameters agree."""
    seqs = batches()
    weights = torch.randn(TreePack.from_sequences(seqs).rows.shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(4))
    alone, parted = model_of("qwen2"), model_of("qwen2")
    loss = 0.0
    for i, s in enumerate(seqs):
        ids = torch.tensor([s])
        logits = alone(ids).logits[0]
        if len(s) > 1:
            logp = logits[:-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
            ent = -(logits[:-1].log_softmax(-1).exp() * logits[:-1].log_softmax(-1)).sum(-1)
            term = (-(logp * weights[i, 1:len(s)]) + 0.01 * ent).sum() / 100
            term.backward()
            loss += float(term.detach())
    got = hf.backward_in_parts(parted, seqs, loss_of(weights), max_tokens=7, entropy=True)
    # a sum of log-probs and entropies of a float64 model with float32 norms
    assert within(abs(float(got.loss) - loss), inside(alone) * abs(loss))
    grads = {k: p.grad for k, p in parted.named_parameters()}
    assert within(relative(grads, {k: p.grad for k, p in alone.named_parameters()}),
                  inside(alone, grads=True))
    for model in (alone, parted):
        torch.optim.SGD(model.parameters(), lr=1.0).step()
    for (k, a), (_, b) in zip(alone.named_parameters(), parted.named_parameters()):
        # the step moves each by its gradient (lr 1): their difference, and a rounding each
        allowed = (inside(alone, grads=True) * float(a.grad.abs().max())
                   + rounding(torch.float64, a, steps=2))
        assert within((b - a).detach().abs().max(), allowed), k


def test_parts_refuse_what_they_cannot_run_exactly():
    seqs = [[1, 2, 3, 4], [1, 2, 5]]
    model = zoo.tiny_model("llama", layers=2)
    with pytest.raises(ValueError, match="not prepared"):
        hf.logprobs_in_parts(model, seqs, max_tokens=2)
    hf.prepare(model).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(hf.UnsupportedModel, match="use_reentrant"):
        hf.backward_in_parts(model, seqs, lambda out, mask: out.logprobs.sum(), max_tokens=2)


def test_parts_under_activation_checkpointing_equal_one_forward(monkeypatch):
    """transformers' (non-reentrant) activation checkpointing recomputes each layer in its
    part's backward; the keys and values kept are the first forward's."""
    from treepack.forwards import carried

    calls = []
    put = carried.Carried.put
    monkeypatch.setattr(carried.Carried, "put",
                        lambda self, *a: calls.append(a[0]) or put(self, *a))
    seqs = batches()
    weights = torch.randn(TreePack.from_sequences(seqs).rows.shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(5))
    model = model_of("qwen2").train()
    want, _, want_grads = whole_tree(model, seqs, weights)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.zero_grad()
    got = hf.backward_in_parts(model, seqs, loss_of(weights), max_tokens=7, entropy=True)
    assert len(calls) > 2 * got.parts  # 2 layers a forward, and recomputed in backward
    assert_within(got.logprobs, want.logprobs.detach(), inside(model))
    assert within(relative({k: p.grad for k, p in model.named_parameters()}, want_grads),
                  inside(model, grads=True))


# Random forests (forks, prefixes, duplicates, several trees) at random budgets: parts'
# log-probs and entropies equal one forward over the whole tree. qwen2 has a sliding window
# of 6 on one layer. Qwen3.5 (convolutions, scans and attention) runs its scan in float64
# (exact_kernel; transformers' own computes in float32, chunked by where each batch starts,
# FLOAT32_OP of the log-probs, 1.4e-4): both models keep their norms' float32 steps
# (FLOAT32_INSIDE, 9e-6); with the states at cuts lost, the smallest forest hypothesis finds
# is 7e-5 off.
@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
@settings(max_examples=40, deadline=None)
@given(forests(vocab=4, max_sequences=8, max_len=16), st.integers(1, 24))
def test_any_forest_at_any_budget_equals_one_forward(family, seqs, max_rows):
    seqs = [[t + 3 for t in s] for s in seqs]
    with pytest.MonkeyPatch.context() as patch:  # the kernel swapped for this example only
        model = (zoo.tiny_model("qwen2", layers=2).double() if family == "qwen2" else
                 zoo.tiny_model("qwen3_5", layers=4, dtype=torch.float64))
        exact_kernel(patch, model)
        with hf.prepared(model):
            assert inside(model) == FLOAT32_INSIDE
            want = hf.logprobs(model, TreePack.from_sequences(seqs), entropy=True, head="hidden")
            got = hf.logprobs_in_parts(model, seqs, max_tokens=max_rows, entropy=True)
    assert_within(got.logprobs, want.logprobs, FLOAT32_INSIDE)
    assert_within(got.entropy, want.entropy, FLOAT32_INSIDE)


# ------------------------------------------------------------------------ hybrid models

def hybrid_of(family, monkeypatch):
    model = zoo.tiny_model(family, layers=4, dtype=torch.float64)
    exact_kernel(monkeypatch, model)  # the gated delta rule in float64, not float32
    return hf.prepare(model)


def check_hybrid_gradients(model, want_grads):
    """These families compute in float32 even in a float64 model (RMSNorm, the decay
    A = -exp(A_log.float()), dt's softplus, Mamba2's chunked scan, Mamba (v1)'s B.float(),
    Kimi-Linear's forget gate): the backward of each float32 step rounds the gradients
    through it, so every gradient is float32-accurate (``tolerance.inside``)."""
    grads = {k: p.grad for k, p in model.named_parameters() if k in want_grads}
    assert within(relative(grads, want_grads), inside(model, grads=True))


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "bamba"])
@pytest.mark.parametrize("max_tokens", [40, 7, 1])
def test_hybrid_parts_equal_one_forward_over_the_tree(family, max_tokens, monkeypatch):
    """Gated DeltaNet (qwen3_5), short convolutions alone (lfm2) and Mamba2 (bamba), beside
    attention: a part's convolutions read the inputs of the K - 1 rows above each cut from
    the parts that computed them, its scans start from the state those parts ended at. At
    1 row a part, every row is a cut. float64 with float32 steps inside (Kimi-Linear's float32
    forget gate turns the parts' float64 differences into float32 ones)."""
    model = hybrid_of(family, monkeypatch)
    got, want_grads = parts_against_one_forward(model, max_tokens)
    assert got.parts > 1
    check_hybrid_gradients(model, want_grads)


@pytest.mark.parametrize("family", ["qwen3_next", "olmo_hybrid", "lfm3", "nemotron_h",
                                    "falcon_h1", "jamba", "falcon_mamba", "zamba",
                                    "kimi_linear", "minimax"])
def test_every_routed_hybrid_runs_in_parts(family, monkeypatch):
    """The other routed families (falcon_h1 attends and scans in one layer; Mamba (v1) in
    jamba, falcon_mamba and zamba, whose layers scan once per Mamba head) at 7 rows a
    part."""
    test_hybrid_parts_equal_one_forward_over_the_tree(family, 7, monkeypatch)


def test_hybrid_parts_under_activation_checkpointing(monkeypatch):
    """A recomputed layer finds what its first forward kept, by its convolution's weight."""
    model = hybrid_of("qwen3_5", monkeypatch).train()
    seqs = batches()
    weights = torch.randn(TreePack.from_sequences(seqs).rows.shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(5))
    want, _, want_grads = whole_tree(model, seqs, weights)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.zero_grad()
    got = hf.backward_in_parts(model, seqs, loss_of(weights), max_tokens=7, entropy=True)
    assert_within(got.logprobs, want.logprobs.detach(), inside(model))
    check_hybrid_gradients(model, want_grads)


def test_hybrid_parts_equal_every_sequence_alone(monkeypatch):
    """Against the model on each sequence alone (its own convolution and scan): the
    reference that cannot share the tree's bugs."""
    seqs = batches()
    weights = torch.randn(TreePack.from_sequences(seqs).rows.shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(4))
    alone, parted = hybrid_of("qwen3_5", monkeypatch), hybrid_of("qwen3_5", monkeypatch)
    for i, s in enumerate(seqs):  # a prepared model given no pack runs as it would unprepared
        ids = torch.tensor([s])
        if len(s) > 1:
            logp = alone(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])
            (-(logp[:, 0] * weights[i, 1:len(s)]).sum() / 100).backward()
    got = hf.backward_in_parts(parted, seqs, lambda o, m: -(o.logprobs * weights).where(
        m, 0).sum() / 100, max_tokens=5)
    assert got.parts > 10
    want = {k: p.grad for k, p in alone.named_parameters() if p.grad is not None}
    check_hybrid_gradients(parted, want)


@pytest.mark.parametrize("broken", ["zero_state", "no_conv_context", "no_state_backward"])
def test_hybrid_parts_fail_without_what_cuts_carry(broken, monkeypatch):
    """Negative controls: scans restarting from zeros at a cut, convolutions reading zeros
    above it, or the states' gradients never reaching the part that made them."""
    from treepack.forwards import carried, mixers

    if broken == "zero_state":
        scan = mixers.scan_levels
        monkeypatch.setattr(mixers, "scan_levels",
                            lambda plan, kernel, inputs, initial: scan(plan, kernel, inputs))
    elif broken == "no_conv_context":
        gather = carried.Carried.gather

        def zero_inputs(self, key, grouped, dim):
            got = gather(self, key, grouped, dim)
            conv = isinstance(key, tuple) and key[0] == "conv"
            return [torch.zeros_like(t) for t in got] if got and conv else got
        monkeypatch.setattr(carried.Carried, "gather", zero_inputs)
    else:
        put = carried.Carried.put

        def states_without_graph(self, i, key, *tensors):
            if isinstance(key, tuple) and key[0] == "scan":
                tensors = tuple(t.detach() for t in tensors)
            put(self, i, key, *tensors)
        monkeypatch.setattr(carried.Carried, "put", states_without_graph)
    with pytest.raises(AssertionError), negative_control():
        test_hybrid_parts_equal_one_forward_over_the_tree("qwen3_5", 7, monkeypatch)


# ------------------------------------------------------------------------ recompute

def trajectory(steps=8, seed=7):
    """An agent trajectory whose steps extend each other: at 12 rows a part, a chain of trunk
    parts, each with the step's answer hanging off it."""
    g = np.random.default_rng(seed)
    history, out = g.integers(3, 90, 6).tolist(), []
    for _ in range(steps):
        history = history + g.integers(3, 90, 9).tolist()
        out.append(history + g.integers(3, 90, 3).tolist())
    return out


class SavedBytes:
    """The bytes autograd holds for backward, alive at once: their peak over a call."""

    def __init__(self):
        self.alive = self.peak = 0

    def __enter__(self):
        meter = self

        class Held:
            def __init__(self, t):
                self.t, self.size = t, t.numel() * t.element_size()
                meter.alive += self.size
                meter.peak = max(meter.peak, meter.alive)

            def __del__(self):
                meter.alive -= self.size

        self.hooks = torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_recomputed_parts_hold_fewer_activations_and_equal_one_forward(family, monkeypatch):
    """A chain of trunk parts keeps every one's activations until its backward; recomputing
    the parts with grandchildren ("auto") or all with children (True) holds about two parts'
    at once and runs one more forward per recomputed part, with the same result."""
    model = model_of("qwen2") if family == "qwen2" else hybrid_of("qwen3_5", monkeypatch)
    seqs = trajectory()
    weights = torch.randn(TreePack.from_sequences(seqs).rows.shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(8))
    want, want_loss, want_grads = whole_tree(model, seqs, weights)
    forwards, peaks = {}, {}
    real_forward = model.forward
    for recompute in (False, "auto", True):
        calls = []
        monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or
                            real_forward(*a, **k))
        model.zero_grad()
        with SavedBytes() as saved:
            got = hf.backward_in_parts(model, seqs, loss_of(weights), max_tokens=12,
                                       entropy=True, recompute=recompute)
        forwards[recompute], peaks[recompute] = len(calls), saved.peak
        torch.testing.assert_close(got.loss, want_loss, rtol=0,
                                   atol=loss_tolerance(inside(model), want, weights))
        check_hybrid_gradients(model, want_grads)
    trunks = sum(1 for p in split(TreePack.from_sequences(seqs), 12).parts
                 if p.rows.shape[0] == 12)
    assert trunks >= 6 and forwards[False] == got.parts
    assert forwards[False] < forwards["auto"] < forwards[True] <= 2 * got.parts
    assert peaks["auto"] < peaks[False] / 2 and peaks[True] <= peaks["auto"], peaks


def test_recomputed_parts_draw_the_same_dropout_masks():
    """Dropout on: a recomputed part's second forward replays the first's masks, so every
    gradient equals the run that keeps its activations."""
    model = hf.prepare(zoo.tiny_model("qwen2", layers=2, attention_dropout=0.3).double())
    model.train()
    seqs = trajectory()
    grads = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model.zero_grad()
        hf.backward_in_parts(model, seqs, lambda o, m: o.logprobs.where(m, 0).sum(),
                             max_tokens=12, recompute=recompute)
        grads[recompute] = {k: p.grad.clone() for k, p in model.named_parameters()}
    assert relative(grads[True], grads[False]) == 0


def test_recompute_names_its_choices():
    with pytest.raises(ValueError, match="recompute='always'"):
        hf.backward_in_parts(model_of("llama"), [[1, 2, 3]], lambda o, m: o.logprobs.sum(),
                             max_tokens=2, recompute="always")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_collate_keeps_trees_whole_and_its_batches_run_in_parts(mode):
    """The documented loop for custom trainers: collate(parts=True) at a budget smaller than
    every GRPO group keeps each group in one batch, and hf.step_in_parts on each batch's pack
    with the clipped policy loss (the step's denominators) gives the gradients of one forward
    per batch at an unlimited budget; so does hf.backward_in_parts for a token mean (a sum
    over predictions), masked to each part's."""
    import treepack
    from treepack import losses

    g = np.random.default_rng(9)
    rollouts = []
    for group in range(3):
        prompt = g.integers(3, 90, 20)
        for _ in range(4):
            n = int(g.integers(3, 9))
            rollouts.append({"prompt": prompt, "completion": g.integers(3, 90, n),
                             "group": group, "old_logps": -g.random(n) * 3,
                             "loss_mask": (g.random(n) < 0.8).astype(np.int64),
                             "advantage": float(g.normal())})
    model = model_of("qwen2")

    def run(step, how):
        den = step.denominators()
        model.zero_grad()
        for batch in step.batches():
            def loss_fn(out, mask=True):
                return losses.policy_loss(out.logprobs, batch.fields["old_logps"],
                                          batch.fields["advantage"], batch.mask & mask,
                                          mode=mode, denominators=den).loss
            if how == "backward_in_parts":  # the loss as a sum over each part's predictions
                hf.backward_in_parts(model, batch.pack, loss_fn, max_tokens=16)
            elif how == "step_in_parts":  # the loss of the whole batch
                hf.step_in_parts(model, batch.pack, loss_fn, max_tokens=16)
            else:
                loss_fn(hf.logprobs(model, batch.pack, head="hidden")).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    step = treepack.collate(rollouts, max_tokens=16, parts=True)
    assert len(step.batches()) < 3 or all(len(set(b.groups)) == 1 for b in step.batches())
    assert sorted(len(set(b.groups) & {gr}) for b in step.batches() for gr in range(3)
                  if gr in b.groups) == [1, 1, 1]  # every group in exactly one batch
    want = run(treepack.collate(rollouts, max_tokens=10_000), "one forward")
    allowed = inside(model, grads=True)  # float64, gradients through float32 norms
    assert within(relative(run(step, "step_in_parts"), want), allowed)
    # a per-sequence mean is not a sum over each part's predictions: a part would divide by
    # its own share of the sequence's tokens (the reason step_in_parts exists)
    error = relative(run(step, "backward_in_parts"), want)
    assert within(error, allowed) if mode == "token-mean" else error > 1e-3
    with pytest.raises(ValueError, match="pad_to_multiple_of=8 with parts=True"):
        treepack.collate(rollouts, max_tokens=16, parts=True, pad_to_multiple_of=8)
