"""What a search shows: thumbnails with a view badge, the contact sheet (PNG) and the HTML report of ranked hits
(with per-camera timelines), used by ``tagclip search --png/--html`` and the demo."""

from __future__ import annotations

import base64
import html
import io
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "VIEW_COLOURS",
    "contact_sheet",
    "html_report",
    "predicted_view",
    "thumbnail",
    "thumbnail_data_uri",
]

VIEW_COLOURS = {"aerial": (30, 110, 220), "ground": (225, 120, 20), None: (120, 120, 120)}


def predicted_view(hit: dict[str, Any]) -> str:
    """The router's prediction of a hit and its probability ("ground 0.83"), or "-" without a router."""
    if not hit.get("predicted_view"):
        return "-"
    return f"{hit['predicted_view']} {hit['predicted_view_score']:.2f}"


def thumbnail(path: str | None, view: str | None, size: tuple[int, int] = (96, 192)):
    """A crop fitted on a grey canvas of ``size`` under a bar coloured and labelled by ``view``."""
    from PIL import Image, ImageDraw, ImageOps

    canvas = Image.new("RGB", size, (235, 235, 235))
    if path and Path(path).is_file():
        try:
            with Image.open(path) as img:
                img.draft("RGB", size)  # JPEG: decode at about the thumbnail's size
                img = ImageOps.contain(img.convert("RGB"), size)
            canvas.paste(img, ((size[0] - img.width) // 2, (size[1] - img.height) // 2))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            warnings.warn(
                f"{path} is not a readable image ({error}); a grey placeholder stands in", stacklevel=2
            )
    draw = ImageDraw.Draw(canvas)
    draw.rectangle([0, 0, size[0] - 1, 13], fill=VIEW_COLOURS.get(view, VIEW_COLOURS[None]))
    draw.text((3, 1), (view or "view ?").upper(), fill=(255, 255, 255))
    return canvas


def contact_sheet(queries: Sequence[str], results: Sequence[list[dict[str, Any]]], size=(96, 192)):
    """A PNG-ready PIL image: one row per query, its top hits with rank, score and a predicted-view badge."""
    from PIL import Image, ImageDraw

    columns = max((len(h) for h in results), default=1)
    row_h, label_w = size[1] + 34, 220
    sheet = Image.new("RGB", (label_w + columns * (size[0] + 6), row_h * len(queries)), "white")
    draw = ImageDraw.Draw(sheet)
    for row, (query, hits) in enumerate(zip(queries, results, strict=True)):
        y = row * row_h
        for line, start in enumerate(range(0, len(query), 34)):
            draw.text((4, y + 4 + 12 * line), query[start : start + 34], fill="black")
        for col, hit in enumerate(hits):
            x = label_w + col * (size[0] + 6)
            sheet.paste(thumbnail(hit.get("image", hit["path"]), hit["predicted_view"], size), (x, y + 4))
            draw.text((x, y + size[1] + 8), f"#{hit['rank']}  {hit['score']:.3f}", fill="black")
    return sheet


def thumbnail_data_uri(path: str | None, view: str | None) -> str:
    """A crop's thumbnail with its view badge as an inline PNG data URI (grey placeholder if unreadable)."""
    buffer = io.BytesIO()
    thumbnail(path, view).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def html_report(
    queries: Sequence[str], results: Sequence[list[dict[str, Any]]], timelines: Sequence | None = None
) -> str:
    """A self-contained HTML page (embedded thumbnails) of the ranked hits of every query; with ``timelines``,
    each query's per-camera timeline above its hits (markers link to the video at the sighting's second)."""
    from .timeline import timeline_html, video_link

    parts = ["<!doctype html><meta charset='utf-8'><title>TAG-CLIP search</title>"]
    parts.append("<style>figure{display:inline-block;margin:4px;font:12px sans-serif}</style>")
    for j, (query, hits) in enumerate(zip(queries, results, strict=True)):
        parts.append(f"<h3>{html.escape(query)}</h3>")
        if timelines is not None:
            thumbs = {hit.get("index"): hit for hit in hits}
            parts.append(
                timeline_html(
                    timelines[j],
                    lambda h, thumbs=thumbs: thumbnail_data_uri(
                        thumbs.get(h.get("index"), h).get("image"), h.get("predicted_view")
                    ),
                    video_link,
                )
            )
        parts.append("<div>")
        for hit in hits:
            views = f"view {hit['view'] or '?'}, predicted {predicted_view(hit)}"
            name = html.escape(Path(str(hit["path"])).name)
            hit_id = f"<br>id {html.escape(hit['id'])}" if hit.get("id") else ""  # for --like
            caption = f"#{hit['rank']} {hit['score']:.3f}{hit_id}<br>{views}<br>{name}"
            parts.append(
                f"<figure><img src='{thumbnail_data_uri(hit.get('image', hit['path']), hit['predicted_view'])}' "
                f"title='{html.escape(str(hit['path']))}'><figcaption>{caption}</figcaption></figure>"
            )
        parts.append("</div>")
    return "\n".join(parts)
