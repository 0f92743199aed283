"""Ops that keep the expert dispatch on the device: a grouped GEMM (`torch._grouped_mm` wrapped as a
`torch.library` op so that `torch.compile` traces it) and `grouped_linear`, a Linear per group of rows.

The ViSA unit carries a generated copy (``utils/fix_copies.py``).
"""

from collections.abc import Callable, Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "check_on_device",
    "check_pixel_dtype",
    "non_finite_message",
    "grouped_gemm_syncs",
    "grouped_linear",
    "on_host",
    "stacked_weights",
]


def _grouped_mm_loop(inputs: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm` semantics as one matmul per group (reads `offsets` on the host: a sync on GPUs)."""
    bounds = [0] + offsets.tolist()
    if weight.ndim == 3:  # [P, in] x [G, in, out] -> [P, out]
        parts = [inputs[a:b] @ weight[g] for g, (a, b) in enumerate(pairwise(bounds))]
        return torch.cat(parts) if parts else inputs.new_zeros(0, weight.shape[-1])
    # [in, P] x [P, out] -> [G, in, out]
    return torch.stack([inputs[:, a:b] @ weight[a:b] for a, b in pairwise(bounds)])


def _grouped_mm_eager(inputs: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm` where it runs without a host sync (CPU, bf16 on GPU) and the strides are 16-byte
    aligned (widths multiple of 4 in fp32, 8 in bf16), else the per-group loop."""
    aligned = all(
        stride * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0
        for t in (inputs, weight)
        for stride in t.stride()
        if stride != 1
    )
    native = inputs.device.type == "cpu" or inputs.dtype == torch.bfloat16
    if hasattr(torch, "_grouped_mm") and native and aligned:
        return torch._grouped_mm(inputs, weight, offs=offsets)
    return _grouped_mm_loop(inputs, weight, offsets)


def _define_grouped_mm_op(namespace: str) -> Callable:
    """A `torch.library` grouped GEMM op with a shape-only fake and a backward, defined once per process.

    `torch._grouped_mm` has no fp32 meta kernel, so it cannot be traced by `torch.compile`; wrapped as a custom
    op it compiles into one graph (`fullgraph=True`) at the exact FLOPs of the routed pairs.
    """
    name = f"{namespace}::grouped_mm"
    existing = (
        getattr(getattr(torch.ops, namespace), "grouped_mm", None) if hasattr(torch.ops, namespace) else None
    )
    if existing is not None:
        return existing

    @torch.library.custom_op(name, mutates_args=())
    def grouped_mm(inputs: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return _grouped_mm_eager(inputs, weight, offsets)

    @grouped_mm.register_fake
    def _(inputs, weight, offsets):
        if weight.ndim == 3:
            return inputs.new_empty(inputs.shape[0], weight.shape[-1])
        return inputs.new_empty(offsets.shape[0], inputs.shape[0], weight.shape[-1])

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, grad):
        inputs, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_inputs = grouped_mm(grad, weight.transpose(-1, -2), offsets)
        grad_weight = grouped_mm(inputs.t(), grad, offsets)
        return grad_inputs, grad_weight, None

    grouped_mm.register_autograd(backward, setup_context=setup_context)
    return grouped_mm


_GROUPED_MM = _define_grouped_mm_op("tagclip")  # one op for both units


def grouped_gemm_syncs(inputs: torch.Tensor, widths: Sequence[int]) -> bool:
    """Whether `grouped_linear` would read its offsets on the host here: off the CPU, `torch._grouped_mm` is
    native only in bf16 with every width a multiple of 8 (else `_grouped_mm_loop`, one matmul per expert after
    a device-to-host copy). Callers then run every expert densely instead: no sync, more FLOPs."""
    device = inputs.device.type
    if device == "cpu":
        return False
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else inputs.dtype
    return dtype != torch.bfloat16 or any(width % 8 for width in widths)


def on_host(tensor: torch.Tensor) -> bool:
    """Whether Python may read `tensor`'s values without a device sync: on the CPU, outside `torch.compile`."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def check_on_device(ok: torch.Tensor, message: str, detail: Callable[[], str] | None = None) -> None:
    """Raise ValueError unless every element of the bool tensor `ok` is true, never syncing: read directly on
    the host (the error is `detail()` when given, else `message`), checked by a device-side assert with
    `message` elsewhere (`torch._assert_async`); skipped under `torch.compile`. Data that enters through the
    processor, collator, CLI or handler is validated there."""
    if torch.compiler.is_compiling():
        return
    if not on_host(ok):
        torch._assert_async(ok.all(), message)
    elif not bool(ok.all()):
        raise ValueError(detail() if detail is not None else message)


def check_pixel_dtype(pixel_values: torch.Tensor) -> None:
    """Raise ValueError for raw pixels (an integer or bool batch, e.g. uint8 0-255): the model takes the
    processor's normalised floats. A dtype check reads no values: no host sync."""
    if not pixel_values.is_floating_point():
        raise ValueError(
            f"pixel_values are {str(pixel_values.dtype).removeprefix('torch.')}, not floating point: they look like "
            "raw pixels. Run the image processor first (it resizes and normalises them)."
        )


def check_not_empty(values: torch.Tensor, name: str, what: str) -> None:
    """Raise ValueError for an empty batch (0 images or texts): nothing to encode. Reads the shape only."""
    if values.ndim > 0 and values.shape[0] == 0:
        raise ValueError(f"{name} is an empty batch (shape {tuple(values.shape)}): give at least one {what}")


def non_finite_message(pixel_values: torch.Tensor) -> str:
    """The error for a batch with NaN/inf pixels, naming the first images that hold them (host-side only)."""
    bad = (~torch.isfinite(pixel_values)).flatten(1).any(1).nonzero().flatten().tolist()
    return f"pixel_values contain NaN or inf values (images {bad[:10]} of the batch)"


def _stack(layers: list[nn.Linear], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.stack([layer.weight.t() for layer in layers]).to(dtype)  # [E, in, out], contiguous
    bias = None if layers[0].bias is None else torch.stack([layer.bias for layer in layers]).to(dtype)
    return weight, bias


def stacked_weights(layers: list[nn.Linear], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights [E, in, out] and biases [E, out] of `layers` stacked in `dtype`, cached on the first layer
    until a weight or bias changes (storage or version: an optimizer step, `load_state_dict`), in eval and in
    training alike: one stack per optimizer step, not one per call (chunk, layer call, accumulation micro-batch).

    With autograd on, the cached stack carries its graph (`stack` and the dtype cast save no tensors, so every
    backward through it reaches each expert's weight); a stack made without autograd is never handed to a
    call that records one, nor the reverse. Under `torch.compile` the stack is traced into the graph. The
    state dict keeps one Linear per expert."""
    if torch.compiler.is_compiling():
        return _stack(layers, dtype)
    grad = torch.is_grad_enabled() and any(layer.weight.requires_grad for layer in layers)
    params = [p for layer in layers for p in (layer.weight, layer.bias) if p is not None]
    key = (dtype, grad, *((p.data_ptr(), p._version) for p in params))
    cached = layers[0].__dict__.get("_stacked_weights")
    if cached is None or cached[0] != key:
        cached = layers[0].__dict__["_stacked_weights"] = (key, _stack(layers, dtype))
    return cached[1]


def grouped_linear(
    inputs: torch.Tensor, layers: list[nn.Linear], experts: torch.Tensor, offsets: torch.Tensor
):
    """y_p = x_p W_e(p)^T + b_e(p) for rows sorted by expert e(p), group g ending at `offsets[g]` (grouped GEMM).

    Under autocast the GEMM runs in the autocast dtype, as `nn.Linear` would; the stacked weights come from
    `stacked_weights`. On the host (`on_host`), each expert runs `F.linear` on its slice instead (fused bias,
    no stacked copy: faster there).
    """
    if on_host(inputs):
        bounds = [0, *offsets.tolist()]
        pairs = zip(layers, pairwise(bounds), strict=True)
        return torch.cat([F.linear(inputs[a:b], layer.weight, layer.bias) for layer, (a, b) in pairs])
    if torch.is_autocast_enabled(inputs.device.type):
        inputs = inputs.to(torch.get_autocast_dtype(inputs.device.type))
    weight, bias = stacked_weights(layers, inputs.dtype)
    output = _GROUPED_MM(inputs.contiguous(), weight, offsets)
    return output if bias is None else output + bias[experts]
