"""Sequence parallelism on a tree: 2, 3 and 4 gloo ranks against one process (float64).

Each spawn runs many cases (a case: a model, a batch, a call, a group size); every rank saves
what it got, and the tests compare every rank with the same loss in one process: the whole
pack in one forward and, for label-aligned cases, every sequence run alone. Negative controls
run the same cases with one thing broken and must differ.
"""

import numpy as np
import pytest
import torch

import sp_workers
from launch import spawn
from tolerance import FLOAT64_EXACT, inside, within

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")

TWO = {
    "grpo and agents, temperatures": dict(temperatures=True),
    "logits head, prediction alignment": dict(head="logits", align="prediction"),
    "dense backend": dict(backend="dense", batch="small"),
    "activation checkpointing": dict(checkpointing=True, batch="small"),
    "sliding window and soft-capping (gemma2)": dict(family="gemma2", batch="small"),
    "gated deltanet and convolutions (qwen3.5)": dict(family="qwen3_5", batch="small"),
    "short convolutions (lfm2)": dict(family="lfm2", batch="small"),
    "backward in parts": dict(call="backward", budget=16, temperatures=True),
    "step in parts": dict(call="step", budget=16),
    "log-probs in parts": dict(call="score", budget=16),
    "hybrid in parts": dict(family="qwen3_5", call="backward", budget=8, batch="small"),
    "attention sinks, windows and moe (gpt-oss)": dict(family="gpt_oss", batch="small"),
    "attention sinks in parts (gpt-oss)": dict(family="gpt_oss", call="backward", budget=16,
                                               batch="small"),
    "chunked attention, no-rope temperature (llama 4)": dict(family="llama4_text",
                                                             batch="small"),
    "mamba2 (bamba): per-head A and D, B and C shared by groups": dict(family="bamba",
                                                                     batch="small"),
    "mamba2 in parts (nemotron-h)": dict(family="nemotron_h", call="backward", budget=8,
                                         batch="small"),
    "kimi delta attention, a gate per key channel (kimi-linear)": dict(family="kimi_linear",
                                                                       batch="small"),
    "lightning attention, a decay per head (minimax)": dict(family="minimax",
                                                            batch="small"),
    "mamba (jamba): per-channel A, B and C shared by every channel": dict(family="jamba",
                                                                          batch="small"),
    "mamba in parts, two scans a layer (zamba)": dict(family="zamba", call="backward",
                                                      budget=8, batch="small"),
    "moe router loss, routing summed over the group (mixtral)": dict(family="mixtral",
                                                                     router=True),
    "chunked attention in parts (llama 4)": dict(family="llama4_text", call="backward",
                                                 budget=16, batch="small"),
    "broken: no gradient back through the return exchange":
        dict(broken="no_return_backward", batch="small"),
    "broken: every rank computes the same rows": dict(broken="same_rows", batch="small"),
    "broken: rotary at each slice's own index": dict(broken="slice_positions", batch="small"),
    "images (qwen2-vl)": dict(family="qwen2_vl", batch="images", temperatures=True),
    "images, deepstack (qwen3-vl)": dict(family="qwen3_vl", batch="images"),
    "images in parts (qwen3-vl)": dict(family="qwen3_vl", batch="images", call="backward",
                                       budget=16),
    "images whose tokens see each other both ways (gemma 3)": dict(family="gemma3",
                                                                   batch="images"),
    "broken: image features and positions of rank 0's rows":
        dict(family="qwen2_vl", batch="images", broken="image_rows_from_zero"),
    "broken: image rows at depth positions":
        dict(family="qwen2_vl", batch="images", broken="image_depth_positions"),
}

FOUR = {
    "sp 2 x dp 2": dict(group=2, average_over="world", temperatures=True),
    "sp 2 x dp 2 in parts": dict(group=2, average_over="world", call="backward", budget=16),
    "sp 4, fewer key/value heads than ranks": dict(group=4),
    "sp 4, fewer rows than ranks": dict(group=4, batch="tiny"),
    "sp 4, images (qwen2-vl)": dict(group=4, family="qwen2_vl", batch="images"),
}

