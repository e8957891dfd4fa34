"""treepack.megatron on a vision-language model: mbridge's Qwen2.5-VL (verl's Megatron engine's
model for it) on a tree equals the stock model run on every sequence alone, images and mrope
positions included, with every distinct image encoded once (float64, gloo).

Runs where mbridge is installed (the verl environment; .ci/run runs this file there).
"""

import pytest
import torch

pytest.importorskip("mbridge")
pytest.importorskip("megatron.core")

import vision_workers  # noqa: E402
from launch import spawn  # noqa: E402
from tolerance import FLOAT64_EXACT, within  # noqa: E402

LAYOUTS = {
    "tp1": dict(world=1),
    "tp2, sequence parallel": dict(tp=2, world=2, sequence_parallel=True),
    "cp2": dict(cp=2, world=2),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision")
    spawn(vision_workers.reference_worker, str(out), world=1, timeout=600)
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, reference):
    spec = {"name": request.param.replace(" ", "_").replace(",", ""), **LAYOUTS[request.param]}
    spawn(vision_workers.tree_worker, str(reference), spec, world=spec["world"], timeout=600)
    return request.param, [torch.load(reference / f"vision-{spec['name']}-rank{r}.pt")
                           for r in range(spec["world"])], \
        torch.load(reference / "vision-reference.pt")


@pytest.mark.parametrize("how", ["one forward", "in parts"])
def test_the_tree_equals_every_sequence_alone_with_its_images(layout, how):
    """Log-probs, entropies, the loss and every gradient (the vision tower's, its projector's
    and the language model's) within FLOAT64_EXACT of each one's largest: in one forward, and
    in parts of at most 40 rows (backward_in_parts with images=, each part encoding the
    images its rows need)."""
    name, results, reference = layout
    for rank, got in enumerate(results):
        if how == "in parts":
            assert got["parts"]["parts"] > 2, got["parts"]["parts"]
            got = got["parts"]
        errors = {}
        for key in ("logprobs", "entropy", "loss"):
            scale = reference[key].abs().max()
            errors[key] = ((got[key] - reference[key]).abs().max() / scale).item()
        assert got["grads"].keys() == reference["grads"].keys()
        for k, want in reference["grads"].items():
            errors[k] = ((got["grads"][k] - want).abs().max() / want.abs().max()).item()
        bad = {k: v for k, v in errors.items() if not within(v, FLOAT64_EXACT)}
        assert not bad, f"{name}, rank {rank}: {bad}"


def test_each_distinct_image_is_encoded_once_and_keys_keep_images_apart(layout):
    """One call of the vision tower per forward, over the distinct images its rows need (3
    here, though the batch holds 10); the content keys give rows that text alone would have
    merged (the same prompt text on two images) to each image."""
    name, results, _ = layout
    for rank, got in enumerate(results):
        assert got["distinct"] == 3, got["distinct"]
        assert sum(got["calls"]) <= 3 and len(got["calls"]) <= 1, (name, rank, got["calls"])
        assert got["rows"] > got["unkeyed_rows"], (got["rows"], got["unkeyed_rows"])
        assert got["rows"] < got["tokens"]
    assert sum(sum(r["calls"]) for r in results) >= 3  # every image read somewhere


def test_what_a_vision_tree_cannot_run_is_refused(layout):
    name, results, _ = layout
    for got in results:
        refused = got["refused"]
        assert refused["a pack built without the images' keys"].startswith(
            "ValueError: the pack was built without these images' content keys"), refused
        assert refused["images of other sequences"].startswith(
            "ValueError: images holds 3 sequences but the pack 10"), refused
        for case in ("image placeholders without images",
                     "image placeholders in parts without images"):
            assert refused[case].startswith(
                "UnsupportedMegatron: the pack holds image placeholders (id 151655) but no "
                "images were given"), refused
        assert refused["videos"].startswith("UnsupportedMegatron: Qwen2_5VLModel: treepack "
                                            "runs videos of"), refused


def test_images_through_megatrons_pipeline_schedule(reference):
    """PP = 2 (the vision tower on the first stage): two (pack, images) micro-batches through
    get_forward_backward_func with treepack.megatron.forward_step; the last stage's log-probs
    and every stage's gradients (times the micro-batches the schedule divides by) are the
    reference's."""
    spawn(vision_workers.pipeline_worker, str(reference), {"name": "pp2", "pp": 2}, world=2,
          timeout=600)
    results = [torch.load(reference / f"vision-pp2-rank{r}.pt") for r in range(2)]
    want = torch.load(reference / "vision-reference.pt")
    grads = {}
    for got in results:
        grads.update(got["grads"])
        if got["last"]:
            error = (got["logprobs"] - want["logprobs"]).abs().max() / want["logprobs"].abs().max()
            assert within(error.item(), FLOAT64_EXACT), error
    assert grads.keys() == want["grads"].keys()
    for k, g in want["grads"].items():
        error = ((grads[k] - g).abs().max() / g.abs().max()).item()
        assert within(error, FLOAT64_EXACT), (k, error)
