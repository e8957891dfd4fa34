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
from tolerance import FLOAT32_INSIDE, FLOAT32_RELATIVE, FLOAT64_EXACT, within  # noqa: E402

# an MoE model replaying the rollout's routes (R3), its router losses off: a loss over
# sequences alone is then the sum of each one's (the load-balancing losses are a function of
# the whole batch: the EP fixture below tests them with replay, against the padded batch)
REPLAY = {**megatron_workers.MOE, "moe_enable_routing_replay": True, "moe_aux_loss_coeff": 0.0,
          "moe_z_loss_coeff": None, "moe_router_load_balancing_type": "none"}

# Megatron's full activation recomputation: each layer's forward runs again in the backward
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1}

CASES = {
    "grouped-query attention, rope": {},
    "per-sequence temperatures": {"temperatures": True},
    "multi-head attention": {"groups": 4},
    "learned absolute positions": {"positions": "learned_absolute"},
    "mrope, text rows": {"positions": "mrope", "config": {"mrope_section": [2, 3, 3]}},
    "sliding window": {"window": 5, "config": {"window_size": (4, 0)}},
    "tied embeddings": {"tied": True},
    "a pack with fewer rows than ranks": {"batch": "tiny"},
    # attention sinks: a logit per head in every softmax denominator (GPT-OSS's)
    "attention sinks, learnable": {"config": {"softmax_type": "learnable"}},
    "attention sinks, off-by-one, sliding window": {
        "window": 5, "config": {"softmax_type": "off-by-one", "window_size": (4, 0)}},
    # a tree over the budget: parts of at most this many rows, each row computed once
    "in parts": {"parts": 6},
    "in parts, sliding window, temperatures": {"parts": 5, "window": 5, "temperatures": True,
                                               "config": {"window_size": (4, 0)}},
    "in parts, a whole-batch loss (step_in_parts)": {"parts": 6, "step": True},
    "in parts, every part recomputed": {"parts": 4, "recompute": True},
    "in parts, none recomputed": {"parts": 7, "recompute": False},
    "in parts, attention sinks": {"parts": 6, "config": {"softmax_type": "learnable"}},
    # each part's chains in one varlen call (its exact CPU reference here), sinks through the
    # kernel's log-sum-exp
    "in parts on varlen, sliding window": {"parts": 5, "window": 5, "backend": "varlen",
                                           "config": {"window_size": (4, 0)}},
    "in parts on varlen, attention sinks": {"parts": 6, "backend": "varlen",
                                            "config": {"softmax_type": "learnable"}},
    # top-2 of 4 experts, each token replaying its recorded route; one sequence routed its
    # own way forks from its group (megatron_workers.routes_of)
    "MoE, routing replay": {"routes": True, "config": REPLAY},
    "activation recomputation, every layer": {"config": RECOMPUTE},
    "MoE, routing replay, every layer recomputed": {
        "routes": True, "config": {**REPLAY, **RECOMPUTE}},
    "in parts, MoE routing replay": {"parts": 6, "routes": True, "config": REPLAY},
    # a prompt's first 4 tokens without recorded routes (-1): their routers' own top-k
    "MoE, routing replay, a prefix unrecorded": {
        "routes": True, "unrecorded": 4, "config": REPLAY},
    # DeepSeek's multi-latent attention: q and kv low-rank, their norms, a decoupled rope
    # part of q and k rotated inside each layer (queries and keys 20 wide, values 10)
    "multi-latent attention, rope": {"mla": "rope"},
    "multi-latent attention, yarn": {"mla": "yarn"},
    "multi-latent attention, q not low-rank": {"mla": "rope", "q_lora_rank": None},
    # TransformerEngine's MLA spec with qk_layernorm: the kv norm fused into the up-projection
    # (under CP the latent exchange applies it: megatron_cpu.fused_norm_linear)
    "multi-latent attention, kv norm fused into the up-projection": {
        "mla": "rope", "fused_norm": True},
    "in parts, multi-latent attention": {"parts": 6, "mla": "yarn"},
    "multi-latent attention, every layer recomputed": {"mla": "rope", "config": RECOMPUTE},
    "multi-latent attention, yarn, MoE routing replay": {
        "mla": "yarn", "routes": True, "config": REPLAY},
    # Gated DeltaNet in every other layer (Qwen3-Next's, megatron-core's deterministic torch
    # kernel): its convolution along each row's path, its scan from each parent's state; the
    # batch with a 70-token prompt forking past the kernel's 64-row chunk
    "Gated DeltaNet layers": {"gdn": True, "batch": "long"},
    "in parts, Gated DeltaNet layers": {"gdn": True, "parts": 6},
    "Gated DeltaNet layers, every layer recomputed": {"gdn": True, "config": RECOMPUTE},
    # a hybrid of Mamba2, attention and MLP layers (Nemotron-H's shape, without positions as
    # Nemotron-H's attention): each Mamba2 layer's convolution along each row's path, its SSD
    # scan from each parent's state, in chunks of 32 rows (the long prompt spans three)
    "Mamba2 hybrid layers": {"mamba": "M*-M", "batch": "long", "positions": "none"},
    "in parts, Mamba2 hybrid layers": {"mamba": "M*-M", "parts": 6},
    # a dense layer, then an MoE one; routes one per layer of the model, as vLLM records
    # them for verl's R3 (the dense layer's column unread)
    "MoE in the second layer, a route per layer": {
        "routes": True, "route_layers": "all", "config": {**REPLAY, "moe_layer_freq": [0, 1]}},
}

