import subprocess
import sys
from pathlib import Path

import pytest

from tolerance import FLOAT32_RELATIVE, assert_within

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_is_generated_from_the_current_docstrings():
    pytest.importorskip("trl")  # the reference covers treepack.trl
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_docs_link_to_files_that_exist():
    import re

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+\.md)\)", page.read_text()):
            assert (page.parent / target).exists() or (ROOT / target).exists(), (page, target)


def test_the_grpo_step_over_planned_packs_in_losses_md_equals_each_sequence_alone():
    import re

    import torch

    pytest.importorskip("transformers")
    text = (ROOT / "docs" / "losses.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
               if b.startswith("# runs as a test")]
    scope = {}
    exec(compile(code, "docs/losses.md", "exec"), scope)
    model, packs = scope["model"], scope["packs"]
    assert len(packs) > 1 and sorted(i for p in packs for i in p.seq_ids.tolist()) == \
        list(range(len(scope["seqs"])))
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    # The same loss unpacked: every sequence alone, completion tokens only, one denominator.
    model.zero_grad()
    total, count = 0.0, 0
    for seq, plen, adv in zip(scope["seqs"], scope["prompt_lens"], scope["advantages"]):
        logp = model(input_ids=seq[None]).logits[0].log_softmax(-1)[:-1]
        logp = logp.gather(-1, seq[1:, None])[plen - 1:, 0]  # predictions of completion tokens
        ratio = torch.exp(logp - logp.detach())
        total = total + (-adv * ratio).sum()
        count += len(logp)
    (total / count).backward()
    for k, p in model.named_parameters():  # a float32 model, packed and alone
        assert_within(got[k], p.grad, FLOAT32_RELATIVE)


def test_every_public_function_documents_what_it_takes_and_gives():
    """Args where there are parameters, Returns where something is returned; no ritual
    sections ("Args: None.", "Raises: Nothing of its own.") that say nothing."""
    import importlib
    import inspect

    pytest.importorskip("trl")
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        from gen_api import SECTIONS
    finally:
        sys.path.pop(0)
    from treepack import TreePack
    from treepack.planner import Plan

    entry_points = [getattr(importlib.import_module(m), n) for m, names in SECTIONS
                    for n in names]
    entry_points += [getattr(TreePack, n) for n in ("from_sequences", "empty", "to", "dense_mask",
                                                     "mask_mod", "block_mask", "token_logprobs",
                                                     "token_entropy", "place", "unpack",
                                                     "completion_mask",
                                                     "token_logprobs_and_entropy")]
    entry_points.append(Plan.packs)
    lacking = []
    for fn in entry_points:
        if not inspect.isfunction(fn) and not inspect.ismethod(fn):
            continue
        doc = inspect.getdoc(fn) or ""
        signature = inspect.signature(fn)
        takes = [p for p in signature.parameters if p not in ("self", "cls")]
        gives = signature.return_annotation not in ("None", None)
        missing = [s for s, needed in (("Args:", takes), ("Returns:", gives))
                   if needed and s not in doc]
        ritual = [r for r in ("Nothing of its own", "Args:\n    None.", "Returns:\n    None.")
                  if r in doc]
        if missing or ritual:
            lacking.append(f"{fn.__qualname__}: missing {missing}, ritual {ritual}")
    assert not lacking, "\n".join(lacking)
