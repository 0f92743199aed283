"""A saved TAG-CLIP folder loads and runs in a fresh venv that has only the packages its model card lists.

The venv is a real one (no system site packages, so neither ftfy nor this project leaks in), filled by pip
from its cache with the card's packages at the versions of constraints.txt.
"""

from __future__ import annotations

import json
import re
import subprocess
import venv
from pathlib import Path

import pytest
import torch
from fixtures import REPO_ROOT, clean_env, save_tiny_model
from PIL import Image

pytestmark = pytest.mark.slow

FIND_SPECS = "import importlib.util as u; print([u.find_spec(n) for n in ('ftfy', 'modeling_tagclip')])"
CARD = REPO_ROOT / "modeling_tagclip" / "hub" / "cards" / "tagclip_card.md"

LOAD = """
import json, sys, warnings
from PIL import Image
from transformers import AutoModel, AutoProcessor, pipeline

folder, query, *paths = sys.argv[1:]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    inputs = processor(text=[query, query], images=[Image.open(p) for p in paths])
    logits = model(**inputs).logits_per_text[0].tolist()
    retrieve = pipeline("text-to-person-retrieval", model=folder, trust_remote_code=True)
    hits = retrieve(query, gallery=paths, top_k=2)
print(json.dumps({
    "logits": logits,
    "hits": [[hit["path"], hit["score"]] for hit in hits],
    "ftfy_warnings": [str(w.message) for w in caught if w.category.__name__ == "FtfyMissingWarning"],
}))
"""


def card_packages() -> list[str]:
    """The packages the card's Usage section names ("Needs `torch`, `transformers ...`, ...; nothing else")."""
    line = re.search(r"Needs (.*?); nothing else", CARD.read_text(encoding="utf-8"), re.S).group(1)
    return [name.split()[0] for name in re.findall(r"`([^`]+)`", line)]


@pytest.fixture(scope="module")
def card_venv(tmp_path_factory) -> Path:
    """The python of a new venv with only the card's packages installed (constraints.txt's versions)."""
    env_dir = tmp_path_factory.mktemp("card-venv")
    venv.create(env_dir, system_site_packages=False, with_pip=True)
    python = env_dir / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q", "-c", str(REPO_ROOT / "constraints.txt")]
    subprocess.run([*install, *card_packages()], check=True, timeout=600, capture_output=True)
    return python


def test_the_card_lists_the_packages_the_test_installs():
    assert card_packages() == ["torch", "transformers", "pillow", "huggingface_hub"]


def test_a_saved_folder_loads_and_runs_the_pipeline_with_only_the_cards_packages(card_venv, tmp_path):
    folder = save_tiny_model(tmp_path / "model")
    paths = [tmp_path / f"crop{i}.png" for i in range(3)]
    for i, path in enumerate(paths):
        Image.new("RGB", (16, 32), (200 * (i == 0), 200 * (i == 1), 200 * (i == 2))).save(path)
    missing = subprocess.run(
        [str(card_venv), "-I", "-c", FIND_SPECS],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert missing.stdout.strip() == "[None, None]"

    query = "a man in a red coat with a black backpack"
    result = subprocess.run(
        [str(card_venv), "-I", "-c", LOAD, str(folder), query, *map(str, paths)],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report["ftfy_warnings"]) == 1 and "curly quotes" in report["ftfy_warnings"][0]

    from modeling_tagclip import TagClipModel, TagClipProcessor

    model, processor = TagClipModel.from_pretrained(folder).eval(), TagClipProcessor.from_pretrained(folder)
    with torch.inference_mode():  # the package with ftfy: the same caption, the same scores
        inputs = processor(text=[query, query], images=[Image.open(p) for p in paths])
        expected = model(**inputs).logits_per_text[0]
    torch.testing.assert_close(torch.tensor(report["logits"]), expected, atol=1e-5, rtol=0)
    assert len(report["hits"]) == 2 and report["hits"][0][1] >= report["hits"][1][1]
    assert {path for path, _ in report["hits"]} <= set(map(str, paths))
