"""Person queries: score fusion and the mean set rule are exact through TAG-PR Eq. 14 (linear in the query), the max
rule keeps each crop's best score; bad queries are refused with their reason."""

import pytest
import torch

from modeling_tagclip.retrieval.encode import eq14_similarity
from modeling_tagclip.retrieval.queries import best_of, fuse, set_query


def unit(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.nn.functional.normalize(
        torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1
    )


def eq14(query, gallery):
    return eq14_similarity(query["global"], gallery["global"], query.get("local"), gallery.get("local"))


GALLERY = {"global": unit(50, 16, 0), "local": unit(50, 32, 1)}
TEXT = {"global": unit(1, 16, 2), "local": unit(1, 32, 3)}
IMAGE = {"global": unit(1, 16, 4), "local": unit(1, 32, 5)}


@pytest.mark.parametrize("weight", [0.0, 0.3, 0.5, 1.0])
def test_fusion_scores_are_the_weighted_sum_of_the_two_scores(weight):
    fused = eq14(fuse(TEXT, IMAGE, weight), GALLERY)
    expected = weight * eq14(TEXT, GALLERY) + (1 - weight) * eq14(IMAGE, GALLERY)
    torch.testing.assert_close(fused, expected)


def test_the_mean_rule_scores_the_mean_of_the_crops_scores():
    crops = {"global": unit(3, 16, 6), "local": unit(3, 32, 7), "view_probs": torch.rand(3, 2)}
    query = set_query(crops)
    assert set(query) == {"global", "local"} and query["global"].shape == (1, 16)
    crops.pop("view_probs")
    torch.testing.assert_close(eq14(query, GALLERY)[0], eq14(crops, GALLERY).mean(dim=0))


def test_the_max_rule_keeps_each_crops_best_score():
    a = [{"index": 1, "score": 0.5, "path": "a"}, {"index": 2, "score": 0.4, "path": "b"}]
    b = [{"index": 2, "score": 0.9, "path": "b"}, {"index": 3, "score": 0.1, "path": "c"}]
    merged = best_of([a, b], top_k=2)
    assert [(h["index"], h["score"], h["rank"]) for h in merged] == [(2, 0.9, 1), (1, 0.5, 2)]


def test_bad_queries_are_refused():
    with pytest.raises(ValueError, match="text weight must lie in"):
        fuse(TEXT, IMAGE, 1.5)
    with pytest.raises(ValueError, match="different models"):
        fuse(TEXT, {"global": unit(1, 8, 0)})
    with pytest.raises(ValueError, match="NaN or inf"):
        set_query({"global": torch.full((2, 4), float("nan"))})
    with pytest.raises(ValueError, match="needs \\[n, d\\]"):
        set_query({"global": torch.empty(0, 4)})
