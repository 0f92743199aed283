"""Diversified Text Generation (DTG): caption re-ID person crops with a local multimodal LLM into TAG-PEDES JSON.

    python -m training.dtg --images DIR --model LOCAL_VLM_DIR --out train_reid.json
    python -m training.dtg --dataset reid.json [--image-dir DIR] --model LOCAL_VLM_DIR --out train_reid.json
        [--attributes attrs.json] [--quality-check] [--filter] [--limit N] [--do-sample --seed S]

Strategies (paper, "Text Generation"; prompts verbatim in ``PROMPT_BASED``, ``TEMPLATE_BASED``,
``ATTRIBUTE_BASED``): prompt-based, template-based (``{template}`` = one template sampled from
``training.dtg_templates.TEMPLATES`` or ``--templates``) and attribute-based (the image's attribute labels and a
template). Mixing rule, two captions per image: attribute-based plus one of prompt/template picked at random when
the image has labels, else prompt-based plus template-based. All choices use ``random.Random(f"{seed}|{file_path}")``
so they depend only on the seed and the image, not on order, batch size or resumption.

Image ids (``--images``): ``--id-from auto`` takes the integer at the start of the file name (after optional
letters: ``0002_c1s1_000451_03.jpg`` -> 2, ``P0101T...jpg`` -> 101), else at the start of the parent folder
name (``0007/img.jpg`` -> 7); images with neither are skipped and counted. ``--dataset`` entries keep their
``id``. ``file_path`` is relative to ``--image-dir`` (for ``--images`` default the folder itself; give the
common root, e.g. ``--images root/train --image-dir root``, so that train and test files share one image dir).
View (``cam_id``, 0 aerial / 1 ground): from ``--dataset`` entries, else ``--cam-id``, else a path
folder named aerial/uav/drone (0) or ground/cctv (1); otherwise omitted and the loaders treat it as ground.

Attributes (``--attributes FILE``): JSON mapping an image key to a dict or list of labels, the key being the
relative ``file_path``, the file name, the file stem or the person id (looked up in that order); ``--dataset``
entries may also carry an ``attributes`` field. Dict values: strings/numbers give ``key: value``, true/1 gives
the key alone (``backpack``), false/0/null/empty are left out.

Resume: each finished image is appended to ``OUT.partial.jsonl`` (first line: the settings); a rerun skips the
images there and refuses to mix settings (seed, model, sampling, templates, attributes) unless
``--force-resume``. ``--limit N`` captions only the first N images. The final TAG-PEDES list (``id``,
``file_path``, ``captions``, ``cam_id`` when known) goes to OUT in the source order.

Empty generations (after ``clean_caption``) are retried once (``generator.retry`` if it has one: sampling for
``HFGenerator``); a caption still empty is dropped and counted, an image left without captions is left out.

Quality check (``--quality-check``): the VLM labels each caption Match / Contradictory / Hallucinatory / Vacuous
(``QUALITY_PROMPT``; an answer naming none of them counts as Vacuous and as ``unparsed``); proportions are printed
as the paper's Fig. 3a and written with the labels to ``OUT.quality.json`` (resumable via
``OUT.quality.partial.jsonl``). ``--filter`` drops non-Match captions without regenerating: an image keeps its
Match captions (1 or 2), an image with none is dropped; OUT holds the filtered list and
``OUT.unfiltered.json`` the full one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol, runtime_checkable

from PIL import Image
from tqdm import tqdm

from modeling_tagclip.atomic_io import atomic_write
from modeling_tagclip.flags import accept_both_spellings
from modeling_tagclip.tagclip.configuration_tagclip import AERIAL, GROUND
from training.dtg_templates import TEMPLATES

__all__ = [
    "PROMPT_BASED",
    "TEMPLATE_BASED",
    "ATTRIBUTE_BASED",
    "QUALITY_PROMPT",
    "QUALITY_CATEGORIES",
    "CaptionGenerator",
    "HFGenerator",
    "ImageItem",
    "scan_images",
    "load_dataset_items",
    "load_attributes",
    "attach_attributes",
    "format_attributes",
    "plan_captions",
    "clean_caption",
    "generate_captions",
    "parse_quality",
    "quality_check",
    "filter_records",
    "to_tagpedes",
    "main",
]

logger = logging.getLogger(__name__)

PROMPT_BASED = (
    "Don't mention the background of the people in the image. Please provide a detailed description of this "
    "person's age, gender, top (including color and style), bottom (including color and style), hair "
    "(including color and style), shoes (including color and style), belongings (including color and style). "
    "Finally, combine all the details into a single sentence."
)
TEMPLATE_BASED = (
    "Generate a description about the overall appearance of the person, in a style similar to the template: "
    "{template}. If some requirements in the template are not visible, you can ignore. "
    "Do not imagine any contents not in the image."
)
ATTRIBUTE_BASED = (
    "Generate a description about the overall appearance of the person, based on the attribute: {attributes}, "
    "in a style similar to the template: {template}. If some requirements in the template are not visible, "
    "you can ignore. Do not imagine any contents that are not in the image."
)
QUALITY_CATEGORIES = ("Match", "Contradictory", "Hallucinatory", "Vacuous")
QUALITY_PROMPT = (
    'Here is a description of the person in the image: "{caption}"\n'
    "How well does the description match the person in the image? Answer with exactly one word:\n"
    "Match - the description is accurate and consistent with the image;\n"
    "Contradictory - it states something the image contradicts (e.g. a wrong color, gender or garment);\n"
    "Hallucinatory - it mentions details that are not in the image;\n"
    "Vacuous - it is empty, generic or says almost nothing about the person.\n"
    "Answer:"
)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
VIEW_FOLDERS = {"aerial": AERIAL, "uav": AERIAL, "drone": AERIAL, "ground": GROUND, "cctv": GROUND}
PROGRESS_VERSION = 1


# ----------------------------------------------------------------------------- images and labels


@dataclass
class ImageItem:
    """One image to caption: ``file_path`` is relative to the image dir (POSIX separators)."""

    file_path: str
    id: int
    cam_id: int | None = None
    attributes: str = ""


_LEADING_INT = re.compile(r"^[A-Za-z]*(\d+)")


def _leading_int(name: str) -> int | None:
    match = _LEADING_INT.match(name)
    return int(match.group(1)) if match else None


def parse_id(rel: PurePosixPath, id_from: str = "auto") -> int | None:
    """Person id from a relative image path by the ``--id-from`` rule (see the module docstring)."""
    from_file = _leading_int(rel.name) if id_from in ("auto", "file") else None
    if from_file is not None or id_from == "file":
        return from_file
    return _leading_int(rel.parent.name) if rel.parent.name else None


def view_from_path(rel: PurePosixPath) -> int | None:
    """0/1 from a folder named aerial/uav/drone or ground/cctv in the path, else None."""
    views = {VIEW_FOLDERS[p.lower()] for p in rel.parent.parts if p.lower() in VIEW_FOLDERS}
    return views.pop() if len(views) == 1 else None


def _abs(path: str | Path) -> Path:
    return Path(os.path.abspath(path))


def scan_images(
    image_dir: str | Path,
    id_from: str = "auto",
    cam_id: int | None = None,
    relative_to: str | Path | None = None,
) -> tuple[list[ImageItem], list[str]]:
    """Image files under ``image_dir`` (recursive, sorted) and the paths skipped for lack of an id.

    ``file_path`` is relative to ``relative_to`` (default ``image_dir``; it must contain ``image_dir``).
    """
    root = Path(image_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"--images: {root} is not a directory")
    base = Path(relative_to) if relative_to is not None else root
    if not _abs(root).is_relative_to(_abs(base)):
        raise ValueError(f"--image-dir {base} must contain --images {root}")
    items, skipped = [], []
    for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()):
        rel = PurePosixPath(_abs(path).relative_to(_abs(base)).as_posix())
        pid = parse_id(rel, id_from)
        if pid is None:
            skipped.append(str(rel))
            continue
        view = cam_id if cam_id is not None else view_from_path(rel)
        items.append(ImageItem(str(rel), pid, view))
    if not items:
        raise ValueError(f"no images with a parsable person id under {root} (id rule: --id-from {id_from})")
    return items, skipped


def _dataset_image_dir(dataset: Path, entries: list[dict[str, Any]]) -> Path:
    """Default image dir for ``--dataset``: ``images/`` next to the file if the first entry is there, else its folder."""
    first = next((e.get("file_path") for e in entries if isinstance(e, dict) and e.get("file_path")), None)
    for cand in (dataset.parent / "images", dataset.parent):
        if first is not None and (cand / first).is_file():
            return cand
    raise FileNotFoundError(f"cannot find the images of {dataset}: pass --image-dir")


def _dataset_item(entry: Any, index: int) -> ImageItem:
    if not isinstance(entry, dict) or not isinstance(entry.get("file_path"), str):
        raise ValueError(f"--dataset entry {index} has no 'file_path': {entry!r}")
    try:
        pid = int(entry["id"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"--dataset entry {index} has no integer 'id': {entry!r}") from err
    cam = entry.get("cam_id")
    view = cam if type(cam) is int and cam in (0, 1) else None
    return ImageItem(entry["file_path"], pid, view, format_attributes(entry.get("attributes")))


def load_dataset_items(
    dataset: str | Path, image_dir: str | Path | None = None
) -> tuple[list[ImageItem], Path]:
    """Items from a TAG-PEDES-style JSON list (``id``, ``file_path``, optional ``cam_id``/``attributes``)."""
    path = Path(dataset)
    entries = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of entries")
    root = Path(image_dir) if image_dir is not None else _dataset_image_dir(path, entries)
    items, seen = [], set()
    for index, entry in enumerate(entries):
        item = _dataset_item(entry, index)
        if item.file_path not in seen:
            seen.add(item.file_path)
            items.append(item)
    if len(items) < len(entries):
        logger.warning("%s: %d duplicate file_path entries ignored", path, len(entries) - len(items))
    return items, root


def _label_text(key: str, value: Any) -> str:
    if value is None or value is False or value == "" or value == 0 or value == []:
        return ""
    name = str(key).replace("_", " ")
    if value is True or value == 1:
        return name
    if isinstance(value, (list, tuple)):
        value = " ".join(str(v) for v in value)
    return f"{name}: {value}"


def format_attributes(labels: Any) -> str:
    """Attribute labels as prompt text: dict -> ``"gender: male, age: young, backpack"``, list -> joined."""
    if not labels:
        return ""
    if isinstance(labels, str):
        return labels.strip()
    if isinstance(labels, dict):
        parts = [_label_text(k, v) for k, v in labels.items()]
    elif isinstance(labels, (list, tuple)):
        parts = [str(v).strip() for v in labels if v not in (None, "")]
    else:
        raise ValueError(f"attribute labels must be a dict, list or string, got {labels!r}")
    return ", ".join(p for p in parts if p)


def load_attributes(path: str | Path) -> dict[str, Any]:
    """The ``--attributes`` JSON: a mapping image key -> labels (dict / list / string)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object mapping image keys to attribute labels")
    return data


