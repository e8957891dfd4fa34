"""treepack.verl's Megatron engine on a vision-language model: verl's real engine built by verl
through mbridge (Qwen2.5-VL, ``vanilla_mbridge``) from one checkpoint, with image batches as
verl's agent loop writes them (each row's ``multi_modal_inputs``, ``[4, length]`` mrope ids),
packs them -- every distinct image encoded once a forward, rows keyed by the image's content --
instead of falling back, and equals verl's stock engine running every row alone: log-probs,
entropies, both loss aggregations, every gradient (vision tower, projector, language model),
the grad norm, the parameters and log-probs after an SGD step (float32, gloo).

Runs where verl, megatron-core and mbridge are installed together (`.ci/run`'s `.venv-verl`).
"""

import pytest

pytest.importorskip("verl", reason="verl tests run in the verl environment (.ci/run)")
pytest.importorskip("megatron.core", reason="verl's Megatron engine needs megatron-core")
pytest.importorskip("mbridge", reason="verl's Megatron engine builds models with mbridge")
torch = pytest.importorskip("torch")

import verl_megatron_vision as vv  # noqa: E402
from launch import run_python, spawn  # noqa: E402
from tolerance import within  # noqa: E402
from verl_workers import TOLERANCE  # noqa: E402  (float32: FLOAT32_RELATIVE)

