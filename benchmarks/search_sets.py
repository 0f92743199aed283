"""A real-model embedding set for ``bench_search.py --model PATH``: a trained TAG-CLIP's embeddings of the
synthetic test crops it was evaluated on plus rendered distractors (the gallery), and of the test captions (the
queries, alternately held-out and test).

The test split is rendered again, crop for crop, from the run's ``synthetic.*`` settings (the ``config.json`` beside
the model folder, or the folder's own parent's; ``generate_dataset``'s defaults for the rest): the same pixels
and captions as ``modeling_tagclip.data.synthetic.generate_dataset`` writes. Distractors are identities of
another seed (``DISTRACTOR_SEED + seed``), one crop per view each, never in the test split.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modeling_tagclip.data.synthetic import (
    AERIAL,
    GROUND,
    image_captions,
    person_descriptions,
    plan_identities,
    render_person,
)

SPLIT_DEFAULTS = {  # generate_dataset's defaults, for settings the run's config.json does not give
    "num_identities": 260,
    "seed": 0,
    "image_size": [128, 64],
    "images_per_view": 2,
    "test_fraction": 0.25,
    "ground_only_fraction": 0.2,
    "aerial_only_fraction": 0.2,
}
DISTRACTOR_SEED = 1000  # distractor identities: plan_identities of seed DISTRACTOR_SEED + seed


def split_settings(model: Path) -> dict[str, Any]:
    """The synthetic settings the model was trained and tested on: ``synthetic.*`` of the run's config.json
    (the model folder's parent; its own when none), else ``generate_dataset``'s defaults."""
    settings = dict(SPLIT_DEFAULTS)
    for config in (model.parent / "config.json", model / "config.json"):
        data = json.loads(config.read_text()) if config.is_file() else {}
        given = {k.split(".", 1)[1]: v for k, v in data.items() if k.startswith("synthetic.")}
        if given:
            settings.update({k: json.loads(v) if isinstance(v, str) else v for k, v in given.items()})
            settings["source"] = config.name if config.parent == model else f"../{config.name}"
            break
    return settings


def test_crops(settings: dict[str, Any]) -> tuple[list, list[str]]:
    """(PIL crops, their captions in crop order) of the test split ``generate_dataset`` renders."""
    seed, size = int(settings["seed"]), tuple(settings["image_size"])
    plan = plan_identities(
        int(settings["num_identities"]),
        seed,
        float(settings["test_fraction"]),
        float(settings["ground_only_fraction"]),
        float(settings["aerial_only_fraction"]),
    )
    per_view = int(settings.get("test_images_per_view") or settings["images_per_view"])
    crops, captions = [], []
    for person in (p for p in plan if p["split"] == "test"):
        views = {"ground": [GROUND], "aerial": [AERIAL], "both": [AERIAL, GROUND]}[person["views"]]
        for view in views:
            for k in range(per_view):
                rng = np.random.default_rng([seed, 1, person["id"], view, k])
                crops.append(render_person(person["attributes"], view, rng, size))
                captions.extend(image_captions(person["attributes"], seed, person["id"], view, k))
    return crops, captions


def test_people(settings: dict[str, Any]) -> list[int]:
    """The person of each crop ``test_crops`` renders, in crop order (each crop has two captions, in order)."""
    plan = plan_identities(
        int(settings["num_identities"]),
        int(settings["seed"]),
        float(settings["test_fraction"]),
        float(settings["ground_only_fraction"]),
        float(settings["aerial_only_fraction"]),
    )
    per_view = int(settings.get("test_images_per_view") or settings["images_per_view"])
    views = {"ground": 1, "aerial": 1, "both": 2}
    return [p["id"] for p in plan if p["split"] == "test" for _ in range(views[p["views"]] * per_view)]


def distractor_crops(count: int, seed: int, size: tuple[int, int]) -> list:
    """``count`` crops of identities of seed ``DISTRACTOR_SEED + seed``: each seen once from the air and once
    from the ground."""
    people = plan_identities((count + 1) // 2, DISTRACTOR_SEED + seed, 0.0, 0.0, 0.0)
    crops = []
    for i in range(count):
        person, view = people[i // 2], (AERIAL, GROUND)[i % 2]
        rng = np.random.default_rng([DISTRACTOR_SEED + seed, 1, person["id"], view, 0])
        crops.append(render_person(person["attributes"], view, rng, size))
    return crops


def model_set(
    path: str, distractors: int, seed: int = 0
) -> tuple[dict, dict, dict, dict[str, Any], dict, dict[str, dict]]:
    """(gallery fp16 ``global``/``local``, held-out queries, test queries, info, people, calibration queries):
    the model's embeddings of the test crops + ``distractors`` rendered crops and of the test captions (even
    ones held out, odd ones test); ``people`` gives the person of each gallery row (-1: a distractor) and of
    each test query; calibration queries by name: ``queries``, the model's embeddings of the person
    descriptions ``tagclip index --ann`` calibrates a new index on (``index_build.CALIBRATION_TEXTS``), and
    ``captions``, the held-out captions (what a user's ``--calibration-texts`` gives)."""
    from modeling_tagclip.retrieval.cli import load_model
    from modeling_tagclip.retrieval.embedded.index_build import CALIBRATION_TEXTS
    from modeling_tagclip.retrieval.encode import encode_images, encode_texts

    start = time.perf_counter()
    model, processor = load_model(path)
    model.eval()
    settings = split_settings(Path(path))
    crops, captions = test_crops(settings)
    crops += distractor_crops(distractors, seed, tuple(settings["image_size"]))
    rendered = time.perf_counter() - start
    with torch.inference_mode():
        images = encode_images(model, processor, crops, batch_size=64)
        texts = encode_texts(model, processor, captions)
        described = encode_texts(model, processor, person_descriptions(CALIBRATION_TEXTS))
    calibration = {key: value.float() for key, value in described.items() if key in ("global", "local")}
    gallery = {key: images[key].half() for key in ("global", "local") if key in images}
    held_out = {key: value[0::2].float() for key, value in texts.items()}
    test = {key: value[1::2].float() for key, value in texts.items()}
    people = torch.tensor(test_people(settings))  # test caption j describes test crop j
    people = {"gallery": torch.cat([people, torch.full((distractors,), -1)]), "test": people}
    info = {
        "model": Path(path).name,
        "split": {k: v for k, v in settings.items()},
        "test_crops": len(crops) - distractors,
        "distractors": distractors,
        "distractor_seed": DISTRACTOR_SEED + seed,
        "captions": len(captions),
        "render_s": round(rendered, 1),
        "encode_s": round(time.perf_counter() - start - rendered, 1),
    }
    return gallery, held_out, test, info, people, {"queries": calibration, "captions": held_out}
