"""treepack.sharing: where a step's sharing was lost. Every number checked against a dict trie
(no sort, no LCP), each cause on a hand-made step whose rows are counted by hand."""

import doctest
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treepack
import treepack.sharing
from treepack.planner import plan
from treepack.sharing import (CAUSES, Causes, metrics_from_counts, placement, report,
                              rows_from_trl, rows_from_verl)

from reference import NaiveTrie
from strategies import forests


def naive_rows(seqs, cells=None) -> int:
    """Distinct prefixes per cell, summed: a dict trie per cell."""
    cells = [0] * len(seqs) if cells is None else cells
    by_cell = {}
    for s, c in zip(seqs, cells):
        by_cell.setdefault(c, []).append(s)
    return sum(NaiveTrie(members).num_nodes for members in by_cell.values())


def naive_false_forks(seqs, groups, plen):
    """(ideal rows, {group: (depth, variants, rows)}) by the definition, one token at a time:
    the prompt a group's rollouts share is as long as its shortest (an agent loop's later
    turns hold their session's history); a diverging group's prompt rows at or below its
    divergence depth take the least such group's label; the ideal is the trie of the
    relabelled sequences."""
    members = {}
    for s, g in enumerate(groups):
        members.setdefault(g, []).append(s)
    shortest = {g: min(plen[s] for s in ss) for g, ss in members.items()}
    plen = [shortest[g] for g in groups]
    index = {g: k for k, g in enumerate(members)}  # groups numbered by first appearance
    depth = {}
    for g, ss in members.items():
        prompts = {tuple(seqs[s][:plen[s]]) for s in ss}
        if len(prompts) > 1:
            d = 0
            while all(len(p) > d for p in prompts) and len({p[d] for p in prompts}) == 1:
                d += 1
            depth[g] = d
    trie = NaiveTrie(seqs)
    label = {}
    for g, d in depth.items():
        for s in members[g]:
            for p in range(d, plen[s]):
                node = trie.paths[s][p]
                label[node] = min(label.get(node, index[g]), index[g])
    big = 1 + max(max(s) for s in seqs)
    relabelled = [[big + label[n] if n in label else t for n, t in zip(trie.paths[s], seq)]
                  for s, seq in enumerate(seqs)]
    ideal = NaiveTrie(relabelled)
    # each ideal node saves (actual nodes inside it) - 1, credited to its path's first label
    inside, credit = {}, {}
    for s, seq in enumerate(relabelled):
        first = next((p for p, t in enumerate(seq) if t >= big), None)
        for p, (a, b) in enumerate(zip(trie.paths[s], ideal.paths[s])):
            inside.setdefault(b, set()).add(a)
            if first is not None and p >= first:
                credit[b] = seq[first] - big
    rows = {g: 0 for g in depth}
    names = list(members)
    for b, actual in inside.items():
        if len(actual) > 1:
            rows[names[credit[b]]] += len(actual) - 1
    variants = {g: len({tuple(seqs[s][:plen[s]]) for s in members[g]}) for g in depth}
    return ideal.num_nodes, {g: (depth[g], variants[g], rows[g]) for g in depth}


@st.composite
def steps(draw):
    """A random step: a forest, group keys, prompt lengths and a placement (any may be
    missing). Groups are mostly the sequences' own first tokens plus noise, so prompts of one
    group often agree for a while and then fork."""
    seqs = draw(forests(vocab=3, max_sequences=10, max_len=10))
    n = len(seqs)
    label = st.lists(st.integers(0, 2), min_size=n, max_size=n)
    groups = draw(st.one_of(st.none(), label, st.lists(st.sampled_from("ab"), min_size=n,
                                                        max_size=n)))
    plen = draw(st.one_of(st.none(), st.tuples(*[st.integers(0, len(s)) for s in seqs])))
    cells = [draw(st.one_of(st.none(), label)) for _ in range(3)]
    return seqs, groups, None if plen is None else list(plen), cells