# negative controls, each on the layouts it applies to, must be caught (Megatron's own rope
# under CP asks for 2 x CP chunks of the rows: that control would crash, not mislead, there)
BROKEN = {
    "broken: rotary at each row's packed index":
        ({"broken": "positions"}, lambda layout: layout.get("cp", 1) == 1),
    "broken: multi-latent attention's rotary at each row's packed index":
        ({"broken": "packed index", "mla": "yarn"}, lambda layout: layout.get("tp", 1) == 1),
    "broken: no gradient back through the row-to-head exchange":
        ({"broken": "exchange gradient"}, lambda layout: layout.get("cp", 1) > 1),
    "broken: each CP rank attends among its own rows":
        ({"broken": "local mask"}, lambda layout: layout.get("cp", 1) > 1),
    "broken: each TP rank reads the target's logit as the first rank's":
        ({"broken": "vocabulary share"}, lambda layout: layout.get("tp", 1) > 1),
    "broken: each Gated DeltaNet scan chain starts from zeros":
        ({"broken": "scan from zeros", "gdn": True}, lambda layout: True),
    "broken: each Gated DeltaNet convolution reads the packed rows before it":
        ({"broken": "packed convolution", "gdn": True}, lambda layout: True),
    "broken: each Mamba2 scan chain starts from zeros":
        ({"broken": "scan from zeros", "mamba": "M*-M"}, lambda layout: True),
    "broken: each Mamba2 convolution reads the packed rows before it":
        ({"broken": "packed convolution", "mamba": "M*-M"}, lambda layout: True),
    "broken: parts hand no gradient to the parts above":
        ({"broken": "carried gradient", "parts": 6}, lambda layout: True),
    "broken: the tree's routers route natively":
        ({"broken": "routes not replayed", "routes": True, "config": REPLAY},
         lambda layout: True),
    "broken: each row replays its neighbour's route":
        ({"broken": "each row replays its neighbour's route", "routes": True,
          "config": REPLAY}, lambda layout: True),
    "broken: a recomputed layer's router without its forward's routes":
        ({"broken": "no routing in recomputation", "routes": True,
          "config": {**REPLAY, **RECOMPUTE}}, lambda layout: True),
}

# ranks of the TP x CP group that disagree: every rank must refuse, none may hang
MISMATCH = {"temperatures that differ between ranks": {"mismatch": True}}

# with dropout on: step_in_parts's two passes draw backward_in_parts's masks
DROPOUT = {"in parts, dropout: step_in_parts replays its masks": {
    "parts": 6, "dropout_pair": True, "config": {"attention_dropout": 0.2,
                                                 "hidden_dropout": 0.2}}}

