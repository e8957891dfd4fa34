"""treepack.verl against verl's real FSDP engine (CPU, gloo): the stock engine and
TreepackEngine, built from the same checkpoint, must give the same log-probs, entropies,
losses and gradients. Runs where verl is installed (`.ci/run` makes a `.venv-verl`)."""

import subprocess
import sys

import warnings

import numpy as np
import pytest

pytest.importorskip("verl", reason="verl tests run in the verl environment (.ci/run)")
torch = pytest.importorskip("torch")
import torch.multiprocessing as mp  # noqa: E402

# verl announces each optional engine it cannot import (torchtitan, megatron, ...)
warnings.filterwarnings("ignore", message=".* engine is not available")

import verl_trainer_path  # noqa: E402
import verl_workers  # noqa: E402  (installs the CPU platform)
from launch import free_port, run_python  # noqa: E402
from tolerance import FLOAT64_OP, within  # noqa: E402
from verl_workers import TOLERANCE  # noqa: E402


def spawn(fn, world, *args):
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return verl_workers.make_model_dir(str(tmp_path_factory.mktemp("verl")))


@pytest.fixture(scope="module")
def trainer_batches(model_dir, tmp_path_factory):
    """Each world size's worker batches, made by verl's trainer code with Ray and
    TransferQueue running (in a subprocess: Ray stays out of the ranks' parent)."""
    root = tmp_path_factory.mktemp("trainer")
    code = ("import sys, verl_workers, verl_trainer_path as t\n"
            "for world in (1, 2):\n"
            f"    t.trainer_batches({model_dir!r}, world, f'{root}/batches{{world}}.pt')\n"
            f"t.trainer_batches({model_dir!r}, 2, '{root}/long2.pt', scale=4)\n"
            f"t.trainer_batches({model_dir!r}, 1, '{root}/long1.pt', scale=4)\n")
    run_python(code)
    return {**{world: str(root / f"batches{world}.pt") for world in (1, 2)},
            "long": str(root / "long2.pt"), "long1": str(root / "long1.pt")}


@pytest.mark.parametrize("world", [1, 2])
def test_verl_worker_on_the_trainers_batches_equals_stock(world, model_dir, trainer_batches,
                                                         tmp_path):
    """verl's ActorRolloutRefWorker (actor and ref), built from the docs' GRPO command, fed
    what the v1 trainer (agent-loop rows through TransferQueue, multi_modal_inputs={} on every
    row) and the v0 trainer (left_right_2_no_padding) hand it: compute_log_prob,
    compute_ref_log_prob, update_actor, compute_log_prob again, equal to stock verl."""
    batches = torch.load(trainer_batches[world], weights_only=False)
    for path in ("v1", "v0"):  # every GRPO group and agent prompt stayed on one rank
        metrics = batches[path]["metrics"]
        assert metrics["treepack/groups_split_ranks"] == 0, (path, metrics)
        # and in one mini-batch, but for v1's agent prompt at 2 ranks: its 8 rows (4 sessions
        # x 2 outputs) exceed a rank's mini-batch of 4
        forced = int(path == "v1" and world == 2)
        assert metrics["treepack/groups_split_minibatches"] == forced, (path, metrics)
    out = tmp_path / "result.pt"
    spawn(verl_trainer_path.compare_workers, world, model_dir, trainer_batches[world], str(out))
    r = torch.load(out, weights_only=False)
    assert r["engines_tree"] == ("TreepackEngine", "TreepackEngine"), r["engines_tree"]
    assert r["engines_stock"] == ("FSDPEngineWithLMHead", "FSDPEngineWithLMHead")
    assert not any("stock engine path" in m for m in r["messages"]), r["messages"]
    for path in ("v1", "v0"):
        tree, stock = r["tree", path], r["stock", path]
        assert_worker_equals_stock(tree, stock, path)
        ratios = tree["update_metrics"]["treepack/token_ratio"]
        assert ratios and all(0 < x < 1 for x in ratios), (path, ratios)
        # where sharing was lost, summed over ranks (treepack.sharing): v1's rows carry their
        # uid and prompts, and its agent sessions' later turns (prompts holding each
        # session's history) are no false forks; no tree was split
        m = tree["update_metrics"]
        for ideal, achievable, achieved in zip(m["treepack/ideal_ratio"],
                                               m["treepack/achievable_ratio"],
                                               m["treepack/achieved_ratio"]):
            assert 0 < ideal <= achievable <= achieved < 1, (path, m)
        assert set(m["treepack/lost_rows/split_and_repeat"]) == {0.0}, (path, m)
        if path == "v1":  # the rows carry session_id: every later turn extends the last
            assert set(m["treepack/lost_rows/false_forks"]) == {0.0}, m
            assert set(m["treepack/session_forks/sessions"]) == {0.0}, m
            assert set(m["treepack/session_forks/rows"]) == {0.0}, m
        else:  # v0's rows carry no session
            assert "treepack/session_forks/rows" not in m, m
        log_prob_ratio = tree["update_metrics"]["treepack/log_prob_token_ratio"]
        assert log_prob_ratio and all(0 < x < 1 for x in log_prob_ratio), log_prob_ratio
        assert "treepack/log_prob_token_ratio" not in stock["update_metrics"]
        # verl's own PrefixGrouper switch changes nothing in verl 0.9.1's engine: every output
        # is stock's, bit for bit (no prefix is shared; docs/integrations.md compares)
        grouper = r["prefix_grouper", path]
        for key in ("log_probs", "entropy", "ref_log_probs", "log_probs_after"):
            assert all(torch.equal(a, b) for a, b in zip(grouper[key], stock[key])), (path, key)


