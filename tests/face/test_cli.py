import json
import subprocess
import sys
from pathlib import Path

import pytest

import treepack
from treepack import cli
from treepack.planning import jsonl
from treepack.synthetic import agentic_batch

from tolerance import FLOAT32_RELATIVE, FLOAT64_OP, within

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_stats_builtin_batch_json(capsys):
    code, out, _ = run(capsys, "stats", "--json")
    assert code == 0
    result = json.loads(out)
    batch = agentic_batch()
    pack = treepack.TreePack.from_sequences(batch)
    assert result["num_sequences"] == len(batch)
    assert result["original_tokens"] == pack.num_original_tokens
    assert result["packed_rows"] == pack.num_packed_rows
    assert result["token_ratio"] == pack.token_ratio  # JSON keeps a float64 exactly
    assert 0 < result["attention_pairs_ratio"] < 1


def test_stats_human_readable(capsys):
    code, out, _ = run(capsys, "stats")
    assert code == 0
    for word in ("sequences", "original tokens", "packed rows", "token ratio",
                 "attention pairs ratio"):
        assert word in out


def test_stats_file_lists_and_objects(tmp_path, capsys):
    path = tmp_path / "batch.jsonl"
    path.write_text('[1, 2, 3]\n{"input_ids": [1, 2, 4], "reward": 1.0}\n\n[1, 2]\n')
    code, out, _ = run(capsys, "stats", str(path), "--json")
    result = json.loads(out)
    assert code == 0
    assert (result["num_sequences"], result["original_tokens"], result["packed_rows"]) == (3, 8, 4)


@pytest.mark.parametrize(
    "lines, line_no, words",
    [
        (['[1, 2]', '[1, "x"]'], 2, ["integers", "'x'"]),
        (['[1, 2]', '', '[3, -1]'], 3, [">= 0", "-1"]),
        (['[1, 2', '[1]'], 1, ["not valid JSON"]),
        (['[1]', '[]'], 2, ["empty"]),
        (['{"ids": [1, 2]}'], 1, ["input_ids"]),
        (['"hello"'], 1, ["list of token ids", "str"]),
        (['[1.5, 2]'], 1, ["integers", "1.5"]),
        # the fields of groups and placement: named, with the rule and the fix
        (['{"input_ids": [1], "micro_batches": 0}'], 1, ["'micro_batches'", "did you mean",
                                                         "'micro_batch'"]),
        (['{"prompt": [1, 2]}'], 1, ["'prompt'", "'completion'"]),
        (['{"input_ids": [1], "prompt": [1], "completion": [2]}'], 1, ["one of them"]),
        (['{"input_ids": [1], "uid": "a", "group": "a"}'], 1, ["both 'uid' and 'group'"]),
        (['{"input_ids": [1], "uid": [1]}'], 1, ["'uid' is [1]", "string or an integer"]),
        (['{"input_ids": [1], "rank": -1}'], 1, ["'rank' is -1", "integer >= 0"]),
        (['{"input_ids": [1], "rank": 0}', '{"input_ids": [2]}'], 2,
         ["line 1 has 'rank' and line 2 has not", "every line a 'rank', or none"]),
        (['{"input_ids": [1]}', '{"input_ids": [2], "uid": 1}'], 2,
         ["line 2 has 'uid' and line 1 has not"]),
        (['{"prompt_ids": [1], "completion_ids": "x"}'], 1, ["'completion_ids' must be a list"]),
        # padding left in: -100 and padding are named, with the fix
        (['[1, 2, -100]'], 1, ["found -100 at position 2", "padding", "-100"]),
        # a whole batch on one line
        (['[[1, 2], [3, 4]]'], 1, ["holds 2 lists", "one sequence per line"]),
        # lines that mix a prompt format with input_ids: which lines, not a silent drop
        (['{"input_ids": [1, 2], "uid": 1}', '{"prompt": [1], "completion": [2], "uid": 1}'],
         2, ["mix formats", "line 2 gives 'prompt'", "line 1 'input_ids' (no prompt)"]),
        (['{"prompt": [1], "completion": [2], "uid": 1}'] * 2 + ['{"input_ids": [1, 2], '
                                                                   '"uid": 1}'],
         3, ["line 1 gives 'prompt'", "line 3 'input_ids' (no prompt)", "every line its prompt"]),
        (['{"input_ids": [1, 2], "keys": [0]}'], 1, ["'keys' has 1 values", "2 tokens"]),
        (['{"input_ids": [1, 2], "session": [1]}'], 1, ["'session' is [1]"]),
    ],
)
def test_stats_bad_line_reports_its_number(tmp_path, capsys, lines, line_no, words):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = run(capsys, "stats", str(path))
    assert code == 2 and out == ""
    assert f"{path}:{line_no}:" in err
    for w in words:
        assert w in err, err


