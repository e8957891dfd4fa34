"""The parts calls at their edges: every input hf.logprobs takes (layouts, empty packs, built
parts, autocast, LoRA heads, MoE router losses), refused the same way where hf.logprobs
refuses, and the errors a user hits first naming the value, the rule and the fix."""

import copy

import numpy as np
import pytest
import torch

from treepack import hf, zoo
from treepack.core.outputs import TokenLogprobs
from treepack.planning.parts import split
from treepack.tree import TreePack

from tolerance import (
    FLOAT32_OP,
    FLOAT32_RELATIVE,
    FLOAT64_EXACT,
    assert_within,
    inside,
    low_precision,
    within,
)

SEQS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11], [5, 6, 12, 13, 14], [20, 21, 22]]


def model_of(family="llama", **config):
    return hf.prepare(zoo.tiny_model(family, layers=2, dtype=torch.float64, **config))


def sum_loss(out, mask):
    return out.logprobs.where(mask, 0).sum()


def grads_of(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(got, want, rel):
    """Every gradient within ``rel`` of its tensor's largest."""
    assert got.keys() == want.keys()
    for k, w in want.items():
        err = float((got[k] - w).abs().max() / w.abs().max().clamp_min(1e-300))
        assert within(err, rel), (k, err)


# ------------------------------------------------------------ refused as hf.logprobs refuses

def test_a_rope_that_reads_the_longest_position_is_refused_in_parts_too():
    """Dynamic NTK: each part would compute frequencies from its own longest position (a
    30-token sequence at 8 rows a part was 9.6e-4 off its run alone)."""
    model = model_of(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                      "rope_theta": 10000.0}, max_position_embeddings=16)
    long = [list(range(3, 33))]
    with pytest.raises(hf.UnsupportedModel, match="rope_type='dynamic'.*at most 16 tokens"):
        hf.logprobs(model, TreePack.from_sequences(long))
    for call in (lambda: hf.logprobs_in_parts(model, long, max_tokens=8),
                 lambda: hf.backward_in_parts(model, long, sum_loss, max_tokens=8),
                 lambda: hf.step_in_parts(model, long, lambda o: o.logprobs.sum(),
                                          max_tokens=8)):
        with pytest.raises(hf.UnsupportedModel, match="rope_type='dynamic'.*at most 16 tokens"):
            call()
    short = [list(range(3, 15)), list(range(3, 10)) + [40, 41]]  # under the limit: exact
    want = hf.logprobs(model, TreePack.from_sequences(short), head="hidden").logprobs
    got = hf.logprobs_in_parts(model, short, max_tokens=4).logprobs
    assert_within(got, want.detach(), inside(model))


def test_a_token_id_past_the_embedding_is_named_in_parts_too():
    model = model_of()
    with pytest.raises(ValueError, match="token id 200 but LlamaForCausalLM's embedding has 97"):
        hf.logprobs_in_parts(model, [[5, 6, 200]], max_tokens=2)


def test_keyword_arguments_are_checked_as_hf_logprobs_checks_them():
    model = model_of()
    with pytest.raises(ValueError, match="does not take 'attention_mask'"):
        hf.logprobs_in_parts(model, SEQS, max_tokens=4, attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="use_cache=True"):
        hf.backward_in_parts(model, SEQS, sum_loss, max_tokens=4, use_cache=True)


# --------------------------------------------------------------- the layouts hf.logprobs has

@pytest.mark.parametrize("align", ["label", "prediction"])
def test_a_flat_pack_gives_its_flat_layout_as_hf_logprobs_does(align):
    model = model_of()
    pack = TreePack.from_sequences(SEQS, layout="flat")
    want = hf.logprobs(model, pack, head="hidden", entropy=True, align=align)
    got = hf.logprobs_in_parts(model, pack, max_tokens=4, entropy=True, align=align)
    assert got.logprobs.shape == want.logprobs.shape == (pack.num_original_tokens,)
    assert_within(got.logprobs, want.logprobs.detach(), inside(model))
    assert_within(got.entropy, want.entropy.detach(), inside(model))
    model.zero_grad()
    step = hf.backward_in_parts(model, pack, sum_loss, max_tokens=4, align=align)
    assert step.logprobs.shape == (pack.num_original_tokens,)
    parted = grads_of(model)
    model.zero_grad()
    want.logprobs.sum().backward()  # 0 wherever nothing is predicted
    assert_grads_equal(parted, grads_of(model), inside(model, grads=True))