# what a tree (in parts) cannot run: refused by name on every rank (case, words)
REFUSED = {
    "a pack with routes, not replayed": (
        {"routes": True}, "ValueError: the pack carries routes (TreePack.from_sequences(..., "
        "routes=...)) but the model does not replay routes"),
    "routes for 3 layers, a model of 2": (
        {"routes": True, "route_layers": 3, "config": REPLAY},
        "ValueError: the pack's routes are [rows, 3, 2] but the model has 2 MoE layers of 2 "
        "routing top-2"),
    "a replaying model, a pack without routes": (
        {"config": REPLAY}, "ValueError: the model replays routes (moe_enable_routing_replay="
        "True) but the pack has none"),
    "in parts, activation recomputation": (
        {"parts": 6, "config": {"recompute_granularity": "full", "recompute_method": "uniform",
                                "recompute_num_layers": 1}},
        "UnsupportedMegatron: a layer ran its forward without gradients during a training "
        "step in parts"),
}

LAYOUTS = {
    "tp1": dict(tp=1, world=1),
    "tp2": dict(tp=2, world=2),
    "tp2, sequence parallel": dict(tp=2, world=2, sequence_parallel=True),
    "cp2": dict(cp=2, world=2),
    "tp2 x cp2": dict(tp=2, cp=2, world=4),
}

# float64 throughout (the reference's softmax too: attention_softmax_in_fp32=False): each
# output and gradient within FLOAT64_EXACT of its largest value
TOLERANCE = FLOAT64_EXACT

# Megatron's router takes its softmax in float32 whatever the model's dtype
# (topk_routing_with_score_function), token by token: the routed outputs carry float32
# rounding (FLOAT32_INSIDE of the log-probs) and every gradient through them too
# (FLOAT32_RELATIVE), in the reference as in the tree
MOE_TOLERANCE = {"logprobs": FLOAT32_INSIDE, "grads": FLOAT32_RELATIVE}


# a Gated DeltaNet layer computes its log-decay g in float32 row by row (FLOAT32_INSIDE of the
# values; every gradient through it FLOAT32_RELATIVE); the kernel runs at float64 here
# (megatron_cpu.gdn_without_fla)
GDN_TOLERANCE = {"logprobs": FLOAT32_INSIDE, "grads": FLOAT32_RELATIVE}

# a Mamba2 layer computes in float64 here (megatron_cpu.mamba_without_ssm), but hands its
# kernel A_log and dt_bias in float32 (``.float()``), whose gradients are rounded to float32
# on their way back to the float64 parameters: FLOAT32_RELATIVE of every gradient
MAMBA_TOLERANCE = {"logprobs": FLOAT64_EXACT, "grads": FLOAT32_RELATIVE}


def tolerance(case: dict, key: str) -> float:
    """A case's tolerance for ``key`` (an output, or a parameter's gradient)."""
    kind = "logprobs" if key in ("logprobs", "entropy", "loss") else "grads"
    if case.get("gdn"):
        return GDN_TOLERANCE[kind]
    if case.get("mamba"):
        return MAMBA_TOLERANCE[kind]
    if "num_moe_experts" not in case.get("config", {}):
        return TOLERANCE
    return MOE_TOLERANCE[kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    spawn(megatron_workers.reference_worker, str(out),
          {**CASES, **{n: b for n, (b, _) in BROKEN.items()}, **MISMATCH, **DROPOUT,
           **{n: c for n, (c, _) in REFUSED.items()}}, world=1,
          timeout=900)
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, reference):
    spec = {"name": request.param.replace(" ", "_").replace(",", ""), **LAYOUTS[request.param]}
    broken = {n: b for n, (b, applies) in BROKEN.items() if applies(spec)}
    cases = {n: {**c, "sequence_parallel": spec.get("sequence_parallel", False)}
             for n, c in {**CASES, **broken, **MISMATCH, **DROPOUT,
                          **{n: c for n, (c, _) in REFUSED.items()}}.items()}
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
        if got.get("skip"):
            pytest.skip(got["skip"])
        assert "error" not in got, got.get("trace")
        # the stock model at this TP where Megatron's is not the TP = 1 model's function
        expect = got.get("reference", reference[case])
        bad = {k: v for k, v in differences(got, expect).items()
               if not within(v, tolerance(CASES[case], k))}
        assert not bad, f"{name}, rank {rank}: {bad}"


