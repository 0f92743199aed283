"""Gradient caching (GradCache, Gao et al. 2021): the loss of a large contrastive batch computed in chunks.

1. every chunk is encoded without a graph into per-sample representations;
2. the loss is computed once on the whole batch of representations (leaves), and back-propagated to them and to
   the parameters used only there (heads, logit scale, TSE with its batch-coupled BatchNorm);
3. every chunk is encoded again with a graph, under the RNG state of its first pass, and back-propagates its
   slice of the cached gradients.

Loss and gradients equal one full-batch step; memory holds one chunk's activations plus the representations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

Batch = dict[str, Any]


class RngState:
    """The global torch RNG state (CPU and the current CUDA device): dropout and routing noise of one chunk."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


def check_per_sample(modules: list[torch.nn.Module]) -> None:
    """Chunks are encoded apart: a BatchNorm in an encoder would normalise per chunk. A clear error instead."""
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
                raise ValueError(
                    f"gradient caching needs per-sample encoders, but {type(module).__name__}.{name} is a "
                    "BatchNorm (its statistics would be per chunk)"
                )


def split_batch(batch: Batch, chunks: int) -> list[Batch]:
    """``chunks`` consecutive slices of every tensor of ``batch`` along dim 0 (sizes differ by at most one)."""
    sizes = {value.shape[0] for value in batch.values() if isinstance(value, torch.Tensor)}
    if len(sizes) != 1:
        raise ValueError(f"the batch tensors disagree on the batch size: {sorted(sizes)}")
    (size,) = sizes
    if not 1 <= chunks <= size:
        raise ValueError(
            f"cannot split a batch of {size} into {chunks} chunks (need 1 <= chunks <= batch size)"
        )
    parts: list[Batch] = [{} for _ in range(chunks)]
    for key, value in batch.items():
        pieces = value.tensor_split(chunks) if isinstance(value, torch.Tensor) else [value] * chunks
        for part, piece in zip(parts, pieces, strict=True):
            part[key] = piece
    return parts


def concat(chunks: list[Any]) -> Any:
    """Concatenate per-chunk representation trees (dicts / tuples of tensors; ``None`` holds no tensor)."""
    flat = [pytree.tree_flatten(tree) for tree in chunks]
    spec = flat[0][1]
    if any(other != spec for _, other in flat[1:]):
        raise ValueError("chunks returned representations of different structures")
    leaves = [
        None if parts[0] is None else torch.cat(parts) for parts in zip(*(f for f, _ in flat), strict=True)
    ]
    return pytree.tree_unflatten(leaves, spec)


def as_leaves(tree: Any) -> Any:
    """Detached copies of the tree's tensors; the floating-point ones require grad (step 2's inputs)."""

    def leaf(value):
        if not isinstance(value, torch.Tensor):
            return value
        return value.detach().requires_grad_(value.is_floating_point())

    return pytree.tree_map(leaf, tree)


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tree's tensors in a fixed order (two trees of one structure align)."""
    return [leaf for leaf in pytree.tree_flatten(tree)[0] if leaf is not None]


def cached_step(
    encode: Callable[[Batch], Any],
    loss_fn: Callable[[Any], tuple[torch.Tensor, Any]],
    batch: Batch,
    chunks: int,
    backward: Callable[[torch.Tensor], None],
) -> tuple[torch.Tensor, Any]:
    """One GradCache step: gradients accumulated in the parameters' ``.grad``; returns (detached loss, extra).

    ``encode(chunk)`` maps a chunk to a tree of per-sample tensors (dim 0 = the chunk's samples; it must not couple
    samples); ``loss_fn(tree)`` computes (loss, extra) on the concatenated tree; ``backward(loss)`` back-propagates
    the loss (e.g. ``accelerator.backward``, which scales it for fp16: the cached gradients carry that scale).
    """
    parts = split_batch(batch, chunks)
    states, encoded = [], []
    with torch.no_grad():
        for part in parts:
            states.append(RngState())
            encoded.append(encode(part))
    after = RngState()
    reps = as_leaves(concat(encoded))
    del encoded
    loss, extra = loss_fn(reps)
    backward(loss)
    grads = [leaf.grad for leaf in tensors(reps)]
    start = 0
    for part, state in zip(parts, states, strict=True):
        state.restore()
        outputs = tensors(encode(part))
        size = next(value.shape[0] for value in part.values() if isinstance(value, torch.Tensor))
        pairs = [
            (out, grad[start : start + size])
            for out, grad in zip(outputs, grads, strict=True)
            if grad is not None and out.requires_grad
        ]
        if pairs:
            torch.autograd.backward(*zip(*pairs, strict=True))
        start += size
    after.restore()
    return loss.detach(), extra


def average_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Average ``.grad`` over the ranks in bucketed all-reduces, as DDP would (a parameter no rank used keeps
    ``None``). The chunks and the loss run outside the DDP forward, so its reducer never fires: this is the
    step's only gradient sync, after the last chunk."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=params[0].device)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    synced = [p for p, flag in zip(params, used.tolist(), strict=True) if flag]
    for param in synced:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    for bucket in _buckets([p.grad for p in synced]):
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for grad, value in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(value)


def _buckets(grads: list[torch.Tensor], limit: int = 1 << 24) -> list[list[torch.Tensor]]:
    """Consecutive same-dtype groups of at most ``limit`` elements (or one larger tensor): bounded extra memory."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        if not buckets or size + grad.numel() > limit or grad.dtype != buckets[-1][0].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += grad.numel()
    return buckets
