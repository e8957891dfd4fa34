"""Generate docs/api.md from the docstrings of treepack's public API.

    python docs/gen_api.py          # rewrites docs/api.md
    python docs/gen_api.py --check  # exit 1 if docs/api.md is out of date

tests/test_docs.py runs the check, so the reference cannot drift from the code.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

OUT = Path(__file__).with_name("api.md")

SECTIONS = [
    ("treepack", ["TreePack", "Segments", "Predictions", "HostLayout", "forest_stats",
                  "ForestStats", "logprobs_from_hidden", "logprobs_and_entropy_from_hidden",
                  "TokenLogprobs", "plan", "Plan", "PackSpec", "collate", "verify",
                  "VerifyReport"]),
    ("treepack.attention", ["TreeAttention", "BACKENDS", "CHOICES", "choose_backend"]),
    ("treepack.recurrent", ["tree_conv1d", "ancestors", "level_scan", "levels"]),
    ("treepack.hf", ["logprobs", "HEADS", "pair_cost", "prepare", "restore", "prepared", "is_prepared",
                     "original_attention", "forward", "forward_hidden", "HiddenOutput",
                     "unwrap", "lm_head", "compute_device", "row_multiplicity",
                     "router_aux_loss", "batch_router_aux_loss", "UnsupportedModel",
                     "backward_in_parts", "step_in_parts", "logprobs_in_parts", "PartsResult",
                     "average_gradients", "Images"]),
    ("treepack.parts", ["split", "Parts", "Part"]),
    ("treepack.logprobs", ["outputs_from_hidden", "RowLogprobs"]),
    ("treepack.core.outputs", ["from_logits", "token_outputs", "row_outputs", "take_columns",
                               "per_sequence_temperature", "ALIGNMENTS"]),
    ("treepack.core.softmax", ["normalise", "Logits", "Head", "head_logits",
                               "default_chunk_size"]),
    ("treepack.losses", ["MODES", "Denominators", "global_denominators", "aggregate",
                         "sft_loss", "policy_loss", "PolicyLoss", "kl_penalty",
                         "entropy_bonus"]),
    ("treepack.collation", ["Batch", "Collated", "rollouts_from_padded"]),
    ("treepack.groups", ["keep_groups_together", "GroupOrder"]),
    ("treepack.sharing", ["report", "SharingReport", "Causes", "FalseFork", "placement",
                          "Placement", "rows_from_trl", "rows_from_verl", "unpadded",
                          "metrics_from_counts", "CAUSES"]),
    ("treepack.trl", ["TreepackGRPOTrainer", "TreepackAsyncGRPOTrainer", "patch",
                      "per_token_logps_and_entropies",
                      "shuffle_whole_groups"]),
    ("treepack.zoo", ["FAMILIES", "tiny_config", "tiny_model", "qwen2_40m_config",
                      "qwen25_05b_config", "MODELS", "VISION_FAMILIES", "tiny_vision_model",
                      "ImageBatch", "image_batch"]),
    ("treepack.synthetic", ["grpo_batch", "agent_batch", "agentic_batch"]),
]


# Deprecated names: each warns (FutureWarning) naming its replacement and the release that
# removes it (treepack.core.deprecation.REMOVED_IN).
DEPRECATED = [
    ("treepack.hf.forward_lean(...)", "treepack.hf.logprobs(model, pack, head='inside')"),
    ("treepack.hf.forward(..., return_hidden=True)", "treepack.hf.forward_hidden"),
    ("treepack.hf.unprepare", "treepack.hf.restore"),
    ("treepack.hf.router_aux_loss(model, packs, router_logits) with lists",
     "treepack.hf.batch_router_aux_loss"),
    ("treepack.logprobs_from_hidden(..., with_entropy=True)",
     "treepack.logprobs_and_entropy_from_hidden"),
    ("treepack.logprobs.row_logprobs_from_hidden",
     "treepack.hf.logprobs(model, pack, head='inside')"),
    ("treepack.softmax.log_softmax_rows", "treepack.core.softmax.normalise(Logits(logits), ...)"),
    ("treepack.verl.verl_log_probs",
     "treepack.core.outputs.from_logits(pack, logits, align='prediction')"),
    ("TreePack.num_tokens", "TreePack.num_packed_rows"),
    ("ForestStats.packed_tokens", "ForestStats.packed_rows"),
    ("PackSpec.rows / Plan.rows", "PackSpec.packed_rows / Plan.packed_rows"),
]


def _doc(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return f"```text\n{doc}\n```\n" if doc else ""


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    text = re.sub(r"(: |-> )'([^']*)'", r"\1\2", text)  # postponed annotations: unquote
    return text.replace("(self, ", "(").replace("(self)", "()")


def _members(cls) -> list[str]:
    out = []
    inherited = {}  # public members of treepack's own base classes, the subclass's first
    for base in reversed(cls.__mro__):
        if base is cls or base.__module__.startswith("treepack."):
            inherited.update(vars(base))
    for name, value in inherited.items():
        if name.startswith("_") or name in ("count", "index"):
            continue
        if isinstance(value, property):
            doc = inspect.getdoc(value)
            out.append(f"- `.{name}` (property){': ' + doc.splitlines()[0] if doc else ''}")
        elif isinstance(value, (classmethod, staticmethod)) or inspect.isfunction(value):
            fn = getattr(cls, name)
            doc = inspect.getdoc(fn)
            first = doc.split("\n\n")[0].replace("\n", " ") if doc else ""
            out.append(f"- `.{name}{_signature(fn)}`{': ' + first if first else ''}")
    return out


def _value(obj) -> str:
    if isinstance(obj, dict):
        items = (f"{k!r}: {_value(v)}" for k, v in obj.items())
        return "{" + ", ".join(items) + "}"
    if callable(obj):
        return f"{obj.__module__}.{obj.__qualname__}"
    return repr(obj)


def render() -> str:
    parts = ["# API reference", "",
             "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.", ""]
    for module_name, names in SECTIONS:
        module = importlib.import_module(module_name)
        parts += [f"## `{module_name}`", ""]
        for name in names:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                parts += [f"### class `{name}`", "", _doc(obj)]
                members = _members(obj)
                if members:
                    parts += members + [""]
            elif callable(obj):
                parts += [f"### `{name}{_signature(obj)}`", "", _doc(obj)]
            else:
                parts += [f"### `{name}`", "", f"```text\n{_value(obj)}\n```\n"]
    from treepack.core.deprecation import REMOVED_IN

    parts += ["## Deprecated", "",
              f"Each still works, warns (`FutureWarning`) and goes in treepack {REMOVED_IN}.", "",
              "| deprecated | use instead |", "|---|---|"]
    parts += [f"| `{old}` | `{new}` |" for old, new in DEPRECATED]
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
