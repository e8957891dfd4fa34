"""What tests/adapters/trl/test_trl_async.py and async_ranks.py run TRL's asynchronous GRPO
trainer with: a scripted rollout worker (no vLLM), a no-op weight transfer, an
unpacked reference trainer, and one function that trains a trainer class and returns what
the tests compare.
"""

from __future__ import annotations

import queue
import time
from typing import NamedTuple

import numpy as np
import torch

from tiny_models import word_tokenizer
from treepack import zoo
from treepack.adapters.trl.async_grpo import PerTerm, RankSamples, TreepackAsyncGRPOTrainer

PAD, BOS, EOS = 0, 1, 2
SYSTEM = [BOS, 5, 6]  # every prompt starts with it: groups share a prefix too


def group(index: int, generations: int = 4) -> list[dict]:
    """Rollout ``index``'s samples, the same every run: one prompt (the shared system prefix
    and its own tokens), ``generations`` completions among which pairs fork after 2 tokens,
    one with a tool result inside (context tokens the loss skips), and a duplicate (even
    groups) or a truncated prefix (odd groups) of another."""
    rng = np.random.default_rng(1000 + index)
    prompt = SYSTEM + rng.integers(3, zoo.VOCAB, int(rng.integers(2, 5))).tolist()
    completions, masks = [], []
    for g in range(generations):
        if g % 4 == 3:  # a copy of the previous completion, or it cut one token short
            completion = list(completions[-1]) if index % 2 == 0 else completions[-1][:-1]
            mask = list(masks[-1][:len(completion)])
        else:
            completion = rng.integers(3, zoo.VOCAB, int(rng.integers(3, 6))).tolist() + [EOS]
            if g % 4 == 1:  # forks from the previous completion after its first 2 tokens
                completion[:2] = completions[-1][:2]
            mask = [1] * len(completion)
            if g % 4 == 2:  # a tool result: 2 context tokens inside the completion
                completion[2:2] = rng.integers(3, zoo.VOCAB, 2).tolist()
                mask[2:2] = [0, 0]
        completions.append(completion)
        masks.append(mask)
    rewards = rng.normal(size=generations)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    samples = []
    for completion, mask, advantage, reward in zip(completions, masks, advantages, rewards):
        ids = np.array(prompt + completion, dtype=np.int64)
        trained = np.array([0] * len(prompt) + mask, dtype=np.int64)
        # the sampler's log-probs, aligned with ids: near a random model's, 0 on context
        old = np.where(trained == 1, -np.log(zoo.VOCAB) + 0.1 * rng.normal(size=len(ids)), 0.0)
        samples.append(dict(input_ids=ids, completion_mask=trained,
                            old_log_probs=old.astype(np.float32), advantage=float(advantage),
                            group_id=index, metrics={"reward": float(reward)}))
    return samples


class ScriptedQueue:
    """The worker's rollout buffer: each ``get`` hands the next sample of :func:`group` 0, 1,
    ..., stamped with the worker's current model version (never stale): the same stream
    every run, whatever the timing, and no thread."""

    def __init__(self, worker):
        self.worker, self.ready, self.next_group = worker, [], 0

    def get(self, timeout=None):
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        if not self.ready:
            for sample in group(self.next_group):
                self.worker.max_abs_advantage = max(self.worker.max_abs_advantage,
                                                    abs(sample["advantage"]))
                self.ready.append(RolloutSample(
                    prompt=[], completion=[], model_version=self.worker.model_version,
                    enqueued_at=time.time(), **sample))
            self.next_group += 1
        return self.ready.pop(0)

    def qsize(self):
        return len(self.ready)


class ScriptedWorker:
    """TRL's ``RolloutWorkerProtocol`` over :class:`ScriptedQueue`."""

    def __init__(self):
        self.model_version = 0
        self.max_abs_advantage = 0.0  # over the samples handed out
        self.rollout_buffer = ScriptedQueue(self)
        self.metrics_queue = queue.Queue()

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, version):
        self.model_version = version

    def check_health(self, stale_after_s):
        pass


