"""Merging segments' FastScan lists (``ann.move_lists``): a list whose size is a non-zero multiple of its block's
bytes is where faiss 1.15's own merge overflows the heap (the process aborts with ``malloc(): invalid size``).
Each case runs in a fresh process, so an abort is a failed test, not a lost worker."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("faiss")
pytestmark = pytest.mark.slow  # a fresh process per case

MERGE = """
import faiss, numpy as np
from modeling_tagclip.retrieval.embedded.ann import merge_ann
faiss.omp_set_num_threads(1)
x = np.random.default_rng(0).standard_normal((3000, 16)).astype("float32")
template = faiss.index_factory(16, "IVF1,PQ8x4fs", faiss.METRIC_INNER_PRODUCT)  # a 128-byte block of 32 codes
template.train(x)
for sizes in SIZES:
    parts, start = [], 0
    for size in sizes:
        part = faiss.clone_index(template)
        part.add_with_ids(x[start : start + size], np.arange(start, start + size))
        parts.append(part)
        start += size
    whole = faiss.clone_index(template)
    whole.add(x[:start])
    merged, one = merge_ann(parts)
    assert one and merged[0].ntotal == start and all(p.ntotal == 0 for p in parts[1:]), sizes
    got, want = merged[0].search(x[:40], start), whole.search(x[:40], start)
    assert (np.sort(got[1], 1) == np.sort(want[1], 1)).all(), sizes
    assert np.array_equal(np.sort(got[0], 1), np.sort(want[0], 1)), sizes
print("merged", len(SIZES))
"""


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "case.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)


def test_lists_ending_on_a_block_merge_as_one_index_built_over_every_row(tmp_path):
    # 128 and 256 codes fill 128-byte blocks exactly: faiss' merge copies the whole merged length past their end
    sizes = [(128, 10), (256, 1), (128, 128), (1024, 33), (100, 28, 10), (0, 128, 5), (31, 1), (32, 32, 0, 7)]
    done = _run(MERGE.replace("SIZES", repr(sizes * 20)), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"merged {len(sizes) * 20}"


def test_a_gallery_grown_from_a_block_sized_segment_loads_and_searches_as_exact_search(tmp_path):
    """The user's path: an index of 2048 rows over ``IVF1,PQ16x4fs`` (one list, 256-byte blocks of 32 codes:
    2048 rows end on a block), one add, then a load that merges the two segments and a search."""
    code = f"""
    import faiss, torch
    from modeling_tagclip.retrieval.embedded import gallery_index as gi
    from modeling_tagclip.retrieval.embedded.index_build import index_embeddings
    faiss.omp_set_num_threads(1)
    torch.manual_seed(0)

    def rows(n):
        unit = lambda t: torch.nn.functional.normalize(t, dim=-1)
        return {{"global": unit(torch.randn(n, 32)), "local": unit(torch.randn(n, 32)),
                 "view_probs": torch.full((n, 2), 0.5)}}

    out = {str(tmp_path / "index")!r}
    first, added = rows(2048), rows(10)
    index_embeddings(out, first, [f"a{{i}}.jpg" for i in range(2048)], {str(tmp_path)!r},
                     ann="IVF1,PQ16x4fs", ann_params={{"nprobe": 1, "k_factor": 300}})
    index_embeddings(out, added, [f"b{{i}}.jpg" for i in range(10)], {str(tmp_path)!r})
    index = gi.GalleryIndex.load(out, cache=False)
    assert len(index.ann_indexes) == 1 and index.ann_indexes[0].ntotal == 2058
    queries = {{k: v for k, v in added.items() if k != "view_probs"}}  # the 10 added rows themselves
    found = index.topk(queries, 5)[1]
    every = {{k: torch.cat([first[k], added[k]]) for k in ("global", "local")}}
    exact = gi.chunked_topk(queries, every, 5)[1]
    assert torch.equal(found[:, 0], torch.arange(2048, 2058)) and torch.equal(found, exact)
    print("ok")
    """
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
