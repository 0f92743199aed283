"""DTG's prompts (paper, "Text Generation"), the shipped template set, the mixing rule and caption cleaning.

The three generation prompts are verbatim from the paper. It fills ``{template}`` with templates from its
appendix (after Tan et al. 2024), which is not part of the material this project has: ``TEMPLATES`` were
written in that style, one sentence each, bracketed slots for age, gender, hair, top, bottom, shoes and
belongings, varied in order and phrasing. ``--templates FILE`` (a JSON list of strings) replaces them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from modeling_tagclip.dtg.scan import ImageItem

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

TEMPLATES: tuple[str, ...] = (
    "A [age] [gender] with [hair color and style] hair is wearing a [top color and style] and "
    "[bottom color and style], with [shoes color and style] shoes, and is carrying [belongings].",
    "The [gender] has [hair color and style] hair and wears a [top color and style], "
    "[bottom color and style] and [shoes color and style] shoes.",
    "This [age] [gender] is dressed in a [top color and style] over [bottom color and style]; "
    "[his/her] hair is [hair color and style] and [he/she] carries [belongings].",
    "A [gender] in a [top color and style] and [bottom color and style] walks with [belongings], "
    "wearing [shoes color and style] shoes.",
    "The person is a [age] [gender] wearing a [top color and style], [bottom color and style] and "
    "[shoes color and style] shoes.",
    "[Hair color and style] hair, a [top color and style], [bottom color and style] and "
    "[shoes color and style] shoes: this [age] [gender] is holding [belongings].",
    "A [age] [gender] wearing [shoes color and style] shoes, [bottom color and style] and a "
    "[top color and style], with [hair color and style] hair.",
    "The [age] [gender] has [hair color and style] hair, a [top color and style] with "
    "[bottom color and style], and carries [belongings] on [his/her] [shoulder/back/hand].",
    "A [gender] who looks [age] is wearing a [top color and style] and [bottom color and style].",
    "[He/She] is a [age] [gender] in a [top color and style] and [bottom color and style], "
    "wearing [shoes color and style] shoes and carrying [belongings].",
    "The pedestrian, a [gender] with [hair color and style] hair, wears a [top color and style], "
    "[bottom color and style] and [shoes color and style] shoes.",
    "A [age] [gender] dressed in [top color and style] and [bottom color and style], "
    "with [belongings] and [shoes color and style] shoes.",
    "This [gender] wears a [top color and style] on top and [bottom color and style] below, "
    "with [shoes color and style] shoes; [his/her] hair is [hair color and style].",
    "A [gender] carrying [belongings] wears a [top color and style], [bottom color and style] "
    "and [shoes color and style] shoes.",
    "The [age] [gender] is in a [top color and style] paired with [bottom color and style] and "
    "[shoes color and style] shoes, and has [hair color and style] hair.",
    "A [age] [gender] with [hair color and style] hair, a [top color and style], "
    "[bottom color and style], [shoes color and style] shoes and [belongings].",
    "[He/She] has [hair color and style] hair and is wearing a [top color and style] and "
    "[bottom color and style].",
    "The [gender] is wearing [shoes color and style] shoes with [bottom color and style] and a "
    "[top color and style], and is carrying [belongings] in [his/her] hand.",
    "A [gender] of [age] age in a [top color and style], [bottom color and style] and "
    "[shoes color and style] shoes, with [hair color and style] hair.",
    "This person is a [gender] wearing a [top color and style]; [he/she] also wears "
    "[bottom color and style] and [shoes color and style] shoes and carries [belongings].",
    "A [age] [gender] in [bottom color and style] and a [top color and style] has "
    "[hair color and style] hair and [shoes color and style] shoes.",
    "The [gender] with [belongings] is dressed in a [top color and style], "
    "[bottom color and style] and [shoes color and style] shoes.",
    "Wearing a [top color and style] and [bottom color and style], the [age] [gender] has "
    "[hair color and style] hair and carries [belongings].",
    "A [gender] with [hair color and style] hair, wearing a [top color and style], "
    "[bottom color and style] and [shoes color and style] shoes, is walking.",
)


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