@settings(max_examples=300, deadline=None)
@given(steps())
def test_the_rows_add_up_and_every_number_equals_a_dict_trie(step):
    seqs, groups, plen, (ranks, micro, packs) = step
    r = report(seqs, groups=groups, prompt_lengths=plen, ranks=ranks, micro_batches=micro,
               packs=packs)
    assert r.achieved_rows == r.ideal_rows + sum(r.lost)  # the decomposition, exactly
    assert all(rows >= 0 for rows in r.lost)
    assert r.original_tokens == sum(map(len, seqs)) and r.num_sequences == len(seqs)
    assert r.achievable_rows == naive_rows(seqs)
    # each level: forests per (rank), (rank, micro-batch), (rank, micro-batch, pack)
    n = len(seqs)
    key, levels = [()] * n, [r.achievable_rows]
    for labels in (ranks, micro, packs):
        if labels is not None:
            key = [k + (x,) for k, x in zip(key, labels)]
        levels.append(naive_rows(seqs, key))
    assert list(r.lost[1:4]) == [b - a for a, b in zip(levels, levels[1:])]
    assert r.lost.differing_routes == 0  # no routes given
    assert r.achieved_rows == levels[-1]
    if groups is not None and plen is not None:
        ideal, forks = naive_false_forks(seqs, groups, plen)
        assert r.ideal_rows == ideal
        assert {f.group: (f.depth, f.variants, f.rows) for f in r.false_forks} == forks
        assert sum(f.rows for f in r.false_forks) == r.lost.false_forks
        for f in r.false_forks:
            ss = [s for s, g in enumerate(groups) if g == f.group]
            assert f.sequences == len(ss)
            assert (f.shortest_prompt, f.prompt_length) == (min(plen[s] for s in ss),
                                                             max(plen[s] for s in ss))
            # the two tokens are those of two of the group's prompts at the divergence,
            # inside its shortest prompt
            assert f.depth < f.shortest_prompt
            at = {seqs[s][f.depth] for s in ss}
            assert f.tokens[0] != f.tokens[1] and set(f.tokens) <= at
    else:
        assert r.ideal_rows == r.achievable_rows and r.false_forks == ()
    assert r.measured == Causes(groups is not None and plen is not None, ranks is not None,
                                micro is not None, packs is not None)
    check_groups_hit(r, seqs, groups, plen, (ranks, micro, packs))


