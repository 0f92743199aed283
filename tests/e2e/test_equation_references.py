"""Equation references name their paper ("TAG-PR Eq. 14", "ViSA Eq. 14", "k-reciprocal Eq. 3"): both papers
have an Eq. 14. A docstring that opens with "PAPER Eq. N:" defines that equation, and each equation of each
paper is defined by one function."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAPERS = ("TAG-PR", "ViSA", "k-reciprocal")
EQUATION = re.compile(r"(?<![\w-])Eqs?\.\s?\d")
DEFINITION = re.compile(rf"^({'|'.join(map(re.escape, PAPERS))}) Eqs?\. (\d+)(?:[-–](\d+))?:")
SCANNED = ["modeling_tagclip/**/*.py", "modeling_tagclip/**/*.md", "docs/**/*.md", "README.md", "app.py"]
SCANNED += ["benchmarks/*.py", "training/*.py", "utils/*.py", "tests/**/*.py"]


def _fix_copies():
    spec = importlib.util.spec_from_file_location("fix_copies", ROOT / "utils" / "fix_copies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unprefixed(text: str) -> list[str]:
    """The equation references of ``text`` that no paper name precedes, with their line."""
    found = []
    for match in EQUATION.finditer(text):
        before = text[: match.start()]
        if not before.endswith(tuple(f"{paper} " for paper in PAPERS)):
            found.append(text.splitlines()[before.count("\n")].strip())
    return found


def definitions(source: str) -> list[tuple[str, int, str]]:
    """(paper, equation, function) for every docstring of ``source`` that opens with "PAPER Eq. N[-M]:"."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            match = DEFINITION.match(ast.get_docstring(node) or "")
            if match:
                first, last = int(match[2]), int(match[3] or match[2])
                out += [(match[1], n, node.name) for n in range(first, last + 1)]
    return out


def test_the_checks_see_a_bare_reference_and_a_definition():
    assert unprefixed("the Eq. 14 score, TAG-PR Eq. 14 and ViSA Eq. 3") == [
        "the Eq. 14 score, TAG-PR Eq. 14 and ViSA Eq. 3"
    ]
    assert unprefixed("ViSA Eq. 14 and k-reciprocal Eq. 3") == []
    source = 'def f():\n    """TAG-PR Eq. 11-13: total."""\n\n\ndef g():\n    """ViSA Eq. 7 as coded."""\n'
    assert definitions(source) == [("TAG-PR", 11, "f"), ("TAG-PR", 12, "f"), ("TAG-PR", 13, "f")]


def test_every_equation_reference_names_its_paper():
    files = sorted({path for pattern in SCANNED for path in ROOT.glob(pattern)} - {Path(__file__).resolve()})
    bare = [f"{path.relative_to(ROOT)}: {line}" for path in files for line in unprefixed(path.read_text())]
    assert bare == [], (
        "equation references without their paper (write TAG-PR Eq. N, ViSA Eq. N):\n" + "\n".join(bare)
    )


def test_each_equation_is_defined_by_one_function():
    generated = {
        ROOT / "modeling_tagclip" / target for target in [*_fix_copies().WHOLE, *_fix_copies().REGIONS]
    }
    defined: dict[tuple[str, int], list[str]] = {}
    for path in sorted((ROOT / "modeling_tagclip").rglob("*.py")):
        if path in generated:
            continue
        for paper, number, name in definitions(path.read_text()):
            defined.setdefault((paper, number), []).append(f"{path.relative_to(ROOT)}:{name}")
    assert ("TAG-PR", 14) in defined and ("ViSA", 14) in defined  # the two papers' Eq. 14 stay apart
    twice = {f"{paper} Eq. {n}": where for (paper, n), where in defined.items() if len(where) > 1}
    assert twice == {}, f"equations defined by more than one function: {twice}"
