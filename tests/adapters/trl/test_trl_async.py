"""TRL's asynchronous GRPO trainer with treepack's forward (TreepackAsyncGRPOTrainer), through
the real ``trainer.train()`` loop on CPU: a scripted rollout worker (async_workers.py) stands
in for vLLM, and TRL's FA3 tree attention runs as a pure-torch stand-in for the stock runs
(tests/support/trl_async_cpu.py).

Every run trains from one saved checkpoint on the same rollouts (GRPO groups of 4 sharing a
prompt, and a system prefix across groups; completions that fork after 2 tokens, carry a tool
result, repeat or stop one token short of another), in float32 with SGD.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
from treepack.adapters.trl import compat  # noqa: E402

try:
    STOCK, TRAINER_MODULE = compat.async_grpo()
except ImportError as e:  # pragma: no cover - a TRL without the asynchronous trainer
    pytest.skip(f"TRL's asynchronous GRPO trainer: {e}", allow_module_level=True)

from async_workers import UnpackedReference, build, group, train  # noqa: E402
from treepack import TreePack, zoo  # noqa: E402
from treepack.adapters import hf  # noqa: E402
from treepack.adapters.trl import async_grpo  # noqa: E402
from treepack.trl import TreepackAsyncGRPOTrainer  # noqa: E402

from tolerance import (FLOAT32_OP, FLOAT32_RELATIVE, FLOAT64_OP,  # noqa: E402
                       negative_control, scale)
from trl_async_cpu import cpu_stand_ins  # noqa: E402

STEPS, LR = 2, 0.1  # async_workers.config
PLANNERS = {"fixed": dict(token_budget=0, per_device_train_batch_size=8),  # FixedCountBatcher
            # TokenBudgetBatcher, rows of at most 32 unique tokens, 2 micro-batches a step
            "budget": dict(token_budget=32, gradient_accumulation_steps=2)}


def save(path: Path, model) -> str:
    """A tiny model saved where TRL loads it from (TRL takes a path only). Mixtral's and
    GPT-OSS's configs get the two MoE fields TRL 1.16's FLOPs estimate reads from every MoE
    config (``compute_flops_per_token``: ``moe_intermediate_size``, ``decoder_sparse_step``);
    the models never read them."""
    if getattr(model.config, "num_experts_per_tok", None) is not None:
        for key, value in (("moe_intermediate_size", model.config.intermediate_size),
                           ("decoder_sparse_step", 1)):
            if not hasattr(model.config, key):
                setattr(model.config, key, value)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> the path of its tiny model (saved on first use)."""
    paths = {}

    def get(family):
        if family not in paths:
            import tiny_models

            model = tiny_models.gpt_oss() if family == "gpt_oss" else zoo.tiny_model(family)
            paths[family] = save(tmp_path_factory.mktemp(family), model)
        return paths[family]

    return get


def assert_same_run(got, want, *, aux_coef=0.0):
    """Equal losses, gradient norms and weights after the last step, to float32 rounding.

    A loss is a mean of terms ratio x advantage (ratios within 2 of 1, checked) plus
    ``aux_coef`` x the router loss: FLOAT32_RELATIVE of that size. A gradient norm:
    FLOAT32_RELATIVE of itself. A weight moves by lr x its (clipped) gradient each SGD step,
    at most lr x the gradient norm: FLOAT32_RELATIVE of its size plus those moves."""
    assert len(want.losses) == STEPS and len(got.losses) == STEPS, (got.logs, want.logs)
    assert all(0.5 < h["ratio"] < 2 for h in want.logs), want.logs
    size = 2 * want.max_abs_advantage + aux_coef * max(h.get("aux_loss", 0) for h in want.logs)
    torch.testing.assert_close(got.losses, want.losses, rtol=0, atol=FLOAT32_RELATIVE * size)
    torch.testing.assert_close(got.grad_norms, want.grad_norms, rtol=0,
                               atol=FLOAT32_RELATIVE * max(want.grad_norms))
    moved = STEPS * LR * max(want.grad_norms)
    assert got.params.keys() == want.params.keys()
    for k, b in want.params.items():
        torch.testing.assert_close(got.params[k], b, rtol=0,
                                   atol=FLOAT32_RELATIVE * (scale(b) + moved), msg=k)


def assert_trained(run, path):
    """The run moved the weights (the equality above is about a step, not a no-op)."""
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert any((run.params[k] - start[k]).abs().max() > 1e-3 * max(scale(start[k]), 1.0)
               for k in run.params)


class ShiftedPositions(TreepackAsyncGRPOTrainer):
    """A broken gather (each term read one position early): the negative control."""

    def _treepack_per_term(self, model, rank):
        return super()._treepack_per_term(model, rank._replace(
            term_position=rank.term_position - 1))