def test_stats_missing_and_empty_files(tmp_path, capsys):
    code, _, err = run(capsys, "stats", str(tmp_path / "nope.jsonl"))
    assert code == 2 and "cannot read" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    code, _, err = run(capsys, "stats", str(empty))
    assert code == 2 and "no sequences" in err


def test_large_file_shows_progress_bar(tmp_path, capsys, monkeypatch):
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(list(range(i % 50 + 1))) + "\n" for i in range(2000)))
    monkeypatch.setattr(jsonl, "PROGRESS_MIN_BYTES", path.stat().st_size // 2)
    code, out, err = run(capsys, "stats", str(path), "--json")
    assert code == 0 and json.loads(out)["num_sequences"] == 2000
    assert "reading big.jsonl" in err and "100%" in err
    monkeypatch.setattr(jsonl, "PROGRESS_MIN_BYTES", path.stat().st_size + 1)
    run(capsys, "stats", str(path), "--json")
    assert "reading" not in capsys.readouterr().err


def test_console_script_runs():
    exe = [sys.executable, "-m", "treepack.cli", "stats", "--json"]
    result = subprocess.run(exe, capture_output=True, text=True, check=True)
    assert json.loads(result.stdout)["num_sequences"] == len(agentic_batch())


def test_import_pulls_no_optional_package():
    # Beyond torch and numpy (and what they load themselves), only treepack and stdlib.
    code = (
        "import sys; import torch, numpy; before = set(sys.modules); import treepack; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(','.join(sorted(new - set(sys.stdlib_module_names) - {'treepack'})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == ""


def test_verify_command_passes_and_prints_the_report(capsys):
    pytest.importorskip("transformers")
    code, out, _ = run(capsys, "verify", "--family", "qwen2", "--layers", "2")
    assert code == 0
    for word in ("logprobs", "loss", "grads", "params", "PASS", "Qwen2ForCausalLM"):
        assert word in out
    code, out, _ = run(capsys, "verify", "--family", "llama", "--dtype", "bfloat16")
    assert code == 0 and "relative L2 error per tensor" in out and "unpacked" in out


def test_verify_command_exit_status_1_above_tolerance(capsys, monkeypatch):
    pytest.importorskip("transformers")
    from treepack import verification

    monkeypatch.setitem(verification.TOLERANCE, __import__("torch").float32, 1e-12)
    monkeypatch.setattr(verification, "FLOOR_FACTOR", 0.0)
    code, out, _ = run(capsys, "verify", "--family", "llama")
    assert code == 1 and "FAIL" in out


def test_verify_all_runs_the_census_writes_its_table_and_fails_on_a_wrong_family(
        capsys, monkeypatch, tmp_path):
    """`treepack verify --all`: the census's table on stdout and in --markdown; exit 1 when a
    family is silently wrong, crashed or hung, 0 when every one is exact, refused or not
    built. (The census itself: tests/face/test_census.py.)"""
    pytest.importorskip("transformers")
    from treepack.face import census

    seen = {}

    def fake(names=None, *, timeout, workers=2, mapping="causal-lm"):
        seen[mapping] = timeout
        return outcomes if mapping == "causal-lm" else images

    monkeypatch.setattr(census, "census", fake)
    outcomes = [census.Outcome("llama", "exact", "logprobs 1e-16"),
                census.Outcome("doge", "refused", "a bias")]
    images = [census.Outcome("llava", "exact", "logprobs 1e-16")]
    table = tmp_path / "census.md"
    code, out, _ = run(capsys, "verify", "--all", "--timeout", "7", "--markdown", str(table))
    assert code == 0 and seen == {"causal-lm": 7, "image-text-to-text": 7}
    assert "causal-lm: 2 families: 1 exact, 1 refused" in out
    assert "image-text-to-text: 1 families: 1 exact" in out
    assert table.read_text().strip() in out
    images.append(census.Outcome("y", "crash", "IndexError"))  # either mapping fails it
    assert run(capsys, "verify", "--all")[0] == 1
    images.pop()
    outcomes.append(census.Outcome("x", "wrong", "grads 1e-2"))
    assert run(capsys, "verify", "--all")[0] == 1
    with pytest.raises(SystemExit):  # one family or all of them
        cli.main(["verify", "--all", "--family", "llama"])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_verify_command_passes_on_a_vision_language_family(capsys, family):
    pytest.importorskip("transformers")
    code, out, _ = run(capsys, "verify", "--family", family)
    assert code == 0 and "PASS" in out
    assert "8 sequences, 112 tokens and 10 images (3 distinct)" in out
    assert "every sequence alone with its own images" in out


@pytest.mark.parametrize("control", ["positions", "vision_gradient"])
def test_verify_command_fails_a_vision_language_pack_that_cuts_a_corner(capsys, monkeypatch,
                                                                        control):
    """Negative controls: depth positions on an mrope model (the images' positions dropped),
    and image features with no gradient into the vision tower in the packed run."""
    pytest.importorskip("transformers")
    from treepack.adapters.hf import vision

    if control == "positions":
        monkeypatch.setattr(vision, "_rope_positions", lambda *args, **kwargs: None)
    else:
        encode = vision._encode

        def detached(*args):
            features, deepstack = encode(*args)
            return features.detach(), [d.detach() for d in deepstack]

        monkeypatch.setattr(vision, "_encode", detached)
    code, out, _ = run(capsys, "verify", "--family", "qwen2_vl")
    assert code == 1 and "FAIL" in out
    if control == "vision_gradient":
        assert "no gradient in one run: model.visual." in out


def test_verify_refuses_images_of_other_sequences():
    pytest.importorskip("transformers")
    from treepack import hf, zoo
    from treepack.verification import verification_image_batch, verify

    model = zoo.tiny_vision_model("qwen2_vl")
    batch = verification_image_batch("qwen2_vl")
    images = hf.Images(model, batch.sequences, pixel_values=batch.pixel_values,
                       image_grid_thw=batch.image_grid_thw)
    with pytest.raises(ValueError, match="images holds 8 sequences but verify was given 7"):
        verify(model, batch.sequences[:7], images=images)
    with pytest.raises(ValueError, match="sequence 1 is not the images' sequence 1"):
        verify(model, [batch.sequences[0], batch.sequences[2]] + batch.sequences[2:],
               images=images)


def test_verify_command_reports_flex_cpu_backward_clearly(capsys):
    pytest.importorskip("transformers")
    code, out, err = run(capsys, "verify", "--family", "llama", "--backend", "flex")
    assert code == 2 and out == ""
    assert "no FlexAttention backward on CPU" in err and "segment" in err


def test_bench_command_writes_table_json_and_plot(capsys, tmp_path):
    import statistics

    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    code, out, err = run(capsys, "bench", "--prompts", "1", "--rollouts", "3", "--steps", "2",
                         "--prefix-len", "24", "--branch-len", "8", "--tool-len", "4",
                         "--json", str(out_json), "--plot", str(out_png), "--repeats", "2")
    assert code == 0, err
    for word in ("step time", "peak memory", "FLOP-ratio limit", "padding-free", "tree / padded",
                 "median of 2 rounds", "equivalence", "Claw-R1", "0.500", "~0.53"):
        assert word in out
    result = json.loads(out_json.read_text())
    (work,) = result["workloads"]
    assert work["sequences"] == 6 and work["packed_rows"] < work["original_tokens"]
    assert set(work["steps"]) == {"padded", "padding_free", "tree_logits", "tree"}
    assert all(within(s["grad_max_rel_error"], FLOAT32_RELATIVE)  # a float32 model
               and within(s["loss_rel_error"], FLOAT32_RELATIVE) for s in work["steps"].values())
    for s in work["steps"].values():  # a step's time: the median of its rounds, and their range
        assert len(s["round_seconds"]) == 2 == result["repeats"]
        assert s["seconds"] == pytest.approx(statistics.median(s["round_seconds"]),
                                             rel=FLOAT64_OP, abs=0)
        assert s["seconds_spread"] == [min(s["round_seconds"]), max(s["round_seconds"])]
    tree, padded = (work["steps"][k]["round_seconds"] for k in ("tree", "padded"))
    per_round = [t / p for t, p in zip(tree, padded)]  # a ratio: within each round, then median
    # medians and ranges of a few float64 quotients: FLOAT64_OP
    assert work["tree_vs_padded"] == pytest.approx(statistics.median(per_round), rel=FLOAT64_OP,
                                                   abs=0)
    assert work["tree_vs_padded_spread"] == pytest.approx([min(per_round), max(per_round)],
                                                          rel=FLOAT64_OP, abs=0)
    assert work["tree_vs_padded_uncertain"] == (min(per_round) < 1 < max(per_round))
    assert len(result["claw_r1"]) == 3 and result["backend"] == "auto"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    progress = [line.split("] ", 1)[1] for line in err.splitlines()
                if line.startswith("treepack bench [")]  # one line each, as it runs
    assert progress[0] == "building the model" and progress[-1] == "done"
    assert progress[1] == "custom: warm-up round, every step checked against the padded one"
    assert [line.split(":")[1] for line in progress[2:4]] == [" round 1 of 2", " round 2 of 2"]
    assert all(f"{step} " in progress[2] for step in work["steps"])


def test_bench_flags_a_ratio_whose_rounds_disagree(capsys, tmp_path, monkeypatch):
    """A load burst during one round's tree step makes that round's tree / padded ratio read
    above 1 while the others read below: the median stands, and the ratio is flagged uncertain
    in the JSON and marked in the table. The steps run for real; the clock is a fake one in
    which padded takes 4 s, padding-free 3 s and tree 1 s, but 5 s in round 2."""
    pytest.importorskip("transformers")
    from treepack.face.benchmark import compare

    real = compare.interleave

    def on_a_fake_clock(steps, rounds, **kwargs):
        now, calls = [0.0], {name: 0 for name in steps}
        cost = {"padded": 4.0, "padding_free": 3.0, "tree": 1.0}

        def timed(name, step):
            def run():
                step()
                calls[name] += 1
                now[0] += cost[name] * (5 if (name, calls[name]) == ("tree", 2) else 1)
            return run

        return real({name: timed(name, step) for name, step in steps.items()}, rounds,
                    clock=lambda: now[0], **kwargs)

    monkeypatch.setattr(compare, "interleave", on_a_fake_clock)
    out = tmp_path / "bench.json"
    code, table, _ = run(capsys, "bench", "--quick", "--prompts", "1", "--rollouts", "2",
                         "--steps", "1", "--prefix-len", "8", "--branch-len", "4", "--no-plot",
                         "--json", str(out))
    (work,) = json.loads(out.read_text())["workloads"]
    assert code == 0 and work["steps"]["tree"]["round_seconds"] == [1.0, 5.0, 1.0]
    assert work["steps"]["tree"]["seconds"] == 1.0
    assert (work["tree_vs_padded"], work["tree_vs_padded_spread"]) == (0.25, [0.25, 1.25])
    assert work["tree_vs_padded_uncertain"] and work["tree_vs_padding_free_uncertain"]
    (row,) = [line for line in table.splitlines()
              if line.startswith("  custom ") and "]" in line]  # the time table's row
    assert "0.250 [0.250-1.250]*" in row and row.count("]*") == 2
    assert "the rounds disagree on which step is faster" in table


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "0 must be at least 1"),
    (["--prompts", "-1"], "-1 must be at least 1"),
    (["--jitter", "1.5"], "must be in [0, 1)"),
    (["--repeats", "0"], "0 must be at least 1"),
    (["--model", "gpt5"], "invalid choice"),
])
def test_bench_refuses_bad_flags_with_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_help_and_version_answer_without_importing_torch():
    code = ("import sys; from treepack import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'building the parser imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "usage: treepack" in result.stdout
    version = subprocess.run([sys.executable, "-m", "treepack.cli", "--version"],
                             capture_output=True, text=True)
    assert version.stdout.strip() == f"treepack {treepack.__version__}"


def test_parser_choices_match_the_library():
    from treepack import zoo
    from treepack.attention import CHOICES

    assert cli.BACKEND_CHOICES == CHOICES
    parser = cli.build_parser()
    for family in [*zoo.FAMILIES, *zoo.VISION_FAMILIES]:
        assert parser.parse_args(["verify", "--family", family]).family == family
    for backend in CHOICES:
        assert parser.parse_args(["bench", "--backend", backend]).backend == backend


def test_stats_reads_standard_input(monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"[1, 2, 3]\n[1, 2, 4]\n")))
    code, out, _ = run(capsys, "stats", "-", "--json")
    assert code == 0 and json.loads(out)["packed_rows"] == 4


