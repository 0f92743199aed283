"""benchmarks/bench_ingest.py's end-to-end part on tiny footage: tracks get their true identity, and every
caption of every identity shown ranks the tracks."""

import json

import numpy as np
import pytest
from fixtures import save_tiny_model

from benchmarks.bench_ingest import _tracks_with_identity, end_to_end
from modeling_tagclip.video.footage import render_footage
from modeling_tagclip.video.mot_eval import read_gt

TINY = {
    "ground_cameras": 1,
    "aerial_cameras": 0,
    "people": 3,
    "people_per_camera": 3,
    "seconds": 4.0,
    "fps": 5.0,
    "size": (120, 200),
}


def test_tracks_get_the_identity_they_overlap(tmp_path):
    footage = render_footage(tmp_path, seed=1, **TINY)
    tracks = _tracks_with_identity(footage.videos[0], footage.gt[0], fps=5.0)
    truth = {int(i) for ids, _ in read_gt(footage.gt[0]).values() for i in ids}
    found = [who for who, _ in tracks]
    assert set(found) - {-1} <= truth and len(set(found) - {-1}) >= 2
    assert all(1 <= len(crops) <= 3 and crops[0].dtype == np.uint8 for _, crops in tracks)


@pytest.mark.slow
def test_end_to_end_ranks_every_caption(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    result = end_to_end(str(model), [1], 5.0, **TINY)
    (run,) = result["per_seed"]
    footage = render_footage(tmp_path / "again", seed=1, **TINY)
    identities = json.loads(footage.identities.read_text())
    shown = [who for who, _ in _tracks_with_identity(footage.videos[0], footage.gt[0], fps=5.0) if who >= 0]
    assert run["identities"] == len(set(shown))
    assert run["queries"] == sum(len(identities[str(who)]["captions"]) for who in set(shown))
    assert 0 <= run["R@1"] <= 100 and 0 < run["mAP"] <= 100 and result["crop_level"] is None
