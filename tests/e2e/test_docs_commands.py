"""Every command in the bash blocks of the README and the docs pages.

Fast tier: each command is parsed by the real parser of its program (the `tagclip` verb's argparse, `tagclip
train`'s settings check, accelerate's and torchrun's launchers, the demo's and benchmark scripts' parsers), so a
flag or verb that does not exist, or a value of the wrong type, fails with the page and the line.

Slow tier: the commands run, in page order, in a tiny project: the main job's own command trains a tiny model
into ``outputs/tagclip-synthetic`` first, and every later command finds what it names there. The names a page
uses for the reader's own files map to the fixture's through `SUBSTITUTIONS` (and training runs get `TINY_RUN`
appended); commands that cannot run here are listed in `NOT_RUN` with the reason, and are still parsed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from fixtures import REPO_ROOT, TINY_TRAIN_ARGS

from modeling_tagclip.cli import MAIN_JOB

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {"<", ">", ">>"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# programs that are not this project's commands: the shell's and pip's own
OTHER_PROGRAMS = {".", "pip", "printf", "bash"}
# python FILE: the function that parses its arguments (module, function)
PYTHON_FILES = {
    "app.py": ("app", "_parse_args"),
    "benchmarks/gpu_report.py": ("benchmarks.gpu_report", "parse_args"),
    "benchmarks/bench_rerank.py": ("benchmarks.bench_rerank", "parse_args"),
}
# python -m MODULE that are not this project's commands
OTHER_MODULES = {"venv", "pytest"}


@dataclass(frozen=True)
class Command:
    """One simple command of a page: its program and arguments, leading variables and redirections."""

    page: str
    line: int
    argv: tuple[str, ...]
    env: tuple[str, ...] = ()
    redirects: tuple[tuple[str, str], ...] = ()

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def text(self) -> str:
        return " ".join((*self.env, shlex.join(self.argv), *(f"{op} {name}" for op, name in self.redirects)))


def _simple_commands(tokens: list[str]) -> Iterator[tuple[list[str], list[str], list[tuple[str, str]]]]:
    """Split a line's tokens at `&&`, `;`, `|`, `&` into (env, argv, redirects); ``[--flag VALUE]`` (an optional
    part, as a page writes it) counts as written without the brackets."""
    env, argv, redirects = [], [], []
    tokens = iter(tokens)
    for token in tokens:
        if token in SEPARATORS:
            if argv:
                yield env, argv, redirects
            env, argv, redirects = [], [], []
        elif token in REDIRECTS:
            redirects.append((token, next(tokens)))
        elif not argv and ENV_ASSIGNMENT.match(token):
            env.append(token)
        else:
            if token.startswith("[-"):
                token = token[1:]
            argv.append(token[:-1] if token.endswith("]") and "[" not in token else token)
    if argv:
        yield env, argv, redirects


def page_commands(page: Path) -> list[Command]:
    """The commands of every bash block of ``page``, with the line each starts on (continuations joined)."""
    text, found = page.read_text(), []
    name = str(page.relative_to(REPO_ROOT))
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).splitlines()
        i = 0
        while i < len(lines):
            start, logical = i, lines[i]
            while logical.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                logical = logical.rstrip()[:-1] + " " + lines[i]
            i += 1
            for env, argv, redirects in _simple_commands(shlex.split(logical, comments=True)):
                found.append(Command(name, first + start, tuple(argv), tuple(env), tuple(redirects)))
    return found


COMMANDS = [command for page in PAGES for command in page_commands(page)]


# ----------------------------------------------------------------------------- parsing with the real parsers


class CommandError(Exception):
    """A documented command that its program refuses."""


@contextlib.contextmanager
def _refusals(prog: str) -> Iterator[None]:
    """argparse's error (usage on stderr, exit 2) or a settings error as one `CommandError` naming ``prog``."""
    from modeling_tagclip.engine.config import ConfigError

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            yield
    except SystemExit as done:
        if done.code not in (0, None):
            message = err.getvalue().strip().splitlines() or [str(done.code)]
            raise CommandError(f"{prog}: {message[-1]}") from None
    except ConfigError as error:
        raise CommandError(f"{prog}: {error}") from None


