"""Procedurally generated synthetic aerial-ground person dataset (the project's embedded default data).

People are drawn with PIL from a combination of attributes (the identity) and rendered from a ground view
(upright full body, street scene) and an aerial view (steep top-down, foreshortened, rotated, small and blurry,
ground-texture scene). Each image gets two attribute-driven captions built with three strategies that mirror the
paper's DTG paradigm (prompt-style sentence, template-style, attribute-list). Output follows the TAG-PEDES layout
(``images/``, ``train_reid.json``, ``test_reid.json``; ``cam_id`` 0 = aerial, 1 = ground) and is fully
deterministic given the seed. ``metadata/<split>.csv`` gives each crop a camera and a capture time
(``synthetic_metadata``), the sidecar for filtered search.

Usage: ``generate_dataset(out_dir)``; ``tagclip train`` renders it into ``data/synthetic`` when absent.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import re
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from modeling_tagclip.atomic_io import atomic_write
from modeling_tagclip.data.raster import Canvas, gaussian_blur, resize_bilinear, to_uint8
from modeling_tagclip.data.synthetic_metadata import write_sidecars
from modeling_tagclip.flags import accept_both_spellings
from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND, VIEW_NAMES
from modeling_tagclip.progress import Progress

GENERATOR_VERSION = 2  # 2: numpy rasteriser (pixels independent of the Pillow version)
GENERATORS = (
    "modeling_tagclip.data.synthetic",
    "training.synthetic",
)  # dataset_info.json's name (and an older one)
SUPERSAMPLING = 4  # figure layer samples per output pixel and axis
DEFAULT_SIZE = (128, 64)  # (H, W)

RGB = tuple[int, int, int]
COLORS: dict[str, RGB] = {
    "black": (32, 32, 34),
    "white": (232, 232, 226),
    "grey": (128, 128, 132),
    "red": (188, 36, 40),
    "blue": (42, 82, 178),
    "green": (48, 128, 62),
    "yellow": (226, 198, 52),
    "pink": (232, 142, 172),
    "purple": (118, 58, 148),
    "brown": (108, 70, 40),
    "orange": (228, 118, 32),
    "beige": (204, 184, 148),
}
HAIR_COLORS: dict[str, RGB] = {
    "black": (22, 18, 16),
    "brown": (92, 58, 34),
    "blonde": (214, 184, 118),
    "grey": (168, 168, 166),
    "red": (150, 62, 30),
}
SKIN_TONES: dict[str, RGB] = {
    "light": (238, 204, 178),
    "medium": (208, 162, 122),
    "tan": (164, 114, 78),
    "dark": (98, 66, 46),
}
TOP_COLORS = list(COLORS)
BOTTOM_COLORS = ["black", "blue", "grey", "white", "brown", "beige", "green"]
SHOE_COLORS = ["black", "white", "brown", "grey", "red", "blue"]
BAG_COLORS = ["black", "brown", "red", "blue", "grey", "pink", "green"]
HAT_COLORS = ["black", "white", "red", "blue", "grey", "green", "yellow"]
TOP_TYPES = ["t-shirt", "shirt", "jacket", "hoodie", "coat"]
BAGS = ["none", "backpack", "handbag", "shoulder bag"]
HATS = ["none", "cap", "beanie", "sun hat"]
HAIR_STYLES = {
    "male": (["short", "long", "ponytail", "bun", "bald"], [0.66, 0.1, 0.04, 0.02, 0.18]),
    "female": (["short", "long", "ponytail", "bun", "bald"], [0.22, 0.42, 0.24, 0.12, 0.0]),
}
BUILD_WIDTH = {"slim": 0.095, "average": 0.112, "heavy": 0.138}
ATTRIBUTE_KEYS = (
    "gender",
    "build",
    "skin",
    "hair_color",
    "hair_style",
    "top_color",
    "top_type",
    "sleeves",
    "bottom_color",
    "bottom_type",
    "shoes_color",
    "bag",
    "bag_color",
    "hat",
    "hat_color",
    "glasses",
)


# ----------------------------------------------------------------------------------------------- identities
def _pick(rng: np.random.Generator, options: Sequence[str], p: Sequence[float] | None = None) -> str:
    """Choose one string from ``options`` (optionally weighted)."""
    if p is not None:
        p = np.asarray(p, dtype=float) / np.sum(p)
    return str(options[int(rng.choice(len(options), p=p))])


def sample_identity(rng: np.random.Generator) -> dict[str, Any]:
    """Sample one identity as a dict of attributes (all values are str or bool)."""
    gender = _pick(rng, ["male", "female"])
    styles, style_p = HAIR_STYLES[gender]
    hair_style = _pick(rng, styles, style_p)
    top_type = _pick(rng, TOP_TYPES, [0.3, 0.2, 0.2, 0.15, 0.15])
    bottom_p = [0.75, 0.25, 0.0] if gender == "male" else [0.5, 0.2, 0.3]
    bag = _pick(rng, BAGS, [0.34, 0.26, 0.18 if gender == "female" else 0.1, 0.22])
    hat = _pick(rng, HATS, [0.58, 0.2, 0.12, 0.1])
    return {
        "gender": gender,
        "build": _pick(rng, list(BUILD_WIDTH), [0.35, 0.45, 0.2]),
        "skin": _pick(rng, list(SKIN_TONES)),
        "hair_color": "none" if hair_style == "bald" else _pick(rng, list(HAIR_COLORS)),
        "hair_style": hair_style,
        "top_color": _pick(rng, TOP_COLORS),
        "top_type": top_type,
        "sleeves": "long" if top_type in ("jacket", "hoodie", "coat") else _pick(rng, ["short", "long"]),
        "bottom_color": _pick(rng, BOTTOM_COLORS),
        "bottom_type": _pick(rng, ["trousers", "shorts", "skirt"], bottom_p),
        "shoes_color": _pick(rng, SHOE_COLORS),
        "bag": bag,
        "bag_color": "none" if bag == "none" else _pick(rng, BAG_COLORS),
        "hat": hat,
        "hat_color": "none" if hat == "none" else _pick(rng, HAT_COLORS),
        "glasses": bool(rng.random() < 0.25),
    }


def attribute_key(attrs: dict[str, Any]) -> tuple:
    """Hashable key over all identity attributes (used to reject duplicate identities)."""
    return tuple(attrs[k] for k in ATTRIBUTE_KEYS)


def sample_identities(n: int, rng: np.random.Generator, max_tries: int = 1000) -> list[dict[str, Any]]:
    """Sample ``n`` identities with pairwise-distinct attribute sets."""
    seen: set[tuple] = set()
    out: list[dict[str, Any]] = []
    while len(out) < n:
        for _ in range(max_tries):
            attrs = sample_identity(rng)
            if attribute_key(attrs) not in seen:
                break
        else:
            raise RuntimeError("could not sample a new unique identity; attribute space exhausted")
        seen.add(attribute_key(attrs))
        out.append(attrs)
    return out


# ----------------------------------------------------------------------------------------------- captions
def _color_word(name: str, rng: np.random.Generator) -> str:
    """Colour name with spelling variants."""
    return ("gray" if rng.random() < 0.4 else "grey") if name == "grey" else name


def _article(phrase: str) -> str:
    """'a' or 'an' for ``phrase``."""
    return "an" if phrase[0] in "aeiou" else "a"


def _noun(attrs: dict[str, Any], rng: np.random.Generator) -> str:
    """Person noun, e.g. 'man', 'lady', 'person'."""
    nouns = {
        "male": ["man", "man", "guy", "gentleman", "male pedestrian"],
        "female": ["woman", "woman", "lady"],
    }
    return _pick(rng, nouns[attrs["gender"]] + ["person"]) if rng.random() < 0.9 else "pedestrian"


def _hair_phrase(attrs: dict[str, Any], rng: np.random.Generator) -> str:
    """Noun phrase for the hair, e.g. 'long brown hair'."""
    style = attrs["hair_style"]
    if style == "bald":
        return _pick(rng, ["a bald head", "a shaved head"])
    c = _color_word(attrs["hair_color"], rng)
    options = {
        "short": [f"short {c} hair", f"{c} short hair", f"cropped {c} hair"],
        "long": [f"long {c} hair", f"{c} hair falling to the shoulders", f"long, loose {c} hair"],
        "ponytail": [f"{c} hair in a ponytail", f"a {c} ponytail", f"{c} hair tied back in a ponytail"],
        "bun": [f"{c} hair in a bun", f"{c} hair tied up in a bun"],
    }
    return _pick(rng, options[style])


def _top_phrase(attrs: dict[str, Any], rng: np.random.Generator) -> str:
    """Noun phrase for the upper garment, e.g. 'a red short-sleeved t-shirt'."""
    names = {
        "t-shirt": ["t-shirt", "T-shirt", "tee"],
        "shirt": ["shirt", "button-up shirt", "collared shirt"],
        "jacket": ["jacket", "zip-up jacket"],
        "hoodie": ["hoodie", "hooded sweatshirt"],
        "coat": ["coat", "long coat"],
    }
    name, c = _pick(rng, names[attrs["top_type"]]), _color_word(attrs["top_color"], rng)
    if attrs["top_type"] in ("t-shirt", "shirt") and rng.random() < 0.8:
        if rng.random() < 0.5:
            phrase = f"{c} {attrs['sleeves']}-sleeved {name}"
        else:
            phrase = f"{c} {name} with {attrs['sleeves']} sleeves"
    else:
        phrase = f"{c} {name}"
    return f"{_article(phrase)} {phrase}"


def _bottom_phrase(attrs: dict[str, Any], rng: np.random.Generator) -> str:
    """Noun phrase for the lower garment, e.g. 'black trousers'."""
    names = {
        "trousers": ["trousers", "pants", "long pants"],
        "shorts": ["shorts", "short pants"],
        "skirt": ["a skirt", "a knee-length skirt"],
    }
    name = _pick(rng, names[attrs["bottom_type"]])
    c = _color_word(attrs["bottom_color"], rng)
    return f"{_article(c)} {c} {name[2:]}" if name.startswith("a ") else f"{c} {name}"


def _shoes_phrase(attrs: dict[str, Any], rng: np.random.Generator) -> str:
    """Noun phrase for the shoes."""
    return f"{_color_word(attrs['shoes_color'], rng)} {_pick(rng, ['shoes', 'sneakers', 'shoes'])}"


def _bag_phrase(attrs: dict[str, Any], rng: np.random.Generator) -> str:
    """Noun phrase for the bag ('' when the identity has none)."""
    if attrs["bag"] == "none":
        return ""
    c = _color_word(attrs["bag_color"], rng)
    names = {"backpack": ["backpack"], "handbag": ["handbag", "hand bag"], "shoulder bag": ["shoulder bag"]}
    return f"{_article(c)} {c} {_pick(rng, names[attrs['bag']])}"


def _hat_phrase(attrs: dict[str, Any], rng: np.random.Generator) -> str:
    """Noun phrase for the hat ('' when the identity has none)."""
    if attrs["hat"] == "none":
        return ""
    c = _color_word(attrs["hat_color"], rng)
    names = {
        "cap": ["cap", "baseball cap"],
        "beanie": ["beanie", "knit hat"],
        "sun hat": ["sun hat", "wide-brimmed hat"],
    }
    return f"{_article(c)} {c} {_pick(rng, names[attrs['hat']])}"


def _glasses_phrase(rng: np.random.Generator) -> str:
    """Noun phrase for glasses."""
    return _pick(rng, ["glasses", "a pair of glasses", "spectacles"])


def _bare(phrase: str) -> str:
    """Drop a leading indefinite article."""
    return phrase.split(" ", 1)[1] if phrase.startswith(("a ", "an ")) else phrase


def _join(items: list[str]) -> str:
    """'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _keep(rng: np.random.Generator, p: float = 0.85) -> bool:
    """Whether to mention an optional attribute."""
    return bool(rng.random() < p)