@settings(max_examples=150, deadline=None)
@given(steps(), st.data())
def test_with_content_keys_every_number_counts_id_key_pairs(step, data):
    """Keys (an image placeholder's image): the report over (id, key) pairs is the report
    over one integer per pair, computed here without treepack, and its achievable rows those
    of the pack built with the same keys; false forks still name token ids."""
    seqs, groups, plen, (ranks, micro, packs) = step
    keys = [data.draw(st.lists(st.integers(0, 2), min_size=len(q), max_size=len(q)))
            for q in seqs]
    r = report(seqs, groups=groups, prompt_lengths=plen, ranks=ranks, micro_batches=micro,
               packs=packs, keys=keys)
    pairs = [[int(t) * 3 + k for t, k in zip(q, ks)] for q, ks in zip(seqs, keys)]
    by_pairs = report(pairs, groups=groups, prompt_lengths=plen, ranks=ranks,
                      micro_batches=micro, packs=packs)
    assert (r.ideal_rows, r.achievable_rows, r.achieved_rows, r.lost, r.groups_hit) == (
        by_pairs.ideal_rows, by_pairs.achievable_rows, by_pairs.achieved_rows, by_pairs.lost,
        by_pairs.groups_hit)
    assert r.achievable_rows == naive_rows([list(zip(q, ks)) for q, ks in zip(seqs, keys)])
    assert r.achievable_rows == treepack.TreePack.from_sequences(seqs, keys=keys).num_packed_rows
    for f, g in zip(r.false_forks, by_pairs.false_forks):
        assert (f.group, f.depth, f.rows) == (g.group, g.depth, g.rows)
        assert f.tokens == tuple(t // 3 for t in g.tokens)


def test_the_same_text_on_different_images_is_counted_as_the_packs_compute_it():
    """Three GRPO groups, the same text on three images (placeholder id 9, keyed by image):
    over ids alone the report saw one forest of 19 rows; the packs compute 34."""
    prompt = [1, 2, 9, 9, 9, 9, 3]
    completions = [[4, 5], [4, 6], [7, 8, 8]]
    seqs, keys, groups = [], [], []
    for image in (11, 12, 13):
        for c in completions:
            seqs.append(prompt + c)
            keys.append([image if t == 9 else 0 for t in prompt] + [0] * len(c))
            groups.append(f"g{image}")
    plen = [len(prompt)] * len(seqs)
    assert report(seqs, groups=groups, prompt_lengths=plen).achievable_rows == 7 + 2 + 1 + 3
    r = report(seqs, groups=groups, prompt_lengths=plen, keys=keys)
    built = plan(seqs, max_tokens=64, keys=keys).packs(0)
    assert r.achievable_rows == sum(p.num_packed_rows for p in built) == 2 + 3 * (5 + 6)
    assert r.false_forks == ()  # each group's prompt is one image's: no fork
    with pytest.raises(ValueError, match="keys has 8 sequences for 9"):
        report(seqs, keys=keys[:-1])


def test_group_keys_of_different_types_are_different_groups():
    """1 and "1" were merged (np.asarray turned the list into strings): one group whose
    prompts fork. As Python compares them, they are two groups, each agreeing."""
    seqs = [[1, 2, 3], [1, 2, 4], [1, 5, 3], [1, 5, 4]]
    r = report(seqs, groups=[1, 1, "1", "1"], prompt_lengths=[2] * 4)
    assert r.groups == 2 and r.false_forks == () and r.lost.false_forks == 0
    assert r.ideal_rows == r.achievable_rows == 7
    merged = report(seqs, groups=["1"] * 4, prompt_lengths=[2] * 4)
    assert merged.groups == 1 and merged.lost.false_forks == 3  # 2 and 5 made one row


def naive_session_forks(seqs, sessions, plen):
    """{session: (turn, depth, breaks, rows)} by the definition, a token at a time: each turn
    should repeat the previous turn (as it would have been, fixed) up to its own prompt; a
    turn that does not is rewritten to; rows are the session's trie before and after."""
    out = {}
    for name in dict.fromkeys(sessions):
        turns = [s for s, k in enumerate(sessions) if k == name]
        fixed, found = [list(seqs[turns[0]])], []
        for t in range(1, len(turns)):
            prev, cur = fixed[-1], list(seqs[turns[t]])
            end = min(len(prev), len(cur) if plen is None else plen[turns[t]])
            depth = next((p for p in range(end) if prev[p] != cur[p]), None)
            if depth is not None:
                found.append((t, depth))
                cur = prev[:end] + cur[end:]
            fixed.append(cur)
        if found:
            rows = NaiveTrie([seqs[s] for s in turns]).num_nodes - NaiveTrie(fixed).num_nodes
            out[name] = (found[0][0], found[0][1], len(found), rows)
    return out


@settings(max_examples=200, deadline=None)
@given(steps(), st.data())
def test_sessions_whose_turns_do_not_extend_the_last_match_the_definition(step, data):
    seqs, _, plen, _ = step
    sessions = data.draw(st.lists(st.sampled_from(["s", "t", 0]), min_size=len(seqs),
                                  max_size=len(seqs)))
    r = report(seqs, prompt_lengths=plen, sessions=sessions)
    assert r.sessions == len(set(map(repr, sessions)))
    got = {f.session: (f.turn, f.depth, f.breaks, f.rows) for f in r.session_forks}
    assert got == naive_session_forks(seqs, sessions, plen)
    assert report(seqs, prompt_lengths=plen).session_forks == ()


def check_groups_hit(r, seqs, groups, plen, placement):
    """Groups per cause: each level's cut splits a group if the group lies in more of its
    cells than of the level above's (sets, no numpy)."""
    if groups is None and plen is None:
        assert r.groups is None and r.groups_hit == Causes(0, 0, 0, 0)
        return
    if groups is None:  # groups by identical prompt
        groups = [tuple(s[:p]) for s, p in zip(seqs, plen)]
    assert r.groups == len(set(groups))

    def cells(key):
        return {g: len({c for c, h in zip(key, groups) if h == g}) for g in groups}

    key, hit = [()] * len(seqs), [len(r.false_forks)]
    for labels in placement:
        finer = key if labels is None else [k + (x,) for k, x in zip(key, labels)]
        coarse, fine = cells(key), cells(finer)
        hit.append(sum(fine[g] > coarse[g] for g in fine))
        key = finer
    assert r.groups_hit == Causes(*hit)


# One GRPO group: a 10-token prompt and four 5-token completions with distinct first tokens.
PROMPT = list(range(100, 110))
GROUP = [PROMPT + [t] * 5 for t in (1, 2, 3, 4)]  # one tree of 10 + 4 x 5 = 30 rows


def test_a_group_split_across_ranks_computes_its_prompt_on_each():
    r = report(GROUP, groups=[7] * 4, prompt_lengths=[10] * 4, ranks=[0, 0, 1, 1])
    assert (r.ideal_rows, r.achievable_rows, r.achieved_rows) == (30, 30, 40)
    assert r.lost == Causes(0, 10, 0, 0) and r.groups_hit == Causes(0, 1, 0, 0)
    assert r.shares == Causes(0.0, 1.0, 0.0, 0.0)
    assert r.achieved_ratio == 40 / 60 and r.achievable_ratio == 30 / 60


def test_a_group_split_across_micro_batches_computes_its_prompt_in_each():
    r = report(GROUP, groups=[7] * 4, ranks=[0] * 4, micro_batches=[0, 1, 2, 0])
    assert r.achieved_rows == 30 + 2 * 10
    assert r.lost == Causes(0, 0, 20, 0) and r.groups_hit == Causes(0, 0, 1, 0)
    assert r.measured == Causes(False, True, True, False)  # no prompt lengths: forks unseen


def test_a_tree_over_the_budget_repeats_its_prefix_in_each_pack_the_plan_cuts():
    p = plan(GROUP, max_tokens=20)  # 15 + 5 rows per pack: two packs of two rollouts
    where = placement(p)
    assert where.packs.tolist() in ([0, 0, 1, 1], [1, 1, 0, 0])
    r = report(GROUP, ranks=where.ranks, packs=where.packs)
    assert r.lost == Causes(0, 0, 0, 10) == Causes(0, 0, 0, p.packed_rows - p.min_rows)
    assert r.achieved_rows == p.packed_rows == 40


def test_a_plan_over_ranks_reads_back_as_its_own_rows():
    seqs = [PROMPT + [t] * 5 for t in range(8)] + [[1, 2, 3]] * 3
    p = plan(seqs, max_tokens=25, world_size=2)
    r = report(seqs, **placement(p)._asdict())
    assert r.achieved_rows == p.packed_rows and r.achievable_rows == p.min_rows


def test_a_re_rendered_prompt_is_a_false_fork_with_its_depth_and_tokens():
    # Two rollouts of uid "q1" had their 8-token prompt re-rendered from token 5 on (one
    # token longer); the other two kept it. Completions: 3 tokens, all different.
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    rerendered = [1, 2, 3, 4, 5, 60, 70, 80, 90]
    seqs = [prompt + [20, 21, 22], prompt + [30, 31, 32], rerendered + [40, 41, 42],
            rerendered + [50, 51, 52]]
    r = report(seqs, groups=["q1"] * 4, prompt_lengths=[8, 8, 9, 9])
    # one forest: 5 shared + 3 + 4 prompt rows + 4 x 3 completion rows = 24
    # ideal: the rows at depth 5..8 merged into one path of 4: 5 + 4 + 12 = 21
    assert (r.achievable_rows, r.ideal_rows) == (24, 21)
    (f,) = r.false_forks
    assert f == treepack.sharing.FalseFork("q1", 4, 2, 5, 9, 8, (6, 60), 3)
    assert "re-rendered or re-tokenized" in f.hint
    assert r.lost.false_forks == 3 and r.groups_hit.false_forks == 1


def test_hints_name_the_likely_cause():
    def fork(prompts):
        seqs = [p + [99, k] for k, p in enumerate(prompts)]
        (f,) = report(seqs, groups=[0] * len(seqs),
                      prompt_lengths=[len(p) for p in prompts]).false_forks
        return f

    # a prompt that goes on where another ends is no fork: an agent loop's later turns
    # extend the first turn's prompt with the session's history
    seqs = [[1, 2, 3, 99, 0], [1, 2, 3, 4, 99, 1]]
    assert report(seqs, groups=[0, 0], prompt_lengths=[3, 4]).false_forks == ()
    first = fork([[5, 2, 3], [1, 2, 3]])
    assert first.depth == 0 and "first token" in first.hint
    inside = fork([[1, 2, 3], [1, 7, 3]])
    assert inside.depth == 1 and "one length" in inside.hint


def test_identical_prompts_and_groups_without_prompt_lengths_show_no_fork():
    seqs = [PROMPT + [t] for t in range(4)]
    r = report(seqs, groups=[0] * 4, prompt_lengths=[10] * 4)
    assert r.false_forks == () and r.ideal_rows == r.achievable_rows == 14
    assert r.measured.false_forks and not report(seqs, groups=[0] * 4).measured.false_forks


def test_inputs_may_be_tensors_and_arrays():
    seqs = [torch.tensor(s) for s in GROUP]
    a = report(seqs, groups=torch.tensor([3, 3, 3, 3]), prompt_lengths=torch.full((4,), 10),
               ranks=np.array([0, 0, 1, 1]))
    b = report(GROUP, groups=[3] * 4, prompt_lengths=[10] * 4, ranks=[0, 0, 1, 1])
    assert a == b


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(groups=["a", "b"]), ValueError, ["groups has 2 values for 4 sequences", "uid"]),
    (dict(groups=[[1], [2], [3], [4]]), ValueError, ["groups has shape (4, 1)"]),
    (dict(groups=[1.5, 2, 3, 4]), TypeError, ["groups[0] is 1.5", "uid"]),
    (dict(prompt_lengths=[10, 10, 10]), ValueError, ["prompt_lengths", "one integer"]),
    (dict(prompt_lengths=[10, 10, 16, 10]), ValueError, ["prompt_lengths[2] = 16",
                                                         "outside 0 .. 15"]),
    (dict(ranks=[0, 1]), ValueError, ["ranks has 2 values for 4 sequences"]),
    (dict(micro_batches=[0, None, 1, 1]), TypeError, ["micro_batches[1] is None"]),
])
def test_bad_inputs_name_the_value_the_rule_and_the_fix(kwargs, error, words):
    with pytest.raises(error) as e:
        report(GROUP, **kwargs)
    for w in words:
        assert w in str(e.value)