def rerender_a_later_turn(batches_path: str, out_path: str, depth: int) -> int:
    """The trainer's v1 batches (every call's, every rank's) with one agent session's second
    turn re-rendered: its prompt's token at ``depth``, inside the first turn's response (past
    the agent group's shortest prompt, the system prompt), changed. Saved without v0; returns
    the first turn's length, all of which the second turn's prompt held."""
    batches = torch.load(batches_path, weights_only=False)
    changed, first = 0, None
    for call in ("log_prob", "ref", "update"):
        for td in batches["v1"][call]:
            rows = [i for i, (uid, session) in enumerate(zip(td["uid"], td["session_id"]))
                    if uid.startswith("a") and session == 1]
            if not rows:
                continue
            plen = td["prompts"].offsets().diff()
            lengths = td["input_ids"].offsets().diff()
            turn0, turn1 = sorted(rows, key=lambda i: int(plen[i]))
            assert plen[turn0] <= depth < lengths[turn0], (plen[turn0], lengths[turn0])
            for key in ("input_ids", "prompts"):
                at = int(td[key].offsets()[turn1]) + depth
                values = td[key].values()
                values[at] = 4 + (int(values[at]) - 3) % (verl_workers.VOCAB - 4)
            first, changed = int(lengths[turn0]), changed + 1
    assert changed == 3, changed  # the session's rank, in each call
    torch.save({"v1": batches["v1"]}, out_path)
    return first


def test_verl_worker_reports_a_re_rendered_later_turn_of_a_session(model_dir, trainer_batches,
                                                                   tmp_path):
    """verl v1's agent-loop rows carry ``session_id``: the engine reads ``{uid}_{session_id}``
    as sessions, so a later turn whose re-rendered history no longer extends the previous
    turn's ids (invisible to the false forks: it differs past the group's shortest prompt) is
    logged, summed over the ranks, as one forked session and the rows its forest loses;
    outputs and update still equal stock verl's (2 ranks)."""
    depth = 11  # the agent prompt's system prompt is 10 tokens
    batches = tmp_path / "rerendered.pt"
    first = rerender_a_later_turn(trainer_batches[2], str(batches), depth)
    out = tmp_path / "result.pt"
    spawn(verl_trainer_path.compare_workers, 2, model_dir, str(batches), str(out))
    r = torch.load(out, weights_only=False)
    assert not any("stock engine path" in m for m in r["messages"]), r["messages"]
    tree = r["tree", "v1"]
    assert_worker_equals_stock(tree, r["stock", "v1"], "v1")
    m = tree["update_metrics"]
    assert set(m["treepack/lost_rows/false_forks"]) == {0.0}, m
    # one mini-batch holds the session, and each rank reports the sum over ranks (verl lists
    # every rank's metrics of every mini-batch); the second turn shares `depth` of the first
    # turn's rows instead of all of them
    for name, value in (("sessions", 1), ("rows", first - depth)):
        got = list(m[f"treepack/session_forks/{name}"])
        assert set(got) == {0.0, value} and got.count(value) == 2, (name, value, got)


