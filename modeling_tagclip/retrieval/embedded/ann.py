"""Approximate (faiss) layer of the gallery index: presets, training, build-time calibration, faiss files.

A preset (``ANN_PRESETS``) indexes ``ann_vectors`` (by default the combined ``sqrt(1/2) [global, TSE]``
vector, whose inner product is the TAG-PR Eq. 14 score) per segment; search proposes ``k_factor x k`` candidates that
``gallery_index`` re-ranks exactly. The quantizer is trained once the gallery has ``ANN_MIN_SIZE`` rows, on a
fixed sample of rows, and a preset's is retrained (every segment re-encoded) whenever the gallery calls for
more lists (``ivf_lists``: ~sqrt(N) / 4, a power of two, so at about every 4x growth).
Each training **calibrates** ``nprobe`` and ``k_factor`` on held-out rows of the gallery itself and on the text
queries the index was given when built (``calibrate``): the cheapest setting whose recall@10 reaches
``CALIBRATION_TARGET`` on both; they are kept in
``index.json`` with the recall found, and calibrated again, without retraining, whenever the gallery has
``RECALIBRATE_GROWTH`` x the rows of the last calibration. Both happen O(log N) times over a gallery's life and
each costs O(N) (re-encoding, or one exact pass of the proxies over the stored rows), so growing to N rows
costs O(N) in all: O(1) per added row.

Hub custom-code compatible: only the standard library and torch are imported; faiss is optional.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..encode import combined_vectors, eq14_similarity
from ..gallery_types import GalleryIndexError
from .index_store import (
    atomic_write,
    check_finite,
    kept_rows,
    read_rows,
    read_tensors,
    sha256_bytes,
    sha256_file,
    write_tensors,
)

try:  # optional: approximate search through faiss
    import faiss
except ImportError:  # pragma: no cover - depends on the environment
    faiss = None

__all__ = [
    "ANN_MIN_SIZE",
    "ANN_ON",
    "ANN_PRESETS",
    "IVF_K_FACTOR",
    "ann_segments",
    "ann_spec",
    "ann_vectors",
    "calibrate",
    "candidates",
    "check_calibration_queries",
    "ivf_lists",
    "merge_ann",
    "move_lists",
    "read_faiss",
    "search_cost",
    "set_search_params",
    "write_calibration_queries",
]

# Approximate index presets (``{dim}``: the ANN vectors' width); candidates are re-ranked exactly (TAG-PR Eq. 14).
ANN_PRESETS = {
    "ivf": "PCA{p},IVF{nlist},PQ{p}x4fs: the ANN vectors' p = min(128, dim) principal components, "
    "~sqrt(N) / 4 lists (~4 sqrt(N) rows a list), one 4-bit PQ FastScan code per component (p/2 bytes a crop), nprobe and k_factor calibrated on "
    "held-out gallery rows and the index's text queries when the quantizer is trained, exact TAG-PR Eq. 14 re-ranking of k_factor x k candidates",
    "ivf-full": "IVF{nlist},PQ{m}x4fsr: no PCA, m = dim/4 sub-vectors over the combined global + TSE vector "
    "(dim/2 over the global one): 3x the bytes scanned of 'ivf' at 1536-d for the same recall on "
    "bench_search.py's generator; for embeddings whose neighbours need more than 128 components",
}
ANN_VECTORS = {"global": 2, "combined": 4}  # what the ANN indexes -> dims per 4-bit PQ code of "ivf-full"
PCA_DIMS = 128  # "ivf" preset: principal components kept (bench_search.py: recall@10 0.99 vs exact at 128)
# The "ivf" preset's codes are of the PCA vectors themselves ("x4fs"), not of their residuals to the list centroid
# ("x4fsr"): FastScan quantises each query's distance table to 8 bits, per list for residual codes, so scores of
# different lists then compare coarsely. At 1M text queries of bench_search.py's generator find more of the
# exact top 10 at equal nprobe (512 / 640 of 1024 lists, 600 candidates: 0.962 / 0.973 vs 0.953 / 0.963).
IVF_PROBE_DIVISOR = 2  # before calibration (and for factories whose queries cannot be calibrated): lists / 2
IVF_K_FACTOR = 80  # re-rank 80 k candidates exactly (the uncalibrated default)
ANN_ON = "combined"  # default vectors of the ANN (bench_search.py: global-only candidates missed 0.95 recall)
ANN_MIN_SIZE = 2048  # smaller galleries keep exact search (the ANN is not built; build_index warns)
OWN_PARAMS = {"k_factor"}  # search parameters handled by the re-ranking, not by faiss
ANN_ADD_CHUNK = 65536  # rows converted to float32 ANN vectors at once when adding to a faiss index
TRAIN_MAX = 131072  # training sample of a non-IVF ANN (e.g. the PCA of PCA..,HNSW..)
RETRAIN_GROWTH = 2  # a preset's quantizer is retrained when the gallery calls for this many times its lists
RECALIBRATE_GROWTH = 1.25  # nprobe / k_factor are calibrated again when the gallery has this x the rows

# Calibration: two sets of proxy queries, each with its exact TAG-PR Eq. 14 top-10 over the gallery as truth.
# - Rows: held-out gallery rows (not in the training sample) moved by isotropic noise to cosine CALIBRATION_COSINE
#   from themselves, the row itself excluded from the truth (image-like queries; always there).
# - Queries: text embeddings the index was given when built (``calibration_queries.safetensors``: by default the
#   model's embeddings of person descriptions the index never sees as queries; ``write_calibration_queries``).
#   Text queries sit much farther from their matches than moved rows (cosine ~0.35 vs 0.9) and their top-10 is
#   ranked by closer scores, so they can ask for more probes or candidates (test_ann_calibration_queries.py).
# A setting is chosen only if it reaches the target on every set.
CALIBRATION_QUERIES = 256
QUERIES_FILE = "calibration_queries.safetensors"
MAX_CALIBRATION_QUERIES = 4096  # stored text queries: their exact truth costs one pass over the gallery each
CALIBRATION_K = 10
CALIBRATION_TARGET = 0.97  # recall@10 on the proxies: a margin over the 0.95 promised for real queries
CALIBRATION_COSINE = 0.9
CALIBRATION_K_FACTORS = (10, 20, 40, 60, 80, 100, 120, 160, 240, 320)
# Search cost in units of one scanned PQ code (1M rows, PCA128 + PQ128x4fs, one thread: ~2.7 ns a code): probing a
# list costs ~LIST_COST codes beyond its rows (~1.4 us), an exactly re-ranked candidate ~RERANK_COST (~2.6 us: a
# random fp16 row gather from the mapped store, and its place in FastScan's result heap). Fitted on bench_search.py's
# generator at 1M: 128 to 1024 lists, nprobe 3/8 to 6/8 of them, 600 and 1000 candidates.
LIST_COST = 500
RERANK_COST = 950
MIN_LIST_ROWS = 64  # IVF lists hold at least this many rows on average
LIST_SHRINK = 4  # lists ~ sqrt(N) / LIST_SHRINK


def ivf_lists(size: int) -> int:
    """IVF lists for ``size`` vectors: the power of two nearest sqrt(N) / ``LIST_SHRINK`` (halves rounded up),
    with >= ``MIN_LIST_ROWS`` vectors per list. A probed list costs ~``LIST_COST`` codes beyond its rows, and text
    queries need about 3/4 of the lists probed whatever their number, so fewer, longer lists scan faster:
    bench_search.py at 1M, 600 candidates, recall@10 ~0.97 of exact: 256 lists of ~3,900 rows (192 probed)
    2.65 ms of FastScan, 512 lists 2.96 ms, 1024 lists (640 probed) 3.4-3.9 ms (a micro-benchmark of one run)."""
    if size < MIN_LIST_ROWS:
        return 1
    nearest = math.floor(math.log2(size) / 2 - math.log2(LIST_SHRINK) + 0.5)
    return 2 ** max(0, min(nearest, math.floor(math.log2(size / MIN_LIST_ROWS))))


def search_cost(nprobe: int, k_factor: int, rows_per_list: float, k: int = 10) -> float:
    """Estimated cost of a search, in scanned PQ codes: ``nprobe`` lists of ``rows_per_list`` rows (plus
    ``LIST_COST`` each) and the exact re-ranking of ``k_factor x k`` candidates (``RERANK_COST`` each)."""
    return nprobe * (rows_per_list + LIST_COST) + RERANK_COST * k_factor * k


def pq_subquantizers(dim: int, dims_per_code: int = 2) -> int:
    """PQ sub-vectors: one per ``dims_per_code`` dims (256 for 512-d and 2); the largest divisor of ``dim``
    not above that."""
    return next(m for m in range(max(1, dim // dims_per_code), 0, -1) if dim % m == 0)


def ann_vectors(embeds: dict[str, torch.Tensor], on: str) -> torch.Tensor:
    """float32 vectors an ANN index holds: the global embedding, or ``sqrt(1/2) [global, local]`` whose inner
    product is the TAG-PR Eq. 14 score (global alone without TSE)."""
    if on not in ANN_VECTORS:
        raise GalleryIndexError(f"ANN vectors must be one of {sorted(ANN_VECTORS)}, got {on!r}")
    return embeds["global"].float().contiguous() if on == "global" else combined_vectors(embeds)


def ann_spec(
    ann: str, size: int, dim: int, params: dict[str, float] | None = None, on: str = ANN_ON
) -> dict[str, Any]:
    """``{"factory", "params", "on", "fixed"}`` of an ANN preset (``ANN_PRESETS``) or a faiss index_factory
    string over ``dim``-d ``ann_vectors(.., on)``. ``params``: faiss ``ParameterSpace`` names (``nprobe``,
    ``efSearch``) and ``k_factor``; those given are ``fixed`` (never calibrated)."""
    if faiss is None:
        raise GalleryIndexError("an approximate (ANN) index needs faiss: pip install faiss-cpu")
    if on not in ANN_VECTORS:
        raise GalleryIndexError(f"ANN vectors must be one of {sorted(ANN_VECTORS)}, got {on!r}")
    if ann in ANN_PRESETS:
        nlist = ivf_lists(size)
        pca, full = min(PCA_DIMS, dim), pq_subquantizers(dim, ANN_VECTORS[on])
        codes = f"PCA{pca},IVF{nlist},PQ{pca}x4fs" if ann == "ivf" else f"IVF{nlist},PQ{full}x4fsr"
        spec = {"factory": codes, "params": {"nprobe": max(1, nlist // IVF_PROBE_DIVISOR)}}
    else:
        try:
            faiss.index_factory(dim, ann, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as error:
            presets = ", ".join(ANN_PRESETS)
            raise GalleryIndexError(
                f"unknown ANN index {ann!r}: use a preset ({presets}) or a faiss index_factory string"
            ) from error
        spec = {"factory": ann, "params": {}}
    spec["params"] = {"k_factor": IVF_K_FACTOR, **spec["params"], **(params or {})}
    for name, value in spec["params"].items():
        if not math.isfinite(float(value)) or float(value) <= 0:
            raise GalleryIndexError(f"ANN parameter {name} must be a positive number, got {value}")
    spec["params"] = {
        name: int(value) if float(value).is_integer() else float(value)
        for name, value in spec["params"].items()
    }
    set_search_params(faiss.index_factory(dim, spec["factory"], faiss.METRIC_INNER_PRODUCT), spec["params"])
    return {**spec, "on": on, "fixed": sorted(params or {})}


def set_search_params(index: Any, params: dict[str, float]) -> None:
    """Apply faiss search parameters (``nprobe``, ``efSearch``, ...; ``k_factor`` is the re-ranking's)."""
    space = faiss.ParameterSpace()
    for name, value in params.items():
        if name in OWN_PARAMS:
            continue
        try:
            space.set_index_parameter(index, name, value)
        except RuntimeError as error:
            raise GalleryIndexError(
                f"faiss index {type(index).__name__} has no parameter {name!r}"
            ) from error
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:  # an IVF-PQ FastScan index probing more lists than it has returns wrong neighbours
        ivf.nprobe = min(ivf.nprobe, ivf.nlist)


def _search_params(index: Any, selector: Any, nprobe: Callable[[Any], int] | None = None) -> Any:
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return faiss.SearchParametersIVF(
            sel=selector, nprobe=min(nprobe(ivf) if nprobe else ivf.nprobe, ivf.nlist)
        )
    return faiss.SearchParameters(sel=selector)


def candidates(
    indexes: Sequence[Any],
    vectors: torch.Tensor,
    wanted: int,
    selector: Any = None,
    nprobe: Callable[[Any], int] | None = None,
) -> torch.Tensor:
    """Candidate rows [n_queries, <= wanted] (-1 = none): the ``wanted`` best by approximate score over every
    segment's ANN index, among the rows ``selector`` keeps, probing ``nprobe(ivf)`` lists of an IVF index (its
    own nprobe without). The segments share one trained quantizer, so their approximate scores compare, and the
    candidates (hence the exact re-ranking's work) are those of one index over all the rows, however many
    segments the gallery has."""
    found = [
        ann.search(vectors.numpy(), min(wanted, ann.ntotal), params=_search_params(ann, selector, nprobe))
        for ann in indexes
        if ann.ntotal
    ]
    if not found:
        return torch.full((vectors.shape[0], 0), -1, dtype=torch.long)
    ids = torch.cat([torch.from_numpy(i).long() for _, i in found], dim=1)
    if len(found) == 1 or ids.shape[1] <= wanted:
        return ids
    scores = torch.cat([torch.from_numpy(d) for d, _ in found], dim=1).masked_fill(ids < 0, -math.inf)
    return ids.gather(1, scores.topk(wanted, dim=1).indices)


def merge_ann(indexes: list[Any]) -> tuple[list[Any], bool]:
    """The segments' ANN indexes as one index when they are IVF indexes of one trained quantizer (the lists of
    the others are moved into the first, not copied: searching it equals searching one index built over every
    row), else the list as it is; and whether the result is one merged index."""
    ivfs = [faiss.try_extract_index_ivf(index) for index in indexes]
    if len(indexes) < 2 or any(ivf is None for ivf in ivfs):
        return indexes, len(indexes) == 1
    try:
        for ivf in ivfs[1:]:
            move_lists(ivfs[0], ivf)
    except RuntimeError:  # pragma: no cover - segments of one commit always share the quantizer
        return indexes, False
    indexes[0].ntotal = ivfs[0].ntotal  # a pre-transform (PCA) wrapper keeps a count of its own
    return indexes[:1], True


def move_lists(into: Any, other: Any) -> None:
    """``into.merge_from(other, 0)`` for IVF indexes of one trained quantizer: ``other``'s inverted lists are
    appended to ``into``'s and emptied. A FastScan (block) list that ends on a block boundary gets the other
    list's blocks appended as they are; there faiss 1.15's ``BlockInvertedLists::add_entries`` (whenever the list
    size is a non-zero multiple of the block's bytes) copies as many bytes as the whole merged list past the old
    end, a heap overflow that aborts the process (``malloc(): invalid size``) or silently corrupts memory."""
    lists, others = faiss.downcast_InvertedLists(into.invlists), faiss.downcast_InvertedLists(other.invlists)
    if not isinstance(lists, faiss.BlockInvertedLists):
        into.merge_from(other, 0)
        return
    into.check_compatible_for_merge(other)
    per_block, block = lists.n_per_block, lists.block_size
    for i in range(lists.nlist):
        count, size = others.list_size(i), lists.list_size(i)
        if count == 0:
            continue
        if size % per_block:  # mid-block (so not a multiple of the block's bytes): faiss packs code by code
            lists.add_entries(i, count, others.get_ids(i), others.get_codes(i))
        else:
            lists.resize(i, size + count)
            start, nbytes = size // per_block * block, -(-count // per_block) * block
            ids, codes = lists.get_ids(i), lists.get_codes(i)
            faiss.rev_swig_ptr(ids, size + count)[size:] = faiss.rev_swig_ptr(others.get_ids(i), count)
            faiss.rev_swig_ptr(codes, start + nbytes)[start:] = faiss.rev_swig_ptr(
                others.get_codes(i), nbytes
            )
        others.resize(i, 0)
    into.ntotal += other.ntotal
    other.ntotal = 0


def read_faiss(path: Path, sha256: str) -> Any:
    """A faiss index file after checking its checksum."""
    if not path.is_file() or sha256_file(path) != sha256:
        raise GalleryIndexError(f"gallery index file {path} is missing or corrupt (checksum mismatch)")
    return _read_index(path)


def without_pca_training_matrix(index: Any) -> Any:
    """``index`` with the d x d eigenvector matrix of its PCA pre-transform freed (``PCAMatrix.PCAMat``: 9 MiB at
    d = 1536, in every segment's file and in memory): only training reads it, applying the PCA reads ``A`` and
    ``b``. Answers are unchanged."""
    chain = getattr(index, "chain", None)
    for i in range(chain.size() if chain is not None else 0):
        transform = faiss.downcast_VectorTransform(chain.at(i))
        if isinstance(transform, faiss.PCAMatrix) and transform.PCAMat.size():
            transform.PCAMat.swap(faiss.Float32Vector())  # swapped out: the memory itself is freed
    return index


def train_transforms_uncentred(index: Any, sample: Any) -> None:
    """Train the pre-transforms of ``index`` (a faiss ``IndexPreTransform``; others are left as they are) on
    ``sample`` [n, dim], each PCA without its centring: y = A x, not A (x - mean). Inner products need it: the
    centred A (q - m) . A (x - m) ranks rows by q . x - m . x (for every query alike), which reorders them by
    how far they lie along the mean, and trained TAG-CLIP embeddings share a large one (the search-model figure
    of docs/search.md; test_gallery_ann.py's shared-mean gallery)."""
    chain = getattr(index, "chain", None)
    for i in range(chain.size() if chain is not None else 0):
        transform = faiss.downcast_VectorTransform(chain.at(i))
        if not transform.is_trained:
            transform.train(sample)
        if isinstance(transform, faiss.PCAMatrix):
            transform.have_bias = False
        sample = transform.apply(sample)


def _read_index(path: Path) -> Any:
    """``faiss.read_index`` (``without_pca_training_matrix``); a file faiss cannot read (its checksum re-written
    to match) is a GalleryIndexError."""
    try:
        return without_pca_training_matrix(faiss.read_index(str(path)))
    except RuntimeError as error:  # faiss reports a bad file as a RuntimeError with a C++ stack in the text
        cause = " ".join(str(error).split()).rsplit(": ", 1)[
            -1
        ]  # after faiss' "Error in <function> at <file>:"
        raise GalleryIndexError(f"gallery index file {path} is not a faiss index ({cause[:200]})") from None


# ---------------------------------------------------------------------------------------------------------
# Build: train, encode segments, calibrate
# ---------------------------------------------------------------------------------------------------------


def ann_segments(out: Path, header: dict, manifest: dict, warn: Callable[[str], None]) -> dict:
    """Give every segment its approximate index, training (and calibrating) the quantizer once the gallery is
    large enough and again, every segment re-encoded from its stored rows, when a preset's is outgrown; and
    calibrating ``nprobe`` / ``k_factor`` again when the gallery has grown ``RECALIBRATE_GROWTH`` x since."""
    request = header.get("ann_request")
    if not request:
        return header
    total = manifest["num_rows"]
    if total < ANN_MIN_SIZE:
        warn(
            f"ANN index {request['ann']!r} not built yet: {total} images < {ANN_MIN_SIZE}, search is exact; "
            "it is built once the gallery grows past that size"
        )
        return header
    on, probes = request["on"], None
    if header.get("ann") is None or _outgrown(header["ann"], request, total):
        header["ann"], probes = _train(out, manifest, request, previous=header.get("ann"))
    elif _calibration_stale(header["ann"], total):
        probes = _recalibration_probes(out, manifest, request, header["ann"])
    tag = header["ann"].get("tag", "")
    trained = out / f"ann_trained{tag}.faiss"
    if sha256_file(trained) != header["ann"]["trained_sha256"]:
        raise GalleryIndexError(f"{trained} is corrupt (checksum mismatch)")
    template, searched = _read_index(trained), []
    for segment in manifest["segments"]:
        ann_file = segment["file"].replace(".safetensors", f"{tag}.faiss")
        if segment.get("ann_file") == ann_file:  # else new, or encoded by an outgrown quantizer
            if probes:  # a calibration searches (and scores exactly) every row
                stored = read_rows(out, segment)
                for probe in probes:
                    probe.update(stored, segment["start"])
                del stored
                searched.append(read_faiss(out / ann_file, segment["ann_sha256"]))
            continue
        stored = read_rows(out, segment)
        kept = kept_rows(segment)
        index = _encode_segment(template, stored, segment["start"], on, kept)
        for probe in probes or []:
            probe.update(stored, segment["start"])
        del stored
        data = faiss.serialize_index(index).tobytes()
        atomic_write(out / ann_file, data)  # a new name: the committed manifest's files stay valid
        segment["ann_file"], segment["ann_sha256"] = ann_file, sha256_bytes(data)
        searched.append(index)
    if probes:
        params, report = calibrate(searched, probes, header["ann"], total, on)
        header["ann"] = {
            **header["ann"],
            "params": params,
            "calibration": report,
            "calibrations": header["ann"].get("calibrations", 0) + 1,
        }
    if probes is not None or "calibrated_rows" not in header["ann"]:
        header["ann"]["calibrated_rows"] = total  # calibrated, or tried to be, at this size
    return header


def _encode_segment(
    template: Any, stored: dict, start: int, on: str, kept: torch.Tensor | None = None
) -> Any:
    """The segment's rows (those ``kept``: purged rows have no vector) added to a copy of the trained index.
    It keeps the template's search parameters: a loaded index applies ``index.json``'s, so a segment's file
    does not depend on the calibration at the time it was written."""
    index = faiss.clone_index(template)
    if faiss.try_extract_index_ivf(index) is None:
        index = faiss.IndexIDMap2(index)
    rows_total = next(iter(stored.values())).shape[0]
    for begin in range(0, rows_total, ANN_ADD_CHUNK):  # fp32 vectors of one chunk at a time
        ids: Any = slice(begin, min(begin + ANN_ADD_CHUNK, rows_total))
        if kept is not None and not bool(kept[ids].all()):
            ids = kept[ids].nonzero().squeeze(1) + begin
        vectors = ann_vectors({k: v[ids] for k, v in stored.items()}, on)
        ids = torch.arange(ids.start, ids.stop) if isinstance(ids, slice) else ids
        index.add_with_ids(vectors.numpy(), (ids + start).numpy())
    return index


def _outgrown(ann: dict, request: dict, total: int) -> bool:
    """Whether a preset's IVF quantizer has ``RETRAIN_GROWTH`` x fewer lists than ``total`` rows call for
    (``ivf_lists``); a factory string the user gave is never retrained."""
    trained = re.search(r"IVF(\d+)", ann["factory"])
    if request["ann"] not in ANN_PRESETS or trained is None:
        return False
    return ivf_lists(total) >= RETRAIN_GROWTH * int(trained.group(1))


def _calibration_stale(ann: dict, total: int) -> bool:
    """Whether an IVF index with a tunable ``nprobe`` or ``k_factor`` was last calibrated (or tried to be) at
    1 / ``RECALIBRATE_GROWTH`` of ``total`` rows or fewer (an index.json without that count: yes)."""
    if "IVF" not in ann["factory"] or not {"nprobe", "k_factor"} - set(ann.get("fixed", [])):
        return False
    return total >= RECALIBRATE_GROWTH * ann.get("calibrated_rows", 0)


def remove_unreferenced(out: Path, header: dict, manifest: dict) -> None:
    """After a commit: delete the segment and ANN files that neither header nor manifest names (segments merged
    into a larger one, ANN files of an outgrown quantizer)."""
    keep = {out / s["ann_file"] for s in manifest["segments"] if s.get("ann_file")}
    keep |= {out / s["file"] for s in manifest["segments"]}
    if header.get("ann"):
        keep.add(out / f"ann_trained{header['ann'].get('tag', '')}.faiss")
    segments = [*(out / "segments").glob("*.faiss"), *(out / "segments").glob("*.safetensors")]
    for path in [*out.glob("ann_trained*.faiss"), *segments]:
        if path not in keep:
            path.unlink(missing_ok=True)


def _train(
    out: Path, manifest: dict, request: dict, previous: dict | None
) -> tuple[dict, list[_Probe] | None]:
    """Resolve the requested ANN for the gallery, train it on a fixed sample of rows (read segment by segment:
    memory bounded by the sample), save it as ``ann_trained[.ivf<lists>].faiss`` (the tag on a retrain of the
    ``previous`` one), and collect the held-out proxy queries its calibration uses (None when its search cannot
    be calibrated)."""
    total, segments, on = manifest["num_rows"], manifest["segments"], request["on"]
    first = read_rows(out, segments[0])
    dim = ann_vectors({k: v[:1] for k, v in first.items()}, on).shape[1]
    del first
    spec = ann_spec(request["ann"], total, dim, request.get("params"), on)
    template = faiss.index_factory(dim, spec["factory"], faiss.METRIC_INNER_PRODUCT)
    picked = _training_rows(total, template)
    tunable = {"nprobe", "k_factor"} - set(spec["fixed"])
    calibrated = faiss.try_extract_index_ivf(template) is not None and bool(tunable)
    held_out = _held_out_rows(total, picked) if calibrated else picked[:0]
    parts, queries = _read_rows(
        out, segments, picked if not template.is_trained else picked[:0], held_out, on
    )
    if not template.is_trained:
        sample = torch.cat(parts).numpy()
        train_transforms_uncentred(template, sample)
        template.train(sample)
        without_pca_training_matrix(template)
    ivf = faiss.try_extract_index_ivf(template)
    tag = f".ivf{ivf.nlist}" if previous is not None and ivf is not None else ""
    data = faiss.serialize_index(template).tobytes()
    atomic_write(out / f"ann_trained{tag}.faiss", data)
    probes = _probes(out, request, queries, held_out) if calibrated else None
    history = {
        "trained_rows": total,
        "training_sample": len(picked),
        "trainings": (previous or {}).get("trainings", 0) + 1,
        "calibrations": (previous or {}).get("calibrations", 0),
    }
    return {**spec, "trained_sha256": sha256_bytes(data), "tag": tag, **history}, probes


def _recalibration_probes(out: Path, manifest: dict, request: dict, ann: dict) -> list[_Probe]:
    """The proxy queries of a calibration without retraining: held-out rows outside the quantizer's training
    sample (that of ``trained_rows``; every row is a candidate where index.json does not say), and the stored
    text queries."""
    total, trained_rows = manifest["num_rows"], ann.get("trained_rows")
    known = trained_rows and "training_sample" in ann
    training = _sample(trained_rows, ann["training_sample"]) if known else torch.empty(0, dtype=torch.long)
    held_out = _held_out_rows(total, training)
    _, queries = _read_rows(out, manifest["segments"], held_out[:0], held_out, ann["on"])
    return _probes(out, request, queries, held_out)


def _probes(out: Path, request: dict, rows: list[dict[str, torch.Tensor]], held_out: torch.Tensor) -> list:
    """The calibration's proxy query sets: the held-out ``rows`` moved (when any), and the stored text queries
    (when the index was given some)."""
    probes = [_Probe(_moved_rows(rows), held_out, "rows")] if rows else []
    entry = request.get("queries")
    if entry:
        probes.append(_Probe(read_calibration_queries(out, entry), None, "queries"))
    return probes


def _read_rows(
    out: Path, segments: list[dict], picked: torch.Tensor, held_out: torch.Tensor, on: str
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(ANN vectors of the rows ``picked``, the stored rows ``held_out``), reading only the segments holding
    them, one at a time."""
    parts, queries = [], []
    for segment in segments:
        lo, hi = segment["start"], segment["start"] + segment["rows"]
        local = picked[(picked >= lo) & (picked < hi)] - lo
        asked = held_out[(held_out >= lo) & (held_out < hi)] - lo
        if len(local) or len(asked):
            stored = read_rows(out, segment)
            if len(local):
                parts.append(ann_vectors({k: v[local] for k, v in stored.items()}, on))
            if len(asked):
                queries.append({k: v[asked].float() for k, v in stored.items() if k != "view_probs"})
            del stored
    return parts, queries


def _training_rows(size: int, index: Any) -> torch.Tensor:
    """A fixed random subset of rows for training: 40 per IVF list, else ``TRAIN_MAX`` (all rows when fewer)."""
    ivf = faiss.try_extract_index_ivf(index)
    return _sample(size, min(size, 40 * ivf.nlist if ivf is not None else TRAIN_MAX))


def _sample(size: int, count: int) -> torch.Tensor:
    """``count`` of ``size`` rows, fixed (seed 0), sorted: the training sample of a gallery of ``size``."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(0))[:count].sort().values


def _held_out_rows(size: int, training: torch.Tensor) -> torch.Tensor:
    """Up to ``CALIBRATION_QUERIES`` fixed random rows outside the training sample (sorted)."""
    free = torch.ones(size, dtype=torch.bool)
    free[training] = False
    rows = free.nonzero().squeeze(1)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1))[:CALIBRATION_QUERIES]
    return rows[order].sort().values


