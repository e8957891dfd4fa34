"""TRL's GRPOTrainer with treepack's per-token log-prob seam, end to end on a tiny model."""

import collections
import doctest
import warnings

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import treepack.trl  # noqa: E402
from treepack.adapters.trl import seam, shuffle  # noqa: E402
from treepack import zoo  # noqa: E402

from reference import exact_kernel, float64_throughout  # noqa: E402
from tiny_models import word_tokenizer  # noqa: E402
from tolerance import (  # noqa: E402
    FLOAT32_RELATIVE,
    FLOAT64_EXACT,
    FLOAT64_OP,
    assert_within,
    inside,
    rounding,
    scale,
    within,
)


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 saved locally: TRL loads the policy and, with beta > 0, its
    reference model from a path."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    zoo.tiny_model("qwen2").save_pretrained(path)
    return str(path)


def make_trainer(tokenizer, tmp_path, model, cls=GRPOTrainer, config=None, **kwargs):
    dataset = Dataset.from_dict({"prompt": ["w5 w6 w7 w8 w9", "w10 w11 w12", "w13 w14 w15 w16",
                                            "w5 w6 w7"] * 2})

    def reward(completions, **kw):
        return [float(len(c)) + 0.1 * i for i, c in enumerate(completions)]

    args = GRPOConfig(**dict(output_dir=str(tmp_path), per_device_train_batch_size=4,
                             num_generations=4, max_completion_length=6, max_steps=1,
                             report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                             temperature=0.7, seed=0, learning_rate=1e-3, beta=0.04,
                             logging_steps=1) | (config or {}))
    return cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
               processing_class=tokenizer, **kwargs)


def trl_batch():
    """Left-padded prompts + right-padded completions, as the trainer builds them."""
    ids = torch.tensor([[0, 0, 16, 17, 18, 40, 41, 2, 0],
                        [0, 0, 16, 17, 18, 40, 44, 45, 2],
                        [21, 22, 23, 24, 25, 50, 2, 0, 0],
                        [0, 0, 16, 17, 18, 40, 41, 42, 43]])
    return ids, (ids != 0).long()


@pytest.mark.parametrize("max_tokens", [None, 12])
def test_seam_equals_the_stock_seam(tokenizer, tmp_path, model_dir, max_tokens):
    trainer = make_trainer(tokenizer, tmp_path, model_dir)
    model = trainer.model
    ids, mask = trl_batch()
    keep = 4
    stock = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep,
                                                       compute_entropy=True)
    treepack.trl.patch(trainer, max_tokens=max_tokens)
    ours = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep,
                                                      compute_entropy=True)
    completion = mask[:, -keep:].bool()
    for a, b in zip(ours[:2], stock[:2]):
        assert a.shape == b.shape == (4, keep)
        assert_within(a[completion], b[completion], FLOAT32_RELATIVE)  # a float32 model
        assert (a[~completion] == 0).all()
    # gradients too: the loss the trainer builds on them
    w = torch.randn(4, keep)
    grads = []
    for out in (ours, stock):
        model.zero_grad(set_to_none=True)
        ((out[0] * w * completion).sum() + (out[1] * w * completion).sum()).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for k, g in grads[1].items():
        assert_within(grads[0][k], g, FLOAT32_RELATIVE)


def test_the_seam_called_by_hand_runs_no_collective(tokenizer, tmp_path, model_dir,
                                                     monkeypatch):
    """The step's sharing report ends in an all-reduce over the processes, which every
    process reaches inside the trainer's own loss. Called by hand in train mode with
    gradients on (on one process of several, it waited for the others forever), the seam
    logs nothing and runs no collective."""
    trainer = make_trainer(tokenizer, tmp_path, model_dir)
    treepack.trl.patch(trainer)
    trainer.model.train()

    def collective(*args, **kwargs):
        raise AssertionError("a collective in a call by hand")

    monkeypatch.setattr(trainer.accelerator, "reduce", collective)
    ids, mask = trl_batch()
    out = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4)
    assert out[0].requires_grad and getattr(trainer, "_treepack_step", None) is None


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_no_grad_passes_run_a_tree_over_the_budget_in_parts(tokenizer, tmp_path, model_dir,
                                                           monkeypatch, family):
    """TRL's old / reference log-prob passes (no grad) at a budget that splits the batch's
    tree: every row once, in parts, equal to the stock seam; the training pass plans packs.
    On Qwen3.5 each cut carries the convolutions' inputs and the scans' states: a state lost
    at a cut is 1.1e-5 off, within float32's rounding of these log-probs (FLOAT32_RELATIVE of
    their size, 3e-4), so the model runs in float64 throughout (its float32 norms and scan
    too: reference.float64_throughout, exact_kernel) and the seams agree to FLOAT64_EXACT."""
    from treepack.adapters.hf.parts import run as parts

    model_dir = str(tmp_path / family)
    zoo.tiny_model(family, layers=4, dtype=torch.float64).save_pretrained(model_dir)
    trainer = make_trainer(tokenizer, tmp_path, model_dir,  # "auto": the saved float64
                           config=dict(model_init_kwargs={"dtype": "auto"}))
    model = trainer.model
    assert model.dtype == torch.float64
    exact_kernel(monkeypatch, model)
    ids, mask = trl_batch()
    with torch.no_grad(), float64_throughout():
        assert inside(model) == FLOAT64_EXACT
        stock = trainer._get_per_token_logps_and_entropies(model, ids, mask, 4,
                                                           compute_entropy=True)
    treepack.trl.patch(trainer, max_tokens=8)  # the 11-row tree of rows 0, 1, 3 splits
    runs = []
    real = parts.Run.all
    monkeypatch.setattr(parts.Run, "all", lambda self: runs.append(len(self.parts.parts))
                        or real(self))
    with torch.no_grad(), float64_throughout():
        ours = trainer._get_per_token_logps_and_entropies(model, ids, mask, 4,
                                                          compute_entropy=True)
    assert runs and runs[0] > 1  # in parts
    completion = mask[:, -4:].bool()
    for a, b in zip(ours[:2], stock[:2]):
        assert a.dtype == torch.float64
        assert_within(a[completion], b[completion], FLOAT64_EXACT)
        assert (a[~completion] == 0).all()
    trainer._get_per_token_logps_and_entropies(model, ids, mask, 4)  # with grad: packs
    assert len(runs) == 1


