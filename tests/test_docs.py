"""Documentation references: nothing cites files outside the repository, and every `docs/<page>.md §N` exists."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".cfg", ".toml", ".sh", ".txt"}
SKIP_PARTS = {".git", ".cache", "build", "dist", "hf_suite", "clip_vocab", "__pycache__", "results"}
# notes that only exist on the machine the project was written on: shared/spec/*.md, "spec §4", "spec ``x.md``"
OUTSIDE = re.compile(r"shared/|/work/|\bspec ?§|\bspec/[\w-]+\.md|\bspec ``|\bspec [\w-]+\.md")
CITATION = re.compile(r"docs/([\w-]+\.md) §(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?")
HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)?)[. ]", re.MULTILINE)


def _skipped(folder: str) -> bool:
    return folder in SKIP_PARTS or folder.startswith(".venv") or folder.endswith(".egg-info")


def project_files() -> list[Path]:
    """Text files of the project (virtual environments, caches and vendored data pruned)."""
    files = []
    for root, folders, names in os.walk(REPO_ROOT):
        folders[:] = [f for f in folders if not _skipped(f)]
        files += [Path(root) / name for name in names if Path(name).suffix in SUFFIXES]
    return files


def outside_references(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if OUTSIDE.search(line)]


def sections(page: Path) -> set[str]:
    return set(HEADING.findall(page.read_text()))


def test_patterns_catch_outside_references_only():
    cited = 'x = 1  # spec §4\n"""facts: shared/spec/tag-clip.md"""\n(spec ``visa.md`` §7)\n# spec tag-clip.md §5\n'
    assert len(outside_references(cited)) == 4
    assert outside_references("see docs/visa-reference.md §6.2 and importlib.util.find_spec(name)\n") == []
    assert sections(REPO_ROOT / "docs" / "visa-reference.md") >= {"0", "1.2", "2.4", "6.2", "7"}


def test_no_reference_to_files_outside_the_repository():
    this = Path(__file__).resolve()
    found = {
        str(path.relative_to(REPO_ROOT)): lines
        for path in project_files()
        if path.resolve() != this and (lines := outside_references(path.read_text(errors="replace")))
    }
    assert not found, f"cite the paper, the reference code's function or a docs/ page instead: {found}"


def test_docs_citations_name_existing_sections():
    missing, cited = [], 0
    for path in project_files():
        for page, first, last in CITATION.findall(path.read_text(errors="replace")):
            cited += 1
            target = REPO_ROOT / "docs" / page
            known = sections(target) if target.is_file() else set()
            missing += [f"{path.name}: docs/{page} §{n}" for n in (first, last) if n and n not in known]
    assert cited > 10 and not missing, missing
