"""`evaluate` metric: text-to-image person retrieval (R@1/5/10, mAP, mINP and the breakdown by match views).

Each example is one text query: ``predictions`` = its scores against every gallery image (higher = better,
e.g. TAG-CLIP's TAG-PR Eq. 14 similarity), ``references`` = its person id; ``compute`` takes the gallery's person ids
and, optionally, views (0 = aerial, 1 = ground) for the per-query breakdown by the views of the true matches.
The numbers are those of ``modeling_tagclip.metrics.retrieval`` (this module calls it: one implementation).
"""

import datasets
import evaluate
import numpy as np
import torch

from modeling_tagclip.metrics.retrieval import check_finite, stream_retrieval_metrics

_DESCRIPTION = __doc__
_CITATION = """\
@article{tagclip,
  title = {TAG-CLIP: text-based aerial-ground person retrieval with hierarchically-routed mixture of experts},
}
"""
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[list[float]]`): per query, its score for every gallery item (higher ranks first; ties
        rank the lower gallery index first).
    references (`list[int]`): person id of each query.
    gallery_ids (`list[int]`): person id of each gallery item (every query id must occur).
    gallery_views (`list[int]`, *optional*): 0 = aerial, 1 = ground per gallery item; adds
        `match_view_breakdown` (queries whose true matches are all aerial, all ground, or both).
    ks (`list[int]`, defaults to `[1, 5, 10]`): the R@K cut-offs.
    chunk_size (`int`, defaults to 512): queries ranked at a time.
Returns:
    `R@K` for each K, `mAP`, `mINP` (percent) and, with `gallery_views`, `match_view_breakdown`.
Examples:
    >>> metric = evaluate.load("modeling_tagclip/metrics/evaluate_modules/text_person_retrieval")
    >>> metric.compute(predictions=[[0.9, 0.1], [0.2, 0.8]], references=[1, 2], gallery_ids=[1, 2])
    {'R@1': 100.0, 'R@5': 100.0, 'R@10': 100.0, 'mAP': 100.0, 'mINP': 100.0}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class TextPersonRetrieval(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("float32")),
                    "references": datasets.Value("int64"),
                }
            ),
        )

    def _compute(
        self, predictions, references, gallery_ids, gallery_views=None, ks=(1, 5, 10), chunk_size=512
    ):
        scores = torch.from_numpy(np.asarray(predictions, dtype=np.float32))
        check_finite(scores, "predictions")
        accumulator = stream_retrieval_metrics(
            lambda start, stop: scores[start:stop], references, gallery_ids, gallery_views, ks, chunk_size
        )
        result = accumulator.compute()
        if gallery_views is not None:
            result["match_view_breakdown"] = accumulator.breakdown()
        return result