class GradientsAtStep(TrainerCallback):
    """The gradients the optimizer is about to apply (the last step's), and each gradient's
    largest magnitude over every step (``sizes``)."""

    def __init__(self):
        self.grads = None
        self.sizes = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {k: p.grad.clone() for k, p in model.named_parameters()
                      if p.grad is not None}
        for k, g in self.grads.items():
            self.sizes[k] = max(self.sizes.get(k, 0.0), scale(g))


@pytest.mark.parametrize("max_tokens", [None, 16])
def test_one_training_step_equals_the_stock_trainer(tokenizer, tmp_path, model_dir, max_tokens,
                                                    monkeypatch):
    """trainer.train(), packed and stock. At 16 rows a forward a prompt's group does not fit:
    the training pass plans packs, the reference model's no-grad pass runs in parts."""
    from treepack.adapters.hf.parts import run as parts

    forwards = []
    real_all = parts.Run.all
    monkeypatch.setattr(parts.Run, "all", lambda self: forwards.append(len(self.parts.parts))
                        or real_all(self))
    model = zoo.tiny_model("qwen2")  # the saved weights
    runs = {}
    for name, cls in (("stock", GRPOTrainer), ("packed", treepack.trl.TreepackGRPOTrainer)):
        probe = GradientsAtStep()
        extra = {"treepack_max_tokens": max_tokens} if name == "packed" else {}
        trainer = make_trainer(tokenizer, tmp_path / name, model_dir, cls=cls, callbacks=[probe],
                               **extra)
        torch.manual_seed(0)
        trainer.train()  # same seed: the same completions, rewards and advantages
        runs[name] = (trainer, probe.grads)
    packed, stock = runs["packed"][0], runs["stock"][0]
    assert treepack.hf.is_prepared(packed.model) and not treepack.hf.is_prepared(stock.model)
    for k, g in runs["stock"][1].items():
        assert g.abs().max() > 0
        assert_within(runs["packed"][1][k], g, FLOAT32_RELATIVE, msg=k)  # a float32 model
    for (name, a), b in zip(packed.model.named_parameters(), stock.model.parameters()):
        assert (a - model.get_parameter(name)).abs().max() > 0  # both took the step
    assert bool(forwards) == (max_tokens is not None) and all(n > 1 for n in forwards), forwards


def test_patch_refuses_images_for_a_text_model_and_other_trainers(tokenizer, tmp_path, model_dir):
    trainer = treepack.trl.patch(make_trainer(tokenizer, tmp_path, model_dir))
    ids, mask = trl_batch()
    with pytest.raises(treepack.hf.UnsupportedModel, match="encodes no images"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4,
                                                   pixel_values=torch.zeros(1, 12),
                                                   image_grid_thw=torch.ones(1, 3))
    with pytest.raises(NotImplementedError, match=r"this batch has \['pixel_attention_mask'\]"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4,
                                                   pixel_attention_mask=torch.zeros(1))
    with pytest.raises(TypeError, match="GRPOTrainer"):
        treepack.trl.patch(object())


