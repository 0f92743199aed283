"""`evaluate` metric: aerial-ground image re-ID (CMC R1/5/10, mAP, mINP) with fast-reid's same-camera
filtering, for every protocol of the view split (ALL, A<->G, G<->G, A<->A, A<->G (VDT), G->A).

Each example is one query image: ``predictions`` = its embedding, ``references`` = its person id, with its
camera id and view (0 = aerial, 1 = ground); ``compute`` takes the gallery's embeddings, person ids, camera
ids and views. Distances are 1 - cosine. The numbers are those of ``modeling_tagclip.metrics.reid`` (this
module calls it: one implementation), as ``tagclip eval --task reid`` reports them.
"""

import datasets
import evaluate
import numpy as np

from modeling_tagclip.metrics.reid import Protocol, evaluate_protocols, view_protocols

_DESCRIPTION = __doc__
_CITATION = """\
@article{visa,
  title = {ViSA: view-aware semantic alignment for aerial-ground person re-identification},
}
"""
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[list[float]]`): query embeddings.
    references (`list[int]`): query person ids.
    query_camids (`list[int]`): query camera ids.
    query_views (`list[int]`): query views (0 = aerial, 1 = ground).
    gallery_embeddings (`list[list[float]]`), gallery_pids, gallery_camids, gallery_views (`list[int]`): the
        gallery, in the same form.
    protocols (`str`, defaults to `"views"`): `"views"` = every protocol of the view split, `"all"` = ALL only.
    ks (`list[int]`, defaults to `[1, 5, 10]`): the CMC ranks.
Returns:
    `{protocol: {"R1", "R5", "R10", "mAP", "mINP", "metric", "num_queries"}}` (percent; a protocol without a
    valid query gives `{"num_queries": 0}`).
Examples:
    >>> metric = evaluate.load("modeling_tagclip/metrics/evaluate_modules/aerial_ground_reid")
    >>> metric.compute(predictions=[[1.0, 0.0]], references=[1], query_camids=[0], query_views=[0],
    ...                gallery_embeddings=[[1.0, 0.0], [0.0, 1.0]], gallery_pids=[1, 2], gallery_camids=[6, 7],
    ...                gallery_views=[1, 1], protocols="all")["ALL"]["R1"]
    100.0
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class AerialGroundReID(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("float32")),
                    "references": datasets.Value("int64"),
                    "query_camids": datasets.Value("int64"),
                    "query_views": datasets.Value("int64"),
                }
            ),
        )

    def _compute(
        self,
        predictions,
        references,
        query_camids,
        query_views,
        gallery_embeddings,
        gallery_pids,
        gallery_camids,
        gallery_views,
        protocols="views",
        ks=(1, 5, 10),
    ):
        if protocols not in ("views", "all"):
            raise ValueError(f"protocols must be 'views' or 'all', got {protocols!r}")
        query = {"person_id": references, "camera_id": query_camids, "view": query_views}
        gallery = {"person_id": gallery_pids, "camera_id": gallery_camids, "view": gallery_views}
        splits = (
            view_protocols(query_views, gallery_views)
            if protocols == "views"
            else {"ALL": Protocol(description="all queries vs the whole gallery")}
        )
        query_features = np.asarray(predictions, dtype=np.float32)
        gallery_features = np.asarray(gallery_embeddings, dtype=np.float32)
        return evaluate_protocols(query_features, gallery_features, query, gallery, splits, ks=ks)
