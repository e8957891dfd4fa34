import pytest
import torch

transformers = pytest.importorskip("transformers")

import tiny_models  # noqa: E402
import treepack  # noqa: E402
from tolerance import (  # noqa: E402
    FLOAT32_INSIDE,
    FLOAT32_OP,
    FLOAT32_RELATIVE,
    FLOAT64_EXACT,
    FLOAT64_OP,
    assert_within,
    inside,
    within,
)
from treepack import TreePack, hf, zoo  # noqa: E402
from treepack.forwards import PackForward  # noqa: E402
from treepack.verification import verification_batch, verify  # noqa: E402

SEQS = verification_batch(zoo.VOCAB)


def tiny(*args, **kwargs):
    """A zoo model, prepared for tree forwards (hf.forward refuses unprepared models)."""
    return hf.prepare(zoo.tiny_model(*args, **kwargs))


# A float64 transformers model rounds to float32 inside (tolerance.inside finds it; then
# FLOAT32_INSIDE, else FLOAT64_EXACT): its norms' variance; transformers' eager attention
# (Gemma 2's reference) takes its softmax in float32; Kimi-Linear computes its forget gate in
# float32 (forget_gate.float(), A_log.float()), where a tree's float64 rounding, 1e-16 apart
# from alone's, can come out a float32 step apart (1e-8 in the log-probs on an Intel Xeon).
# Nemotron-H and Falcon-Mamba cast their logits to float32 (``.float()``), and alone_logprobs
# takes their log-softmax in float32: a whole float32 operation (tolerance.FLOAT32_OP).
FLOAT32_LOGITS = {"nemotron_h", "falcon_mamba"}


def alone_logprobs(model, seqs):
    """[M] log-probs with every sequence run alone through the unprepared model."""
    out = []
    for seq in seqs:
        logits = model(input_ids=seq[None], use_cache=False).logits[0]
        out.append(logits.log_softmax(-1)[:-1].gather(-1, seq[1:, None])[:, 0])
    return torch.cat(out)


def packed_flat(pack, logps):
    return logps.reshape(-1)[pack.predictions.index]


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_every_family_equals_each_sequence_alone_float64(family, monkeypatch):
    model = zoo.tiny_model(family, dtype=torch.float64)
    if family in zoo.HYBRIDS:  # transformers' scan computes in float32: a float64 one here
        from reference import exact_kernel

        exact_kernel(monkeypatch, model)
    hf.prepare(model)
    expect = alone_logprobs(model, SEQS)
    pack = TreePack.from_sequences(SEQS, pad_to_multiple_of=16)
    flat = TreePack.from_sequences(SEQS, share_prefixes=False)  # the padding-free baseline
    rel = FLOAT32_OP if family in FLOAT32_LOGITS else inside(model)
    softcapped = bool(getattr(model.config, "attn_logit_softcapping", None))
    for p, backend in ((pack, "segment"), (pack, "dense"), (pack, "varlen"), (flat, "auto")):
        if backend == "varlen" and softcapped:
            with pytest.raises(RuntimeError, match="no logit soft-capping"):
                hf.forward(model, p, backend)
            continue
        got = packed_flat(p, p.token_logprobs(hf.forward(model, p, backend).logits[0]))
        assert_within(got, expect.to(got.dtype), rel)


