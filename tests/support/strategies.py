"""Hypothesis strategies for prefix-sharing batches (tiny vocabularies force sharing)."""

from __future__ import annotations

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