def train_both(tokenizer, tmp_path, model_dir, **kwargs):
    """Stock TRL and TreepackGRPOTrainer trained from the same seed: (trainer, gradients at the
    last optimizer step, each gradient's size over the steps) each."""
    runs = {}
    for name, cls in (("stock", GRPOTrainer), ("packed", treepack.trl.TreepackGRPOTrainer)):
        probe = GradientsAtStep()
        trainer = make_trainer(tokenizer, tmp_path / name, model_dir, cls=cls,
                               callbacks=[probe], **kwargs)
        torch.manual_seed(0)
        trainer.train()  # same seed: the same completions, rewards and advantages
        runs[name] = (trainer, probe.grads, probe.sizes)
    return runs


def assert_same_training(runs, zero_by_algebra=()):
    """Equal logged losses, equal gradients at the last step and equal weights after it
    (a float32 model: FLOAT32_RELATIVE; the runs step with SGD, whose update is linear in the
    gradient: Adam's first step divides each gradient by its own magnitude, so it turns
    rounding in a near-zero one into ~lr). Gradients whose names end in ``zero_by_algebra`` (a
    key bias without rotary: the softmax ignores it) hold only rounding, judged against the
    model's largest."""
    (packed, packed_grads, *_), (stock, stock_grads, *sizes) = runs["packed"], runs["stock"]
    # each gradient's size over the steps (GradientsAtStep.sizes), or the last step's
    sizes = sizes[0] if sizes else {k: scale(g) for k, g in stock_grads.items()}
    model_max = max(g.abs().max().item() for g in stock_grads.values())
    sizes = dict(sizes)
    for k in [k for k in stock_grads if zero_by_algebra and k.endswith(zero_by_algebra)]:
        for g in (stock_grads.pop(k), packed_grads.pop(k)):
            assert within(g.abs().max(), FLOAT32_RELATIVE * model_max), k
        sizes[k] = model_max  # its gradient: rounding of terms as large as the model's
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (packed, stock)]
    assert len(losses[1]) == stock.args.max_steps, stock.state.log_history
    torch.testing.assert_close(losses[0], losses[1], rtol=0,
                               atol=FLOAT32_RELATIVE * max(abs(v) for v in losses[1]))
    assert stock_grads and packed_grads.keys() == stock_grads.keys()
    for k, g in stock_grads.items():
        assert_within(packed_grads[k], g, FLOAT32_RELATIVE, msg=k)
    lr, steps = stock.args.learning_rate, stock.args.max_steps
    for (name, a), b in zip(packed.model.named_parameters(), stock.model.parameters()):
        # float32 weights computed two ways (FLOAT32_RELATIVE of their size), each SGD step
        # moving them by lr x gradients within FLOAT32_RELATIVE of their size
        size = scale(b) + steps * lr * sizes.get(name, 0.0)
        torch.testing.assert_close(a, b, rtol=0, atol=FLOAT32_RELATIVE * size, msg=name)


def test_a_lora_grpo_step_equals_the_stock_trainer(tokenizer, tmp_path, model_dir):
    """A peft LoRA policy: TRL's reference pass disables the adapter; both passes packed."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0, task_type="CAUSAL_LM")
    runs = train_both(tokenizer, tmp_path, model_dir, peft_config=lora,
                      config=dict(optim="sgd", learning_rate=0.1))
    assert all("lora_" in k for k in runs["stock"][1]) and runs["stock"][1]
    assert type(runs["packed"][0].model).__name__ == "PeftModelForCausalLM"
    assert_same_training(runs)


def test_gradient_accumulation_keeps_groups_whole_and_equals_stock(tokenizer, tmp_path,
                                                                   model_dir, monkeypatch):
    """gradient_accumulation_steps=4 (so steps_per_generation=4): TRL shuffles the generation
    batch before cutting it into 4 micro-batches; the packed trainer shuffles whole groups,
    so each micro-batch is one prompt's 4 completions, and two optimizer steps equal stock."""
    training_batches = []
    real = seam._packed_forwards

    def recording(model, input_ids, attention_mask, logits_to_keep, **kw):
        if torch.is_grad_enabled():
            training_batches.append((input_ids[:, :input_ids.shape[1] - logits_to_keep],
                                     attention_mask[:, :input_ids.shape[1] - logits_to_keep]))
        return real(model, input_ids, attention_mask, logits_to_keep, **kw)

    monkeypatch.setattr(seam, "_packed_forwards", recording)
    runs = train_both(tokenizer, tmp_path, model_dir,
                      config=dict(gradient_accumulation_steps=4, max_steps=2, optim="sgd",
                                  learning_rate=0.1))
    assert len(training_batches) == 8  # 2 steps x 4 micro-batches
    for prompts, mask in training_batches:  # one prompt per micro-batch
        assert len({tuple(p[m.bool()].tolist()) for p, m in zip(prompts, mask)}) == 1
    ratios = [h["treepack/token_ratio"] for h in runs["packed"][0].state.log_history
              if "treepack/token_ratio" in h]
    assert ratios and all(0 < r < 1 for r in ratios), ratios
    assert_same_training(runs)


