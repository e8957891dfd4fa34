"""Hybrid models (Gated DeltaNet, short-convolution and attention layers) on a tree: every
log-prob and every gradient equal to each sequence run alone."""

import copy
import sys

import pytest
import torch

from treepack import TreePack, hf, zoo
from treepack.recurrent import level_chunk

from reference import exact_kernel
from tolerance import (
    FLOAT32_INSIDE,
    FLOAT32_OP,
    FLOAT32_RELATIVE,
    FLOAT64_EXACT,
    assert_within,
    inside,
    low_precision,
    negative_control,
    scale,
    within,
)

GDN = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "kimi_linear"]
MAMBA2 = ["bamba", "nemotron_h", "falcon_h1"]
MAMBA = ["jamba", "falcon_mamba", "zamba"]  # Mamba (v1): the selective scan
FAMILIES = [*GDN, "lfm2", "lfm3", *MAMBA2, *MAMBA, "minimax"]  # minimax: lightning


def batch(vocab=zoo.VOCAB, seed=0):
    """Prompts longer than the scan's chunk (64), forks inside a chunk and at row 1,
    duplicates, a sequence that is a prefix of another, single tokens, agent steps."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompt = ids(70)
    steps = [ids(9)]
    for _ in range(2):
        steps.append(steps[-1] + ids(4))
    return [prompt + ids(5), prompt + ids(9), prompt + ids(1), prompt[:30], prompt + ids(5)[:0],
            prompt[:50] + ids(3), [7], [7, 8, 9], [7, 10], prompt[:30], *steps]


def alone(model, seq):
    """log p(seq[p] | seq[:p]) for p >= 1, the model on the sequence alone."""
    ids = torch.tensor([seq])
    if len(seq) == 1:
        return torch.zeros(0, dtype=torch.float64)
    logits = model(input_ids=ids).logits[0]  # float32 at least, as treepack normalises them
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].double()


def packed_values(out, pack, s, n):
    return out[s, 1:n] if pack.layout == "dense" else out[pack.offsets[s] + 1:pack.offsets[s] + n]


def unpacked_run(family, monkeypatch, seqs, weights):
    """Log-probs of each sequence alone and the parameter gradients of their weighted sum."""
    model = zoo.tiny_model(family, dtype=torch.float64, layers=4)
    exact_kernel(monkeypatch, model)
    logps = [alone(model, s) for s in seqs]
    sum((lp * w).sum() for lp, w in zip(logps, weights)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return model, [lp.detach() for lp in logps], grads


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["dense", "flat"])
def test_hybrid_logprobs_and_gradients_equal_each_sequence_alone(family, layout, monkeypatch):
    """Float64, against each sequence alone. transformers computes these models' norms,
    gates and decays in float32 even in float64 models, so float64 is float32-accurate there
    (the Gated DeltaNet scans run in float64, reference.exact_kernel): log-probs within
    tolerance.inside of their size (FLOAT32_OP where a float32 scan remains or the head casts
    its logits to float32 and ``alone`` takes their log-softmax in float32), gradients within
    FLOAT32_RELATIVE of each tensor's largest (the backward of a float32 cast rounds every
    gradient through it)."""
    seqs = batch()
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(len(s) - 1, generator=g, dtype=torch.float64) for s in seqs]
    model, want_lp, want = unpacked_run(family, monkeypatch, seqs, weights)
    with torch.no_grad():  # a head that casts its logits to float32 (Falcon-Mamba's .float())
        logits = model(input_ids=torch.tensor([seqs[0]])).logits
    rel_lp = inside(model) if logits.dtype == torch.float64 else FLOAT32_OP
    lp_tol = rel_lp * max(scale(lp) for lp in want_lp)
    with hf.prepared(model):
        pack = TreePack.from_sequences(seqs, layout=layout, pad_to_multiple_of=16)
        out = hf.logprobs(model, pack, head="logits").logprobs
        loss = 0
        for s, seq in enumerate(seqs):
            got = packed_values(out, pack, s, len(seq))
            assert got.numel() == 0 or within((got.detach() - want_lp[s]).abs().max(), lp_tol), s
            loss = loss + (got * weights[s]).sum()
        loss.backward()
    for name, w in want.items():
        assert within(rel(model.get_parameter(name).grad, w), FLOAT32_RELATIVE), name


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_hybrid_float32_with_transformers_own_kernels_is_within_the_unpacked_error(
        family, monkeypatch):
    """No kernel swapped: transformers' chunked scan (float32 inside) on the tree; the packed
    error against a float64 run of the same weights (its scan in float64) stays within twice
    the unpacked float32 run's. (The float64 run was a tiny_model of its own dtype, whose
    random weights differ from the float32 one's: both errors were 0.64, and the check
    vacuous.)"""
    model32 = zoo.tiny_model(family, dtype=torch.float32, layers=4)
    model64 = copy.deepcopy(model32).double()
    seqs = batch(seed=2)
    with torch.no_grad():
        with monkeypatch.context() as m:
            exact_kernel(m, model64)
            ref = [alone(model64, s) for s in seqs]
        own = max(float((alone(model32, s) - r).abs().max()) for s, r in zip(seqs, ref)
                  if len(s) > 1)
        with hf.prepared(model32):
            pack = TreePack.from_sequences(seqs)
            out = hf.logprobs(model32, pack).logprobs
        packed = max(float((packed_values(out, pack, s, len(seq)) - r).abs().max())
                     for s, (seq, r) in enumerate(zip(seqs, ref)) if len(seq) > 1)
    # the rule for low precision: within twice the unpacked run's own error. Below
    # FLOAT32_INSIDE of the log-probs' size an error counts as rounding: a float32 log-prob is
    # that far from float64 at best (the last norm, the head's sums, the log-softmax)
    floor = FLOAT32_INSIDE * max(scale(r) for r in ref)
    assert low_precision(packed, max(own, floor)), (packed, own)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_moe_router_loss_counts_original_tokens(family, monkeypatch):
    model = zoo.tiny_model(family, dtype=torch.float64, layers=2)
    exact_kernel(monkeypatch, model)
    seqs = batch()[:4]
    L = max(map(len, seqs))
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        with hf.prepared(model):
            got = hf.logprobs(model, TreePack.from_sequences(seqs),
                              output_router_logits=True).aux_loss
    # the router loss is one float32 operation (a softmax and means over the rows)
    torch.testing.assert_close(got, want, rtol=FLOAT32_OP, atol=0)


@pytest.mark.parametrize("family", ["qwen3_5", "falcon_mamba"])
def test_a_scan_that_forgets_its_parent_state_is_caught(family, monkeypatch):
    """A negative control: the equivalence fails when segments start from zero states."""
    from treepack.forwards import mixers

    real = mixers.level_scan

    def zero_states(pack, kernel, inputs):
        return real(pack, lambda batch, state: kernel(batch, None), inputs)

    monkeypatch.setattr(mixers, "level_scan", zero_states)
    with pytest.raises(AssertionError), negative_control():
        test_hybrid_logprobs_and_gradients_equal_each_sequence_alone(family, "flat",
                                                                     monkeypatch)


def test_restore_puts_the_modeling_functions_back():
    """Routing is counted per prepared model: the functions stay routed while one holds them
    and are exactly what was there before once the last is restored."""
    from treepack.adapters.hf import routing

    model = zoo.tiny_model("qwen3_5")
    module = sys.modules[type(model.model.layers[0]).__module__]
    before = module.torch_chunk_gated_delta_rule, module.causal_conv1d_fn
    held_before = +routing._HOLDERS  # models prepared by earlier tests and never restored
    other = zoo.tiny_model("qwen3_5", seed=1)
    hf.prepare(model)
    hf.prepare(other)
    assert hasattr(module.torch_chunk_gated_delta_rule, "treepack_original")
    hf.restore(model)  # the other model still needs them routed
    assert hasattr(module.torch_chunk_gated_delta_rule, "treepack_original")
    hf.restore(other)
    assert (module.torch_chunk_gated_delta_rule, module.causal_conv1d_fn) == before
    assert +routing._HOLDERS == held_before
    if not held_before:
        assert not hasattr(before[0], "treepack_original")  # the originals themselves


def test_a_layer_that_bypasses_the_routed_functions_is_refused(monkeypatch):
    model = hf.prepare(zoo.tiny_model("qwen3_5"))
    module = sys.modules[type(model.model.layers[0]).__module__]
    routed = module.torch_chunk_gated_delta_rule
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", routed.treepack_original)
    try:
        with pytest.raises(hf.UnsupportedModel, match="gated_delta"):
            hf.forward(model, TreePack.from_sequences([[5, 6, 7], [5, 6, 8]]))
    finally:
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", routed)
        hf.restore(model)


def test_hybrids_not_routed_yet_are_refused_by_name():
    from treepack.face.census import _tiny_model

    model = _tiny_model("deepseek_v4", torch.float32)  # its compressed attention layers
    with pytest.raises(hf.UnsupportedModel, match="deepseek_v4.*compressed.*not ones"):
        hf.prepare(model)
    assert not hf.is_prepared(model)


def test_auto_head_falls_back_when_the_model_changes_its_heads_output():
    """Nemotron-H casts its logits (``.float()``): in a float64 model that is a new tensor, so
    the head inside the forward cannot hand its values through. ``head="inside"`` refuses;
    ``auto`` finds out once, remembers it, and uses the logits."""
    model = hf.prepare(zoo.tiny_model("nemotron_h", dtype=torch.float64))
    pack = TreePack.from_sequences(batch()[:5])
    with pytest.raises(hf.UnsupportedModel, match="changes the output of its head"):
        hf.logprobs(model, pack, head="inside")
    got = hf.logprobs(model, pack).logprobs
    torch.testing.assert_close(got, hf.logprobs(model, pack, head="logits").logprobs,
                               rtol=0, atol=0)
    from treepack.adapters.hf.forwarding import inside_refusal

    assert "changes the output" in inside_refusal(model)
    hf.restore(model)


def test_a_mixer_module_that_drops_the_forward_keywords_routes_through_its_decoder_layer(
        monkeypatch):
    """transformers 5.17's LFM2 short-convolution module takes none of the model's forward
    keywords (the GPU image's version): its module-level convolution reads the pack from the
    decoder layer's, taken by a pre-hook. Simulated here by a module that drops them: the
    log-probs equal each sequence alone, and restoring the model removes the hooks."""
    from treepack.adapters.hf import compat, routing

    model = zoo.tiny_model("lfm2", dtype=torch.float64, layers=4)
    conv = next(m for m in model.modules() if type(m).__name__ == "Lfm2ShortConv")
    original = type(conv).forward

    def forward(self, *args, **kwargs):  # as in transformers 5.17: no keywords passed on
        kwargs.pop(routing.TREE_FORWARD_KWARG, None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(conv), "forward", forward)
    seqs = batch(seed=3)
    with torch.no_grad():
        want = [alone(model, s) for s in seqs]
        with hf.prepared(model):
            pack = TreePack.from_sequences(seqs)
            out = hf.logprobs(model, pack).logprobs
    for s, seq in enumerate(seqs):
        if len(seq) > 1:
            # float64 with float32 norms
            assert within((packed_values(out, pack, s, len(seq)) - want[s]).abs().max(),
                          FLOAT32_INSIDE * scale(want[s]))
    assert not any(routing._enter in layer._forward_pre_hooks.values()
                   for layer in compat.decoder_layers(model))


def test_short_tree_levels_scan_in_short_chunks():
    """transformers' torch scans pad every call to whole chunks (Falcon-H1's 256): each tree
    level runs with the power of two (>= 16) that holds it, so a tree of short chains costs
    no more chunk positions than every sequence alone (Falcon-H1's census model: the packed
    forward took 6.4 s against 6.1 s alone before, 0.26 s after)."""
    from treepack.adapters.hf import routing
    from treepack.forwards import PackForward

    seqs = batch()
    pack = TreePack.from_sequences(seqs)
    calls = []

    def original(x, dt, A, B, C, chunk_size, **kwargs):  # records, returns the right shapes
        calls.append((x.shape[0], x.shape[1], chunk_size))
        n = x.shape[0]
        return x * dt[..., None], x.new_zeros((n, x.shape[2], x.shape[3], B.shape[-1]))

    routed = routing._ssd(original)
    tree = PackForward(pack, "segment")
    T, H, D, N = pack.num_rows, 2, 4, 3
    out = routed(torch.randn(1, T, H, D), torch.rand(1, T, H), -torch.rand(H),
                 torch.randn(1, T, 1, N), torch.randn(1, T, 1, N), 256,
                 **{routing.TREE_FORWARD_KWARG: tree})
    assert out.shape == (1, T, H, D)
    assert all(chunk == min(256, max(16, 1 << (width - 1).bit_length()))
               for _, width, chunk in calls), calls
    tree_positions = sum(b * -(-w // c) * c for b, w, c in calls)
    alone_positions = sum(-(-len(s) // 256) * 256 for s in seqs)
    assert tree_positions < alone_positions / 4, (tree_positions, alone_positions)
    assert [level_chunk(64, w) for w in (1, 16, 17, 64, 65, 300)] == [16, 16, 32, 64, 64, 64]


@pytest.mark.parametrize("family", ["falcon_mamba", "jamba"])
def test_mixers_reached_through_their_layers_recompute_with_the_pack(family):
    """Falcon-Mamba's model calls its blocks without its forward keywords, and Jamba's layers
    call their Mamba mixers without them: the pack reaches those scans from the model's or
    the layer's forward. transformers checkpoints a layer's forward, not its call, so the
    recompute must be handed the pack again: gradients with activation checkpointing equal
    those without."""
    model = hf.prepare(zoo.tiny_model(family, dtype=torch.float64, layers=4)).train()
    pack = TreePack.from_sequences(batch()[:6])
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        hf.logprobs(model, pack).logprobs.sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    for name, g in grads[0].items():  # the same computation recomputed: float64's allowance
        assert_within(grads[1][name], g, FLOAT64_EXACT)
    hf.restore(model)
    assert not any(hasattr(getattr(m, "_gradient_checkpointing_func", None),
                           "treepack_original") for m in model.modules())