def test_a_peft_lora_model_packs_like_its_base_with_the_adapter_on_and_off():
    """A real peft LoRA model: the adapter runs inside the packed forward (float64, equal to
    each sequence alone), disable_adapter() gives the base model's numbers, and verify
    passes with gradients on the LoRA weights only."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(
        tiny("qwen2", dtype=torch.float64),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                        task_type="CAUSAL_LM", init_lora_weights=False))  # B != 0: it counts
    with_adapter = alone_logprobs(model, SEQS)
    with model.disable_adapter():
        without = alone_logprobs(model, SEQS)
    assert (with_adapter - without).abs().max() > 1e-3
    hf.prepare(model)
    assert hf.unwrap(model) is model.get_base_model()
    pack = TreePack.from_sequences(SEQS)
    got = packed_flat(pack, pack.token_logprobs(hf.forward(model, pack).logits[0]))
    assert_within(got, with_adapter, FLOAT32_INSIDE)  # float64 with float32 norms
    with model.disable_adapter():
        got = packed_flat(pack, pack.token_logprobs(hf.forward(model, pack).logits[0]))
    assert_within(got, without, FLOAT32_INSIDE)
    report = verify(model.float(), SEQS)
    assert report.passed, str(report)


def test_verify_in_float16_steps_on_float32_master_weights():
    """Pure float16 AdamW divides 0 by 0 (eps rounds to 0): both runs went NaN and verify
    always failed. With float32 master weights the step is finite and packing passes."""
    report = verify(zoo.tiny_model("qwen2").eval(), SEQS, dtype=torch.float16)
    assert report.passed, str(report)
    assert all(torch.isfinite(torch.tensor(e.max_rel)) for e in report.errors.values())


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_verify_passes_float32(family):
    report = verify(zoo.tiny_model(family).eval(), SEQS, backend="segment")
    assert report.passed, str(report)
    if family not in zoo.HYBRIDS:  # a scan in float32: the floor of two unpacked runs decides
        assert within(report.errors["grads"].max_rel, FLOAT32_RELATIVE)  # a float32 run
    assert report.packed_rows < report.original_tokens


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3", "mixtral"])
def test_verify_passes_float32_through_the_varlen_plan(family):
    # On CPU, backend='varlen' runs the exact reference of the FlashAttention varlen call on
    # the same chain index plan the GPU kernel gets (windows included).
    report = verify(zoo.tiny_model(family).eval(), SEQS, backend="varlen")
    assert report.passed, str(report)


@pytest.mark.parametrize("family, backend", [("llama", "segment"), ("gemma2", "dense"),
                                             ("qwen2", "segment")])
def test_verify_passes_bfloat16_against_float32(family, backend):
    report = verify(zoo.tiny_model(family).eval(), SEQS, backend=backend, dtype=torch.bfloat16)
    assert report.passed, str(report)
    assert report.unpacked_errors is not None


def test_verify_low_precision_params_are_judged_where_the_gradient_sets_the_step():
    """AdamW's first step moves an element by about lr * sign(g): in a zero-initialised
    tensor (Qwen3.5's norms) one sign flip of a gradient that is rounding is a relative L2
    error of 0.25, in whichever run it falls (measured: verify --family qwen3_5 --dtype
    bfloat16 failed 14.9x on one such flip on an AMD EPYC). Flips where the gradient is
    rounding pass; a flip where it is not still fails."""
    from treepack.face import verification as v

    lr, n = 1e-2, 64
    g = torch.linspace(1e-3, 2e-3, n).double()
    g[7] = 1e-7  # rounding next to the unpacked run's own error below
    before = {"w": torch.zeros(n, dtype=torch.float64)}

    def step(grad):
        after = -lr * grad / (grad.abs() + v.ADAM_EPS)
        return v._Step(torch.zeros(1), torch.zeros(()), {"w": grad}, before, {"w": after})

    reference = step(g)
    unpacked = step(g + 1e-6)  # the low-precision unpacked run's error: 1e-6 everywhere
    settled = v._settled(unpacked, reference)
    assert not settled["w"][7] and settled["w"].sum() == n - 1
    noise_flip = g.clone()
    noise_flip[7] = -1e-7
    real_flip = g.clone()
    real_flip[20] = -real_flip[20]
    for got, bad in ((noise_flip, False), (real_flip, True)):
        err = v._compare(step(got), reference, l2=True, settled=settled)["params"].max_rel
        plain = v._compare(step(got), reference, l2=True)["params"].max_rel
        assert plain > 0.2  # the L2 over every element fails either flip
        assert (err > 0.2) == bad, (err, bad)


def test_verify_fails_when_siblings_leak(monkeypatch):
    # A negative control: attention over the packed order (plain causal) must be caught.
    from treepack.attention import dense

    def leaky(q, k, v, ctx, *, scale, softcap, window, dropout):
        causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
        return dense.sdpa(q, k, v, causal, scale=scale, softcap=softcap, dropout=dropout)

    monkeypatch.setitem(__import__("treepack.attention", fromlist=["BACKENDS"]).BACKENDS, "dense", leaky)
    report = verify(zoo.tiny_model("llama").eval(), SEQS, backend="dense")
    assert not report.passed
    assert report.errors["logprobs"].max_rel > 1e-3
    assert "FAIL" in str(report)


def test_verify_floor_counts_float32_roundings_inside_a_float64_model():
    """Llama's RMSNorm upcasts to float32 inside a float64 model: its floor is at least 16
    float32 roundings, derived, not measured; GPT-2 never leaves float64 and keeps its
    measured floor (~1e-16), so a float64 error above 1e-9 still fails it."""
    from treepack.face.verification import INSIDE_ROUNDINGS

    llama = verify(zoo.tiny_model("llama", dtype=torch.float64).eval(), SEQS)
    assert llama.passed and llama.rounds_in == "float32"
    assert llama.inside_floor == INSIDE_ROUNDINGS * torch.finfo(torch.float32).eps
    assert "the model rounds to float32 inside" in str(llama)
    gpt2 = verify(zoo.tiny_model("gpt2", dtype=torch.float64).eval(), SEQS)
    assert gpt2.passed and gpt2.rounds_in == "" and gpt2.inside_floor == 0.0
    assert gpt2.allowed("grads") == 1e-9


def test_verify_refuses_dropout_in_training_mode():
    model = tiny("llama", attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"dropout.*model.eval\(\)"):
        verify(model.train(), SEQS)
    assert verify(model.eval(), SEQS).passed  # eval mode: dropout is off


def test_forward_never_changes_an_unprepared_model():
    model = zoo.tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"not prepared: call treepack.hf.prepare\(model\)"):
        hf.forward(model, TreePack.from_sequences(SEQS))
    assert model.config._attn_implementation == before and not hf.is_prepared(model)
    pack = TreePack.from_sequences(SEQS)
    with hf.prepared(model):  # a block: prepared inside, restored after
        logits = hf.forward(model, pack).logits
    assert model.config._attn_implementation == before and not hf.is_prepared(model)
    assert hf.restore(hf.prepare(model)) is model and not hf.is_prepared(model)
    hf.prepare(model)
    with hf.prepared(model):  # an already prepared model stays prepared: the same computation
        torch.testing.assert_close(hf.forward(model, pack).logits, logits, rtol=0, atol=0)
    assert hf.is_prepared(model) and hf.original_attention(model) == before


def test_prepared_model_runs_padded_batches_unchanged():
    model = tiny("gemma2")
    ids = torch.randint(3, zoo.VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, 9:] = 0  # right padding
    before = model(input_ids=ids, attention_mask=mask).logits
    original = hf.original_attention(model)  # "eager" or "sdpa", by transformers version
    hf.prepare(model)
    assert hf.is_prepared(model) and model.config._attn_implementation == f"treepack_{original}"
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)
    pack = TreePack.from_sequences(SEQS)
    hf.forward(model, pack)  # and the same object runs packs
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)
    with pytest.warns(FutureWarning, match="hf.restore"):
        hf.unprepare(model)  # the deprecated name still works
    assert model.config._attn_implementation == original


def loss_and_grads(model, pack, mask=None, backend="segment"):
    model.zero_grad(set_to_none=True)
    logps = pack.token_logprobs(hf.forward(model, pack, backend).logits[0])
    mask = pack.prediction_mask if mask is None else mask & pack.prediction_mask
    loss = -(logps * mask).sum()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def alone_loss_and_grads(model, seqs, mask):
    model.zero_grad(set_to_none=True)
    loss = 0
    for s, seq in enumerate(seqs):
        logits = model(input_ids=seq[None], use_cache=False).logits[0]
        logp = logits.log_softmax(-1)[:-1].gather(-1, seq[1:, None])[:, 0]
        loss = loss - (logp * mask[s, 1:len(seq)]).sum()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


# transformers' RMSNorm computes in float32 even in a float64 model, and the backward of that
# cast rounds gradients to float32: float64 gradients are float32-accurate by construction
# (relative to each tensor's largest).
GRAD_TOL = FLOAT32_RELATIVE


def assert_grads_close(a, b, tol=GRAD_TOL):
    for k in b:
        assert_within(a[k], b[k], tol)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_tree_attention(reentrant):
    model = tiny("qwen2", dtype=torch.float64).train()
    pack = TreePack.from_sequences(SEQS, pad_to_multiple_of=8)
    loss, plain = loss_and_grads(model, pack)
    # gradient_checkpointing_enable is the name every transformers version keeps
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    loss2, ckpt = loss_and_grads(model, pack)
    assert loss2 == loss
    assert_grads_close(ckpt, plain, 0)


def test_loss_masked_prompts_still_get_gradient_from_descendants():
    model = tiny("mistral", dtype=torch.float64)
    pack = TreePack.from_sequences(SEQS)
    mask = torch.zeros(pack.rows.shape, dtype=torch.bool)
    for s, seq in enumerate(SEQS):
        mask[s, min(10, len(seq) - 1):len(seq)] = True  # supervise only past the prompt
    loss, grads = loss_and_grads(model, pack, mask)
    ref_loss, ref = alone_loss_and_grads(model, SEQS, mask)
    torch.testing.assert_close(loss, ref_loss, rtol=FLOAT32_INSIDE, atol=0)
    assert_grads_close(grads, ref)
    # the prompt's embeddings are trained only through attention from later tokens
    prompt_token = int(SEQS[0][0])
    assert grads["model.embed_tokens.weight"][prompt_token].abs().max() > 0


def test_gradient_accumulation_over_packs_with_global_denominator():
    model = tiny("llama", dtype=torch.float64)
    packs = [TreePack.from_sequences(SEQS[:7]), TreePack.from_sequences(SEQS[7:])]
    total = sum(p.num_predictions for p in packs)  # the global denominator
    model.zero_grad(set_to_none=True)
    for pack in packs:
        logps = pack.token_logprobs(hf.forward(model, pack).logits[0])
        (-(logps * pack.prediction_mask).sum() / total).backward()
    accumulated = {k: p.grad.clone() for k, p in model.named_parameters()}
    single = TreePack.from_sequences(SEQS)
    _, ref = loss_and_grads(model, single)
    assert_grads_close(accumulated, {k: g / total for k, g in ref.items()})


def test_return_hidden_gives_the_lm_head_input():
    model = tiny("gemma2", dtype=torch.float64)
    pack = TreePack.from_sequences(SEQS)
    logits = hf.forward(model, pack).logits[0]
    hidden = hf.forward_hidden(model, pack).last_hidden_state[0]
    z = hidden @ model.get_output_embeddings().weight.T
    cap = model.config.final_logit_softcapping
    # the same forward; the head: one matmul over the hidden size and a tanh, in float64
    assert_within(torch.tanh(z / cap) * cap, logits, FLOAT64_OP)


def test_moe_aux_loss_counts_original_tokens():
    model = tiny("mixtral", dtype=torch.float64)
    pack = TreePack.from_sequences(SEQS, pad_to_multiple_of=16)
    out = hf.forward(model, pack, output_router_logits=True)
    L = max(len(s) for s in SEQS)
    ids = torch.zeros(len(SEQS), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(SEQS):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    hf.restore(model)
    ref = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    # the router's logits come out of float32 norms (FLOAT32_INSIDE), packed and padded
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=FLOAT32_INSIDE, atol=0)
    weights = hf.row_multiplicity(pack)
    assert weights.sum() == pack.num_original_tokens and weights[pack.num_packed_rows:].sum() == 0
    # counting each packed row once (what a naive packer does) would be wrong
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    once = (weights > 0).double()[None]
    naive = load_balancing_loss_func(out.router_logits, 4, 2, once)
    assert (naive - ref.aux_loss).abs() > 1e-4


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"labels": torch.zeros(1, 4, dtype=torch.long)}, "token_logprobs"),
        ({"attention_mask": torch.ones(1, 4)}, "tree structure"),
        ({"position_ids": torch.zeros(1, 4)}, "depths"),
        ({"cu_seq_lens_q": torch.zeros(2)}, "padding-free"),
        ({"use_cache": True}, "cache"),
    ],
)
def test_forward_refuses_what_would_be_silently_wrong(kwargs, words):
    model = tiny("llama")
    with pytest.raises(ValueError, match=words):
        hf.forward(model, TreePack.from_sequences(SEQS), **kwargs)


def test_refuses_a_model_that_ignores_position_ids():
    model = zoo.tiny_model("llama")
    rotary = model.model.rotary_emb
    original = rotary.forward
    rotary.forward = lambda x, position_ids: original(x, torch.arange(x.shape[1])[None])
    with pytest.raises(hf.UnsupportedModel, match="ignores position_ids"):
        hf.prepare(model)
    assert not hf.is_prepared(model)


def _tiny_from_config(name: str, **kwargs):
    """A tiny random transformers model from config class ``name`` (no zoo family)."""
    config = getattr(transformers, name)(vocab_size=zoo.VOCAB, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, **kwargs)
    for key in ("attention_dropout", "hidden_dropout", "hidden_dropout_prob",
                "attention_probs_dropout_prob"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name,kwargs,words", [
    # Doge adds a learned dynamic bias (A, dt_proj) through its attention mask
    ("DogeConfig", dict(num_key_value_heads=4), "adds values of its own to the attention mask"),
    # RoBERTa built as a causal LM counts positions from padding_idx + 1
    ("RobertaConfig", dict(is_decoder=True), "positions other than 0 .. L-1"),
    # BERT without is_decoder attends both ways
    ("BertConfig", {}, "is not causal"),
], ids=["doge_attention_bias", "roberta_shifted_positions", "bert_bidirectional"])
def test_refuses_what_the_census_found_silently_wrong(name, kwargs, words):
    """Models a pack used to get wrong without an error (issue 35's census): each is refused
    by name, with the reason, from what the model does rather than from a list of names."""
    model = _tiny_from_config(name, **kwargs).double()
    with pytest.raises(hf.UnsupportedModel, match=words):
        hf.prepare(model)
    assert not hf.is_prepared(model)


def test_bert_built_as_a_decoder_is_exact():
    """The same encoder told to be causal (is_decoder=True) reads positions from 0 and runs
    exactly on a pack."""
    model = _tiny_from_config("BertConfig", is_decoder=True).double()
    assert verify(model, SEQS).passed


def test_refuses_a_layer_that_bypasses_the_attention_interface():
    model = zoo.tiny_model("llama")
    layer = model.model.layers[1].self_attn

    def own_attention(hidden_states, position_embeddings, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, layer.head_dim)
        q = layer.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = layer.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = layer.v_proj(hidden_states).view(shape).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True)
        return layer.o_proj(out.transpose(1, 2).flatten(2)), None

    layer.forward = own_attention
    with pytest.raises(hf.UnsupportedModel, match="1 of them attended"):
        hf.prepare(model)


def test_refuses_recurrent_layers_it_does_not_route():
    model = zoo.tiny_model("llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(hf.UnsupportedModel, match="linear_attention"):
        hf.prepare(model)


@pytest.mark.parametrize("backend", ["auto", "varlen"])
def test_gpt_oss_sinks_windows_and_moe_equal_each_sequence_alone(backend):
    """GPT-OSS's sinks enter every tree softmax (treepack.attention, TreeAttention sinks; on
    varlen through the kernel's log-sum-exp, its CPU reference here): log-probs and every
    gradient, the sinks' and the router's included, equal every sequence alone, across its
    6-token windows (the batch's sequences run to 32 tokens)."""
    model = tiny_models.gpt_oss()
    report = verify(model, verification_batch(zoo.VOCAB), backend=backend)
    assert report.passed, report
    if backend == "varlen":
        return
    with hf.prepared(model):  # the sinks learn on a pack (verify compared their gradients)
        out = hf.logprobs(model, TreePack.from_sequences(verification_batch(zoo.VOCAB)))
        out.logprobs.sum().backward()
    assert all(layer.self_attn.sinks.grad.abs().min() > 0 for layer in model.model.layers)


@pytest.mark.parametrize("broken", [None, "no chunks", "temperature at packed index"])
def test_llama4_chunked_attention_and_nope_temperature_equal_each_sequence_alone(
        broken, monkeypatch):
    """Llama 4 text: its chunked layer attends within chunks of 5 depths (the batch's
    sequences run to 32 tokens), its no-rope layer tunes the attention temperature at each
    row's depth, and its MoE routes per row: log-probs and every gradient equal every
    sequence alone to rounding (its float32 internals in float64 here). Each thing broken
    alone fails."""
    from treepack.adapters.hf import routing

    tiny_models.llama4_in_float64(monkeypatch)
    if broken == "no chunks":
        monkeypatch.setattr(routing, "_chunk_of", lambda module: None)
    elif broken == "temperature at packed index":
        monkeypatch.setattr(routing, "_temperature_at_depths", lambda module, q, tree: q)
    report = verify(tiny_models.llama4_text(torch.float64), verification_batch(zoo.VOCAB))
    if broken is None:
        assert report.passed, report
        # llama4_in_float64 leaves no float32 step that the two runs take on different values
        assert within(report.errors["logprobs"].max_rel, FLOAT64_EXACT), report
    else:  # and the floor (one padded batch included) does not swallow it
        assert not report.passed and report.errors["logprobs"].max_rel > 1e-4, report


def test_llama4_chunked_attention_on_varlen_equals_each_sequence_alone(monkeypatch):
    """Llama 4's chunked layer on varlen (chains cut at chunk starts; the CPU reference of
    the kernel here): log-probs and every gradient equal every sequence alone to float64's
    rounding."""
    tiny_models.llama4_in_float64(monkeypatch)
    report = verify(tiny_models.llama4_text(torch.float64), verification_batch(zoo.VOCAB),
                    backend="varlen")
    assert report.passed and within(report.errors["logprobs"].max_rel, FLOAT64_EXACT), report


def test_pack_on_another_device_is_refused():
    with pytest.raises(ValueError, match="pack.to"):
        hf.forward(tiny("llama"), TreePack.from_sequences(SEQS, device="meta"))


def test_the_pack_goes_where_a_wrapper_computes_not_where_it_offloads_parameters():
    """FSDP1 with CPU offload keeps parameters on the CPU and computes on its compute_device:
    the pack must be there (verl's reference model runs this way)."""

    class Offloading(torch.nn.Module):  # the two attributes FSDP1 has that matter here
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.compute_device = torch.device("meta")

        def forward(self, **kw):
            return self.module(**kw)

    model = Offloading(tiny("llama"))
    assert hf.compute_device(model) == torch.device("meta")
    assert hf.compute_device(model.module) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"computes on meta .* pack.to\('meta'\)"):
        hf.forward(model, TreePack.from_sequences(SEQS))


def test_flex_forward_on_cpu_equals_segment_through_the_model():
    model = tiny("gemma2")  # sliding + full layers, soft-capping
    pack = TreePack.from_sequences(SEQS, pad_to_multiple_of=128)
    with torch.no_grad():
        flex = hf.forward(model, pack, "flex").logits
        segment = hf.forward(model, pack, "segment").logits
    assert_within(flex, segment, FLOAT32_RELATIVE)  # a float32 model, two attention kernels


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_lean_logprobs_from_hidden_equal_the_logits_path(family):
    import treepack

    model = tiny(family, dtype=torch.float64)
    pack = TreePack.from_sequences(SEQS, pad_to_multiple_of=16)
    expect = pack.token_logprobs(hf.forward(model, pack).logits[0])
    hidden = hf.forward_hidden(model, pack).last_hidden_state[0]
    got = treepack.logprobs_from_hidden(pack, hidden, **hf.lm_head(model), chunk_size=5)
    # a head that casts its logits to float32 rounds them once, and the two paths differently;
    # one forward of one pack: the heads differ (a float64 matmul and log-softmax)
    assert_within(got, expect.to(got.dtype),
                  FLOAT32_OP if family in FLOAT32_LOGITS else FLOAT64_EXACT)


def test_lm_head_refuses_an_unknown_logit_transform():
    model = tiny("cohere")  # multiplies its logits by logit_scale = 0.5
    hf.lm_head(model)  # known: passes its self-check
    other = zoo.tiny_model("cohere", seed=3)
    other.config.logit_scale = None  # now the transform is invisible to lm_head
    with pytest.raises(hf.UnsupportedModel, match="transforms its logits"):
        hf.lm_head(other)


def test_a_pack_scored_under_inference_mode_still_trains():
    import treepack

    model = tiny("qwen2")
    pack = TreePack.from_sequences(SEQS)
    with torch.inference_mode():  # old log-probs, the usual way
        old = pack.token_logprobs(hf.forward(model, pack).logits[0])
        hidden = hf.forward_hidden(model, pack).last_hidden_state[0]
        treepack.logprobs_from_hidden(pack, hidden, **hf.lm_head(model))
    logps = pack.token_logprobs(hf.forward(model, pack).logits[0])
    hidden = hf.forward_hidden(model, pack).last_hidden_state[0]
    lean = treepack.logprobs_from_hidden(pack, hidden, **hf.lm_head(model))
    ((logps - old.clone()) * pack.prediction_mask).sum().backward()
    lean.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_moe_aux_loss_of_an_empty_pack_is_zero_and_of_several_packs_is_the_batch_loss():
    model = tiny("mixtral", dtype=torch.float64)
    out = hf.forward(model, TreePack.empty(4), output_router_logits=True)
    assert out.aux_loss.item() == 0.0 and out.aux_loss.requires_grad
    packs = [TreePack.from_sequences(SEQS[:7]), TreePack.from_sequences(SEQS[7:])]
    logits = [hf.forward(model, p, output_router_logits=True).router_logits for p in packs]
    whole = hf.forward(model, TreePack.from_sequences(SEQS), output_router_logits=True)
    empty = hf.forward(model, TreePack.empty(2), output_router_logits=True).router_logits
    both = hf.batch_router_aux_loss(model, packs + [TreePack.empty(2)], logits + [empty])
    torch.testing.assert_close(both, whole.aux_loss, rtol=FLOAT32_INSIDE, atol=0)  # other packs
    with pytest.warns(FutureWarning, match="batch_router_aux_loss"):  # the deprecated form
        old = hf.router_aux_loss(model, packs + [TreePack.empty(2)], logits + [empty])
    torch.testing.assert_close(old, both, rtol=0, atol=0)


def test_refuses_a_window_that_the_model_keeps_in_its_own_mask():
    # Qwen2-MoE builds sliding-window masks but does not pass sliding_window to the
    # attention interface: a tree forward would silently attend without the window.
    config = transformers.Qwen2MoeConfig(
        **zoo._COMMON, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["sliding_attention"] * 2, sliding_window=3, use_sliding_window=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(hf.UnsupportedModel, match="sliding window of 3 on 2 layers, but 0"):
        hf.prepare(model)


def test_rotary_scaling_that_reads_the_longest_position_is_refused_past_its_limit():
    # Dynamic NTK changes every position's frequencies once the batch is longer than
    # max_position_embeddings: a short sequence packed with a long one would be 2e-4 off.
    model = tiny("llama", dtype=torch.float64, max_position_embeddings=16,
                           rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                            "rope_theta": 10000.0})
    short = [[5, 6, 7, 8], [5, 6, 9]]
    pack = TreePack.from_sequences(short)
    got = packed_flat(pack, pack.token_logprobs(hf.forward(model, pack).logits[0]))
    # within the limit: exact (a float64 model with float32 norms)
    assert_within(got, alone_logprobs(model, [torch.tensor(s) for s in short]), FLOAT32_INSIDE)
    long = TreePack.from_sequences(short + [list(range(3, 23))])
    with pytest.raises(hf.UnsupportedModel, match="rope_type='dynamic'.*16 positions.*has 20"):
        hf.forward(model, long)


def test_forward_checks_ids_against_the_embedding_and_takes_use_cache_false():
    model = tiny("llama")
    with pytest.raises(ValueError, match=f"token id {zoo.VOCAB} but .* embedding has "
                                         f"{zoo.VOCAB} rows"):
        hf.forward(model, TreePack.from_sequences([[1, zoo.VOCAB]]))
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]])
    assert hf.forward(model, pack, use_cache=False).logits.shape == (1, 4, zoo.VOCAB)
    with pytest.raises(ValueError, match="use_cache=True"):
        hf.forward(model, pack, use_cache=True)
    with pytest.raises(ValueError, match="output_attentions=True: .*never form"):
        hf.forward(model, pack, output_attentions=True)


