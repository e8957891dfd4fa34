"""The built-in RL tasks: the character tokenizer round-trips text one token a character, and
the letter task's reward counts its letter."""

import pytest

pytest.importorskip("tokenizers")

from treepack import tasks  # noqa: E402


def test_the_character_tokenizer_round_trips_one_token_a_character():
    tok = tasks.char_tokenizer()
    text = tasks.letter_prompts("ab", instruction_repeats=2)["prompt"][1]
    ids = tok(text).input_ids
    assert len(ids) == len(text) and min(ids) >= 3  # no special token, none unknown
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 3 + len(tasks.CHARACTERS)
    # a character outside the set is <pad>, never dropped
    assert tok("a~b").input_ids == [tok.convert_tokens_to_ids("a"), 0,
                                     tok.convert_tokens_to_ids("b")]


def test_the_letter_prompts_share_their_instruction_and_name_their_letter():
    data = tasks.letter_prompts("abc", instruction_repeats=3)
    assert data["letter"] == ["a", "b", "c"]
    for prompt, letter in zip(data["prompt"], data["letter"]):
        assert prompt.startswith(tasks.INSTRUCTION * 3)
        assert f"the letter is {letter}." in prompt


def test_the_letter_reward_counts_the_prompts_letter_over_the_length():
    reward = tasks.letter_reward(4)
    assert reward.__name__ == "letter"  # TRL names the reward column after it
    assert reward(["aaaa", "abab", "", "bbbb"], letter=["a", "a", "a", "a"]) == [1.0, 0.5, 0.0,
                                                                                0.0]
    with pytest.raises(ValueError):  # one letter per completion
        reward(["a", "b"], letter=["a"])
