"""Every Python snippet of the README and the docs runs, against a tiny model saved where the snippets expect
the main job's (``outputs/tagclip-synthetic/best``) and a tiny synthetic set in ``data/synthetic``; the README's
search commands run on them too. A snippet that cannot run here is preceded by ``<!-- snippet: skip (REASON) -->``
with a REASON from ``SKIP_REASONS``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import REPO_ROOT, repo_env, save_tiny_model, synthetic_gallery

FENCE = re.compile(
    r"(?:<!-- snippet: skip \((?P<reason>[^)]*)\) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)```", re.DOTALL
)
SKIP_REASONS = {
    "needs the Hub": "a repository on huggingface.co and network access",
    "needs a Milvus collection": "a gallery indexed into Milvus by the page's commands (pymilvus, milvus-lite)",
    "needs a sentence-transformers folder": "a model folder saved with its sentence-transformers modules",
}
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def snippets(lang: str) -> list[tuple[str, str | None, str]]:
    """(page:index, skip reason or None, code) of every fenced block in `lang`."""
    found = []
    for page in PAGES:
        blocks = [m for m in FENCE.finditer(page.read_text()) if m.group("lang") == lang]
        found += [(f"{page.name}:{i}", m.group("reason"), m.group("body")) for i, m in enumerate(blocks)]
    return found


PYTHON = snippets("python")


def test_snippets_are_found_and_skips_are_justified():
    assert len(PYTHON) >= 6
    bad = [
        (where, reason) for where, reason, _ in PYTHON if reason is not None and reason not in SKIP_REASONS
    ]
    assert not bad, f"unknown skip reasons (known: {sorted(SKIP_REASONS)}): {bad}"
    assert sum(reason is None for _, reason, _ in PYTHON) >= 5


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A folder laid out as after the main job, with a tiny model, a tiny synthetic set and its index."""
    root = tmp_path_factory.mktemp("project")
    save_tiny_model(root / "outputs" / "tagclip-synthetic" / "best")
    synthetic_gallery(root / "data" / "synthetic")
    return root


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = repo_env(cwd, HF_HUB_OFFLINE="1")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_readme_search_commands_run(project):
    """The README's `tagclip index` and `tagclip search` lines, as written, on the tiny model."""
    readme = (REPO_ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith(("tagclip index", "tagclip search"))]
    commands = [
        line for line in commands if "synthetic-footage" not in line
    ]  # after ingest: test_docs_commands
    assert len(commands) == 3
    for command in commands:
        argv = [
            sys.executable,
            "-m",
            "modeling_tagclip.cli",
            *shlex.split(command)[1:],
        ]
        done = run(argv, project)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    assert "query: a woman in a red coat" in done.stdout and "rank" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("where", "reason", "code"), PYTHON, ids=[where for where, _, _ in PYTHON])
def test_python_snippet_runs(where, reason, code, project):
    if reason is not None:
        pytest.skip(f"{where}: {reason} ({SKIP_REASONS[reason]})")
    if "gallery.idx" in code and not (project / "gallery.idx").exists():
        argv = [
            "index",
            "--model",
            "outputs/tagclip-synthetic/best",
            "--images",
            "data/synthetic/images/test",
            "--out",
            "gallery.idx",
            "--quiet",
        ]
        assert run([sys.executable, "-m", "modeling_tagclip.cli", *argv], project).returncode == 0
    done = run([sys.executable, "-c", code], project)
    assert done.returncode == 0, f"{where}\n{code}\n{done.stderr[-3000:]}"
