import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treepack
from treepack import TreePack
from treepack.planner import PAIR_COST, PackSpec, plan
from treepack.synthetic import agent_batch, grpo_batch

from strategies import forests
from tolerance import FLOAT64_OP, assert_within


def check_plan(seqs, p, budget):
    """Every structural promise of a plan, checked on the built packs."""
    world = p.world_size
    assert all(len(rank) == p.packs_per_rank for rank in p.specs)  # equal micro-steps
    seen = []
    rows = 0
    for r in range(world):
        for spec, pack in zip(p.specs[r], p.packs(r)):
            ids = pack.seq_ids.tolist()
            assert ids == spec.seq_ids.tolist() == sorted(ids)
            seen += ids
            assert pack.num_packed_rows == spec.packed_rows <= budget
            assert int((pack.position_ids[: pack.num_packed_rows] + 1).sum()) == spec.pairs
            for k, i in enumerate(ids):  # the pack holds exactly those sequences, whole
                n = int(pack.lengths[k])
                assert pack.input_ids[pack.rows[k, :n]].tolist() == list(seqs[i])
            rows += pack.num_packed_rows
            if not ids:
                assert pack.num_predictions == 0
    assert sorted(seen) == list(range(len(seqs)))  # each sequence in exactly one pack
    assert rows == p.packed_rows
    assert p.packed_rows >= p.min_rows == treepack.forest_stats(seqs).packed_rows


@settings(max_examples=80, deadline=None)
@given(forests(vocab=2, max_sequences=12, max_len=15), st.integers(0, 40), st.integers(1, 4))
def test_random_plans_keep_every_promise(seqs, extra, world):
    budget = max(map(len, seqs)) + extra
    p = plan(seqs, max_tokens=budget, world_size=world)
    check_plan(seqs, p, budget)
    largest_tree = max(treepack.forest_stats([s for s in seqs if s[0] == t]).packed_rows
                       for t in {s[0] for s in seqs})
    if budget >= largest_tree:
        assert p.efficiency == 1.0  # whole trees: no prefix is ever computed twice


@settings(max_examples=80, deadline=None)
@given(forests(vocab=2, max_sequences=12, max_len=15), st.integers(0, 40), st.integers(1, 4),
       st.data())
def test_plans_with_routes_keep_every_pack_within_the_budget(seqs, extra, world, data):
    """Routes fork rows, and each pack keeps its rows' routes: a pack is the forest of its
    sequences and their routes, never more rows than planned (a last token whose longer
    sequence went to another pack may join a row of its own pack instead)."""
    routes = [np.array(data.draw(st.lists(st.integers(0, 1), min_size=len(s),
                                          max_size=len(s))))[:, None, None] for s in seqs]
    budget = max(map(len, seqs)) + extra
    p = plan(seqs, max_tokens=budget, world_size=world, routes=routes)
    seen = []
    for r in range(world):
        for spec, pack in zip(p.specs[r], p.packs(r)):
            ids = pack.seq_ids.tolist()
            seen += ids
            if not ids:
                continue
            alone = TreePack.from_sequences([seqs[i] for i in ids],
                                            routes=[routes[i] for i in ids])
            assert pack.num_packed_rows == alone.num_packed_rows <= spec.packed_rows <= budget
            np.testing.assert_array_equal(pack.host.row_routes, alone.host.row_routes)
    assert sorted(seen) == list(range(len(seqs)))
    whole = TreePack.from_sequences(seqs, routes=routes).num_packed_rows
    assert p.min_rows == whole >= treepack.forest_stats(seqs).packed_rows


def test_a_tree_bigger_than_the_budget_repeats_only_its_prompt():
    seqs = grpo_batch(groups=1, rollouts=8, prompt_len=100, response_len=50)  # 500 rows
    p = plan(seqs, max_tokens=260, world_size=1)
    check_plan(seqs, p, 260)
    assert p.packs_per_rank == 3  # 100 + 3 x 50 = 250 rows each, the last 100 + 2 x 50
    assert p.packed_rows == 500 + 2 * 100  # each further pack repeats the 100-token prompt


def test_cuts_go_between_trajectories_not_inside_one():
    # Two agent trajectories of one prompt: each step repeats the whole history, so cutting
    # inside a trajectory would repeat that history; cutting between them only the prompt.
    seqs = agent_batch(prompts=1, trajectories=2, steps=4, prompt_len=50, response_len=20,
                       tool_len=10)
    one_trajectory = treepack.forest_stats(seqs[:4]).packed_rows
    p = plan(seqs, max_tokens=one_trajectory, world_size=1)
    check_plan(seqs, p, one_trajectory)
    assert sorted(tuple(s.seq_ids.tolist()) for s in p.specs[0]) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert p.packed_rows == treepack.forest_stats(seqs).packed_rows + 50