@pytest.mark.parametrize("argv, message", [
    (["verify", "--family", "llama", "--layers", "0"], "0 must be at least 1"),
    (["verify", "--family", "llama", "--layers", "1000000000"], "is more than 64"),
    (["verify", "--family", "llama", "--seed", "-1"], "-1 must be in [0, 2**32)"),
    (["verify", "--family", "llama", "--pad-to-multiple-of", "x"], "'x' is not an integer"),
])
def test_verify_refuses_bad_flags_with_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_on_cuda_without_cuda_says_so(capsys):
    pytest.importorskip("transformers")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run(capsys, "bench", "--device", "cuda", "--no-plot")
    assert code == 2 and "--device cuda: this torch sees no CUDA device" in err


def test_stats_reads_the_rollout_format_collate_takes(tmp_path, capsys):
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"prompt": [1, 2, 3], "completion": [4, 5], "advantage": 1.0}\n'
                    '{"prompt": [1, 2, 3], "completion": [4, 6]}\n')
    code, out, _ = run(capsys, "stats", str(path), "--json")
    result = json.loads(out)
    assert code == 0 and (result["original_tokens"], result["packed_rows"]) == (10, 6)


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_bench_checks_its_output_paths_before_the_run(capsys, flag):
    """A path it cannot write is refused at once, not after minutes of benchmarking."""
    code, _, err = run(capsys, "bench", "--quick", flag, "/nonexistent/folder/out.x")
    assert code == 2 and f"{flag} /nonexistent/folder/out.x: cannot write there" in err