def assert_worker_equals_stock(tree, stock, path):
    """compare_workers' outputs and update metrics of one trainer path within TOLERANCE."""
    for key in ("log_probs", "entropy", "ref_log_probs", "log_probs_after"):
        error = verl_workers.relative_error(tree[key], stock[key])
        assert within(error, TOLERANCE), (path, key, error)
    # verl normalises these by global token counts: independent of micro-batching
    # (pg_clipfrac and ppo_kl are means over micro-batches, which packing changes)
    for key in ("loss", "grad_norm", "actor/pg_loss", "kl_loss", "actor/entropy_loss"):
        got, want = (m["update_metrics"][key] for m in (tree, stock))
        error = verl_workers.metric_error(got, want)
        assert within(error, TOLERANCE), (path, key, got, want)


def test_verl_worker_under_ulysses_packs_and_equals_stock(model_dir, trainer_batches,
                                                         tmp_path):
    """verl's worker from the docs' command with ulysses_sequence_parallel_size=2 on 2 ranks
    (one data-parallel share, held by both): treepack packs (no fallback), each rank embeds
    only its slice of every pack's rows, and compute_log_prob, compute_ref_log_prob,
    update_actor and compute_log_prob again equal stock verl without sequence parallelism on
    the same share. (Stock verl's own Ulysses is no reference on a CPU: its patch wraps only
    flash attention, so with sdpa each rank would attend within its own slice.)"""
    stock, tree = tmp_path / "stock.pt", tmp_path / "tree.pt"
    spawn(verl_trainer_path.compare_ulysses, 1, model_dir, trainer_batches[1], str(stock), 1)
    spawn(verl_trainer_path.compare_ulysses, 2, model_dir, trainer_batches[1], str(tree), 2)
    stock, tree = (torch.load(p, weights_only=False) for p in (stock, tree))
    assert tree["engines"] == ("TreepackEngine", "TreepackEngine"), tree["engines"]
    assert tree["sp"] == (2, 2) and stock["sp"] == (1, 1), (tree["sp"], stock["sp"])
    assert not any("stock engine path" in m for m in tree["messages"]), tree["messages"]
    for path in ("v1", "v0"):
        assert_worker_equals_stock(tree[path], stock[path], path)
        ratios = tree[path]["update_metrics"]["treepack/token_ratio"]
        assert ratios and all(0 < x < 1 for x in ratios), (path, ratios)
        assert tree[path]["update_metrics"]["treepack/log_prob_token_ratio"]
    # every forward of both ranks: a slice of ceil(T'/2) rows, and the embedding took it
    ranks = tree["ranks"]
    assert ranks[0]["slices"] and len(ranks[0]["slices"]) == len(ranks[1]["slices"])
    for (total, own0, width0), (total1, own1, width1) in zip(ranks[0]["slices"],
                                                             ranks[1]["slices"]):
        assert total == total1 and width0 == width1 == -(-total // 2), (total, width0)
        assert own0 + own1 == total, (total, own0, own1)
    for r in ranks:
        assert_embeds_slices(r)


def assert_embeds_slices(rank: dict) -> None:
    """Every forward's embedding took the rank's slice of the pack's rows: the slices' widths
    in order, besides forwards of a row or two (treepack's head check, FSDP's one-row
    forward that reduce-scatters after parts)."""
    widths = iter(width for _, _, width in rank["slices"])
    expected, extra = next(widths, None), []
    for rows in rank["embedded"]:
        if rows == expected:
            expected = next(widths, None)
        else:
            extra.append(rows)
    assert expected is None, ("a slice was not embedded", rank)
    assert all(rows <= 3 for rows in extra), (extra, rank)


def test_verl_worker_under_ulysses_runs_trees_over_its_budget_in_parts(model_dir,
                                                                      trainer_batches,
                                                                      tmp_path):
    """The long batches' GRPO trees (about 200 rows) under Ulysses on 2 ranks at 64 tokens a
    rank (128 a forward, verl's Ulysses budget): each tree runs in parts, each part's rows
    split over the two ranks; equal to stock verl without sequence parallelism at 128."""
    stock, tree = tmp_path / "stock.pt", tmp_path / "tree.pt"
    spawn(verl_trainer_path.compare_ulysses, 1, model_dir, trainer_batches["long1"], str(stock),
          1, 128)
    spawn(verl_trainer_path.compare_ulysses, 2, model_dir, trainer_batches["long1"], str(tree),
          2, 64)
    stock, tree = (torch.load(p, weights_only=False) for p in (stock, tree))
    assert not any("is split" in m or "stock engine path" in m for m in tree["messages"]), \
        tree["messages"]
    for path in ("v1", "v0"):
        assert_worker_equals_stock(tree[path], stock[path], path)
        assert np.ravel(tree[path]["log_prob_metrics"]["treepack/parts"]).max() > 1, path
        assert np.ravel(tree[path]["update_metrics"]["treepack/parts"]).max() > 1, path
    ranks = tree["ranks"]
    assert ranks[0]["slices"] and all(total <= 128 for total, _, _ in ranks[0]["slices"]), \
        ranks[0]["slices"]
    for r in ranks:
        assert_embeds_slices(r)


def test_verl_worker_runs_trees_over_its_budget_in_parts(model_dir, trainer_batches, tmp_path):
    """The same worker on the trainer's batches with GRPO prompts and responses 4x as long,
    at a 128-token budget (the longest row: stock verl refuses a row longer than its budget):
    the GRPO groups' trees exceed it (about 200 rows), so the worker's log-prob and update
    calls run each rank's trees in parts, under the docs' strategy=fsdp2; equal to stock
    verl, which splits them into micro-batches (2 ranks)."""
    out = tmp_path / "result.pt"
    spawn(verl_trainer_path.compare_workers, 2, model_dir, trainer_batches["long"], str(out), 128)
    r = torch.load(out, weights_only=False)
    assert not any("is split" in m or "stock engine path" in m for m in r["messages"]), \
        r["messages"]
    for path in ("v1", "v0"):
        tree = r["tree", path]
        assert_worker_equals_stock(tree, r["stock", path], path)
        parts = tree["update_metrics"]["treepack/parts"]
        assert parts and max(parts) > 1, (path, parts)  # the update ran in parts
        # every row once: no rows lost to split packs, the achieved ratio the achievable one
        m = tree["update_metrics"]
        assert set(m["treepack/lost_rows/split_and_repeat"]) == {0.0}, (path, m)
        assert m["treepack/achieved_ratio"] == m["treepack/achievable_ratio"], (path, m)
        parts = np.ravel(tree["log_prob_metrics"]["treepack/parts"])
        assert parts.size and parts.max() > 1, (path, parts)  # and the log-prob pass


def assert_equals_stock(r, grads="grads"):
    """compare_engines' results within TOLERANCE: outputs, gradients (relative to each
    tensor's largest, or with ``grads_over_model`` the model's), losses and the step."""
    for key in ("log_probs_scalar", "entropy_scalar", "log_probs_per_row", "entropy_per_row",
                "log_probs_fixed_size", f"{grads}_token-mean", f"{grads}_seq-mean-token-mean",
                "log_probs_after_step"):
        assert within(r[key], TOLERANCE), (key, r[key])
    for key in ("loss_token-mean", "loss_seq-mean-token-mean", "grad_norm"):
        got, want = r[key]
        assert within(abs(got - want), TOLERANCE * abs(want)), (key, got, want)


@pytest.mark.parametrize("world,strategy", [(1, "fsdp2"), (2, "fsdp2"), (2, "fsdp")])
def test_verl_engine_equals_stock_engine(world, strategy, model_dir, tmp_path):
    out = tmp_path / "result.pt"
    spawn(verl_workers.compare_engines, world, model_dir, strategy, str(out))
    r = torch.load(out)
    assert r["registered"] == "TreepackEngine"
    assert_equals_stock(r)
    assert r["grad_names_token-mean"] and r["model_output_dropped"]
    # every rank runs as many micro-batches; the shared prefixes were packed once
    assert len({run for run, _ in r["micro_batches"]}) == 1, r["micro_batches"]
    assert all(0 < ratio < 1 for ratio in r["token_ratio"]), r["token_ratio"]
    # the agent rows need more packs than the GRPO rows: the other rank splits packs, so
    # every micro-batch is real and verl's per-index metric aggregation works as for stock
    assert all(run == packed for run, packed in r["micro_batches"]), r["micro_batches"]
    assert r["metrics_tree"].keys() == r["metrics_stock"].keys() and r["metrics_tree"]


@pytest.mark.parametrize("world,strategy", [(1, "fsdp2"), (2, "fsdp2"), (2, "fsdp")])
def test_verl_engine_runs_trees_over_budget_in_parts(world, strategy, model_dir, tmp_path):
    """A budget of 64 tokens splits the 9-rollout GRPO group: under FSDP2 and FSDP1 the
    engine runs every rank's trees in parts (each row once; log-probs, then verl's loss on
    them, then the parts' backward with its gradient), equal to the stock engine."""
    out = tmp_path / "result.pt"
    spawn(verl_workers.compare_engines, world, model_dir, strategy, str(out), False, 64)
    r = torch.load(out)
    assert_equals_stock(r)
    assert r["parts"] and r["parts"][0] > 1 and not r["messages"], r
    assert r["micro_batches"] == [(1, 1)] * world  # one micro-batch a rank, in parts


@pytest.mark.parametrize("world,budget,strategy", [(1, None, "fsdp2"), (2, None, "fsdp2"),
                                                   (2, 64, "fsdp2"), (2, 64, "fsdp")])
def test_verl_engine_on_a_hybrid_qwen3_5_equals_stock_padded(world, budget, strategy,
                                                             tmp_path_factory, tmp_path):
    """A tiny Qwen3.5 (Gated DeltaNet and attention layers) through TreepackEngine under
    transformers 5.10, whose layers hold their convolution and scan per layer, with
    activation checkpointing on: log-probs, entropies, loss and gradients equal the stock
    engine's on padded batches. (Stock's padding-free path is wrong here: 0.039 off on the
    log-probs, measured, as its CPU scan runs across the sequences it concatenates.) The
    gradients are judged against the model's largest one: transformers' scan computes in
    float32 and rounds differently with where its chunks start. At a 64-token budget the
    trees run in parts: each cut carries the convolutions' inputs and the scans' states
    (under FSDP1 too, whose flat parameters hold the convolution weights that name the
    layers)."""
    model_dir = verl_workers.make_model_dir(str(tmp_path_factory.mktemp("hybrid")), "qwen3_5")
    out = tmp_path / "result.pt"
    spawn(verl_workers.compare_engines, world, model_dir, strategy, str(out), True, budget)
    r = torch.load(out)
    assert_equals_stock(r, grads="grads_over_model")
    if budget is None:
        assert all(0 < ratio < 1 for ratio in r["token_ratio"]), r["token_ratio"]  # packed
    else:
        assert r["parts"] and r["parts"][0] > 1 and not r["messages"], r


@pytest.fixture(scope="module")
def vision_model_dir(tmp_path_factory):
    return verl_workers.make_model_dir(str(tmp_path_factory.mktemp("vision")), "qwen3_vl")


@pytest.mark.parametrize("world,budget", [(1, None), (2, None), (2, 44)])
def test_verl_engine_with_images_equals_stock_engine(world, budget, vision_model_dir,
                                                     tmp_path):
    """A tiny Qwen3-VL (deepstack) through TreepackEngine on rows as verl's agent loop
    writes them: each row's ``multi_modal_inputs`` (its copy of its images) and verl's
    ``[4, length]`` mrope position ids. The rows pack (keyed by image content, each distinct
    image encoded once a forward) instead of falling back, and log-probs, entropies, losses,
    gradients (the vision tower's too) and the step equal the stock engine's; at a 44-token
    budget the trees run in parts, cutting through images."""
    out = tmp_path / "result.pt"
    spawn(verl_workers.compare_engines, world, vision_model_dir, "fsdp2", str(out), False,
          budget, True)
    r = torch.load(out)
    assert not any("stock engine path" in m for m in r["messages"]), r["messages"]
    assert_equals_stock(r)
    assert r["grad_names_token-mean"]
    assert all(0 < ratio < 1 for ratio in r["token_ratio"]), r["token_ratio"]
    if budget is not None:
        assert r["parts"] and r["parts"][0] > 1, r
    assert "['pixel_values_videos']" in r["video_reason"], r["video_reason"]
    # the sharing report counts (id, image) pairs, as the packs: the same text on images 1
    # and 2 is two prompts' rows (over ids alone it was one)
    logged = r["sharing"]["logged"]
    # a ratio of row counts, one float64 division each way
    assert logged == [pytest.approx(r["sharing"]["keys"], rel=FLOAT64_OP, abs=0)], r["sharing"]
    assert r["sharing"]["keys"] > r["sharing"]["ids"], r["sharing"]


def test_verl_worker_with_images_on_the_trainers_batches_equals_stock(vision_model_dir,
                                                                     tmp_path):
    """verl's ActorRolloutRefWorker built from the docs' GRPO command on a tiny Qwen3-VL, fed
    what the v1 trainer hands it for rows with images (agent-loop rows through TransferQueue:
    each row's multi_modal_inputs, [4, length] mrope position ids): compute_log_prob,
    compute_ref_log_prob, update_actor and compute_log_prob again pack and equal stock verl."""
    batches = tmp_path / "batches.pt"
    run_python("import verl_trainer_path as t\n"
               f"t.trainer_batches({vision_model_dir!r}, 2, {str(batches)!r}, images=True)\n")
    out = tmp_path / "result.pt"
    spawn(verl_trainer_path.compare_workers, 2, vision_model_dir, str(batches), str(out))
    r = torch.load(out, weights_only=False)
    assert r["engines_tree"] == ("TreepackEngine", "TreepackEngine"), r["engines_tree"]
    assert not any("stock engine path" in m for m in r["messages"]), r["messages"]
    tree, stock = r["tree", "v1"], r["stock", "v1"]
    assert_worker_equals_stock(tree, stock, "v1")
    ratios = tree["update_metrics"]["treepack/token_ratio"]
    assert ratios and all(0 < x < 1 for x in ratios), ratios


@pytest.mark.parametrize("world", [1, 2])
def test_verl_engine_packs_qwen2_vl_on_transformers_own_forwards(world, tmp_path_factory,
                                                                tmp_path):
    """verl patches Qwen2-VL's classes (its forward takes only 4-row position ids; with
    use_remove_padding its attention calls flash-attention directly). TreepackEngine runs its
    packed forwards, and their backward, on transformers' own forwards: equal to the stock
    engine. Both engines here say use_remove_padding=false, so that verl leaves the attention
    alone and its stock path runs on a CPU (its patched attention needs flash-attn); the
    forwards' swap is the one a GPU run takes. The engines step with SGD (its step linear in
    the gradient: verl_workers.optimizer_settings), so the log-probs after it agree to float32
    rounding; with AdamW one element of one token's embedding ended 0.034 x lr apart, and the
    log-probs after the step 4.2e-5 (lr 1e-2) and 1.3e-5 (1e-3) apart."""
    model_dir = verl_workers.make_model_dir(str(tmp_path_factory.mktemp("qwen2vl")), "qwen2_vl")
    out = tmp_path / "result.pt"
    spawn(verl_workers.compare_engines, world, model_dir, "fsdp2", str(out), True, None, True,
          {"use_remove_padding": False})
    r = torch.load(out)
    assert r["registered"] == "TreepackEngine"
    assert not any("stock engine path" in m for m in r["messages"]), r["messages"]
    assert_equals_stock(r)
    assert all(0 < ratio < 1 for ratio in r["token_ratio"]), r["token_ratio"]


@pytest.mark.parametrize("world,strategy", [(2, "fsdp2"), (2, "fsdp")])
def test_verl_lean_engine_equals_stock_engine(world, strategy, model_dir, tmp_path):
    """external_lib=treepack.verl_lean: the LM head runs inside FSDP's forward on hidden
    states; log-probs, entropies, loss and every gradient equal the stock engine's."""
    out = tmp_path / "result.pt"
    spawn(verl_workers.compare_lean, world, model_dir, strategy, str(out))
    r = torch.load(out)
    assert r["registered"] == "TreepackLeanEngine"
    for key in ("log_probs_scalar", "entropy_scalar", "log_probs_per_row", "entropy_per_row",
                "grads"):
        assert within(r[key], TOLERANCE), (key, r[key])
    got, want = r["loss"]
    assert within(abs(got - want), TOLERANCE * abs(want)) and r["grad_names"]
    assert any("per-row temperatures" in m for m in r["messages"])  # those used full logits
    assert not any("does not apply" in m for m in r["messages"]), r["messages"]


def test_verl_lora_path_equals_stock(model_dir, tmp_path):
    """model.lora_rank > 0: verl wraps a peft model in FSDP; treepack packs it (with the adapter,
    and without it as verl's in-actor reference pass runs), equal to stock."""
    out = tmp_path / "result.pt"
    spawn(verl_workers.compare_lora, 2, model_dir, str(out))
    r = torch.load(out, weights_only=False)
    assert r["refused"] is None, r["refused"]
    for key in ("adapter", "no_adapter"):
        error = verl_workers.relative_error(r["tree"][key], r["stock"][key])
        assert within(error, TOLERANCE), (key, error)
    assert verl_workers.relative_error(r["stock"]["adapter"], r["stock"]["no_adapter"]) > 1e-4
    assert r["grad_names"] and within(r["grads"], TOLERANCE), r["grads"]


def test_verl_ranks_fall_back_together(model_dir, tmp_path):
    out = tmp_path / "result.pt"
    spawn(verl_workers.divergent_fallback, 2, model_dir, str(out))
    (same0, said0, shifted0), (same1, said1, shifted1) = torch.load(out)
    assert same0 and same1
    assert "position ids" in shifted0 and "position ids" in shifted1
    assert len(said0) == 1 and "temperature" in said0[0]
    assert len(said1) == 1 and "another data-parallel rank" in said1[0]


def test_verl_falls_back_to_the_stock_path_and_says_why_once(model_dir, tmp_path):
    out = tmp_path / "result.pt"
    spawn(verl_workers.fallback, 1, model_dir, str(out))
    r = torch.load(out)
    assert r["same"]
    assert len(r["messages"]) == 1 and "cannot be tree-packed" in r["messages"][0]
    assert "a layer treepack cannot pack" in r["messages"][0]
    assert "treepack/token_ratio" not in r["metrics"]


def test_verl_external_lib_switches_the_engine(model_dir):
    """The documented switch: verl imports `model.external_lib` in every worker, and the
    engine it then builds for the actor is treepack's."""
    code = (
        "import os; os.environ['VERL_ENGINE_DEVICE'] = 'cuda'\n"
        "import verl_workers\n"  # a platform verl can start on without a GPU
        "from verl.workers.config import HFModelConfig\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        f"HFModelConfig(path={model_dir!r}, external_lib=['treepack.verl'])\n"
        "print(*(EngineRegistry.get_engine_cls('language_model', b).__name__\n"
        "        for b in ('fsdp', 'fsdp2')))\n"
    )
    stdout = run_python(code, timeout=300)
    assert stdout.split()[-2:] == ["TreepackEngine", "TreepackEngine"], stdout


def test_the_docs_command_runs_verls_entry_point_with_treepack_on():
    """docs/integrations.md's GRPO command through verl's own command line (Hydra composes it,
    unknown keys fail; ``--cfg job`` prints the config instead of training), and everything
    main_ppo's v1 trainer and agent loop import is installed by treepack[verl]."""
    import importlib

    words = verl_trainer_path.docs_command()
    assert words[:3] == ["python3", "-m", "verl.trainer.main_ppo"], words[:3]
    overrides = words[3:]
    assert "actor_rollout_ref.model.external_lib=treepack.verl" in overrides
    assert not any(w.startswith("trainer.balance_batch") for w in overrides)  # default: true
    done = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--cfg", "job",
                           *overrides], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "external_lib: treepack.verl" in done.stdout
    for module in ("verl.trainer.main_ppo", "verl.trainer.main_ppo_v0", "transfer_queue",
                   "verl.trainer.ppo.v1.agent_loop_tq",
                   "verl.experimental.agent_loop.single_turn_agent_loop",
                   "verl.experimental.agent_loop.tool_agent_loop"):
        importlib.import_module(module)
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = verl_trainer_path.compose_config("unused", treepack=True, world=8)
    assert get_trainer_cls(config.trainer.v1.trainer_mode)


