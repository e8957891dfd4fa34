"""treepack.megatron: a megatron-core GPTModel on a tree equals the same model run on every
sequence alone (float64, gloo), at TP = 1, TP = 2 (with and without Megatron's sequence
parallelism), CP = 2 and TP = 2 x CP = 2.

One spawn per layout runs every case; every layout loads the same canonical weights (built at
TP = 1), so every layout must give the reference's log-probs, entropies and gradients (each
TP shard gathered, each CP rank's share summed). Runs in the megatron environment (.ci/run
makes it); skipped where megatron-core is not installed.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_workers  # noqa: E402
from launch import spawn  # noqa: E402

CASES = {
    "grouped-query attention, rope": {},
    "per-sequence temperatures": {"temperatures": True},
    "multi-head attention": {"groups": 4},
    "learned absolute positions": {"positions": "learned_absolute"},
    "sliding window": {"window": 5, "config": {"window_size": (4, 0)}},
    "tied embeddings": {"tied": True},
    "a pack with fewer rows than ranks": {"batch": "tiny"},
}

# negative controls, each on the layouts it applies to, must be caught (Megatron's own rope
# under CP asks for 2 x CP chunks of the rows: that control would crash, not mislead, there)
BROKEN = {
    "broken: rotary at each row's packed index":
        ({"broken": "positions"}, lambda layout: layout.get("cp", 1) == 1),
    "broken: no gradient back through the row-to-head exchange":
        ({"broken": "exchange gradient"}, lambda layout: layout.get("cp", 1) > 1),
    "broken: each CP rank attends among its own rows":
        ({"broken": "local mask"}, lambda layout: layout.get("cp", 1) > 1),
    "broken: each TP rank reads the target's logit as the first rank's":
        ({"broken": "vocabulary share"}, lambda layout: layout.get("tp", 1) > 1),
}

LAYOUTS = {
    "tp1": dict(tp=1, world=1),
    "tp2": dict(tp=2, world=2),
    "tp2, sequence parallel": dict(tp=2, world=2, sequence_parallel=True),
    "cp2": dict(cp=2, world=2),
    "tp2 x cp2": dict(tp=2, cp=2, world=4),
}

# float64 throughout (the reference's softmax too: attention_softmax_in_fp32=False)
TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    spawn(megatron_workers.reference_worker, str(out),
          {**CASES, **{n: b for n, (b, _) in BROKEN.items()}}, world=1, timeout=900)
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, reference):
    spec = {"name": request.param.replace(" ", "_").replace(",", ""), **LAYOUTS[request.param]}
    broken = {n: b for n, (b, applies) in BROKEN.items() if applies(spec)}
    cases = {n: {**c, "sequence_parallel": spec.get("sequence_parallel", False)}
             for n, c in {**CASES, **broken}.items()}
    spawn(megatron_workers.cases_worker, str(reference), cases, spec, world=spec["world"],
          timeout=900)
    results = [torch.load(reference / f"{spec['name']}-rank{r}.pt")
               for r in range(spec["world"])]
    return request.param, results, torch.load(reference / "reference.pt")


def differences(got: dict, expect: dict) -> dict:
    out = {}
    for key in ("logprobs", "entropy", "loss"):
        scale = expect[key].abs().max().clamp_min(1e-30)
        out[key] = ((got[key] - expect[key]).abs().max() / scale).item()
    assert got["grads"].keys() == expect["grads"].keys()
    for k, e in expect["grads"].items():
        out[k] = ((got["grads"][k] - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_tree_equals_every_sequence_alone(layout, case):
    name, results, reference = layout
    for rank, per_case in enumerate(results):
        got = per_case[case]
        assert "error" not in got, got.get("trace")
        bad = {k: v for k, v in differences(got, reference[case]).items() if v > TOLERANCE}
        assert not bad, f"{name}, rank {rank}: {bad}"


@pytest.mark.parametrize("case", list(BROKEN))
def test_negative_controls_are_caught(layout, case):
    name, results, reference = layout
    if not BROKEN[case][1](LAYOUTS[name]):
        pytest.skip(f"{case!r} does not apply to {name}")
    got = results[0][case]
    assert "error" not in got, got.get("trace")
    worst = max(differences(got, reference[case]).values())
    assert worst > 1e-4, f"{case} went unnoticed on {name}: {worst:.1e}"
