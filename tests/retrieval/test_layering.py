"""The gallery's layering, read from the code with ``ast``: no module under ``retrieval/`` imports a private
name of another module, the two backends do not import each other and stand on one floor, and the types module
imports nothing of the package."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
from fixtures import REPO_ROOT

RETRIEVAL = REPO_ROOT / "modeling_tagclip" / "retrieval"
PACKAGE = "modeling_tagclip.retrieval"
EMBEDDED = "embedded"  # the embedded backend: a subpackage, one room of retrieval/
MILVUS = "milvus"
TYPES = "gallery_types"


def _name(path: Path) -> str:
    """``retrieval/embedded/ann.py`` -> ``embedded.ann``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(RETRIEVAL).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path): path for path in sorted(RETRIEVAL.rglob("*.py")) if _name(path)}


def _imports(module: str) -> list[tuple[str, str | None]]:
    """(module, name) of every import in ``module`` (``embedded.ann``) of ``retrieval``, relative ones resolved
    to their module name inside ``retrieval``, at any depth (function-level imports count); ``from . import x``
    of a module ``x`` is (``x``, None)."""
    path = MODULES[module]
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [node.module])])
            elif (node.module or "").startswith(f"{PACKAGE}."):
                base = node.module.removeprefix(f"{PACKAGE}.")
            else:
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}".lstrip(".")
                found.append((submodule, None) if submodule in MODULES else (base, alias.name))
        elif isinstance(node, ast.Import):
            found += [
                (a.name.removeprefix(f"{PACKAGE}."), None)
                for a in node.names
                if a.name.startswith(f"{PACKAGE}.")
            ]
    return found


def _room(module: str) -> str:
    """The room of ``retrieval/`` a module stands in: its file, or its subpackage as a whole."""
    return module.split(".")[0]


@cache
def _floor(room: str) -> int:
    """1 for a room that imports nothing of ``retrieval/``, else one above the highest room it imports."""
    below = {_room(source) for module in MODULES if _room(module) == room for source, _ in _imports(module)}
    return 1 + max((_floor(other) for other in below - {room, ""}), default=0)


def test_the_walk_reads_real_imports():
    assert ("gallery_types", "SearchFilter") in _imports("embedded.gallery_index")
    assert ("embedded.index_store", "read_rows") in _imports("embedded.ann")  # a sibling in the subpackage
    assert ("embedded.index_store", None) in _imports("cli")  # `from .embedded import index_store as store`
    assert ("milvus", "MilvusGallery") in _imports("store")


def test_the_floors_are_counted_from_the_imports():
    assert _floor(TYPES) == 1 and _floor("encode") == 1  # they import nothing of the package
    assert _floor("ingest") == _floor("encode") + 1
    assert _floor("cli") > _floor("indexing") > max(_floor(EMBEDDED), _floor(MILVUS))


def test_the_two_backends_stand_on_one_floor_above_the_types():
    assert _floor(EMBEDDED) == _floor(MILVUS), {EMBEDDED: _floor(EMBEDDED), MILVUS: _floor(MILVUS)}
    assert _floor(EMBEDDED) > max(_floor(TYPES), _floor("encode"), _floor("ingest"))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_is_imported_from_another_module(module):
    private = [f"{source}.{name}" for source, name in _imports(module) if name and name.startswith("_")]
    assert private == [], f"{module} imports private names {private}"


def test_the_backends_do_not_import_each_other():
    for module in MODULES:
        rooms = {_room(source) for source, _ in _imports(module)}
        if _room(module) == EMBEDDED:
            assert MILVUS not in rooms, module
        if _room(module) == MILVUS:
            assert EMBEDDED not in rooms, module


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
