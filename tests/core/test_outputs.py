"""treepack.core.outputs: a pack's log-probs in the label- and prediction-aligned layouts,
against references that read each sequence's rows one at a time."""

import pytest
import torch

from treepack import TreePack
from treepack.core.outputs import from_logits, per_sequence_temperature, take_columns

from tolerance import FLOAT64_OP, assert_within


def sequences_and_logits(seed=0, n=7, vocab=11, layout="flat", pad=None):
    g = torch.Generator().manual_seed(seed)
    stem = torch.randint(0, vocab, (5,), generator=g).tolist()
    seqs = [stem[:int(torch.randint(1, 6, (1,), generator=g))]
            + torch.randint(0, vocab, (int(torch.randint(0, 4, (1,), generator=g)),),
                            generator=g).tolist() for _ in range(n)]
    seqs = [s or [1] for s in seqs]
    pack = TreePack.from_sequences(seqs, layout=layout, pad_to_multiple_of=pad)
    return seqs, pack, torch.randn(pack.num_rows, vocab, generator=g, dtype=torch.float64)


def rows_of(pack, s, length):
    if pack.layout == "flat":
        return pack.rows[pack.offsets[s]:pack.offsets[s] + length]
    return pack.rows[s, :length]


def at(pack, s, a, b):
    return slice(pack.offsets[s] + a, pack.offsets[s] + b) if pack.layout == "flat" else \
        (s, slice(a, b))


@pytest.mark.parametrize("layout", ["flat", "dense"])
@pytest.mark.parametrize("per_row", [False, True])
def test_prediction_aligned_at_each_rows_temperature(per_row, layout):
    """Position p of each row holds log p(token p+1) from its own packed row at its own
    temperature, 0 at the last; entropy at every position. Reference: the packed rows of each
    sequence read one sequence at a time."""
    seqs, pack, logits = sequences_and_logits(layout=layout)
    temps = torch.tensor([0.5, 1.0, 2.0] * 3)[:len(seqs)] if per_row else torch.tensor(0.7)
    out = from_logits(pack, logits, temperature=temps, entropy=True, align="prediction")
    for s, seq in enumerate(seqs):
        t = float(temps[s] if per_row else temps)
        logp = torch.log_softmax(logits[rows_of(pack, s, len(seq))] / t, dim=-1)  # [len, V]
        want = torch.zeros(len(seq), dtype=torch.float64)
        want[:-1] = logp[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        # a float64 log-softmax over 11 logits, two ways
        assert_within(out.logprobs[at(pack, s, 0, len(seq))], want, FLOAT64_OP)
        assert_within(out.entropy[at(pack, s, 0, len(seq))], -(logp.exp() * logp).sum(-1),
                      FLOAT64_OP)


@pytest.mark.parametrize("per_row", [False, True])
def test_label_aligned_at_each_rows_temperature_equals_each_temperature_alone(per_row):
    seqs, pack, logits = sequences_and_logits(layout="dense")
    temps = torch.tensor([0.5, 1.0, 2.0] * 3)[:len(seqs)] if per_row else torch.tensor(0.7)
    out = from_logits(pack, logits, temperature=temps, entropy=True)
    for t in set(temps.reshape(-1).tolist()):
        rows = torch.ones(len(seqs), dtype=torch.bool) if not per_row else temps == t
        lp, ent = pack.token_logprobs_and_entropy(logits, temperature=t)
        torch.testing.assert_close(out.logprobs[rows], lp[rows], rtol=0, atol=0)
        torch.testing.assert_close(out.entropy[rows], ent[rows], rtol=0, atol=0)


def test_a_padded_pack_gives_the_unpadded_packs_values():
    """A pack padded to a multiple has a logit row per padding row too: accepted, and read
    as the unpadded pack."""
    seqs, pack, logits = sequences_and_logits()
    padded = TreePack.from_sequences(seqs, layout="flat", pad_to_multiple_of=16)
    assert padded.num_rows > pack.num_rows
    extra = torch.randn(padded.num_rows - pack.num_rows, logits.shape[1], dtype=logits.dtype)
    got = from_logits(padded, torch.cat([logits, extra]), temperature=0.7, entropy=True,
                      align="prediction")
    want = from_logits(pack, logits, temperature=0.7, entropy=True, align="prediction")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_refusals_name_the_value_and_the_fix():
    seqs, pack, logits = sequences_and_logits()
    with pytest.raises(ValueError, match="one row per row of the pack"):
        from_logits(pack, logits[1:])
    with pytest.raises(ValueError, match="one number or one per sequence"):
        from_logits(pack, logits, temperature=torch.ones(len(seqs) + 1))
    with pytest.raises(ValueError, match=r"temperature\[0\]=0.0 must be a finite number"):
        from_logits(pack, logits, temperature=torch.zeros(len(seqs)))
    with pytest.raises(ValueError, match="temperature=True"):
        from_logits(pack, logits, temperature=True)
    with pytest.raises(ValueError, match="align='labels' must be one of"):
        from_logits(pack, logits, align="labels")


def test_per_sequence_temperatures_keep_the_callers_precision():
    """A list of Python floats stays float64 (torch.as_tensor would make it float32: 0.7 ->
    0.699999988); a float32 tensor keeps its own values."""
    assert per_sequence_temperature([0.7, 0.3], 2).tolist() == [0.7, 0.3]
    assert per_sequence_temperature((0.7,), 3).tolist() == [0.7] * 3
    t32 = torch.tensor([0.7, 0.3])
    assert per_sequence_temperature(t32, 2).tolist() == t32.double().tolist()


def test_take_columns_reads_label_aligned_values_into_columns():
    values = torch.arange(12.0).reshape(2, 6)
    columns = torch.tensor([[2, 3, 4], [0, 1, 9]])
    keep = torch.tensor([[True, True, False], [True, True, True]])
    got = take_columns(values, columns, keep)
    assert got.tolist() == [[2.0, 3.0, 0.0], [6.0, 7.0, 11.0]]  # 9 clamps to the last
    assert take_columns(values[:, :0], columns, keep).shape == (2, 3)