def _attribute_keys(item: ImageItem) -> Iterable[str]:
    rel = PurePosixPath(item.file_path)
    return (item.file_path, rel.name, rel.stem, str(item.id))


def attach_attributes(items: Sequence[ImageItem], mapping: dict[str, Any]) -> int:
    """Set ``item.attributes`` from ``mapping`` (see the module docstring); returns how many items got labels."""
    found = 0
    for item in items:
        key = next((k for k in _attribute_keys(item) if k in mapping), None)
        if key is not None:
            item.attributes = format_attributes(mapping[key])
            found += bool(item.attributes)
    return found


# ----------------------------------------------------------------------------- strategies


def _fill(prompt: str, template: str, attributes: str = "") -> str:
    return prompt.replace("{template}", template).replace("{attributes}", attributes)


def plan_captions(item: ImageItem, templates: Sequence[str], seed: int = 0) -> list[tuple[str, str]]:
    """The image's two (strategy, prompt) pairs by the paper's mixing rule, seeded per image."""
    if not templates:
        raise ValueError("the template set is empty")
    rng = random.Random(f"{seed}|{item.file_path}")
    if item.attributes:
        strategies = ["attribute", rng.choice(["prompt", "template"])]
    else:
        strategies = ["prompt", "template"]
    picked = rng.sample(list(templates), 2) if len(templates) > 1 else list(templates) * 2
    plan = []
    for strategy, template in zip(strategies, picked, strict=True):
        if strategy == "prompt":
            plan.append((strategy, PROMPT_BASED))
        elif strategy == "template":
            plan.append((strategy, _fill(TEMPLATE_BASED, template)))
        else:
            plan.append((strategy, _fill(ATTRIBUTE_BASED, template, item.attributes)))
    return plan


