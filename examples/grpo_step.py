"""One GRPO step with treepack, on a random tiny model: the few lines a trainer changes.

    python examples/grpo_step.py

A GRPO batch: 4 prompts x 6 rollouts. Every rollout repeats its prompt, so the unpacked
forward computes each prompt 6 times; the packed forward computes it once. The loss code is
the trainer's own, on the usual [N, L] tensors; only the lines marked "treepack" differ
from an unpacked trainer. At the end the same step is run unpacked and compared.
"""

from __future__ import annotations

import copy

import torch

import treepack
from treepack import hf, losses, zoo

torch.manual_seed(0)
policy = hf.prepare(zoo.tiny_model("qwen2", layers=2))  # any transformers causal LM; treepack
reference = copy.deepcopy(policy).eval()
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)

# ---- rollouts: prompt + completion ids, one reward per completion (from your environment)
G = 6
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, zoo.VOCAB, (int(n),), generator=gen) for n in (18, 24, 30, 21)]
sequences, prompt_lengths = [], []
for prompt in prompts:
    for _ in range(G):
        completion = torch.randint(3, zoo.VOCAB, (int(torch.randint(8, 24, (1,), generator=gen)),),
                                   generator=gen)
        sequences.append(torch.cat((prompt, completion)))
        prompt_lengths.append(len(prompt))
rewards = torch.randn(len(sequences), generator=gen)
group = rewards.view(-1, G)
advantages = ((group - group.mean(1, keepdim=True)) / (group.std(1, keepdim=True) + 1e-6))
advantages = advantages.flatten()  # [N], one per rollout: GRPO's group-normalised reward

# ---- treepack: one pack for the whole batch (a planner splits bigger batches)
pack = treepack.TreePack.from_sequences(sequences, pad_to_multiple_of=64)
mask = pack.completion_mask(prompt_lengths)  # the completion only; the prompt still gets gradient


def logprobs(model):
    # treepack: one forward over the tree, log-probs back in [N, L] without [T', V] logits
    return hf.logprobs(model, pack, entropy=True)


with torch.no_grad():
    old_logps = logprobs(policy).logprobs  # usually stored at rollout time
    ref_logps = logprobs(reference).logprobs

# ---- the trainer's own loss on [N, L]: nothing packed about it
den = losses.global_denominators([mask])  # every pack and rank of the step (here: one)
logps, entropy = logprobs(policy)
pg = losses.policy_loss(logps, old_logps, advantages, mask, clip=0.2, clip_high=0.28,
                        mode="token-mean", denominators=den)
kl = losses.aggregate(losses.kl_penalty(logps, ref_logps, "k3"), mask, denominators=den)
loss = pg.loss + 0.01 * kl - 0.001 * losses.entropy_bonus(entropy, mask, denominators=den)
optimizer.zero_grad(set_to_none=True)
loss.backward()
packed_grads = {k: p.grad.clone() for k, p in policy.named_parameters()}

print(f"{len(sequences)} sequences, {pack.num_original_tokens} tokens -> {pack.num_packed_rows} "
      f"packed rows (token ratio {pack.token_ratio:.2f})")
print(f"loss {loss.item():.6f}  clip fraction {pg.clip_fraction.item():.3f}  "
      f"kl {kl.item():.2e}")

# ---- the same step unpacked: every sequence alone, the same loss code
L = pack.max_length
with torch.no_grad():
    old_alone = torch.zeros(len(sequences), L)
    ref_alone = torch.zeros(len(sequences), L)
logps_alone = torch.zeros(len(sequences), L)
entropy_alone = torch.zeros(len(sequences), L)
for s, seq in enumerate(sequences):
    idx = (torch.tensor([s]), torch.arange(1, len(seq)))
    for model, out, grad in ((policy, "logps", True), (reference, "ref", False)):
        with torch.set_grad_enabled(grad):
            logp = model(input_ids=seq[None], use_cache=False).logits[0].float().log_softmax(-1)
        picked = logp[:-1].gather(-1, seq[1:, None])[:, 0]
        if out == "logps":
            logps_alone = logps_alone.index_put(idx, picked)
            entropy_alone = entropy_alone.index_put(idx, -(logp.exp() * logp).sum(-1)[:-1])
            old_alone = old_alone.index_put(idx, picked.detach())
        else:
            ref_alone = ref_alone.index_put(idx, picked)
pg_alone = losses.policy_loss(logps_alone, old_alone, advantages, mask, clip=0.2,
                              clip_high=0.28, mode="token-mean", denominators=den)
kl_alone = losses.aggregate(losses.kl_penalty(logps_alone, ref_alone, "k3"), mask,
                            denominators=den)
loss_alone = (pg_alone.loss + 0.01 * kl_alone
              - 0.001 * losses.entropy_bonus(entropy_alone, mask, denominators=den))
optimizer.zero_grad(set_to_none=True)
loss_alone.backward()
worst = max((packed_grads[k] - p.grad).abs().max().item() / p.grad.abs().max().item()
            for k, p in policy.named_parameters())
print(f"unpacked loss {loss_alone.item():.6f}; largest relative gradient difference "
      f"{worst:.1e}")
assert abs(loss.item() - loss_alone.item()) <= 1e-5 * abs(loss_alone.item()) and worst < 1e-4

optimizer.step()  # unchanged
