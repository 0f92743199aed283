"""Serving RAM of a gallery index: the memory a query server holds for the index, over its size on disk.

Each index is measured in two fresh processes that do the same work except opening the index. Both import
the package, load the TAG-CLIP model (`--model PATH`, or the reference ViT-B/16 config with random weights,
saved once) and encode the text queries; then the high-water mark of the resident set is reset (Linux `clear_refs`) so that
the model load's transient peak cannot hide the index. The *served* process then opens the index
(`GalleryIndex.load`, every checksum verified) and answers each query at batch 1 (`topk`, k=10); the *baseline*
process answers nothing. Peak RSS is VmHWM read at the end.

    serving ratio = (served peak RSS - baseline peak RSS) / bytes of the index folder on disk

where each peak counts from the process's resident set at the reset, so the model's share of the resident set
(file-backed pages the kernel may drop, which differ between processes) cancels. The same ratio is given for
the resident set at the end (after the load's transient copies are freed). One baseline process serves all
the indexes of a run (it opens none).

    python benchmarks/bench_serving.py /tmp/idx/5000/ivf_combined /tmp/idx/10000/ivf_combined
    (index folders written by `tagclip index` or `bench_search.py --keep DIR`)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, add_allow_dirty, print_table, write_json  # noqa: E402
from modeling_tagclip.flags import positive_int  # noqa: E402
from modeling_tagclip.retrieval.embedded.index_store import HEADER, MANIFEST  # noqa: E402

CAPTIONS = (
    "a man in a red jacket and black trousers carrying a backpack",
    "a woman with long hair wearing a white shirt and blue jeans",
    "a person in a grey hoodie riding a bicycle",
    "a young man in a green t-shirt and shorts holding a phone",
    "an older woman in a long black coat with a handbag",
)
K = 10


def proc_status(field: str) -> float:
    """A `/proc/self/status` memory field (VmHWM, VmRSS) in MiB."""
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


def child(args: argparse.Namespace) -> dict[str, float]:
    """One measured process: model, queries, reset peak, then (served) open the index and answer them."""
    from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex
    from modeling_tagclip.retrieval.encode import encode_texts
    from modeling_tagclip.retrieval.loading import load_model

    torch.set_num_threads(1)
    model, processor = load_model(args.model, family="tagclip")
    texts = [CAPTIONS[i % len(CAPTIONS)] for i in range(args.queries)]
    queries = encode_texts(model, processor, texts, batch_size=len(texts))
    reset_peak()
    start = proc_status("VmRSS")
    if args.child == "served":
        index = GalleryIndex.load(args.index, cache=False)
        for i in range(args.queries):
            index.topk({key: value[i : i + 1] for key, value in queries.items()}, K)
    return {"start_rss_mib": start, "peak_mib": proc_status("VmHWM"), "rss_mib": proc_status("VmRSS")}


def run_child(kind: str, index: Path, args: argparse.Namespace) -> dict[str, float]:
    """Run `child` in a fresh interpreter; its JSON answer (a clear error when it fails)."""
    command = [sys.executable, __file__, str(index), "--child", kind, "--queries", str(args.queries)]
    command += ["--model", args.model]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: the {kind} process for {index} failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def added(result: dict[str, float], key: str) -> float:
    """MiB a process grew from the reset point (after the model load and query encoding) to `key`."""
    return result[key] - result["start_rss_mib"]


def serving_row(index: Path, base: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    """The served process of one index against the baseline process, and the serving ratios."""
    manifest = json.loads((index / MANIFEST).read_text())
    header = json.loads((index / HEADER).read_text())
    served = run_child("served", index, args)
    mib = folder_bytes(index) / 2**20
    peak = added(served, "peak_mib") - added(base, "peak_mib")
    resident = added(served, "rss_mib") - added(base, "rss_mib")
    return {
        "size": manifest["num_rows"],
        "ann": (header.get("ann") or {}).get("factory"),
        "index_mib": round(mib, 1),
        "baseline_peak_mib": round(base["peak_mib"], 1),
        "served_peak_mib": round(served["peak_mib"], 1),
        "added_peak_mib": round(peak, 1),
        "peak_over_index": round(peak / mib, 3),
        "added_rss_mib": round(resident, 1),
        "rss_over_index": round(resident / mib, 3),
        "queries": args.queries,
    }


def check_index(text: str) -> Path:
    """argparse type: an index folder (its header and manifest inside)."""
    path = Path(text)
    if not ((path / MANIFEST).is_file() and (path / HEADER).is_file()):
        raise argparse.ArgumentTypeError(f"{text} is not a gallery index folder (no {HEADER} and {MANIFEST})")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("indexes", type=check_index, nargs="+", help="gallery index folders")
    parser.add_argument("--queries", type=positive_int, default=50, help="text queries answered at batch 1")
    parser.add_argument("--model", help="a saved TAG-CLIP folder (default: reference config, random weights)")
    parser.add_argument("--child", choices=["baseline", "served"], help=argparse.SUPPRESS)
    parser.add_argument("--output", default=str(RESULTS_DIR / "serving_cpu.json"))
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.child and len(args.indexes) != 1:
        parser.error("--child measures one index")
    args.index = args.indexes[0]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    torch.set_num_threads(1)  # as in the measured processes (recorded in the machine record)
    rows, model = [], args.model
    with tempfile.TemporaryDirectory() as tmp:
        args.model = args.model or save_reference_model(Path(tmp) / "model")
        base = run_child("baseline", args.indexes[0], args)  # opens no index: one for all
        for index in args.indexes:
            rows.append(serving_row(index, base, args))
            print_table(
                rows,
                [
                    "size",
                    "index_mib",
                    "baseline_peak_mib",
                    "served_peak_mib",
                    "added_peak_mib",
                    "peak_over_index",
                    "added_rss_mib",
                    "rss_over_index",
                ],
            )
    payload = {
        "model": model or "TagClipConfig() (ViT-B/16, HR-MoE), random init",
        "definition": "(served - baseline) / index bytes on disk, each process's growth from the point after "
        "the model load and query encoding (VmHWM reset there via /proc/self/clear_refs; VmRSS at the end)",
        "rows": rows,
    }
    write_json(args.output, payload)
    return payload


if __name__ == "__main__":
    main()