def test_bench_on_a_batch_of_two_token_sequences_passes(capsys, tmp_path):
    """1-token prompts and branches: a key bias's gradient is zero in exact arithmetic and
    rounding in both runs; judged per tensor it read as a 300 % error and bench exited 1. The
    FLOP-ratio limit counted the pack's padding rows (64x); with nothing shared it is 1."""
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    code, _, _ = run(capsys, "bench", "--quick", "--prompts", "1", "--rollouts", "1", "--steps",
                     "1", "--prefix-len", "1", "--branch-len", "1", "--no-plot", "--json",
                     str(out))
    result = json.loads(out.read_text())
    (work,) = result["workloads"]
    # a quotient of FLOP counts (float64); a float32 model's gradients
    assert code == 0 and work["flop_ratio_limit"] == pytest.approx(1.0, rel=FLOAT64_OP, abs=0)
    assert within(max(s["grad_max_rel_error"] for s in work["steps"].values()), FLOAT32_RELATIVE)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_stats_on_a_trl_dump_reports_what_the_step_lost(tmp_path, capsys):
    """TRL's columns, dumped with rows_from_trl: the file's numbers are report()'s on the
    tensors, and every cause the dump can show is measured."""
    import torch

    from treepack.sharing import report, rows_from_trl

    prompt = torch.tensor([[0, 0, 7, 8, 9]] * 4 + [[3, 4, 5, 6, 2]] * 4)  # 2 prompts x 4
    prompt_mask = (prompt > 0).long()
    completion = torch.tensor([[1, 2, 0], [1, 3, 4], [5, 0, 0], [6, 6, 6]] * 2)
    completion_mask = (completion > 0).long()
    micro = torch.tensor([0, 1, 0, 1, 0, 0, 1, 1])  # the first prompt's rollouts split
    rows = rows_from_trl(prompt, prompt_mask, completion, completion_mask, rank=0,
                         micro_batch=micro)
    code, out, _ = run(capsys, "stats", write_jsonl(tmp_path / "trl.jsonl", rows), "--json")
    assert code == 0
    seqs = [p[pm.bool()].tolist() + c[cm.bool()].tolist()
            for p, pm, c, cm in zip(prompt, prompt_mask, completion, completion_mask)]
    expected = report(seqs, prompt_lengths=prompt_mask.sum(1), ranks=[0] * 8,
                      micro_batches=micro)
    sharing = json.loads(out)["sharing"]
    assert sharing == json.loads(json.dumps(expected.as_dict()))
    assert sharing["groups"] == 2 and sharing["lost"]["across_micro_batches"] == {
        "rows": 3 + 5 + 1, "share": 1.0, "measured": True, "groups": 2}
    # each prompt twice, and the first prompt's completions [1, 2] and [1, 3, 4] their "1"
    assert not sharing["lost"]["false_forks"]["measured"]  # groups by prompt: none to see


