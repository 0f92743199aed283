"""The command line answers quickly: every help and argument error in a fresh process, without torch or
transformers (measured by benchmarks/bench_cli_startup.py; this keeps it, with a margin)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/

from benchmarks.bench_cli_startup import BAD_FLAG, commands, heavy_imports, run_once  # noqa: E402
from modeling_tagclip.cli import VERBS  # noqa: E402

CPU_LIMIT_S = 2.0  # the benchmark measures about 0.1-0.2 s; `import torch` alone takes about 1.8 s


def test_every_verb_and_its_help_and_a_bad_flag_are_measured():
    names = [name for name, _ in commands()]
    assert names[0] == "tagclip --help"
    assert {f"tagclip {verb} --help" for verb in VERBS} | {
        f"tagclip {verb} {BAD_FLAG}" for verb in VERBS
    } == set(names[1:])


@pytest.mark.slow
@pytest.mark.parametrize(("name", "args"), commands(), ids=[name for name, _ in commands()])
def test_help_and_argument_errors_come_before_torch_and_transformers(name, args):
    cpu, _, status = run_once(args)
    assert status == (2 if name.endswith(BAD_FLAG) else 0), name
    assert cpu < CPU_LIMIT_S, f"{name}: {cpu:.2f} s of CPU"
    assert heavy_imports(args) == [], name


@pytest.mark.slow
def test_the_import_check_sees_torch_when_it_is_imported():
    assert heavy_imports(["-c", "import torch"]) == ["torch"]
