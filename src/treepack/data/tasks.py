"""Built-in RL tasks with rule rewards, small enough that a random-init model learns them on a
CPU in a few dozen GRPO steps: the data of ``treepack bench --e2e`` and the agent example.

- :func:`letter_prompts` / :func:`letter_reward`: each prompt names a letter after a shared
  instruction; a completion earns the count of that letter over the longest a completion may
  be.
- :func:`char_tokenizer`: a character-level tokenizer built locally (nothing downloaded), so
  prompts and completions are real text and a token is a character.

Imports nothing of treepack; transformers and tokenizers only when a tokenizer is built.
"""

from __future__ import annotations

import string

__all__ = ["CHARACTERS", "char_tokenizer", "letter_prompts", "letter_reward", "INSTRUCTION"]

CHARACTERS = string.ascii_lowercase + string.digits + " .,:;?=+-*()\n"
SPECIAL = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2

INSTRUCTION = ("you are a careful assistant. read the task below, then answer with the "
               "letter it names, as many times as the answer allows, and nothing else.\n")


def char_tokenizer():
    """A ``PreTrainedTokenizerFast`` with one token per character of :data:`CHARACTERS` (ids
    from 3; ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2); decoding joins the characters back. A
    character outside the set becomes ``<pad>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + tuple(CHARACTERS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")


def letter_prompts(letters: str = "ab", *, instruction_repeats: int = 1) -> dict[str, list]:
    """The prompts of the letter task: ``{"prompt": [...], "letter": [...]}``, one per letter.

    Every prompt starts with the same instruction (``instruction_repeats`` times: a longer
    shared prompt), then names its letter, so a GRPO group shares its whole prompt and the
    groups share the instruction."""
    preamble = INSTRUCTION * instruction_repeats
    prompts = [f"{preamble}task {i}: the letter is {letter}.\nanswer:"
               for i, letter in enumerate(letters)]
    return {"prompt": prompts, "letter": list(letters)}


def letter_reward(length: int):
    """The letter task's reward function for completions of at most ``length`` characters: the
    count of each completion's prompt letter over ``length`` (1 for a completion that is that
    letter throughout), a TRL reward function (``letter`` is the dataset column). Counting, not
    averaging, keeps completions long: a run's sequence lengths stay those it was sized for."""

    def letter(completions: list[str], letter: list[str], **_) -> list[float]:
        return [sum(ch == want for ch in text) / length
                for text, want in zip(completions, letter, strict=True)]

    return letter