def test_stats_on_a_verl_dump_finds_the_false_fork_and_says_where(tmp_path, capsys):
    import numpy as np
    import torch

    from treepack.sharing import rows_from_verl

    prompt = list(range(100, 140))  # a 40-token prompt; two rollouts re-rendered at 25
    variant = prompt[:25] + list(range(500, 516))
    prompts = [prompt, prompt, variant, variant]
    responses = [[1, 2], [3, 4], [5, 6], [7, 8]]
    P, R = 41, 2
    ids, mask = torch.zeros(4, P + R, dtype=torch.long), torch.zeros(4, P + R, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, responses)):
        ids[b, P - len(p):P + len(c)], mask[b, P - len(p):P + len(c)] = torch.tensor(p + c), 1
    rows = rows_from_verl(ids, np.array(["u1"] * 4, dtype=object), attention_mask=mask,
                          prompt_width=P, rank=[0, 1, 0, 1])
    path = write_jsonl(tmp_path / "verl.jsonl", rows)
    code, out, _ = run(capsys, "stats", path)
    assert code == 0
    assert "in 1 group by 'uid'" in out
    assert "uid 'u1': 4 sequences, 2 prompts, diverge at token 25 of 40- to 41-token prompts " \
           "(125 vs 500): 15 rows" in out
    assert "likely: the prompts diverge part-way and differ in length" in out
    assert "+ across ranks" in out and "fix: keep each group on one rank" in out
    code, js, _ = run(capsys, "stats", path, "--json")
    sharing = json.loads(js)["sharing"]
    # one forest: 25 + 15 + 16 prompt rows + 8 completion rows; ideal: 25 + 16 + 8
    assert (sharing["achievable_rows"], sharing["ideal_rows"]) == (64, 49)
    (fork,), lost = sharing["false_forks"], sharing["lost"]
    assert (fork["group"], fork["depth"], fork["prompt_length"], fork["rows"]) == ("u1", 25,
                                                                                   41, 15)
    assert lost["across_ranks"]["rows"] == 2 * (25 + 15 + 16 + 4) - 64
    assert sharing["achieved_rows"] == sharing["ideal_rows"] + sum(v["rows"]
                                                                   for v in lost.values())


