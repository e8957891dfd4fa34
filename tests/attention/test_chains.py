import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack import TreePack
from treepack.attention.chains import chains, varlen_index
from treepack.synthetic import agent_batch, grpo_batch

from reference import NaiveTrie
from strategies import forests


@settings(max_examples=150, deadline=None)
@given(forests(vocab=3, max_sequences=7, max_len=14), st.sampled_from([None, 1, 2, 5]),
       st.sampled_from([None, 4]))
def test_every_row_reads_exactly_its_visible_keys_in_depth_order(seqs, window, pad):
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=pad)
    c = chains(pack, window)
    T = pack.num_rows
    assert c.start[0] == 0 and np.all(np.diff(c.start) > 0)
    assert np.array_equal(np.append(c.start, T), np.cumsum(np.append(0, c.length)))
    visible = pack.dense_mask()
    if window is not None:
        pos = pack.position_ids
        visible &= pos[:, None] - pos[None, :] < window
    depth = pack.host.position_ids
    key_start = c.key_start
    for i, (a, n, ctx) in enumerate(zip(c.start, c.length, c.context)):
        keys = c.key_rows[key_start[i]: key_start[i + 1]]
        assert np.array_equal(keys[ctx:], np.arange(a, a + n))  # own rows, in order
        for t in range(n):  # query a + t sees keys u with u <= ctx + t, u > ctx + t - window
            lo = 0 if window is None else max(0, ctx + t - window + 1)
            seen = keys[lo: ctx + t + 1]
            expect = np.flatnonzero(visible[a + t].numpy())
            assert sorted(seen.tolist()) == expect.tolist()
            if a + t < pack.num_packed_rows:  # real rows: keys by increasing depth, ending at t
                assert np.array_equal(depth[seen], np.arange(depth[a + t] - len(seen) + 1,
                                                             depth[a + t] + 1))


@settings(max_examples=100, deadline=None)
@given(forests(vocab=3, max_sequences=7, max_len=14))
def test_chains_cut_only_at_forks_and_tree_ends(seqs):
    # Against a dict trie: a row starts a chain iff it is a root or not its parent's first
    # child in DFS order; a sequence ending mid-chain does not cut it.
    pack = TreePack.from_sequences(seqs)
    trie = NaiveTrie(seqs)
    c = chains(pack)
    node_of_row = {}
    for s, path in enumerate(trie.paths):
        for p, node in enumerate(path):
            node_of_row[int(pack.rows[s, p])] = node
    starts = set()
    for row in range(pack.num_packed_rows):
        node = node_of_row[row]
        par = trie.parent[node]
        first_child = row > 0 and node_of_row[row - 1] == par
        if not first_child:
            starts.add(row)
    assert set(c.start.tolist()) == starts
    # The keys read beyond the rows: each chain's depth, i.e. the depth of every later fork.
    assert int(c.context.sum()) == sum(int(pack.position_ids[r]) for r in starts)


def test_an_agent_trajectory_is_one_chain_and_gathers_nothing():
    # 40 steps that each extend the previous one: one chain, keys = rows, no gather.
    steps = agent_batch(prompts=1, trajectories=1, steps=40, prompt_len=200, response_len=150,
                        tool_len=100, seed=0)
    pack = TreePack.from_sequences(steps)
    c = chains(pack)
    assert len(c.start) == 1 and not c.gathers
    assert varlen_index(pack).key_rows is None


def test_forks_gather_their_depth_once_per_later_child():
    rng = np.random.default_rng(1)
    prompt_len = [50, 37, 64]
    seqs = [np.concatenate((np.full(p, g + 1), [100 + i], rng.integers(10, 99, size=i + 3)))
            for g, p in enumerate(prompt_len) for i in range(8)]  # responses differ at once
    pack = TreePack.from_sequences(seqs, pad_to_multiple_of=64)
    c = chains(pack)
    # 3 trees: the first rollout continues its prompt's chain, the other 7 read the prompt.
    assert int(c.context.sum()) == 7 * sum(prompt_len)
    padding = pack.num_rows - pack.num_packed_rows
    assert len(c.start) == 3 * 8 + padding
    index = varlen_index(pack, None)
    assert index.cu_seq_q.dtype == torch.int32 and index.cu_seq_k.dtype == torch.int32
    assert index.max_q == int(c.length.max()) and index.max_k == int(c.key_length.max())
    assert torch.equal(index.key_rows, torch.from_numpy(c.key_rows))


def test_windows_bound_the_context():
    seqs = [[1] * 30 + [2] * 5, [1] * 30 + [3] * 5]
    pack = TreePack.from_sequences(seqs)
    assert chains(pack).context.tolist() == [0, 30]
    assert chains(pack, window=4).context.tolist() == [0, 3]
    assert chains(pack, window=1).context.tolist() == [0, 0]


@pytest.mark.parametrize("pad", [None, 8])
def test_padding_free_packs_gather_nothing(pad):
    seqs = grpo_batch(groups=2, rollouts=4, prompt_len=9, response_len=5, jitter=0.5, seed=2)
    pack = TreePack.from_sequences(seqs, share_prefixes=False, pad_to_multiple_of=pad)
    c = chains(pack)
    assert c.length[: len(seqs)].tolist() == [len(s) for s in seqs] and not c.gathers
