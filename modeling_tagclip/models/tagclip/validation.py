"""Input checks both model families make, each failing with one clear error that names the problem (ViSA
carries a generated copy: ``python utils/fix_copies.py``). No host sync off the CPU: `check_on_device`."""

from collections.abc import Callable

import torch

from .device_ops import check_not_empty, check_on_device, check_pixel_dtype, non_finite_message
from .views import AERIAL, GROUND

__all__ = ["check_pixel_values", "check_view_labels"]


def check_pixel_values(
    pixel_values: torch.Tensor, expected: tuple[int, int, int], hint: Callable[[tuple[int, ...]], str]
) -> None:
    """A clear ValueError for raw (integer) pixels, an empty batch, a shape other than (batch, *`expected`)
    (channels, height, width; `hint(shape)` says how to fix it) or NaN/inf pixels."""
    check_pixel_dtype(pixel_values)
    check_not_empty(pixel_values, "pixel_values", "image")
    if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != tuple(expected):
        raise ValueError(
            f"pixel_values must have shape (batch, {expected[0]}, {expected[1]}, {expected[2]}) "
            f"(channels, height, width of the config), got {tuple(pixel_values.shape)}. "
            + hint(tuple(pixel_values.shape))
        )
    check_on_device(
        torch.isfinite(pixel_values),
        "pixel_values contain NaN or inf values",
        lambda: non_finite_message(pixel_values),
    )


def check_view_labels(view_labels: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """`view_labels` as a long tensor [batch]; a clear ValueError for a wrong count or a value other than
    0 (aerial) / 1 (ground)."""
    if view_labels is None:
        return None
    view_labels = torch.as_tensor(view_labels).reshape(-1)
    if view_labels.numel() != batch:
        raise ValueError(f"view_labels has {view_labels.numel()} entries for a batch of {batch} images.")
    check_on_device(
        (view_labels == AERIAL) | (view_labels == GROUND),
        "view_labels must be 0 (aerial) or 1 (ground)",
        lambda: f"view_labels must be 0 (aerial) or 1 (ground), got {view_labels.unique().tolist()}.",
    )
    return view_labels.long()
