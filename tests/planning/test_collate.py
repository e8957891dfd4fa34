import numpy as np
import pytest
import torch

import treepack
from treepack import losses
from treepack.collation import rollouts_from_padded
from treepack.synthetic import agent_batch, grpo_batch

from tolerance import FLOAT64_OP


def make_rollouts(seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    seqs = grpo_batch(groups=3, rollouts=4, prompt_len=9, response_len=6, jitter=0.5,
                      vocab=vocab, seed=seed)
    out = []
    for i, s in enumerate(seqs):
        s = torch.as_tensor(s)
        prompt, completion = s[:9], s[9:]
        n = len(completion)
        out.append(dict(prompt=prompt, completion=completion, group=i // 4,
                        advantage=float(torch.randn((), generator=g)),
                        old_logps=-torch.rand(n, generator=g),
                        loss_mask=torch.rand(n, generator=g) < 0.8))
    return out


def all_batches(collated):
    return [b for r in range(collated.plan.world_size) for b in collated.batches(r)]


def test_fields_land_where_their_tokens_are_predicted():
    rollouts = make_rollouts()
    collated = treepack.collate(rollouts, max_tokens=30, world_size=2)
    seen = []
    for batch in all_batches(collated):
        for k, i in enumerate(batch.pack.seq_ids.tolist()):
            seen.append(i)
            r = rollouts[i]
            p, c = len(r["prompt"]), len(r["completion"])
            old = batch.fields["old_logps"][k]
            assert torch.equal(old[p:p + c], r["old_logps"])
            assert (old[:p] == 0).all() and (old[p + c:] == 0).all()
            field = batch.fields["advantage"]  # the rollout's value in the field's dtype
            assert field[k] == torch.tensor(r["advantage"], dtype=field.dtype)
            assert batch.groups[k] == r["group"]
            expect_mask = torch.zeros_like(batch.mask[k])
            expect_mask[p:p + c] = r["loss_mask"]
            assert torch.equal(batch.mask[k], expect_mask)
            # the pack's token at the completion positions is the completion
            rows = batch.pack.rows[k, p:p + c]
            assert torch.equal(batch.pack.input_ids[rows], r["completion"])
            # completion(): back to one column per completion token
            back = batch.completion(batch.fields["old_logps"])[k]
            assert torch.equal(back[:c], r["old_logps"]) and (back[c:] == 0).all()
    assert sorted(seen) == list(range(len(rollouts)))


def test_a_step_over_ranks_and_packs_equals_the_unpacked_loss():
    # Random logits stand in for a model: the sum over every pack of every rank of the
    # per-pack policy losses (global denominators) is the loss of the whole batch.
    rollouts = make_rollouts(1)
    collated = treepack.collate(rollouts, max_tokens=30, world_size=3)
    batches = all_batches(collated)
    den = losses.global_denominators([b.mask for b in batches])  # one process: all ranks
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 50, generator=g, dtype=torch.float64)  # logits by previous token
    total = 0.0
    for b in batches:
        logits = table[b.pack.input_ids]  # a stand-in model: logits from the row's own token
        logps = b.pack.token_logprobs(logits)
        total += losses.policy_loss(logps, b.fields["old_logps"].double(),
                                    b.fields["advantage"].double(), b.mask,
                                    mode="seq-mean-token-mean", denominators=den).loss
    # unpacked: each rollout alone, in the completion layout
    per_seq, count = [], 0
    for r in rollouts:
        seq = torch.cat((r["prompt"], r["completion"]))
        logp = table[seq[:-1]].log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
        c = len(r["completion"])
        lp = logp[-c:]
        ratio = torch.exp(lp - r["old_logps"].double())
        a = r["advantage"]
        tok = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
        m = r["loss_mask"]
        if m.any():
            per_seq.append(tok[m].mean())
            count += 1
    expect = torch.stack(per_seq).sum() / count
    # float64 losses over a few dozen tokens, terms of size 1: FLOAT64_OP
    assert total.item() == pytest.approx(expect.item(), rel=FLOAT64_OP, abs=FLOAT64_OP)


