"""Hub units are self-contained: code shared between TAG-CLIP and ViSA is copied, and the copies stay identical.

Like transformers' "Copied from" convention: a `# Copied from package.module.Name with A->B, C->D` comment stands
before the copy (a class, a function or a module-level constant); the original's source, with the replacements
applied in order, must equal the copy. Every module of the package is scanned: the family units and the
self-contained serving files shipped to the Hub (retrieval/encode.py, retrieval/handler.py).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "modeling_tagclip"
COPIED = re.compile(r"^# Copied from ([\w.]+)\.(\w+)(?: with (.+))?$")
UNITS = {"tagclip": PACKAGE / "tagclip", "visa": PACKAGE / "visa"}


def _sources(path: Path) -> dict[str, str]:
    """Source of every top-level class, function and assigned name (``A, B = ...`` gives both names)."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
            out[node.name] = "".join(lines[start : node.end_lineno])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for name in (n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                out[name] = "".join(lines[node.lineno - 1 : node.end_lineno])
    return out


def _copies() -> list[tuple[Path, str, str, str, list[tuple[str, str]]]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for index, line in enumerate(lines):
            match = COPIED.match(line)
            if match:
                name = re.match(r"(?:class |def )?(\w+)", lines[index + 1]).group(1)
                pairs = [tuple(p.split("->")) for p in match.group(3).split(", ")] if match.group(3) else []
                found.append((path, name, match.group(1), match.group(2), pairs))
    return found


def test_there_are_copies_to_check():
    assert len(_copies()) >= 4


@pytest.mark.parametrize("filename", ["encode.py", "handler.py"])
def test_serving_files_copy_the_eq14_score_and_view_names(filename):
    """The Hub-shipped serving files hold checked copies of Eq. 14 and the view names, not their own."""
    copied = {(module, original) for path, _, module, original, _ in _copies() if path.name == filename}
    assert ("modeling_tagclip.tagclip.modeling_tagclip", "eq14_similarity") in copied
    assert ("modeling_tagclip.tagclip.configuration_tagclip", "VIEW_NAMES") in copied


@pytest.mark.parametrize("path, name, module, original, pairs", _copies())
def test_copy_matches_original(path, name, module, original, pairs):
    source = Path(importlib.util.find_spec(module).origin)
    expected = _sources(source)[original]
    for old, new in pairs:
        expected = expected.replace(old, new)
    assert _sources(path)[name] == expected, f"{path.name}:{name} drifted from {module}.{original}"


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_hub_unit_imports_only_siblings(unit):
    """A Hub unit's modules import each other relatively, never another folder of the package."""
    for path in UNITS[unit].glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level in (0, 1), f"{path.name} imports from outside its unit: level {node.level}"
                if node.level == 0:
                    assert not (node.module or "").startswith("modeling_tagclip"), (
                        f"{path.name}: {node.module}"
                    )