def test_stats_formats_agree_and_extra_fields_are_ignored(tmp_path, capsys):
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5]]
    forms = {
        "lists": [s for s in seqs],
        "input_ids": [{"input_ids": s, "reward": 1.0} for s in seqs],
        "prompt": [{"prompt": s[:3], "completion": s[3:], "advantage": 0.5} for s in seqs],
        "trl": [{"prompt_ids": s[:3], "completion_ids": s[3:], "completion_mask": [1]}
                for s in seqs],
    }
    for name, rows in forms.items():
        code, out, _ = run(capsys, "stats", write_jsonl(tmp_path / f"{name}.jsonl", rows),
                           "--json")
        result = json.loads(out)
        assert code == 0 and (result["original_tokens"], result["packed_rows"]) == (8, 5), name
        assert result["sharing"]["groups"] == (None if name in ("lists", "input_ids") else 1)


def test_stats_counts_id_key_pairs_groups_of_each_type_and_sessions(tmp_path, capsys):
    """Per-token ``keys`` (an image placeholder's image): the same text on two images is
    two rows, in the token ratio and the report alike; ``uid`` 1 and "1" are two groups;
    ``session`` finds a turn whose prompt does not extend the previous turn."""
    from treepack.sharing import report

    text = [{"prompt": [1, 9, 9, 2], "completion": [c], "uid": u, "keys": [0, k, k, 0, 0]}
            for u, k, c in (("a", 5, 3), ("a", 5, 4), ("b", 6, 3), ("b", 6, 4))]
    code, out, _ = run(capsys, "stats", write_jsonl(tmp_path / "keys.jsonl", text), "--json")
    result = json.loads(out)
    # the first token is text, shared; then each image's prompt and completions: 1 + 2 x 5
    assert code == 0 and result["packed_rows"] == 11  # over ids alone: 6
    assert result["sharing"]["achievable_rows"] == 11
    typed = [{"prompt": [1, 2], "completion": [c], "uid": u}
             for u, c in ((1, 3), (1, 4), ("1", 3), ("1", 4))]
    typed[2]["prompt"] = typed[3]["prompt"] = [1, 5]
    code, out, _ = run(capsys, "stats", write_jsonl(tmp_path / "typed.jsonl", typed), "--json")
    sharing = json.loads(out)["sharing"]
    assert sharing["groups"] == 2 and sharing["false_forks"] == []  # was 1, with a fork
    turns = [[1, 2, 3, 10, 11], [20, 21, 22]], [[1, 2, 3, 10, 11, 20, 21, 22, 12, 13], [23]], \
        [[1, 2, 3, 10, 11, 20, 22, 12, 13, 14], [25]]  # the last re-renders, dropping 21
    agent = [{"prompt": p, "completion": c, "session": "s0"} for p, c in turns]
    agent.append({"prompt": [1, 2, 3, 10, 11], "completion": [30], "session": "s1"})
    path = write_jsonl(tmp_path / "agent.jsonl", agent)
    code, out, _ = run(capsys, "stats", path)
    assert code == 0
    assert "false forks in later turns: 1 of 2 sessions re-render their history" in out
    assert "session 's0': turn 2 of 3 shares 6 of the previous turn's 11 tokens (21 vs 22)" \
        in out and "extending the previous turn's ids" in out
    code, out, _ = run(capsys, "stats", path, "--json")
    (fork,) = json.loads(out)["sharing"]["session_forks"]
    seqs = [p + c for p, c in turns] + [[1, 2, 3, 10, 11, 30]]
    expected = report(seqs, prompt_lengths=[5, 10, 10, 5], sessions=["s0"] * 3 + ["s1"])
    assert fork["rows"] == expected.session_forks[0].rows == 4


