import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treepack
from treepack.forest import previous_smaller

from strategies import forests


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=70), st.booleans())
def test_previous_smaller_brute_force(values, strict):
    a = np.array(values, dtype=np.int64)
    expect = [
        max((j for j in range(k) if (a[j] < a[k] if strict else a[j] <= a[k])), default=-1)
        for k in range(len(a))
    ]
    assert previous_smaller(a, strict=strict).tolist() == expect


@settings(max_examples=100, deadline=None)
@given(forests())
def test_forest_stats_equal_the_built_pack(seqs):
    stats = treepack.forest_stats(seqs)
    pack = treepack.TreePack.from_sequences(seqs)
    assert stats.num_sequences == len(seqs)
    assert stats.original_tokens == pack.num_original_tokens == sum(map(len, seqs))
    assert stats.packed_rows == pack.num_packed_rows
    assert stats.token_ratio == pack.token_ratio
    assert stats.trees == len({s[0] for s in seqs}) == int((pack.segments.parent == -1).sum())
    # visible pairs: the dense mask's count packed, causal triangles unpacked
    assert stats.packed_attention_pairs == int(pack.dense_mask().sum())
    assert stats.unpacked_attention_pairs == sum(n * (n + 1) // 2 for n in map(len, seqs))


def test_forest_stats_validates_input():
    import pytest

    with pytest.raises(ValueError, match="sequence 1 is empty"):
        treepack.forest_stats([[1], torch.tensor([], dtype=torch.long)])
