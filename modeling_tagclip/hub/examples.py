"""Two example crops (aerial, ground) for the card's usage snippet: from the evaluated split, else synthetic."""

from __future__ import annotations

import json
from pathlib import Path

from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND, VIEW_NAMES

DEFAULT_QUERY = "a young woman in a red jacket with a black backpack"
Example = tuple[Path, str, str]  # (image, view name, caption)


def dataset_examples(data_dir: Path, split: str) -> list[Example]:
    """The first aerial and the first ground image of a TAG-PEDES-style split, with a caption each."""
    records = json.loads((data_dir / f"{split}_reid.json").read_text())
    picked: dict[int, Example] = {}
    for record in records:
        view = int(record.get("cam_id", 1))
        image = data_dir / "images" / record["file_path"]
        if view in (AERIAL, GROUND) and view not in picked and image.is_file():
            picked[view] = (image, VIEW_NAMES[view], record["captions"][0])
    return [picked[v] for v in sorted(picked)]


def rendered_examples(out: Path, size: tuple[int, int]) -> list[Example]:
    """Two synthetic crops (aerial, ground) of one identity drawn by modeling_tagclip.data.synthetic."""
    import numpy as np

    from modeling_tagclip.data.synthetic import make_captions, render_person, sample_identity

    rng = np.random.default_rng(7)
    attrs = sample_identity(rng)
    caption = make_captions(attrs, rng)[0]
    examples = []
    for view, name in enumerate(VIEW_NAMES):
        path = out / f"render_{name}.png"
        render_person(attrs, view, np.random.default_rng([7, view]), size).save(path)
        examples.append((path, name, caption))
    return examples


def stage_examples(
    out: Path, size: tuple[int, int], results: dict | None = None
) -> tuple[list[str], list[str], str]:
    """Write two example crops to ``out/examples``; returns (repo paths, views, query).

    They come from the split that ``results`` were measured on (its ``data`` and ``split``) when that split
    has an aerial and a ground image, else they are rendered synthetically at ``size`` (height, width).
    """
    from PIL import Image

    examples: list[Example] = []
    data = Path(str((results or {}).get("data", "")))
    split = str((results or {}).get("split", "test"))
    if results and (data / f"{split}_reid.json").is_file():
        examples = dataset_examples(data, split)
    folder = out / "examples"
    folder.mkdir(parents=True, exist_ok=True)
    if len(examples) < 2:
        examples = rendered_examples(folder, size)
    names = []
    for image, view, _ in examples:
        with Image.open(image) as img:
            img.convert("RGB").save(folder / f"{view}.png")
        names.append(f"examples/{view}.png")
    for leftover in folder.glob("render_*.png"):
        leftover.unlink()
    query = examples[-1][2] if examples else DEFAULT_QUERY
    return names, [v for _, v, _ in examples], query
