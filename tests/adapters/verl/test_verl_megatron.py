"""treepack.verl against verl's real Megatron engine (CPU, gloo): the stock
``MegatronEngineWithLMHead`` and ``TreepackMegatronEngine``, built by verl from the same
checkpoint through mbridge, must give the same log-probs, entropies, losses and gradients.
Runs where verl and megatron-core are installed together (`.ci/run` makes a `.venv-verl`
with both)."""

import warnings

import pytest

pytest.importorskip("verl", reason="verl tests run in the verl environment (.ci/run)")
pytest.importorskip("megatron.core", reason="verl's Megatron engine needs megatron-core")
pytest.importorskip("mbridge", reason="verl's Megatron engine builds models with mbridge")
torch = pytest.importorskip("torch")
import torch.multiprocessing as mp  # noqa: E402

warnings.filterwarnings("ignore", message=".* engine is not available")

import verl_megatron_workers  # noqa: E402  (the CPU platform, megatron-core and mbridge)
import verl_workers  # noqa: E402
from launch import free_port, run_python  # noqa: E402
from tolerance import within  # noqa: E402
from verl_workers import TOLERANCE  # noqa: E402  (float32: FLOAT32_RELATIVE)


def same(got: float, want: float) -> bool:
    """Two float32 engines' loss or grad norm: within TOLERANCE of its size."""
    return within(abs(got - want), TOLERANCE * abs(want))


def spawn(fn, world, *args):
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return verl_workers.make_model_dir(str(tmp_path_factory.mktemp("verl_megatron")))


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """The model with 4 layers: 2 pipeline stages of 2 virtual stages each."""
    return verl_workers.make_model_dir(str(tmp_path_factory.mktemp("verl_megatron4")),
                                       layers=4)


@pytest.mark.parametrize("world,tp,cp,loss_scale", [
    (1, 1, 1, None), (2, 1, 1, None), (2, 2, 1, None), (2, 1, 2, None), (1, 1, 1, 4.0)],
    ids=["one_rank", "dp2", "tp2_sequence_parallel", "cp2", "loss_scale"])