def record_micro_batches(monkeypatch):
    """Every training micro-batch TRL's loss sees, per trainer: (optimizer step, its rows as
    prompt ids, its rows as prompt + completion ids)."""
    seen = collections.defaultdict(list)
    real = GRPOTrainer._compute_loss

    def recording(self, model, inputs):
        prompts = [tuple(p[m.bool()].tolist())
                   for p, m in zip(inputs["prompt_ids"], inputs["prompt_mask"])]
        rows = [p + tuple(c[m.bool()].tolist()) for p, c, m in
                zip(prompts, inputs["completion_ids"], inputs["completion_mask"])]
        seen[self].append((self.state.global_step, prompts, rows))
        return real(self, model, inputs)

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", recording)
    return seen


def rows_per_step(micro_batches):
    """The rows each optimizer step applied, as a sorted list per step."""
    steps = collections.defaultdict(list)
    for step, _, rows in micro_batches:
        steps[step] += rows
    return [sorted(rows) for _, rows in sorted(steps.items())]


ACCUMULATION = dict(gradient_accumulation_steps=4, max_steps=2, optim="sgd", learning_rate=0.1)


@pytest.mark.parametrize("option", [
    dict(entropy_coef=0.1),
    dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0),
    dict(loss_type="bnpo"),
])
def test_options_trl_takes_per_micro_batch_equal_stock_under_accumulation(
        tokenizer, tmp_path, model_dir, monkeypatch, option):
    """TRL's entropy bonus is a token mean per micro-batch, and bnpo divides a micro-batch's
    loss by its tokens. With whole-group micro-batches the bonus is taken per row over the
    micro-batch stock TRL would have put the row in (measured before, whole groups without the
    correction: a parameter's gradient up to 3.0e-3 relative off and weights 7.1e-4 at
    entropy_coef=0.1, 1.6e-3 / 3.9e-4 adaptive); bnpo keeps TRL's own micro-batches (it weighs
    a row by all of its micro-batch's rows inside TRL's clipped objective; before: loss 2.0,
    gradient 0.61, weights 0.14 relative off) and says so. Two optimizer steps of 4
    micro-batches equal stock TRL's: losses, gradients, weights."""
    seen = record_micro_batches(monkeypatch)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        runs = train_both(tokenizer, tmp_path, model_dir, config=ACCUMULATION | option)
    said = [str(w.message) for w in said if "treepack" in str(w.message)]
    packed, stock = seen[runs["packed"][0]], seen[runs["stock"][0]]
    if option.get("loss_type") == "bnpo":  # TRL's own micro-batches, every one as stock's
        assert [rows for *_, rows in packed] == [rows for *_, rows in stock]
        (warned,) = said
        assert "keeps TRL's own micro-batches" in warned and "loss_type='bnpo'" in warned
        assert "loss_type='dapo'" in warned and "per_device_train_batch_size=16" in warned
    else:  # whole groups: one prompt per micro-batch
        assert all(len(set(prompts)) == 1 for _, prompts, _ in packed) and not said
        assert any(len(set(prompts)) > 1 for _, prompts, _ in stock)
    assert_same_training(runs)


def test_an_entropy_threshold_keeps_trls_micro_batches_and_equals_stock(tokenizer, tmp_path,
                                                                        model_dir, monkeypatch):
    """top_entropy_quantile=0.2 trains on the tokens above the 80 % quantile of the entropies
    of a micro-batch (on every process): the packed trainer keeps TRL's own micro-batches
    (measured before, with whole groups: loss 1.2, weights 2.0 relative off).

    The threshold is a hard cut by rank: two tokens whose entropies lie within rounding of each
    other on either side of it may swap sides between two runs, whatever the order of rows. So
    the test first asserts that in every micro-batch of either run the lowest entropy kept
    exceeds the highest one dropped by more than 10x the largest difference between the two
    runs' entropies (packed vs stock forward: rounding; measured 3.1e-5 against 2.4e-6);
    equal masks, and with them equal training, are then what it checks, and a change of seed or
    model that puts tokens on the cut fails loudly there instead of in the comparison."""
    masks = collections.defaultdict(list)
    real = GRPOTrainer.get_high_entropy_mask

    def recording(self, entropies, mask, threshold):
        chosen = real(self, entropies, mask, threshold)
        kept, dropped = entropies[chosen], entropies[mask.bool() & ~chosen]
        masks[self].append((chosen, (kept.min() - dropped.max()).item(), entropies.detach()))
        return chosen

    monkeypatch.setattr(GRPOTrainer, "get_high_entropy_mask", recording)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        runs = train_both(tokenizer, tmp_path, model_dir,
                          config=ACCUMULATION | dict(top_entropy_quantile=0.2))
    (warned,) = [str(w.message) for w in said if "treepack" in str(w.message)]
    assert "top_entropy_quantile=0.2" in warned
    packed, stock = masks[runs["packed"][0]], masks[runs["stock"][0]]
    assert len(packed) == len(stock) == 8
    rounding = max((a - b).abs().max().item() for (*_, a), (*_, b) in zip(packed, stock))
    gap = min(gap for _, gap, _ in packed + stock)
    assert 0 < rounding and gap > 10 * rounding, (gap, rounding)
    for (a, *_), (b, *_) in zip(packed, stock):
        assert torch.equal(a, b)
    assert_same_training(runs)