# (world, tp, cp, budget): verl's budget here is 96 tokens a GPU (two packs of this batch)
LAYOUTS = {
    "one pack": (1, 1, 1, 512),
    "dp2": (2, 1, 1, None),
    "tp2, sequence parallel": (2, 2, 1, None),
    "cp2": (2, 1, 2, None),
    "in parts": (1, 1, 1, 40),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vv.make_model_dir(str(tmp_path_factory.mktemp("verl_megatron_vision")))


@pytest.fixture(scope="module")
def stocks(model_dir, tmp_path_factory):
    """verl's stock engine at a TP size, every row alone through mbridge's forward (each TP
    size run once): mbridge 0.15.1 loads the vision tower's weights otherwise at TP = 2 than
    at TP = 1 (rows after an image differ, text rows agree: for stock and tree alike), so a
    layout is compared with stock at its own TP size. Stock cannot run CP here (mbridge's
    forward takes whole rows), nor needs to: CP and DP leave every weight whole."""
    cache = {}

    def at(tp: int) -> dict:
        if tp not in cache:
            out = tmp_path_factory.mktemp(f"stock_tp{tp}") / "stock.pt"
            spawn(vv.run_engine, model_dir, str(out), True, tp, world=tp, timeout=900)
            cache[tp] = torch.load(out, weights_only=False)
        return cache[tp]

    return at


@pytest.fixture(scope="module", params=list(LAYOUTS))
def tree(request, model_dir, stocks, tmp_path_factory):
    world, tp, cp, budget = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp("tree") / "tree.pt"
    spawn(vv.run_engine, model_dir, str(out), False, tp, cp, budget, world=world, timeout=900)
    return request.param, torch.load(out, weights_only=False), stocks(tp)


def _error(got, want) -> float:
    """max |got - want| / max |want|: over a list's rows, per tensor of a dict (the worst)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), set(got) ^ set(want)
        return max(_error(got[k], want[k]) for k in want)
    if isinstance(want, list):
        diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
        return diff / max(float(b.abs().max()) for b in want)
    if isinstance(want, torch.Tensor):
        return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    return abs(got - want) / abs(want)


def test_the_tree_engine_with_images_equals_verls_stock_engine(tree):
    name, got, stock = tree
    assert (got["engine"], stock["engine"]) == ("TreepackMegatronEngine",
                                                "MegatronEngineWithLMHead")
    assert not got["messages"], got["messages"]  # no fallback line: the batches packed
    keys = [k for k in stock if k.startswith(("log_probs", "entropy", "loss", "grads",
                                              "grad_norm", "params_after"))]
    errors = {k: _error(got[k], stock[k]) for k in keys}
    bad = {k: v for k, v in errors.items() if not within(v, TOLERANCE)}
    assert not bad, (name, bad)
    # the step moved the model: the log-probs after it are not the ones before
    assert _error(stock["log_probs_after"], stock["log_probs_scalar"]) > 100 * TOLERANCE
    assert got["video_refusal"] == (
        "multi-modal inputs ['pixel_values_videos', 'video_grid_thw'] (treepack packs images: "
        "['pixel_values', 'image_grid_thw', 'images_seqlens'])"), got["video_refusal"]


def test_every_distinct_image_is_encoded_once_a_forward(tree):
    """Stock encodes each row's images (13 for its 11 rows with images); a tree forward the
    distinct images its rows need, once: all 3 in one pack; at most 3 in each of two packs;
    in parts (a budget of 40 rows, less than an image's rows and their prompt), each part
    those of its rows."""
    name, got, stock = tree
    assert stock["calls_scalar"] == [1] * 9 + [2] * 2
    for key in ("calls_scalar", "calls_per_row"):
        calls = got[key]
        if name == "one pack":
            assert calls == [3], calls
        elif name == "in parts":
            assert len(calls) > 2 and max(calls) <= 3, calls
        else:  # two packs on each rank (dp2: the rank's half of the rows)
            assert len(calls) <= 2 and max(calls) <= 3, calls
    metrics = got["metrics_token-mean"]
    assert max(metrics["treepack/token_ratio"]) < 1.0, metrics
    if name == "in parts":
        assert metrics["treepack/parts"][0] > 2, metrics


def test_verl_megatron_worker_with_images_on_the_trainers_batches_equals_stock(model_dir,
                                                                              tmp_path):
    """verl's ActorRolloutRefWorker (actor and ref) with ``model_engine=megatron`` built from
    the docs' GRPO command, fed what the v1 trainer hands each of 2 data-parallel ranks for
    rows with images (agent-loop rows through TransferQueue: each row's multi_modal_inputs,
    [4, length] mrope ids): compute_log_prob, compute_ref_log_prob, update_actor and
    compute_log_prob again pack and equal stock verl's worker (its rows alone, bshd)."""
    from verl_workers import metric_error, relative_error

    batches = tmp_path / "batches.pt"
    run_python("import verl_trainer_path as t\n"
               f"t.trainer_batches({model_dir!r}, 2, {str(batches)!r}, images=True)\n")
    out = tmp_path / "result.pt"
    spawn(vv.compare_workers, model_dir, str(batches), str(out), world=2, timeout=900)
    r = torch.load(out, weights_only=False)
    assert r["engines_tree"] == ("TreepackMegatronEngine", "TreepackMegatronEngine")
    assert r["engines_stock"] == ("MegatronEngineWithLMHead", "MegatronEngineWithLMHead")
    assert not any("stock Megatron engine path" in m for m in r["messages"]), r["messages"]
    tree, stock = r["tree"], r["stock"]
    for key in ("log_probs", "entropy", "ref_log_probs", "log_probs_after"):
        assert within(relative_error(tree[key], stock[key]), TOLERANCE), key
    # the update moved the model (lr 1e-3 on near-uniform log-probs of Qwen's vocabulary:
    # little) ten times more than the tree and stock differ after it
    moved = relative_error(stock["log_probs_after"], stock["log_probs"])
    apart = relative_error(tree["log_probs_after"], stock["log_probs_after"])
    assert apart < moved / 10, (apart, moved)
    m, s = tree["update_metrics"], stock["update_metrics"]
    for key in ("grad_norm", "actor/pg_loss"):  # one a mini-batch, for both
        assert within(metric_error(m[key], s[key]), TOLERANCE), (key, m[key], s[key])
    ratios = m["treepack/token_ratio"]
    assert ratios and all(0 < x < 1 for x in ratios), ratios
