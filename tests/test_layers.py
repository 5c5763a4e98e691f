"""The package's layers: a module may import from its own layer or a lower one, never a higher one.

Layers, lowest first (README, "How d2lpar is organised"): infra, processes, comm, strategies, cost,
then the faces (``info``, ``bench``, ``examples``, ``gpu_report``, ``solutions``, ``__main__``).
Every ``import`` counts, including those inside functions: a lazy import still ties the lower layer
to the higher one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "d2lpar"
LAYERS = ["infra", "processes", "comm", "strategies", "cost"]
FACES = {"info", "bench", "examples", "gpu_report", "solutions", "__main__"}


def layer_of(module: str) -> int | None:
    """0-based layer of a dotted ``d2lpar...`` module name; faces are above every layer."""
    parts = module.split(".")
    if parts[0] != "d2lpar":
        return None
    if len(parts) == 1:
        return -1  # the package itself: a docstring and the version
    if parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    if parts[1] in FACES:
        return len(LAYERS)
    raise AssertionError(f"d2lpar.{parts[1]} is in no layer: put it in one of {LAYERS} or the faces")


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against the importing module's package
            base = importer.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        # ``from d2lpar import comm`` imports the subpackage ``d2lpar.comm``
        if target == "d2lpar":
            return [f"d2lpar.{a.name}" for a in node.names]
        return [target]
    return []


def upward_imports(root: Path = PACKAGE) -> list[str]:
    """``file:line: layer A imports higher layer B`` for every upward import under ``root``."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        importer = _module_name(path, root)
        mine = layer_of(importer)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _imported(node, importer, path.name == "__init__.py"):
                theirs = layer_of(target)
                if theirs is not None and mine is not None and theirs > mine:
                    problems.append(f"{path.relative_to(root.parent)}:{node.lineno}: {importer} "
                                    f"(layer {mine + 1}) imports {target} (layer {theirs + 1})")
    return problems


def test_no_layer_imports_a_higher_one():
    problems = upward_imports()
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_every_module_is_in_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(_module_name(path, PACKAGE))


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "d2lpar"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("source", [
    "from d2lpar.cost.memory import footprints\n",
    "import d2lpar.strategies.data.data_parallel\n",
    "from ..comm import collectives\n",
    "def f():\n    from d2lpar.processes.launch import launch\n",  # lazy imports count too
])
def test_an_upward_import_is_named_with_its_file_and_line(tmp_path, source):
    root = _tree(tmp_path, {"infra/__init__.py": "", "infra/data.py": "import torch\n" + source})
    problems = upward_imports(root)
    assert len(problems) == 1
    line = source.count("\n")  # the import is on the source's last line, after `import torch`
    assert problems[0].startswith(f"d2lpar/infra/data.py:{line + 1}: d2lpar.infra.data (layer 1) imports")


def test_downward_and_sideways_imports_are_fine(tmp_path):
    root = _tree(tmp_path, {"comm/x.py": "from d2lpar.infra.data import split_sizes\nfrom .y import z\n",
                            "bench/b.py": "from d2lpar.cost import memory\n"})
    assert upward_imports(root) == []


def import_cycles(root: Path = PACKAGE) -> list[list[str]]:
    """Every cycle of modules that import each other (lazily or not), each as a list of names."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for node in ast.walk(tree):
            for t in _imported(node, name, path.name == "__init__.py"):
                targets.add(t)   # ``from package import module`` imports the module too
                targets.update(f"{t}.{a.name}" for a in getattr(node, "names", []))
        graph[name] = {t for t in targets if t in modules and t != name}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_two_modules_import_each_other():
    cycles = import_cycles()
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_an_import_circle_is_found(tmp_path):
    root = _tree(tmp_path, {"strategies/pipeline/a.py": "from d2lpar.strategies.pipeline.b import x\n",
                            "strategies/pipeline/b.py": "def f():\n    from d2lpar.strategies.pipeline import a\n"})
    assert import_cycles(root) == [["d2lpar.strategies.pipeline.a", "d2lpar.strategies.pipeline.b",
                                    "d2lpar.strategies.pipeline.a"]]
