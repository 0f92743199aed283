"""The shared part of the bad-input suite (``test_bad_input_*.py``, one file per area of the package): the
context its cases run in, the helpers that call each entry point, and the check every case makes."""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures import REAL_TEXT, make_visa_model, save_tiny_model, synthetic_gallery, tiny_config
from PIL import Image
from safetensors.torch import load_file, save_file

from modeling_tagclip import TagClipModel, TagClipProcessor


def _bomb(c: dict[str, Any]) -> Path:
    bomb = c["root"] / "bomb.png"
    Image.new("1", (20000, 20000)).save(bomb)  # 400 Mpx in a few KB
    return bomb


def _searcher(c: dict[str, Any]):
    import app

    return app.load_searcher(str(c["model_dir"]), str(c["images"]))


def _handler(c: dict[str, Any]):
    from handler import EndpointHandler

    return EndpointHandler(str(c["model_dir"]))


PARTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "model_dir": lambda c: save_tiny_model(c["root"] / "model"),
    "model": lambda c: TagClipModel.from_pretrained(c["model_dir"]).eval(),
    "processor": lambda c: TagClipProcessor.from_pretrained(c["model_dir"]),
    "data": lambda c: synthetic_gallery(c["root"] / "data"),
    "images": lambda c: c["data"] / "images" / "test",
    "bomb": _bomb,
    "handler": _handler,
    "searcher": _searcher,
}


class Context(dict):
    """What the cases run against, each part built on first use: a saved tiny model, its in-memory copy, a
    synthetic TAG-PEDES set, an endpoint handler and a demo."""

    def __init__(self, root: Path):
        super().__init__(root=root)
        (root / "not_an_image.png").write_text("hello")

    def __missing__(self, key: str) -> Any:
        self[key] = value = PARTS[key](self)
        return value


def b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def tampered(c, name: str, edit_state=None, edit_config=None) -> Path:
    """A copy of the saved model with its weights and/or config edited."""
    out = c["root"] / f"tampered-{name}"
    if not out.exists():
        out.mkdir()
        config = json.loads((c["model_dir"] / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
        state = load_file(c["model_dir"] / "model.safetensors")
        save_file(
            edit_state(state) if edit_state else state, out / "model.safetensors", metadata={"format": "pt"}
        )
    return out


def replaced(state: dict, key: str, fn) -> dict:
    return {k: fn(v) if k == key else v for k, v in state.items()}


def anno_folder(c, name: str, text: str) -> Path:
    """An annotation folder holding ``train_reid.json`` with ``text``."""
    folder = c["root"] / f"anno-{name}"
    folder.mkdir(exist_ok=True)
    (folder / "train_reid.json").write_text(text)
    return folder


def entry_json(**fields) -> str:
    return json.dumps([{"id": 1, "file_path": "1/a.png", "captions": ["a man in red"], **fields}])


def load_tagpedes_folder(folder: Path, **kwargs):
    from modeling_tagclip.data.text_retrieval import load_tagpedes

    return load_tagpedes(folder, folder, "train", check_files=False, **kwargs)


def corrupt_model(c) -> Path:
    folder = c["root"] / "corrupt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text((c["model_dir"] / "config.json").read_text())
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    return folder


def tagclip_cli(*argv: str):
    """``tagclip`` CLI; a non-zero exit status (an error printed on stderr) becomes SystemExit."""
    from modeling_tagclip.retrieval.cli import main

    status = main(list(argv))
    if status:
        raise SystemExit(status)


def index_cli(c, *args: str):
    return tagclip_cli("index", "--model", str(c["model_dir"]), "--images", str(c["images"]), *args)


def search_cli(c, *args: str):
    return tagclip_cli("search", *args)


def convert_cli(*args: str):
    from modeling_tagclip.convert.tagclip import main

    return main(list(args))


def convert_visa_cli(*args: str):
    from modeling_tagclip.convert.visa import main

    return main(list(args))


def train_cli(c, *args: str):
    from training.train import main

    return main([*args, "--output_dir", str(c["root"] / "train-out")])


def evaluate_cli(*args: str):
    from modeling_tagclip.evaluation.text_retrieval import main

    return main(list(args))


def dtg_cli(*args: str):
    from modeling_tagclip.dtg.cli import main

    return main(list(args))


def run_pipeline(c, text, **kwargs):
    from transformers import pipeline

    from modeling_tagclip.retrieval.pipeline_tagclip import TASK

    return pipeline(TASK, model=c["model"], processor=c["processor"])(text, **kwargs)


def text_file(c, name: str, content: str) -> str:
    path = c["root"] / name
    path.write_text(content)
    return str(path)


def token_ids(*ids: int) -> torch.Tensor:
    return torch.tensor([list(ids)])


def raw_pixels(batch: int = 2) -> torch.Tensor:
    """uint8 images as a decoder gives them (0-255), not the processor's normalised floats."""
    return torch.randint(0, 256, (batch, 3, 32, 16), dtype=torch.uint8)


def label_routed_model() -> TagClipModel:
    """The tiny model with ``routing="label"``: its HR-MoE routes by the given view_labels."""
    torch.manual_seed(0)
    return TagClipModel(tiny_config(text=REAL_TEXT, vision=dict(routing="label"))).eval()


def tiny_visa():
    return make_visa_model()


Case = tuple[str, Callable[[dict], Any], type[BaseException], str]


def case_id(case) -> str:
    values = case.values if hasattr(case, "values") else case
    return f"{values[0]}: {values[3][:40]}"


def check(
    context: dict[str, Any], capsys, entry: str, call, error: type[BaseException], message: str
) -> None:
    """``call(context)`` raises ``error`` whose message (stderr for a command's exit) matches ``message``."""
    with pytest.raises(error) as info:
        call(context)
    text = str(info.value)
    if isinstance(info.value, SystemExit):  # argparse / a CLI's parser.error: the message is on stderr
        text = capsys.readouterr().err
    assert re.search(message, text), f"{entry}: message does not name the problem: {text[-600:]}"


def check_table(cases: list[Any], entries: set[str], minimum: int) -> None:
    """An area's table holds at least ``minimum`` cases and every one of its entry points."""
    assert len(cases) >= minimum
    assert entries <= {(c.values if hasattr(c, "values") else c)[0] for c in cases}
