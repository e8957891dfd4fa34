"""``treepack bench --e2e``: whole GRPO runs, stock TRL and TreepackGRPOTrainer, through the
command line as a user runs it (each run in a process of its own, steps in turn)."""

import json
import math

import pytest

pytest.importorskip("trl")

from treepack import cli  # noqa: E402
from treepack.face.benchmark import e2e, e2e_report  # noqa: E402

from tolerance import FLOAT32_RELATIVE, FLOAT64_EXACT, within  # noqa: E402


def bench(tmp_path, capsys, *argv):
    out_json, out_png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    code = cli.main(["bench", "--e2e", "--json", str(out_json), "--plot", str(out_png), *argv])
    out, err = capsys.readouterr()
    return code, out, err, out_json, out_png


@pytest.mark.parametrize("dtype, workload, allowed", [
    ("float64", "long_completion", FLOAT64_EXACT),
    ("float32", "long_prompt", FLOAT32_RELATIVE),
])
def test_the_runs_sample_alike_take_turns_and_agree(tmp_path, capsys, dtype, workload, allowed):
    """Three steps each: the same completions at every step (their digests), losses equal to
    the dtype's rounding (each the model computed two ways, on weights that agree to it), the
    steps taken in turn, and the JSON of the issue's contract."""
    steps = 3
    code, out, err, path, png = bench(tmp_path, capsys, "--e2e-steps", str(steps), "--dtype",
                                      dtype, "--workloads", workload)
    assert code == 0, err
    assert "same samples" in out and png.stat().st_size > 0
    result = json.loads(path.read_text())
    assert result["dtype"] == dtype and result["model"] == "qwen2-1m"
    (work,) = result["workloads"]
    assert result["runs"] == work["runs"]  # the contract's top level: the first workload's
    stock, tree = (result["runs"][name]["steps"] for name in ("stock", "treepack"))
    assert len(stock) == len(tree) == steps
    for run in ("stock", "treepack"):
        assert result["runs"][run]["parameters"] == f"torch.{dtype}"
        for step in result["runs"][run]["steps"]:
            assert set(step["seconds"]) == {"generate", "score", "logprobs", "update"}
            assert all(v >= 0 for v in step["seconds"].values())
            assert math.isfinite(step["reward"]) and math.isfinite(step["loss"])
    assert [s["completions"] for s in stock] == [s["completions"] for s in tree]
    assert work["agreement"]["identical_steps"] == steps
    scale = max(abs(s["loss"]) for s in stock)
    for a, b in zip(stock, tree):
        assert within(abs(a["loss"] - b["loss"]), allowed * scale), (a["loss"], b["loss"])
    # the steps interleave: stock's step k, then treepack's step k, then stock's step k + 1
    began = [t for a, b in zip(stock, tree) for t in (a["began"], b["began"])]
    assert began == sorted(began), began
    assert 0 < work["agreement"]["token_ratio"] < 1
    # the no-grad log-probs (the reference model's, beta > 0) ran in both
    assert all(s["seconds"]["logprobs"] > 0 for s in stock + tree)


def summary_runs(digests_tree):
    def step(reward, digest):
        return {"reward": reward, "loss": 0.5, "completions": digest,
                "seconds": {"generate": 1.0, "score": 0.0, "logprobs": 1.0, "update": 2.0}}

    stock = [step(0.1 * i, f"d{i}") for i in range(4)]
    tree = [step(0.1 * i + (0.05 if d != f"d{i}" else 0), d) for i, d in enumerate(digests_tree)]
    return {"stock": {"steps": stock}, "treepack": {"steps": tree}}


def test_the_summary_finds_where_the_runs_part():
    runs = summary_runs(["d0", "d1", "x2", "d3"])
    agreement = e2e_report.summarize(runs, 4)
    assert agreement["identical_steps"] == 2
    assert agreement["after_split"]["steps"] == 2
    means = agreement["after_split"]["reward_mean"]
    assert means["treepack"] - means["stock"] == pytest.approx(0.025)
    assert agreement["training_ratio"] == pytest.approx(1.0)
    full = e2e_report.summarize(summary_runs(["d0", "d1", "d2", "d3"]), 4)
    assert full["identical_steps"] == 4 and "after_split" not in full
    last = e2e_report.summarize(summary_runs(["d0", "d1", "d2", "x3"]), 4)  # one step after: no
    assert last["after_split"]["reward_difference_in_standard_errors"] is None  # error bar


def test_a_float64_run_whose_samples_part_fails(tmp_path, capsys, monkeypatch):
    """In float64 the runs must sample alike at every step: where they do not, the command
    says so and exits 1."""
    def parted(workloads, **kwargs):
        runs = summary_runs(["d0", "x1", "x2", "x3"])
        return {"model": "qwen2-1m", "model_params": 1, "dtype": "float64", "device": "cpu",
                "steps": 4, "num_generations": 8, "prompts_per_step": 2,
                "learning_rate": 1e-3, "beta": 0.0, "runs": runs, "workloads": [
                    {"workload": "long_prompt", "runs": runs,
                     "agreement": e2e_report.summarize(runs, 4)}]}

    monkeypatch.setattr(e2e, "run_e2e", parted)
    code, out, err, path, _ = bench(tmp_path, capsys, "--dtype", "float64", "--e2e-steps", "4",
                                    "--no-plot")
    assert code == 1 and "FAIL" in err and "long_prompt" in err
    assert "from step 2 the runs sample differently" in out
    assert json.loads(path.read_text())["workloads"][0]["agreement"]["identical_steps"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--e2e", "--dtype", "bfloat16", "--device", "cpu"], "GPU's bfloat16 autocast"),
    (["--dtype", "float64"], "float64 is for --e2e"),
    (["--model", "qwen2-1m"], "--e2e's CPU model"),
    (["--workloads", "long_prompt"], "these are --e2e's"),
    (["--e2e", "--steps", "50"], "--steps: the step benchmark's options"),
    (["--e2e-steps", "5"], "--e2e-steps is for --e2e"),
])
def test_bench_refuses_what_its_mode_cannot_run(capsys, argv, message):
    code = cli.main(["bench", *argv, "--no-plot", "--json", "/dev/null"])
    _, err = capsys.readouterr()
    assert code == 2 and message in err, err