def test_a_built_split_runs_as_given():
    """The calls take a :class:`Parts` (built once for several passes) and run exactly its
    parts."""
    model = model_of()
    pack = TreePack.from_sequences(SEQS)
    parts = split(pack, 5)
    want = hf.logprobs_in_parts(model, SEQS, max_tokens=5)
    got = hf.logprobs_in_parts(model, parts)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
    step = hf.backward_in_parts(model, parts, sum_loss)
    assert step.parts == len(parts.parts) and step.rows == pack.num_rows
    with pytest.raises(ValueError, match="max_tokens=4 but the parts were split at 5"):
        hf.logprobs_in_parts(model, parts, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        hf.logprobs_in_parts(model, SEQS)


# ------------------------------------------------------------------- empty packs are no-ops

def test_an_empty_pack_is_a_step_that_computes_nothing():
    """What plan / collate give a rank with fewer trees: a no-op step (under DDP and FSDP it
    still takes part in the gradient collectives: tests/adapters/test_distributed.py)."""
    model = model_of()
    for empty in (TreePack.empty(1), TreePack.empty(8), []):
        model.zero_grad()
        step = hf.backward_in_parts(model, empty, sum_loss, max_tokens=4)
        assert step.parts == step.rows == 0 and float(step.loss) == 0.0
        shape = (0, 0) if isinstance(empty, list) else tuple(empty.rows.shape)
        assert tuple(step.logprobs.shape) == shape
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())
        out = hf.logprobs_in_parts(model, empty, max_tokens=4)
        assert tuple(out.logprobs.shape) == shape
        assert float(hf.step_in_parts(model, empty, lambda o: o.logprobs.sum(),
                                      max_tokens=4).loss) == 0.0


@pytest.mark.parametrize("head", ["auto", "inside", "hidden", "logits"])
def test_hf_logprobs_on_an_empty_pack_is_empty(head):
    model = model_of()
    pack = TreePack.empty(1)
    out = hf.logprobs(model, pack, head=head, entropy=True)
    assert out.logprobs.shape == out.entropy.shape == pack.rows.shape


# ------------------------------------------------------------------------------- dtypes

def test_parts_under_cpu_autocast_match_one_forward_under_it():
    """CPU autocast to bfloat16: a cut tree's context keys (float32 after rotary) and values
    (bfloat16) reach the attention kernel as one forward's do."""
    model = hf.prepare(zoo.tiny_model("llama", layers=2))
    pack = TreePack.from_sequences(SEQS)
    reference = hf.logprobs(model, pack, head="hidden").logprobs.detach()  # float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = hf.logprobs(model, pack, head="hidden").logprobs.detach()
        got = hf.logprobs_in_parts(model, SEQS, max_tokens=3).logprobs
        step = hf.backward_in_parts(model, SEQS, sum_loss, max_tokens=3)
    whole_err = float((whole - reference).abs().max())
    # the rule for low precision: within twice one forward's own bfloat16 error
    error = float((got - reference).abs().max())
    assert 0 < error and low_precision(error, whole_err), (error, whole_err)
    torch.testing.assert_close(step.logprobs, got, rtol=0, atol=0)


def test_a_per_sequence_temperature_list_keeps_its_precision():
    """[0.7, 0.3] as a Python list is float64, not float32 (5e-9 off in a float64 model).
    GPT-2 computes in float64 throughout (tolerance.inside): parts within FLOAT64_EXACT."""
    model = model_of("gpt2")
    pack = TreePack.from_sequences(SEQS)
    temps = [0.7, 0.3, 0.9, 1.1]
    as_array = hf.logprobs(model, pack, head="hidden", temperature=np.array(temps)).logprobs
    as_list = hf.logprobs(model, pack, head="hidden", temperature=temps).logprobs
    assert torch.equal(as_list, as_array)
    parted = hf.logprobs_in_parts(model, SEQS, max_tokens=4, temperature=temps).logprobs
    assert inside(model) == FLOAT64_EXACT
    assert_within(parted, as_array.detach(), FLOAT64_EXACT)


# ----------------------------------------------------------------------------- long chains

def test_a_long_chain_of_parts_runs_without_recursion():
    """A trajectory at one row a forward is a chain of parts, each under the last: walked
    with a stack, not recursion (1,200 parts hit Python's limit of 1,000). Here 400 parts
    under a limit of 300 frames more than the test's own depth."""
    import inspect
    import sys

    model = hf.prepare(zoo.tiny_model("llama", layers=1))
    seq = [np.random.default_rng(0).integers(3, 90, 400).tolist()]
    want = hf.logprobs(model, TreePack.from_sequences(seq), head="hidden").logprobs
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + 300)
    try:
        out = hf.logprobs_in_parts(model, seq, max_tokens=1)
    finally:
        sys.setrecursionlimit(limit)
    assert_within(out.logprobs, want.detach(), FLOAT32_RELATIVE)  # a float32 model, 400 parts


# --------------------------------------------------------------------------- LoRA heads