def test_verl_megatron_engine_runs_trees_over_the_budget_in_parts(world, tp, cp, loss_scale,
                                                                  model_dir, tmp_path):
    """Under a budget smaller than a GRPO group's tree (56 rows for 223), the tree engine
    runs each rank's trees in parts (every row once) and still equals the stock engine: its
    log-probs, entropies, losses, gradients, grad norm and the step after; with a loss scale
    (a float16 optimizer's grad_scale_func) the parts' gradients carry it as stock's do."""
    out = tmp_path / "result.pt"
    spawn(verl_megatron_workers.compare_engines, world, model_dir, str(out), tp, 1, cp, None,
          56 // cp, loss_scale)
    r = torch.load(out, weights_only=False)
    assert not any("stock Megatron engine path" in m or "is split" in m
                   for m in r["messages"]), r["messages"]
    assert min(r["update_metrics"]["treepack/parts"]) > 1, r["update_metrics"]
    for name in ("scalar", "per_row", "fixed_size"):
        assert within(r[f"log_probs_{name}"], TOLERANCE), (name, r)
        assert within(r[f"entropy_{name}"], TOLERANCE), (name, r)
    for mode in ("seq-mean-token-mean", "token-mean"):
        tree, stock = r[f"loss_{mode}"]
        assert same(tree, stock), (mode, tree, stock)
        assert within(r[f"grads_{mode}"], TOLERANCE), (mode, r[f"grads_{mode}"])
    tree, stock = r["grad_norm"]
    assert same(tree, stock)
    # SGD's step is linear in the gradient: float32 rounding after it too
    assert within(r["log_probs_after_step"], TOLERANCE), r["log_probs_after_step"]


@pytest.mark.parametrize("world,tp,pp,cp,vpp", [(1, 1, 1, 1, None), (2, 1, 1, 1, None),
                                                (2, 2, 1, 1, None), (2, 1, 2, 1, None),
                                                (2, 1, 1, 2, None), (2, 1, 2, 1, 2)],
                         ids=["one_rank", "dp2", "tp2_sequence_parallel", "pp2", "cp2",
                              "pp2_virtual2"])
def test_verl_megatron_engine_equals_stock(world, tp, pp, cp, vpp, model_dir, four_layers,
                                           tmp_path):
    """Log-probs and entropies (one temperature, one per row, a fixed micro-batch size), the
    update's loss and every gradient under verl's ppo_loss in two aggregations, the grad
    norm, and the log-probs after one optimizer step: the tree engine equals verl's stock
    Megatron engine (THD packs) at each parallel layout, the interleaved schedule (virtual
    pipeline stages) included."""
    out = tmp_path / "result.pt"
    spawn(verl_megatron_workers.compare_engines, world, four_layers if vpp else model_dir,
          str(out), tp, pp, cp, vpp)
    r = torch.load(out, weights_only=False)
    assert r["registered"] == "TreepackMegatronEngine"
    assert r["chunks"] == (vpp or 1)
    assert not any("stock Megatron engine path" in m for m in r["messages"]), r["messages"]
    for name in ("scalar", "per_row", "fixed_size"):
        assert within(r[f"log_probs_{name}"], TOLERANCE), (name, r)
        assert within(r[f"entropy_{name}"], TOLERANCE), (name, r)
    assert r["token_ratio"] and all(0 < x < 1 for x in r["token_ratio"]), r["token_ratio"]
    for mode in ("seq-mean-token-mean", "token-mean"):
        tree, stock = r[f"loss_{mode}"]
        assert same(tree, stock), (mode, tree, stock)
        assert r[f"grad_names_{mode}"], mode
        assert within(r[f"grads_{mode}"], TOLERANCE), (mode, r[f"grads_{mode}"])
    tree, stock = r["grad_norm"]
    assert same(tree, stock)
    # SGD's step is linear in the gradient: float32 rounding after it too
    assert within(r["log_probs_after_step"], TOLERANCE), r["log_probs_after_step"]
    m = r["update_metrics"]
    assert "treepack/log_prob_token_ratio" in m and "treepack/achievable_ratio" in m, m


@pytest.fixture(scope="module")
def trainer_batches(model_dir, tmp_path_factory):
    """The v1 trainer's worker batches for one and two data-parallel ranks, made by verl's
    trainer code with Ray and TransferQueue running (in a subprocess, as test_verl.py's)."""
    root = tmp_path_factory.mktemp("trainer")
    in_subprocess("for dp in (1, 2):\n"
                  f"    t.trainer_batches({model_dir!r}, dp, f'{root}/batches{{dp}}.pt')\n"
                  f"t.trainer_batches({model_dir!r}, 2, '{root}/long2.pt', scale=4)\n")
    return {**{dp: str(root / f"batches{dp}.pt") for dp in (1, 2)},
            "long": str(root / "long2.pt")}


@pytest.mark.parametrize("tp,pp,cp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)],
                         ids=["dp2", "tp2_sequence_parallel", "pp2", "cp2"])
def test_verl_megatron_worker_on_the_trainers_batches_equals_stock(tp, pp, cp, model_dir,
                                                                  trainer_batches, tmp_path):
    """verl's ActorRolloutRefWorker (actor and ref) with ``model_engine=megatron``, built from
    the docs' GRPO command composed with verl's Hydra config, fed what the v1 trainer hands
    each data-parallel rank (agent-loop rows through TransferQueue): compute_log_prob,
    compute_ref_log_prob, update_actor, compute_log_prob again, equal to stock verl's
    Megatron engine, at two ranks in each layout."""
    world = 2
    dp = world // (tp * pp * cp)
    out = tmp_path / "result.pt"
    spawn(verl_megatron_workers.compare_workers, world, model_dir, trainer_batches[dp],
          str(out), tp, pp, cp)
    r = torch.load(out, weights_only=False)
    assert r["engines_tree"] == ("TreepackMegatronEngine", "TreepackMegatronEngine")
    assert r["engines_stock"] == ("MegatronEngineWithLMHead", "MegatronEngineWithLMHead")
    assert not any("stock Megatron engine path" in m for m in r["messages"]), r["messages"]
    m, s = assert_tree_equals_stock(r)
    ratios = m["treepack/token_ratio"]
    assert ratios and all(0 < x < 1 for x in ratios), ratios
    assert set(m["treepack/lost_rows/false_forks"]) == {0.0}, m
    assert set(m["treepack/session_forks/sessions"]) == {0.0}, m
    assert all(0 < x < 1 for x in m["treepack/log_prob_token_ratio"]), m
    assert "treepack/token_ratio" not in s


def assert_tree_equals_stock(r: dict):
    """The worker's tree engine against stock verl's Megatron engine: log-probs, entropies,
    reference log-probs, log-probs after the update and its metrics. Returns both runs'
    update metrics."""
    tree, stock = r["tree"], r["stock"]
    for key in ("log_probs", "entropy", "ref_log_probs"):
        assert within(verl_workers.relative_error(tree[key], stock[key]), TOLERANCE), key
    # after the update's SGD steps (linear in the gradient: verl_trainer_path's optimizer),
    # float32 rounding; with AdamW, its normalisation of near-zero gradients moved them 1e-4
    # apart
    assert within(verl_workers.relative_error(tree["log_probs_after"], stock["log_probs_after"]),
                  TOLERANCE)
    m, s = tree["update_metrics"], stock["update_metrics"]
    for key in ("grad_norm", "actor/pg_loss", "actor/entropy_loss", "kl_loss"):
        # kl_loss of a policy and its equal reference: rounding of log-probs and ratios of
        # size 1 (metric_error's size)
        error = verl_workers.metric_error(m[key], s[key], size=1.0)
        assert within(error, TOLERANCE), (key, m[key], s[key])
    return m, s


def test_verl_megatron_worker_runs_trees_over_its_budget_in_parts(model_dir, trainer_batches,
                                                                  tmp_path):
    """The same worker on the trainer's batches with GRPO prompts and responses 4x as long,
    at a 128-token budget (the longest row; stock verl refuses a row longer than its budget):
    the GRPO groups' trees exceed it, so the Megatron engine's log-prob and update calls run
    each rank's trees in parts; equal to stock verl's Megatron engine (2 data-parallel
    ranks)."""
    out = tmp_path / "result.pt"
    spawn(verl_megatron_workers.compare_workers, 2, model_dir, trainer_batches["long"],
          str(out), 1, 1, 1, 128)
    r = torch.load(out, weights_only=False)
    assert not any("stock Megatron engine path" in m or "is split" in m
                   for m in r["messages"]), r["messages"]
    m, _ = assert_tree_equals_stock(r)
    parts = m["treepack/parts"]
    assert parts and max(parts) > 1, parts  # the update ran in parts


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A Qwen3-MoE model (4 experts, top-2, in both layers) through mbridge."""
    return verl_workers.make_model_dir(str(tmp_path_factory.mktemp("verl_moe")), "qwen3_moe")


@pytest.mark.parametrize("world,tp,cp,fused,budget", [
    (1, 1, 1, True, None), (2, 2, 1, False, None), (2, 1, 2, False, None),
    (2, 1, 1, False, 256)],
    ids=["one_rank_fused_kernels_in_parts", "tp2_sequence_parallel_in_parts", "cp2", "dp2"])
def test_verl_megatron_engine_replays_the_rollouts_routes_as_stock(world, tp, cp, fused, budget,
                                                                 moe_dir, tmp_path):
    """An MoE model under verl's R3 routing replay, the rollout's ``routed_experts`` in each
    batch (rows with and without the last token's placeholder; one GRPO rollout's prompt routed
    differently): the tree engine equals stock verl's replay in a replaying log-prob pass, a
    native one (the reference's), a replaying update (loss, every gradient, grad norm) and
    after the step. The replayed log-probs are not the native ones (the routes are read), the
    differently routed prompt forks its rows (``differing_routes``), the expert biases of
    sigmoid routing move as stock's (each expert's tokens counted once per original token,
    which verl's replay patch counts itself), and with verl's fused
    kernels on (a GPU kernel for stock) the tree engine serves them with its own head and
    leaves verl's patch in place."""
    out = tmp_path / "result.pt"
    spawn(verl_megatron_workers.compare_replay, world, moe_dir, str(out), tp, cp, fused, budget)
    r = torch.load(out, weights_only=False)
    assert not any("stock Megatron engine path" in m for m in r["messages"]), r["messages"]
    assert r["routers"] == "verl.utils.megatron.router_replay_patch"  # verl's replay on 0.16
    assert r["fused"] is fused and r["fused_after"] is fused
    assert r["replay_vs_native"] > 1e-3, r  # float32 rounding is 1e-7 of it
    for name in ("replay", "native"):
        assert within(r[f"log_probs_{name}"], TOLERANCE), (name, r)
        assert within(r[f"entropy_{name}"], TOLERANCE), (name, r)
    tree, stock = r["loss"]
    assert same(tree, stock), r["loss"]
    assert r["grad_names"] and within(r["grads"], TOLERANCE), r["grads"]
    tree, stock = r["grad_norm"]
    assert same(tree, stock), r["grad_norm"]
    assert within(r["log_probs_after_step"], TOLERANCE), r["log_probs_after_step"]
    # the step moved each expert's bias by the sign of its token count's deviation: the
    # counts over original tokens, as stock's
    assert r["expert_bias_moved"] > 0 and r["expert_bias"] == 0, r
    m = r["update_metrics"]
    assert m["treepack/lost_rows/differing_routes"][0] > 0, m
    assert all(0 < x < 1 for x in m["treepack/token_ratio"]), m


@pytest.fixture(scope="module")
def moe_trainer_batches(moe_dir, tmp_path_factory):
    """The v1 trainer's worker batches for two data-parallel ranks, their rows carrying an
    MoE rollout's ``routed_experts`` as verl's agent loop writes them."""
    path = tmp_path_factory.mktemp("moe_trainer") / "batches2.pt"
    in_subprocess(f"t.trainer_batches({moe_dir!r}, 2, {str(path)!r}, routes=(2, 4, 2))\n")
    return str(path)


def in_subprocess(code: str) -> None:
    """Run ``code`` (``verl_trainer_path`` imported as ``t``) in a fresh Python, as the v1
    trainer's batches are made: Ray and TransferQueue in a process of their own."""
    run_python("import verl_workers, verl_trainer_path as t\n" + code)


def test_verl_megatron_worker_replays_the_rollouts_routes_as_stock(moe_dir, moe_trainer_batches,
                                                                 tmp_path):
    """verl's ActorRolloutRefWorker with ``model_engine=megatron`` and the actor's
    ``router_replay.mode=R3``, built from the docs' GRPO command, fed the trainer's batches
    with the rollout's routed experts (2 data-parallel ranks): compute_log_prob (replaying),
    compute_ref_log_prob (routing natively), update_actor (replaying) and compute_log_prob
    after it equal stock verl's Megatron engine with R3; no fallback; a GRPO session whose
    prompt was routed differently forks from its group."""
    out = tmp_path / "result.pt"
    spawn(verl_megatron_workers.compare_workers, 2, moe_dir, moe_trainer_batches, str(out),
          1, 1, 1, None, True)
    r = torch.load(out, weights_only=False)
    assert r["engines_tree"] == ("TreepackMegatronEngine", "TreepackMegatronEngine")
    assert not any("stock Megatron engine path" in m for m in r["messages"]), r["messages"]
    m, _ = assert_tree_equals_stock(r)
    assert set(m["treepack/lost_rows/differing_routes"]) != {0.0}, m
    assert all(0 < x < 1 for x in m["treepack/token_ratio"]), m


def test_verl_megatron_ranks_fall_back_together(model_dir, tmp_path):
    """One data-parallel rank's rows cannot be packed (temperature 0): both ranks run verl's
    stock Megatron path, each says why once, and the outputs are stock's bit for bit."""
    out = tmp_path / "result.pt"
    spawn(verl_megatron_workers.divergent_fallback, 2, model_dir, str(out))
    ranks = torch.load(out, weights_only=False)["ranks"]
    for rank, (messages, result) in enumerate(ranks):
        said = [m for m in messages if "stock Megatron engine path" in m]
        assert len(said) == 1, (rank, messages)
        assert result["equal"], rank
    assert "temperature" in ranks[0][1]["reason"] and "temperature" in ranks[0][0][0]
    assert ranks[1][1]["reason"] is None  # its own rows could pack
    assert "another rank" in ranks[1][0][0]


def test_verl_external_lib_registers_the_megatron_engine():
    """Importing treepack.verl (verl's external_lib) makes TreepackMegatronEngine the
    Megatron language-model engine verl's registry hands out."""
    import treepack.verl  # noqa: F401
    from treepack.adapters.verl.megatron_engine import TreepackMegatronEngine
    from verl.workers.engine.base import EngineRegistry

    registered = EngineRegistry._engines["language_model"]["megatron"]
    assert registered and all(v is TreepackMegatronEngine for v in registered.values()), registered


def test_verl_megatron_engine_in_bfloat16_is_as_close_to_float32_as_stock(model_dir, tmp_path):
    """verl's own dtype (bfloat16, its model in Megatron's Float16Module): the tree engine's
    log-probs, entropies and update gradients are as close to the float32 stock engine's as
    the bfloat16 stock engine's are (within 1.5x its error)."""
    out = tmp_path / "result.pt"
    spawn(verl_megatron_workers.compare_bfloat16, 1, model_dir, str(out))
    r = torch.load(out, weights_only=False)
    assert r["modules"] == ["GPTModel", "Float16Module", "Float16Module"], r["modules"]
    for key in ("log_probs", "entropy", "grads"):
        tree, stock = r["tree"][key], r["stock"][key]
        assert 0 < stock < 0.05, (key, stock)  # bfloat16's own rounding, not a broken run
        assert tree <= 1.5 * stock, (key, tree, stock)
