"""TAG-CLIP web demo (Gradio, Space-ready): type a description, get the ranked gallery with view badges.

    python app.py [--model DIR_OR_REPO] [--gallery DIR | --index IDX] [--host 127.0.0.1] [--port 7860]

Defaults (also from the environment: TAGCLIP_MODEL, TAGCLIP_GALLERY, TAGCLIP_INDEX): the main job's model
``outputs/tagclip-synthetic/best`` and its synthetic test images ``data/synthetic/images/test``. Every result
shows its rank, the Eq. 14 score and the view the model's router predicts (blue AERIAL / orange GROUND badge);
when the gallery comes with TAG-PEDES-style annotations the true view is shown too. If the main job has not
been run the page says so and how to run it. Space requirements: ``requirements-space.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

ROOT = Path(__file__).resolve().parent
DEFAULT_MODEL = "outputs/tagclip-synthetic/best"
DEFAULT_GALLERY = "data/synthetic/images/test"
MAIN_JOB = "accelerate launch training/train.py"
try:
    from modeling_tagclip.tagclip.configuration_tagclip import VIEW_NAMES
except ImportError:  # a Space without the package
    VIEW_NAMES = ("aerial", "ground")
BADGE_COLOURS = {"aerial": (30, 110, 220), "ground": (225, 120, 20), None: (120, 120, 120)}
EXAMPLES = [
    "a woman with long black hair in a red jacket and blue jeans carrying a black backpack",
    "a man in a white t-shirt, black shorts and a cap",
    "a person in a green hoodie with a grey shoulder bag",
]


@dataclass
class Searcher:
    """A loaded model, its processor and the encoded gallery."""

    model: Any
    processor: Any
    index: Any
    encode_texts: Any
    true_views: dict[str, str] = field(default_factory=dict)

    def search(self, query: str, top_k: int) -> list[dict[str, Any]]:
        return self.index.search(self.encode_texts(self.model, self.processor, [query]), top_k)[0]


def _gallery_module(model_path: str):
    """``gallery_index`` from this checkout, else the copy shipped with the model (Hub custom code)."""
    try:
        from modeling_tagclip.retrieval import gallery_index

        return gallery_index
    except ImportError:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        cls = get_class_from_dynamic_module("gallery_index.GalleryIndex", model_path)
        return sys.modules[cls.__module__]


def _load_model(model: str):
    """(model, processor) through the package's loader; without the package (e.g. a Space), the Hub code."""
    try:
        from modeling_tagclip.retrieval.loading import load_model
    except ImportError:
        from transformers import AutoModel, AutoProcessor

        net = AutoModel.from_pretrained(model, trust_remote_code=True).eval()
        return net, AutoProcessor.from_pretrained(model, trust_remote_code=True)
    return load_model(model, "cpu", family="tagclip")


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


def load_searcher(model: str, gallery: str | None, index: str | None = None) -> Searcher | str:
    """The searcher, or a Markdown message explaining what is missing."""
    is_repo_id = model.count("/") == 1 and not model.startswith((".", "/")) and not Path(model).exists()
    if not Path(model, "config.json").is_file() and not is_repo_id:
        return _missing_model_message(model)
    if index is None and (gallery is None or not Path(gallery).is_dir()):
        return _missing_gallery_message(str(gallery))
    module = _gallery_module(model)
    net, processor = _load_model(model)
    if index is not None:
        encoded = module.GalleryIndex.load(index)
        encoded.check_model(net)
    else:
        encoded = module.GalleryIndex.from_folder(net, processor, gallery, batch_size=32, progress=True)
    views = _true_views(Path(gallery).resolve()) if gallery else {}
    return Searcher(net, processor, encoded, module.encode_texts, views)