@pytest.mark.parametrize("name, config", [
    ("FalconConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                          alibi=False, new_decoder_architecture=False)),
    ("FalconConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                          alibi=True)),
    ("MptConfig", dict(d_model=64, n_heads=4, n_layers=2)),
])
def test_models_whose_own_code_breaks_on_a_tree_forward_get_treepacks_refusal(name, config):
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, name)(vocab_size=zoo.VOCAB, **config))
    # the model's own code raising on the tree forward (transformers 5.24's Falcon), or its
    # attention bypassing the interface, caught by the count (5.25's): refused either way
    with pytest.raises(hf.UnsupportedModel, match="(cannot run a tree forward|attended through "
                                                  "transformers' attention interface).*run this "
                                                  "one unpacked"):
        hf.prepare(model)
    assert not hf.is_prepared(model)  # a refused model is left as it was


def test_a_layer_of_another_dtype_is_refused_by_its_dtype_not_as_alibi():
    """One float64 layer in a float32 model fails with or without a pack: the refusal names
    the dtypes and the layer (and the cast that fixes it), not ALiBi or custom attention."""
    model = zoo.tiny_model("qwen2")
    model.model.layers[0].to(torch.float64)
    with pytest.raises(hf.UnsupportedModel) as info:
        hf.prepare(model)
        hf.logprobs(model, TreePack.from_sequences([[1, 2, 3], [1, 2, 4]]))
    message = str(info.value)
    assert "most in torch.float32, model.layers.0 in torch.float64" in message
    assert "ordinary forward without a pack too" in message
    assert "model.to(torch.float32)" in message
    assert "ALiBi" not in message and "custom attention" not in message
    assert not hf.is_prepared(model)