_CHATTY = [
    re.compile(r"^(?:sure|certainly|of course|okay|ok)\b[!,.]?\s*", re.I),
    re.compile(r"^here(?: is|'s| are)\b[^:\n]{0,80}:\s*", re.I),
    re.compile(r"^(?:description|caption|answer)\s*:\s*", re.I),
    re.compile(
        r"^(?:in )?(?:the|this) (?:image|picture|photo(?:graph)?)\s*"
        r"(?:(?:shows|depicts|features|displays|presents|captures|contains)\s*[:,]?|[:,])\s*",
        re.I,
    ),
]
_MARKDOWN = re.compile(r"\*\*|__|^\s*(?:[-*•]|\d+[.)])\s+", re.M)


def clean_caption(text: str) -> str:
    """Strip, drop markdown and chatty prefixes ("The image shows", "Sure! Here is..."), collapse whitespace."""
    text = " ".join(_MARKDOWN.sub(" ", text or "").split())
    changed = True
    while changed and text:
        before = text
        for pattern in _CHATTY:
            text = pattern.sub("", text).strip()
        text = text.strip(" \"'`“”‘’")
        changed = text != before
    return text[:1].upper() + text[1:]


# ----------------------------------------------------------------------------- generators


@runtime_checkable
class CaptionGenerator(Protocol):
    """Anything that answers one prompt per image: ``generator(images, prompts) -> list[str]``.

    It may also have ``retry(images, prompts)``, used for the one retry of empty answers.
    """

    def __call__(self, images: list[Image.Image], prompts: list[str]) -> list[str]: ...


