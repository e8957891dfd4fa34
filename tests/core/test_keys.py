"""Content keys: a token is its (id, key) pair, against a naive trie over those pairs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack import TreePack

from reference import NaiveTrie
from strategies import forests

IMAGE = 9  # an image placeholder id, the same for every image


def test_the_same_text_with_different_images_never_merges():
    prompt = [1, 2, IMAGE, IMAGE, IMAGE, 3, 4]
    a = [0, 0, 11, 11, 11, 0, 0]  # image 11 in the first prompt, image 12 in the second
    b = [0, 0, 12, 12, 12, 0, 0]
    pack = TreePack.from_sequences([prompt + [5], prompt + [6]], keys=[a + [0], b + [0]])
    assert pack.num_packed_rows == 2 + 2 * 6  # only the text before the images is shared
    assert pack.host.row_keys[:pack.num_packed_rows].tolist() == \
        [0, 0, 11, 11, 11, 0, 0, 0, 12, 12, 12, 0, 0, 0]
    unkeyed = TreePack.from_sequences([prompt + [5], prompt + [6]])
    assert unkeyed.num_packed_rows == 7 + 2 and unkeyed.host.row_keys is None


def test_the_same_image_in_two_prompts_merges():
    prompt, key = [1, IMAGE, IMAGE, 3], [0, 7, 7, 0]
    pack = TreePack.from_sequences([prompt + [5, 6], prompt + [8]],
                                   keys=[key + [0, 0], key + [0]])
    assert pack.num_packed_rows == 4 + 3
    assert pack.input_ids.tolist() == [1, IMAGE, IMAGE, 3, 5, 6, 8]


@st.composite
def keyed_forests(draw):
    """Forests with keys from a small alphabet on some tokens, so that equal ids with equal
    and with different keys both occur, at every depth."""
    seqs = draw(forests(vocab=3, max_sequences=6, max_len=8))
    keys = [draw(st.lists(st.sampled_from([0, 0, 5, -6]), min_size=len(s), max_size=len(s)))
            for s in seqs]
    return seqs, keys


@given(keyed_forests())
@settings(max_examples=150, deadline=None)
def test_rows_are_the_distinct_prefixes_of_id_key_pairs(forest):
    seqs, keys = forest
    pack = TreePack.from_sequences(seqs, keys=keys, layout="flat")
    pairs = [list(zip(s, k)) for s, k in zip(seqs, keys)]
    trie = NaiveTrie(pairs)
    assert pack.num_packed_rows == trie.num_nodes
    node_of_row = {}
    h = pack.host
    for s, (seq, key) in enumerate(zip(seqs, keys)):
        rows = h.rows[h.offsets[s]:h.offsets[s + 1]]
        assert h.input_ids[rows].tolist() == list(seq)
        assert h.row_keys[rows].tolist() == list(key)
        assert h.position_ids[rows].tolist() == list(range(len(seq)))
        for row, node in zip(rows.tolist(), trie.paths[s]):
            assert node_of_row.setdefault(row, node) == node  # one row <=> one prefix
        parents = h.parent_row[rows].tolist()
        assert parents == [-1] + rows[:-1].tolist()
    assert len(set(node_of_row.values())) == pack.num_packed_rows


def test_zero_keys_change_nothing():
    seqs = [[1, 2, 3], [1, 2, 4], [1, 5]]
    keyed = TreePack.from_sequences(seqs, keys=[np.zeros(len(s), dtype=np.int64) for s in seqs])
    plain = TreePack.from_sequences(seqs)
    assert keyed.input_ids.tolist() == plain.input_ids.tolist()
    assert keyed.parent_row.tolist() == plain.parent_row.tolist()


@pytest.mark.parametrize("keys,error,match", [
    ([[0, 0]], ValueError, "1 sequences for 2"),
    ([[0, 0], [0]], ValueError, r"keys\[1\] has shape \(1,\) but sequence 1 has 2 tokens"),
    ([[0, 0], [0.5, 0]], TypeError, r"keys\[1\] has dtype float64"),
    (np.zeros((2, 2), dtype=np.int64), TypeError, "one key sequence per sequence"),
])
def test_bad_keys_are_refused_by_name(keys, error, match):
    with pytest.raises(error, match=match):
        TreePack.from_sequences([[1, 2], [1, 3]], keys=keys)


def test_a_plan_shares_and_builds_over_keys():
    """plan(keys=) plans sharing over (id, key) pairs and builds every pack keyed: its packs
    hold the rows of the naive trie over their sequences' pairs."""
    from treepack import plan

    prompt = [1, 2, IMAGE, IMAGE, 3]
    seqs = [prompt + [t] for t in (4, 5, 6, 7)]
    keys = [[0, 0, k, k, 0, 0] for k in (11, 11, 12, 12)]
    planned = plan(seqs, max_tokens=12, keys=keys)
    unkeyed = plan(seqs, max_tokens=12)
    assert planned.min_rows == NaiveTrie([list(zip(s, k)) for s, k in zip(seqs, keys)]).num_nodes
    assert unkeyed.min_rows == 5 + 4 < planned.min_rows
    for pack in planned.packs(0):
        ids = pack.seq_ids.tolist()
        trie = NaiveTrie([list(zip(seqs[i], keys[i])) for i in ids])
        assert pack.num_packed_rows == trie.num_nodes
        assert pack.host.row_keys is not None


def test_collate_plans_and_packs_over_keys():
    """collate(keys=): every batch's pack is keyed, with the naive keyed trie's rows."""
    from treepack import collate

    prompt = [1, 2, IMAGE, IMAGE, 3]
    rollouts = [{"prompt": prompt, "completion": [t, 5]} for t in (4, 6, 7, 8)]
    keys = [[0, 0, k, k, 0, 0, 0] for k in (11, 11, 12, 12)]
    step = collate(rollouts, max_tokens=12, keys=keys)
    seqs = [r["prompt"] + r["completion"] for r in rollouts]
    for batch in step.batches(0):
        ids = batch.pack.seq_ids.tolist()
        assert batch.pack.num_packed_rows == NaiveTrie(
            [list(zip(seqs[i], keys[i])) for i in ids]).num_nodes
    whole = collate(rollouts, max_tokens=4, parts=True, keys=keys).batches(0)
    assert [b.pack.num_packed_rows for b in whole] == [NaiveTrie(
        [list(zip(s, k)) for s, k in zip(seqs, keys)]).num_nodes]