def _caption_prompt(attrs: dict[str, Any], rng: np.random.Generator) -> str:
    """Prompt-style: one natural sentence combining all details."""
    build = {"slim": "slim ", "average": "", "heavy": _pick(rng, ["heavyset ", "stocky "])}[attrs["build"]]
    noun = _noun(attrs, rng)
    words = (build if _keep(rng, 0.7) else "") + noun
    head = f"{_article(words)} {words}"
    with_parts = [_hair_phrase(attrs, rng)] if _keep(rng) else []
    if attrs["glasses"] and _keep(rng):
        with_parts.append(_glasses_phrase(rng))
    wear = [_top_phrase(attrs, rng), _bottom_phrase(attrs, rng)]
    if _keep(rng):
        wear.append(_shoes_phrase(attrs, rng))
    if attrs["hat"] != "none" and _keep(rng):
        wear.append(_hat_phrase(attrs, rng))
    text = head + (f" with {_join(with_parts)}" if with_parts else "")
    text += f", {_pick(rng, ['wearing', 'dressed in', 'who is wearing'])} {_join(wear)}"
    if attrs["bag"] != "none" and _keep(rng, 0.9):
        verbs = ["carrying", "with"] + (["holding"] if attrs["bag"] == "handbag" else [])
        text += f", {_pick(rng, verbs)} {_bag_phrase(attrs, rng)}"
    return text[0].upper() + text[1:] + "."