def test_balances_a_mixed_workload_across_ranks():
    seqs = grpo_batch(groups=32, rollouts=8, prompt_len=256, response_len=128, jitter=0.5) + \
        agent_batch(prompts=16, trajectories=4, steps=4, prompt_len=256, response_len=64,
                    tool_len=48, jitter=0.5, seed=1)
    p = plan(seqs, max_tokens=8192, world_size=8)
    check_plan(seqs, p, 8192)
    assert p.efficiency == 1.0 and p.imbalance <= 1.1, str(p)


def test_ranks_with_fewer_packs_get_empty_ones():
    seqs = [[1, 2, 3, 4, 5, 6]] + [[7, 8]] * 1
    p = plan(seqs, max_tokens=8, world_size=3, pad_to_multiple_of=4)
    check_plan(seqs, p, 8)
    assert p.packs_per_rank == 1
    empties = [pk for rank in p.ranks for pk in rank if pk.num_sequences == 0]
    assert len(empties) == 1 and empties[0].num_rows == 4  # padded like every pack


def test_a_sequence_longer_than_the_budget_is_named():
    with pytest.raises(ValueError, match=r"sequence 1 has 9 tokens, more than max_tokens=8"):
        plan([[1, 2], list(range(9))], max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens"):
        plan([[1, 2]], max_tokens=0)
    with pytest.raises(ValueError, match="world_size"):
        plan([[1, 2]], max_tokens=4, world_size=0)
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        plan([[1, 2], []], max_tokens=4)


def test_packs_are_built_on_demand_per_rank():
    seqs = grpo_batch(groups=4, rollouts=2, prompt_len=20, response_len=10)
    p = plan(seqs, max_tokens=40, world_size=2, device="meta")
    assert p.built_ranks == []
    packs = p.packs(1)
    assert p.built_ranks == [1] and packs is p.packs(1)
    assert all(pk.input_ids.device.type == "meta" for pk in packs)
    assert len(p.ranks) == 2 and p.built_ranks == [0, 1]
    assert "2 ranks x" in str(p)


def test_seq_ids_map_outputs_back_to_the_batch():
    seqs = grpo_batch(groups=3, rollouts=3, prompt_len=12, response_len=6, jitter=0.5, vocab=50)
    p = plan(seqs, max_tokens=30, world_size=2)
    found = []
    for rank in p.ranks:
        for pack in rank:
            z = torch.randn(pack.num_rows, 50, dtype=torch.float64)
            lp = pack.token_logprobs(z)
            for k, i in enumerate(pack.seq_ids.tolist()):
                # Sequence i of the caller's batch: its own tokens are the targets, read from
                # the row of the token before each (a wrong seq_ids would pick other targets;
                # mutation check: with the planner's seq_ids taken modulo 3, this fails).
                s = torch.as_tensor(seqs[i])
                sources = pack.rows[k, : len(s) - 1]
                expect = z[sources].log_softmax(-1).gather(-1, s[1:, None])[:, 0]
                assert_within(lp[k, 1: len(s)], expect, FLOAT64_OP)  # float64 log-softmax
                assert (lp[k, len(s):] == 0).all() and lp[k, 0] == 0
                found.append(i)
    assert sorted(found) == list(range(len(seqs)))


def test_empty_pack_runs_through_attention_and_log_probs():
    pack = TreePack.empty(8)
    assert pack.num_rows == 8 and pack.num_sequences == 0 and pack.num_predictions == 0
    z = torch.randn(8, 5, requires_grad=True)
    pack.token_logprobs(z).sum().backward()
    assert torch.equal(z.grad, torch.zeros_like(z))


def test_padding_must_keep_packs_within_the_budget():
    with pytest.raises(ValueError, match="not a multiple of pad_to_multiple_of=128.*max_tokens=256"):
        plan([[1, 2]], max_tokens=300, pad_to_multiple_of=128)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        plan([[1, 2]], max_tokens=8, pad_to_multiple_of=0)


def test_plan_arguments_are_checked_by_name():
    seqs = [[1, 2, 3], [1, 2, 4]]
    p = plan(seqs, max_tokens=np.int64(8), world_size=np.int32(2))  # numpy integers welcome
    check_plan(seqs, p, 8)
    for rank in (-1, 2, True):
        with pytest.raises(ValueError, match=r"this plan has ranks 0 \.\. 1"):
            p.packs(rank)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="pair_cost=.* must be a finite number >= 0"):
            plan(seqs, max_tokens=8, pair_cost=bad)
    with pytest.raises(ValueError, match="max_tokens=True must be a positive int"):
        plan(seqs, max_tokens=True)