def test_ranks_that_disagree_refuse_on_every_rank(layout):
    """One all-gather over the tensor x context parallel group before the first collective:
    ranks given different temperatures raise a Disagreement naming it on every rank."""
    name, results, _ = layout
    if len(results) == 1:
        pytest.skip("one rank agrees with itself")
    for rank, per_case in enumerate(results):
        got = per_case["temperatures that differ between ranks"]
        assert "error" in got and got["error"].startswith("Disagreement"), (name, rank, got)
        assert "temperature (rank 0: 1.0 for each of" in got["error"], got["error"]
        assert "tensor- and context-parallel group" in got["error"], got["error"]


@pytest.mark.parametrize("case", list(DROPOUT))
def test_step_in_parts_replays_its_dropout_masks(layout, case):
    name, results, _ = layout
    for rank, per_case in enumerate(results):
        got = per_case[case]
        assert "error" not in got, got.get("trace")
        assert got["dropout_effect"] > 1e-3, (name, rank, got["dropout_effect"])
        a, b = got["pair"]["backward"], got["pair"]["step"]
        # the same parts on the same draw, in float64: TOLERANCE of each value's size
        assert within(abs(float(a["loss"] - b["loss"])), TOLERANCE * abs(float(a["loss"]))), name
        torch.testing.assert_close(b["logprobs"], a["logprobs"], rtol=0,
                                   atol=TOLERANCE * float(a["logprobs"].abs().max()))
        for k, g in a["grads"].items():
            scale = g.abs().max().clamp_min(1e-30)
            assert within((b["grads"][k] - g).abs().max() / scale, TOLERANCE), (name, rank, k)


