"""ONNX export of the inference graphs, each with a dynamic batch dimension.

- TAG-CLIP: `image.onnx` (pixel_values -> global embedding v_cls, TSE embedding v_tse, image-level router
  logits of every HR-MoE block, the TSE token indices) and `text.onnx` (input_ids -> t_eos, t_tse, indices),
  all unnormalised as `get_image_features` / `get_text_features` return them.
- ViSA: `visa.onnx` (pixel_values [, view_labels] -> the test embedding).

The HR-MoE runs its dense dispatch in the graph (the same output as the sparse one: unused experts get weight 0;
the grouped GEMM op has no ONNX form). Deterministic routing only: `routing="argmax"`; the training-only modes
(`gumbel`, `soft`) and `label` (needs view labels the image graph does not take) raise `ExportError`.

    tagclip export onnx --model MODEL_DIR --output OUT_DIR [--opset 18]   (the command: modeling_tagclip/cli/export.py)
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .atomic_io import atomic_write, output_folder
from .models.tagclip.modeling_tagclip import TagClipModel
from .models.visa.modeling_visa import ViSAForReID, ViSAModel

__all__ = ["ExportError", "export_onnx"]

EXPORTABLE_ROUTING = ("argmax",)


class ExportError(ValueError):
    """A model (or a setting of it) that has no ONNX form."""


class TagClipImageGraph(nn.Module):
    """pixel_values -> (image_embeds, image_local_embeds, view_logits [B, blocks, 2], tse_indices)."""

    def __init__(self, model: TagClipModel):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model.get_image_features(pixel_values)
        outputs = [out.pooler_output]
        if out.local_embeds is not None:
            outputs.append(out.local_embeds)
        if out.view_logits:
            outputs.append(torch.stack(out.view_logits, dim=1))
        if out.tse_indices is not None:
            outputs.append(out.tse_indices)
        return tuple(outputs)


class TagClipTextGraph(nn.Module):
    """input_ids -> (text_embeds, text_local_embeds, tse_indices)."""

    def __init__(self, model: TagClipModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model.get_text_features(input_ids)
        if out.local_embeds is None:
            return (out.pooler_output,)
        return out.pooler_output, out.local_embeds, out.tse_indices


class ViSAGraph(nn.Module):
    """pixel_values [, view_labels] -> the test embedding (ViSAModel's `pooler_output`)."""

    def __init__(self, model: ViSAModel):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor, view_labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(pixel_values, view_labels=view_labels).pooler_output


def tagclip_output_names(model: TagClipModel) -> tuple[list[str], list[str]]:
    """Output names of the image and text graphs (the TSE and router outputs exist only when the model has them)."""
    tse = model.config.use_tse
    image = ["image_embeds"] + (["image_local_embeds"] if tse else [])
    vision = model.config.vision_config
    if vision.block_type == "hrmoe" and vision.active_moe_layers:
        image.append("view_logits")
    image += ["image_tse_indices"] if tse else []
    text = ["text_embeds"] + (["text_local_embeds", "text_tse_indices"] if tse else [])
    return image, text


def check_exportable(model: TagClipModel) -> None:
    """Refuse, with the reason, what the graphs cannot hold."""
    routing = model.config.vision_config.routing
    if model.config.vision_config.block_type == "hrmoe" and routing not in EXPORTABLE_ROUTING:
        why = "needs the view labels as an input" if routing == "label" else "is a training-only routing mode"
        raise ExportError(
            f"routing={routing!r} cannot be exported: it {why}. Export with deterministic routing: set "
            "model.config.vision_config.routing = 'argmax' (the reference's inference routing) first."
        )


def inference_copy(model: nn.Module) -> nn.Module:
    """An eval-mode fp32 copy with SDPA attention (and dense MoE dispatch for TAG-CLIP); the caller's model is
    left as it was."""
    model = copy.deepcopy(model).float().eval()
    model.set_attn_implementation("sdpa")
    if isinstance(model, TagClipModel):
        model.config.vision_config.moe_dispatch = "dense"
        for module in model.modules():
            if hasattr(module, "config") and hasattr(module.config, "moe_dispatch"):
                module.config.moe_dispatch = "dense"
    return model


def _export(
    graph: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str], opset: int
) -> None:
    batch = torch.export.Dim("batch", min=1, max=4096)
    dynamic = {name: {0: batch} for name in inputs}
    program = torch.onnx.export(
        graph.eval(),
        args,
        dynamo=True,
        input_names=inputs,
        output_names=outputs,
        dynamic_shapes=dynamic,
        opset_version=opset,
        verbose=False,
    )
    program.save(str(path))


