"""The package's layering (docs/design.md), read from every module's imports.

core -> core; attention -> core; lean -> core; plan -> core; adapters -> any of those; face ->
anything. Nothing imports face, no module imports the package root for a re-export, and
core, attention, lean and plan never import transformers, TRL or verl. Imports inside
functions count: they run too.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "treepack"

LAYERS = {
    "core": {"tree", "forest", "mask", "softmax", "checks", "denominators", "version"},
    "attention": {"attention"},
    "lean": {"logprobs", "losses"},
    "plan": {"planner", "collation", "groups"},
    "adapters": {"hf", "hf_compat", "trl", "verl", "verl_lean", "verl_trainer", "zoo"},
    "face": {"cli", "verification", "benchmark"},
    "data": {"synthetic"},  # built-in workloads: import nothing of treepack, usable anywhere
}
MAY_IMPORT = {
    "core": {"core"},
    "attention": {"core", "attention"},
    "lean": {"core", "lean"},
    "plan": {"core", "plan"},
    "adapters": {"core", "attention", "lean", "plan", "adapters", "data"},
    "face": set(LAYERS),
    "data": set(),
}
FRAMEWORKS = {"transformers", "trl", "verl"}


def layer_of(module: str) -> str:
    """``treepack.attention.segment`` -> "attention"."""
    top = module.split(".")[1]
    for layer, names in LAYERS.items():
        if top in names:
            return layer
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def imports(path: Path, module: str):
    """(imported module, line) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                # `from treepack import hf` names a submodule; `from treepack import X` a
                # re-export of the root
                sub = f"{base}.{alias.name}"
                yield (sub if (SRC.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                       or (SRC.parent / sub.replace(".", "/")).is_dir() else base), node.lineno


def test_every_import_points_down():
    wrong = []
    for module, path in modules():
        if module == "treepack":  # the root: lazy, checked below
            continue
        layer = layer_of(module)
        for target, line in imports(path, module):
            top = target.split(".")[0]
            where = f"{path.relative_to(SRC.parent)}:{line} imports {target}"
            if top in FRAMEWORKS and layer in ("core", "attention", "lean", "plan"):
                wrong.append(f"{where}: {layer} never imports {top}")
            if top != "treepack":
                continue
            if target == "treepack":
                wrong.append(f"{where}: import the defining module, not the package root")
                continue
            target_layer = layer_of(target)
            if target_layer not in MAY_IMPORT[layer] and target_layer != layer:
                wrong.append(f"{where}: {layer} -> {target_layer} points up")
    assert not wrong, "\n".join(wrong)


def test_the_package_root_imports_nothing_at_import_time():
    root = SRC / "__init__.py"
    tree = ast.parse(root.read_text())
    eager = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
             and not (isinstance(node, ast.ImportFrom) and node.module in ("__future__",
                                                                           "typing"))
             and not (isinstance(node, ast.Import) and node.names[0].name == "importlib")]
    assert [ast.unparse(n) for n in eager] == ["from treepack.version import __version__"]


@pytest.mark.parametrize("name", ["treepack", "treepack.tree", "treepack.cli"])
def test_importing_loads_no_framework(name):
    import subprocess
    import sys

    code = (f"import sys, {name}\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'trl', "
            "'verl', 'matplotlib'})\n"
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_layering_test_catches_an_upward_import(tmp_path, monkeypatch):
    # A mutation check: core importing the lean layer must be reported.
    fake = tmp_path / "treepack"
    fake.mkdir()
    for name in ("tree.py", "logprobs.py"):
        (fake / name).write_text("")
    (fake / "mask.py").write_text("from treepack.logprobs import edges\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    with pytest.raises(AssertionError, match="core -> lean points up"):
        test_every_import_points_down()
