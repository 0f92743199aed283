"""TAG-CLIP web demo (Gradio, Space-ready): type a description, get the ranked gallery with view badges.

    python app.py [--model DIR_OR_REPO] [--gallery DIR | --index IDX | --index URI --collection NAME]
                  [--dtype fp32|fp16|bf16]
                  [--trust-remote-code] [--host 127.0.0.1] [--port 7860]

Defaults (also from the environment: TAGCLIP_MODEL, TAGCLIP_GALLERY, TAGCLIP_INDEX): the main job's model
``outputs/tagclip-synthetic/best`` and its synthetic test images ``data/synthetic/images/test``. Every result
shows its rank, the Eq. 14 score and the view the model's router predicts (blue AERIAL / orange GROUND badge);
when the gallery comes with TAG-PEDES-style annotations the true view is shown too. A synthetic-set gallery
(``ROOT/images/SPLIT``) is indexed with its ``ROOT/metadata/SPLIT.csv``, so the camera filter (and the view
filter, by the crops' recorded view) work on it. Why each result: the
patches TSE selected are outlined in magenta on the crop, and a bar shows the router's aerial / ground
probability. Results can be restricted to a view or a camera. If the main job has not been run the page says so
and how to run it. Needs the ``demo`` extra (Gradio); Space requirements: ``requirements-space.txt``.

Limits: a query is at most ``MAX_QUERY_CHARS`` characters and asks for 1 to ``MAX_RESULTS`` results; bad input
raises ``DemoInputError`` (a ValueError) naming the problem, shown as an error on the page. This package's own
model types load with its installed code; where the package is not installed (a Space), the model repository's
code runs only with ``--trust-remote-code`` (or ``TAGCLIP_TRUST_REMOTE_CODE=1``).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

ROOT = Path(__file__).resolve().parent
DEFAULT_MODEL = "outputs/tagclip-synthetic/best"
DEFAULT_GALLERY = "data/synthetic/images/test"
try:
    from modeling_tagclip.cli import MAIN_JOB
    from modeling_tagclip.tagclip.configuration_tagclip import VIEW_NAMES
except ImportError:  # a Space without the package
    MAIN_JOB = "accelerate launch --config_file training/accelerate_config.yaml -q training/train.py"
    VIEW_NAMES = ("aerial", "ground")
BADGE_COLOURS = {"aerial": (30, 110, 220), "ground": (225, 120, 20), None: (120, 120, 120)}
PATCH_COLOUR = (255, 0, 255)  # outline of the TSE-selected patches
MAX_RESULTS = 50
MAX_QUERY_CHARS = 1000
VIEW_CHOICES = ("any", *VIEW_NAMES)
DTYPES = ("fp32", "fp16", "bf16")
TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# Gradio's gallery cuts captions to one line (white-space: nowrap; overflow: hidden): let them wrap
CSS = """
#results .caption-label, #results .caption {
  white-space: normal !important; overflow: visible !important; text-overflow: clip !important;
  max-width: 100% !important;
}
"""
EXAMPLES = [
    "a woman with long black hair in a red jacket and blue jeans carrying a black backpack",
    "a man in a white t-shirt, black shorts and a cap",
    "a person in a green hoodie with a grey shoulder bag",
]


class DemoInputError(ValueError):
    """A bad query or setting in the demo (its message is shown on the page)."""


@dataclass
class Searcher:
    """A loaded model, its processor and the encoded gallery."""

    model: Any
    processor: Any
    index: Any
    encode_texts: Any
    true_views: dict[str, str] = field(default_factory=dict)

    def search(
        self, query: str, top_k: int, view: str | None = None, camera: str | None = None
    ) -> list[dict[str, Any]]:
        """Ranked hits; ``view`` / ``camera`` restrict the gallery (exact pre-filtering in the index)."""
        filters = {key: value for key, value in (("view", view), ("camera", camera)) if value}
        query_embeds = self.encode_texts(self.model, self.processor, [query])
        return self.index.search(query_embeds, top_k, filters=filters or None)[0]

    def explain(self, paths: Sequence[str]) -> list[dict[str, Any]]:
        """Why each image: the (row, column) patch cells TSE selects and the router's view probabilities."""
        import torch

        module = importlib.import_module(type(self.model).__module__)
        vision = self.model.config.vision_config
        rows, cols = (size // vision.patch_size for size in vision.image_hw)
        pixels = self.processor(images=list(paths))["pixel_values"]
        with torch.inference_mode():
            out = self.model.vision_model(pixel_values=pixels, return_dict=True)
        row = getattr(out, "attention_row", None)
        if row is None:  # older model code: the full head-averaged map
            row = out.attention_map[:, 0]
        k = min(self.model.image_tse_k, rows * cols)
        tokens = module.image_tse_scores(row.float()).topk(k, dim=-1).indices - 1  # token 0 is CLS
        probs = None
        if out.view_logits:
            probs = torch.stack([v.float().softmax(-1) for v in out.view_logits]).mean(0)
        return [
            {
                "patches": [(int(t) // cols, int(t) % cols) for t in tokens[i] if 0 <= int(t) < rows * cols],
                "grid": (rows, cols),
                "aerial": None if probs is None else float(probs[i, 0]),
                "ground": None if probs is None else float(probs[i, 1]),
            }
            for i in range(len(paths))
        ]


def _gallery_module(model_path: str, trust_remote_code: bool = False):
    """``gallery_index`` from this checkout, else the copy shipped with the model (Hub custom code, opt-in)."""
    try:
        from modeling_tagclip.retrieval import gallery_index

        return gallery_index
    except ImportError:
        if not trust_remote_code:
            raise DemoInputError(_remote_code_message(model_path)) from None
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        cls = get_class_from_dynamic_module("gallery_index.GalleryIndex", model_path)
        return sys.modules[cls.__module__]


def _remote_code_message(model: str) -> str:
    return (
        f"The package modeling_tagclip is not installed here, so {model} would run the code its repository ships: "
        "pass --trust-remote-code (or set TAGCLIP_TRUST_REMOTE_CODE=1) if you trust it, or pip install the package."
    )


def _load_model(model: str, dtype: str = "fp32", trust_remote_code: bool = False):
    """(model, processor) through the package's loader (its own model types never run folder code); without the
    package (e.g. a Space), the Hub code, only with ``trust_remote_code``."""
    try:
        from modeling_tagclip.retrieval.loading import load_model
    except ImportError:
        if not trust_remote_code:
            raise DemoInputError(_remote_code_message(model)) from None
        from transformers import AutoModel, AutoProcessor

        net = AutoModel.from_pretrained(model, trust_remote_code=True, dtype=TORCH_DTYPES[dtype]).eval()
        return net, AutoProcessor.from_pretrained(model, trust_remote_code=True)
    return load_model(model, "cpu", family="tagclip", trust_remote_code=trust_remote_code, dtype=dtype)


def _true_views(gallery: Path) -> dict[str, str]:
    """Ground-truth views of a TAG-PEDES-style gallery (``images/<split>/...`` next to ``<split>_reid.json``)."""
    views: dict[str, str] = {}
    for root in (gallery.parent, gallery.parent.parent):
        for annotation_file in sorted(root.glob("*_reid.json")):
            for record in json.loads(annotation_file.read_text()):
                if int(record.get("cam_id", -1)) in (0, 1):
                    path = (root / "images" / record["file_path"]).resolve()
                    views[str(path)] = VIEW_NAMES[int(record["cam_id"])]
    return views


def gallery_metadata(gallery: Path) -> Path | None:
    """The per-crop metadata (camera, time, view) of a synthetic-set gallery ``ROOT/images/SPLIT``:
    ``ROOT/metadata/SPLIT.csv`` when it exists."""
    sidecar = gallery.parent.parent / "metadata" / f"{gallery.name}.csv"
    return sidecar if gallery.parent.name == "images" and sidecar.is_file() else None


def _encode_folder(module, net, processor, gallery: Path):
    """The gallery folder encoded; with its metadata (``gallery_metadata``) into a temporary index folder, as
    ``tagclip index --metadata`` builds it, so the camera and view filters use it (removed at exit)."""
    sidecar = gallery_metadata(gallery)
    if sidecar is None or importlib.util.find_spec("modeling_tagclip") is None:
        return module.GalleryIndex.from_folder(net, processor, gallery, batch_size=32, progress=True)
    from modeling_tagclip.retrieval.index_build import build_index

    folder = Path(tempfile.mkdtemp(prefix="tagclip-demo-index-")) / "index"
    atexit.register(shutil.rmtree, folder.parent, True)
    print(f"indexing {gallery} with its metadata {sidecar} (camera, time and view filters)")
    return build_index(net, processor, gallery, folder, batch_size=32, metadata=sidecar)


def _missing_model_message(model: str) -> str:
    return (
        f"**No trained model at `{model}`.** The demo uses the model of the main job: run `{MAIN_JOB}` first "
        "(it generates the synthetic aerial-ground set, trains TAG-CLIP and saves it there), or start the demo "
        "with `--model DIR_OR_REPO` / `TAGCLIP_MODEL`."
    )


def _missing_gallery_message(gallery: str) -> str:
    return (
        f"**No gallery images at `{gallery}`.** The main job (`{MAIN_JOB}`) renders the synthetic test images "
        "there; or pass `--gallery DIR` / `TAGCLIP_GALLERY` (a folder of person crops) or `--index IDX`."
    )


def load_searcher(
    model: str,
    gallery: str | None,
    index: str | None = None,
    dtype: str = "fp32",
    trust_remote_code: bool = False,
    collection: str | None = None,
) -> Searcher | str:
    """The searcher, or a Markdown message explaining what is missing."""
    if dtype not in DTYPES:
        raise DemoInputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    is_repo_id = model.count("/") == 1 and not model.startswith((".", "/")) and not Path(model).exists()
    if not Path(model, "config.json").is_file() and not is_repo_id:
        return _missing_model_message(model)
    if index is None and (gallery is None or not Path(gallery).is_dir()):
        return _missing_gallery_message(str(gallery))
    module = _gallery_module(model, trust_remote_code)
    net, processor = _load_model(model, dtype, trust_remote_code)
    if index is not None and collection is not None:  # a Milvus URI (Lite file or server)
        from modeling_tagclip.retrieval.store import open_gallery

        encoded = open_gallery(index, collection)
        encoded.check_model(net)
    elif index is not None:
        encoded = module.GalleryIndex.load(index)
        encoded.check_model(net)
    else:
        encoded = _encode_folder(module, net, processor, Path(gallery))
    views = _true_views(Path(gallery).resolve()) if gallery else {}
    return Searcher(net, processor, encoded, module.encode_texts, views)


def _font(size: int = 12):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return ImageFont.load_default()


def _draw_patches(draw, box: tuple[int, int, int, int], why: dict[str, Any]) -> None:
    """Outline the TSE-selected patch cells on the crop placed at ``box`` (left, top, width, height)."""
    left, top, width, height = box
    rows, cols = why["grid"]
    for row, col in why["patches"]:
        x0, y0 = left + col * width / cols, top + row * height / rows
        x1, y1 = left + (col + 1) * width / cols - 1, top + (row + 1) * height / rows - 1
        draw.rectangle([x0, y0, x1, y1], outline=PATCH_COLOUR, width=2)


def _draw_view_bar(draw, width: int, hit: dict[str, Any], why: dict[str, Any] | None, font) -> None:
    """The top bar: the router's aerial (blue) / ground (orange) probability split, or the predicted view."""
    if why is None or why.get("aerial") is None:
        view = hit.get("view")
        draw.rectangle([0, 0, width, 16], fill=BADGE_COLOURS.get(view, BADGE_COLOURS[None]))
        label = f"{view.upper()} {hit['view_score']:.2f}" if view else "VIEW ?"
        draw.text((4, 2), label, fill="white", font=font)
        return
    split = round(width * why["aerial"])
    draw.rectangle([0, 0, split, 16], fill=BADGE_COLOURS["aerial"])
    draw.rectangle([split, 0, width, 16], fill=BADGE_COLOURS["ground"])
    draw.text((4, 2), f"A {why['aerial']:.2f} | G {why['ground']:.2f}", fill="white", font=font)


def badge(hit: dict[str, Any], why: dict[str, Any] | None = None, size: tuple[int, int] = (128, 256)):
    """The hit as the model sees it (squashed to its input shape) under a bar of the router's aerial / ground
    probability, with the TSE-selected patches outlined, and its rank and score below."""
    from PIL import Image, ImageDraw

    font = _font()
    with Image.open(hit["path"]) as img:
        person = img.convert("RGB").resize(size, Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (size[0], size[1] + 36), "white")
    canvas.paste(person, (0, 18))
    draw = ImageDraw.Draw(canvas)
    _draw_view_bar(draw, size[0], hit, why, font)
    if why is not None:
        _draw_patches(draw, (0, 18, *size), why)
    draw.text((4, size[1] + 20), f"#{hit['rank']}  score {hit['score']:.3f}", fill="black", font=font)
    return canvas


def caption(hit: dict[str, Any], true_view: str | None) -> str:
    view = f"{hit['view']} ({hit['view_score']:.2f})" if hit.get("view") else "view unknown"
    truth = f" · true view: {true_view}" if true_view else ""
    return f"#{hit['rank']} · score {hit['score']:.3f} · predicted {view}{truth} · {Path(hit['path']).name}"


def check_query(
    query: Any, top_k: Any, view: Any = "any", camera: Any = ""
) -> tuple[str, int, str | None, str | None]:
    """Validated (query, top_k, view or None, camera or None); DemoInputError names what is wrong."""
    if not isinstance(query, str):
        raise DemoInputError(f"the description must be text, got {type(query).__name__}")
    if len(query) > MAX_QUERY_CHARS:
        raise DemoInputError(f"the description has {len(query)} characters; the limit is {MAX_QUERY_CHARS}")
    if isinstance(top_k, float) and top_k.is_integer():
        top_k = int(top_k)  # the slider sends floats
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_RESULTS:
        raise DemoInputError(
            f"the number of results must be an integer from 1 to {MAX_RESULTS}, got {top_k!r}"
        )
    view = (view or "any").strip().lower() if isinstance(view, str) or view is None else view
    if view not in VIEW_CHOICES:
        raise DemoInputError(f"unknown view filter {view!r}; choose one of {', '.join(VIEW_CHOICES)}")
    if camera is not None and (isinstance(camera, bool) or not isinstance(camera, (str, int))):
        raise DemoInputError(f"the camera filter must be a camera id, got {type(camera).__name__}")
    camera = "" if camera is None else str(camera).strip()
    return query.strip(), top_k, None if view == "any" else view, camera or None


def run_query(
    searcher: Searcher | str, query: str, top_k: int, view: str = "any", camera: str = ""
) -> tuple[list, str]:
    """Gallery items ``(image, caption)`` and a status line for one query (DemoInputError for bad input)."""
    if isinstance(searcher, str):
        return [], searcher
    query, top_k, view, camera = check_query(query, top_k, view, camera)
    if not query:
        return [], "Type a description of the person first."
    hits = searcher.search(query, top_k, view, camera)
    whys = searcher.explain([h["path"] for h in hits]) if hits else []
    items = []
    for hit, why in zip(hits, whys, strict=True):
        truth = searcher.true_views.get(str(Path(hit["path"]).resolve()))
        items.append((badge(hit, why), caption(hit, truth)))
    views = [h["view"] for h in hits]
    summary = f"{views.count('aerial')} aerial, {views.count('ground')} ground"
    scope = "".join(f", {name} {value}" for name, value in (("view", view), ("camera", camera)) if value)
    status = f"Top {len(hits)} of {len(searcher.index)} gallery images{scope} for “{query}” ({summary})."
    return items, status


def build_demo(searcher: Searcher | str):
    """The Gradio Blocks app."""
    import gradio as gr

    ready = not isinstance(searcher, str)
    intro = (
        "# TAG-CLIP: text-based aerial-ground person retrieval\n"
        "Describe a person; the gallery mixes drone (**aerial**) and CCTV (**ground**) crops. Badges show the view "
        "the model's router predicts; scores are the paper's Eq. 14 similarity. Why each result: the patches TSE "
        "selected are outlined in magenta, and the top bar splits the router's aerial (A, blue) / ground (G, "
        "orange) probability."
    )
    with gr.Blocks(title="TAG-CLIP person search") as demo:
        gr.Markdown(intro)
        with gr.Row():
            query = gr.Textbox(label="Description", placeholder=EXAMPLES[0], elem_id="query", scale=4)
            top_k = gr.Slider(1, MAX_RESULTS, value=12, step=1, label="Results", elem_id="top_k", scale=1)
        with gr.Row():
            view = gr.Radio(list(VIEW_CHOICES), value="any", label="View", elem_id="view")
            camera = gr.Textbox(label="Camera (empty = any)", elem_id="camera", max_lines=1)
        button = gr.Button("Search", variant="primary", elem_id="search")
        status = gr.Markdown("Ready." if ready else searcher, elem_id="status")
        results = gr.Gallery(
            label="Ranked gallery", columns=6, height="auto", elem_id="results", object_fit="contain"
        )
        gr.Examples(EXAMPLES, inputs=query)
        inputs = [query, top_k, view, camera]
        button.click(lambda *args: _on_search(searcher, *args), inputs, [results, status])
        query.submit(lambda *args: _on_search(searcher, *args), inputs, [results, status])
    return demo


def _on_search(searcher: Searcher | str, *args: Any) -> tuple[list, str]:
    """``run_query`` for the page: bad input becomes a Gradio error message, not a traceback."""
    import gradio as gr

    try:
        return run_query(searcher, *args)
    except ValueError as error:
        raise gr.Error(str(error)) from error


def _resolve(path: str | None) -> str | None:
    """A relative default that is missing here but exists in the repository: the repository's one."""
    if path and not Path(path).exists() and (ROOT / path).exists():
        return str(ROOT / path)
    return path


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="TAG-CLIP person search demo (Gradio)")
    p.add_argument(
        "--model", default=os.environ.get("TAGCLIP_MODEL", DEFAULT_MODEL), help="model folder or repo id"
    )
    p.add_argument(
        "--gallery", default=os.environ.get("TAGCLIP_GALLERY", DEFAULT_GALLERY), help="image folder"
    )
    p.add_argument(
        "--index", default=os.environ.get("TAGCLIP_INDEX"), help="index directory from `tagclip index`"
    )
    p.add_argument(
        "--collection", default=os.environ.get("TAGCLIP_COLLECTION"),
        help="with --index URI: the Milvus collection (the index is then a Milvus URI: gallery.db or http://...)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", default=os.environ.get("TAGCLIP_DTYPE", "fp32"), choices=DTYPES, help="serving precision"
    )
    p.add_argument(
        "--trust_remote_code",
        "--trust-remote-code",
        action="store_true",
        default=os.environ.get("TAGCLIP_TRUST_REMOTE_CODE", "").lower() in ("1", "true", "yes"),
        help="run the model repository's code where this package is not installed (e.g. a Space)",
    )
    p.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Load the model and gallery (or explain what is missing) and serve the demo."""
    if importlib.util.find_spec("gradio") is None:  # before loading anything
        raise SystemExit(
            "The demo needs Gradio, the `demo` extra: pip install -e '.[demo]' (from a checkout) or "
            "pip install 'gradio>=5.0,<7'."
        )
    args = _parse_args(argv)
    model, gallery, index = (_resolve(p) for p in (args.model, args.gallery, args.index))
    try:
        searcher = load_searcher(model, gallery, index, args.dtype, args.trust_remote_code, args.collection)
    except ValueError as error:  # DemoInputError, or a model folder that does not load cleanly
        raise SystemExit(f"cannot start the demo: {error}") from error
    if isinstance(searcher, str):
        print(searcher.replace("**", "").replace("`", ""), file=sys.stderr)
    else:
        print(f"gallery: {len(searcher.index)} images; model: {model}", flush=True)
    build_demo(searcher).launch(
        server_name=args.host, server_port=args.port, ssr_mode=False, show_error=True, css=CSS
    )


if __name__ == "__main__":
    main()