class _Probe:
    """One set of proxy queries (``name``: "rows" or "queries") and their exact TAG-PR Eq. 14
    top-``CALIBRATION_K`` over the gallery, accumulated segment by segment; ``ids``: the gallery row each query
    was made from (excluded from its truth), or None."""

    def __init__(self, query: dict[str, torch.Tensor], ids: torch.Tensor | None, name: str):
        self.query, self.ids, self.name = query, ids, name
        self.size = query["global"].shape[0]
        self.best_s = torch.full((self.size, CALIBRATION_K), -math.inf)
        self.best_i = torch.full((self.size, CALIBRATION_K), -1, dtype=torch.long)

    def update(self, stored: dict[str, torch.Tensor], start: int, chunk: int = 16384) -> None:
        """Merge the exact top-k of gallery rows ``start..`` (``stored``), ``chunk`` rows at a time."""
        size = stored["global"].shape[0]
        for begin in range(0, size, chunk):
            part = {key: value[begin : begin + chunk].float() for key, value in stored.items()}
            local = part.get("local") if "local" in self.query else None
            scores = eq14_similarity(self.query["global"], part["global"], self.query.get("local"), local)
            rows = torch.arange(start + begin, start + begin + scores.shape[1])
            if self.ids is not None:  # a proxy's own row is not a neighbour to find
                scores[self.ids[:, None] == rows[None, :]] = -math.inf
            merged_s = torch.cat([self.best_s, scores], dim=1)
            merged_i = torch.cat([self.best_i, rows.expand(self.size, -1)], dim=1)
            self.best_s, pos = merged_s.topk(CALIBRATION_K, dim=1)
            self.best_i = merged_i.gather(1, pos)

    def recall(self, found: torch.Tensor) -> float:
        """Recall@k of candidates ``found`` [n_queries, C] after exact re-ranking: the share of the true top-k
        among them (rows the gallery lacks, -1, count as found: a gallery of fewer than k rows)."""
        truth = self.best_i
        hit = (truth[:, :, None] == found[:, None, :]).any(-1) | (truth < 0)
        return float(hit.float().mean())