def parse_verb(args: list[str]) -> None:
    """`tagclip VERB ARGS`: the verb's parser (`tagclip train`'s also with its full settings check), nothing run;
    every flag in the spelling `--help` shows (an old name or an underscore spelling parses, but is not taught)."""
    from modeling_tagclip.cli import VERBS, build_parser, parse
    from modeling_tagclip.flags import visible_flags

    if not args or args[0] not in VERBS:
        raise CommandError(f"tagclip: unknown command {args[:1]} (verbs: {', '.join(VERBS)})")
    verb, rest = args[0], args[1:]
    shown = visible_flags(build_parser(verb))
    hidden = [
        word.split("=")[0] for word in rest if word.startswith("--") and word.split("=")[0] not in shown
    ]
    if hidden:
        raise CommandError(f"tagclip {verb}: {hidden[0]} is not the spelling `tagclip {verb} --help` shows")
    if verb == "train":
        from modeling_tagclip.engine.config import parse_args

        with _refusals("tagclip train"):
            parse_args(rest)
        return
    with _refusals(f"tagclip {verb}"):
        parse(verb, rest)


def parse_launcher(parser: argparse.ArgumentParser, prog: str, args: list[str]) -> None:
    """A launcher's own flags with its parser, then what it starts: `-m modeling_tagclip.cli VERB ...` or
    `training/train.py ...`."""
    with _refusals(prog):
        launch = parser.parse_args(args)
    config = getattr(launch, "config_file", None)
    if config and not (REPO_ROOT / config).is_file():
        raise CommandError(f"{prog}: --config_file {config} is not a file of the repository")
    script, rest = launch.training_script, list(launch.training_script_args)
    if launch.module and script == "modeling_tagclip.cli":
        parse_verb(rest)
    elif not launch.module and script == "training/train.py":
        parse_verb(["train", *rest])
    else:
        raise CommandError(f"{prog}: starts {script!r}, not `-m modeling_tagclip.cli` or training/train.py")


def parse_python(args: list[str]) -> None:
    """`python FILE ARGS` with the file's parser (`PYTHON_FILES`), `python -m modeling_tagclip.cli VERB ...`."""
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module == "modeling_tagclip.cli":
            return parse_verb(rest)
        if module not in OTHER_MODULES:
            raise CommandError(f"python -m {module}: not a documented route (use `tagclip <verb>`)")
        return None
    if args[0] not in PYTHON_FILES:
        raise CommandError(f"python {args[0]}: no parser known for it (add it to PYTHON_FILES)")
    module, function = PYTHON_FILES[args[0]]
    with _refusals(f"python {args[0]}"):
        getattr(importlib.import_module(module), function)(args[1:])
    return None


def _accelerate_parser() -> argparse.ArgumentParser:
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser()


def _torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def check(command: Command) -> None:
    """Raise `CommandError` when the command's program refuses it."""
    prog, *args = command.argv
    parsers: dict[str, Callable[[list[str]], None]] = {
        "tagclip": parse_verb,
        "python": parse_python,
        "python3": parse_python,
        "torchrun": lambda rest: parse_launcher(_torchrun_parser(), "torchrun", rest),
    }
    if prog == "accelerate":
        if args[:1] != ["launch"]:
            raise CommandError(f"accelerate {args[:1]}: the docs use `accelerate launch` only")
        parse_launcher(_accelerate_parser(), "accelerate launch", args[1:])
    elif prog in parsers:
        parsers[prog](args)
    elif prog not in OTHER_PROGRAMS:
        raise CommandError(f"{prog}: not a program the docs may use (tagclip, accelerate, torchrun, python)")


def test_commands_are_found_on_every_page_that_has_a_bash_block():
    pages = {command.page for command in COMMANDS}
    assert {
        "README.md",
        "docs/getting-started.md",
        "docs/search.md",
        "docs/training.md",
        "docs/hub.md",
    } <= pages
    verbs = {c.argv[1] for c in COMMANDS if c.argv[0] == "tagclip"}
    assert {
        "index",
        "search",
        "serve",
        "remove",
        "eval",
        "push",
        "export",
        "convert",
        "dtg",
        "ablate",
    } <= verbs
    assert any(c.argv[:2] == ("accelerate", "launch") for c in COMMANDS)