def test_a_router_loss_keeps_trls_micro_batches_and_equals_stock(tokenizer, tmp_path,
                                                               monkeypatch):
    """Mixtral's load-balancing loss is a product of two token averages over a micro-batch:
    the packed trainer keeps TRL's micro-batches (measured before, with whole groups: a
    parameter's gradient up to 0.74 relative off at router_aux_loss_coef=0.5, 0.05 at
    Mixtral's own 0.001)."""
    path = tmp_path / "tiny-mixtral"
    model = zoo.tiny_model("mixtral")
    model.config.output_router_logits = False  # TRL asks for router logits where it needs them
    model.save_pretrained(path)
    seen = record_micro_batches(monkeypatch)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        runs = train_both(tokenizer, tmp_path, str(path),
                          config=ACCUMULATION | dict(router_aux_loss_coef=0.5))
    (warned,) = [str(w.message) for w in said if "treepack" in str(w.message)]
    assert "router_aux_loss_coef=0.5" in warned
    packed, stock = seen[runs["packed"][0]], seen[runs["stock"][0]]
    assert [rows for *_, rows in packed] == [rows for *_, rows in stock]
    assert_same_training(runs)


@pytest.mark.parametrize("sizes", [dict(steps_per_generation=4, gradient_accumulation_steps=2),
                                   dict(steps_per_generation=3, gradient_accumulation_steps=2)])
def test_several_optimizer_steps_per_generation_apply_stocks_rows(tokenizer, tmp_path, model_dir,
                                                                 monkeypatch, sizes):
    """steps_per_generation > gradient_accumulation_steps: one generation batch feeds several
    optimizer steps, and which rows each applies is part of the run (measured before: the
    whole-group shuffle moved rows between steps, losses 1.0 relative off at 4 / 2 and 3 / 2).
    Each row stays in the step stock TRL's shuffle gives it, groups whole inside it; at 3 / 2
    the steps do not line up with the micro-batches and TRL's own are kept. A warning says why
    groups split."""
    seen = record_micro_batches(monkeypatch)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        runs = train_both(tokenizer, tmp_path, model_dir, config=ACCUMULATION | sizes)
    (warned,) = [str(w.message) for w in said if "treepack" in str(w.message)]
    packed, stock = seen[runs["packed"][0]], seen[runs["stock"][0]]
    assert rows_per_step(packed) == rows_per_step(stock)
    if sizes["steps_per_generation"] == 4:
        assert "steps_per_generation=4 > gradient_accumulation_steps=2" in warned
        # inside a step groups are dealt whole where they can be: fewer prompt copies
        assert sum(len(set(p)) for _, p, _ in packed) < sum(len(set(p)) for _, p, _ in stock)
    else:
        assert "do not divide one another" in warned
        assert [rows for *_, rows in packed] == [rows for *_, rows in stock]
    assert_same_training(runs)


@pytest.mark.parametrize("option", [
    dict(loss_type="dapo"), dict(loss_type="dr_grpo"), dict(loss_type="sapo"),
    dict(loss_type="cispo"), dict(loss_type="vespo"),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(importance_sampling_level="sequence", delta=1.5),
    dict(off_policy_mask_threshold=0.01, num_iterations=2),
    dict(loss_type="dapo", entropy_coef=0.1),
])
def test_losses_trl_averages_per_row_or_batch_equal_stock_with_whole_groups(
        tokenizer, tmp_path, model_dir, monkeypatch, option):
    """The loss types and options whose weights do not depend on which rows share a
    micro-batch: whole-group micro-batches, and two steps equal stock TRL's."""
    seen = record_micro_batches(monkeypatch)
    runs = train_both(tokenizer, tmp_path, model_dir, config=ACCUMULATION | option)
    assert all(len(set(prompts)) == 1 for _, prompts, _ in seen[runs["packed"][0]])
    assert_same_training(runs)