def test_verify_runs_the_reference_on_the_callers_ids(monkeypatch):
    # A pack whose ids are consistently wrong (input ids and targets shifted alike) used to
    # pass: the reference was rebuilt from the pack.
    from treepack import verification

    real = verification.TreePack.from_sequences

    def shifted(seqs, **kw):
        return real([(torch.as_tensor(s) + 1) % zoo.VOCAB for s in seqs], **kw)

    monkeypatch.setattr(verification.TreePack, "from_sequences", shifted)
    report = verify(zoo.tiny_model("llama").eval(), SEQS)
    assert not report.passed and report.errors["logprobs"].max_rel > 1e-2


def test_verify_reference_computes_soft_capping_whatever_the_models_attention():
    # Gemma 2 switched to sdpa: transformers 5.17 silently left attention soft-capping out
    # there (and 5.24 raises), while the tree backends honour it; the reference must be eager.
    model = tiny("gemma2").eval()
    model.config._attn_implementation = "sdpa"
    report = verify(model, SEQS)
    assert report.passed and report.reference_attention == "eager", str(report)
    assert "attention=eager" in str(report)


@pytest.mark.parametrize("family", sorted(zoo.FAMILIES))
def test_verify_passes_float64_against_the_floor_of_two_unpacked_runs(family):
    # transformers computes norms and softmax in float32 inside float64 models, so two
    # unpacked runs already differ by ~1e-7; the tolerance follows that floor.
    report = verify(zoo.tiny_model(family, dtype=torch.float64).eval(), SEQS)
    assert report.passed, str(report)
    assert report.floor_errors is not None and "floor" in str(report)