def export_tagclip(model: TagClipModel, out_dir: Path, opset: int) -> dict[str, Any]:
    check_exportable(model)
    model = inference_copy(model)
    vision, text = model.config.vision_config, model.config.text_config
    pixels = torch.randn(2, vision.num_channels, *vision.image_hw)
    ids = torch.zeros(2, text.max_position_embeddings, dtype=torch.long)
    ids[:, 0], ids[:, 1], ids[:, 2] = text.bos_token_id, 1, text.eos_token_id
    image_out, text_out = tagclip_output_names(model)
    _export(TagClipImageGraph(model), (pixels,), out_dir / "image.onnx", ["pixel_values"], image_out, opset)
    _export(TagClipTextGraph(model), (ids,), out_dir / "text.onnx", ["input_ids"], text_out, opset)
    return {
        "image.onnx": {"inputs": ["pixel_values"], "outputs": image_out, "image_size": list(vision.image_hw)},
        "text.onnx": {
            "inputs": ["input_ids"],
            "outputs": text_out,
            "context_length": text.max_position_embeddings,
        },
    }


def export_visa(model: ViSAModel, out_dir: Path, opset: int) -> dict[str, Any]:
    model = inference_copy(model)
    config = model.config
    pixels = torch.randn(2, config.num_channels, *config.image_size)
    inputs, args = ["pixel_values"], (pixels,)
    if model.needs_view_labels:
        inputs, args = ["pixel_values", "view_labels"], (pixels, torch.tensor([0, 1]))
    _export(ViSAGraph(model), args, out_dir / "visa.onnx", inputs, ["embeddings"], opset)
    return {"visa.onnx": {"inputs": inputs, "outputs": ["embeddings"], "image_size": list(config.image_size)}}


def export_onnx(model: nn.Module, out_dir: str | Path, opset: int = 18) -> dict[str, Any]:
    """Export `model` (a `TagClipModel`, `ViSAModel` or `ViSAForReID`) to ONNX files in `out_dir`.

    Writes the graphs and `onnx_export.json` (file -> input and output names); returns that manifest.
    """
    if isinstance(model, ViSAForReID):
        model = model.visa
    if not isinstance(model, (TagClipModel, ViSAModel)):
        raise ExportError(f"cannot export a {type(model).__name__}: expected a TagClipModel or a ViSA model")
    out = output_folder(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".onnx-export-", dir=out))
    try:  # every graph is written first; a failure (a full disk) leaves the folder as it was
        graphs = (export_tagclip if isinstance(model, TagClipModel) else export_visa)(model, staging, opset)
        for name in graphs:
            os.replace(staging / name, out / name)
    except OSError as error:  # name the folder the user gave, not the staging file
        if not error.strerror:
            raise
        raise OSError(
            error.errno, f"{error.strerror} while exporting; nothing was changed there", str(out)
        ) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    manifest = {"opset": opset, "dynamic_axes": {"batch": 0}, "graphs": graphs}
    atomic_write(out / "onnx_export.json", (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """Silence what does not concern the user of the command: the exporter's "torchvision is not installed"
    notes, pytree FutureWarnings, onnx_ir's empty-attribute default and the weight-loading progress bar."""
    from transformers.utils import logging as hf_logging

    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnx_ir", "onnxscript")]
    levels = [logger.level for logger in loggers]
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        if bar:
            hf_logging.enable_progress_bar()