def test_empty_sequences_are_refused_as_the_pack_refuses_them():
    with pytest.raises(ValueError, match="sequences is empty"):
        report([])
    with pytest.raises(ValueError, match="sequence 1"):
        report([[1], []])


def test_trl_columns_round_trip_through_rows():
    # TRL: left-padded prompts, right-padded completions, 0 = padding
    prompt_ids = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [9, 1, 2, 4]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    completion_ids = torch.tensor([[5, 6, 0], [5, 7, 8], [5, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    rows = rows_from_trl(prompt_ids, prompt_mask, completion_ids, completion_mask,
                         groups=[0, 0, 1], rank=1, micro_batch=torch.tensor([0, 1, 1]))
    assert rows == [
        {"prompt_ids": [1, 2, 3], "completion_ids": [5, 6], "group": 0, "rank": 1,
         "micro_batch": 0},
        {"prompt_ids": [1, 2, 3], "completion_ids": [5, 7, 8], "group": 0, "rank": 1,
         "micro_batch": 1},
        {"prompt_ids": [9, 1, 2, 4], "completion_ids": [5], "group": 1, "rank": 1,
         "micro_batch": 1},
    ]
    assert [json.loads(json.dumps(r)) for r in rows] == rows  # plain JSON values
    # the sequences are the ones the TRL seam packs: ids[attention_mask]
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask,
                                                                     completion_mask], 1)
    assert [r["prompt_ids"] + r["completion_ids"] for r in rows] == \
        [i[m.bool()].tolist() for i, m in zip(ids, mask)]
    with pytest.raises(ValueError, match="micro_batch has shape"):
        rows_from_trl(prompt_ids, prompt_mask, completion_ids, completion_mask,
                      micro_batch=[0, 1])


def test_verl_batches_round_trip_through_rows():
    uid = np.array(["u0", "u0", "u1"], dtype=object)
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5]]
    responses = [[6, 7], [6], [8, 9, 10]]
    P, R = 3, 3  # verl: prompts left-padded to P, responses right-padded to R
    input_ids = torch.zeros(3, P + R, dtype=torch.long)
    mask = torch.zeros(3, P + R, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, responses)):
        input_ids[b, P - len(p):P + len(c)] = torch.tensor(p + c)
        mask[b, P - len(p):P + len(c)] = 1
    rows = rows_from_verl(input_ids, uid, attention_mask=mask, prompt_width=P, rank=0)
    assert rows == [{"prompt": p, "completion": c, "uid": u, "rank": 0}
                    for p, c, u in zip(prompts, responses, uid.tolist())]
    nested = torch.nested.nested_tensor([torch.tensor(p + c) for p, c in zip(prompts,
                                                                               responses)],
                                        layout=torch.jagged)
    assert rows_from_verl(nested, uid, prompt_lengths=[3, 3, 2], rank=0) == rows
    assert rows_from_verl([p + c for p, c in zip(prompts, responses)], uid)[2] == \
        {"input_ids": [4, 5, 8, 9, 10], "uid": "u1"}
    with pytest.raises(ValueError, match="attention_mask"):
        rows_from_verl(input_ids, uid)
    with pytest.raises(ValueError, match="give prompt_lengths"):
        rows_from_verl(nested, uid, prompt_width=3)
    with pytest.raises(ValueError, match="uid has shape"):
        rows_from_verl(nested, uid[:2])
    # per-token keys and sessions travel with the rows
    keys = [[0, 5, 0, 0, 0], [0, 5, 0, 0], [0, 0, 0, 0, 0]]
    with_keys = rows_from_verl(nested, uid, prompt_lengths=[3, 3, 2], keys=keys,
                               session=["a", "a", "b"])
    assert [r["keys"] for r in with_keys] == keys and with_keys[1]["session"] == "a"
    with pytest.raises(ValueError, match="one key per real token"):
        rows_from_verl(nested, uid, prompt_lengths=[3, 3, 2], keys=keys[:2])