@pytest.mark.slow
def test_planning_65536_sequences_is_fast_at_any_budget():
    # The pack count used to grow one by one, re-running the whole greedy each time: 8,192
    # sequences took 16.6 s and 65,536 over 900 s under a tight budget on 8 ranks.
    import time

    seqs = grpo_batch(groups=6144, rollouts=8, prompt_len=64, response_len=32, jitter=0.5) + \
        agent_batch(prompts=1024, trajectories=4, steps=4, prompt_len=48, response_len=16,
                    tool_len=8, jitter=0.5, seed=3)
    for budget in (160, 16384):
        if budget == 160:
            seqs = [s[:160] for s in seqs]
        t = time.perf_counter()
        p = plan(seqs, max_tokens=budget, world_size=8)
        assert time.perf_counter() - t < 5.0  # 0.43-0.79 s on 2 CPU cores (BENCHMARKS.md)
        assert p.imbalance < 1.01 and len({len(r) for r in p.specs}) == 1


def test_split_tree_cuts_exactly_where_the_plain_rule_cuts():
    """The one-cumulative-sum split (linear) against the rule written plainly: a run takes
    sequences while its rows fit, then cuts before the last smallest LCP in its reach."""
    from treepack.planner import _split_tree

    def plain(a, b, s_len, new, lcp, budget):
        runs, i = [], a
        while i < b:
            k, rows = i + 1, s_len[i]
            while k < b and rows + new[k] <= budget:
                rows += new[k]
                k += 1
            if k >= b:
                runs.append((i, b))
                break
            window = list(lcp[i + 1:k + 1])
            cut = i + 1 + max(j for j, x in enumerate(window) if x == min(window))
            runs.append((i, cut))
            i = cut
        return runs

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 40))
        lcp = np.concatenate(([0], rng.integers(1, 6, n - 1)))
        s_len = lcp + rng.integers(1, 8, n)
        new = s_len - lcp
        budget = int(s_len.max() + rng.integers(0, 20))
        assert _split_tree(0, n, s_len, new, lcp, budget) == plain(0, n, s_len, new, lcp,
                                                                   budget)


def test_min_packs_cuts_where_the_least_prefix_is_shared():
    """Two GRPO groups fit one pack, rows interleaved as a trainer may order them; asked for
    two packs, the planner cuts between the groups (no prompt runs twice), and every row stays
    in exactly one pack. Asked for more packs than rows, each row gets its own."""
    prompt_a, prompt_b = [1] * 40, [2] * 40
    sequences = [(prompt_a if r % 2 else prompt_b) + [3 + r] * (5 + r) for r in range(8)]
    p = plan(sequences, max_tokens=1000, min_packs=2)
    assert sorted(tuple(s.seq_ids) for s in p.specs[0]) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    p = plan(sequences, max_tokens=1000, min_packs=5)
    ids = [s.seq_ids for s in p.specs[0] if len(s.seq_ids)]
    assert len(ids) == 5 and sorted(np.concatenate(ids).tolist()) == list(range(8))
    p = plan(sequences, max_tokens=1000, min_packs=20)
    assert sorted(len(s.seq_ids) for s in p.specs[0]) == [1] * 8
    assert plan([[1, 2]], max_tokens=10, min_packs=3).specs == [[PackSpec(np.array([0]), 2, 3,
                                                                         2 + PAIR_COST * 3)]]


@settings(max_examples=60, deadline=None)
@given(forests(), st.integers(1, 6), st.integers(1, 3))
def test_min_packs_keeps_every_sequence_once_and_counts_the_real_packs(sequences, count, world):
    budget = max(len(s) for s in sequences) + 3
    p = plan(sequences, max_tokens=budget, world_size=world, min_packs=count)
    seen = []
    for rank in range(world):
        real = [s for s in p.specs[rank] if len(s.seq_ids)]
        mine = sum(len(s.seq_ids) for s in real)
        assert len(real) >= min(count, mine)
        for spec, pack in zip(p.specs[rank], p.packs(rank)):
            assert spec.packed_rows == pack.num_packed_rows <= budget
            seen.extend(spec.seq_ids.tolist())
        assert len({len(r) for r in p.specs}) == 1  # every rank the same number of packs
    assert sorted(seen) == list(range(len(sequences)))
    with pytest.raises(ValueError, match="min_packs=0 must be a positive int"):
        plan(sequences, max_tokens=budget, min_packs=0)