def test_the_token_ratio_sums_each_steps_micro_batches(tokenizer, tmp_path, model_dir,
                                                       monkeypatch):
    """treepack/token_ratio is one ratio per optimizer step: packed rows / tokens summed over
    its micro-batches (and processes: tests/trl_ranks.py), not a mean of per-micro-batch
    ratios (measured before: 0.6976 and 0.6875 logged where the steps' sums give 0.6938 and
    0.6950)."""
    step = [0]  # optimizer steps taken

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step[0] = state.global_step

    sums = collections.defaultdict(lambda: [0, 0])  # step -> [packed rows, tokens]
    real = seam._packed_forwards

    def recording(*args, **kw):
        out = real(*args, **kw)
        if torch.is_grad_enabled():  # a training forward
            sums[step[0]][0] += sum(p.num_packed_rows for p in out[3])
            sums[step[0]][1] += sum(p.num_original_tokens for p in out[3])
        return out

    monkeypatch.setattr(seam, "_packed_forwards", recording)
    trainer = make_trainer(tokenizer, tmp_path, model_dir, cls=treepack.trl.TreepackGRPOTrainer,
                           config=ACCUMULATION, callbacks=[Steps()])
    torch.manual_seed(0)
    trainer.train()
    logged = [h["treepack/token_ratio"] for h in trainer.state.log_history
              if "treepack/token_ratio" in h]
    want = [rows / tokens for _, (rows, tokens) in sorted(sums.items())]
    # a ratio of two counts: a float64 division either way
    assert len(want) == 2 and logged == pytest.approx(want, rel=FLOAT64_OP, abs=0), (logged, want)


def test_a_per_device_batch_smaller_than_a_group_warns_with_the_fix(tokenizer, tmp_path,
                                                                    model_dir):
    """per_device_train_batch_size 2 < num_generations 4 with 4 micro-batches: a group cannot
    be whole in one micro-batch, its prompt is computed in each (token ratios 0.76 and 0.83
    where per-device batch 4 x accumulation 2, the same batch, gives 0.65 and 0.75; no warning
    before)."""
    with pytest.warns(UserWarning) as said:
        make_trainer(tokenizer, tmp_path, model_dir, cls=treepack.trl.TreepackGRPOTrainer,
                     config=dict(per_device_train_batch_size=2, gradient_accumulation_steps=4))
    (warned,) = [str(w.message) for w in said if "treepack" in str(w.message)]
    assert "per_device_train_batch_size=2 is not a multiple of num_generations=4" in warned
    assert "per_device_train_batch_size=4 and gradient_accumulation_steps=2" in warned
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        make_trainer(tokenizer, tmp_path, model_dir, cls=treepack.trl.TreepackGRPOTrainer,
                     config=dict(gradient_accumulation_steps=4))
    assert not [w for w in said if "treepack" in str(w.message)]  # whole groups fit


def test_each_step_logs_where_sharing_was_lost(tokenizer, tmp_path, model_dir):
    """Beside the token ratio, each step logs its sequences as one forest (achievable) and the
    rows lost on the way to what it computed (treepack.sharing): the same generation batch cut
    into 2 micro-batches of whole groups, or into 4 that split every group, has one achievable
    ratio, and the second loses more rows across micro-batches, exactly the rows between."""
    logs = {}
    for per_device, accumulation in ((4, 2), (2, 4)):  # 8 rows a generation batch either way
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the split groups' warning: tested above
            trainer = make_trainer(tokenizer, tmp_path, model_dir,
                                   cls=treepack.trl.TreepackGRPOTrainer,
                                   config=dict(per_device_train_batch_size=per_device,
                                               gradient_accumulation_steps=accumulation,
                                               max_steps=2))
            torch.manual_seed(0)
            trainer.train()
        logs[per_device] = [h for h in trainer.state.log_history if "treepack/token_ratio" in h]
    for whole, split in zip(logs[4], logs[2]):
        for h in (whole, split):
            assert h["treepack/achieved_ratio"] == h["treepack/token_ratio"]
            assert h["treepack/ideal_ratio"] == h["treepack/achievable_ratio"]  # no uid
            assert h["treepack/lost_rows/split_and_repeat"] == 0  # one pack a micro-batch
        assert whole["treepack/achievable_ratio"] == split["treepack/achievable_ratio"]
        more = (split["treepack/lost_rows/across_micro_batches"]
                - whole["treepack/lost_rows/across_micro_batches"])
        assert more > 0
        # the rows between the two achieved ratios, in tokens of the same batch
        gaps = (whole["treepack/achieved_ratio"] - whole["treepack/achievable_ratio"],
                split["treepack/achieved_ratio"] - whole["treepack/achieved_ratio"])
        tokens = whole["treepack/lost_rows/across_micro_batches"] / gaps[0]
        # ratios in [0, 1], rounded once each (float64): a difference keeps their rounding,
        # relative to itself 1 / gap of them, and the two quotients add theirs
        rel = rounding(torch.float64, 1 / min(gaps), steps=8)
        assert more / gaps[1] == pytest.approx(tokens, rel=rel, abs=0)
    assert len(logs[4]) == len(logs[2]) == 2


