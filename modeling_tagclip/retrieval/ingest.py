"""The pieces both gallery backends build with: ranks of a multi-process run, crops decoded in DataLoader
workers, a batch encoded on the model's device, a progress bar, and unreadable crops reported.

``index_build`` (the embedded index's resumable sharded build) and ``milvus_store`` (upserts by shard) call
them; neither reaches into the other.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from .encode import autocast, load_rgb, model_device, view_probabilities
from .encode import progress_bar as _progress_bar

__all__ = [
    "CropBatches",
    "Ranks",
    "encode_batch",
    "encode_crops",
    "progress_bar",
    "unreadable_message",
    "warn_unreadable",
]


class Ranks:
    """Rank and world size from ``torchrun`` / ``accelerate launch`` (gloo process group for barriers)."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


class CropBatches(torch.utils.data.Dataset):
    """Item = one batch (rows of ``files``) decoded and preprocessed, in the DataLoader's workers, and the rows
    whose file could not be decoded ({row: reason}; encoded as a black image, flagged removed at commit)."""

    def __init__(self, processor, files: Sequence[Path], batches: Sequence[range]):
        self.processor, self.files, self.batches = processor, files, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, b: int) -> tuple[torch.Tensor, dict[int, str]]:
        images, unreadable = [], {}
        for i in self.batches[b]:
            try:
                images.append(load_rgb(self.files[i]))
            except ValueError as error:  # load_rgb's error for undecodable, truncated or too large files
                images.append(Image.new("RGB", (1, 1)))
                unreadable[i] = str(error)
        return self.processor(images=images)["pixel_values"], unreadable


@torch.inference_mode()
def encode_batch(
    model, pixels: torch.Tensor, device: torch.device, dtype: str | None
) -> dict[str, torch.Tensor]:
    """One batch's rows on the host: on CUDA pinned buffers filled by non-blocking copies (wait on a CUDA event
    recorded after this call before reading them), so the copy-back does not stall the next forward."""
    with autocast(device, dtype):
        out = model.get_image_features(pixel_values=pixels.to(device, non_blocking=True))
    rows = {"global": torch.nn.functional.normalize(out.pooler_output.float(), dim=-1)}
    if out.local_embeds is not None:
        rows["local"] = torch.nn.functional.normalize(out.local_embeds.float(), dim=-1)
    probs = view_probabilities(out.view_logits)
    if probs is not None:
        rows["view_probs"] = probs
    if device.type != "cuda":
        return {key: value.cpu() for key, value in rows.items()}
    return {
        key: torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value, non_blocking=True)
        for key, value in rows.items()
    }


def progress_bar(total: int, enabled: bool):
    """``encode.progress_bar`` of the indexing phase, over ``total`` images."""
    return _progress_bar(total, enabled, "indexing", "image")


def encode_crops(
    model: Any,
    processor: Any,
    files: Sequence[Path],
    batch_size: int,
    progress: bool,
    *,
    dtype: str | None = None,
    num_workers: int = 0,
    device: str | torch.device | None = None,
) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """Embeddings of ``files`` as the embedded build computes them, and the rows that could not be decoded
    ({row: reason}; encoded as a black image, to be stored flagged removed)."""
    device = model_device(model, device)
    batches = [range(s, min(s + batch_size, len(files))) for s in range(0, len(files), batch_size)]
    loader = torch.utils.data.DataLoader(
        CropBatches(processor, files, batches),
        batch_size=None,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )
    parts, unreadable = [], {}
    with progress_bar(len(files), progress) as bar:
        for pixels, bad in loader:
            parts.append(encode_batch(model, pixels, device, dtype))
            unreadable.update(bad)
            bar.update(pixels.shape[0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # encode_batch's copies back to the host are non-blocking
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}, unreadable


def unreadable_message(paths: Sequence[str], unreadable: dict[int, str]) -> str:
    """The one line that reports crops that could not be decoded (``{row: reason}``), the first five named."""
    listed = "; ".join(f"{paths[i]}: {reason}" for i, reason in sorted(unreadable.items())[:5])
    return f"{len(unreadable)} unreadable image(s) skipped (kept as removed rows, never returned): {listed}"


def warn_unreadable(paths: Sequence[str], unreadable: dict[int, str]) -> None:
    """``unreadable_message`` as a warning (the CLI prints it as one warning line), when there are any."""
    if unreadable:
        warnings.warn(unreadable_message(paths, unreadable), stacklevel=3)
