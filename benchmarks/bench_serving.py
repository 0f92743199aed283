"""Serving RAM of a gallery index: the memory a query server holds for the index, over its size on disk.

Each index is measured in two fresh processes that do the same work except opening the index. Both import
the package, load the TAG-CLIP model (`--model PATH`, or the reference ViT-B/16 config with random weights,
saved once) and encode the text queries; then the C heap's free memory is returned to the OS (`malloc_trim`, so
the index cannot fill the encoding's freed heap unseen) and the high-water mark of the resident set is reset
(Linux `clear_refs`) so that the model load's transient peak cannot hide the index. The *served* process then opens the index
(`GalleryIndex.load`, every checksum verified) and answers each query at batch 1 (`topk`, k=10); the *baseline*
process answers nothing. Peak RSS is VmHWM read at the end.

    serving ratio = (served peak RSS - baseline peak RSS) / bytes of the index folder on disk

where each peak counts from the process's resident set at the reset, so the model's share of the resident set
(file-backed pages the kernel may drop, which differ between processes) cancels. The same ratio is given for
the resident set at the end (after the load's transient copies are freed). One baseline process serves all
the indexes of a run (it opens none).

Each row also gives the anonymous and the file-backed parts of the added resident set (RssAnon, RssFile of
`/proc/self/status`), the index's store dtype, how it was loaded (`--load mapped`, `GalleryIndex.load`'s
default, or `read`: `mmap=False`) and whether its segment files were in fact memory-mapped (listed in
`/proc/self/maps`): a mapped store is file-backed pages, outside the anonymous set. `added_live_anon_mib` is
the anonymous part once both processes hand their freed C heap back (`malloc_trim`) at the end: what serving
needs, without what the allocator keeps for reuse (a query's re-ranking workspace, about 7 MiB).

    python benchmarks/bench_serving.py /tmp/idx/5000/ivf_combined /tmp/idx/10000/ivf_combined
    (index folders written by `tagclip index` or `bench_search.py --keep DIR`)
    python benchmarks/bench_serving.py --generate 100000:fp16 100000:int8 --load mapped read
    (`ivf` indexes of `bench_search.py`'s generator written first, nprobe and k_factor fixed: no calibration)
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    add_allow_dirty,
    check_publishable,
    print_table,
    write_json,
)
from modeling_tagclip.flags import positive_int  # noqa: E402
from modeling_tagclip.retrieval.embedded.index_store import HEADER, MANIFEST  # noqa: E402
from modeling_tagclip.retrieval.embedded.row_store import release_free_heap  # noqa: E402

CAPTIONS = (
    "a man in a red jacket and black trousers carrying a backpack",
    "a woman with long hair wearing a white shirt and blue jeans",
    "a person in a grey hoodie riding a bicycle",
    "a young man in a green t-shirt and shorts holding a phone",
    "an older woman in a long black coat with a handbag",
)
K = 10
LOADS = ("mapped", "read")
DTYPES = ("fp16", "int8")


def proc_status(field: str) -> float:
    """A `/proc/self/status` memory field (VmHWM, VmRSS, RssAnon, RssFile) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} field")