def check_calibration_queries(queries: Any, dims: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Text query embeddings to calibrate an ANN index on: a dict with ``global`` (and ``local`` when the
    gallery has TSE rows) of 1..``MAX_CALIBRATION_QUERIES`` finite rows each, with the gallery's widths
    (``dims``) when known; returned as L2-normalised float32 rows (queries are normalised when searched)."""
    if not isinstance(queries, dict) or "global" not in queries:
        raise GalleryIndexError("calibration queries must be a dict of embeddings with a 'global' entry")
    extra = set(queries) - {"global", "local"}
    if extra:
        raise GalleryIndexError(f"calibration queries hold unknown entries {sorted(extra)} (global, local)")
    out = {}
    for key, value in queries.items():
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or not value.is_floating_point():
            raise GalleryIndexError(f"calibration queries {key!r} must be a 2-d float tensor [n, dim]")
        if not 1 <= value.shape[0] <= MAX_CALIBRATION_QUERIES:
            raise GalleryIndexError(
                f"calibration queries must hold 1 to {MAX_CALIBRATION_QUERIES} rows, got {value.shape[0]}"
            )
        if dims is not None and value.shape[1] != dims.get(key):
            raise GalleryIndexError(
                f"calibration queries {key!r} have {value.shape[1]} dims, the gallery {dims.get(key)}: "
                "embed them with the model that embeds the gallery"
            )
        out[key] = torch.nn.functional.normalize(value.detach().float().cpu(), dim=1).contiguous()
    if dims is not None and set(out) != set(dims):
        raise GalleryIndexError(f"calibration queries hold {sorted(out)}, the gallery {sorted(dims)}")
    if len({value.shape[0] for value in out.values()}) != 1:
        raise GalleryIndexError("calibration queries 'global' and 'local' must have the same number of rows")
    check_finite(out, list(range(out["global"].shape[0])), "calibration query")
    return out


def write_calibration_queries(out: Path, queries: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Save checked calibration queries (``check_calibration_queries``) as ``out/QUERIES_FILE``; returns the
    ``{"file", "rows", "sha256"}`` entry ``index.json`` keeps in its ``ann_request``."""
    return {"file": QUERIES_FILE, **write_tensors(out / QUERIES_FILE, queries)}


def read_calibration_queries(out: Path, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The stored calibration queries, checked against their ``index.json`` entry (safetensors: no code)."""
    return read_tensors(out / QUERIES_FILE, entry["sha256"], entry["rows"])


def _moved_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Held-out rows (read segment by segment) joined and moved: each embedding rotated towards a random
    orthogonal direction to cosine ``CALIBRATION_COSINE`` (seed 2)."""
    joined = {key: torch.cat([r[key] for r in rows]) for key in rows[0]}
    generator = torch.Generator().manual_seed(2)
    return {key: _moved(value, generator) for key, value in joined.items()}


def _moved(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Unit rows rotated towards random orthogonal directions to cosine ``CALIBRATION_COSINE``."""
    rows = torch.nn.functional.normalize(rows, dim=1)
    noise = torch.randn(rows.shape, generator=generator)
    noise = torch.nn.functional.normalize(noise - (noise * rows).sum(1, keepdim=True) * rows, dim=1)
    sine = math.sqrt(1 - CALIBRATION_COSINE**2)
    return CALIBRATION_COSINE * rows + sine * noise


def calibrate(
    indexes: Sequence[Any], probes: Sequence[_Probe], ann: dict, total: int, on: str
) -> tuple[dict[str, float], dict[str, Any]]:
    """(params, report): the ``nprobe`` and ``k_factor`` of least estimated cost (``search_cost``) whose
    recall@10 reaches ``CALIBRATION_TARGET`` on every set of proxy queries, else the most accurate (by their
    lowest recall); parameters the user fixed are kept. Recall after exact re-ranking = the share of the true
    top-10 among the candidates, so no re-ranking is run. The segments' ``indexes`` are merged into one (their
    lists moved, as a loaded index searches them), so the candidates are those a search re-ranks."""
    params, fixed, k = dict(ann["params"]), set(ann.get("fixed", [])), CALIBRATION_K
    merged, _ = merge_ann(list(indexes))
    nlist = faiss.extract_index_ivf(merged[0]).nlist
    grid = [params["nprobe"]] if "nprobe" in fixed else _probe_grid(nlist)
    factors = [params["k_factor"]] if "k_factor" in fixed else list(CALIBRATION_K_FACTORS)
    vectors = [ann_vectors(probe.query, on) for probe in probes]
    tried = []
    for nprobe in grid:
        found = [candidates(merged, v, k * max(factors), nprobe=lambda ivf, n=nprobe: n) for v in vectors]
        for factor in factors:
            recalls = [probe.recall(f[:, : k * factor]) for probe, f in zip(probes, found, strict=True)]
            cost = search_cost(nprobe, factor, total / nlist, k)
            tried.append((min(recalls), cost, nprobe, factor, recalls))
    reached = [t for t in tried if t[0] >= CALIBRATION_TARGET]
    recall, _, nprobe, factor, recalls = min(reached, key=lambda t: t[1]) if reached else max(tried)
    report = {
        "recall_at_10": round(recall, 4),
        "target": CALIBRATION_TARGET,
        "queries": sum(probe.size for probe in probes),
        "sets": {
            probe.name: {"queries": probe.size, "recall_at_10": round(r, 4)}
            for probe, r in zip(probes, recalls, strict=True)
        },
        "query_cosine": CALIBRATION_COSINE,
    }
    return {**params, "nprobe": int(nprobe), "k_factor": int(factor)}, report


def _probe_grid(nlist: int) -> list[int]:
    """nprobe values tried: lists / 64 ... lists / 4 (powers of two), then eighths: 3/8, 1/2, 5/8, 3/4 of the
    lists and all of them."""
    eighths = {max(1, e * nlist // 8) for e in (3, 4, 5, 6, 8)}
    return sorted({max(1, nlist // d) for d in (64, 32, 16, 8, 4)} | eighths)