def _caption_template(attrs: dict[str, Any], rng: np.random.Generator) -> str:
    """Template-style: several short sentences in a fixed template order."""
    he = "he" if attrs["gender"] == "male" else "she"
    noun = _noun(attrs, rng)
    s = [
        f"The {noun} has {_hair_phrase(attrs, rng)}"
        if _keep(rng, 0.9)
        else f"This is {_article(noun)} {noun}"
    ]
    s.append(f"{he} is wearing {_top_phrase(attrs, rng)} and {_bottom_phrase(attrs, rng)}")
    if _keep(rng):
        s.append(f"{he} has {_shoes_phrase(attrs, rng)} on")
    if attrs["hat"] != "none" and _keep(rng):
        s.append(f"{he} wears {_hat_phrase(attrs, rng)}")
    if attrs["glasses"] and _keep(rng):
        s.append(f"{he} wears {_glasses_phrase(rng)}")
    if attrs["bag"] != "none" and _keep(rng, 0.9):
        s.append(f"{he} is carrying {_bag_phrase(attrs, rng)}")
    elif attrs["bag"] == "none" and _keep(rng, 0.3):
        s.append(f"{he} is not carrying a bag")
    return " ".join(x[0].upper() + x[1:] + "." for x in s)


def _caption_attributes(attrs: dict[str, Any], rng: np.random.Generator) -> str:
    """Attribute-list style: explicit attribute labels joined into one description."""
    items = [attrs["gender"], f"{attrs['build']} build", _hair_phrase(attrs, rng)]
    items += [_top_phrase(attrs, rng), _bottom_phrase(attrs, rng), _shoes_phrase(attrs, rng)]
    if attrs["hat"] != "none":
        items.append(_hat_phrase(attrs, rng))
    items.append(_bag_phrase(attrs, rng) if attrs["bag"] != "none" else "no bag")
    if attrs["glasses"]:
        items.append("glasses")
    items = [x for i, x in enumerate(items) if i < 1 or _keep(rng, 0.9)]
    prefix = _pick(
        rng, ["A person with the following attributes: ", "Pedestrian attributes: ", "Person: ", ""]
    )
    text = prefix + ", ".join(_bare(x) for x in items)
    return text[0].upper() + text[1:] + "."


CAPTION_STRATEGIES = (_caption_prompt, _caption_template, _caption_attributes)


def make_captions(attrs: dict[str, Any], rng: np.random.Generator) -> list[str]:
    """Two captions for one image, from two different (randomly chosen) DTG-like strategies."""
    first, second = rng.choice(len(CAPTION_STRATEGIES), size=2, replace=False)
    return [CAPTION_STRATEGIES[int(i)](attrs, rng) for i in (first, second)]


def image_captions(attrs: dict[str, Any], seed: int, identity: int, view: int, k: int) -> list[str]:
    """The captions ``generate_dataset`` writes for image ``k`` of ``identity`` seen from ``view``."""
    return make_captions(attrs, np.random.default_rng([seed, 2, identity, view, k]))


DESCRIPTION_SEED = 7919  # person_descriptions: people no split of a seed-0..1000 set is planned from


def person_descriptions(count: int, seed: int = DESCRIPTION_SEED) -> list[str]:
    """``count`` descriptions of distinct random people, one caption each in a random ``make_captions``
    style: text queries of the kind a user types, for calibrating an approximate index (``tagclip index
    --ann``). Deterministic per ``seed``; the first ``n`` do not depend on ``count``."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    people = sample_identities(count, np.random.default_rng([seed, 3]))
    return [make_captions(attrs, np.random.default_rng([seed, 4, i]))[0] for i, attrs in enumerate(people)]


# ----------------------------------------------------------------------------------------------- drawing
@dataclass
class _Pen:
    """Draws in figure units (1 = figure scale ``s`` pixels) centred at ``(cx, top)``, rotated by ``angle``.

    ``angle`` (radians) turns the figure about ``pivot`` (output pixels), so the rotation is part of the geometry
    and every shape is rasterised once, anti-aliased by the canvas' supersampling.
    """

    canvas: Canvas
    cx: float
    top: float
    s: float
    angle: float = 0.0
    pivot: tuple[float, float] = (0.0, 0.0)

    def p(self, x: float, y: float) -> tuple[float, float]:
        dx, dy = self.cx + x * self.s - self.pivot[0], self.top + y * self.s - self.pivot[1]
        cos, sin = math.cos(self.angle), math.sin(self.angle)
        return self.pivot[0] + dx * cos - dy * sin, self.pivot[1] + dx * sin + dy * cos

    def ellipse(self, x0: float, y0: float, x1: float, y1: float, fill: tuple) -> None:
        cx, cy = self.p((x0 + x1) / 2, (y0 + y1) / 2)
        self.canvas.ellipse(cx, cy, abs(x1 - x0) * self.s / 2, abs(y1 - y0) * self.s / 2, self.angle, fill)

    def poly(self, pts: Sequence[tuple[float, float]], fill: tuple) -> None:
        self.canvas.polygon([self.p(x, y) for x, y in pts], fill)

    def line(self, pts: Sequence[tuple[float, float]], fill: tuple, width: float) -> None:
        self.canvas.polyline([self.p(x, y) for x, y in pts], max(0.5, width * self.s), fill)

    def limb(self, x0: float, y0: float, x1: float, y1: float, w: float, fill: tuple) -> None:
        """A limb segment of width ``w`` with rounded joints."""
        self.canvas.capsule(self.p(x0, y0), self.p(x1, y1), w * self.s / 2, fill)


def _shade(c: tuple, f: float) -> tuple:
    """Scale an RGB(A) colour's brightness by ``f`` (alpha kept)."""
    return tuple(min(255, max(0, round(v * f))) for v in c[:3]) + tuple(c[3:])


def _palette(attrs: dict[str, Any], rng: np.random.Generator) -> dict[str, tuple]:
    """Per-image RGBA colours of the identity's parts, with small colour jitter."""

    def jit(c: RGB) -> tuple:
        return tuple(int(np.clip(v + rng.normal(0, 7), 0, 255)) for v in c) + (255,)

    hair = HAIR_COLORS.get(attrs["hair_color"], SKIN_TONES[attrs["skin"]])
    pal = {
        "skin": SKIN_TONES[attrs["skin"]],
        "hair": hair,
        "top": COLORS[attrs["top_color"]],
        "bottom": COLORS[attrs["bottom_color"]],
        "shoes": COLORS[attrs["shoes_color"]],
        "bag": COLORS.get(attrs["bag_color"], (0, 0, 0)),
        "hat": COLORS.get(attrs["hat_color"], (0, 0, 0)),
    }
    return {k: jit(v) for k, v in pal.items()}


def _widths(attrs: dict[str, Any]) -> tuple[float, float]:
    """Shoulder and hip half-widths in figure units."""
    sw = BUILD_WIDTH[attrs["build"]] * (0.92 if attrs["gender"] == "female" else 1.0)
    return sw, sw * (1.0 if attrs["gender"] == "female" else 0.86)