def badge(hit: dict[str, Any], size: tuple[int, int] = (128, 256)):
    """The hit's image with a coloured view badge on top and its rank and score below."""
    from PIL import Image, ImageDraw, ImageFont, ImageOps

    try:
        font = ImageFont.load_default(size=12)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        font = ImageFont.load_default()
    with Image.open(hit["path"]) as img:
        person = ImageOps.contain(img.convert("RGB"), size)
    canvas = Image.new("RGB", (size[0], size[1] + 36), "white")
    canvas.paste(person, ((size[0] - person.width) // 2, 18))
    draw = ImageDraw.Draw(canvas)
    view = hit.get("view")
    draw.rectangle([0, 0, size[0], 16], fill=BADGE_COLOURS.get(view, BADGE_COLOURS[None]))
    label = f"{(view or 'view ?').upper()} {hit['view_score']:.2f}" if view else "VIEW ?"
    draw.text((4, 2), label, fill="white", font=font)
    draw.text((4, size[1] + 20), f"#{hit['rank']}  score {hit['score']:.3f}", fill="black", font=font)
    return canvas


def caption(hit: dict[str, Any], true_view: str | None) -> str:
    view = f"{hit['view']} ({hit['view_score']:.2f})" if hit.get("view") else "view unknown"
    truth = f" · true view: {true_view}" if true_view else ""
    return f"#{hit['rank']} · score {hit['score']:.3f} · predicted {view}{truth} · {Path(hit['path']).name}"


def run_query(searcher: Searcher | str, query: str, top_k: int) -> tuple[list, str]:
    """Gallery items ``(image, caption)`` and a status line for one query."""
    if isinstance(searcher, str):
        return [], searcher
    query = (query or "").strip()
    if not query:
        return [], "Type a description of the person first."
    hits = searcher.search(query, int(top_k))
    items = []
    for hit in hits:
        truth = searcher.true_views.get(str(Path(hit["path"]).resolve()))
        items.append((badge(hit), caption(hit, truth)))
    views = [h["view"] for h in hits]
    summary = f"{views.count('aerial')} aerial, {views.count('ground')} ground"
    status = f"Top {len(hits)} of {len(searcher.index)} gallery images for “{query}” ({summary})."
    return items, status


def build_demo(searcher: Searcher | str):
    """The Gradio Blocks app."""
    import gradio as gr

    ready = not isinstance(searcher, str)
    intro = (
        "# TAG-CLIP: text-based aerial-ground person retrieval\n"
        "Describe a person; the gallery mixes drone (**aerial**) and CCTV (**ground**) crops. Badges show the view "
        "the model's router predicts; scores are the paper's Eq. 14 similarity."
    )
    with gr.Blocks(title="TAG-CLIP person search") as demo:
        gr.Markdown(intro)
        with gr.Row():
            query = gr.Textbox(label="Description", placeholder=EXAMPLES[0], elem_id="query", scale=4)
            top_k = gr.Slider(1, 50, value=12, step=1, label="Results", elem_id="top_k", scale=1)
        button = gr.Button("Search", variant="primary", elem_id="search")
        status = gr.Markdown("Ready." if ready else searcher, elem_id="status")
        results = gr.Gallery(
            label="Ranked gallery", columns=6, height="auto", elem_id="results", object_fit="contain"
        )
        gr.Examples(EXAMPLES, inputs=query)
        button.click(lambda q, k: run_query(searcher, q, k), [query, top_k], [results, status])
        query.submit(lambda q, k: run_query(searcher, q, k), [query, top_k], [results, status])
    return demo


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
    p.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Load the model and gallery (or explain what is missing) and serve the demo."""
    args = _parse_args(argv)
    model, gallery, index = (_resolve(p) for p in (args.model, args.gallery, args.index))
    searcher = load_searcher(model, gallery, index)
    if isinstance(searcher, str):
        print(searcher.replace("**", "").replace("`", ""), file=sys.stderr)
    else:
        print(f"gallery: {len(searcher.index)} images; model: {model}", flush=True)
    build_demo(searcher).launch(server_name=args.host, server_port=args.port, ssr_mode=False, show_error=True)


if __name__ == "__main__":
    main()