def test_a_flat_pack_gives_the_dense_packs_values_sequence_after_sequence():
    model = tiny("mixtral", dtype=torch.float64)  # the router loss reads rows too
    dense = TreePack.from_sequences(SEQS)
    flat = TreePack.from_sequences(SEQS, layout="flat")
    valid = dense.rows >= 0
    out_d = hf.forward(model, dense, output_router_logits=True)
    out_f = hf.forward(model, flat, output_router_logits=True)
    # the same rows in the same forward: only the gathers differ
    torch.testing.assert_close(out_f.aux_loss, out_d.aux_loss, rtol=FLOAT64_EXACT, atol=0)
    assert torch.equal(flat.token_logprobs(out_f.logits[0]),
                       dense.token_logprobs(out_d.logits[0])[valid])
    hidden = hf.forward_hidden(model, flat).last_hidden_state[0]
    lean = treepack.logprobs_from_hidden(flat, hidden, **hf.lm_head(model))
    assert_within(lean, dense.token_logprobs(out_d.logits[0])[valid], FLOAT64_EXACT)


def reference_outputs(model, pack, temperature, align):
    """Log-probs and entropies per position from the model's own logits, by hand: plain
    log_softmax of every row, read at each position (no treepack code past the forward)."""
    logp = torch.log_softmax(hf.forward(model, pack).logits[0] / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    lp = torch.zeros(pack.rows.shape, dtype=logp.dtype)
    ent = torch.zeros(pack.rows.shape, dtype=logp.dtype)
    offsets = pack.host.offsets
    for s, length in enumerate(pack.host.lengths):
        rows = (pack.rows[s, :length] if pack.layout == "dense" else
                pack.rows[offsets[s]:offsets[s] + length])
        ids = pack.input_ids[rows]
        at = (lambda p: (s, p)) if pack.layout == "dense" else (lambda p: offsets[s] + p)
        for p in range(length):
            if align == "label" and p >= 1:
                lp[at(p)] = logp[rows[p - 1], ids[p]]
                ent[at(p)] = entropy[rows[p - 1]]
            if align == "prediction":
                if p + 1 < length:
                    lp[at(p)] = logp[rows[p], ids[p + 1]]
                ent[at(p)] = entropy[rows[p]]
    return lp, ent


@pytest.mark.parametrize("family,layout,align", [
    ("qwen2", "flat", "prediction"), ("gpt2", "dense", "label"),  # untied, tied
    ("mixtral", "flat", "label"), ("qwen2", "dense", "prediction")])  # MoE
def test_every_head_gives_the_same_logprobs_entropies_and_gradients(family, layout, align):
    """hf.logprobs from the head inside the forward, from hidden states and from the model's
    logits: values at every position (padding included) and every parameter's gradient equal
    a by-hand log_softmax of the model's logits."""
    model = tiny(family, dtype=torch.float64)
    pack = TreePack.from_sequences(SEQS, layout=layout, pad_to_multiple_of=16)
    g = torch.Generator().manual_seed(0)
    w_lp = torch.randn(pack.rows.shape, generator=g, dtype=torch.float64)
    w_ent = torch.randn(pack.rows.shape, generator=g, dtype=torch.float64)

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return out

    want_lp, want_ent = reference_outputs(model, pack, 0.8, align)
    ((want_lp * w_lp).sum() + (want_ent * w_ent).sum()).backward()
    want = grads()
    for head in ("inside", "hidden", "logits"):
        out = hf.logprobs(model, pack, head=head, entropy=True, temperature=0.8, align=align)
        assert out.align == align and out.logprobs.shape == pack.rows.shape
        # one forward of one pack: only the head's float64 matmul and log-softmax differ
        assert_within(out.logprobs, want_lp, FLOAT64_EXACT, msg=head)
        assert_within(out.entropy, want_ent, FLOAT64_EXACT, msg=head)
        ((out.logprobs * w_lp).sum() + (out.entropy * w_ent).sum()).backward()
        got = grads()
        assert got.keys() == want.keys(), head
        for name, w in want.items():
            # backward through the float32 norms from the heads' float64-rounded gradients
            assert_within(got[name], w, FLOAT32_RELATIVE, msg=f"{head} {name}")
    assert "forward" not in vars(model.get_output_embeddings())  # the head is restored


def test_auto_head_and_per_sequence_temperatures():
    """``auto`` takes the head inside the forward where it applies and the logits where the
    model transforms them (Gemma 2's soft-cap) or the temperatures differ; a temperature per
    sequence equals running each temperature's sequences on their own."""
    model = tiny("qwen2", dtype=torch.float64)
    pack = TreePack.from_sequences(SEQS)
    temps = torch.tensor([0.5 if i % 2 else 1.3 for i in range(len(SEQS))], dtype=torch.float64)
    got = hf.logprobs(model, pack, temperature=temps, entropy=True)  # auto: the logits
    for t in (0.5, 1.3):
        alone = hf.logprobs(model, pack, temperature=t, entropy=True)  # auto: inside
        rows = temps == t
        assert_within(got.logprobs[rows], alone.logprobs[rows], FLOAT64_EXACT)
        assert_within(got.entropy[rows], alone.entropy[rows], FLOAT64_EXACT)
    with pytest.raises(hf.UnsupportedModel, match="different temperatures"):
        hf.logprobs(model, pack, head="inside", temperature=temps)
    gemma = tiny("gemma2", dtype=torch.float64)
    auto = hf.logprobs(gemma, pack).logprobs
    assert_within(auto, hf.logprobs(gemma, pack, head="hidden").logprobs, FLOAT64_EXACT)


def test_moe_router_loss_comes_with_the_logprobs():
    model = tiny("mixtral", dtype=torch.float64)
    pack = TreePack.from_sequences(SEQS)
    want = hf.forward(model, pack, output_router_logits=True).aux_loss
    for head in ("inside", "hidden", "logits"):
        out = hf.logprobs(model, pack, head=head, output_router_logits=True)
        torch.testing.assert_close(out.aux_loss, want, rtol=FLOAT64_EXACT, atol=0, msg=head)
        assert len(out.router_logits) == model.config.num_hidden_layers


def test_forward_lean_is_a_deprecated_wrapper_of_the_inside_head():
    model = tiny("qwen2", dtype=torch.float64)
    pack = TreePack.from_sequences(SEQS, layout="flat")
    with pytest.warns(FutureWarning, match="head='inside'"):
        rows = hf.forward_lean(model, pack, temperature=0.7, with_entropy=True)
    got = rows.in_layout(pack)
    want = hf.logprobs(model, pack, head="inside", temperature=0.7, entropy=True)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=0)