def _draw_ground_legs(pen: _Pen, a: dict[str, Any], col: dict[str, tuple], hw: float, stride: float) -> None:
    """Legs, lower garment and shoes of the upright figure."""
    lw = 0.062 if a["build"] == "heavy" else 0.052
    hip, knee_sk, knee_sh, ankle = 0.47, 0.70, 0.63, 0.935
    for side in (-1, 1):
        x0, x1 = side * hw * 0.5, side * (hw * 0.5 + stride)
        pen.limb(x0, hip, x1, ankle, lw, col["skin"])
        if a["bottom_type"] == "trousers":
            pen.limb(x0, hip, x1, ankle - 0.005, lw * 1.15, col["bottom"])
        elif a["bottom_type"] == "shorts":
            t = (knee_sh - hip) / (ankle - hip)
            pen.limb(x0, hip, x0 + (x1 - x0) * t, knee_sh, lw * 1.25, col["bottom"])
        pen.ellipse(x1 - 0.038, ankle - 0.02, x1 + 0.038, ankle + 0.035, col["shoes"])
    if a["bottom_type"] == "skirt":
        pen.poly(
            [(-hw, hip - 0.02), (hw, hip - 0.02), (hw * 1.5, knee_sk), (-hw * 1.5, knee_sk)], col["bottom"]
        )
    else:
        pen.poly([(-hw, hip - 0.02), (hw, hip - 0.02), (hw, hip + 0.04), (-hw, hip + 0.04)], col["bottom"])


def _draw_ground_torso(
    pen: _Pen, a: dict[str, Any], col: dict[str, tuple], front: bool, swing: float
) -> None:
    """Upper garment and arms of the upright figure."""
    sw, hw = _widths(a)
    top, dark = col["top"], _shade(col["top"], 0.7)
    end = 0.68 if a["top_type"] == "coat" else 0.5
    belly = 1.08 if a["build"] == "heavy" else 1.0
    pen.poly(
        [
            (-sw, 0.165),
            (sw, 0.165),
            (hw * belly, 0.33),
            (hw * 1.02, end),
            (-hw * 1.02, end),
            (-hw * belly, 0.33),
        ],
        top,
    )
    pen.ellipse(-sw - 0.025, 0.15, -sw + 0.05, 0.2, top)
    pen.ellipse(sw - 0.05, 0.15, sw + 0.025, 0.2, top)
    if front and a["top_type"] in ("jacket", "coat"):
        pen.line([(0, 0.17), (0, end)], dark, 0.012)
    if front and a["top_type"] == "shirt":
        pen.poly([(-0.035, 0.16), (0, 0.2), (0.035, 0.16)], _shade(top, 1.25))
    if a["top_type"] == "hoodie":
        y = 0.15 if front else 0.2
        pen.ellipse(-0.06, 0.135, 0.06, y + 0.02, dark)
    for side in (-1, 1):
        x0, y0 = side * (sw + 0.005), 0.185
        x1, y1 = side * (sw + 0.025) + side * abs(swing) * 0.3 + swing, 0.5
        pen.limb(x0, y0, x1, y1, 0.042, col["skin"])
        t = 0.3 if a["sleeves"] == "short" else 0.94
        pen.limb(x0, y0, x0 + (x1 - x0) * t, y0 + (y1 - y0) * t, 0.05, top)


def _draw_ground_head(pen: _Pen, a: dict[str, Any], col: dict[str, tuple], front: bool) -> None:
    """Neck, head, hair, hat and glasses of the upright figure."""
    hair, style = col["hair"], a["hair_style"]
    pen.limb(0, 0.11, 0, 0.17, 0.035, col["skin"])
    pen.ellipse(-0.05, 0.005, 0.05, 0.135, col["skin"])
    if style != "bald":
        if front:
            pen.ellipse(-0.054, -0.002, 0.054, 0.065, hair)
            pen.poly([(-0.054, 0.035), (0.054, 0.035), (0.05, 0.05), (-0.05, 0.05)], hair)
        else:
            pen.ellipse(-0.054, -0.002, 0.054, 0.13, hair)
    if style == "long":
        y = 0.26 if not front else 0.2
        pen.poly(
            [(-0.055, 0.04), (0.055, 0.04), (0.065, y), (-0.065, y)]
            if not front
            else [(-0.062, 0.04), (-0.045, 0.04), (-0.05, y), (-0.07, y)],
            hair,
        )
        if front:
            pen.poly([(0.045, 0.04), (0.062, 0.04), (0.07, y), (0.05, y)], hair)
    elif style == "ponytail":
        if front:
            pen.ellipse(0.04, 0.04, 0.075, 0.12, hair)
        else:
            pen.limb(0, 0.06, 0, 0.2, 0.035, hair)
    elif style == "bun":
        pen.ellipse(-0.03, -0.035, 0.03, 0.02, hair)
    if front:
        eye = (40, 30, 30, 255)
        pen.ellipse(-0.028, 0.066, -0.014, 0.078, eye)
        pen.ellipse(0.014, 0.066, 0.028, 0.078, eye)
        if a["glasses"]:
            g = (20, 20, 20, 255)
            pen.line([(-0.04, 0.071), (0.04, 0.071)], g, 0.008)
            pen.ellipse(-0.036, 0.061, -0.006, 0.082, g)
            pen.ellipse(0.006, 0.061, 0.036, 0.082, g)
    _draw_ground_hat(pen, a, col, front)


def _draw_ground_hat(pen: _Pen, a: dict[str, Any], col: dict[str, tuple], front: bool) -> None:
    """Hat of the upright figure."""
    hat = col["hat"]
    if a["hat"] == "cap":
        pen.ellipse(-0.056, -0.008, 0.056, 0.07, hat)
        pen.poly([(-0.058, 0.035), (0.058, 0.035), (0.058, 0.045), (-0.058, 0.045)], hat)
        if front:
            pen.ellipse(-0.06, 0.035, 0.06, 0.058, _shade(hat, 0.8))
    elif a["hat"] == "beanie":
        pen.ellipse(-0.057, -0.02, 0.057, 0.075, hat)
        pen.poly([(-0.057, 0.03), (0.057, 0.03), (0.057, 0.05), (-0.057, 0.05)], _shade(hat, 0.85))
    elif a["hat"] == "sun hat":
        pen.ellipse(-0.045, -0.03, 0.045, 0.05, hat)
        pen.ellipse(-0.1, 0.02, 0.1, 0.055, _shade(hat, 0.9))


def _draw_ground_bag(pen: _Pen, a: dict[str, Any], col: dict[str, tuple], front: bool, side: int) -> None:
    """Bag of the upright figure (drawn over the body)."""
    sw, hw = _widths(a)
    bag, strap = col["bag"], _shade(col["bag"], 0.75)
    if a["bag"] == "backpack":
        if front:
            for s in (-1, 1):
                pen.line([(s * sw * 0.6, 0.165), (s * sw * 0.7, 0.36)], strap, 0.018)
        else:
            pen.ellipse(-sw * 0.8, 0.18, sw * 0.8, 0.44, bag)
            pen.ellipse(-sw * 0.55, 0.3, sw * 0.55, 0.42, strap)
    elif a["bag"] == "shoulder bag":
        pen.line([(-side * sw * 0.7, 0.17), (side * (hw + 0.02), 0.45)], strap, 0.014)
        pen.ellipse(side * (hw - 0.03), 0.42, side * (hw + 0.08), 0.53, bag)
    elif a["bag"] == "handbag":
        x = side * (sw + 0.04)
        pen.line([(x - 0.02, 0.53), (x, 0.49), (x + 0.02, 0.53)], strap, 0.01)
        pen.poly([(x - 0.045, 0.53), (x + 0.045, 0.53), (x + 0.05, 0.62), (x - 0.05, 0.62)], bag)


