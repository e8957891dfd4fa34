"""The framework-free forwards: every implementation speaks the one TreeForward protocol, and a
tree's parts, each attending over what the parts above it carry, give the whole pack's
attention and convolutions (no model, no framework: the dense reference over every row)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import forests
from treepack import TreePack
from treepack.forwards import Carried, PackForward, PartForward, TreeForward, Walk
from tolerance import FLOAT64_OP, assert_within
from treepack.planning.parts import split

# float64 against float64, no float32 step: each side is one softmax-weighted sum (or one
# convolution) over the same few dozen keys in another order, one operation done two ways
# (FLOAT64_OP of the values' size), far below the error of reading a wrong key (~1e-1).


def parts_and_whole(seqs, budget: int, window=None, broken=None):
    """Each part's attention and convolution over its rows, placed back in the pack's row
    order, and the whole pack's, for random queries, keys, values and inputs."""
    pack = TreePack.from_sequences(seqs)
    parts = split(pack, budget)
    g = torch.Generator().manual_seed(0)
    heads, d, channels, taps = 2, 4, 3, 3
    q, k, v = (torch.randn(1, heads, pack.num_rows, d, generator=g, dtype=torch.float64)
               for _ in range(3))
    x = torch.randn(pack.num_rows, channels, generator=g, dtype=torch.float64)
    weight = torch.randn(channels, taps, generator=g, dtype=torch.float64)
    layer = object()  # names the attention layer whose keys the parts carry
    whole = PackForward(pack, "dense")
    want_att = whole.attend(layer, q, k, v, scale=0.5, window=window)
    want_conv = whole.conv(x, weight, None)

    carried = Carried(parts, train=False, refuse_no_grad=RuntimeError)
    if broken == "no context":  # every part reads zeros for the keys above it
        gather = carried.gather
        carried.gather = lambda key, grouped, dim: (
            None if not grouped else [torch.zeros_like(t) for t in gather(key, grouped, dim)])
    got_att = torch.zeros_like(want_att)
    got_conv = torch.zeros_like(want_conv)

    def enter(i):
        rows = torch.from_numpy(parts.parts[i].rows)
        mixers = PartForward(carried, i)
        got_att[:, :, rows] = mixers.attend(layer, q[:, :, rows], k[:, :, rows], v[:, :, rows],
                                            scale=0.5, window=window)
        got_conv[rows] = mixers.conv(x[rows], weight, None)

    Walk(parts, train=False, recompute=False).run(enter, carried.release)
    return (got_att, want_att), (got_conv, want_conv), len(parts.parts)


def test_every_forward_speaks_the_protocol():
    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]])
    carried = Carried(split(pack, 2), train=False, refuse_no_grad=RuntimeError)
    for forward in (PackForward(pack, "segment"), PartForward(carried, 0)):
        assert isinstance(forward, TreeForward)


@settings(max_examples=25, deadline=None)
@given(seqs=forests(vocab=3, max_sequences=6, max_len=10), budget=st.integers(1, 12),
       window=st.sampled_from([None, 2, 4]))
def test_parts_attend_and_convolve_as_the_whole_pack(seqs, budget, window):
    (att, want_att), (conv, want_conv), _ = parts_and_whole(seqs, budget, window)
    assert_within(att, want_att, FLOAT64_OP)
    assert_within(conv, want_conv, FLOAT64_OP)


def test_parts_without_their_context_are_caught():
    """A negative control: parts that read zeros for their ancestors' keys and inputs."""
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 9, 9, 9]]
    (att, want_att), (conv, want_conv), count = parts_and_whole(seqs, 3, broken="no context")
    assert count > 1
    assert (att - want_att).abs().max() > 1e-3
    assert (conv - want_conv).abs().max() > 1e-3


def test_a_part_refuses_what_it_cannot_run_with_the_adapters_error():
    class Refused(ValueError):
        pass

    pack = TreePack.from_sequences([[1, 2, 3], [1, 2, 4]])
    part = PartForward(Carried(split(pack, 2), train=False, refuse_no_grad=RuntimeError), 0,
                       Refused)
    with pytest.raises(Refused, match="in parts"):
        part.dense_mask()
    with pytest.raises(Refused, match="Gemma 3"):
        part.set_blocks(torch.zeros(pack.num_rows, dtype=torch.long))