def test_a_model_object_with_a_reference_model_equals_stock_from_its_path(tokenizer, tmp_path,
                                                                          model_dir):
    """beta > 0 with a model built in memory: stock TRL loads the reference model from the
    config's path and fails (measured before: 'Repo id must use alphanumeric chars' in the
    packed trainer too); the packed trainer copies the object, which trains as stock TRL
    given the saved checkpoint's path."""
    model = zoo.tiny_model("qwen2")  # the weights model_dir holds, with no path
    with pytest.raises(Exception, match="alphanumeric"):
        make_trainer(tokenizer, tmp_path / "stock", model)
    runs = {}
    for name, cls, given in (("stock", GRPOTrainer, model_dir),
                             ("packed", treepack.trl.TreepackGRPOTrainer, model)):
        probe = GradientsAtStep()
        trainer = make_trainer(tokenizer, tmp_path / name, given, cls=cls, callbacks=[probe],
                               config=dict(optim="sgd", learning_rate=0.1, max_steps=2))
        torch.manual_seed(0)
        trainer.train()
        runs[name] = (trainer, probe.grads, probe.sizes)
    packed = runs["packed"][0]
    assert packed.ref_model is not model and packed.model is model
    assert_same_training(runs)
    for name, p in packed.ref_model.named_parameters():  # the reference stayed as given
        assert torch.equal(p, runs["stock"][0].ref_model.get_parameter(name)), name


def test_shuffle_whole_groups_draws_what_trl_draws_and_keeps_groups_together():
    """One randperm, as TRL's shuffle: the random stream after it is the same; every row kept;
    each of the parts holds whole groups (equal sizes), scalars untouched."""
    from trl.trainer.utils import shuffle_sequence_dict

    prompts = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9], [0, 0, 4], [0, 0, 4]])
    batch = {"prompt_ids": prompts, "prompt_mask": (prompts != 0).long(),
             "row": torch.arange(6), "names": list("abcdef"), "num_items": torch.tensor(12)}
    torch.manual_seed(3)
    ours = treepack.trl.shuffle_whole_groups(batch, parts=3)
    after_ours = torch.rand(1)
    torch.manual_seed(3)
    shuffle_sequence_dict(batch)
    assert torch.equal(torch.rand(1), after_ours)
    assert sorted(ours["row"].tolist()) == list(range(6)) and ours["num_items"] == 12
    assert ours["names"] == ["abcdef"[i] for i in ours["row"].tolist()]
    for part in ours["prompt_ids"].split(2):
        assert torch.equal(part[0], part[1])
    # two optimizer steps of two parts each: every row stays in the step TRL's shuffle gives it
    prompts = torch.tensor([[5], [5], [6], [6], [7], [7], [8], [8]])
    batch = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts),
             "row": torch.arange(8)}
    for seed in range(20):
        torch.manual_seed(seed)
        ours = treepack.trl.shuffle_whole_groups(batch, parts=4, parts_per_step=2)
        torch.manual_seed(seed)
        stock = shuffle_sequence_dict(batch)
        for mine, theirs in zip(ours["row"].split(4), stock["row"].split(4)):
            assert sorted(mine.tolist()) == sorted(theirs.tolist())
    assert doctest.testmod(shuffle, raise_on_error=True).attempted > 0


def test_no_grad_passes_pack_at_most_one_of_trls_chunks(tokenizer, tmp_path, model_dir,
                                                        monkeypatch):
    """TRL scores old and reference log-probs in chunks of batch_size rows; each forward then
    computes at most batch_size x the padded width rows, the tokens of one of those chunks
    (here the 11-row tree does not fit 1 x 9: it runs in parts)."""
    from treepack.adapters.hf.parts import run as parts

    trainer = treepack.trl.patch(make_trainer(tokenizer, tmp_path, model_dir))
    ids, mask = trl_batch()
    packs, forwards = [], []
    real, real_all = seam._packed_forwards, parts.Run.all

    def recording(*args, **kw):
        out = real(*args, **kw)
        packs.extend(out[3])
        return out

    monkeypatch.setattr(seam, "_packed_forwards", recording)
    monkeypatch.setattr(parts.Run, "all", lambda self: forwards.extend(
        p.rows.shape[0] for p in self.parts.parts) or real_all(self))
    with torch.no_grad():
        chunked = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4,
                                                             batch_size=1)
        whole = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4)
    assert len(forwards) > 1 and max(forwards) <= ids.shape[1], forwards
    (one,) = packs  # without chunks: the whole batch in one pack
    assert one.num_sequences == len(ids)
    assert_within(chunked[0], whole[0], FLOAT32_RELATIVE)  # a float32 model, other packs