def test_metrics_and_dict_carry_the_same_numbers():
    r = report(GROUP, groups=[7] * 4, prompt_lengths=[10] * 4, ranks=[0, 0, 1, 1])
    m = r.metrics()
    assert m["treepack/achieved_ratio"] == r.achieved_ratio
    # micro-batches and packs were not given: not measured, not logged
    assert [m.get(f"treepack/lost_rows/{c}") for c in CAUSES] == [*r.lost[:2], None, None,
                                                                  None]
    # counts add up over processes: two processes' reports summed give the step's metrics
    other = report(GROUP[:2], groups=[7] * 2, prompt_lengths=[10] * 2, ranks=[0, 1])
    summed = [a + b for a, b in zip(r.counts(), other.counts())]
    both = metrics_from_counts(summed, r.measured)
    assert both["treepack/achieved_ratio"] == (r.achieved_rows + other.achieved_rows) / (
        r.original_tokens + other.original_tokens)
    assert both["treepack/lost_rows/across_ranks"] == r.lost.across_ranks + other.lost.across_ranks
    d = json.loads(json.dumps(r.as_dict()))
    assert d["lost"]["across_ranks"] == {"rows": 10, "share": 1.0, "measured": True,
                                         "groups": 1}
    assert d["achieved_rows"] - d["ideal_rows"] == sum(v["rows"] for v in d["lost"].values())


