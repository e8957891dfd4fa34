"""The package's layering (docs/design.md), read from every module's imports.

Each part is a folder: core -> core; attention, recurrent, lean, planning -> core; forwards
-> those; adapters -> any of those and data; face -> anything; data -> nothing. Nothing imports
face, no module imports the package root for a re-export or a short path (``treepack.hf`` for
``treepack.adapters.hf``), and no part below the adapters imports transformers, TRL, verl or
megatron-core. Imports inside functions count: they run too.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "treepack"

# Each part is a folder of src/treepack; the package root and version.py stand alone.
PARTS = ("core", "attention", "recurrent", "lean", "planning", "forwards", "adapters", "face",
         "data")
MAY_IMPORT = {
    "core": {"core"},
    "attention": {"core"},
    "recurrent": {"core"},
    "lean": {"core"},
    "planning": {"core"},
    "forwards": {"core", "attention", "recurrent", "lean", "planning"},
    "adapters": {"core", "attention", "recurrent", "lean", "planning", "forwards", "data"},
    "face": set(PARTS),
    "data": set(),  # built-in workloads: import nothing of treepack, usable anywhere
}
FRAMEWORKS = {"transformers", "trl", "verl", "megatron"}
FRAMEWORK_FREE = ("core", "attention", "recurrent", "lean", "planning", "forwards")


def _short_paths() -> dict:
    """treepack.PATHS, read from the root's source (importing it would run the code under
    test)."""
    for node in ast.parse((SRC / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PATHS":
            return ast.literal_eval(node.value)
    raise AssertionError("treepack/__init__.py defines no PATHS table")


SHORT_PATHS = _short_paths()


def layer_of(module: str) -> str:
    """``treepack.attention.segment`` -> "attention": the folder it lives in."""
    top = module.split(".")[1]
    if top in PARTS:
        return top
    if module == "treepack.version":
        return "core"  # read by setuptools from its own path; imports nothing
    raise AssertionError(f"{module} lives in no part's folder: move it into one of {PARTS}")


def modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def imports(path: Path, module: str):
    """(imported module, line) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    # `if TYPE_CHECKING:` imports never run: annotations only
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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
            if top in FRAMEWORKS and layer in FRAMEWORK_FREE:
                wrong.append(f"{where}: {layer} never imports {top}")
            if top != "treepack":
                continue
            if target == "treepack":
                wrong.append(f"{where}: import the defining module, not the package root")
                continue
            if target.split(".")[1] in SHORT_PATHS:
                wrong.append(f"{where}: a short public path; import "
                             f"treepack.{SHORT_PATHS[target.split('.')[1]]} inside the package")
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
             and not (isinstance(node, ast.Import) and node.names[0].name.split(".")[0]
                      in ("importlib", "sys"))]
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
    for part in ("core", "lean"):
        (fake / part).mkdir(parents=True)
    (fake / "__init__.py").write_text("PATHS = {}\n")
    for name in ("core/tree.py", "lean/logprobs.py"):
        (fake / name).write_text("")
    (fake / "core" / "mask.py").write_text("from treepack.lean.logprobs import edges\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    with pytest.raises(AssertionError, match="core -> lean points up"):
        test_every_import_points_down()


@pytest.mark.parametrize("line,caught", [
    ("from treepack.adapters.hf import routing\n", "forwards -> adapters points up"),
    ("import transformers\n", "forwards never imports transformers"),
    ("from megatron.core import parallel_state\n", "forwards never imports megatron"),
])
def test_the_layering_test_keeps_the_forwards_framework_free(tmp_path, monkeypatch, line,
                                                             caught):
    """The parts layer (forwards) sits below the adapters: it may not reach up into them nor
    import a framework."""
    fake = tmp_path / "treepack"
    for part in ("forwards", "adapters"):
        (fake / part).mkdir(parents=True)
    (fake / "__init__.py").write_text("PATHS = {}\n")
    (fake / "adapters" / "hf").mkdir()
    (fake / "adapters" / "hf" / "routing.py").write_text("")
    (fake / "forwards" / "mixers.py").write_text(line)
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    with pytest.raises(AssertionError, match=caught):
        test_every_import_points_down()


def test_the_layering_test_catches_a_short_path_inside_the_package(tmp_path, monkeypatch):
    fake = tmp_path / "treepack"
    (fake / "core").mkdir(parents=True)
    (fake / "__init__.py").write_text("PATHS = {'tree': 'core.tree'}\n")
    (fake / "core" / "tree.py").write_text("")
    (fake / "core" / "mask.py").write_text("from treepack.tree import TreePack\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    monkeypatch.setattr(__import__(__name__), "SHORT_PATHS", _short_paths())
    with pytest.raises(AssertionError, match="a short public path"):
        test_every_import_points_down()


def test_short_paths_are_the_same_modules():
    import importlib

    import treepack

    for short, place in treepack.PATHS.items():
        if short in ("trl", "verl", "verl_lean", "verl_trainer", "verl_megatron", "megatron"):
            continue  # their frameworks are optional; tested with them
        assert importlib.import_module(f"treepack.{short}") is \
            importlib.import_module(f"treepack.{place}"), short
    from treepack.hf import compat
    assert compat is importlib.import_module("treepack.hf_compat")


def test_tests_mirror_the_package():
    """tests/<part>/ holds the tests of src/treepack/<part>/, and tests/adapters/<framework>/
    those of src/treepack/adapters/<framework>/, with their worker modules; what spans the
    parts (the layering, the docs, the README, the examples, bad input everywhere) stays in
    tests/, and the helpers every folder shares (launch, strategies, reference, tolerance,
    tiny models, megatron-core on a CPU) are in tests/support/."""
    tests = Path(__file__).resolve().parent

    def folders(path: Path) -> set[str]:
        return {p.name for p in path.iterdir() if p.is_dir()
                and not p.name.startswith((".", "__"))}

    top = folders(tests) - {"support"}
    assert top <= set(PARTS), top - set(PARTS)
    assert not any(tests.joinpath("support").glob("test_*.py")), "support/ holds helpers only"
    mirrored = [*(top - {"adapters"}), *(f"adapters/{f}" for f in folders(tests / "adapters"))]
    for folder in mirrored:
        assert (SRC / folder).is_dir(), folder
        assert any(tests.joinpath(folder).glob("test_*.py")), folder
    assert not list(tests.joinpath("adapters").glob("*.py")), \
        "each framework's tests live in tests/adapters/<framework>/"
    assert folders(SRC / "adapters") <= folders(tests / "adapters"), \
        folders(SRC / "adapters") - folders(tests / "adapters")


def import_graph() -> dict[str, set[str]]:
    """Every treepack module -> the treepack modules it names (the package root left out:
    its re-exports are lazy)."""
    names = {name for name, _ in modules()}
    graph = {}
    for module, path in modules():
        targets = set()
        for target, _ in imports(path, module):
            while target not in names and "." in target:
                target = target.rsplit(".", 1)[0]  # `from a.b import name` names a.b
            if target in names and target not in ("treepack", module):
                targets.add(target)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``, one path each (depth-first, white/grey/black)."""
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "grey"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "grey":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "black"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_circle_test_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