def _chunks(seq: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(seq), max(1, size)):
        yield seq[start : start + max(1, size)]


def _batch_seed(seed: int, images: Sequence[Image.Image], prompts: Sequence[str]) -> int:
    """A sampling seed from the run seed and the batch content (reproducible across resumes)."""
    crc = zlib.crc32(str(seed).encode())
    for image, prompt in zip(images, prompts, strict=True):
        crc = zlib.crc32(image.tobytes(), zlib.crc32(prompt.encode(), crc))
    return crc


@dataclass
class HFGenerator:
    """A local transformers ``image-text-to-text`` model (``AutoProcessor`` + ``AutoModelForImageTextToText``).

    Greedy by default; ``do_sample`` with ``temperature``/``top_p`` is seeded per batch from ``seed`` and the
    batch content. ``retry`` samples (temperature 0.7, top-p 0.9 unless sampling was set) to escape an empty
    greedy answer.
    """

    model_dir: str
    batch_size: int = 8
    max_new_tokens: int = 160
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    device: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    model: Any = field(default=None, repr=False)
    processor: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.model is None:
            self._load()

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if not Path(self.model_dir).is_dir():
            raise FileNotFoundError(f"--model {self.model_dir} is not a local model folder")
        kwargs = {"local_files_only": True, "trust_remote_code": self.trust_remote_code}
        self.processor = AutoProcessor.from_pretrained(self.model_dir, **kwargs)
        dtype = self.dtype if self.dtype == "auto" else getattr(torch, self.dtype)
        self.model = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=dtype, **kwargs)
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(device).eval()
        tokenizer = getattr(self.processor, "tokenizer", None)
        if tokenizer is not None and not self.model.config.is_encoder_decoder:
            tokenizer.padding_side = "left"

    def with_options(self, **options: Any) -> HFGenerator:
        """A copy sharing the loaded model, with other generation options (e.g. for the quality check)."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return HFGenerator(**{**fields, **options})

    def __call__(self, images: list[Image.Image], prompts: list[str]) -> list[str]:
        return self._run(images, prompts, self.do_sample, self.temperature, self.top_p)

    def retry(self, images: list[Image.Image], prompts: list[str]) -> list[str]:
        temperature, top_p = (self.temperature, self.top_p) if self.do_sample else (0.7, 0.9)
        return self._run(images, prompts, True, temperature, top_p)

    def _run(self, images: list, prompts: list, sample: bool, temperature: float, top_p: float) -> list[str]:
        out: list[str] = []
        pairs = list(zip(images, prompts, strict=True))
        for chunk in _chunks(pairs, self.batch_size):
            imgs, texts = [p[0] for p in chunk], [p[1] for p in chunk]
            out.extend(self._generate(imgs, texts, sample, temperature, top_p))
        return out

    def _generate(
        self, images: list, prompts: list, sample: bool, temperature: float, top_p: float
    ) -> list[str]:
        import torch

        conversations = [
            [{"role": "user", "content": [{"type": "image", "image": im}, {"type": "text", "text": p}]}]
            for im, p in zip(images, prompts, strict=True)
        ]
        inputs = self.processor.apply_chat_template(
            conversations,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs={"padding": True},
        ).to(self.model.device, dtype=self.model.dtype)
        options: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": sample}
        if sample:
            options.update(temperature=temperature, top_p=top_p)
            torch.manual_seed(_batch_seed(self.seed, images, prompts))
        with torch.inference_mode():
            ids = self.model.generate(**inputs, **options)
        if not self.model.config.is_encoder_decoder:
            ids = ids[:, inputs["input_ids"].shape[1] :]
        return self.processor.batch_decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------- progress files


def _suffixed(out: Path, suffix: str) -> Path:
    return out.with_name(out.name + suffix)


def settings_digest(value: Any) -> str:
    """Short stable digest of a JSON-able value (for the progress header)."""
    return hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON lines of a progress file; a torn (unparsable) line from an interruption is skipped."""
    if not path.exists():
        return []
    rows, torn = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
    if torn:
        logger.warning("%s: skipped %d unreadable line(s) (interrupted write)", path, torn)
    return rows