def _draw_ground_figure(
    pen: _Pen, a: dict[str, Any], col: dict[str, tuple], rng: np.random.Generator
) -> None:
    """Full upright figure (front or back) with a random walking pose."""
    front = bool(rng.random() < 0.6)
    stride, swing, side = rng.uniform(-0.01, 0.05), rng.uniform(-0.05, 0.05), int(rng.choice([-1, 1]))
    sw, hw = _widths(a)
    pen.ellipse(-0.14, 0.95, 0.14, 1.0, (0, 0, 0, 70))
    if a["bag"] == "backpack" and front:
        pen.ellipse(-sw * 1.1, 0.19, sw * 1.1, 0.42, col["bag"])
    _draw_ground_legs(pen, a, col, hw, stride)
    _draw_ground_torso(pen, a, col, front, swing)
    _draw_ground_head(pen, a, col, front)
    _draw_ground_bag(pen, a, col, front, side)


def _draw_aerial_body(pen: _Pen, a: dict[str, Any], col: dict[str, tuple], f: float, side: int) -> float:
    """Foreshortened legs, torso, arms and shoulders seen from high up; returns the shoulder line y."""
    sw, hw = _widths(a)
    sw, hw = sw * 1.35, hw * 1.3
    sh, hip = 0.3, 0.3 + 0.27 * f
    foot = hip + 0.3 * f
    for s in (-1, 1):
        leg = col["bottom"] if a["bottom_type"] == "trousers" else col["skin"]
        pen.limb(s * hw * 0.45, hip, s * hw * 0.5, foot, 0.06, leg)
        if a["bottom_type"] == "shorts":
            pen.limb(s * hw * 0.45, hip, s * hw * 0.47, hip + 0.12 * f, 0.075, col["bottom"])
        pen.ellipse(s * hw * 0.5 - 0.035, foot - 0.015, s * hw * 0.5 + 0.035, foot + 0.05, col["shoes"])
    if a["bottom_type"] == "skirt":
        pen.poly(
            [(-hw, hip - 0.03), (hw, hip - 0.03), (hw * 1.35, hip + 0.17 * f), (-hw * 1.35, hip + 0.17 * f)],
            col["bottom"],
        )
    else:
        pen.ellipse(-hw, hip - 0.04, hw, hip + 0.05, col["bottom"])
    end = hip + (0.16 * f if a["top_type"] == "coat" else 0.02)
    pen.poly([(-sw, sh), (sw, sh), (hw * 1.05, end), (-hw * 1.05, end)], col["top"])
    for s in (-1, 1):
        x0, x1 = s * (sw + 0.01), s * (sw + 0.03)
        pen.limb(x0, sh + 0.02, x1, hip, 0.05, col["skin"])
        t = 0.35 if a["sleeves"] == "short" else 0.95
        pen.limb(x0, sh + 0.02, x0 + (x1 - x0) * t, sh + 0.02 + (hip - sh - 0.02) * t, 0.06, col["top"])
    if a["bag"] == "backpack":
        pen.ellipse(-sw * 0.85, sh - 0.2, sw * 0.85, sh + 0.02, col["bag"])
    pen.ellipse(-sw - 0.02, sh - 0.075, sw + 0.02, sh + 0.075, col["top"])
    _draw_aerial_bag(pen, a["bag"], col["bag"], (sw, hw, sh, hip), side)
    return sh


def _draw_aerial_bag(pen: _Pen, bag: str, color: tuple, geom: tuple[float, ...], side: int) -> None:
    """Shoulder bag or handbag seen from high up (``geom`` = shoulder/hip half-widths, shoulder/hip y)."""
    sw, hw, sh, hip = geom
    if bag == "shoulder bag":
        pen.line([(-side * sw * 0.6, sh - 0.03), (side * (hw + 0.01), hip)], _shade(color, 0.75), 0.02)
        pen.ellipse(side * (hw - 0.02), hip - 0.04, side * (hw + 0.09), hip + 0.06, color)
    elif bag == "handbag":
        x = side * (sw + 0.04)
        pen.ellipse(x - 0.045, hip - 0.02, x + 0.045, hip + 0.07, color)


def _draw_aerial_head(pen: _Pen, a: dict[str, Any], col: dict[str, tuple], sh: float) -> None:
    """Head seen from high up: hair/hat dominate, a sliver of face at the front."""
    hair, hat, style = col["hair"], col["hat"], a["hair_style"]
    cy, rx, ry = sh - 0.13, 0.1, 0.11
    if a["top_type"] == "hoodie":
        pen.ellipse(-0.1, cy - 0.02, 0.1, sh + 0.03, _shade(col["top"], 0.7))
    if style == "long":
        pen.ellipse(-rx * 1.25, cy - 0.04, rx * 1.25, sh + 0.1, hair)
    elif style == "ponytail":
        pen.ellipse(-0.035, cy - ry - 0.08, 0.035, cy - ry + 0.03, hair)
    pen.ellipse(-rx, cy - ry, rx, cy + ry, col["skin"])
    if style != "bald":
        pen.ellipse(-rx * 1.03, cy - ry * 1.03, rx * 1.03, cy + ry * 0.45, hair)
    if style == "bun":
        pen.ellipse(-0.04, cy - 0.07, 0.04, cy + 0.01, _shade(hair, 0.85))
    if a["glasses"] and a["hat"] != "sun hat":
        pen.line([(-0.06, cy + ry * 0.72), (0.06, cy + ry * 0.72)], (20, 20, 20, 255), 0.014)
    if a["hat"] == "cap":
        pen.ellipse(-rx * 0.8, cy + ry * 0.2, rx * 0.8, cy + ry * 1.2, _shade(hat, 0.8))
        pen.ellipse(-rx * 1.04, cy - ry * 1.04, rx * 1.04, cy + ry * 0.5, hat)
    elif a["hat"] == "beanie":
        pen.ellipse(-rx * 1.06, cy - ry * 1.06, rx * 1.06, cy + ry * 0.6, hat)
        pen.ellipse(-rx * 0.3, cy - ry * 0.4, rx * 0.3, cy + ry * 0.1, _shade(hat, 0.85))
    elif a["hat"] == "sun hat":
        pen.ellipse(-0.17, cy - 0.16, 0.17, cy + 0.16, _shade(hat, 0.92))
        pen.ellipse(-0.085, cy - 0.09, 0.085, cy + 0.07, hat)