def test_rollouts_from_padded_tensors():
    # verl / TRL keep left-padded prompts and right-padded completions
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    prompt_mask = (prompts != 0).long()
    completions = torch.tensor([[11, 12, 0], [13, 14, 15]])
    completion_mask = (completions != 0).long()
    old = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]])
    adv = torch.tensor([0.5, -0.5])
    rollouts = rollouts_from_padded(prompts, prompt_mask, completions, completion_mask,
                                    old_logps=old, advantage=adv)
    assert rollouts[0]["prompt"].tolist() == [5, 6]
    assert rollouts[0]["completion"].tolist() == [11, 12]
    assert rollouts[0]["old_logps"].tolist() == [-1.0, -2.0]
    assert rollouts[1]["advantage"].item() == -0.5
    batch = treepack.collate(rollouts, max_tokens=16).batches(0)[0]
    assert torch.equal(batch.completion(batch.fields["old_logps"]), old[batch.pack.seq_ids])


def test_agent_steps_share_their_history_across_rollouts():
    steps = agent_batch(prompts=1, trajectories=2, steps=3, prompt_len=8, response_len=4,
                        tool_len=3, vocab=50)
    # each step: the history so far is the prompt, its response is the completion
    rollouts = [dict(prompt=s[:-4], completion=s[-4:]) for s in steps]
    collated = treepack.collate(rollouts, max_tokens=64)
    (batch,) = collated.batches(0)
    assert batch.pack.num_packed_rows == treepack.forest_stats(steps).packed_rows
    assert batch.mask.sum() == 4 * len(steps)
    assert collated.denominators(0).tokens == 4 * len(steps)


@pytest.mark.parametrize("parts", [False, True])
def test_rollouts_routed_differently_fork_where_their_routes_differ(parts):
    """A GRPO group whose prompt the rollout engine routed one way for two rollouts and
    another way (from its third token on) for the third: planned and packed on routes."""
    prompt, layers, topk = [3, 4, 5, 6], 2, 2
    rollouts = [dict(prompt=prompt, completion=[7 + i, 8]) for i in range(3)]
    routes = [np.zeros((6, layers, topk), np.int16) for _ in rollouts]
    routes[2][2:] = 1
    collated = treepack.collate(rollouts, max_tokens=16, routes=routes, parts=parts)
    (batch,) = collated.batches(0)
    assert batch.pack.num_packed_rows == 4 + 2 + 2 + 4  # the prompt forks at its third token
    for k, s in enumerate(batch.pack.seq_ids.tolist()):
        rows = batch.pack.host.rows[k, :5]  # every token but the last replays its route
        np.testing.assert_array_equal(batch.pack.host.row_routes[rows], routes[s][:5])
    assert batch.mask.sum() == 2 * 3  # every completion token is still predicted


@pytest.mark.parametrize(
    "rollouts, words",
    [
        ([], "at least one"),
        ([{"prompt": [1, 2]}], "'completion'"),
        ([{"prompt": [], "completion": [1]}], "empty prompt"),
        ([{"prompt": [1], "completion": [2, 3], "x": [1.0]}], "one value per completion token"),
        ([{"prompt": [1], "completion": [2], "x": 1.0}, {"prompt": [1], "completion": [3]}],
         "same fields"),
        ([{"prompt": [1.5], "completion": [2]}], "token ids"),
    ],
)
def test_bad_rollouts_are_named(rollouts, words):
    with pytest.raises(ValueError, match=words):
        treepack.collate(rollouts, max_tokens=8)


def test_per_sequence_fields_keep_their_dtype():
    rollouts = [dict(prompt=[1, 2], completion=[3], reward=np.float32(1.5), idx=np.int64(4))]
    batch = treepack.collate(rollouts, max_tokens=8).batches(0)[0]
    assert batch.fields["reward"].dtype == torch.float32 and batch.fields["idx"].item() == 4