def _load_progress(path: Path, settings: dict[str, Any] | None, force: bool) -> list[dict[str, Any]]:
    """Finished rows of a progress file; its settings line must equal ``settings`` unless ``force``."""
    rows = _read_jsonl(path)
    header = next((r["settings"] for r in rows if "settings" in r), None)
    if header is not None and settings is not None and header != settings and not force:
        changed = sorted(k for k in set(header) | set(settings) if header.get(k) != settings.get(k))
        raise ValueError(
            f"{path} was written with other settings ({', '.join(changed)}); delete it to start over "
            "or pass --force-resume to continue anyway"
        )
    return [r for r in rows if "settings" not in r]


def _ends_torn(path: Path) -> bool:
    """Whether a non-empty file lacks a final newline."""
    if not path.exists() or not path.stat().st_size:
        return False
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def _open_progress(path: Path, settings: dict[str, Any] | None) -> Any:
    """Open a progress file for appending; a new file starts with the settings line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = _ends_torn(path)
    handle = open(path, "a", encoding="utf-8")  # closed by the caller's with-block
    if torn:  # end a line cut short by an interruption so the next record starts on its own line
        handle.write("\n")
    if settings is not None and handle.tell() == 0:
        _append(handle, [{"settings": settings}])
    return handle


def _progress_bar(total: int, remaining: int, desc: str, unit: str, enabled: bool) -> tqdm:
    """A tqdm bar over ``total`` items that starts past the ``total - remaining`` already done."""
    return tqdm(total=total, initial=total - remaining, desc=desc, unit=unit, disable=not enabled)


def _append(handle: Any, rows: Iterable[dict[str, Any]]) -> None:
    for row in rows:
        handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    handle.flush()


def write_json(path: str | Path, obj: Any, indent: int | None = None) -> None:
    """Write JSON (UTF-8, trailing newline) atomically, creating the folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(Path(path), (json.dumps(obj, ensure_ascii=False, indent=indent) + "\n").encode())


# ----------------------------------------------------------------------------- generation driver


@dataclass
class GenerationStats:
    """Counts of a generation run (including resumed records)."""

    images: int = 0
    resumed: int = 0
    captions: int = 0
    retried: int = 0
    empty_dropped: int = 0
    images_dropped: int = 0
    unreadable: list[str] = field(default_factory=list)
    by_strategy: Counter = field(default_factory=Counter)


def _open_image(path: Path) -> Image.Image | None:
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, ValueError):
        return None


def _ask(generator: CaptionGenerator, images: list, prompts: list, retry: bool = False) -> list[str]:
    call = getattr(generator, "retry", generator) if retry else generator
    answers = list(call(images, prompts))
    if len(answers) != len(prompts):
        raise RuntimeError(f"generator returned {len(answers)} answers for {len(prompts)} prompts")
    return [clean_caption(a) for a in answers]


def _answer_with_retry(generator: CaptionGenerator, images: list, prompts: list) -> tuple[list[str], int]:
    """Cleaned answers; empty ones are asked once more. Returns (answers, number retried)."""
    answers = _ask(generator, images, prompts)
    empty = [i for i, a in enumerate(answers) if not a]
    if empty:
        again = _ask(generator, [images[i] for i in empty], [prompts[i] for i in empty], retry=True)
        for i, answer in zip(empty, again, strict=True):
            answers[i] = answer
    return answers, len(empty)


def _caption_chunk(
    items: Sequence[ImageItem],
    image_dir: Path,
    generator: CaptionGenerator,
    templates: Sequence[str],
    seed: int,
) -> tuple[list[dict[str, Any]], list[str], int]:
    """Records for a chunk of images, the unreadable paths and the retry count."""
    loaded = [(it, _open_image(image_dir / it.file_path)) for it in items]
    unreadable = [it.file_path for it, im in loaded if im is None]
    jobs = [
        (it, im, s, p) for it, im in loaded if im is not None for s, p in plan_captions(it, templates, seed)
    ]
    if not jobs:
        return [], unreadable, 0
    answers, retried = _answer_with_retry(generator, [j[1] for j in jobs], [j[3] for j in jobs])
    records: dict[str, dict[str, Any]] = {}
    for (item, _, strategy, _), answer in zip(jobs, answers, strict=True):
        rec = records.setdefault(item.file_path, _new_record(item))
        rec["strategies"].append(strategy)
        rec["captions"].append(answer)
    for rec in records.values():
        rec["empty"] = sum(not c for c in rec["captions"])
        rec["strategies"] = [s for s, c in zip(rec["strategies"], rec["captions"], strict=True) if c]
        rec["captions"] = [c for c in rec["captions"] if c]
    return list(records.values()), unreadable, retried