# float64 throughout (the Gated DeltaNet kernels too: sp_workers.case_model). Where a model
# rounds to float32 inside (its norms' variance, gates, a float32 decay), its values are
# float32-accurate and its gradients too (the backward of a float32 cast rounds them):
# tolerance.inside derives both from the model.
_ALLOWANCES: dict = {}


def allowances(case: dict) -> tuple[float, float]:
    """(values, gradients): the relative error a case's model allows, computed two ways."""
    family = case.get("family", "llama")
    if family not in _ALLOWANCES:
        with sp_workers.case_model({"family": family}) as model:
            _ALLOWANCES[family] = inside(model), inside(model, grads=True)
    return _ALLOWANCES[family]


def run(cases: dict, world: int, tmp_path) -> list[dict]:
    spawn(sp_workers.cases_worker, str(tmp_path), cases, world=world)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run(TWO, 2, tmp_path_factory.mktemp("sp2"))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run(FOUR, 4, tmp_path_factory.mktemp("sp4"))


def differences(got: dict, expect: dict) -> dict:
    """Each output's and gradient's largest difference, relative to the largest value."""
    out = {}
    for key in ("logprobs", "entropy", "loss"):
        if got.get(key) is not None and expect.get(key) is not None:
            scale = expect[key].abs().max().clamp_min(1e-30)
            out[key] = ((got[key] - expect[key]).abs().max() / scale).item()
    assert got["grads"].keys() == expect["grads"].keys() or not got["grads"]
    for k, g in got["grads"].items():
        e = expect["grads"][k]
        out[k] = ((g - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
    return out


def assert_equal(got: dict, expect: dict, allowed: tuple[float, float], what: str) -> None:
    """Every output within ``allowed[0]`` and every gradient within ``allowed[1]`` of its
    largest value."""
    assert "error" not in got, got.get("error")
    bad = {k: v for k, v in differences(got, expect).items()
           if not within(v, allowed[0] if k in ("logprobs", "entropy", "loss") else allowed[1])}
    assert not bad, f"{what}: {bad}"


def case_names(cases):
    return [n for n in cases if not n.startswith("broken")]


@pytest.mark.parametrize("name", case_names(TWO))
def test_two_ranks_equal_one_process_and_every_sequence_alone(two, name):
    case = TWO[name]
    expect = sp_workers.reference(case)
    for rank, results in enumerate(two):
        got = results[name]
        if case.get("call") == "score":  # no gradients
            got = {**got, "grads": {}}
        assert_equal(got, expect["pack"], allowances(case), f"rank {rank} vs one forward")
        if "alone" in expect and case.get("call") != "score":
            assert_equal({**got, "loss": None}, expect["alone"], allowances(case),
                         f"rank {rank} vs alone")


@pytest.mark.parametrize("name", [n for n in TWO if n.startswith("broken")])
def test_negative_controls_are_caught(two, name):
    expect = sp_workers.reference(TWO[name])["pack"]
    got = two[0][name]
    assert "error" not in got, got.get("error")
    worst = max(differences(got, expect).values())
    assert worst > 1e-4, f"{name} went unnoticed: {worst}"


@pytest.mark.parametrize("name", list(FOUR))
def test_four_ranks(four, name):
    case = FOUR[name]
    size = case.get("group", 4)
    refs = [sp_workers.reference(case, seed) for seed in range(4 // size)]
    for rank, results in enumerate(four):
        got, expect = results[name], refs[rank // size]["pack"]
        if case.get("average_over") == "world":  # DDP's average over both batches' grads
            grads = {k: sum(r["pack"]["grads"][k] for r in refs) / len(refs)
                     for k in expect["grads"]}
            expect = {**expect, "grads": grads}
        assert_equal(got, expect, allowances(case), f"rank {rank}")
        if case.get("batch") == "images":  # images: every sequence alone too
            assert_equal({**got, "loss": None}, refs[0]["alone"], allowances(case),
                         f"rank {rank} vs alone")


@pytest.mark.parametrize("ranks, budget", [(2, None), (4, None), (2, 16)])
def test_images_cases_split_an_image_between_ranks(ranks, budget):
    """The images batch puts a rank boundary inside an image's placeholder rows (of the pack,
    and of a part in parts): two ranks each place part of one image's features."""
    from treepack.planning.parts import split

    model = sp_workers.model_for({"family": "qwen2_vl"})
    pack, extra = sp_workers.inputs(model, {"batch": "images"}, 0)
    images = extra["images"]
    feature = np.full(pack.num_rows, -1)
    for rows, f in zip(pack.host.rows, images.features):
        feature[rows[:len(f)]] = f
    image = np.where(feature >= 0,
                     np.searchsorted(images.feature_start, feature, side="right") - 1, -1)
    forwards = [np.arange(pack.num_rows)] if budget is None else \
        [part.rows for part in split(pack, budget).parts]
    inside = []
    for rows in forwards:
        width = -(-len(rows) // ranks)  # SequenceParallel.share
        inside += [b for b in range(width, len(rows), width)
                   if image[rows[b]] >= 0 and image[rows[b - 1]] == image[rows[b]]]
    assert inside, (ranks, budget)


def test_refusals_name_the_problem_on_every_rank(tmp_path):
    spawn(sp_workers.refusals_worker, str(tmp_path), world=3)
    for rank in range(3):
        errors = torch.load(tmp_path / f"rank{rank}.pt")
        assert "different packs" in errors["different packs"] and \
            "same pack" in errors["different packs"]
        assert "different packs" in errors["parts, different packs"]
        assert "4 attention heads" in errors["heads"] and "3 ranks" in errors["heads"]
        if rank:
            assert "not a member" in errors["not a member"]
        assert errors["not a group"].startswith("TypeError") and \
            "ProcessGroup" in errors["not a group"]
        if rank < 2:
            assert "output_router_logits=False" in errors["router"]


# ------------------------------------------------ every rank agrees, or every rank refuses

# what each rank's message must say; every rank must raise, none may hang
MISMATCHES = {
    "parts budgets 9 vs 10 (backward)": ("Disagreement", ["parts", "max_tokens=9",
                                                          "max_tokens=10"]),
    "parts budgets 9 vs 10 (step)": ("Disagreement", ["max_tokens=9", "max_tokens=10"]),
    "parts budgets 9 vs 10 (scores)": ("Disagreement", ["max_tokens=9", "max_tokens=10"]),
    "parts budgets 6 vs 9": ("Disagreement", ["max_tokens=6", "max_tokens=9"]),
    "recompute": ("Disagreement", ["recompute (rank 0: False, rank 1: True)"]),
    "call": ("Disagreement", ["call (rank 0: 'logprobs', rank 1: 'logprobs_in_parts')"]),
    "temperature": ("Disagreement", ["temperature (rank 0: 1.0 for each of 5, "
                                     "rank 1: 0.5 for each of 5)"]),
    "align": ("Disagreement", ["align (rank 0: 'label', rank 1: 'prediction')"]),
    "entropy": ("Disagreement", ["entropy (rank 0: False, rank 1: True)"]),
    "head": ("Disagreement", ["head (rank 0: 'auto', rank 1: 'logits')"]),
    "head_dtype": ("Disagreement", ["head_dtype (rank 0: None, rank 1: torch.float64)"]),
    "a bad keyword on one rank": ("ValueError", ["output_attentions=True"]),
    "a bad temperature on one rank": ("ValueError", ["temperature", "-1.0"]),
    "no gradients on one rank": ("Disagreement", ["gradients (rank 0: False, rank 1: True)",
                                                  "torch.no_grad()"]),
    "weights seeded per rank": ("Disagreement", ["weights (rank 0: checksum",
                                                 "different weights"]),
    "packs alike in size": ("Disagreement", ["different packs", "same pack",
                                             "rank 0: 35 rows, rank 1: 35 rows",
                                             "different in contents or order"]),
    "images left out on one rank": ("UnsupportedModel", ["placeholder", "images="]),
}
REFUSED_ON = {"a bad keyword on one rank": 1, "a bad temperature on one rank": 1,
              "images left out on one rank": 1}


@pytest.fixture(scope="module")
def agreement(tmp_path_factory):
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("agreement")
    spawn(sp_workers.agreement_worker, str(out), world=2, timeout=600)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_ranks_that_disagree_or_refuse_raise_on_every_rank(agreement, name):
    """Before any exchange: ranks given different arguments raise a Disagreement naming the
    field and each rank's value; a rank that refuses makes every rank raise its error's type
    (verl's engine falls back on UnsupportedModel: every rank must), naming it."""
    kind, words = MISMATCHES[name]
    for rank, results in enumerate(agreement):
        got = results[name]
        assert got is not None, f"rank {rank} ran {name!r} without an error"
        assert got[0] == kind, (rank, got)
        for word in words:
            assert word in got[1], (rank, word, got[1])
        if name in REFUSED_ON and rank != REFUSED_ON[name]:
            assert f"rank {REFUSED_ON[name]} of the sequence_parallel group refused" in got[1]


def test_an_agreeing_call_runs_one_all_gather_before_its_first_exchange(agreement):
    for results in agreement:
        assert results["collectives"] == {"all_gather": 1, "all_gather_object": 0,
                                          "before_exchange": 1}


@pytest.mark.parametrize("where", ["alone", "sequence parallel"])
def test_head_dtype_with_a_head_treepack_cannot_read_is_refused_by_name(agreement, where):
    """A LoRA adapter with dropout on the LM head, in train mode: head_dtype is refused the
    same way with and without sequence parallelism (before: ignored alone, an
    AttributeError under SP)."""
    for results in agreement:
        kind, message = results[f"head_dtype, lora head, {where}"]
        assert kind == "UnsupportedModel"
        assert "head_dtype=torch.float32" in message and "lora_dropout=0.1" in message


@pytest.fixture(scope="module")
def dropout(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropout")
    spawn(sp_workers.dropout_worker, str(out), world=2, timeout=600)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_each_rank_draws_its_own_dropout_masks(dropout):
    """Seeded alike, the ranks drew one mask for row i on rank 0 and row i + w on rank 1;
    each now draws from its own stream (as in one process, the masks of different rows are
    independent)."""
    first, second = (r["mask"] for r in dropout)
    assert first.shape == second.shape and first.any() and second.any()
    assert not torch.equal(first, second)
    agree = (first == second).double().mean().item()  # independent at p = 0.3: 0.58
    assert agree < 0.75, agree


@pytest.mark.parametrize("name", ["whole, checkpointed", "parts, recompute=False",
                                  "parts, recompute=True", "step in parts"])
def test_recomputation_replays_each_ranks_dropout(dropout, name):
    """Activation checkpointing, the parts' recomputed forwards and step_in_parts' second
    pass draw the same masks as the forward they repeat: their gradients equal the plain
    run's (with dropout on, a replay that drew new masks would be off by O(1)). GPT-2
    computes in float64 throughout (tolerance.inside): FLOAT64_EXACT."""
    for results in dropout:
        reference = results["whole" if name.startswith("whole") else "parts, recompute=False"]
        got = results[name]
        assert got.keys() == reference.keys()
        for k, g in got.items():
            scale = reference[k].abs().max().clamp_min(1e-30)
            assert within((g - reference[k]).abs().max() / scale, FLOAT64_EXACT), (name, k)