def lora_model(targets):
    peft = pytest.importorskip("peft")
    return hf.prepare(peft.get_peft_model(
        zoo.tiny_model("llama", layers=2).double(),
        peft.LoraConfig(r=4, target_modules=targets, lora_dropout=0.0,
                        init_lora_weights=False)))  # B != 0: the adapter counts


def test_a_lora_lm_head_runs_in_parts_and_from_hidden_states():
    """peft's LoRA on lm_head: the head the parts and head='hidden' compute is the adapted
    one (the base weight plus B A), with gradients into A and B."""
    model = lora_model(["q_proj", "lm_head"])
    pack = TreePack.from_sequences(SEQS)
    model.zero_grad()
    want = hf.logprobs(model, pack, head="logits")  # the model's own (adapted) logits
    sum_loss(want, pack.prediction_mask).backward()
    want_grads = grads_of(model)
    assert any("lm_head.lora_B" in k for k in want_grads)
    for head in ("hidden", "inside", "auto"):  # auto: inside, where the head is one matrix
        model.zero_grad()
        got = hf.logprobs(model, pack, head=head)
        # one forward: the heads differ (float64); their gradients meet the float32 norms
        assert_within(got.logprobs, want.logprobs, FLOAT64_EXACT)
        sum_loss(got, pack.prediction_mask).backward()
        assert_grads_equal(grads_of(model), want_grads, inside(model, grads=True))
    model.zero_grad()
    step = hf.backward_in_parts(model, SEQS, sum_loss, max_tokens=4)
    assert_within(step.logprobs, want.logprobs.detach(), inside(model))
    assert_grads_equal(grads_of(model), want_grads, inside(model, grads=True))
    with model.disable_adapter():  # the base head again
        base = hf.logprobs_in_parts(model, SEQS, max_tokens=4).logprobs
        assert_within(base, hf.logprobs(model, pack, head="logits").logprobs.detach(),
                      inside(model))
    assert (base - step.logprobs).abs().max() > 1e-3


def test_a_lora_head_with_dropout_runs_on_the_models_own_logits():
    """lora_dropout drops the head's input for the adapter only, so its logits are not one
    matrix's: head='hidden' refuses by name; parts take the model's own logits per part
    (dropout active in training, replayed where a part is recomputed)."""
    peft = pytest.importorskip("peft")
    model = hf.prepare(peft.get_peft_model(
        zoo.tiny_model("llama", layers=2).double(),
        peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.1,
                        init_lora_weights=False)))
    pack = TreePack.from_sequences(SEQS)
    model.eval()
    hf.logprobs_in_parts(model, SEQS, max_tokens=4)  # the head read once with dropout off
    model.train()
    with pytest.raises(hf.UnsupportedModel, match="lora_dropout=0.1 in training.*head='logits'"):
        hf.logprobs(model, pack, head="hidden")
    step = hf.backward_in_parts(model, SEQS, sum_loss, max_tokens=4)
    assert step.parts > 1 and any(p.grad is not None for n, p in model.named_parameters()
                                  if "lm_head.lora_B" in n)
    model.eval()  # dropout off: the head's weights again, equal to its own logits
    got = hf.logprobs_in_parts(model, SEQS, max_tokens=4).logprobs
    want = hf.logprobs(model, pack, head="hidden").logprobs
    assert_within(got, want, inside(model))
    assert_within(got, hf.logprobs(model, pack, head="logits").logprobs, inside(model))


# ----------------------------------------------------------- errors a user hits first

def test_backward_in_parts_under_no_grad_says_so():
    model = model_of()
    with torch.no_grad(), pytest.raises(RuntimeError, match="torch.no_grad.*logprobs_in_parts"):
        hf.backward_in_parts(model, SEQS, sum_loss, max_tokens=4)


def test_a_loss_that_is_not_a_tensor_is_named():
    model = model_of()
    with pytest.raises(TypeError, match="loss_fn returned a float.*scalar tensor"):
        hf.backward_in_parts(model, SEQS, lambda o, m: 1.0, max_tokens=4)
    with pytest.raises(TypeError, match="loss_fn returned a float"):
        hf.step_in_parts(model, SEQS, lambda o: 1.0, max_tokens=4)


def test_a_loss_that_does_not_read_the_outputs_is_named():
    model = model_of()
    with pytest.raises(ValueError, match="does not depend on the log-probs"):
        hf.step_in_parts(model, SEQS, lambda o: torch.tensor(1.0), max_tokens=4)


# ----------------------------------------------------------------------------- dropout

