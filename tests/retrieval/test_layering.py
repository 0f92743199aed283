"""The gallery's layering, read from the code with ``ast``: no module under ``retrieval/`` imports a private
name of another module, the two backends do not import each other, and the types module imports no backend."""

from __future__ import annotations

import ast

import pytest
from fixtures import REPO_ROOT

RETRIEVAL = REPO_ROOT / "modeling_tagclip" / "retrieval"
EMBEDDED = {"gallery_index", "index_store", "index_build", "index_commit", "ann"}  # the embedded backend
MILVUS = {"milvus_store"}
TYPES = "gallery_types"


def _imports(module: str) -> list[tuple[str, str | None]]:
    """(module, name) of every import in ``retrieval/<module>.py``, relative ones resolved to their module
    name inside ``retrieval``, at any depth (function-level imports count)."""
    tree = ast.parse((RETRIEVAL / f"{module}.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 0 and base.startswith("modeling_tagclip.retrieval."):
                base = base.removeprefix("modeling_tagclip.retrieval.")
            elif node.level != 1:
                continue
            for alias in node.names:
                if base:
                    found.append((base, alias.name))
                else:  # from . import x
                    found.append((alias.name, None))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("modeling_tagclip.retrieval."):
                    found.append((alias.name.removeprefix("modeling_tagclip.retrieval."), None))
    return found


MODULES = sorted(p.stem for p in RETRIEVAL.glob("*.py") if p.stem != "__init__")


def test_the_walk_reads_real_imports():
    assert ("gallery_types", "SearchFilter") in _imports("gallery_index")
    assert ("index_store", None) in _imports("cli")  # `from . import index_store as store`


@pytest.mark.parametrize("module", MODULES)
def test_no_private_name_is_imported_from_another_module(module):
    private = [f"{source}.{name}" for source, name in _imports(module) if name and name.startswith("_")]
    assert private == [], f"{module} imports private names {private}"


def test_the_backends_do_not_import_each_other():
    for module in EMBEDDED:
        assert not {source for source, _ in _imports(module)} & MILVUS, module
    for module in MILVUS:
        assert not {source for source, _ in _imports(module)} & EMBEDDED, module


def test_the_types_module_imports_no_other_module_of_the_package():
    assert _imports(TYPES) == []
    text = (RETRIEVAL / f"{TYPES}.py").read_text()
    roots = {
        (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name.split(".")[0]
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    stdlib = {"__future__", "collections", "csv", "dataclasses", "datetime", "hashlib", "json", "math", "os"}
    assert roots <= stdlib | {"pathlib", "typing", "torch"}, roots