def test_the_collector_splits_lines_joins_continuations_and_reads_optional_parts(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```bash\nA=1 tagclip x --y [--z 3]   # note\n"
        "tagclip a \\\n    'b c' < q.txt && pip install . & tagclip d\n```\n"
    )
    with mock.patch(f"{__name__}.REPO_ROOT", tmp_path):
        found = page_commands(page)
    assert [(c.line, c.env, c.argv, c.redirects) for c in found] == [
        (3, ("A=1",), ("tagclip", "x", "--y", "--z", "3"), ()),
        (4, (), ("tagclip", "a", "b c"), (("<", "q.txt"),)),
        (4, (), ("pip", "install", "."), ()),
        (4, (), ("tagclip", "d"), ()),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        "tagclip serch --index g 'a man'",  # an unknown verb
        "tagclip search --index g --topk 5 'a man'",  # an unknown flag
        "tagclip search --index g -k five 'a man'",  # a value of the wrong type
        "tagclip export onnx model",  # a required argument missing
        "accelerate launch training/train.py --max_stpes 3",  # a training setting that does not exist
        "accelerate launch training/train.py --config nope",  # a recipe that does not ship
        "accelerate launch --num_processes two training/train.py",  # a launcher flag of the wrong type
        "accelerate launch --config_file nowhere.yaml training/train.py",
        "torchrun --nproc_per_node 2 -m modeling_tagclip.cli idx",
        "python -m modeling_tagclip.data.synthetic --out d",  # not a documented route
        "python app.py --dtype fp8",
        "curl https://example.com",
    ],
)
def test_a_typo_in_a_documented_command_is_refused(bad):
    with pytest.raises(CommandError):
        check(Command("page.md", 1, tuple(shlex.split(bad))))


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_documented_command_parses(command):
    try:
        check(command)
    except CommandError as error:
        pytest.fail(f"{command.where}: `{command.text}`\n{error}", pytrace=False)


def test_the_main_job_is_one_command_in_the_readme_the_docs_and_the_demo():
    import app

    readme = (REPO_ROOT / "README.md").read_text()
    assert f" && {MAIN_JOB}\n```" in readme  # the install line ends with it
    assert f"```bash\n{MAIN_JOB}\n```" in (REPO_ROOT / "docs" / "getting-started.md").read_text()
    assert app.MAIN_JOB == MAIN_JOB and MAIN_JOB in app._missing_model_message("m")
    fallback = re.search(
        r'except ImportError:.*?\n\s+MAIN_JOB = "([^"]+)"', (REPO_ROOT / "app.py").read_text(), re.S
    )
    assert fallback and fallback.group(1) == MAIN_JOB  # a Space without the package shows the same command


# ----------------------------------------------------------------------------- running them on a tiny project

