"""The census (treepack.face.census, `treepack verify --all`): each family's class, in a
process of its own, with a timeout."""

import pytest

pytest.importorskip("transformers")

from treepack.face import census  # noqa: E402


@pytest.mark.parametrize("family,status,words", [
    ("llama", "exact", "logprobs"),
    ("minicpm3", "exact", "grads"),  # its float32 norm's rounding: docs/models.md
    ("codegen", "exact", "logprobs"),  # a config without pad_token_id (used to crash)
    ("doge", "refused", "attention mask"),  # a learned bias in its mask
    ("roberta", "refused", "padding_idx"),  # positions from padding_idx + 1
    ("falcon_h1", "exact", "grads"),  # its 256-row chunks: the tree's levels scan short
    ("bamba", "exact", "grads"),  # with an attention layer (attn_layer_indices)
    ("nemotron_h", "exact", "grads"),
    ("qwen3_next", "exact", "grads"),  # each layer kind once (layer_types)
    # attention sinks (s_aux), with GPT-OSS's alternating windows and MoE
    ("gpt_oss", "exact", "grads"),
    ("granite_swa", "exact", "grads"),
    ("mimo_v2_flash", "exact", "grads"),
    ("flint", "exact", "grads"),
    # chunked attention (chunks of 5 depths here); its float32 internals' rounding within
    # the floor of one padded batch (tests/adapters/test_hf.py runs them in float64: exact)
    ("llama4_text", "exact", "grads"),
    # the other families issue 35 names: refused by name
    # DeepSeek sparse attention: the indexer's top-k over each query's ancestors (16 index
    # heads: with 4, ReLU scores tie at 0 and even transformers' own two paths disagree)
    ("glm_moe_dsa", "exact", "grads"),
    ("deepseek_v32", "exact", "grads"),
    ("hy_v4", "refused", "indexed attention) and a sliding window"),
    ("deepseek_v4", "refused", "compressed_attention"),
    # Mamba (v1)'s selective scan, level by level: alone, with norms, beside attention and
    # MoE, and two scans a layer beside a shared attention block (6 layers: its period)
    ("mamba", "exact", "grads"),
    ("falcon_mamba", "exact", "grads"),
    ("jamba", "exact", "grads"),
    ("zamba", "exact", "grads"),
    ("mamba2", "exact", "grads"),
    ("kimi_linear", "exact", "grads"),  # Kimi Delta Attention: a gate per key channel
    ("bailing_hybrid", "exact", "grads"),  # the same scan
    ("minimax", "exact", "grads"),  # lightning attention, inline in its layer
    ("no_such_family", "not built", "KeyError"),
])
def test_each_family_gets_its_class_and_reason(family, status, words):
    out = census.run_one(family)
    assert (out.status, out.family) == (status, family), out
    assert words in out.reason, out


@pytest.mark.parametrize("family,status,words", [
    # images through treepack.hf.Images, each distinct image encoded once, against every
    # sequence alone with its own images
    ("qwen2_vl", "exact", "grads"),
    ("qwen3_vl_moe", "exact", "grads"),  # deepstack features, MoE decoder
    ("qwen3_5_moe", "exact", "grads"),  # Gated DeltaNet hybrid with MoE
    ("llava", "exact", "grads"),  # whole images, 1-D positions
    ("gemma3", "exact", "grads"),  # an image's tokens see the whole image: blocks
    ("paligemma", "refused", "not causal"),  # its prefix attends both ways
    ("idefics3", "refused", "treepack runs the images of"),
])
def test_each_image_family_gets_its_class_and_reason(family, status, words):
    out = census.run_one(family, "image-text-to-text")
    assert (out.status, out.family) == (status, family), out
    assert words in out.reason, out


def test_a_family_runs_in_its_own_process_and_a_timeout_is_reported():
    """The child's answer crosses the process boundary; one that takes too long is stopped
    and reported (a hang once built, not built before), and the others still get theirs."""
    done = census.census(["llama", "doge"], timeout=300)
    assert [(o.family, o.status) for o in done] == [("llama", "exact"), ("doge", "refused")]
    done = census.census(["llava"], timeout=300, mapping="image-text-to-text")
    assert [(o.family, o.status) for o in done] == [("llava", "exact")]
    slow = census._child("llama", timeout=0.01)  # not even built in time
    assert slow.status == "not built" and "building the model took" in slow.reason, slow


def test_the_table_counts_every_class():
    rows = [census.Outcome("a", "exact", "logprobs 1e-16"), census.Outcome("b", "refused", "x|y"),
            census.Outcome("c", "wrong", "grads 1e-2")]
    text = census.table(rows)
    assert "causal-lm: 3 families: 1 exact, 1 refused, 0 not built, 1 wrong, 0 crash, 0 hang" \
        in text
    assert "| b | refused | x/y |" in text  # a pipe in a reason does not break the table


@pytest.mark.slow
def test_the_census_finds_nothing_wrong_crashed_or_hung():
    """Every family of the installed transformers' causal-LM and image-text-to-text mappings
    is exact, refused with its reason, or not built with why: none silently wrong, none
    crashed, none hung."""
    outcomes = census.census(timeout=240)
    bad = [o for o in outcomes if o.status in ("wrong", "crash", "hang")]
    assert not bad, census.table(bad)
    assert sum(o.status == "exact" for o in outcomes) >= 110, census.table(outcomes)
    images = census.census(timeout=240, mapping="image-text-to-text")
    bad = [o for o in images if o.status in ("wrong", "crash", "hang")]
    assert not bad, census.table(bad, "image-text-to-text")
    assert sum(o.status == "exact" for o in images) >= 7, census.table(images)