def test_verl_log_probs_is_a_deprecated_wrapper():
    from treepack import TreePack
    from treepack.core.outputs import from_logits
    from treepack.verl import verl_log_probs

    seqs = [[1, 2, 3], [1, 2, 4, 5], [6]]
    pack = TreePack.from_sequences(seqs, layout="flat")
    logits = torch.randn(pack.num_rows, 8, dtype=torch.float64)
    with pytest.warns(FutureWarning, match="align='prediction'"):
        lp, ent = verl_log_probs(pack, logits, 0.7, entropy_too=True)
    want = from_logits(pack, logits, temperature=0.7, entropy=True, align="prediction")
    torch.testing.assert_close(lp, want.logprobs, rtol=0, atol=0)
    torch.testing.assert_close(ent, want.entropy, rtol=0, atol=0)
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="layout='flat'"):
        verl_log_probs(TreePack.from_sequences(seqs), logits, 1.0)


def test_r3_routes_read_as_verls_replay_aligns_and_masks_them():
    """verl's R3 data for the Megatron engine (routed_experts, one route per token or per
    token but the last, and the response mask): treepack's routes are verl's own
    align_r3_router_replay_data, -1 wherever verl's build_r3_replay_mask leaves the router
    its own choice, on rows with and without a response."""
    from verl.utils.megatron.router_replay_utils import (align_r3_router_replay_data,
                                                         build_r3_replay_mask)

    from treepack.adapters.verl.batches import host_routes

    g = torch.Generator().manual_seed(0)
    lengths, responses = [5, 3, 4, 2], [2, 0, 3, 1]
    ids = torch.nested.nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)
    recorded = [n - 1 if i % 2 == 0 else n for i, n in enumerate(lengths)]  # both layouts
    routed = torch.nested.nested_tensor(
        [torch.randint(0, 8, (n, 3, 2), generator=g, dtype=torch.int16) for n in recorded],
        layout=torch.jagged)
    mask = torch.nested.nested_tensor(
        [torch.ones(r, dtype=torch.long) if r else torch.zeros(1, dtype=torch.long)
         for r in responses], layout=torch.jagged)
    data = {"routed_experts": routed, "input_ids": ids, "response_mask": mask}
    got = host_routes(data)
    aligned = align_r3_router_replay_data(routed, ids).unbind()
    replayed = build_r3_replay_mask(ids, torch.tensor([[r] for r in responses])).unbind()
    for mine, want, keep in zip(got, aligned, replayed):
        want = want.numpy().copy()
        want[~keep.numpy()] = -1
        np.testing.assert_array_equal(mine, want)
    assert (got[1] == -1).all()  # no response: nothing replayed
    with pytest.raises(ValueError, match="row 0 has 2 routes for 5 tokens"):
        host_routes({**data, "routed_experts": torch.nested.nested_tensor(
            [torch.zeros(2, 3, 2, dtype=torch.int16)] + list(routed.unbind())[1:],
            layout=torch.jagged)})
