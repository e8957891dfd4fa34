"""treepack: exact prefix-tree packing for LLM training on prefix-sharing data.

Merge sequences that share prefixes into one forest, run the model once over it, and get
every original next-token log-prob back in the original ``[N, L]`` layout::

    pack = treepack.TreePack.from_sequences(token_ids)
    out = treepack.hf.forward(model, pack)
    logps = pack.token_logprobs(out.logits[0])

Every name below is imported on first use, so ``import treepack`` (and ``treepack --help``)
loads neither torch nor any optional package until something needs it.

The modules live in one folder per part (docs/design.md, "Layering"): ``core``,
``attention``, ``recurrent``, ``lean``, ``planning``, ``forwards``, ``adapters`` (one folder
per framework), ``face`` and ``data``. The short paths
users import (``treepack.hf``, ``treepack.trl``, ``treepack.verl``, ``treepack.losses``, ...)
are the same module objects under a second name (:data:`PATHS`), so ``import treepack.verl``
and verl's ``external_lib=treepack.verl`` keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import TYPE_CHECKING

from treepack.version import __version__

PATHS = {  # short public path -> the module's place in its part
    "tree": "core.tree", "forest": "core.forest", "mask": "core.mask",
    "softmax": "core.softmax", "checks": "core.checks", "denominators": "core.denominators",
    "logprobs": "lean.logprobs", "losses": "lean.losses",
    "planner": "planning.planner", "collation": "planning.collation",
    "groups": "planning.groups", "parts": "planning.parts", "sharing": "planning.sharing",
    "hf": "adapters.hf", "hf_compat": "adapters.hf.compat", "zoo": "data.zoo",
    "trl": "adapters.trl",
    "verl": "adapters.verl", "verl_lean": "adapters.verl.lean",
    "verl_trainer": "adapters.verl.trainer", "verl_megatron": "adapters.verl.megatron_engine",
    "megatron": "adapters.megatron",
    "cli": "face.cli", "verification": "face.verification", "benchmark": "face.benchmark",
    "synthetic": "data.synthetic", "tasks": "data.tasks",
}

_EXPORTS = {  # public name -> the module that defines it
    "TreePack": "core.tree", "Segments": "core.tree", "Predictions": "core.tree",
    "HostLayout": "core.tree", "forest_stats": "core.tree",
    "ForestStats": "core.forest",
    "logprobs_from_hidden": "lean.logprobs", "TokenLogprobs": "lean.logprobs",
    "logprobs_and_entropy_from_hidden": "lean.logprobs",
    "plan": "planning.planner", "Plan": "planning.planner", "PackSpec": "planning.planner",
    "collate": "planning.collation",
    "verify": "face.verification", "VerifyReport": "face.verification",
}
_MODULES = {*PATHS, "attention", "version"}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time names resolve lazily
    from treepack.core.forest import ForestStats
    from treepack.core.tree import HostLayout, Predictions, Segments, TreePack, forest_stats
    from treepack.face.verification import VerifyReport, verify
    from treepack.lean.logprobs import (TokenLogprobs, logprobs_and_entropy_from_hidden,
                                        logprobs_from_hidden)
    from treepack.planning.collation import collate
    from treepack.planning.planner import PackSpec, Plan, plan


class _ShortPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import treepack.hf`` (or ``treepack.hf.compat``) loads ``treepack.adapters.hf`` and
    binds the same module object to the short name: one module, two names, no copy."""

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if parts[0] != __name__ or len(parts) < 2 or parts[1] not in PATHS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None  # a placeholder, replaced in sys.modules by exec_module

    def exec_module(self, module):
        sys.modules[module.__name__] = importlib.import_module(self._target(module.__name__))

    def get_code(self, fullname):  # ``python -m treepack.cli`` runs the module's own code
        target = self._target(fullname)
        return importlib.util.find_spec(target).loader.get_code(target)

    @staticmethod
    def _target(fullname: str) -> str:
        _, short, *rest = fullname.split(".")
        return ".".join([__name__, PATHS[short], *rest])


if not any(isinstance(f, _ShortPaths) for f in sys.meta_path):
    sys.meta_path.insert(0, _ShortPaths())


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"treepack.{_EXPORTS[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _MODULES:
        return importlib.import_module(f"treepack.{name}")
    raise AttributeError(f"module 'treepack' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS, *_MODULES])
