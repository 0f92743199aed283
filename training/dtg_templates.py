"""The template set shipped with DTG template- and attribute-based generation (``training.dtg``).

The paper fills ``{template}`` with templates from its appendix (after Tan et al. 2024), which is not part
of the material this project has. These were written for this project in that style: one sentence each,
bracketed slots for age, gender, hair, top, bottom, shoes and belongings, varied in order and phrasing.
Pass ``--templates FILE`` (a JSON list of strings) to ``python -m training.dtg`` to use your own.
"""

from __future__ import annotations

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