def test_field_dtypes_come_from_every_rollout_not_the_first():
    rollouts = [dict(prompt=[1, 2], completion=[3, 4], adv=[1, 0]),
                dict(prompt=[1, 2], completion=[5, 6, 7], adv=[0.5, 0.25, -0.75]),
                dict(prompt=[8], completion=[9], adv=torch.tensor([0.5], dtype=torch.bfloat16))]
    batch = treepack.collate(rollouts, max_tokens=16).batches(0)[0]
    assert batch.fields["adv"].dtype == torch.float64
    assert batch.completion(batch.fields["adv"])[1].tolist() == [0.5, 0.25, -0.75]
    with pytest.raises(ValueError, match="field 'uid' is <U3, not numeric"):
        treepack.collate([dict(prompt=[1], completion=[2], uid="abc")], max_tokens=8)


def test_rollouts_from_padded_keeps_tool_tokens_in_context():
    prompts = torch.tensor([[0, 5, 6]])
    completions = torch.tensor([[11, 12, 13, 0]])  # 12 is a tool token: context, not loss
    padding = (completions != 0).long()
    loss_mask = torch.tensor([[1, 0, 1, 0]])
    old = torch.tensor([[0.1, 0.2, 0.3, 0.0]])
    (r,) = rollouts_from_padded(prompts, (prompts != 0).long(), completions, padding,
                                loss_mask=loss_mask, old_logps=old)
    assert r["completion"].tolist() == [11, 12, 13]
    assert torch.equal(r["old_logps"], old[0, :3])  # the given values, where they were
    batch = treepack.collate([r], max_tokens=8).batches(0)[0]
    assert batch.mask[0].tolist() == [False, False, True, False, True]  # tool token skipped
    holes = torch.tensor([[1, 0, 1, 0]])
    with pytest.raises(ValueError, match="has holes.*loss_mask"):
        rollouts_from_padded(prompts, (prompts != 0).long(), completions, holes)


def test_denominators_without_distributed_count_every_rank():
    rollouts = make_rollouts(2)
    collated = treepack.collate(rollouts, max_tokens=30, world_size=3)
    den = collated.denominators(0)
    every = [b.mask for b in all_batches(collated)]
    assert den.tokens == float(sum(m.sum() for m in every))
    assert den.sequences == float(sum(m.any(-1).sum() for m in every))
    assert den.world_size == 1  # one process: no gradient averaging to undo


def test_a_scalar_loss_mask_covers_the_whole_completion():
    # loss_mask=0 for a rollout to skip used to be read as a per-sequence field and ignored:
    # the rollout was trained on and counted in the denominators.
    rollouts = make_rollouts(3)
    for i, r in enumerate(rollouts):
        r["loss_mask"] = 0 if i % 3 == 0 else 1
    collated = treepack.collate(rollouts, max_tokens=60)
    den = collated.denominators()
    kept = [r for i, r in enumerate(rollouts) if i % 3]
    assert den.tokens == float(sum(len(r["completion"]) for r in kept))
    for b in all_batches(collated):
        assert "loss_mask" not in b.fields or b.fields["loss_mask"].dim() == 2
        for row, rollout in enumerate(b.pack.seq_ids.tolist()):
            trained = rollout % 3 and len(rollouts[rollout]["completion"]) > 0
            assert bool(b.mask[row].any()) == bool(trained)


@pytest.mark.parametrize("field,rule", [
    (torch.zeros(2, 7), r"'old_logps' has shape \(2, 7\).*\[B, P \+ C\]"),  # [B, P + C]
    (torch.zeros(2, 4, 3), r"'old_logps' has shape \(2, 4, 3\)"),  # 3-D
    (torch.zeros(3), r"'old_logps' has shape \(3,\)"),
])
def test_rollouts_from_padded_refuses_fields_it_would_cut_or_pass_uncut(field, rule):
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    completions = torch.tensor([[10, 11, 0, 0], [12, 13, 14, 15]])
    with pytest.raises(ValueError, match=rule):
        rollouts_from_padded(prompts, (prompts != 0).long(), completions,
                             (completions != 0).long(), old_logps=field)


def test_rollouts_from_padded_refuses_a_prompt_mask_with_holes():
    prompts = torch.tensor([[5, 0, 6]])  # a hole inside the prompt would drop token 0's slot
    completions = torch.tensor([[10, 11]])
    with pytest.raises(ValueError, match=r"prompt_mask row 0 has holes \(\[1, 0, 1\]\)"):
        rollouts_from_padded(prompts, (prompts != 0).long(), completions,
                             torch.ones_like(completions))