class NoWeightTransfer:
    """TRL's ``WeightTransferProtocol``, sending nowhere (it drains the weights' iterator, as
    a sender would)."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, weights):
        for _ in weights:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


class UnpackedReference(TreepackAsyncGRPOTrainer):
    """The reference: each sample ALONE through the plain model (no pack; the prepared
    model runs its original attention), its log-probs and entropies taken from the model's
    logits, into TRL's loss as the packed trainer feeds it. The MoE router loss is the
    model's own on a right-padded batch of the samples (transformers masks the padding)."""

    def _treepack_per_term(self, model, rank: RankSamples) -> PerTerm:
        log_probs, entropy = [], []
        device = rank.term_position.device
        for s, ids in enumerate(rank.sequences):
            ids = ids.to(device)
            logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
            logp = (logits / self.temperature).log_softmax(-1)  # [L, V]
            where = rank.term_position[rank.term_sample == s]
            log_probs.append(logp[where - 1].gather(-1, ids[where, None])[:, 0])
            entropy.append(-(logp[where - 1].exp() * logp[where - 1]).sum(-1))
        aux = None
        if self.aux_loss_enabled:
            ids = torch.nn.utils.rnn.pad_sequence(rank.sequences, batch_first=True,
                                                  padding_value=PAD).to(device)
            mask = torch.nn.utils.rnn.pad_sequence(
                [torch.ones_like(s) for s in rank.sequences], batch_first=True).to(device)
            aux = model(input_ids=ids, attention_mask=mask, output_router_logits=True,
                        use_cache=False).aux_loss
        # terms are sample by sample (TRL's order), as the loop above; a row per token
        tokens = sum(len(s) for s in rank.sequences)
        return PerTerm(torch.cat(log_probs), torch.cat(entropy), aux, tokens, tokens)


class Run(NamedTuple):
    """What a training run gives the tests."""

    losses: list[float]  # each step's logged loss
    grad_norms: list[float]
    logs: list[dict]  # each step's logged metrics
    params: dict  # name -> the weights after the last step
    max_abs_advantage: float  # over the samples trained on (the loss terms' size)


def config(out: str, **fields):
    """The tests' AsyncGRPOConfig: CPU, float32, SGD (its update is linear in the
    gradient), TRL's gradient checkpointing; ``fields`` override."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    return AsyncGRPOConfig(**dict(
        output_dir=out, report_to="none", max_steps=2, use_cpu=True, bf16=False,
        per_device_train_batch_size=8, num_generations=4, token_budget=0, temperature=0.7,
        optim="sgd", learning_rate=0.1, logging_steps=1, save_strategy="no",
        seed=0, disable_tqdm=True) | fields)


def build(cls, model_dir: str, out: str, **fields):
    """``cls`` (stock AsyncGRPOTrainer or a treepack one) on the scripted worker."""
    from datasets import Dataset

    return cls(model=model_dir, args=config(out, **fields),
               train_dataset=Dataset.from_dict({"prompt": ["unused"]}),  # TRL's worker reads it
               processing_class=word_tokenizer(), rollout_worker=ScriptedWorker(),
               weight_transfer=NoWeightTransfer())


def train(cls, model_dir: str, out: str, **fields) -> Run:
    """Build ``cls`` (under the CPU stand-ins) and ``train()`` it."""
    from trl_async_cpu import cpu_stand_ins

    with cpu_stand_ins():
        trainer = build(cls, model_dir, out, **fields)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    worker = trainer.rollout_worker
    return Run([h["loss"] for h in logs], [h["grad_norm"] for h in logs], logs,
               {k: p.detach().clone() for k, p in trainer.model.named_parameters()},
               worker.max_abs_advantage if worker is not None else 0.0)