def reset_peak() -> None:
    """Reset VmHWM to the current RSS; a clear error where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as error:
        raise SystemExit(
            f"error: cannot reset the peak RSS (/proc/self/clear_refs: {error}); needs Linux"
        ) from None


def save_reference_model(folder: Path) -> str:
    """The reference config with random weights and its processor, saved once for every measured process."""
    from modeling_tagclip import TagClipConfig, TagClipModel, TagClipProcessor

    torch.manual_seed(0)
    TagClipModel(TagClipConfig()).save_pretrained(folder)
    TagClipProcessor.from_defaults().save_pretrained(folder)
    return str(folder)


def memory() -> dict[str, float]:
    """The resident set and its anonymous and file-backed parts, MiB."""
    return {
        "rss_mib": proc_status("VmRSS"),
        "anon_mib": proc_status("RssAnon"),
        "file_mib": proc_status("RssFile"),
    }


def maps_segments_of(folder: Path) -> bool:
    """Whether a segment file of the index at ``folder`` is memory-mapped into this process (/proc/self/maps)."""
    prefix = str(folder.resolve() / "segments") + "/"
    return any(prefix in line for line in Path("/proc/self/maps").read_text().splitlines())


def child(args: argparse.Namespace) -> dict[str, float]:
    """One measured process: model, queries, reset peak, then (served) open the index and answer them."""
    from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex
    from modeling_tagclip.retrieval.encode import encode_texts
    from modeling_tagclip.retrieval.loading import load_model

    torch.set_num_threads(1)
    model, processor = load_model(args.model, family="tagclip")
    texts = [CAPTIONS[i % len(CAPTIONS)] for i in range(args.queries)]
    queries = encode_texts(model, processor, texts, batch_size=len(texts))
    release_free_heap()  # else the index loads into the encoding's freed heap and its growth is not counted
    reset_peak()
    start, mapped = memory(), False
    if args.child == "served":
        index = GalleryIndex.load(args.index, cache=False, mmap=args.load == ["mapped"])
        for i in range(args.queries):
            index.topk({key: value[i : i + 1] for key, value in queries.items()}, K)
        mapped = maps_segments_of(args.index)
    end, peak = memory(), proc_status("VmHWM")
    release_free_heap()  # what the process needs: the freed heap the allocator kept is handed back
    return {
        **{f"start_{key}": value for key, value in start.items()},
        **end,
        "live_anon_mib": proc_status("RssAnon"),
        "peak_mib": peak,
        "mapped": mapped,
    }


def run_child(kind: str, index: Path, args: argparse.Namespace, load: str = "mapped") -> dict[str, float]:
    """Run `child` in a fresh interpreter; its JSON answer (a clear error when it fails)."""
    command = [sys.executable, __file__, str(index), "--child", kind, "--queries", str(args.queries)]
    command += ["--load", load]
    command += ["--model", args.model]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: the {kind} process for {index} failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def added(result: dict[str, float], key: str, start: str = "start_rss_mib") -> float:
    """MiB a process grew from the reset point (after the model load and query encoding) to `key`."""
    return result[key] - result[start]


def serving_row(index: Path, base: dict[str, float], args: argparse.Namespace, load: str) -> dict[str, Any]:
    """The served process of one index (loaded ``load``) against the baseline process, and the ratios."""
    manifest = json.loads((index / MANIFEST).read_text())
    header = json.loads((index / HEADER).read_text())
    served = run_child("served", index, args, load)
    mib = folder_bytes(index) / 2**20
    peak = added(served, "peak_mib") - added(base, "peak_mib")
    resident = added(served, "rss_mib") - added(base, "rss_mib")
    part = {
        key: added(served, f"{key}_mib", f"start_{key}_mib") - added(base, f"{key}_mib", f"start_{key}_mib")
        for key in ("anon", "file")
    }
    return {
        "size": manifest["num_rows"],
        "ann": (header.get("ann") or {}).get("factory"),
        "store_dtype": header.get("store_dtype", "fp32"),
        "load": load,
        "mapped": served["mapped"],
        "index_mib": round(mib, 1),
        "baseline_peak_mib": round(base["peak_mib"], 1),
        "served_peak_mib": round(served["peak_mib"], 1),
        "added_peak_mib": round(peak, 1),
        "peak_over_index": round(peak / mib, 3),
        "added_rss_mib": round(resident, 1),
        "rss_over_index": round(resident / mib, 3),
        "added_anon_mib": round(part["anon"], 1),
        "added_file_mib": round(part["file"], 1),
        "added_live_anon_mib": round(
            added(served, "live_anon_mib", "start_anon_mib") - added(base, "live_anon_mib", "start_anon_mib"),
            1,
        ),
        "queries": args.queries,
    }


def check_index(text: str) -> Path:
    """argparse type: an index folder (its header and manifest inside)."""
    path = Path(text)
    if not ((path / MANIFEST).is_file() and (path / HEADER).is_file()):
        raise argparse.ArgumentTypeError(f"{text} is not a gallery index folder (no {HEADER} and {MANIFEST})")
    return path


def generate_spec(text: str) -> tuple[int, str]:
    """argparse type: ``SIZE:DTYPE`` (``100000:int8``), an index to write from bench_search's generator."""
    size, _, dtype = text.partition(":")
    if not size.isdigit() or int(size) < 1 or dtype not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not SIZE:DTYPE (a positive size, DTYPE one of {DTYPES})"
        )
    return int(size), dtype


