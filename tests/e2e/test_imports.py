"""The import graph of `modeling_tagclip/` and `training/`: no cycles, and the package never imports `training`.

Imports are read with `ast` (nothing is executed), including the ones inside functions: a lazy import that
closes a cycle is still a cycle. Imports under `if TYPE_CHECKING:` are ignored.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("modeling_tagclip", "training")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every module of the two roots, by dotted name (a package by its `__init__.py`)."""
    return {module_name(path): path for root in ROOTS for path in sorted((REPO_ROOT / root).rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def _absolute(name: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module a `from ... import` names (relative levels resolved against `name`)."""
    if node.level == 0:
        return node.module or ""
    parts = name.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_targets(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Dotted names this module imports (project modules resolved to the deepest module that exists)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, node, path.name == "__init__.py")
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else base)
    return targets


def import_graph() -> dict[str, set[str]]:
    """Edges module -> project module it imports (self-edges and imports of outside packages dropped)."""
    modules = project_modules()
    return {
        name: {t for t in imported_targets(name, path, modules) if t in modules and t != name}
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_sees_direct_and_longer_cycles():
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_reads_relative_lazy_and_type_checking_imports(tmp_path, monkeypatch):
    package = tmp_path / "modeling_tagclip"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .sub import one\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "one.py").write_text("def f():\n    from ..sub import two\n")
    (package / "sub" / "two.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import one\nimport training.x\n"
    )
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "x.py").write_text("from modeling_tagclip.sub.one import f\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    graph = import_graph()
    assert graph["modeling_tagclip"] == {"modeling_tagclip.sub.one"}
    assert graph["modeling_tagclip.sub.one"] == {"modeling_tagclip.sub.two"}
    assert graph["modeling_tagclip.sub.two"] == {"training.x"}
    assert cycles(graph) == [["modeling_tagclip.sub.one", "modeling_tagclip.sub.two", "training.x"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(component) for component in found
    )


def test_package_never_imports_training():
    """`training/` is not installed: an import of it from the package fails for every pip user."""
    modules = project_modules()
    offenders = {
        name: sorted(t for t in imported_targets(name, path, modules) if t.split(".")[0] == "training")
        for name, path in modules.items()
        if name.split(".")[0] == "modeling_tagclip"
    }
    assert len(offenders) > 20  # the walk found the package
    assert not {name: t for name, t in offenders.items() if t}, "the package imports training"


# test modules whose helpers other tests still import: the training-run helpers of test_train.py,
# test_train_init.py, test_train_reid.py and test_engine.py, and test_faults.py's tmpfs fixture (its module's
# tier depends on it)
HELPER_TEST_MODULES = frozenset(
    {"test_train", "test_train_init", "test_train_reid", "test_engine", "test_faults"}
)


def test_tests_take_shared_helpers_from_fixtures():
    """Tiny configs and helpers live in tests/fixtures.py: no test imports them from conftest.py (which holds the
    injected fixtures and the tiers; test_tiers.py checks the tier logic) or from another test module outside
    HELPER_TEST_MODULES."""
    offenders = []
    for path in sorted(p for p in (REPO_ROOT / "tests").rglob("*.py") if "hf_suite" not in p.parts):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            names = {alias.name for alias in node.names}
            other_test = node.module.startswith("test_") and node.module not in HELPER_TEST_MODULES
            if other_test or (node.module == "conftest" and path.name != "test_tiers.py"):
                offenders.append(
                    f"{path.name}:{node.lineno} from {node.module} import {', '.join(sorted(names))}"
                )
    assert not offenders, offenders