def test_learnable_sinks_checkpoint_split_by_heads_over_tp(layout):
    """Megatron's distributed checkpoint holds the whole softmax offset (2 layers x 4 heads),
    each TP rank its own heads' share, as Megatron's core attention saves it."""
    name, results, _ = layout
    tp = LAYOUTS[name].get("tp", 1)
    got = {r["attention sinks, learnable"]["offset_shard"] for r in results}
    assert {shape for shape, _ in got} == {(2, 4)}, (name, got)
    assert {offset for _, offset in got} == {(0, 4 // tp * r) for r in range(tp)}, (name, got)


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_a_tree_cannot_run_is_refused_on_every_rank(layout, case):
    name, results, _ = layout
    for rank, per_case in enumerate(results):
        got = per_case[case]
        assert got.get("error", "").startswith(REFUSED[case][1]), (name, rank, got)


def test_parts_refuse_moe_router_losses_by_name():
    """A router loss is a function of every row's routing: no part holds it alone."""
    import types

    from treepack.adapters.megatron.parts import router_losses

    def config(kind="aux_loss", coeff=1e-2, z=None):
        return types.SimpleNamespace(moe_router_load_balancing_type=kind,
                                     moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z)

    assert router_losses(config()) == "aux_loss"
    assert router_losses(config(["seq_aux_loss", "global_aux_loss"], [0.0, 1e-3], 1e-3)) \
        == "global_aux_loss and z_loss"
    assert router_losses(config("none")) is None
    assert router_losses(config(coeff=0.0)) is None


@pytest.mark.parametrize("case", list(BROKEN))
def test_negative_controls_are_caught(layout, case):
    name, results, reference = layout
    if not BROKEN[case][1](LAYOUTS[name]):
        pytest.skip(f"{case!r} does not apply to {name}")
    got = results[0][case]
    assert "error" not in got, got.get("trace")
    worst = max(differences(got, got.get("reference", reference[case])).values())
    assert worst > 1e-4, f"{case} went unnoticed on {name}: {worst:.1e}"


PIPELINES = {
    "pp2, 3 micro-batches": dict(pp=2, world=2, micro_batches=3),
    "tp2 x pp2, 2 micro-batches": dict(tp=2, pp=2, world=4, micro_batches=2),
}
PIPELINE_CASES = ["grouped-query attention, rope", "per-sequence temperatures",
                  "sliding window", "MoE, routing replay",
                  "MoE in the second layer, a route per layer", "multi-latent attention, yarn",
                  "Gated DeltaNet layers", "Mamba2 hybrid layers"]


@pytest.fixture(scope="module", params=list(PIPELINES))
def pipeline(request, reference):
    spec = {"name": request.param.replace(" ", "_").replace(",", ""), **PIPELINES[request.param]}
    spawn(megatron_workers.pipeline_worker, str(reference),
          {n: CASES[n] for n in PIPELINE_CASES}, spec, world=spec["world"], timeout=900)
    results = [torch.load(reference / f"{spec['name']}-rank{r}.pt")
               for r in range(spec["world"])]
    return request.param, results, torch.load(reference / "reference.pt")


@pytest.mark.parametrize("case", PIPELINE_CASES)
def test_packs_as_micro_batches_through_megatrons_pipeline_schedule(pipeline, case):
    """get_forward_backward_func with treepack.megatron.forward_step: the packs are the
    micro-batches, the log-probs come from the last stage, and every stage's gradients
    (times the micro-batches the schedule divides by) are the reference's."""
    name, results, reference = pipeline
    if (CASES[case].get("mla") or CASES[case].get("gdn")) and PIPELINES[name].get("tp", 1) > 1:
        pytest.skip("multi-latent attention and Gated DeltaNet at TP > 1 are not the TP = 1 "
                    "model's function in Megatron itself (megatron_workers.stock_at); tested "
                    "against it at TP = 2")
    expect = reference[case]
    grads = {}
    for rank, per_case in enumerate(results):
        got = per_case[case]
        grads.update(got["grads"])
        if got["last"]:
            for key in ("logprobs", "entropy"):
                diff = ((got[key] - expect[key]).abs().max() / expect[key].abs().max()).item()
                assert within(diff, tolerance(CASES[case], key)), (name, rank, key, diff)
    assert grads.keys() == expect["grads"].keys()
    for k, e in expect["grads"].items():
        diff = ((grads[k] - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
        assert within(diff, tolerance(CASES[case], k)), (name, k, diff)


MOE_CASES = {
    "MoE: load-balancing and z-losses": {"config": megatron_workers.MOE},
    "MoE: global load-balancing loss": {"config": {
        **megatron_workers.MOE, "moe_router_load_balancing_type": "global_aux_loss"}},
    "MoE: routing replay, load-balancing and z-losses": {
        "config": {**megatron_workers.MOE, "moe_enable_routing_replay": True}, "routes": True},
    "MoE: every layer recomputed, its router's losses weighted again": {
        "config": {**megatron_workers.MOE, **RECOMPUTE}},
    "MoE: routing replay, every layer recomputed": {
        "config": {**megatron_workers.MOE, **RECOMPUTE, "moe_enable_routing_replay": True},
        "routes": True},
    # in parts: one rank's experts serve every rank's tokens in each forward
    "MoE: routing replay, in parts": {"config": {
        **megatron_workers.MOE, "moe_enable_routing_replay": True, "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None, "moe_router_load_balancing_type": "none"},
        "routes": True, "parts": 6},
    "broken: the router's losses over packed rows, unweighted":
        {"config": megatron_workers.MOE, "broken": "unweighted router"},
}

# what an MoE model cannot run on a tree: refused by name at prepare, on every EP rank (the
# reference runs it unpacked, as Megatron does)
MOE_REFUSED = {
    "MoE: token dropping": (
        {"config": {**megatron_workers.MOE, "moe_expert_capacity_factor": 1.0}},
        "UnsupportedMegatron: moe_expert_capacity_factor=1.0 (token dropping) on a tree"),
}


@pytest.fixture(scope="module", params=[1, 2], ids=["EP=1", "EP=2"])
def moe(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"moe{request.param}")
    cases = {**MOE_CASES, **{n: c for n, (c, _) in MOE_REFUSED.items()}}
    spawn(megatron_workers.moe_reference_worker, str(out), cases, request.param, world=1,
          timeout=900)
    spawn(megatron_workers.moe_worker, str(out), cases, world=request.param, timeout=900)
    return (request.param, [torch.load(out / f"moe-rank{r}.pt") for r in range(request.param)],
            torch.load(out / "moe-reference.pt"))


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_routers_weight_each_row_by_the_tokens_it_stands_for(moe, case):
    """An MoE model in train mode (top-2 of 4 experts, all-to-all dispatch, the router's
    load-balancing and z-losses on): each rank's pack against its sequences as one padded
    batch through Megatron's own path, the padding out of the router's losses. Log-probs and
    every gradient (the router's and each expert's included, summed over the expert-parallel
    ranks as their data-parallel reduction does) equal it; unweighted, the router's
    gradients do not."""
    ranks, results, reference = moe
    if ranks > 1 and "in parts" in case:  # EP ranks would run different numbers of parts
        for per_case in results:
            assert per_case[case].get("error", "").startswith(
                "UnsupportedMegatron: treepack.megatron.backward_in_parts: expert parallelism "
                "(expert_model_parallel_size=2)"), per_case[case]
        return
    if ranks > 1 and "global" in case:
        pytest.skip("the global loss sums its token counts over the data-parallel ranks, "
                    "which the reference, each rank's batch in one process, does not see")
    expect_grads = {k: sum(r["grads"][k] for r in reference[case]["ranks"])
                    for k in reference[case]["ranks"][0]["grads"]}
    for rank, per_case in enumerate(results):
        got = per_case[case]
        assert "error" not in got, got.get("trace")
        want = reference[case]["ranks"][rank]["logprobs"]
        width = min(want.shape[1], got["logprobs"].shape[1])
        diffs = {"logprobs": ((got["logprobs"][:, :width] - want[:, :width]).abs().max()
                              / want.abs().max()).item()}
        assert got["grads"].keys() == expect_grads.keys()
        for k, e in expect_grads.items():
            diffs[k] = ((got["grads"][k] - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
        if case.startswith("broken"):
            assert max(diffs.values()) > 1e-4, f"{case} went unnoticed at EP={ranks}: {diffs}"
        else:
            bad = {k: v for k, v in diffs.items()
                   if not within(v, MOE_TOLERANCE["logprobs" if k == "logprobs" else "grads"])}
            assert not bad, f"EP={ranks}, rank {rank}: {bad}"



@pytest.mark.parametrize("case", list(MOE_REFUSED))
def test_moe_settings_a_tree_cannot_run_are_refused_on_every_rank(moe, case):
    ranks, results, _ = moe
    for rank, per_case in enumerate(results):
        got = per_case[case]
        assert got.get("error", "").startswith(MOE_REFUSED[case][1]), (ranks, rank, got)


@pytest.mark.parametrize("fields,words", [
    ({"moe_enable_routing_replay": True, "moe_router_fusion": True}, "moe_router_fusion=True"),
    ({"moe_expert_capacity_factor": 1.25}, "moe_expert_capacity_factor=1.25"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]},
     "recompute_modules with 'moe' on a tree"),
])
def test_moe_settings_a_tree_cannot_run_are_refused_by_name(fields, words):
    import types

    from treepack.adapters.megatron import moe
    from treepack.megatron import UnsupportedMegatron

    with pytest.raises(UnsupportedMegatron, match=words):
        moe.check(types.SimpleNamespace(**fields))
    moe.check(types.SimpleNamespace(recompute_granularity="selective",
                                    recompute_modules=["core_attn", "moe_act"]))


def test_mla_keys_and_values_travel_as_latents_under_cp(tmp_path):
    """At CP = 2 each rank receives every other rank's latent and rope key per row
    (kv_lora_rank + qk_pos_emb_head_dim values) in place of the expanded keys and values of
    its heads (heads / CP x (qk_head_dim + qk_pos_emb_head_dim + v_head_dim)); the queries
    and outputs travel as before, and the log-probs are the same."""
    spawn(megatron_workers.latent_traffic_worker, str(tmp_path), world=2, timeout=300)
    cfg = megatron_workers.config({"mla": "rope"})
    heads, layers, cp = cfg.num_attention_heads, cfg.num_layers, 2
    key, value = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    for rank in range(cp):
        got = torch.load(tmp_path / f"traffic-rank{rank}.pt")
        width = -(-got["rows"] // cp)  # each rank's rows, padded

        def per_rank(kv_values_per_row):  # queries and outputs all-to-all, keys/values
            exchanged = heads * (key + value) * (cp - 1) // cp
            return layers * width * (exchanged + kv_values_per_row)

        latent = per_rank((cp - 1) * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim))
        expanded = per_rank(heads * (key + value) * (cp - 1) // cp)
        assert got["latent"]["received"] == latent, (got["latent"]["received"], latent)
        assert got["expanded"]["received"] == expanded, (got["expanded"]["received"], expanded)
        assert latent < expanded
        assert within(((got["latent"]["logprobs"] - got["expanded"]["logprobs"]).abs().max()
                       / got["expanded"]["logprobs"].abs().max()).item(), FLOAT64_EXACT)


@pytest.mark.parametrize("tp, cp, latent", [(1, 2, True), (8, 8, True), (8, 16, False)])
def test_mla_exchange_carries_the_smaller_of_latents_and_keys(tp, cp, latent):
    """DeepSeek-V3's shapes: the latent (512 + 64 values a row) travels until the expanded
    keys and values of a rank's heads (128 / TP / CP heads x 320) are smaller."""
    from types import SimpleNamespace

    from treepack.adapters.megatron.latent import LatentKeys

    heads = 128 // tp
    config = SimpleNamespace(kv_lora_rank=512, qk_pos_emb_head_dim=64, qk_head_dim=128,
                             v_head_dim=128, fp8=None, fp4=None)
    up = SimpleNamespace(weight=torch.empty(heads * 256, 512), bias=None)
    attention = SimpleNamespace(config=config, num_attention_heads_per_partition=heads,
                                recompute_up_proj=False, linear_kv_up_proj=up)
    why = LatentKeys.refusal(attention, cp)
    assert (why is None) == latent, why
    if not latent:
        assert "the expanded keys and values are the smaller (320 values" in why


def test_layer_spec_takes_megatrons_te_hybrid_stack_spec():
    """megatron-core's own hybrid stack spec (``mamba_stack_spec``: TransformerEngine's fused
    norm + linear layers, TE's core attention): the attention layer's core attention becomes
    the tree's with TE's as its stock path, everything else as it was, the original
    untouched; a stack of Mamba2 layers only (no core attention) is a tree spec too."""
    import dataclasses

    import megatron_cpu

    megatron_cpu.mamba_without_ssm()  # megatron-core's Mamba module imports Triton
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.transformer.identity_op import IdentityOp

    import treepack.megatron as tm

    stock = mamba_stack_spec.submodules
    attention = stock.attention_layer.submodules.self_attention.submodules
    out = tm.layer_spec(mamba_stack_spec).submodules
    tree = out.attention_layer.submodules.self_attention.submodules
    assert tree.core_attention.module is tm.TreeCoreAttention
    assert tree.core_attention.params["stock"] is attention.core_attention
    assert (tree.linear_qkv, tree.linear_proj) == (attention.linear_qkv, attention.linear_proj)
    assert out.mamba_layer.submodules.mixer.module is stock.mamba_layer.submodules.mixer.module
    assert attention.core_attention is not tm.TreeCoreAttention  # a copy was changed
    mamba_only = dataclasses.replace(stock, attention_layer=IdentityOp)
    spec = type(mamba_stack_spec)(module=mamba_stack_spec.module, submodules=mamba_only)
    assert tm.layer_spec(spec).submodules.mamba_layer.submodules.mixer.module \
        is stock.mamba_layer.submodules.mixer.module
    neither = dataclasses.replace(mamba_only, mamba_layer=IdentityOp)
    with pytest.raises(tm.UnsupportedMegatron, match="found no core_attention"):
        tm.layer_spec(type(mamba_stack_spec)(module=mamba_stack_spec.module,
                                             submodules=neither))