# (pattern, reason): commands that cannot run here; they are still parsed above
NOT_RUN = [
    (r"^python3? -m venv|^\. \.venv|^pip install", "sets up the environment these tests already run in"),
    (r"^bash tests/setup_browser\.sh|^python -m pytest", "the test suite itself"),
    (
        r"--multi_gpu|^torchrun",
        "several processes on GPUs (tests/engine/test_train.py and "
        "tests/retrieval/test_index_accelerate.py run two CPU processes)",
    ),
    (
        r"--dynamo_backend",
        "torch.compile with inductor: minutes of CPU (tests/models/test_compile.py compiles)",
    ),
    (
        r"--config tag-pedes|--data CARGO/|--data path/to/CARGO",
        "a real dataset (TAG-PEDES, CARGO) that is not shipped",
    ),
    (r"^tagclip push (?!.*--dry-run)", "uploads to the Hub: an account and network"),
    (
        r"^tagclip convert (tagpr|visa)",
        "an official checkpoint file (tests/models/test_convert_tagclip.py and "
        "tests/models/test_convert_visa.py convert synthetic ones)",
    ),
    (
        r"^tagclip ablate",
        "dozens of trainings (tests/e2e/test_ablate.py runs a micro study through `tagclip ablate`)",
    ),
    (
        r"^python app\.py",
        "serves the demo until stopped (tests/e2e/test_app_browser.py drives it in a browser)",
    ),
    (r"^python benchmarks/gpu_report\.py", "measures a GPU (tests/e2e/test_gpu_report.py runs its CPU mode)"),
    (
        r"^tagclip ingest rtsp://",
        "a live camera (tests/video/test_stream.py serves a stream on the loopback "
        "network, drops it and resumes)",
    ),
]
# (pattern, replacement, why): a page's names for the reader's own files -> the tiny project's
SUBSTITUTIONS = [
    (r"(?<= )M(?= )", "outputs/tagclip-synthetic/best", "M: a trained model folder"),
    (r"runs/tagclip(?= )", "outputs/tagclip-synthetic/best", "runs/tagclip: a trained model folder"),
    (r"path/to/local-vlm", "tiny-vlm", "a local VLM: a random 2-layer LLaVA"),
    (r"--image-size 384 128", "--image-size 32 16", "the converted CLIP's crop size: the tiny one's"),
]
TINY_RUN = [*TINY_TRAIN_ARGS, "--max-steps", "2"]
TINY_VISA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=[32, 16],
    patch_size=8,
    patch_stride=[4, 4],
    num_experts=3,
    num_prompt_tokens=2,
    expert_intermediate_size=64,
    graph_top_k=8,
    fusion_intermediate_size=64,
)
TINY_RUN_REID = [
    "--model-config",
    json.dumps(TINY_VISA),
    "--batch-size",
    "8",
    "--num-instances",
    "2",
    "--plots",
    "false",
    "--max-steps",
    "2",
]


def not_run_reason(command: Command) -> str | None:
    return next((reason for pattern, reason in NOT_RUN if re.search(pattern, command.text)), None)


def runnable(command: Command) -> str:
    """The command as it runs in the tiny project: names substituted, tiny sizes appended to a training."""
    text = shlex.join(command.argv)
    for pattern, replacement, _ in SUBSTITUTIONS:
        text = re.sub(pattern, replacement, text)
    if "training/train.py" in text or text.startswith("tagclip train"):
        text += " " + shlex.join(TINY_RUN_REID if "--task reid" in text else TINY_RUN)
    return " ".join((*command.env, text, *(f"{op} {name}" for op, name in command.redirects)))


# the main job and the ViSA job first: every later command uses what they write
FIRST = (MAIN_JOB, "accelerate launch training/train.py --task reid")
RUN = sorted(
    (c for c in COMMANDS if not_run_reason(c) is None), key=lambda c: shlex.join(c.argv) not in FIRST
)
# a command documented on several pages runs once, named by every place that shows it
_PLACES: dict[str, list[Command]] = {}
for _command in RUN:
    _PLACES.setdefault(runnable(_command), []).append(_command)
DISTINCT = [places[0] for places in _PLACES.values()]
DISTINCT_IDS = ["+".join(c.where for c in places) for places in _PLACES.values()]
SHELL = """tagclip() { "$PY" -m modeling_tagclip.cli "$@"; }
accelerate() { "$ACCELERATE" "$@"; }
python() { "$PY" "$@"; }
"""


def test_every_command_runs_or_says_why_not():
    skipped = [c for c in COMMANDS if not_run_reason(c)]
    assert len(RUN) >= 30 and len(skipped) < len(RUN)
    for pattern, _ in NOT_RUN:  # no stale entry
        assert any(re.search(pattern, c.text) for c in skipped), pattern
    for pattern, _, _ in SUBSTITUTIONS:
        assert any(re.search(pattern, shlex.join(c.argv)) for c in RUN), pattern
    assert {shlex.join(c.argv) for c in RUN[:3]} == set(FIRST)  # the main job is on two pages
    runs = {c.argv[1] for c in RUN if c.argv[0] == "tagclip"} | {"train"}
    assert runs >= {"train", "eval", "index", "search", "serve", "remove", "push", "export", "convert", "dtg"}


