"""Run transformers' own common model tests (ModelTesterMixin, ConfigTester) against TAG-CLIP and ViSA.

The upstream test mixins are not part of the transformers wheel, but the PyPI sdist ships them. This script:

1. downloads the sdist of exactly the installed transformers version with `pip download --no-deps
   --no-binary :all:` (cached under `$HF_SUITE_DIR/sdist`, so reruns need no network);
2. builds a scratch tree `$HF_SUITE_DIR/tree-<version>/` holding the upstream `tests/test_modeling_common.py`,
   `test_configuration_common.py` and `test_pipeline_mixin.py`, three stub modules the sdist lacks
   (`exporters/test_export.py`, `generation/test_utils.py`, `utils/test_configuration_utils.py`), a `pytest.ini`
   with the upstream markers, and our model tests as `tests/models/tagclip/test_modeling_tagclip.py`
   and `tests/models/visa/test_modeling_visa.py` (copied from `tests/hf_suite/test_tagclip_hf_common.py` and
   `tests/hf_suite/test_visa_hf_common.py`), and the overrides they share as `tests/models/hf_overrides.py`;
3. runs pytest there with `HF_HUB_OFFLINE=1` and `PYTHONPATH=<repo root>`.

Usage: `python tests/hf_suite/setup_suite.py [--build-only] [pytest args...]`. `HF_SUITE_DIR` defaults to
`<repo>/.cache/hf_suite`. The exit status is pytest's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import tomllib

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
# Our model test modules, each copied into the scratch tree as tests/models/<name>/test_modeling_<name>.py.
MODEL_TESTS = {"tagclip": HERE / "test_tagclip_hf_common.py", "visa": HERE / "test_visa_hf_common.py"}
# Overrides both model test modules import as `..hf_overrides`, copied to tests/models/hf_overrides.py.
SHARED_OVERRIDES = HERE / "hf_overrides.py"
UPSTREAM_FILES = ("test_modeling_common.py", "test_configuration_common.py", "test_pipeline_mixin.py")

# Stubs for modules the sdist does not ship; each holds only what the copied files import.
STUBS = {
    # ModelTesterMixin inherits from it; the export tests need optional backends (executorch, ...).
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    # Only used in issubclass checks; TAG-CLIP and ViSA are not generative.
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    # The 5.x keys of the upstream tests/utils/test_configuration_utils.py (used by ConfigTester).
    "utils/test_configuration_utils.py": (
        "config_common_kwargs = {\n"
        '    "return_dict": False,\n'
        '    "output_hidden_states": True,\n'
        '    "output_attentions": True,\n'
        '    "dtype": "float16",\n'
        '    "chunk_size_feed_forward": 5,\n'
        '    "architectures": ["BertModel"],\n'
        '    "id2label": {0: "label"},\n'
        '    "label2id": {"label": "0"},\n'
        '    "problem_type": "regression",\n'
        "}\n"
    ),
}


def transformers_version() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def suite_dir() -> Path:
    return Path(os.environ.get("HF_SUITE_DIR", REPO_ROOT / ".cache" / "hf_suite")).resolve()


def fetch_sdist(version: str, cache: Path) -> Path:
    """The transformers sdist of `version`, downloaded once into `cache`."""
    target = cache / f"transformers-{version}.tar.gz"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"transformers=={version}",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "-d",
            tmp,
        ]
        print("hf_suite: " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        found = list(Path(tmp).glob("transformers-*.tar.gz"))
        if len(found) != 1:
            raise RuntimeError(f"pip download produced {found}, expected one transformers sdist")
        os.replace(found[0], target)  # atomic: a partial download never looks cached
    return target


BUILTIN_MARKS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings", "timeout"}


def pytest_ini(pyproject_text: str, sources: list[str]) -> str:
    """A pytest.ini registering the upstream markers.

    Those of the sdist's pyproject.toml, plus the ones upstream's conftest.py (not in the sdist) registers that
    the copied files use (`accelerate_tests`, `torch_compile_test`, ...) and `slow` (transformers.testing_utils).
    """
    options = tomllib.loads(pyproject_text).get("tool", {}).get("pytest", {}).get("ini_options", {})
    markers = list(options.get("markers", []))
    known = {m.split(":")[0].strip() for m in markers} | BUILTIN_MARKS
    used = {"slow"}
    for text in sources:
        used |= set(re.findall(r"\bmark\.([A-Za-z_]\w*)", text))
    markers += [f"{name}: registered by tests/hf_suite/setup_suite.py" for name in sorted(used - known)]
    lines = ["[pytest]", "markers ="] + [f"    {marker}" for marker in markers]
    return "\n".join(lines) + "\n"


def build_tree(version: str, root: Path) -> Path:
    """Create (or refresh) the scratch test tree for `version`; return its root."""
    sdist = fetch_sdist(version, root / "sdist")
    tree = root / f"tree-{version}"
    tests = tree / "tests"
    prefix = f"transformers-{version}/"
    with tarfile.open(sdist) as tar:
        members = {name: prefix + "tests/" + name for name in UPSTREAM_FILES}
        members["pyproject.toml"] = prefix + "pyproject.toml"
        contents = {}
        for name, member in members.items():
            handle = tar.extractfile(member)
            if handle is None:
                raise RuntimeError(f"{member} missing from {sdist}")
            contents[name] = handle.read()
    for package in (
        "",
        "exporters",
        "generation",
        "utils",
        "models",
        *(f"models/{name}" for name in MODEL_TESTS),
    ):
        (tests / package).mkdir(parents=True, exist_ok=True)
        (tests / package / "__init__.py").write_text("")
    for name in UPSTREAM_FILES:
        (tests / name).write_bytes(contents[name])
    for name, text in STUBS.items():
        (tests / name).write_text(text)
    ours = [*MODEL_TESTS.values(), SHARED_OVERRIDES]
    sources = [contents[name].decode() for name in UPSTREAM_FILES] + [path.read_text() for path in ours]
    (tree / "pytest.ini").write_text(pytest_ini(contents["pyproject.toml"].decode(), sources))
    for name, path in MODEL_TESTS.items():
        shutil.copyfile(path, tests / "models" / name / f"test_modeling_{name}.py")
    shutil.copyfile(SHARED_OVERRIDES, tests / "models" / SHARED_OVERRIDES.name)
    return tree


def main(argv: list[str]) -> int:
    build_only = "--build-only" in argv
    pytest_args = [a for a in argv if a != "--build-only"]
    version = transformers_version()
    tree = build_tree(version, suite_dir())
    print(f"hf_suite: transformers {version}, tree {tree}", flush=True)
    if build_only:
        return 0
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *(f"tests/models/{name}" for name in MODEL_TESTS),
        "-c",
        "pytest.ini",
        "--rootdir",
        ".",
        "-p",
        "no:cacheprovider",
        "-q",
        *pytest_args,
    ]
    return subprocess.run(cmd, cwd=tree, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
