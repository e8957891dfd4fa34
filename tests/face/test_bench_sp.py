"""bench/sp.py runs as it stands (tiny shapes, gloo on this CPU), its all-to-all count agrees
with its formula, and bench/gpu.py turns its report into the sequence-parallelism bars."""

import importlib.util
import json

import pytest
from test_bench_scripts import ROOT, run_script
from tolerance import FLOAT32_RELATIVE, within


def gpu_script():
    spec = importlib.util.spec_from_file_location("gpu_bench_sp", ROOT / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    return gpu


def test_sp_script_quick_run_measures_what_its_table_claims(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    result = run_script([str(ROOT / "bench" / "sp.py"), "--quick", "--ranks", "1", "2",
                         "--workloads", "trajectory"], tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all-to-all bytes per layer equal the formula, forward and backward: PASS" \
        in result.stdout
    report = json.loads((tmp_path / "sp.json").read_text())
    one, two = (report["results"][p]["trajectory"] for p in ("1", "2"))
    for layout in ("tree", "padding_free"):
        assert one[layout]["traffic"]["forward"]["sent"] == 0  # P = 1: the ordinary path
        traffic = two[layout]["traffic"]
        assert traffic["forward"]["calls"] == traffic["backward"]["calls"] == 2  # per layer
        assert 0 < two[layout]["activation_bytes"] < one[layout]["activation_bytes"]
    assert two["tree"]["rows"] < two["padding_free"]["rows"]
    # a float32 model: the same gradients, relative to the largest (tolerance.FLOAT32_RELATIVE)
    assert within(max(report["gradient_errors"].values()), FLOAT32_RELATIVE)

    gpu = gpu_script()  # what bench/gpu.py makes of the same report on two GPUs
    monkeypatch.setenv("OUT", str(tmp_path))
    gpu.record_sp(report)
    assert sum(line.startswith("sp        trajectory") for line in gpu.summary()) == 2
    bars = "\n".join(gpu.bars())
    assert "SP=2 per-rank activation memory <= 0.6x SP=1 (trajectory): PASS" in bars
    assert "SP tree step never slower than padding-free: " in bars


def test_gpu_script_skips_sp_on_one_gpu_and_fails_what_misses_the_bars(monkeypatch, tmp_path):
    gpu = gpu_script()
    monkeypatch.setenv("OUT", str(tmp_path))
    gpu.part_sp(gpu.torch.device("cpu"), dry=True)
    assert "skipped: sequence parallelism needs 2 GPUs" in gpu.RESULTS["sp"][0]["note"]
    for ranks, memory, ratio in ((1, 100.0, 0.5), (2, 70.0, 1.2)):
        gpu.record("sp", workload="trajectory", ranks=ranks, rows=10, padding_free_rows=30,
                   activation_mb={"tree": memory, "padding_free": 3 * memory},
                   peak_mb={"tree": memory, "padding_free": 3 * memory}, tree_s=1.0,
                   padding_free_s=1.0 / ratio, tree_vs_padding_free=ratio,
                   alltoall_forward_mb=1.0, alltoall_formula_mb=1.0, grad_rel_error=1e-7)
    bars = "\n".join(gpu.bars())
    assert "SP=2 per-rank activation memory <= 0.6x SP=1 (trajectory): FAIL (0.700x)" in bars
    assert "SP tree step never slower than padding-free: FAIL (worst 1.200)" in bars
