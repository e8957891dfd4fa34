"""Hypothesis strategies for prefix-sharing batches (tiny vocabularies force sharing)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st


@st.composite
def forests(draw, vocab: int = 3, max_sequences: int = 8, max_len: int = 12):
    """Random batches with forks, prefixes of other sequences, duplicates and several trees."""
    tok = st.integers(0, vocab - 1)
    base = draw(st.lists(st.lists(tok, min_size=1, max_size=max_len), min_size=1,
                         max_size=max_sequences))
    # Derived sequences: a prefix of one (possibly the whole: a duplicate), then a new tail.
    derived = draw(st.lists(
        st.tuples(st.integers(0, len(base) - 1), st.integers(0, max_len),
                  st.lists(tok, max_size=4)),
        max_size=max_sequences,
    ))
    seqs = list(base)
    for i, cut, tail in derived:
        seq = base[i][:cut] + tail
        if seq:
            seqs.append(seq)
    return draw(st.permutations(seqs))


def random_blocks(pack, seed: int) -> torch.Tensor:
    """Runs of rows within one segment (no fork and no sequence end inside, as an image's
    rows are), each a block; -1 elsewhere."""
    rng = np.random.default_rng(seed)
    h = pack.host
    rows = pack.num_packed_rows
    follows = np.zeros(pack.num_rows, dtype=bool)  # row r + 1 may join row r's block
    for a, b in zip(h.segment_start, h.segment_end):
        follows[a:b - 1] = True
    blocks = np.full(pack.num_rows, -1, dtype=np.int64)
    r = 0
    while r < rows:
        if rng.random() < 0.35:
            end = r
            while end + 1 < rows and follows[end] and end - r < rng.integers(1, 6):
                end += 1
            blocks[r:end + 1] = r
            r = end + 1
        r += 1
    return torch.from_numpy(blocks)