def test_patch_keeps_trls_timer_and_refuses_an_override(tokenizer, tmp_path, model_dir):
    class Custom(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    with pytest.raises(TypeError, match="overrides _get_per_token_logps_and_entropies"):
        treepack.trl.patch(make_trainer(tokenizer, tmp_path, model_dir, cls=Custom))
    trainer = treepack.trl.patch(make_trainer(tokenizer, tmp_path, model_dir))
    method = trainer._get_per_token_logps_and_entropies
    assert method.__name__ == "_get_per_token_logps_and_entropies"
    assert method.__func__.__wrapped__ is not None  # TRL's profiling_decorator around it


def launch(mode, model_dir, out, per_device, accumulation, config=None):
    """tests/trl_ranks.py on 2 CPU processes (gloo) under accelerate, as docs/integrations.md
    says to launch them; ``config``: further GRPOConfig fields."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from launch import free_port

    script = Path(__file__).resolve().with_name("trl_ranks.py")
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
         "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", str(free_port()),  # not 29500, which another run may hold
         str(script), mode, model_dir, str(out), str(per_device), str(accumulation),
         json.dumps(config or {})],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    result["micro_batches"] = [torch.load(f"{out}.{rank}", weights_only=False)
                               for rank in range(result["processes"])]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("option", [{}, dict(entropy_coef=0.1, max_completion_length=16)])
def test_two_processes_keep_groups_whole_and_equal_stock(tokenizer, model_dir, tmp_path, option):
    """2 processes x per_device_train_batch_size 4 x gradient accumulation 2: each process
    takes 8 rows (two whole prompts of 4 completions), each micro-batch one prompt; two
    optimizer steps equal stock TRL's, with the entropy bonus (each process's own, corrected
    per row) too. treepack/token_ratio is each step's packed rows / tokens summed over both
    processes and their micro-batches (before: rank 0's mean of its per-micro-batch ratios).
    With 2 rows a process the groups straddle processes and the packed trainer says so, with
    the setting that fixes it."""
    tokenizer.save_pretrained(model_dir)
    stock = launch("stock", model_dir, tmp_path / "stock.pt", 4, 2, option)
    packed = launch("packed", model_dir, tmp_path / "packed.pt", 4, 2, option)
    assert packed["processes"] == 2 and not packed["warnings"]
    for process in packed["micro_batches"]:
        assert len(process) == 4 and all(len(prompts) == 1 for prompts, *_ in process), process
    for k, want in stock["params"].items():  # a float32 model
        assert_within(packed["params"][k], want, FLOAT32_RELATIVE, msg=k)
    logged = [h["treepack/token_ratio"] for h in packed["history"]
              if "treepack/token_ratio" in h]
    sums = [[sum(mb[1] for process in packed["micro_batches"] for mb in process[s:s + 2]),
             sum(mb[2] for process in packed["micro_batches"] for mb in process[s:s + 2])]
            for s in (0, 2)]  # 2 micro-batches a step on each process
    assert logged == pytest.approx([rows / tokens for rows, tokens in sums], rel=FLOAT64_OP, abs=0)
    if not option:
        straddling = launch("packed", model_dir, tmp_path / "straddling.pt", 2, 1)
        (said,) = straddling["warnings"]
        assert "= 2 rows, not a multiple of num_generations = 4" in said
        assert "per_device_train_batch_size=4" in said


@pytest.mark.parametrize("max_tokens", [None, 16])
def test_a_hybrid_qwen3_5_trains_through_the_trainer_as_stock(tokenizer, tmp_path, max_tokens,
                                                              monkeypatch):
    """Qwen3.5 (Gated DeltaNet + attention layers): one GRPO step through trainer.train(),
    packed and stock, apply the same gradients. Judged against the largest gradient of the
    model: the scan runs in float32 inside transformers, whose rounding differs with where a
    chunk starts (``treepack verify`` measures the same between its chunked and token-by-token
    forms). At 16 rows a forward the reference pass runs in parts through the trainer (the
    values at each cut are checked closely by the no-grad seam test above)."""
    from treepack.adapters.hf.parts import run as parts

    forwards = []
    real_all = parts.Run.all
    monkeypatch.setattr(parts.Run, "all", lambda self: forwards.append(len(self.parts.parts))
                        or real_all(self))
    path = tmp_path / "tiny-qwen3_5"
    zoo.tiny_model("qwen3_5", layers=2).save_pretrained(path)
    runs = {}
    for name, cls in (("stock", GRPOTrainer), ("packed", treepack.trl.TreepackGRPOTrainer)):
        probe = GradientsAtStep()
        extra = {"treepack_max_tokens": max_tokens} if name == "packed" else {}
        trainer = make_trainer(tokenizer, tmp_path / name, str(path), cls=cls,
                               callbacks=[probe], **extra)
        torch.manual_seed(0)
        trainer.train()
        runs[name] = probe.grads
    largest = max(g.abs().max().item() for g in runs["stock"].values())
    for k, g in runs["stock"].items():  # a float32 model: FLOAT32_RELATIVE of the largest
        torch.testing.assert_close(runs["packed"][k], g, rtol=0, atol=FLOAT32_RELATIVE * largest,
                                   msg=k)
    assert bool(forwards) == (max_tokens is not None) and all(n > 1 for n in forwards), forwards