def test_the_inside_head_keeps_a_forward_the_head_instance_already_had():
    """accelerate's hooks (device_map, offload) put a forward on the head instance: it must
    run around the lean head during the call and still be there after it."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    model = tiny("qwen2", dtype=torch.float64)
    pack = TreePack.from_sequences(SEQS)
    want = hf.logprobs(model, pack, head="inside").logprobs
    head = model.get_output_embeddings()
    add_hook_to_module(head, Counting())
    hooked = vars(head)["forward"]
    got = hf.logprobs(model, pack, head="inside").logprobs
    assert Counting.calls == 1 and vars(head)["forward"] is hooked
    assert head._old_forward.__func__ is torch.nn.Linear.forward  # the inner one back too
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    own = lambda x: torch.nn.functional.linear(x, head.weight)  # noqa: E731  plain instance
    vars(head).pop("_old_forward"), vars(head).pop("_hf_hook")
    head.forward = own
    hf.logprobs(model, pack, head="inside")
    assert vars(head)["forward"] is own


def test_prepare_and_lm_head_keep_every_submodules_train_flag():
    """Probing the model must not set every submodule's flag to the root's (a frozen,
    eval-mode part of a training model stays in eval mode)."""
    model = tiny("qwen2").train()
    model.model.layers[0].eval()
    before = {name: m.training for name, m in model.named_modules()}
    hf.prepare(model)
    hf.lm_head(model)
    assert {name: m.training for name, m in model.named_modules()} == before


def test_the_inside_head_refuses_logits_transformed_after_the_head():
    model = tiny("gemma2")
    with pytest.raises(hf.UnsupportedModel, match="softcap.*head='hidden'"):
        hf.logprobs(model, TreePack.from_sequences(SEQS), head="inside")
    pack = TreePack.from_sequences([[zoo.VOCAB + 5]])  # fails inside the forward
    qwen = tiny("qwen2")
    with pytest.raises(ValueError):
        hf.logprobs(qwen, pack, head="inside")
    assert "forward" not in vars(qwen.get_output_embeddings())


def test_unsupported_model_is_caught_by_what_earlier_releases_raised():
    """One exception for "cannot run exactly", caught by every type callers caught before."""
    for old in (ValueError, NotImplementedError, RuntimeError):
        assert issubclass(hf.UnsupportedModel, old)


def test_padding_rows_do_not_trigger_transformers_padding_warning():
    """GPT-2 warns "pass an attention_mask, your input_ids may be padded" when the first or
    last id is its pad id; a pack's padding rows are id 0 and isolated by the tree attention,
    so the forward gives them another id. The same ids straight into the model still warn."""
    import io
    import logging

    from transformers.utils import logging as hf_logging

    model = tiny("gpt2")
    assert model.config.pad_token_id == 0
    pack = TreePack.from_sequences(SEQS, pad_to_multiple_of=64)
    assert pack.num_rows > pack.num_packed_rows
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = hf_logging.get_logger()
    root.addHandler(handler)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    try:
        for ids, expect in ((None, False), (pack.input_ids[None], True)):
            logging.Logger.warning_once.cache_clear()
            stream.truncate(0)
            if ids is None:
                hf.forward(model, pack)
            else:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False)
            assert ("attention_mask" in stream.getvalue()) == expect, stream.getvalue()
    finally:
        root.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)


def test_deepseek_sparse_attention_selects_among_ancestors_and_refuses_slices():
    """DeepSeek-V3.2's indexer scores every key its mask lets through and keeps the top k: in
    a tree forward its mask is the pack's ancestor mask, so each query picks among its own
    sequence's earlier tokens, and the layer attends densely with the selection. Without the
    ancestor mask (keys of other sequences selectable) it is wrong; in parts and under a
    group, which hold slices of the rows, it is refused."""
    from treepack.face.census import _tiny_model

    model = hf.prepare(_tiny_model("deepseek_v32", torch.float32))
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21, 22, 23, 24], [30, 31, 32, 33, 34]]
    with torch.no_grad():
        want = [model(input_ids=torch.tensor([s])).logits[0].log_softmax(-1)[:-1].gather(
            -1, torch.tensor(s[1:])[:, None])[:, 0] for s in seqs]
        pack = TreePack.from_sequences(seqs)
        got = hf.logprobs(model, pack).logprobs
        for s, seq in enumerate(seqs):
            # a float32 model, packed and alone
            assert_within(got[s, 1:len(seq)], want[s], FLOAT32_RELATIVE)
        real = PackForward.dense_mask
        try:  # every row visible to the indexer: it picks other sequences' keys
            PackForward.dense_mask = lambda self: torch.ones(
                self.pack.num_rows, self.pack.num_rows, dtype=torch.bool).tril()
            wrong = hf.logprobs(model, pack).logprobs
        finally:
            PackForward.dense_mask = real
        assert (wrong[1, 1:9] - want[1]).abs().max() > 1e-3
        with pytest.raises(hf.UnsupportedModel, match="indexer.*in parts"):
            hf.logprobs_in_parts(model, seqs, max_tokens=6)
