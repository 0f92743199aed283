"""The ``GalleryStore`` contract, one suite run against the embedded index, Milvus Lite and a brute-force
in-memory backend written here: add (in one go or resumed in two parts), remove, every filter, queries by
text-side or image-side vectors, the stored embeddings of crops by hit id and of a track, count/describe/close,
and the same ranked paths and scores from all three as a reference TAG-PR Eq. 14 ranking computed in the test."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from modeling_tagclip.retrieval.encode import view_prediction
from modeling_tagclip.retrieval.gallery_types import (
    CROP_COLUMNS,
    GalleryIndexError,
    Hit,
    SearchFilter,
    crop_id,
    decode_metadata,
    metadata_row,
    parse_time,
)
from modeling_tagclip.retrieval.store import GalleryStore

ROWS, DIM = 40, 8
HIT_KEYS = set(Hit.__annotations__)
FILTERS = [
    None,
    {"view": "aerial"},
    {"camera": "c1"},
    {"camera": ["c0", "c2"]},
    {"tag": "red"},
    {"after": "2026-01-01T10:10", "before": "2026-01-01T10:30"},
    {"track": "t1"},
    {"track": ["t0", "t2"], "camera": "c0"},
    {"view": "ground", "camera": "c2", "after": 1767261900},
    {"track": "nobody"},
]


def _gallery_rows(seed: int = 0) -> tuple[dict[str, torch.Tensor], list[str], list[dict[str, Any]]]:
    generator = torch.Generator().manual_seed(seed)
    unit = lambda *shape: torch.nn.functional.normalize(torch.randn(*shape, generator=generator), dim=-1)  # noqa: E731
    embeds = {
        "global": unit(ROWS, DIM),
        "local": unit(ROWS, DIM),
        "view_probs": torch.softmax(torch.randn(ROWS, 2, generator=generator), dim=-1),
    }
    paths = [f"cam{i % 3}/{i:03d}.png" for i in range(ROWS)]
    records = [
        {
            "view": ("aerial", "ground")[i % 2],
            "camera": f"c{i % 3}",
            "timestamp": f"2026-01-01T10:{i:02d}",
            "tags": ["red"] if i % 4 == 0 else None,
            "track": f"t{i % 5}",
            "source": f"cam{i % 3}.mp4",
            "frame": i,
            "box": [i, 0, i + 8, 16],
            "t_start": 1767261600 + i,
            "t_end": 1767261600 + i + 2,
        }
        for i in range(ROWS)
    ]
    return embeds, paths, records


class MemoryGallery:
    """A test-only backend: rows in tensors, filters and TAG-PR Eq. 14 ranking by brute force."""

    def __init__(self, image_root: Path):
        self.meta: dict[str, Any] = {"image_root": str(image_root), "model_fingerprint": None}
        self.root, self.rows, self.embeds = image_root, [], {}
        self.removed: set[int] = set()

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def fingerprint(self) -> str | None:
        return None

    def check_model(self, model: Any) -> None:
        return None

    def add(self, embeds, paths, records=None) -> int:
        records = records or [None] * len(paths)
        probs = embeds.get("view_probs")
        known = {row["path"] for row in self.rows}
        if known & set(paths):
            raise GalleryIndexError(f"already in the gallery: {sorted(known & set(paths))[:5]}")
        for i, (path, record) in enumerate(zip(paths, records, strict=True)):
            row = dict(
                zip(CROP_COLUMNS, metadata_row(path, record, view_prediction(probs, i)[0]), strict=True)
            )
            self.rows.append({**row, **decode_metadata(row), "router": view_prediction(probs, i)})
        self.embeds = {
            k: torch.cat([self.embeds[k], v]) if k in self.embeds else v for k, v in embeds.items()
        }
        return len(paths)

    def remove(self, paths: Sequence[str] = (), ids: Sequence[int] = ()) -> int:
        chosen = {i for i, row in enumerate(self.rows) if row["path"] in paths} | set(ids)
        fresh = chosen - self.removed
        self.removed |= chosen
        return len(fresh)

    def _allowed(self, row: dict[str, Any], spec: SearchFilter | None) -> bool:
        if spec is None:
            return True
        time = row["timestamp"]
        return (
            (spec.view is None or row["view"] == spec.view)
            and (spec.cameras() is None or row["camera"] in spec.cameras())
            and (spec.tracks() is None or row["track"] in spec.tracks())
            and (spec.after is None or (time is not None and time >= parse_time(spec.after)))
            and (spec.before is None or (time is not None and time < parse_time(spec.before)))
            and (spec.tag is None or spec.tag in (row["tags"] or []))
        )

    def search(self, query, top_k=10, filters=None) -> list[list[Hit]]:
        spec = SearchFilter.of(filters)
        keep = torch.tensor(
            [i not in self.removed and self._allowed(r, spec) for i, r in enumerate(self.rows)]
        )
        scores = 0.5 * (query["global"] @ self.embeds["global"].T + query["local"] @ self.embeds["local"].T)
        scores = scores.masked_fill(~keep, -math.inf)
        best, ids = scores.topk(min(top_k, int(keep.sum())), dim=1)
        pairs = [zip(b.tolist(), r.tolist(), strict=True) for b, r in zip(best, ids, strict=True)]
        return [
            [self._hit(rank, s, i) for rank, (s, i) in enumerate(query_pairs, 1)] for query_pairs in pairs
        ]

    def _hit(self, rank: int, score: float, i: int) -> Hit:
        row = self.rows[i]
        predicted = {"predicted_view": row["router"][0], "predicted_view_score": row["router"][1]}
        fields = {key: row[key] for key in HIT_KEYS - {"rank", "score", "id", "index", "path", *predicted}}
        return {
            "rank": rank,
            "score": score,
            "id": crop_id(row["path"]),
            "index": i,
            "path": str(self.root / row["path"]),
            **fields,
            **predicted,
        }

    def crop_embeddings(self, ids: Sequence[str]) -> dict[str, torch.Tensor]:
        rows = {crop_id(row["path"]): i for i, row in enumerate(self.rows) if i not in self.removed}
        missing = [hit_id for hit_id in ids if hit_id not in rows]
        if missing:
            raise GalleryIndexError(f"no crop with hit id {missing[0]} in the gallery")
        return {k: self.embeds[k][[rows[i] for i in ids]] for k in ("global", "local")}

    def track_embeddings(self, camera: str | None, track: str) -> dict[str, torch.Tensor]:
        rows = sorted(
            (row["path"], i)
            for i, row in enumerate(self.rows)
            if i not in self.removed and row["camera"] == camera and row["track"] == track
        )
        if not rows:
            raise GalleryIndexError(f"no track {camera or ''}:{track} in the gallery")
        return {k: self.embeds[k][[i for _, i in rows]] for k in ("global", "local")}

    def count(self) -> int:
        return len(self.rows) - len(self.removed)

    def describe(self) -> dict[str, Any]:
        return {"backend": "memory", "rows": len(self), "searchable": self.count()}

    def close(self) -> None:
        self.rows = []


def _open(kind: str, tmp: Path, root: Path, embeds, paths, records) -> GalleryStore:
    """A gallery of ``kind`` holding the rows (``embeds``, ``paths``, ``records``)."""
    if kind == "memory":
        gallery = MemoryGallery(root)
        gallery.add(embeds, paths, records)
        return gallery
    if kind == "embedded":
        from modeling_tagclip.retrieval.embedded.index_build import index_embeddings

        return index_embeddings(
            tmp / "index", embeds, paths, root, metadata=dict(zip(paths, records, strict=True))
        )
    pytest.importorskip("pymilvus")
    from modeling_tagclip.retrieval.milvus import MilvusGallery

    dims = {key: embeds[key].shape[1] for key in ("global", "local")}
    gallery = MilvusGallery.create(
        str(tmp / "g.db"), "g", dim=sum(dims.values()), fingerprint=None, image_root=root, embed_dims=dims
    )
    gallery.add(embeds, paths, records)
    return gallery


KINDS = ["memory", "embedded", pytest.param("milvus", marks=pytest.mark.slow)]


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


def _reference(embeds, records, query, spec: SearchFilter | None, removed=()) -> list[list[int]]:
    """Row order of the exact TAG-PR Eq. 14 ranking among the allowed rows, computed here from the definitions."""
    helper = MemoryGallery(Path("/x"))
    rows = [dict(zip(CROP_COLUMNS, metadata_row("p", r, None), strict=True)) for r in records]
    rows = [{**row, **decode_metadata(row)} for row in rows]
    allowed = [i for i, row in enumerate(rows) if i not in removed and helper._allowed(row, spec)]
    out = []
    for q in range(query["global"].shape[0]):
        score = {
            i: 0.5 * float(query["global"][q] @ embeds["global"][i] + query["local"][q] @ embeds["local"][i])
            for i in allowed
        }
        out.append(sorted(allowed, key=lambda i: -score[i])[:10])
    return out


def _paths_of(results, root: Path) -> list[list[str]]:
    return [[Path(hit["path"]).relative_to(root).as_posix() for hit in hits] for hits in results]


def test_every_filter_ranks_as_the_reference_and_hits_carry_every_key(kind, tmp_path):
    embeds, paths, records = _gallery_rows()
    gallery = _open(kind, tmp_path, tmp_path / "root", embeds, paths, records)
    try:
        assert isinstance(gallery, GalleryStore) and len(gallery) == gallery.count() == ROWS
        text_side = {
            k: torch.nn.functional.normalize(v[:3] + 0.3, dim=-1)
            for k, v in embeds.items()
            if k != "view_probs"
        }
        matched = 0
        for filters in FILTERS:
            results = gallery.search(text_side, 10, filters)
            want = _reference(embeds, records, text_side, SearchFilter.of(filters))
            assert _paths_of(results, tmp_path / "root") == [[paths[i] for i in q] for q in want], filters
            matched += sum(map(len, results))
            for hits in results:
                assert [h["rank"] for h in hits] == list(range(1, len(hits) + 1))
                assert all(set(h) == HIT_KEYS for h in hits)
        assert matched > 3 * 10 * 5  # the filters select real, differing subsets
        hit = gallery.search(text_side, 1, {"track": "t1", "camera": "c1"})[0][0]
        i = paths.index(Path(hit["path"]).relative_to(tmp_path / "root").as_posix())
        assert (hit["track"], hit["camera"], hit["frame"], hit["box"]) == ("t1", "c1", i, [i, 0, i + 8, 16])
        assert hit["timestamp"] == parse_time(records[i]["timestamp"]) and hit["t_end"] == 1767261602.0 + i
        assert hit["view"] == records[i]["view"]  # the stored view, the one filtered on
        predicted = view_prediction(embeds["view_probs"], i)
        assert (hit["predicted_view"], hit["predicted_view_score"]) == (
            predicted[0],
            pytest.approx(predicted[1]),
        )
        assert hit["score"] == pytest.approx(
            0.5
            * float(
                text_side["global"][0] @ embeds["global"][i] + text_side["local"][0] @ embeds["local"][i]
            ),
            abs=1e-5,
        )
    finally:
        gallery.close()


def test_an_image_side_query_finds_itself_first(kind, tmp_path):
    embeds, paths, records = _gallery_rows()
    gallery = _open(kind, tmp_path, tmp_path / "root", embeds, paths, records)
    try:
        rows = [5, 17, 33]
        query = {k: v[rows] for k, v in embeds.items() if k != "view_probs"}
        top = gallery.search(query, 1)
        assert [Path(h[0]["path"]).name for h in top] == [Path(paths[i]).name for i in rows]
        assert [h[0]["score"] for h in top] == pytest.approx([1.0, 1.0, 1.0], abs=1e-5)
    finally:
        gallery.close()


def test_remove_then_search_and_count(kind, tmp_path):
    embeds, paths, records = _gallery_rows()
    gallery = _open(kind, tmp_path, tmp_path / "root", embeds, paths, records)
    try:
        query = {k: v[:2] for k, v in embeds.items() if k != "view_probs"}
        assert gallery.remove(paths=[paths[0], paths[7]]) == 2 and gallery.remove(paths=[paths[0]]) == 0
        assert len(gallery) == ROWS and gallery.count() == ROWS - 2
        want = _reference(embeds, records, query, None, removed={0, 7})
        assert _paths_of(gallery.search(query, 10), tmp_path / "root") == [
            [paths[i] for i in q] for q in want
        ]
        described = gallery.describe()
        assert (described["rows"], described["searchable"]) == (ROWS, ROWS - 2)
    finally:
        gallery.close()


def test_an_add_in_two_parts_answers_as_one(kind, tmp_path):
    embeds, paths, records = _gallery_rows()
    head = {k: v[:25] for k, v in embeds.items()}
    tail = {k: v[25:] for k, v in embeds.items()}
    gallery = _open(kind, tmp_path, tmp_path / "root", head, paths[:25], records[:25])
    try:
        assert gallery.add(tail, paths[25:], records[25:]) == ROWS - 25
        assert len(gallery) == gallery.count() == ROWS
        query = {k: v[:3] + 0.1 for k, v in embeds.items() if k != "view_probs"}
        query = {k: torch.nn.functional.normalize(v, dim=-1) for k, v in query.items()}
        for filters in FILTERS[:4]:
            want = _reference(embeds, records, query, SearchFilter.of(filters))
            got = _paths_of(gallery.search(query, 10, filters), tmp_path / "root")
            assert got == [[paths[i] for i in q] for q in want]
    finally:
        gallery.close()


def test_the_stored_embeddings_of_crops_by_hit_id_and_of_a_track(kind, tmp_path):
    embeds, paths, records = _gallery_rows()
    gallery = _open(kind, tmp_path, tmp_path / "root", embeds, paths, records)
    try:
        hits = gallery.search({k: v[[11]] for k, v in embeds.items() if k != "view_probs"}, 3)[0]
        assert [h["id"] for h in hits] == [crop_id(paths[paths.index(_rel(h, tmp_path))]) for h in hits]
        assert hits[0]["id"] == crop_id(paths[11])  # the same id on every backend: the path's key
        got = gallery.crop_embeddings([hits[0]["id"], crop_id(paths[3])])
        for key in ("global", "local"):
            torch.testing.assert_close(got[key], embeds[key][[11, 3]], atol=1e-6, rtol=0)
        track = gallery.track_embeddings("c1", "t1")  # rows 1, 16, 31 (i % 3 == 1 and i % 5 == 1)
        for key in ("global", "local"):
            torch.testing.assert_close(track[key], embeds[key][[1, 16, 31]], atol=1e-6, rtol=0)
        gallery.remove(paths=[paths[16]])
        torch.testing.assert_close(gallery.track_embeddings("c1", "t1")["global"], embeds["global"][[1, 31]])
        for call, message in (
            (
                lambda: gallery.crop_embeddings([crop_id(paths[16])]),
                f"no crop with hit id {crop_id(paths[16])}",
            ),
            (lambda: gallery.crop_embeddings([crop_id("cam9/x.png")]), "no crop with hit id"),
            (lambda: gallery.track_embeddings("c0", "t7"), "no track c0:t7 in"),
            (lambda: gallery.track_embeddings(None, "t1"), "no track :t1 in"),
        ):
            with pytest.raises(GalleryIndexError, match=message):
                call()
    finally:
        gallery.close()


def _rel(hit: dict, tmp_path: Path) -> str:
    return Path(hit["path"]).relative_to(tmp_path / "root").as_posix()