def _draw_aerial_figure(
    pen: _Pen, a: dict[str, Any], col: dict[str, tuple], rng: np.random.Generator
) -> None:
    """Steep top-down figure: big head and shoulders, short legs, cast shadow."""
    f = float(rng.uniform(0.45, 0.9))
    side = int(rng.choice([-1, 1]))
    dx = rng.uniform(-0.12, 0.12)
    pen.ellipse(-0.15 + dx, 0.3 + 0.3 * f, 0.15 + dx, 0.3 + 0.65 * f + 0.1, (0, 0, 0, 55))
    sh = _draw_aerial_body(pen, a, col, f, side)
    _draw_aerial_head(pen, a, col, sh)


# ----------------------------------------------------------------------------------------------- scenes
def _smooth_noise(rng: np.random.Generator, h: int, w: int, cells: int) -> np.ndarray:
    """Low-frequency noise in [0, 1] of shape (h, w)."""
    return resize_bilinear(rng.random((max(2, cells * h // w), cells)), h, w)


def _rgb(c: np.ndarray | Sequence[float]) -> tuple[float, float, float]:
    """An RGB triple clipped to [0, 255]."""
    return tuple(float(v) for v in np.clip(np.asarray(c, dtype=np.float64), 0, 255))


def street_background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Eye-level street scene: facade with windows, a horizon, pavement with seams, poles; (h, w, 3) float."""
    facades = [
        (150, 80, 60),
        (196, 184, 160),
        (140, 140, 146),
        (90, 110, 130),
        (176, 160, 130),
        (110, 100, 90),
    ]
    facade = np.array(facades[int(rng.integers(len(facades)))], dtype=np.float64) + rng.normal(0, 10, 3)
    pave = np.array([130, 128, 124], dtype=np.float64) + rng.normal(0, 12, 3)
    horizon = h * rng.uniform(0.5, 0.72)
    canvas = Canvas(h, w, ss=2, background=_rgb(facade))
    win = _rgb(facade * 0.45 + np.array([20, 30, 45]))
    step_x, step_y = int(rng.integers(w // 4, w // 2 + 1)), int(rng.integers(h // 8, h // 4 + 1))
    ox, oy = int(rng.integers(step_x)), int(rng.integers(step_y))
    for y in range(oy - step_y, int(horizon) - 4, step_y):
        for x in range(ox - step_x, w, step_x):
            canvas.rectangle(x, y, x + step_x * 0.55, y + step_y * 0.6, win)
    canvas.rectangle(0, horizon, w, h, _rgb(pave))
    for i in range(1, 8):
        y = horizon + (h - horizon) * (i / 7) ** 1.6
        canvas.polyline([(0, y), (w, y)], 1.0, _rgb(pave * 0.82))
    for _ in range(int(rng.integers(0, 3))):
        x = float(rng.integers(w))
        canvas.rectangle(x, h * rng.uniform(0.05, 0.4), x + max(1, w // 32), horizon + 6, (60, 62, 66))
    img = _textured(canvas.resolve()[0], rng, 0.18)
    return gaussian_blur(img, rng.uniform(0.4, 1.0))


def terrain_background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Top-down ground texture: pavement tiles, grass, asphalt with markings, or sand; (h, w, 3) float."""
    kind = int(rng.integers(4))
    base = [(150, 148, 142), (72, 122, 58), (70, 72, 76), (196, 172, 128)][kind]
    canvas = Canvas(h, w, ss=2, background=_rgb([v + rng.normal(0, 10) for v in base]))
    if kind == 0:
        step, ang = rng.uniform(w / 5, w / 2.5), rng.uniform(0, math.pi / 2)
        line = _shade(base, 0.75)
        for i in range(-12, 13):
            for a in (ang, ang + math.pi / 2):
                c, s = math.cos(a), math.sin(a)
                px, py = w / 2 + i * step * -s, h / 2 + i * step * c
                canvas.polyline(
                    [(px - c * 2 * h, py - s * 2 * h), (px + c * 2 * h, py + s * 2 * h)], 1.0, line
                )
    elif kind == 2 and rng.random() < 0.6:
        x = rng.uniform(0, w)
        canvas.polyline([(x, 0), (x + rng.uniform(-w / 2, w / 2), h)], max(1, w // 20), (215, 215, 205))
    return _textured(canvas.resolve()[0], rng, 0.45 if kind == 1 else 0.25)


def _textured(img: np.ndarray, rng: np.random.Generator, amount: float) -> np.ndarray:
    """Multiply by low-frequency shading and add fine grain."""
    h, w = img.shape[:2]
    shade = (
        1.0
        + amount * (_smooth_noise(rng, h, w, 4) - 0.5)
        + amount * 0.5 * (_smooth_noise(rng, h, w, 12) - 0.5)
    )
    return np.clip(img * shade[..., None] + rng.normal(0, 255 * amount * 0.06, (h, w, 1)), 0, 255)


def _photometric(img: np.ndarray, rng: np.random.Generator, view: int) -> np.ndarray:
    """Lighting, colour cast, resolution loss/blur and sensor noise on an (h, w, 3) float image."""
    h, w = img.shape[:2]
    if view == AERIAL:
        f = rng.uniform(0.35, 0.6)
        small = resize_bilinear(img, max(8, round(h * f)), max(4, round(w * f)))
        img = gaussian_blur(resize_bilinear(small, h, w), rng.uniform(0.3, 0.8))
    else:
        img = gaussian_blur(img, rng.uniform(0.0, 0.35))
    gain = rng.uniform(0.7, 1.3) * rng.uniform(0.9, 1.1, 3)
    contrast = rng.uniform(0.8, 1.15)
    mean = float(np.mean(img))
    img = ((img - mean) * contrast + mean) * gain
    return img + rng.normal(0, rng.uniform(2, 8 if view == AERIAL else 5), img.shape)


def render_person_with_mask(
    attrs: dict[str, Any], view: int, rng: np.random.Generator, size: tuple[int, int] = DEFAULT_SIZE
) -> tuple[Image.Image, np.ndarray]:
    """Render one image of ``attrs`` from ``view``; returns (RGB image, bool person mask of shape (H, W))."""
    h, w = size
    layer = Canvas(h, w, ss=SUPERSAMPLING)
    col = _palette(attrs, rng)
    if view == GROUND:
        scale = h * rng.uniform(0.8, 0.94)
        cx = w * (0.5 + rng.uniform(-0.08, 0.08))
        top = (h - scale) * rng.uniform(0.2, 0.8)
        angle, pivot = rng.uniform(-4, 4), (cx, top + scale)
        _draw_ground_figure(_Pen(layer, cx, top, scale, -math.radians(angle), pivot), attrs, col, rng)
        bg = street_background(rng, h, w)
    elif view == AERIAL:
        scale = h * rng.uniform(0.55, 0.8)
        cx = w * (0.5 + rng.uniform(-0.1, 0.1))
        top = (h - 0.85 * scale) * rng.uniform(0.3, 0.7)
        angle, pivot = rng.uniform(-40, 40), (cx, top + 0.4 * scale)
        _draw_aerial_figure(_Pen(layer, cx, top, scale, -math.radians(angle), pivot), attrs, col, rng)
        bg = terrain_background(rng, h, w)
    else:
        raise ValueError(f"view must be {AERIAL} (aerial) or {GROUND} (ground), got {view}")
    rgb, alpha = layer.resolve()
    img = _photometric(rgb + bg * (1.0 - alpha[..., None]), rng, view)
    return Image.fromarray(to_uint8(img)), alpha > 0.5


def render_person(
    attrs: dict[str, Any], view: int, rng: np.random.Generator, size: tuple[int, int] = DEFAULT_SIZE
) -> Image.Image:
    """Render one RGB image (``size`` = (H, W)) of the identity ``attrs`` from ``view`` (0 aerial, 1 ground)."""
    return render_person_with_mask(attrs, view, rng, size)[0]


# ----------------------------------------------------------------------------------------------- dataset
def _view_plan(n: int, ground_only: float, aerial_only: float, rng: np.random.Generator) -> list[str]:
    """Shuffled per-identity view availability: 'ground', 'aerial' or 'both'."""
    n_g, n_a = round(n * ground_only), round(n * aerial_only)
    n_g, n_a = min(n_g, n), min(n_a, n - min(n_g, n))
    plan = ["ground"] * n_g + ["aerial"] * n_a + ["both"] * (n - n_g - n_a)
    return [plan[i] for i in rng.permutation(n)]


def _views_of(kind: str) -> list[int]:
    """Views rendered for an identity of availability ``kind``."""
    return {"ground": [GROUND], "aerial": [AERIAL], "both": [AERIAL, GROUND]}[kind]


def _split_sizes(n: int, test_fraction: float) -> tuple[int, int]:
    """(train, test) identity counts, each at least 1 when n >= 2."""
    n_test = round(n * test_fraction)
    if n >= 2:
        n_test = min(max(n_test, 1), n - 1)
    return n - n_test, n_test


def plan_identities(
    num_identities: int, seed: int, test_fraction: float, ground_only: float, aerial_only: float
) -> list[dict[str, Any]]:
    """The set's identities with id, split, view availability and attributes (the footage reuses them)."""
    rng = np.random.default_rng([seed, 0])
    identities = sample_identities(num_identities, rng)
    n_train, n_test = _split_sizes(num_identities, test_fraction)
    kinds = _view_plan(n_train, ground_only, aerial_only, rng) + _view_plan(
        n_test, ground_only, aerial_only, rng
    )
    return [
        {"id": i, "split": "train" if i < n_train else "test", "views": kinds[i], "attributes": identities[i]}
        for i in range(num_identities)
    ]


def _write_json(path: Path, obj: Any, indent: int | None = None) -> None:
    """Write JSON deterministically and atomically."""
    atomic_write(path, (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode())


def _summary(records: dict[str, list[dict[str, Any]]], plan: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-split counts of identities, images, captions and views."""
    out: dict[str, Any] = {}
    for split, recs in records.items():
        kinds = [p["views"] for p in plan if p["split"] == split]
        out[split] = {
            "identities": len(kinds),
            "images": len(recs),
            "captions": sum(len(r["captions"]) for r in recs),
            "aerial_images": sum(r["cam_id"] == AERIAL for r in recs),
            "ground_images": sum(r["cam_id"] == GROUND for r in recs),
            "ground_only_ids": kinds.count("ground"),
            "aerial_only_ids": kinds.count("aerial"),
            "both_view_ids": kinds.count("both"),
        }
    return out


RENDER_PARAMETERS = (  # what the pixels and captions depend on: recorded in dataset_info.json
    "num_identities",
    "seed",
    "image_size",
    "images_per_view",
    "test_images_per_view",
    "test_fraction",
    "ground_only_fraction",
    "aerial_only_fraction",
)
MIN_IMAGES_PER_WORKER = (
    200  # below this a process pool costs more than it saves (~21 ms an image on one core)
)
IMAGE_NAME = re.compile(r"(train|test)/\d{5}/\d{5}_c\d_\d{2}\.png")  # this generator's image paths


def _image_path(split: str, identity: int, view: int, k: int) -> str:
    return f"{split}/{identity:05d}/{identity:05d}_c{view}_{k:02d}.png"


def _render_chunk(out: Path, seed: int, image_size: tuple[int, int], jobs: list[tuple]) -> int:
    """Render and save the images of ``jobs`` ((attributes, split, id, view, k) each); return how many."""
    for attrs, split, identity, view, k in jobs:
        path = out / "images" / _image_path(split, identity, view, k)
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(
            [seed, 1, identity, view, k]
        )  # per image: same bytes for any worker count
        render_person(attrs, view, rng, image_size).save(path)
    return len(jobs)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_count(workers: int | None, images: int) -> int:
    """Rendering processes: ``workers`` when given, else every core, one per ``MIN_IMAGES_PER_WORKER`` images."""
    if workers is None:
        return max(1, min(_cores(), images // MIN_IMAGES_PER_WORKER))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a whole number >= 1 (or None: every core), got {workers!r}")
    return workers


def _render_images(out: Path, jobs: list[tuple], seed: int, image_size, workers: int, progress: bool) -> None:
    """Render ``jobs`` in identity chunks, in this process (1 worker) or a pool of ``workers`` processes."""
    by_identity: dict[int, list[tuple]] = {}
    for job in jobs:
        by_identity.setdefault(job[2], []).append(job)
    groups = list(by_identity.values())
    size = max(1, math.ceil(len(groups) / (workers * 8)))  # ~8 chunks a worker: the load stays balanced
    chunks = [sum(groups[i : i + size], []) for i in range(0, len(groups), size)]
    with Progress("rendering synthetic persons", len(jobs), "image", enabled=progress) as bar:
        if workers == 1:
            for chunk in chunks:
                bar.update(_render_chunk(out, seed, image_size, chunk))
            return
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(_render_chunk, out, seed, image_size, chunk) for chunk in chunks]
            for future in as_completed(futures):
                bar.update(future.result())


def _previous_images(out: Path) -> set[str]:
    """Image paths (under ``images/``) that a previous render of this generator in ``out`` listed."""
    try:
        info = json.loads((out / "dataset_info.json").read_text(encoding="utf-8"))
        if not isinstance(info, dict) or info.get("generator") not in GENERATORS:
            return set()
        records = [r for split in ("train", "test") for r in _read_records(out / f"{split}_reid.json")]
    except (OSError, ValueError):
        return set()
    paths = {str(r.get("file_path")) for r in records if isinstance(r, dict)}
    return {path for path in paths if IMAGE_NAME.fullmatch(path)}


def _read_records(path: Path) -> list:
    records = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    return records if isinstance(records, list) else []


def _remove_images(out: Path, paths: set[str]) -> None:
    """Delete images of a previous render (this generator's names only) and the identity folders left empty."""
    for rel in sorted(paths):
        path = out / "images" / rel
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: something else lives there, it stays
            path.parent.rmdir()


def generate_dataset(
    out_dir: str | Path,
    num_identities: int = 260,
    seed: int = 0,
    image_size: tuple[int, int] = DEFAULT_SIZE,
    images_per_view: int = 2,
    test_fraction: float = 0.25,
    test_images_per_view: int | None = None,
    ground_only_fraction: float = 0.2,
    aerial_only_fraction: float = 0.2,
    progress: bool = True,
    workers: int | None = None,
) -> dict[str, Any]:
    """Render the dataset into ``out_dir`` (TAG-PEDES layout) and return per-split summary counts.

    Each identity gets ``images_per_view`` images of each view it is seen from; a test identity gets
    ``test_images_per_view`` when given (the training split is the same either way). ``workers`` processes render the images (None: the machine's cores, one process for small sets); the files
    are byte-identical for any count. Re-rendering over an earlier render of this generator replaces its files and
    removes the images it listed that this render does not write; nothing else in ``out_dir`` is touched.
    ``dataset_info.json`` is written last: a render cut short is never taken for a finished one."""
    if num_identities < 1 or images_per_view < 1:
        raise ValueError("num_identities and images_per_view must be >= 1")
    if test_images_per_view is not None and (
        isinstance(test_images_per_view, bool)
        or not isinstance(test_images_per_view, int)
        or test_images_per_view < 1
    ):
        raise ValueError(
            f"test_images_per_view must be a whole number >= 1 (or None), got {test_images_per_view!r}"
        )
    if (
        ground_only_fraction < 0
        or aerial_only_fraction < 0
        or ground_only_fraction + aerial_only_fraction > 1
    ):
        raise ValueError("view fractions must be >= 0 and sum to <= 1")
    out = Path(out_dir)
    plan = plan_identities(num_identities, seed, test_fraction, ground_only_fraction, aerial_only_fraction)
    per_view = {"train": images_per_view, "test": test_images_per_view or images_per_view}
    jobs = [(p, v, k) for p in plan for v in _views_of(p["views"]) for k in range(per_view[p["split"]])]
    render_jobs = [(p["attributes"], p["split"], p["id"], view, k) for p, view, k in jobs]
    workers = worker_count(workers, len(jobs))
    previous = _previous_images(out)
    _render_images(out, render_jobs, seed, tuple(image_size), workers, progress)
    records: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for p, view, k in jobs:
        rel = _image_path(p["split"], p["id"], view, k)
        captions = image_captions(p["attributes"], seed, p["id"], view, k)
        records[p["split"]].append({"id": p["id"], "file_path": rel, "captions": captions, "cam_id": view})
    _remove_images(out, previous - {r["file_path"] for recs in records.values() for r in recs})
    _write_json(out / "train_reid.json", records["train"])
    _write_json(out / "test_reid.json", records["test"])
    _write_json(out / "identities.json", plan, indent=1)
    crops = [
        (p["split"], f"{p['id']:05d}/{p['id']:05d}_c{view}_{k:02d}.png", p["id"], view, k)
        for p, view, k in jobs
    ]
    write_sidecars(
        out, crops, seed
    )  # metadata/<split>.csv: camera and time of each crop, for filtered search
    summary = _summary(records, plan)
    params = {
        "num_identities": num_identities,
        "seed": seed,
        "image_size": list(image_size),
        "images_per_view": images_per_view,
        "test_images_per_view": test_images_per_view,
        "test_fraction": test_fraction,
        "ground_only_fraction": ground_only_fraction,
        "aerial_only_fraction": aerial_only_fraction,
    }
    info = {
        "generator": "modeling_tagclip.data.synthetic",
        "version": GENERATOR_VERSION,
        "cam_id": {str(label): name for label, name in enumerate(VIEW_NAMES)},
    }
    _write_json(out / "dataset_info.json", {**info, "parameters": params, "counts": summary}, indent=2)
    return summary


def requested_parameters(requested: dict[str, Any]) -> dict[str, Any]:
    """The full ``RENDER_PARAMETERS`` a ``generate_dataset(**requested)`` call renders with (its defaults filled in),
    as ``dataset_info.json`` records them."""
    defaults = inspect.signature(generate_dataset).parameters
    values = {key: requested.get(key, defaults[key].default) for key in RENDER_PARAMETERS}
    return json.loads(json.dumps(values))  # tuples → lists, as recorded


def stale_render(root: str | Path, requested: dict[str, Any] | None = None) -> str | None:
    """Why the synthetic set in ``root`` does not match this generator or, given ``requested`` (``generate_dataset``
    keyword arguments), the parameters asked for; None when it matches or ``root`` holds no synthetic set."""
    path = Path(root) / "dataset_info.json"
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"{root}: dataset_info.json is not readable JSON ({err})"
    if not isinstance(info, dict) or info.get("generator") not in GENERATORS:
        return None
    if info.get("version") != GENERATOR_VERSION:
        return (
            f"{root} was rendered by synthetic generator version {info.get('version')}, this code renders version "
            f"{GENERATOR_VERSION} (different pixels)"
        )
    if requested is None:
        return None
    recorded = info.get("parameters") if isinstance(info.get("parameters"), dict) else {}
    wanted = requested_parameters(requested)
    differ = [key for key in RENDER_PARAMETERS if recorded.get(key) != wanted[key]]
    if not differ:
        return None
    was = ", ".join(f"{key} {json.dumps(recorded.get(key))}" for key in differ)
    asked = ", ".join(f"{key} {json.dumps(wanted[key])}" for key in differ)
    return f"{root} was rendered with {was}, not the requested {asked}"


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-identities", type=int, default=260, help="total identities (train + test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--height", type=int, default=DEFAULT_SIZE[0])
    p.add_argument("--width", type=int, default=DEFAULT_SIZE[1])
    p.add_argument("--images-per-view", type=int, default=2)
    p.add_argument("--test-fraction", type=float, default=0.25)
    p.add_argument(
        "--test-images-per-view",
        type=int,
        default=None,
        help="images per view of a test identity (default: --images-per-view)",
    )
    p.add_argument("--ground-only-fraction", type=float, default=0.2)
    p.add_argument("--aerial-only-fraction", type=float, default=0.2)
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="rendering processes (default: every core; 1: this process only)",
    )
    return accept_both_spellings(p).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """CLI entry point."""
    a = _parse_args(argv)
    summary = generate_dataset(
        a.out,
        num_identities=a.num_identities,
        seed=a.seed,
        image_size=(a.height, a.width),
        images_per_view=a.images_per_view,
        test_fraction=a.test_fraction,
        test_images_per_view=a.test_images_per_view,
        ground_only_fraction=a.ground_only_fraction,
        aerial_only_fraction=a.aerial_only_fraction,
        progress=not a.no_progress,
        workers=a.workers,
    )
    print(json.dumps(summary, indent=2))
    return summary