@pytest.mark.parametrize("planner", sorted(PLANNERS))
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_training_equals_the_stock_async_trainer(saved, tmp_path, family, planner):
    """Two optimizer steps, packed and stock (TRL's trie and tree attention): the same
    losses, gradient norms and weights. With 8 samples a step (the fixed planner: groups 0, 1
    then 2, 3), the logged token ratio is treepack's forest of those samples; a broken
    gather fails the same comparison."""
    path = saved(family)
    stock = train(STOCK, path, str(tmp_path / "stock"), **PLANNERS[planner])
    packed = train(TreepackAsyncGRPOTrainer, path, str(tmp_path / "packed"), **PLANNERS[planner])
    assert_trained(stock, path)
    assert_same_run(packed, stock)
    ratios = [h["treepack/token_ratio"] for h in packed.logs]
    if planner == "fixed":
        forests = [TreePack.from_sequences([s["input_ids"] for g in groups for s in group(g)])
                   for groups in ((0, 1), (2, 3))]
        assert ratios == pytest.approx([f.token_ratio for f in forests], rel=FLOAT64_OP, abs=0)
        shifted = train(ShiftedPositions, path, str(tmp_path / "shifted"), **PLANNERS[planner])
        with pytest.raises(AssertionError), negative_control():
            assert_same_run(shifted, stock)
    assert all(0 < r < 1 for r in ratios), ratios