def test_step_in_parts_with_dropout_applies_the_gradient_of_the_loss_it_returns():
    """Its two passes draw the same dropout masks: the loss it returns and the gradient it
    applies are those of one draw, the draw backward_in_parts makes from the same seed."""
    model = hf.prepare(zoo.tiny_model("qwen2", layers=2, attention_dropout=0.3,
                                      hidden_dropout=0.0).double())
    model.train()
    runs = {}
    for name in ("step", "backward"):
        torch.manual_seed(0)
        model.zero_grad()
        if name == "step":
            out = hf.step_in_parts(model, SEQS, lambda o: o.logprobs.sum(), max_tokens=4)
        else:
            out = hf.backward_in_parts(model, SEQS, sum_loss, max_tokens=4)
        runs[name] = out, grads_of(model)
    # the same parts on the same draw: float64 sums of the same values in other orders
    torch.testing.assert_close(runs["step"][0].loss, runs["backward"][0].loss,
                               rtol=FLOAT64_EXACT, atol=0)
    assert_grads_equal(runs["step"][1], runs["backward"][1], FLOAT64_EXACT)
    torch.manual_seed(1)  # another draw: another loss (dropout is on)
    other = hf.logprobs_in_parts(model, SEQS, max_tokens=4).logprobs.sum()
    assert abs(float(other) - float(runs["step"][0].loss)) > 1e-6


# ----------------------------------------------------------------------------- MoE

def test_the_router_loss_of_a_whole_step_in_parts_equals_one_forward():
    """output_router_logits: step_in_parts gives its loss the router loss of the step's
    original tokens (outputs.aux_loss), and applies its gradient; logprobs_in_parts returns
    it; backward_in_parts, whose loss sees one part at a time, refuses and names the fix."""
    model = model_of("mixtral")
    pack = TreePack.from_sequences(SEQS)
    model.zero_grad()
    want = hf.logprobs(model, pack, head="hidden", output_router_logits=True)
    (want.logprobs.sum() + 0.5 * want.aux_loss).backward()
    want_grads = grads_of(model)
    assert any("gate" in k for k in want_grads)
    model.zero_grad()
    seen = []
    step = hf.step_in_parts(model, SEQS, lambda o: seen.append(o) or o.logprobs.sum()
                            + 0.5 * o.aux_loss, max_tokens=4, output_router_logits=True)
    # the model's loss function sums in float32, over the rows in another order
    torch.testing.assert_close(seen[0].aux_loss.detach(), want.aux_loss.detach(),
                               rtol=FLOAT32_OP, atol=0)
    assert_grads_equal(grads_of(model), want_grads, inside(model, grads=True))
    scored = hf.logprobs_in_parts(model, SEQS, max_tokens=4, output_router_logits=True)
    torch.testing.assert_close(scored.aux_loss, want.aux_loss.detach(), rtol=FLOAT32_OP, atol=0)
    with pytest.raises(hf.UnsupportedModel, match="router.*step_in_parts"):
        hf.backward_in_parts(model, SEQS, sum_loss, max_tokens=4, output_router_logits=True)
    routed = model_of("mixtral", output_router_logits=True)  # on in the config: the same
    with pytest.raises(hf.UnsupportedModel, match="router.*step_in_parts"):
        hf.backward_in_parts(routed, SEQS, sum_loss, max_tokens=4)
    assert step.parts > 1


# ---------------------------------------------------------------------------- hybrids

def test_a_deep_copy_of_a_prepared_hybrid_runs_after_the_original_is_restored():
    """A reference model copied from a prepared Qwen3.5: restoring the original must not
    take the copy's routing with it."""
    model = hf.prepare(zoo.tiny_model("qwen3_5", layers=2))
    reference = copy.deepcopy(model)
    hf.restore(model)
    pack = TreePack.from_sequences(SEQS)
    out = hf.logprobs(reference, pack)
    hf.prepare(model)
    torch.testing.assert_close(out.logprobs, hf.logprobs(model, pack).logprobs, rtol=0, atol=0)
    hf.restore(reference)
    hf.restore(model)
    assert isinstance(out, TokenLogprobs)


def test_a_padded_keyed_pack_keeps_its_keys_in_parts():
    """Parts rebuild a padded pack without its padding: its content keys come along, so
    rows with equal ids and different keys stay apart."""
    from treepack.adapters.hf.parts.calls import _as_pack

    seqs, keys = [[1, 9, 9, 3], [1, 9, 9, 4]], [[0, 5, 5, 0], [0, 6, 6, 0]]
    padded = TreePack.from_sequences(seqs, keys=keys, pad_to_multiple_of=16)
    rebuilt = _as_pack(padded, torch.device("cpu"))
    plain = TreePack.from_sequences(seqs, keys=keys)
    assert rebuilt.num_rows == plain.num_rows == 7
    assert rebuilt.host.row_keys.tolist() == plain.host.row_keys.tolist()
