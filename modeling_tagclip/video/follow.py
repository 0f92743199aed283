"""Following a person in footage, as the demo does it: videos (or the synthetic footage) into a gallery folder,
a description to one hit per track, a hit to "more like this" (its track's crops as the query) and the
person's per-camera timeline.

``FollowSession(model, processor, folder)`` owns ``folder`` (a temporary one, removed at exit, when None): the
gallery index ``folder/gallery.idx`` and its crops ``folder/gallery.idx.crops``. Every step raises
``FollowError`` (a ValueError) with one line naming the problem.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEMO_FOOTAGE", "FollowError", "FollowSession", "hit_caption"]

# the synthetic footage the demo renders: small and short, so rendering and ingesting take seconds
DEMO_FOOTAGE = {
    "ground_cameras": 2,
    "aerial_cameras": 1,
    "people": 4,
    "people_per_camera": 3,
    "seconds": 6.0,
    "fps": 5.0,
    "size": (144, 256),
}
FETCH_PER_TRACK = 8  # crops fetched per wanted track (as tagclip search does)


class FollowError(ValueError):
    """A step of the flow that cannot go on (its message is one line for the page)."""


def _clock(seconds: float | None) -> str:
    from datetime import datetime, timezone

    if seconds is None:
        return "?"
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%H:%M:%S")


def hit_caption(hit: dict[str, Any]) -> str:
    """One line for a per-track hit: rank, camera, track, time span and score."""
    span = f"{_clock(hit.get('t_start'))}-{_clock(hit.get('t_end'))}"
    return (
        f"#{hit['rank']} · {hit.get('camera') or '?'} · track {hit.get('track') or '?'} · {span} · "
        f"score {hit['score']:.3f}"
    )


class FollowSession:
    """One user's footage gallery and the searches on it (see the module docstring)."""

    def __init__(
        self, model: Any, processor: Any, folder: str | Path | None = None, parent: str | Path | None = None
    ):
        """``folder``: the gallery folder (created when missing); None: a temporary one under ``parent``."""
        self.model, self.processor = model, processor
        if folder is None or not str(folder).strip():
            folder = Path(tempfile.mkdtemp(prefix="tagclip-demo-footage-", dir=parent))
            atexit.register(shutil.rmtree, folder, True)
        self.folder = Path(folder).expanduser()
        if self.folder.exists() and not self.folder.is_dir():
            raise FollowError(f"gallery folder {self.folder} is a file, not a folder")
        self.out = self.folder / "gallery.idx"
        self.crops = self.folder / "gallery.idx.crops"
        self.index: Any = None
        if self._built():
            self._open()

    # -- footage into the gallery ----------------------------------------------------------------------------

    def ingest(self, videos: Sequence[str | Path], cameras: str | Path | None = None) -> str:
        """Ingest ``videos`` (with a camera file, or each video its own camera named after the file) into the
        gallery; a status line (how many tracks and crops it now holds). Videos from outside the folder are
        copied into ``folder/videos`` first, so the timeline's links keep working."""
        from modeling_tagclip.video.detect import load_detector
        from modeling_tagclip.video.frames import expand_sources
        from modeling_tagclip.video.gallery import GalleryTarget
        from modeling_tagclip.video.ingest import Ingest, IngestOptions

        if not videos:
            raise FollowError("no video given: upload a video file or use the synthetic footage")
        missing = [str(v) for v in videos if not Path(v).is_file()]
        if missing:
            raise FollowError(f"no video file at {missing[0]}")
        videos = [self._keep(Path(v)) for v in videos]
        detector, said = load_detector("motion"), []
        options = IngestOptions(
            self.crops,
            GalleryTarget(out=self.out, model_name=self._model_name()),
            Path(cameras) if cameras else None,
        )
        summary = Ingest(self.model, self.processor, lambda source: detector, options, say=said.append).run(
            expand_sources([str(v) for v in videos])
        )
        if summary.failed:
            raise FollowError(" ".join(summary.failed[0].split()))
        if not self._built():
            raise FollowError("no person was found in the footage (nothing moved long enough to be tracked)")
        self._open()
        already = f" ({summary.skipped} already in the gallery)" if summary.skipped else ""
        return (
            f"Ingested {summary.sources} video(s){already}: {summary.tracks} new track(s); the gallery holds "
            f"{self.tracks()} track(s), {len(self.index)} crop(s) in {self.folder}."
        )

    def _keep(self, video: Path) -> Path:
        """``video`` itself when it lies in the folder, else its copy in ``folder/videos``."""
        if video.resolve().is_relative_to(self.folder.resolve()):
            return video
        kept = self.folder / "videos" / video.name
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(video, kept)
        return kept

    def use_synthetic(self, seed: int = 0) -> str:
        """Render the demo's small synthetic footage into the folder (once) and ingest it."""
        from modeling_tagclip.video.footage import render_footage

        root = self.folder / "synthetic-footage"
        if not (root / "cameras.yaml").is_file():
            render_footage(root, seed=seed, **DEMO_FOOTAGE)
        return self.ingest(sorted((root / "videos").glob("*.mp4")), root / "cameras.yaml")

    def _built(self) -> bool:
        from modeling_tagclip.retrieval.embedded.index_store import HEADER

        return (self.out / HEADER).is_file()

    def _model_name(self) -> str:
        return str(getattr(self.model, "name_or_path", "") or "")

    def _open(self) -> None:
        from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex

        self.index = GalleryIndex.load(self.out)
        self.index.check_model(self.model)

    def tracks(self) -> int:
        """How many tracks the gallery holds."""
        from modeling_tagclip.video.manifest import read_manifest

        return len({(row["camera"], row["track"]) for row in read_manifest(self.crops)})

    # -- searches ------------------------------------------------------------------------------------------

    def _gallery(self) -> Any:
        if self.index is None:
            raise FollowError("the gallery is empty: ingest a video or use the synthetic footage first")
        return self.index

    def _per_track(self, query: dict, top_k: int) -> list[dict[str, Any]]:
        from modeling_tagclip.retrieval.timeline import per_track, with_seek

        index = self._gallery()
        hits = index.search(query, top_k=min(len(index), top_k * FETCH_PER_TRACK))[0]
        return per_track(with_seek(hits), top_k)

    def search(self, description: str, top_k: int = 8) -> list[dict[str, Any]]:
        """One hit per track for a description, best first."""
        from modeling_tagclip.retrieval.encode import encode_texts

        if not isinstance(description, str) or not description.strip():
            raise FollowError("type a description of the person first")
        self._gallery()
        return self._per_track(encode_texts(self.model, self.processor, [description.strip()]), top_k)

    def track_query(self, hit: dict[str, Any]) -> dict:
        """The query of a hit's track: the mean of its crops' stored embeddings (``set_query``); a crop without
        a track stands for itself."""
        from modeling_tagclip.retrieval.queries import set_query

        index = self._gallery()
        if hit.get("track") in (None, ""):
            rows = [int(hit["index"])]
        else:
            mask = index.mask({"camera": hit["camera"], "track": str(hit["track"])})
            rows = mask.nonzero().squeeze(1).tolist() if mask is not None else [int(hit["index"])]
        if not rows:
            raise FollowError(f"track {hit['track']} of camera {hit['camera']} is not in the gallery")
        return set_query(index.row_embeddings(rows))

    def more_like(self, hit: dict[str, Any], top_k: int = 8) -> list[dict[str, Any]]:
        """One hit per track for the image query of ``hit``'s track ("more like this"), best first."""
        return self._per_track(self.track_query(hit), top_k)

    def timeline_html(self, hits: Sequence[dict[str, Any]], min_score: float | None = None) -> str:
        """The per-camera timeline (``retrieval.timeline``) of ``hits`` scoring at least ``min_score``, as an
        HTML block with each sighting's thumbnail linking to its video at that second (served by the page)."""
        from modeling_tagclip.retrieval.report import thumbnail_data_uri
        from modeling_tagclip.retrieval.timeline import timeline, timeline_html, video_link

        index = self._gallery()

        def thumbnail(hit: dict[str, Any]) -> str:
            return thumbnail_data_uri(str(index.image_file(hit["path"])), hit.get("predicted_view"))

        def link(hit: dict[str, Any]) -> str | None:
            target = video_link(hit)
            return f"/gradio_api/file={target}" if target else None

        return timeline_html(timeline(list(hits), min_score), thumbnail, link)
