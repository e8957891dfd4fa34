"""Bad input gets an error that names the value, the rule and the fix (issue 18's list of
inputs that raised raw torch / Python errors, or passed and gave NaN)."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
import treepack  # noqa: E402
from treepack import TreePack, hf, zoo  # noqa: E402
from treepack.attention import TreeAttention  # noqa: E402

SEQS = [[5, 6, 7], [5, 6, 8]]


@pytest.fixture(scope="module")
def model():
    return hf.prepare(zoo.tiny_model("qwen2"))


def test_verify_with_nothing_to_predict():
    with pytest.raises(ValueError, match="one token: nothing to predict.*2 or more tokens"):
        treepack.verify(zoo.tiny_model("qwen2"), [[5], [6]])


@pytest.mark.parametrize("call", [hf.forward, hf.logprobs])
def test_forward_of_a_list_instead_of_a_pack(model, call):
    with pytest.raises(TypeError, match="pack must be a TreePack, got list.*from_sequences"):
        call(model, [[5, 6, 7]])


@pytest.mark.parametrize("call", [hf.forward_hidden, hf.logprobs])
def test_named_output_calls_refuse_return_dict_false(model, call):
    with pytest.raises(ValueError, match="drop return_dict=False"):
        call(model, TreePack.from_sequences(SEQS), return_dict=False)


def test_a_none_token():
    with pytest.raises(TypeError, match="sequence 0 holds None at position 1"):
        TreePack.from_sequences([[1, None]])


def test_completion_mask_of_an_empty_pack():
    assert TreePack.empty(3).completion_mask([]).numel() == 0


@pytest.mark.parametrize("window", [2.5, True, torch.tensor(3), 0])
@pytest.mark.parametrize("backend", ["segment", "varlen", "dense"])
def test_one_window_rule_for_every_backend(window, backend):
    pack = TreePack.from_sequences(SEQS)
    q = torch.randn(1, 2, pack.num_rows, 8)
    with pytest.raises(ValueError, match=r"window=.* must be a positive int.*None for no"):
        TreeAttention(pack, backend)(q, q, q, window=window)


def test_temperatures_that_would_give_nan_are_refused_and_tensors_taken():
    pack = TreePack.from_sequences(SEQS)
    logits = torch.randn(pack.num_rows, 16)
    with pytest.raises(ValueError, match="temperature=1e-46 is below 1e-06.*finite in float32"):
        pack.token_logprobs(logits, temperature=1e-46)
    # a tensor and a float of one value: the same computation
    torch.testing.assert_close(pack.token_logprobs(logits, temperature=torch.tensor(0.5)),
                               pack.token_logprobs(logits, temperature=0.5), rtol=0, atol=0)


@pytest.mark.parametrize("call", [hf.forward, hf.logprobs])
def test_a_pack_with_routes_is_refused_by_transformers(model, call):
    """transformers' routers route every row themselves: routes would be dropped."""
    routes = [np.zeros((3, 1, 2), dtype=np.int16)] * 2
    with pytest.raises(ValueError, match="the pack carries routes.*does not replay"):
        call(model, TreePack.from_sequences(SEQS, routes=routes))