def launch(model_dir, out, planners):
    """async_ranks.py on 2 CPU processes (gloo) under accelerate."""
    from launch import free_port

    here = Path(__file__).resolve().parent
    env = {**__import__("os").environ,
           "PYTHONPATH": ":".join([str(here), str(here.parents[1] / "support"), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
         "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", str(free_port()), str(here / "async_ranks.py"), model_dir,
         str(out), json.dumps(planners)],
        capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


def test_two_processes_equal_the_stock_async_trainer(saved, tmp_path):
    """Under ``accelerate launch`` on 2 processes (gloo): each process packs its own rank row
    (per-device batch 4 of the fixed planner; rows of 32 unique tokens of the budget
    planner), DDP averages; two steps equal stock TRL's on 2 processes, and the token ratio
    sums both processes' rows and tokens."""
    planners = {"fixed": dict(token_budget=0, per_device_train_batch_size=4),
                "budget": dict(token_budget=32)}
    result = launch(saved("qwen2"), tmp_path / "ranks.pt", planners)
    assert result["processes"] == 2
    for name in planners:
        runs = {mode: result["runs"][mode, name] for mode in ("stock", "packed")}
        assert_same_run(runs["packed"], runs["stock"])
        ratios = [h["treepack/token_ratio"] for h in runs["packed"].logs]
        assert all(0 < r < 1 for r in ratios), ratios
    # the fixed planner's first micro-batch: groups 0 and 1, one a process (TRL's planner
    # deals whole groups), each process its own forest
    forests = [TreePack.from_sequences([s["input_ids"] for s in group(g)]) for g in (0, 1)]
    first = result["runs"]["packed", "fixed"].logs[0]["treepack/token_ratio"]
    assert first == pytest.approx(sum(f.num_packed_rows for f in forests)
                                  / sum(f.num_original_tokens for f in forests), rel=FLOAT64_OP)


@pytest.mark.parametrize("family,refusal", [
    ("qwen3_5", "linear_attention"),  # Gated DeltaNet (short convolution + delta rule)
    ("gpt_oss", "attention sinks"),  # sinks in every softmax; sliding + full layers; MoE
    ("falcon_h1", "hybrid"),  # attention and Mamba2 side by side (layer_types a property)
    ("lfm2", "conv"),  # short gated convolutions
    ("bamba", "linear_attention"),  # Mamba2
])
def test_models_trl_refuses_train_as_each_sample_alone(saved, tmp_path, family, refusal):
    """Stock TRL refuses them for its tree mode; the treepack trainer trains them, equal to
    the unpacked reference (each sample alone through the plain model, into the same loss):
    losses, gradient norms, router losses (GPT-OSS) and weights after two steps."""
    path = saved(family)
    with pytest.raises(ValueError, match=refusal), cpu_stand_ins():
        build(STOCK, path, str(tmp_path / "stock"))
    packed = train(TreepackAsyncGRPOTrainer, path, str(tmp_path / "packed"))
    alone = train(UnpackedReference, path, str(tmp_path / "alone"))
    assert_trained(alone, path)
    coef = _router_coef(path)
    assert_same_run(packed, alone, aux_coef=coef)
    if coef:
        assert_same_router_loss(packed, alone)


def _router_coef(path) -> float:
    """The router loss coefficient TRL applies (the config's; 0 without a router loss)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).get_text_config()
    return getattr(config, "router_aux_loss_coef", 0.0) if hasattr(
        config, "output_router_logits") else 0.0


def assert_same_router_loss(got, want):
    """The logged router loss of every step: a float32 loss computed two ways (FLOAT32_OP)."""
    aux = [h["aux_loss"] for h in want.logs]
    torch.testing.assert_close([h["aux_loss"] for h in got.logs], aux, rtol=0,
                               atol=FLOAT32_OP * max(aux))


def test_the_router_loss_counts_original_tokens(saved, tmp_path):
    """Mixtral, router_aux_loss_coef=0.5: the treepack trainer's router loss is that of every
    original token, as the unpacked run's (the model's own, on the samples padded), so
    losses, gradient norms and weights equal the reference; stock TRL's counts each unique
    token of its trie once, which the first step (same weights in every run) tells apart."""
    path = saved("mixtral")
    packed = train(TreepackAsyncGRPOTrainer, path, str(tmp_path / "packed"),
                   router_aux_loss_coef=0.5)
    alone = train(UnpackedReference, path, str(tmp_path / "alone"), router_aux_loss_coef=0.5)
    stock = train(STOCK, path, str(tmp_path / "stock"), router_aux_loss_coef=0.5)
    assert_same_router_loss(packed, alone)
    assert_same_run(packed, alone, aux_coef=0.5)
    first = alone.logs[0]["aux_loss"]
    assert abs(stock.logs[0]["aux_loss"] - first) > 100 * FLOAT32_OP * first


def test_refusals_name_the_value_the_rule_and_the_fix(saved, tmp_path, monkeypatch):
    qwen2 = saved("qwen2")
    with pytest.raises(ValueError, match=r"treepack_backend='fa3'.*'auto', 'segment'"):
        TreepackAsyncGRPOTrainer(model=qwen2, treepack_backend="fa3")
    with pytest.raises(ValueError, match=r"treepack_pad_to_multiple_of=0 must be a positive"):
        TreepackAsyncGRPOTrainer(model=qwen2, treepack_pad_to_multiple_of=0)
    with pytest.raises(NotImplementedError, match="use_liger_kernel"):  # TRL's own refusal
        build(TreepackAsyncGRPOTrainer, qwen2, str(tmp_path / "liger"), use_liger_kernel=True)
    # Doge's learned mask bias: TRL's tree mode takes it (and would drop the bias); treepack
    # refuses it when the trainer loads it, and leaves TRL's functions as they were
    import transformers

    config = transformers.DogeConfig(vocab_size=zoo.VOCAB, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, pad_token_id=0)
    doge = save(tmp_path / "doge", transformers.AutoModelForCausalLM.from_config(config))
    originals = (TRAINER_MODULE.create_model_from_path, TRAINER_MODULE.add_fused_lm_head)
    with pytest.raises(hf.UnsupportedModel, match="adds values of its own to the attention"):
        build(TreepackAsyncGRPOTrainer, doge, str(tmp_path / "doge-run"))
    assert (TRAINER_MODULE.create_model_from_path, TRAINER_MODULE.add_fused_lm_head) == originals
    # a TRL whose loss terms are laid out otherwise than treepack rebuilds them
    real = async_grpo.rank_keys

    def reversed_terms(rows):
        keys = real(rows)
        sample = keys[async_grpo.TERM_SAMPLE]
        keys[async_grpo.TERM_SAMPLE] = torch.where(sample >= 0, sample.max() - sample, sample)
        return keys

    monkeypatch.setattr(async_grpo, "rank_keys", reversed_terms)
    with pytest.raises(RuntimeError, match="not laid out as treepack rebuilt them"):
        train(TreepackAsyncGRPOTrainer, qwen2, str(tmp_path / "reversed"))
    # a TRL internal that moved
    monkeypatch.delattr(TRAINER_MODULE, "add_fused_lm_head")
    with pytest.raises(ImportError, match=r"has no .*add_fused_lm_head.*written against TRL 1.16"):
        compat.async_grpo()


def test_treepack_trl_imports_without_the_async_trainer():
    """``treepack.trl`` (and its GRPOTrainer) works where TRL's asynchronous trainer does not
    import; asking for the async trainer then says what is missing."""
    from launch import run_python

    out = run_python(
        "import sys; sys.modules['trl.experimental.async_grpo'] = None\n"
        "import treepack.trl\n"
        "assert treepack.trl.TreepackGRPOTrainer and treepack.trl.patch\n"
        "try:\n"
        "    from treepack.trl import TreepackAsyncGRPOTrainer\n"
        "except ImportError as e:\n"
        "    print(e)\n")
    assert "needs TRL's asynchronous GRPO trainer" in out, out
