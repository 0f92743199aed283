"""The demo's "Follow a person" tab (app.py builds it when the package is installed): upload a video or use the
synthetic footage, ingest it into a gallery, describe the person, click a hit to see more like it and the
person's per-camera timeline.

The page logic is ``modeling_tagclip.video.follow.FollowSession``; this module wires it to Gradio. Each
browser session gets its own temporary gallery folder under the demo's folder, unless the demo was started
with ``--footage-dir DIR`` (then every session shares the gallery in DIR). A step that fails shows one line
starting with "Error:" under the buttons.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr  # module level: Gradio reads the SelectData annotation of the click handler

MAX_HITS = 20
NO_TIMELINE = "<p>Click a hit to see more like it and the person's timeline.</p>"


def _session(state: dict | None, model: Any, processor: Any, folder: str | None, parent: str) -> dict:
    """The browser session's state: its ``FollowSession`` (created on first use) and its last hits."""
    from modeling_tagclip.video.follow import FollowSession

    if state is None or state.get("session") is None:
        state = {"session": FollowSession(model, processor, folder, parent=parent), "hits": [], "like": []}
    return state


def _error(error: Exception) -> str:
    return "Error: " + " ".join(str(error).split())


def _items(session: Any, hits: list[dict[str, Any]]) -> list[tuple[Any, str]]:
    """Gallery items: each hit's best crop (a PIL image) and its one-line caption."""
    from PIL import Image

    from modeling_tagclip.video.follow import hit_caption

    items = []
    for hit in hits:
        with Image.open(session.index.image_file(hit["path"])) as crop:
            items.append((crop.convert("RGB"), hit_caption(hit)))
    return items


def ingest(state, video, model, processor, folder, parent) -> tuple[dict | None, str]:
    """The "Ingest" button: the uploaded video into the gallery."""
    try:
        state = _session(state, model, processor, folder, parent)
        path = getattr(video, "name", video)
        return state, state["session"].ingest([path] if path else [])
    except (ValueError, OSError) as error:
        return state, _error(error)


def synthetic(state, model, processor, folder, parent) -> tuple[dict | None, str]:
    """The "Use the synthetic footage" button: render the small synthetic footage and ingest it."""
    try:
        state = _session(state, model, processor, folder, parent)
        return state, state["session"].use_synthetic()
    except (ValueError, OSError) as error:
        return state, _error(error)


def find(state, description, top_k) -> tuple[dict | None, list, str, list, str]:
    """The "Find" button: one hit per track for the description; clears "more like this" and the timeline."""
    try:
        if state is None:
            raise ValueError("the gallery is empty: ingest a video or use the synthetic footage first")
        session = state["session"]
        hits = session.search(description, int(top_k))
        state = {**state, "hits": hits, "like": []}
        status = f"{len(hits)} track(s) for “{description.strip()}”. Click one to follow the person."
        return state, _items(session, hits), status, [], NO_TIMELINE
    except (ValueError, OSError) as error:
        return state, [], _error(error), [], NO_TIMELINE


def pick(state, top_k, min_score, index: int | None) -> tuple[list, str, str]:
    """A click on hit ``index``: "more like this" (its track as the image query) and the timeline of those
    tracks scoring at least ``min_score``."""
    try:
        if state is None or index is None or not 0 <= index < len(state["hits"]):
            raise ValueError("click one of the hits first")
        session, hit = state["session"], state["hits"][index]
        like = session.more_like(hit, int(top_k))
        state["like"] = like
        timeline = session.timeline_html(like, float(min_score))
        status = (
            f"More like #{hit['rank']} ({hit.get('camera')}, track {hit.get('track')}): {len(like)} "
            f"track(s); the timeline shows those scoring at least {float(min_score):.2f}."
        )
        return _items(session, like), timeline, status
    except (ValueError, OSError) as error:
        return [], NO_TIMELINE, _error(error)


def follow_tab(model: Any, processor: Any, folder: str | None, parent: str) -> None:
    """The tab's components and events (inside a ``gr.Blocks``)."""
    state = gr.State(None)
    gr.Markdown(
        "Upload a video (or use the synthetic footage: two street cameras and a drone), ingest it, describe "
        "the person, then click a hit: **more like this** searches with that track's crops, and the "
        "**timeline** puts the matching tracks on a row per camera."
    )
    with gr.Row():
        video = gr.File(label="Video", file_types=["video"], elem_id="follow-video", scale=3)
        with gr.Column(scale=1):
            ingest_button = gr.Button("Ingest the video", elem_id="follow-ingest")
            synthetic_button = gr.Button("Use the synthetic footage", elem_id="follow-synthetic")
    with gr.Row():
        description = gr.Textbox(label="Description", elem_id="follow-query", scale=4)
        top_k = gr.Slider(1, MAX_HITS, value=8, step=1, label="Tracks", elem_id="follow-top-k", scale=1)
        min_score = gr.Slider(
            -1, 1, value=-1, step=0.01, label="Timeline: minimum score", scale=1, elem_id="follow-min-score"
        )
    find_button = gr.Button("Find", variant="primary", elem_id="follow-find")
    status = gr.Markdown("Ingest a video or use the synthetic footage.", elem_id="follow-status")
    hits = gr.Gallery(
        label="Tracks (click one)",
        columns=8,
        height=320,
        elem_id="follow-hits",
        object_fit="contain",
        allow_preview=False,
    )
    like = gr.Gallery(
        label="More like this",
        columns=8,
        height=320,
        elem_id="follow-like",
        object_fit="contain",
        allow_preview=False,
    )
    timeline = gr.HTML(NO_TIMELINE, elem_id="follow-timeline")

    def on_pick(current, k, score, event: gr.SelectData):
        return pick(current, k, score, event.index if isinstance(event.index, int) else None)

    ingest_button.click(
        lambda s, v: ingest(s, v, model, processor, folder, parent), [state, video], [state, status]
    )
    synthetic_button.click(lambda s: synthetic(s, model, processor, folder, parent), [state], [state, status])
    outputs = [state, hits, status, like, timeline]
    find_button.click(find, [state, description, top_k], outputs)
    description.submit(find, [state, description, top_k], outputs)
    hits.select(on_pick, [state, top_k, min_score], [like, timeline, status])


def footage_root(folder: str | None) -> str:
    """The folder the page may serve footage from: the named gallery folder, else a temporary one."""
    import atexit
    import shutil
    import tempfile

    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        return str(Path(folder).resolve())
    root = tempfile.mkdtemp(prefix="tagclip-demo-")
    atexit.register(shutil.rmtree, root, True)
    return root
