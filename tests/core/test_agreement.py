"""The agreement of a group's ranks (treepack.core.agreement), in one process: the digests and
the messages. tests/adapters/test_sequence_parallel.py runs it over gloo ranks."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from treepack.core import agreement
from treepack.core.agreement import Disagreement, Label, fingerprint, parameters_fingerprint


def test_fingerprints_tell_apart_what_python_tells_apart():
    values = [1, "1", 1.0, True, None, b"1", (1,), [1], np.array([1]), torch.tensor([1]),
              np.array([1], dtype=np.int32), torch.tensor([1.0]), torch.float32, {"a": 1}]
    assert len({fingerprint(v) for v in values}) == len(values)
    assert fingerprint({"a": 1, "b": [2, 3]}) == fingerprint({"b": [2, 3], "a": 1})
    assert fingerprint(np.arange(5)) == fingerprint(np.arange(5).copy())
    assert fingerprint(torch.arange(5)) != fingerprint(torch.arange(5).flip(0))
    big = torch.randn(1 << 17, generator=torch.Generator().manual_seed(0))
    assert fingerprint(big) == fingerprint(big.clone()) != fingerprint(big * 2)


def test_fingerprints_are_the_same_in_every_process():
    """Python's own hash of a string changes per process; the digest must not."""
    value = {"call": "logprobs", "temperature": np.full(3, 0.7), "head": None}
    code = ("import numpy as np; from treepack.core.agreement import fingerprint; "
            "print(fingerprint({'call': 'logprobs', 'temperature': np.full(3, 0.7), "
            "'head': None}))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={"PYTHONHASHSEED": seed, "PATH": ""})
        assert int(out.stdout) == fingerprint(value)


def test_parameters_fingerprint_is_per_weights_and_remembered():
    def linear(seed):
        torch.manual_seed(seed)
        return torch.nn.Linear(4, 3)

    a, b, c = linear(0), linear(0), linear(1)
    assert parameters_fingerprint(a) == parameters_fingerprint(b) != parameters_fingerprint(c)
    with torch.no_grad():
        a.weight.add_(1.0)
    assert parameters_fingerprint(a) == parameters_fingerprint(b)  # once per module


def test_without_a_group_the_block_runs_alone():
    with agreement.agreement(None) as fields:
        fields["x"] = 1
    with pytest.raises(KeyError):
        with agreement.agreement(None):
            raise KeyError("passes through")


def test_a_disagreement_names_each_field_and_its_values_on_every_rank():
    def summaries(**per_rank):
        return [{k: (fingerprint(v), agreement._show(v)) for k, v in rank.items()}
                for rank in per_rank.values()]

    ranks = summaries(r0={"align": "label", "temperature": np.full(4, 1.0),
                          "pack": Label("9 rows")},
                      r1={"align": "prediction", "temperature": np.full(4, 0.5),
                          "pack": Label("9 rows")})
    ranks[1]["pack"] = (ranks[1]["pack"][0] + 1, ranks[1]["pack"][1])  # other contents
    text = agreement._disagreement("sequence_parallel group", ranks, {"pack": "same pack"})
    assert text.startswith("the ranks of the sequence_parallel group disagree on ")
    assert "align (rank 0: 'label', rank 1: 'prediction')" in text
    assert "temperature (rank 0: 1.0 for each of 4, rank 1: 0.5 for each of 4)" in text
    assert "pack (rank 0: 9 rows, rank 1: 9 rows; alike in size, different in contents" in text
    assert text.endswith("same pack; every rank of the group must make the same call with "
                         "the same arguments")
    calls = summaries(r0={"call": "logprobs", "head": "auto"},
                      r1={"call": "logprobs_in_parts", "parts": 3})
    text = agreement._disagreement("group", calls, {})
    assert "call (rank 0: 'logprobs', rank 1: 'logprobs_in_parts')" in text
    assert "head (" not in text and "parts (" not in text  # they follow from the call
    assert issubclass(Disagreement, ValueError)


class Refused(ValueError, NotImplementedError):
    """An adapter's refusal type (as treepack.hf.UnsupportedModel)."""


def test_a_refusal_elsewhere_is_raised_as_its_own_type():
    error = agreement._rebuilt(Refused.__module__, Refused.__qualname__, "rank 1 refused")
    assert type(error) is Refused and str(error) == "rank 1 refused"
    odd = agreement._rebuilt("no.such.module", "Odd", "rank 1 refused")
    assert type(odd) is RuntimeError and str(odd) == "rank 1 refused"