def _new_record(item: ImageItem) -> dict[str, Any]:
    rec: dict[str, Any] = {"file_path": item.file_path, "id": item.id}
    if item.cam_id is not None:
        rec["cam_id"] = item.cam_id
    rec.update(captions=[], strategies=[])
    return rec


def _tally(stats: GenerationStats, records: Iterable[dict[str, Any]]) -> None:
    for rec in records:
        stats.images += 1
        stats.captions += len(rec["captions"])
        stats.empty_dropped += rec.get("empty", 0)
        stats.images_dropped += not rec["captions"]
        stats.by_strategy.update(rec.get("strategies", []))


def generate_captions(
    items: Sequence[ImageItem],
    image_dir: str | Path,
    generator: CaptionGenerator,
    out: str | Path,
    *,
    templates: Sequence[str] = TEMPLATES,
    seed: int = 0,
    batch_size: int = 8,
    limit: int | None = None,
    settings: dict[str, Any] | None = None,
    force_resume: bool = False,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], GenerationStats]:
    """Caption ``items`` (resumably via ``OUT.partial.jsonl``) and return all records in item order.

    Records carry ``file_path``, ``id``, ``cam_id`` (when known), ``captions``, ``strategies`` and ``empty``.
    ``batch_size`` is the number of prompts per generator call (two per image). Does not write OUT itself.
    """
    items = list(items)[:limit] if limit is not None else list(items)
    partial = _suffixed(Path(out), ".partial.jsonl")
    done = {r["file_path"]: r for r in _load_progress(partial, settings, force_resume)}
    todo = [it for it in items if it.file_path not in done]
    stats = GenerationStats(resumed=sum(it.file_path in done for it in items))
    with (
        _open_progress(partial, settings) as handle,
        _progress_bar(len(items), len(todo), "DTG captions", "img", progress) as bar,
    ):
        for chunk in _chunks(todo, max(1, batch_size // 2)):
            records, unreadable, retried = _caption_chunk(chunk, Path(image_dir), generator, templates, seed)
            _append(handle, records)
            done.update((r["file_path"], r) for r in records)
            stats.unreadable += unreadable
            stats.retried += retried
            bar.update(len(chunk))
    ordered = [done[it.file_path] for it in items if it.file_path in done]
    _tally(stats, ordered)
    return ordered, stats


def to_tagpedes(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """TAG-PEDES entries (``id``, ``file_path``, ``captions``, ``cam_id`` when known); caption-less dropped."""
    keys = ("id", "file_path", "captions", "cam_id")
    return [{k: r[k] for k in keys if k in r} for r in records if r["captions"]]


# ----------------------------------------------------------------------------- quality check


_ANSWER = re.compile(r"\b(match(?:es|ed|ing)?|contradict\w*|hallucinat\w*|vacuous\w*)\b", re.I)
_NEGATED = re.compile(r"(?:\bnot|n't|\bno)\s+$", re.I)


def parse_quality(answer: str) -> str | None:
    """The first category named in a VLM answer ("match" after a negation is skipped), or None."""
    for found in _ANSWER.finditer(answer or ""):
        word = found.group(1).lower()
        if word.startswith("match") and _NEGATED.search(answer[: found.start()]):
            continue
        return next(c for c in QUALITY_CATEGORIES if word.startswith(c.lower()[:6]))
    return None


def _strategy(record: dict[str, Any], index: int) -> str | None:
    strategies = record.get("strategies") or []
    return strategies[index] if index < len(strategies) else None


def _quality_jobs(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"file_path": r["file_path"], "index": i, "caption": c, "strategy": _strategy(r, i)}
        for r in records
        for i, c in enumerate(r["captions"])
    ]


def _judge_chunk(jobs: Sequence[dict[str, Any]], image_dir: Path, generator: CaptionGenerator) -> list[dict]:
    images = {j["file_path"]: _open_image(image_dir / j["file_path"]) for j in jobs}
    usable = [j for j in jobs if images[j["file_path"]] is not None]
    prompts = [QUALITY_PROMPT.replace("{caption}", j["caption"]) for j in usable]
    answers = list(generator([images[j["file_path"]] for j in usable], prompts)) if usable else []
    if len(answers) != len(usable):
        raise RuntimeError(f"generator returned {len(answers)} answers for {len(usable)} prompts")
    labelled = []
    for job, raw in zip(usable, answers, strict=True):
        label = parse_quality(raw)
        labelled.append({**job, "label": label or "Vacuous", "parsed": label is not None, "raw": raw.strip()})
    return labelled


def summarize_quality(labels: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts and proportions per category (overall and per strategy), plus the unparsed count."""
    counts = Counter(lab["label"] for lab in labels)
    total = len(labels)
    by_strategy: dict[str, dict[str, int]] = {}
    for lab in labels:
        by_strategy.setdefault(str(lab.get("strategy")), Counter())[lab["label"]] += 1
    return {
        "total": total,
        "counts": {c: counts.get(c, 0) for c in QUALITY_CATEGORIES},
        "proportions": {c: (counts.get(c, 0) / total if total else 0.0) for c in QUALITY_CATEGORIES},
        "unparsed": sum(not lab["parsed"] for lab in labels),
        "by_strategy": {
            s: {c: n.get(c, 0) for c in QUALITY_CATEGORIES} for s, n in sorted(by_strategy.items())
        },
    }


def quality_check(
    records: Sequence[dict[str, Any]],
    image_dir: str | Path,
    generator: CaptionGenerator,
    out: str | Path,
    *,
    batch_size: int = 8,
    settings: dict[str, Any] | None = None,
    force_resume: bool = False,
    progress: bool = True,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Label every caption (resumable via ``OUT.quality.partial.jsonl``); returns (summary, labels)."""
    partial = _suffixed(Path(out), ".quality.partial.jsonl")
    done = {(r["file_path"], r["index"]): r for r in _load_progress(partial, settings, force_resume)}
    jobs = _quality_jobs(records)
    todo = [j for j in jobs if done.get((j["file_path"], j["index"]), {}).get("caption") != j["caption"]]
    with (
        _open_progress(partial, settings) as handle,
        _progress_bar(len(jobs), len(todo), "DTG quality", "cap", progress) as bar,
    ):
        for chunk in _chunks(todo, batch_size):
            labelled = _judge_chunk(chunk, Path(image_dir), generator)
            _append(handle, labelled)
            done.update(((lab["file_path"], lab["index"]), lab) for lab in labelled)
            bar.update(len(chunk))
    labels = [done[k] for k in ((j["file_path"], j["index"]) for j in jobs) if k in done]
    return summarize_quality(labels), labels


def format_quality_table(summary: dict[str, Any]) -> str:
    """The Fig. 3a-style table: category, count, share."""
    lines = [f"Quality check ({summary['total']} captions)", f"{'category':<15}{'count':>8}{'share':>9}"]
    for cat in QUALITY_CATEGORIES:
        lines.append(f"{cat:<15}{summary['counts'][cat]:>8}{100 * summary['proportions'][cat]:>8.1f}%")
    lines.append(f"unparsed answers (counted as Vacuous): {summary['unparsed']}")
    return "\n".join(lines)


def filter_records(
    records: Sequence[dict[str, Any]], labels: Sequence[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Keep only Match captions; images left without any are dropped. Returns (records, counts)."""
    label_of = {(lab["file_path"], lab["index"]): lab["label"] for lab in labels}
    kept, dropped_captions = [], 0
    for rec in records:
        keep = [i for i in range(len(rec["captions"])) if label_of.get((rec["file_path"], i)) == "Match"]
        dropped_captions += len(rec["captions"]) - len(keep)
        if keep:
            captions = [rec["captions"][i] for i in keep]
            kept.append({**rec, "captions": captions, "strategies": [_strategy(rec, i) for i in keep]})
    counts = {
        "captions_dropped": dropped_captions,
        "images_dropped": sum(bool(r["captions"]) for r in records) - len(kept),
    }
    return kept, counts


# ----------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m training.dtg",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="folder of person crops (scanned recursively)")
    src.add_argument("--dataset", help="TAG-PEDES-style JSON list with id, file_path[, cam_id, attributes]")
    p.add_argument(
        "--image-dir",
        help="image root: file_path is relative to it (--dataset default: images/ next to it, or its folder; "
        "--images default: the --images folder, give a common root to caption train/ and test/ separately)",
    )
    p.add_argument("--model", required=True, help="local image-text-to-text model folder")
    p.add_argument("--out", required=True, help="output TAG-PEDES JSON, e.g. train_reid.json")
    p.add_argument("--attributes", help="JSON: image key -> attribute labels (dict or list)")
    p.add_argument("--templates", help="JSON list of templates replacing the shipped set")
    p.add_argument(
        "--id-from", choices=["auto", "file", "folder"], default="auto", help="person-id rule for --images"
    )
    p.add_argument(
        "--cam-id", type=int, choices=[0, 1], help="view for images without one (0 aerial, 1 ground)"
    )
    p.add_argument("--batch-size", type=_positive_int, default=8, help="prompts per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--limit", type=int, help="caption only the first N images")
    p.add_argument("--quality-check", action="store_true", help="label captions Match/Contradictory/...")
    p.add_argument("--qc-model", help="model folder for the quality check (default: --model)")
    p.add_argument("--filter", action="store_true", help="keep only Match captions (implies --quality-check)")
    p.add_argument(
        "--force-resume", action="store_true", help="resume a progress file written with other settings"
    )
    p.add_argument("--no-progress", action="store_true")
    return accept_both_spellings(p).parse_args(argv)


def _load_templates(path: str | None) -> list[str]:
    if path is None:
        return list(TEMPLATES)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list) or not data or not all(isinstance(t, str) and t.strip() for t in data):
        raise ValueError(f"{path}: expected a non-empty JSON list of template strings")
    return data


def _items_from_args(a: argparse.Namespace) -> tuple[list[ImageItem], Path]:
    if a.images:
        items, skipped = scan_images(a.images, a.id_from, a.cam_id, a.image_dir)
        if skipped:
            logger.warning("%d images without a parsable id skipped, e.g. %s", len(skipped), skipped[:3])
        return items, Path(a.image_dir or a.images)
    items, image_dir = load_dataset_items(a.dataset, a.image_dir)
    if a.cam_id is not None:
        for item in items:
            item.cam_id = item.cam_id if item.cam_id is not None else a.cam_id
    return items, image_dir


def _settings(a: argparse.Namespace, templates: list[str], items: list[ImageItem]) -> dict[str, Any]:
    return {
        "version": PROGRESS_VERSION,
        "model": str(Path(a.model).resolve()),
        "seed": a.seed,
        "max_new_tokens": a.max_new_tokens,
        "sampling": [a.do_sample, a.temperature, a.top_p] if a.do_sample else "greedy",
        "templates": settings_digest(templates),
        "attributes": settings_digest({it.file_path: it.attributes for it in items if it.attributes}),
    }


def _generator(a: argparse.Namespace) -> HFGenerator:
    return HFGenerator(
        a.model,
        batch_size=a.batch_size,
        max_new_tokens=a.max_new_tokens,
        do_sample=a.do_sample,
        temperature=a.temperature,
        top_p=a.top_p,
        seed=a.seed,
        device=a.device,
        dtype=a.dtype,
        trust_remote_code=a.trust_remote_code,
    )


def _report(stats: GenerationStats, out: Path) -> str:
    lines = [
        f"DTG: {stats.images} images ({stats.resumed} resumed), {stats.captions} captions -> {out}",
        f"strategies: {dict(sorted(stats.by_strategy.items()))}",
        f"empty generations retried: {stats.retried}; still empty, dropped: {stats.empty_dropped}; "
        f"images without captions: {stats.images_dropped}; unreadable images: {len(stats.unreadable)}",
    ]
    return "\n".join(lines)


def _run_quality(a, records, image_dir, generator: HFGenerator, out: Path) -> list[dict[str, Any]]:
    judge = _generator(argparse.Namespace(**{**vars(a), "model": a.qc_model})) if a.qc_model else generator
    judge = judge.with_options(max_new_tokens=8, do_sample=False)
    settings = {"version": PROGRESS_VERSION, "qc_model": str(Path(a.qc_model or a.model).resolve())}
    summary, labels = quality_check(
        records,
        image_dir,
        judge,
        out,
        batch_size=a.batch_size,
        settings=settings,
        force_resume=a.force_resume,
        progress=not a.no_progress,
    )
    print(format_quality_table(summary))
    write_json(_suffixed(out, ".quality.json"), {"summary": summary, "labels": labels}, indent=1)
    if not a.filter:
        return records
    write_json(_suffixed(out, ".unfiltered.json"), to_tagpedes(records))
    kept, counts = filter_records(records, labels)
    print(
        f"filter: kept {sum(len(r['captions']) for r in kept)} Match captions of {len(kept)} images; {counts}"
    )
    return kept


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """CLI entry point; returns the TAG-PEDES entries written to ``--out``."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    a = _parse_args(argv)
    templates = _load_templates(a.templates)
    items, image_dir = _items_from_args(a)
    if a.attributes:
        found = attach_attributes(items, load_attributes(a.attributes))
        logger.info("attribute labels found for %d of %d images", found, len(items))
    out = Path(a.out)
    generator = _generator(a)
    records, stats = generate_captions(
        items,
        image_dir,
        generator,
        out,
        templates=templates,
        seed=a.seed,
        batch_size=a.batch_size,
        limit=a.limit,
        settings=_settings(a, templates, items),
        force_resume=a.force_resume,
        progress=not a.no_progress,
    )
    if a.quality_check or a.filter:
        records = _run_quality(a, records, image_dir, generator, out)
    entries = to_tagpedes(records)
    write_json(out, entries)
    print(_report(stats, out))
    return entries


if __name__ == "__main__":
    main()