def test_the_short_path_is_the_module_and_its_doctest_runs():
    import treepack.planning.sharing as module

    assert treepack.sharing is module
    assert doctest.testmod(module, raise_on_error=True).attempted > 0


def test_public_functions_document_args_returns_raises_and_example():
    """tests/test_docs.py's rule (Args: where there are parameters, Returns: always here),
    for this module's entry points."""
    import inspect

    for fn in (report, placement, rows_from_trl, rows_from_verl,
               treepack.sharing.SharingReport.as_dict, treepack.sharing.SharingReport.metrics):
        doc = inspect.getdoc(fn)
        takes = [p for p in inspect.signature(fn).parameters if p != "self"]
        assert ("Args:" in doc or not takes) and "Returns:" in doc, fn.__qualname__
    assert all(s in inspect.getdoc(report) for s in ("Raises:", "Example:"))


@settings(max_examples=150, deadline=None)
@given(steps(), st.data())
def test_routes_that_differ_are_their_own_cause(step, data):
    """MoE routes (routing replay): the one forest with routes is TreePack's with routes,
    the rows it adds over the forest on ids alone are ``differing_routes``, the ideal and the
    false forks stay on ids, and the decomposition still adds up exactly."""
    seqs, groups, plen, (ranks, micro, packs) = step
    routes = [np.array([[[data.draw(st.integers(0, 1), label="route")]] for _ in s])
              for s in seqs]
    r = report(seqs, groups=groups, prompt_lengths=plen, ranks=ranks, micro_batches=micro,
               packs=packs, routes=routes)
    plain = report(seqs, groups=groups, prompt_lengths=plen)
    assert r.achieved_rows == r.ideal_rows + sum(r.lost)
    assert all(rows >= 0 for rows in r.lost)
    assert r.achievable_rows == treepack.TreePack.from_sequences(
        seqs, routes=routes).num_packed_rows
    assert r.lost.differing_routes == r.achievable_rows - plain.achievable_rows
    assert (r.ideal_rows, r.lost.false_forks) == (plain.ideal_rows, plain.lost.false_forks)
    assert r.measured.differing_routes and not plain.measured.differing_routes
    metrics = r.metrics()
    assert metrics["treepack/lost_rows/differing_routes"] == r.lost.differing_routes
    assert "treepack/lost_rows/differing_routes" not in plain.metrics()
    if groups is not None:  # a group is hit where its own forest grows with routes, each
        hit = 0  # last token resolved as the whole step resolves it (a group's own pack may
        for g in set(groups):  # let a last token join a row the step gave another route)
            mine = [i for i, x in enumerate(groups) if x == g]
            hit += report([seqs[i] for i in mine], routes=[routes[i] for i in mine]) \
                .lost.differing_routes > 0
        assert r.groups_hit.differing_routes >= hit