def _crops(root: Path, images: list[Path]) -> None:
    """The pages' `crops/` (with `cam7/0001.png`, hit id 3084d0af5d8363fe, and `day2/cam7/000123.jpg`),
    `crops.csv` (with tracks), `my_crops/`, `attrs.json` and a crop of a person to search with, `her.jpg`, from
    the synthetic test crops."""
    import shutil

    from PIL import Image

    names = ["cam7/0001.png", "cam7/0002.png", "cam3/0001.png", "cam3/0002.png", "day2/cam7/000123.jpg"]
    rows = ["path,view,camera,timestamp,tags,track"]
    for i, (name, image) in enumerate(zip(names, images, strict=False)):
        (root / "crops" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.open(image).convert("RGB").save(root / "crops" / name)
        camera = name.split("/")[-2][3:]
        view = "aerial" if int(camera) >= 7 else "ground"
        track = 2 if name.startswith("day2/") else 1  # search.md's `--track 7:1`: cam7/0001.png and 0002.png
        rows.append(f"{name},{view},{camera},2026-01-01T10:{10 + i}:00,{'backpack' if i % 2 else ''},{track}")
    (root / "crops.csv").write_text("\n".join(rows) + "\n")
    Image.open(images[0]).convert("RGB").save(root / "her.jpg")
    (root / "my_crops").mkdir()
    for image in images[:4]:
        shutil.copy(image, root / "my_crops" / image.name)
    (root / "attrs.json").write_text(
        json.dumps({image.name: {"coat": "red", "backpack": True} for image in images})
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A checkout's `training/` and what a reader brings: a Hugging Face CLIP folder, a local VLM, crops; the
    synthetic re-ID set rendered small (the ViSA job would render 200 identities)."""
    from fixtures import REAL_TEXT, build_tiny_vlm, tiny_clip_config
    from transformers import CLIPModel

    from modeling_tagclip.data.synthetic_reid import generate_reid_dataset

    root = tmp_path_factory.mktemp("docs-project")
    (root / "training").symlink_to(REPO_ROOT / "training")  # the pages run from a checkout
    (root / "docs" / "images").mkdir(parents=True)  # ... which has the docs' image folder
    clip = tiny_clip_config()
    clip.text_config.update(REAL_TEXT)  # the CLIP vocabulary, as a real CLIP folder has
    CLIPModel(clip).save_pretrained(root / "clip-vit-base-patch16")
    build_tiny_vlm(root / "tiny-vlm")
    generate_reid_dataset(
        root / "data" / "synthetic_reid", num_identities=8, image_size=(32, 16), progress=False
    )
    return root


@pytest.mark.slow
@pytest.mark.parametrize("command", DISTINCT, ids=DISTINCT_IDS)
def test_documented_command_runs(command, project):
    import os
    import subprocess
    import sys

    from fixtures import repo_env

    if command.argv[:2] != ("accelerate", "launch") and not (project / "crops").exists():
        test_images = sorted((project / "data" / "synthetic" / "images" / "test").rglob("*.png"))
        assert test_images, "the main job ran first and rendered data/synthetic"
        _crops(project, test_images[:6])
    env = repo_env(
        project,
        HF_HUB_OFFLINE="1",
        PY=sys.executable,
        ACCELERATE=str(Path(sys.executable).with_name("accelerate")),
    )
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    script = runnable(command)
    done = subprocess.run(
        ["bash", "-c", SHELL + script],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, f"{command.where}: `{script}`\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, f"{command.where}: `{script}`\n{done.stderr[-3000:]}"


def test_the_package_runs_as_a_module_only_through_its_front_door():
    """`tagclip VERB` (or `python -m modeling_tagclip.cli VERB` under a launcher): no module of the package
    is a second `python -m` route."""
    routes = [
        str(path.relative_to(REPO_ROOT))
        for path in (REPO_ROOT / "modeling_tagclip").rglob("*.py")
        if re.search(r"""^if __name__ == ["']__main__["']""", path.read_text(), re.MULTILINE)
    ]
    assert routes == [], f"use a `tagclip` verb, or a function for library use: {routes}"