def generated_index(size: int, dtype: str, folder: Path) -> Path:
    """An ``ivf`` index of ``size`` rows of bench_search's generator (seed 0) with a ``dtype`` store, written
    under ``folder``; nprobe (lists / 2) and k_factor fixed, so nothing is calibrated."""
    from benchmarks.bench_search import GAP, TEXT_NOISE, make_gallery
    from modeling_tagclip.retrieval.embedded.ann import IVF_K_FACTOR, IVF_PROBE_DIVISOR, ivf_lists
    from modeling_tagclip.retrieval.embedded.index_build import index_embeddings

    gallery = make_gallery(size, argparse.Namespace(seed=0, text_noise=TEXT_NOISE, gap=GAP))[2]
    out = folder / f"{size}_{dtype}"
    params = {"nprobe": max(1, ivf_lists(size) // IVF_PROBE_DIVISOR), "k_factor": IVF_K_FACTOR}
    paths = [f"{i:08d}.jpg" for i in range(size)]
    index_embeddings(out, gallery, paths, folder, ann="ivf", ann_params=params, store_dtype=dtype)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("indexes", type=check_index, nargs="*", help="gallery index folders")
    parser.add_argument(
        "--generate",
        type=generate_spec,
        nargs="+",
        default=[],
        metavar="SIZE:DTYPE",
        help="also write and measure ivf indexes of bench_search's generator (DTYPE: fp16 or int8)",
    )
    parser.add_argument(
        "--load", nargs="+", choices=LOADS, default=["mapped"], help="measure each index loaded these ways"
    )
    parser.add_argument("--queries", type=positive_int, default=50, help="text queries answered at batch 1")
    parser.add_argument("--model", help="a saved TAG-CLIP folder (default: reference config, random weights)")
    parser.add_argument("--child", choices=["baseline", "served"], help=argparse.SUPPRESS)
    parser.add_argument("--output", default=str(RESULTS_DIR / "serving_cpu.json"))
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.child and len(args.indexes) != 1:
        parser.error("--child measures one index")
    if not (args.indexes or args.generate):
        parser.error("name index folders or --generate SIZE:DTYPE")
    args.index = args.indexes[0] if args.indexes else None
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    check_publishable(args.output)  # before the measurement, not after it
    torch.set_num_threads(1)  # as in the measured processes (recorded in the machine record)
    rows, model = [], args.model
    with tempfile.TemporaryDirectory() as tmp:
        args.model = args.model or save_reference_model(Path(tmp) / "model")
        indexes = args.indexes + [generated_index(size, dtype, Path(tmp)) for size, dtype in args.generate]
        base = run_child("baseline", indexes[0], args)  # opens no index: one for all
        for index, load in itertools.product(indexes, args.load):
            rows.append(serving_row(index, base, args, load))
            print_table(
                rows,
                [
                    "size",
                    "store_dtype",
                    "load",
                    "mapped",
                    "index_mib",
                    "baseline_peak_mib",
                    "served_peak_mib",
                    "added_peak_mib",
                    "peak_over_index",
                    "added_rss_mib",
                    "rss_over_index",
                    "added_anon_mib",
                    "added_file_mib",
                    "added_live_anon_mib",
                ],
            )
    payload = {
        "model": model or "TagClipConfig() (ViT-B/16, HR-MoE), random init",
        "definition": "(served - baseline) / index bytes on disk, each process's growth from the point after "
        "the model load and query encoding (VmHWM reset there via /proc/self/clear_refs; VmRSS at the end; "
        "anon and file: RssAnon and RssFile at the end; live anon: RssAnon after malloc_trim at the end)",
        "rows": rows,
    }
    write_json(args.output, payload)
    return payload


if __name__ == "__main__":
    main()
