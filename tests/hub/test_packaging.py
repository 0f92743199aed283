"""The wheel built from setup.cfg: one top-level package, the data files it needs, and working outside a checkout.

The wheel is built (offline, no build isolation) from a copy of the files the build reads, so the checkout
gets no `build/` or `*.egg-info`; it is then installed into a throwaway venv that sees this environment's
dependencies but not the checkout or its editable install.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from fixtures import TINY_TRAIN_ARGS

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_INPUTS = ("setup.cfg", "pyproject.toml", "README.md", "modeling_tagclip", "training")
PACKAGE_DATA = (
    "modeling_tagclip/hub/cards/tagclip_card.md",
    "modeling_tagclip/hub/cards/visa_card.md",
    "modeling_tagclip/retrieval/handler.py",
    "modeling_tagclip/models/tagclip/clip_vocab/vocab.json",
    "modeling_tagclip/models/tagclip/clip_vocab/merges.txt",
    "modeling_tagclip/models/tagclip/clip_vocab/LICENSE",
    "modeling_tagclip/recipes/default.yaml",
    "modeling_tagclip/recipes/tag-pedes.yaml",
    "modeling_tagclip/recipes/visa-cargo.yaml",
    "modeling_tagclip/recipes/visa-synthetic.yaml",
)


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in BUILD_INPUTS:
        src = REPO_ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, source / name)
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    _run([*pip, "-w", str(out), str(source)])
    (built,) = out.glob("tag_clip-*.whl")
    return built


@pytest.mark.slow
def test_wheel_has_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = archive.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    roots = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert roots == {"modeling_tagclip"}, f"generic top-level names in the wheel: {sorted(roots)}"
    assert not any(name.startswith("training/") for name in names)
    assert "modeling_tagclip/models/tagclip/modeling_tagclip.py" in top_level


@pytest.mark.slow
def test_wheel_ships_cards_handler_and_vocabulary(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        missing = [name for name in PACKAGE_DATA if name not in names]
        assert not missing, f"not in the wheel: {missing}"
        for name in PACKAGE_DATA:
            assert archive.read(name) == (REPO_ROOT / name).read_bytes(), name
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt")))
    assert "tagclip = modeling_tagclip.cli:main" in entry_points.decode()


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(venv folder, its site-packages, a clean environment) with the wheel installed outside the checkout."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([str(python), "-c", purelib]).stdout.strip())
    # this environment's dependencies as plain path entries: their .pth files (the editable install's finder)
    # are not processed, so only the wheel can provide modeling_tagclip
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_test_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    install = ["install", "--no-deps", "--no-index", "-q", str(wheel)]
    _run([sys.executable, "-m", "pip", "--python", str(python), *install])
    env = {
        "PATH": f"{env_dir / 'bin'}:/usr/bin:/bin",
        "HF_HUB_OFFLINE": "1",
        "HOME": str(env_dir),
        "OMP_NUM_THREADS": "1",
    }
    return env_dir, site, env


@pytest.mark.slow
def test_installed_wheel_lists_its_recipes_and_trains_with_a_named_one(installed, tmp_path):
    """`pip install tag-clip`: `tagclip train --list_configs` and 2 steps of the `default` recipe, by name."""
    env_dir, site, env = installed
    tagclip = str(env_dir / "bin" / "tagclip")
    listing = _run([tagclip, "train", "--list_configs"], cwd=tmp_path, env=env).stdout
    assert {"default", "tag-pedes", "visa-cargo", "visa-synthetic"} <= {
        line.split()[0] for line in listing.splitlines()[:-1]
    }
    assert str(site.resolve()) in listing.splitlines()[-1]  # read from the installed package, not a checkout
    tiny = [*TINY_TRAIN_ARGS]
    done = _run(
        [tagclip, "train", "--config", "default", "--max_steps", "2", "--output_dir", "out", *tiny],
        cwd=tmp_path,
        env=env,
    )
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["best_step"] in (1, 2) and 0 <= results["R@1"] <= 100
    assert (tmp_path / "data" / "synthetic" / "train_reid.json").is_file()  # rendered where the user runs it
    assert "tagclip search --index" in done.stdout  # the last lines say what to do next with the model


@pytest.mark.slow
def test_installed_wheel_finds_its_cards_outside_the_checkout(installed, tmp_path):
    """`pip install` of the wheel: push_to_hub's default card template and handler resolve in site-packages."""
    env_dir, site, env = installed
    python = env_dir / "bin" / "python"
    work = tmp_path / "elsewhere"
    work.mkdir()
    probe = (
        "import importlib.util, modeling_tagclip\n"
        "from modeling_tagclip.hub.tagclip import TEMPLATE as DEFAULT_TEMPLATE, HANDLER_FILE\n"
        "from modeling_tagclip.hub.visa import TEMPLATE as VISA_TEMPLATE\n"
        "from modeling_tagclip.models.tagclip.processing_tagclip import build_tokenizer\n"
        "assert importlib.util.find_spec('training') is None, 'training is importable'\n"
        "print(modeling_tagclip.__file__)\n"
        "for path in (DEFAULT_TEMPLATE, VISA_TEMPLATE, HANDLER_FILE):\n"
        "    assert path.is_file(), path\n"
        "    print(path)\n"
        "print(build_tokenizer()('a woman in a red coat')['input_ids'][:3])\n"
    )
    lines = _run([str(python), "-I", "-c", probe], cwd=work, env=env).stdout.splitlines()
    assert all(Path(line).resolve().is_relative_to(site.resolve()) for line in lines[:4]), lines
    assert lines[-1] == "[49406, 320, 2308]"
