"""TRL's GRPOTrainer with treepack's per-token log-prob seam, end to end on a tiny model."""

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import treepack.trl  # noqa: E402
from treepack import zoo  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    words = ["<pad>", "<bos>", "<eos>"] + [f"w{i}" for i in range(zoo.VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


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
        # measured 1.4e-6 at most (float32); a scan state lost at a cut is 1.1e-5 off
        torch.testing.assert_close(a[completion], b[completion], rtol=0, atol=4e-6)
        assert (a[~completion] == 0).all()
    # gradients too: the loss the trainer builds on them
    w = torch.randn(4, keep)
    grads = []
    for out in (ours, stock):
        model.zero_grad(set_to_none=True)
        ((out[0] * w * completion).sum() + (out[1] * w * completion).sum()).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for k, g in grads[1].items():
        torch.testing.assert_close(grads[0][k], g, rtol=0, atol=1e-5 * g.abs().max().item())


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_no_grad_passes_run_a_tree_over_the_budget_in_parts(tokenizer, tmp_path, model_dir,
                                                           monkeypatch, family):
    """TRL's old / reference log-prob passes (no grad) at a budget that splits the batch's
    tree: every row once, in parts, equal to the stock seam; the training pass plans packs.
    On Qwen3.5 each cut carries the convolutions' inputs and the scans' states."""
    from treepack.adapters.hf import parts

    if family != "qwen2":
        model_dir = str(tmp_path / family)
        zoo.tiny_model(family, layers=4).save_pretrained(model_dir)
    trainer = make_trainer(tokenizer, tmp_path, model_dir)
    model = trainer.model
    ids, mask = trl_batch()
    with torch.no_grad():
        stock = trainer._get_per_token_logps_and_entropies(model, ids, mask, 4,
                                                           compute_entropy=True)
    treepack.trl.patch(trainer, max_tokens=8)  # the 11-row tree of rows 0, 1, 3 splits
    runs = []
    real = parts._Run.all
    monkeypatch.setattr(parts._Run, "all", lambda self: runs.append(len(self.parts.parts))
                        or real(self))
    with torch.no_grad():
        ours = trainer._get_per_token_logps_and_entropies(model, ids, mask, 4,
                                                          compute_entropy=True)
    assert runs and runs[0] > 1  # in parts
    completion = mask[:, -4:].bool()
    for a, b in zip(ours[:2], stock[:2]):
        # measured 1.4e-6 at most (float32); a scan state lost at a cut is 1.1e-5 off
        torch.testing.assert_close(a[completion], b[completion], rtol=0, atol=4e-6)
        assert (a[~completion] == 0).all()
    trainer._get_per_token_logps_and_entropies(model, ids, mask, 4)  # with grad: packs
    assert len(runs) == 1


class GradientsAtStep(TrainerCallback):
    """The gradients the optimizer is about to apply."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {k: p.grad.clone() for k, p in model.named_parameters()
                      if p.grad is not None}


@pytest.mark.parametrize("max_tokens", [None, 16])
def test_one_training_step_equals_the_stock_trainer(tokenizer, tmp_path, model_dir, max_tokens,
                                                    monkeypatch):
    """trainer.train(), packed and stock. At 16 rows a forward a prompt's group does not fit:
    the training pass plans packs, the reference model's no-grad pass runs in parts."""
    from treepack.adapters.hf import parts

    forwards = []
    real_all = parts._Run.all
    monkeypatch.setattr(parts._Run, "all", lambda self: forwards.append(len(self.parts.parts))
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
        torch.testing.assert_close(runs["packed"][1][k], g, rtol=0,
                                   atol=1e-5 * g.abs().max().item(), msg=k)
    for (name, a), b in zip(packed.model.named_parameters(), stock.model.parameters()):
        assert (a - model.get_parameter(name)).abs().max() > 0  # both took the step
    assert bool(forwards) == (max_tokens is not None) and all(n > 1 for n in forwards), forwards


def test_patch_refuses_multimodal_inputs_and_other_trainers(tokenizer, tmp_path, model_dir):
    trainer = treepack.trl.patch(make_trainer(tokenizer, tmp_path, model_dir))
    ids, mask = trl_batch()
    with pytest.raises(NotImplementedError, match="pixel_values"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4,
                                                   pixel_values=torch.zeros(1))
    with pytest.raises(TypeError, match="GRPOTrainer"):
        treepack.trl.patch(object())


def train_both(tokenizer, tmp_path, model_dir, **kwargs):
    """Stock TRL and TreepackGRPOTrainer trained from the same seed: (trainer, gradients at the
    last optimizer step) each."""
    runs = {}
    for name, cls in (("stock", GRPOTrainer), ("packed", treepack.trl.TreepackGRPOTrainer)):
        probe = GradientsAtStep()
        trainer = make_trainer(tokenizer, tmp_path / name, model_dir, cls=cls,
                               callbacks=[probe], **kwargs)
        torch.manual_seed(0)
        trainer.train()  # same seed: the same completions, rewards and advantages
        runs[name] = (trainer, probe.grads)
    return runs


def assert_same_training(runs):
    """Equal gradients at the last step and equal weights after it (float32 rounding; the
    runs step with SGD, whose update is linear in the gradient: Adam's first step divides
    each gradient by its own magnitude, so it turns rounding in a near-zero one into ~lr)."""
    (packed, packed_grads), (stock, stock_grads) = runs["packed"], runs["stock"]
    assert stock_grads and packed_grads.keys() == stock_grads.keys()
    for k, g in stock_grads.items():
        torch.testing.assert_close(packed_grads[k], g, rtol=0,
                                   atol=1e-5 * g.abs().max().item(), msg=k)
    for (name, a), b in zip(packed.model.named_parameters(), stock.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(b.abs().max().item(), 1e-3),
                                   msg=name)


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
    real = treepack.trl._packed_forwards

    def recording(model, input_ids, attention_mask, logits_to_keep, **kw):
        if torch.is_grad_enabled():
            training_batches.append((input_ids[:, :input_ids.shape[1] - logits_to_keep],
                                     attention_mask[:, :input_ids.shape[1] - logits_to_keep]))
        return real(model, input_ids, attention_mask, logits_to_keep, **kw)

    monkeypatch.setattr(treepack.trl, "_packed_forwards", recording)
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


def test_no_grad_passes_pack_at_most_one_of_trls_chunks(tokenizer, tmp_path, model_dir,
                                                        monkeypatch):
    """TRL scores old and reference log-probs in chunks of batch_size rows; each forward then
    computes at most batch_size x the padded width rows, the tokens of one of those chunks
    (here the 11-row tree does not fit 1 x 9: it runs in parts)."""
    from treepack.adapters.hf import parts

    trainer = treepack.trl.patch(make_trainer(tokenizer, tmp_path, model_dir))
    ids, mask = trl_batch()
    packs, forwards = [], []
    real, real_all = treepack.trl._packed_forwards, parts._Run.all

    def recording(*args, **kw):
        out = real(*args, **kw)
        packs.extend(out[3])
        return out

    monkeypatch.setattr(treepack.trl, "_packed_forwards", recording)
    monkeypatch.setattr(parts._Run, "all", lambda self: forwards.extend(
        p.rows.shape[0] for p in self.parts.parts) or real_all(self))
    with torch.no_grad():
        chunked = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4,
                                                             batch_size=1)
        whole = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4)
    assert len(forwards) > 1 and max(forwards) <= ids.shape[1], forwards
    (one,) = packs  # without chunks: the whole batch in one pack
    assert one.num_sequences == len(ids)
    torch.testing.assert_close(chunked[0], whole[0], rtol=0, atol=1e-6)


def test_patch_keeps_trls_timer_and_refuses_an_override(tokenizer, tmp_path, model_dir):
    class Custom(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    with pytest.raises(TypeError, match="overrides _get_per_token_logps_and_entropies"):
        treepack.trl.patch(make_trainer(tokenizer, tmp_path, model_dir, cls=Custom))
    trainer = treepack.trl.patch(make_trainer(tokenizer, tmp_path, model_dir))
    seam = trainer._get_per_token_logps_and_entropies
    assert seam.__name__ == "_get_per_token_logps_and_entropies"
    assert seam.__func__.__wrapped__ is not None  # TRL's profiling_decorator around it


def launch(mode, model_dir, out, per_device, accumulation):
    """tests/trl_ranks.py on 2 CPU processes (gloo) under accelerate, as docs/integrations.md
    says to launch them."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "trl_ranks.py"
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
         "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         str(script), mode, model_dir, str(out), str(per_device), str(accumulation)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    result["micro_batches"] = [torch.load(f"{out}.{rank}", weights_only=False)
                               for rank in range(result["processes"])]
    return result


@pytest.mark.slow
def test_two_processes_keep_groups_whole_and_equal_stock(tokenizer, model_dir, tmp_path):
    """2 processes x per_device_train_batch_size 4 x gradient accumulation 2: each process
    takes 8 rows (two whole prompts of 4 completions), each micro-batch one prompt; two
    optimizer steps equal stock TRL's. With 2 rows a process the groups straddle processes
    and the packed trainer says so, with the setting that fixes it."""
    tokenizer.save_pretrained(model_dir)
    stock = launch("stock", model_dir, tmp_path / "stock.pt", 4, 2)
    packed = launch("packed", model_dir, tmp_path / "packed.pt", 4, 2)
    assert packed["processes"] == 2 and not packed["warnings"]
    for process in packed["micro_batches"]:
        assert len(process) == 4 and all(len(prompts) == 1 for prompts in process), process
    for k, want in stock["params"].items():
        torch.testing.assert_close(packed["params"][k], want, rtol=0,
                                   atol=1e-5 * want.abs().max().item(), msg=k)
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
    from treepack.adapters.hf import parts

    forwards = []
    real_all = parts._Run.all
    monkeypatch.setattr(parts._Run, "all", lambda self: forwards.append(len(self.parts.parts))
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
    scale = max(g.abs().max().item() for g in runs["stock"].values())
    for k, g in runs["stock"].items():
        torch.testing.assert_close(runs["packed"][k], g, rtol=0, atol=1e-5 * scale, msg=k)
    assert bool(forwards) == (max_tokens is not None) and all(n > 1 for n in forwards), forwards
