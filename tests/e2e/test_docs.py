"""Documentation: references stay inside the repository, published figures equal their results files, the README
is an entry point without history, links resolve and the site builds (`mkdocs build --strict`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
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


# ---------------------------------------------------------------------------------------------------------
# Figures: every published table is rendered from its results file (benchmarks/render.py)
# ---------------------------------------------------------------------------------------------------------


def _figure_root(tmp_path: Path, machine: dict | None) -> Path:
    """A tiny repository: one results file (with `machine` as its record) and a page showing it."""
    import json

    (tmp_path / "docs").mkdir()
    (tmp_path / "results.json").write_text(
        json.dumps(
            {"rows": [{"n": 1, "s": 0.25}, {"n": 8, "s": 2.0}], **({"machine": machine} if machine else {})}
        )
    )
    (tmp_path / "README.md").write_text("intro\n<!-- figure: demo -->\nold numbers\n<!-- /figure -->\nend\n")
    return tmp_path


def _demo_figures():
    from benchmarks.render import Column, Figure

    return {"demo": Figure("demo", "results.json", (Column("n", "n"), Column("s", "s", "{:.2f}")), "make it")}


def test_machine_record_names_what_a_figure_needs():
    from benchmarks.common import machine_record
    from benchmarks.render import has_record

    record = machine_record()
    assert record["cpu"]["model"] and record["cpu"]["logical_cpus"] >= 1 and record["torch_threads"] >= 1
    assert (
        len(record["load_average"]) == 3
        and record["date"].endswith("+00:00")
        and "torch" in record["versions"]
    )
    assert isinstance(record["cpu"]["flags"], list) and "gpu" in record
    assert has_record({"machine": {**record, "command": "python x.py", "commit": "abc"}})
    assert not has_record({"machine": {"cpu": "AMD EPYC", "torch_threads": 1}})  # the old, partial record


def test_render_rewrites_regions_and_check_names_the_stale_page(tmp_path):
    from benchmarks.common import machine_record
    from benchmarks.render import stale_pages

    machine = {**machine_record(), "command": "python bench.py --threads 1", "commit": "0123456789abcdef"}
    root, figures = _figure_root(tmp_path, machine), _demo_figures()
    assert stale_pages(figures, root) == [root / "README.md"]  # check mode: nothing written
    assert "old numbers" in (root / "README.md").read_text()
    assert stale_pages(figures, root, write=True) == [root / "README.md"]
    text = (root / "README.md").read_text()
    assert "| 1 | 0.25 |\n| 8 | 2.00 |" in text and "old numbers" not in text
    assert "`python bench.py --threads 1` at commit 0123456789ab" in text and text.endswith(
        "<!-- /figure -->\nend\n"
    )
    assert stale_pages(figures, root) == []  # rendering is a fixed point


def test_render_without_a_record_says_not_measured_and_unknown_names_fail(tmp_path):
    from benchmarks.render import RenderError, stale_pages

    root, figures = _figure_root(tmp_path, None), _demo_figures()
    stale_pages(figures, root, write=True)
    text = (root / "README.md").read_text()
    assert "Not measured: `make it` writes `results.json`" in text and "0.25" not in text
    (root / "docs" / "page.md").write_text("<!-- figure: nope -->\n<!-- /figure -->\n")
    with pytest.raises(RenderError, match=r"docs/page.md: unknown figure 'nope'"):
        stale_pages(figures, root)


def test_render_appends_the_rows_of_more_files_with_their_own_records(tmp_path):
    import json

    from benchmarks.common import machine_record
    from benchmarks.render import Column, Figure, render

    machine = {**machine_record(), "command": "python bench.py --n 1 8", "commit": "0123456789abcdef"}
    root = _figure_root(tmp_path, machine)
    figure = Figure(
        "demo",
        "results.json",
        (Column("n", "n"), Column("s", "s", "{:.2f}")),
        "make it",
        more=[("big.json", "make big")],
    )
    assert render(figure, root) == "Not measured: `make big` writes `big.json`.\n"
    big = {**machine, "command": "python bench.py --n 300", "commit": "fedcba9876543210"}
    (root / "big.json").write_text(json.dumps({"rows": [{"n": 300, "s": 7.5}], "machine": big}))
    text = render(figure, root)
    assert "| 1 | 0.25 |\n| 8 | 2.00 |\n| 300 | 7.50 |\n" in text
    assert text.index("`python bench.py --n 1 8` at commit 0123456789ab") < text.index(
        "`python bench.py --n 300` at commit fedcba987654"
    )


def test_render_orders_the_rows_of_all_files_by_the_figures_key(tmp_path):
    import json

    from benchmarks.common import machine_record
    from benchmarks.render import Column, Figure, RenderError, render

    machine = {**machine_record(), "command": "python bench.py --n 1 8", "commit": "0123456789abcdef"}
    root = _figure_root(tmp_path, machine)
    middle = {**machine, "command": "python bench.py --n 4", "commit": "fedcba9876543210"}
    (root / "middle.json").write_text(json.dumps({"rows": [{"n": 4, "s": 1.5}], "machine": middle}))
    columns = (Column("n", "n"), Column("s", "s", "{:.2f}"))
    figure = Figure(
        "demo",
        "results.json",
        columns,
        "make it",
        more=[("middle.json", "make middle")],
        order=lambda row: row["n"],
    )
    text = render(figure, root)
    assert "| 1 | 0.25 |\n| 4 | 1.50 |\n| 8 | 2.00 |\n" in text
    assert "at commit 0123456789ab" in text and "at commit fedcba987654" in text
    unordered = Figure("demo", "results.json", columns, "make it", more=[("middle.json", "make middle")])
    assert "| 1 | 0.25 |\n| 8 | 2.00 |\n| 4 | 1.50 |\n" in render(unordered, root)
    broken = Figure("demo", "results.json", columns, "make it", order=lambda row: row["size"])
    with pytest.raises(RenderError, match=r"figure demo: cannot order its rows \(KeyError\('size'\)\)"):
        render(broken, root)


def test_a_figure_note_made_from_its_results_file(tmp_path):
    from benchmarks.common import machine_record
    from benchmarks.render import Column, Figure, RenderError, render

    machine = {**machine_record(), "command": "python bench.py", "commit": "0123456789abcdef"}
    root, columns = _figure_root(tmp_path, machine), (Column("n", "n"),)
    noted = Figure("demo", "results.json", columns, "make it", note=lambda data: f"{len(data['rows'])} rows.")
    assert "| 8 |\n\n2 rows.\n\nMeasured by" in render(noted, root)
    missing = Figure("demo", "results.json", columns, "make it", note=lambda data: f"{data['epochs']} epochs")
    with pytest.raises(
        RenderError, match=r"figure demo: results.json lacks the field its note needs 'epochs'"
    ):
        render(missing, root)


def test_published_figures_equal_their_results_files():
    from benchmarks.figures import FIGURES
    from benchmarks.render import stale_pages

    stale = [str(page.relative_to(REPO_ROOT)) for page in stale_pages(FIGURES, REPO_ROOT)]
    assert not stale, f"pages differ from their results files: {stale}; run `python -m benchmarks.render`"


# ---------------------------------------------------------------------------------------------------------
# The README and the documentation site
# ---------------------------------------------------------------------------------------------------------

HISTORY = re.compile(r"this session|previous (round|session)|the issue'?s|no gpu was lent", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def doc_pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def test_readme_is_an_entry_point_without_history():
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "accelerate launch" in readme and "training/train.py" in readme and "python -m pytest" in readme
    found = {p.name: m.group(0) for p in doc_pages() if (m := HISTORY.search(p.read_text()))}
    assert not found, f"docs speak to users, not about the project's history: {found}"


def test_history_pattern_catches_history():
    assert HISTORY.search("The issue's target is not met") and HISTORY.search("as the previous round printed")
    assert not HISTORY.search("Resume after a crash: the previous checkpoint is kept")


def test_getting_started_names_every_extra():
    import configparser

    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    extras = list(setup["options.extras_require"])
    text = (REPO_ROOT / "docs" / "getting-started.md").read_text()
    assert len(extras) >= 8 and [extra for extra in extras if f"`{extra}`" not in text] == []


def test_relative_links_in_readme_and_docs_exist():
    missing = [
        f"{page.name}: {target}"
        for page in doc_pages()
        for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not missing, missing


@pytest.mark.slow
def test_mkdocs_site_builds_strict(tmp_path):
    """`mkdocs build --strict` (the `docs` extra; CI installs it, where its absence fails the test)."""
    import importlib.util
    import subprocess
    import sys

    if (
        importlib.util.find_spec("mkdocs") is None
        or importlib.util.find_spec("mkdocstrings_handlers") is None
    ):
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail("the docs extra is not installed in CI: pip install -e '.[docs]'")
        pytest.skip("the docs extra is not installed: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "performance" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    targets = re.findall(r"^::: (\S+)", (REPO_ROOT / "docs" / "api.md").read_text(), re.M)
    classes = [t for t in targets if t.rsplit(".", 1)[-1][:1].isupper()]
    assert {
        "TagClipConfig",
        "TagClipModel",
        "TagClipProcessor",
        "ViSAConfig",
        "ViSAModel",
        "ViSAForReID",
    } <= {t.rsplit(".", 1)[-1] for t in classes}
    for target in targets:  # every documented class and module has its own heading
        assert re.search(rf'<h3 id="{re.escape(target)}"[^>]*class="doc doc-heading"', api), target
    config = api[api.index(f'id="{next(t for t in classes if t.endswith(".TagClipConfig"))}"') :]
    args = config[: config.index("</ul>")]  # the Args section: a list, one item per argument
    assert args.count("<li") >= 10 and "projection_dim" in args and "lambda_ortho" in args


def test_mainjob_seeds_collects_rows_mean_and_record(tmp_path, capsys):
    import json

    from benchmarks.mainjob_seeds import MAIN_JOB, main
    from benchmarks.render import has_record

    readme = (REPO_ROOT / "README.md").read_text()
    assert "accelerate " + " ".join(MAIN_JOB) in readme  # the harness runs the README's main job

    for seed, r1 in ((0, 20.0), (1, 26.0)):
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        metrics = {"R@1": r1, "R@5": 50.0, "R@10": 70.0, "mAP": 25.0, "mINP": 12.0, "train_time_s": 400.0}
        result = {**metrics, "best_step": 900, "torch_threads": 2, "num_processes": 1}
        (run / "eval_results.json").write_text(json.dumps(result))
    out = main(
        [
            "--collect",
            str(tmp_path / "seed0"),
            str(tmp_path / "seed1"),
            "--output",
            str(tmp_path / "runs.json"),
        ]
    )
    data = json.loads(out.read_text())
    assert [row["seed"] for row in data["rows"]] == ["seed0", "seed1", "mean ± 95% CI"]
    assert (
        data["rows"][2]["R@1"] == "23.00 ± 38.12" and data["rows"][0]["wall_s"] == 400.0
    )  # t(0.975, 1) = 12.706
    assert data["rows"][0]["threads"] == data["rows"][2]["threads"] == 2
    assert has_record(data)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["--collect", str(tmp_path / "empty"), "--output", str(tmp_path / "x.json")])
    assert "empty/eval_results.json: not a finished run" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_site_nav_lists_every_page_once():
    import yaml

    site = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())

    def pages(entries) -> list[str]:
        found = []
        for entry in entries:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                found += pages(value) if isinstance(value, list) else [value]
        return found

    listed = pages(site["nav"])
    assert len(listed) == len(set(listed)), (
        f"pages listed twice: {sorted({p for p in listed if listed.count(p) > 1})}"
    )
    assert set(listed) == {page.name for page in (REPO_ROOT / "docs").glob("*.md")}
