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


def make_trainer(tokenizer, tmp_path, model, cls=GRPOTrainer, **kwargs):
    dataset = Dataset.from_dict({"prompt": ["w5 w6 w7 w8 w9", "w10 w11 w12", "w13 w14 w15 w16",
                                            "w5 w6 w7"] * 2})

    def reward(completions, **kw):
        return [float(len(c)) + 0.1 * i for i, c in enumerate(completions)]

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to="none", save_strategy="no",
                      use_cpu=True, bf16=False, temperature=0.7, seed=0, learning_rate=1e-3,
                      beta=0.04)
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
        torch.testing.assert_close(a[completion], b[completion], rtol=0, atol=1e-5)
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


class GradientsAtStep(TrainerCallback):
    """The gradients the optimizer is about to apply."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {k: p.grad.clone() for k, p in model.named_parameters()}


def test_one_training_step_equals_the_stock_trainer(tokenizer, tmp_path, model_dir):
    model = zoo.tiny_model("qwen2")  # the saved weights
    runs = {}
    for name, cls in (("stock", GRPOTrainer), ("packed", treepack.trl.TreepackGRPOTrainer)):
        probe = GradientsAtStep()
        trainer = make_trainer(tokenizer, tmp_path / name, model_dir, cls=cls, callbacks=[probe])
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


def test_patch_refuses_multimodal_inputs_and_other_trainers(tokenizer, tmp_path, model_dir):
    trainer = treepack.trl.patch(make_trainer(tokenizer, tmp_path, model_dir))
    ids, mask = trl_batch()
    with pytest.raises(NotImplementedError, match="pixel_values"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4,
                                                   pixel_values=torch.zeros(1))
    with pytest.raises(TypeError, match="GRPOTrainer"):
        treepack.trl.patch(object())