def test_stats_without_groups_or_placement_says_what_it_needs(tmp_path, capsys):
    code, out, _ = run(capsys, "stats", str(ROOT / "examples" / "sample_rollouts.jsonl"))
    assert code == 0 and "where sharing was lost: not measured" in out and "'rank'" in out


def test_the_example_in_sharing_md_prints_what_the_page_shows(tmp_path, capsys, monkeypatch):
    """docs/sharing.md's dump runs, and `treepack stats` prints its table to the letter; the
    page's reading of it (groups kept whole: 0.338, then split-and-repeat) holds too."""
    import re

    import numpy as np

    import treepack
    from treepack.sharing import placement, report

    text = (ROOT / "docs" / "sharing.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
               if b.startswith("# runs as a test")]
    (shown,) = [b for b in re.findall(r"```text\n(.*?)```", text, flags=re.S)
                if b.startswith("treepack stats: verl-batch.jsonl")]
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(code, "docs/sharing.md", "exec"), scope)
    code, out, _ = run(capsys, "stats", "verl-batch.jsonl")
    assert code == 0 and out == shown
    seqs = [p + r for p, r in zip(scope["prompts"], scope["responses"])]
    group = np.arange(len(seqs)) // 8  # each group whole on one rank, in one mini-batch
    rank, micro, pack = group % 2, group // 2, np.zeros(len(seqs), dtype=int)
    for g in range(4):
        mine = np.flatnonzero(group == g)
        pack[mine] = placement(treepack.plan([seqs[i] for i in mine], max_tokens=1024)).packs
    whole = report(seqs, groups=scope["uid"], prompt_lengths=[len(p) for p in scope["prompts"]],
                   ranks=rank, micro_batches=micro, packs=pack)
    assert f"{whole.achieved_ratio:.3f}" == "0.338" and "0.338" in text
    assert whole.lost[1:4] == (0, 0, 1573) and "1,573 rows of split-and-repeat" in text
