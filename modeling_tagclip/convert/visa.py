"""Convert official ViSA checkpoints (`model_best.pth`, docs/visa-reference.md §7) and timm ImageNet ViT
weights to this implementation, and back.

The checkpoint is read with ``safe_torch_load`` (a restricted unpickler: no code runs). Key mapping:

- ``backbone.base.blocks.{i}`` (i < L-1) -> ``visa.encoder.layers.{i}``; ``backbone.b1.0`` (the executed
  block-12 copy) -> ``visa.encoder.layers.{L-1}``; ``backbone.b1.1`` -> ``visa.final_layer_norm``;
  fused ``attn.qkv`` rows [q; k; v] are split into ``q_proj`` / ``k_proj`` / ``v_proj``;
- ``backbone.{share,sky,ground}_experts.{e}.prm.*`` / ``_router.gate`` -> ``visa.etgm.{shared,aerial,ground}``;
- ``backbone.share_gcn.gcn_weights`` (used as x @ W) -> ``visa.dlfm.shared_gcn.weight`` = W^T;
- ``backbone.final_attn_token_to_image`` + ``out_token`` -> ``visa.fusion``;
- ``heads`` / ``local_heads`` / ``view_heads`` -> classifiers and BNNecks (running stats and
  ``num_batches_tracked`` kept).

Never-executed reference tensors (``base.blocks.{L-1}``, ``base.norm``, ``view_gcn`` unless
``dlfm_gcn="per_branch"``, ``image_pe``) are dropped and listed in the report.

Usage: ``tagclip convert visa --checkpoint model_best.pth --output converted/visa-cargo``.
"""

import argparse
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from modeling_tagclip.convert.arguments import parse_visa_args

from ..models.tagclip.modeling_tagclip import interpolate_grid_embeddings
from ..models.visa.configuration_visa import ViSAConfig
from ..models.visa.image_processing_visa import build_visa_image_processor
from ..models.visa.modeling_visa import ViSAForReID, ViSAModel
from .safe_pickle import safe_torch_load

__all__ = [
    "convert_checkpoint",
    "convert_state_dict",
    "infer_config",
    "load_imagenet_vit",
    "load_official_state_dict",
    "to_official_state_dict",
]

SETS = {"share": "shared", "sky": "aerial", "ground": "ground"}
HEADS = {
    "heads": ("classifier", "visa.global_bnneck"),
    "local_heads": ("local_classifier", "visa.local_bnneck"),
    "view_heads": ("view_classifier", "view_bnneck"),
}
BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
# stride per patch count at 256x128 (docs/visa-reference.md §1.2): the only geometry fact a state dict
# does not store
STRIDES = {210: [12, 12], 252: [12, 10], 128: [16, 16]}


def _split_qkv(prefix: str, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Fused [q; k; v] rows -> HF-style q_proj / k_proj / v_proj."""
    out = {}
    for name, w in zip(("q_proj", "k_proj", "v_proj"), weight.chunk(3, dim=0), strict=True):
        out[f"{prefix}.{name}.weight"] = w.clone()
    if bias is not None:
        for name, b in zip(("q_proj", "k_proj", "v_proj"), bias.chunk(3, dim=0), strict=True):
            out[f"{prefix}.{name}.bias"] = b.clone()
    return out


def _copy(out: dict, source: dict, used: set, src: str, dst: str) -> None:
    """out[dst.weight] = source[src.weight] (required) and the bias if present."""
    out[f"{dst}.weight"] = source[f"{src}.weight"].clone()
    used.add(f"{src}.weight")
    if f"{src}.bias" in source:
        out[f"{dst}.bias"] = source[f"{src}.bias"].clone()
        used.add(f"{src}.bias")


def _block(out: dict, sd: dict, used: set, src: str, dst: str, qkv_bias: bool = True) -> None:
    """A timm-style block (norm1/attn.qkv/attn.proj/norm2/mlp) or post-norm tail -> our names."""
    bias = sd.get(f"{src}.attn.qkv.bias") if qkv_bias else None
    out.update(_split_qkv(f"{dst}.self_attn", sd[f"{src}.attn.qkv.weight"], bias))
    used.update({f"{src}.attn.qkv.weight"} | ({f"{src}.attn.qkv.bias"} if bias is not None else set()))
    _copy(out, sd, used, f"{src}.attn.proj", f"{dst}.self_attn.out_proj")
    for name in ("fc1", "fc2"):
        _copy(out, sd, used, f"{src}.mlp.{name}", f"{dst}.mlp.{name}")


def _trunk(out: dict, sd: dict, used: set, config: ViSAConfig) -> None:
    last = config.num_hidden_layers - 1
    base = "backbone.base"
    out["visa.embeddings.cls_token"] = sd[f"{base}.cls_token"].clone()
    out["visa.embeddings.position_embedding"] = sd[f"{base}.pos_embed"].clone()
    used.update({f"{base}.cls_token", f"{base}.pos_embed"})
    tokens = {
        "view_token_sky": "view_token_aerial",
        "view_token_ground": "view_token_ground",
        "view_token": "view_token",
    }
    for src, dst in tokens.items():
        if f"{base}.{src}" in sd:
            out[f"visa.embeddings.{dst}"] = sd[f"{base}.{src}"].clone()
            used.add(f"{base}.{src}")
    _copy(out, sd, used, f"{base}.patch_embed.proj", "visa.embeddings.patch_embedding")
    for index in range(config.num_hidden_layers):
        src = f"{base}.blocks.{index}" if index < last else "backbone.b1.0"
        dst = f"visa.encoder.layers.{index}"
        _block(out, sd, used, src, dst)
        _copy(out, sd, used, f"{src}.norm1", f"{dst}.layer_norm1")
        _copy(out, sd, used, f"{src}.norm2", f"{dst}.layer_norm2")
    _copy(out, sd, used, "backbone.b1.1", "visa.final_layer_norm")


def _experts(out: dict, sd: dict, used: set, config: ViSAConfig) -> None:
    for src_set, dst_set in SETS.items():
        if f"backbone.{src_set}_router.gate.weight" not in sd:
            continue
        _copy(out, sd, used, f"backbone.{src_set}_router.gate", f"visa.etgm.{dst_set}.router")
        for e in range(config.num_experts):
            src, dst = f"backbone.{src_set}_experts.{e}", f"visa.etgm.{dst_set}.experts.{e}"
            out[f"{dst}.prompt"] = sd[f"{src}.prompt"].clone()
            used.add(f"{src}.prompt")
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                _copy(out, sd, used, f"{src}.prm.cross_attn.{proj}", f"{dst}.cross_attn.{proj}")
            for norm in ("norm1", "norm2", "norm3"):
                _copy(out, sd, used, f"{src}.prm.{norm}", f"{dst}.{norm}")
            _block(out, sd, used, f"{src}.prm", dst, qkv_bias=False)


def _local(out: dict, sd: dict, used: set, config: ViSAConfig) -> None:
    if config.use_dlfm:
        gcns = {"share_gcn": "shared_gcn"} | (
            {"view_gcn": "view_gcn"} if config.dlfm_gcn == "per_branch" else {}
        )
        for src, dst in gcns.items():
            out[f"visa.dlfm.{dst}.weight"] = sd[f"backbone.{src}.gcn_weights"].t().contiguous()
            used.add(f"backbone.{src}.gcn_weights")
        _copy(out, sd, used, "backbone.norm_share", "visa.dlfm.norm_shared")
        if config.has_view_branch:
            _copy(out, sd, used, "backbone.norm_view", "visa.dlfm.norm_view")
    if config.has_local_branch:
        fusion = "backbone.final_attn_token_to_image"
        _block(out, sd, used, fusion, "visa.fusion", qkv_bias=False)
        _copy(out, sd, used, f"{fusion}.norm2", "visa.fusion.norm2")
        _copy(out, sd, used, f"{fusion}.norm3", "visa.fusion.norm3")
        out["visa.fusion.out_token"] = sd["backbone.out_token"].clone()
        used.add("backbone.out_token")


def _heads(out: dict, sd: dict, used: set) -> None:
    for src, (classifier, bnneck) in HEADS.items():
        if f"{src}.weight" in sd:
            out[f"{classifier}.weight"] = sd[f"{src}.weight"].clone()
            used.add(f"{src}.weight")
        for key in BN_KEYS:
            if f"{src}.bottleneck.0.{key}" in sd:
                out[f"{bnneck}.{key}"] = sd[f"{src}.bottleneck.0.{key}"].clone()
                used.add(f"{src}.bottleneck.0.{key}")


def convert_state_dict(state_dict: dict[str, torch.Tensor], config: ViSAConfig) -> tuple[dict, list[str]]:
    """Official (fast-reid) state dict -> [`ViSAForReID`] state dict, and the dropped (never-executed) keys.

    Raises ValueError naming keys the official layout should have but lacks, or has but cannot place.
    """
    sd = strip_module_prefix(state_dict)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    try:
        _trunk(out, sd, used, config)
        _experts(out, sd, used, config)
        _local(out, sd, used, config)
    except KeyError as error:
        raise ValueError(
            f"not an official ViSA state dict for this config: missing {error.args[0]!r}"
        ) from None
    _heads(out, sd, used)
    unused = [k for k in sd if k not in used and _never_executed(k, config)]
    unknown = sorted(set(sd) - used - set(unused))
    if unknown:
        raise ValueError(
            f"unexpected keys in the ViSA checkpoint: {unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
        )
    return out, sorted(unused)


def _never_executed(key: str, config: ViSAConfig) -> bool:
    """Tensors the reference stores but never runs (docs/visa-reference.md §7)."""
    last = config.num_hidden_layers - 1
    patterns = [
        rf"backbone\.base\.blocks\.{last}\.",
        r"backbone\.base\.norm\.",
        r"backbone\.image_pe$",
        r"backbone\.view_gcn\.",
    ]
    return any(re.match(p, key) for p in patterns)


def strip_module_prefix(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop a DDP `module.` prefix (fast-reid's loader does too)."""
    return {k[len("module.") :] if k.startswith("module.") else k: v for k, v in state_dict.items()}


def trunk_depth(sd: dict[str, torch.Tensor]) -> int:
    """Trunk blocks from the keys: the last block runs from `b1.0`; the reference also stores a never-executed
    copy at `base.blocks.{L-1}` (with `base.norm`), an executed-only export (`to_official_state_dict`) does not."""
    indices = sorted({int(k.split(".")[3]) for k in sd if k.startswith("backbone.base.blocks.")})
    if indices != list(range(len(indices))) or "backbone.b1.0.attn.qkv.weight" not in sd:
        raise ValueError(
            f"not an official ViSA state dict: trunk blocks {indices} are not contiguous from 0 or 'backbone.b1.0' "
            "(the last block) is missing"
        )
    return len(indices) + (0 if "backbone.base.norm.weight" in sd else 1)


def _geometry(sd: dict[str, torch.Tensor], num_patches: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """Patch size from the patch convolution; image size and stride from the patch count at the reference
    geometries (256x128), else from `overrides`, which must give that many patches."""
    patch_size = sd["backbone.base.patch_embed.proj.weight"].shape[-1]
    kwargs: dict[str, Any] = {"patch_size": patch_size}
    if num_patches in STRIDES and patch_size == 16:
        kwargs["patch_stride"] = STRIDES[num_patches]
    elif not {"image_size", "patch_stride"} <= overrides.keys():
        raise ValueError(
            f"cannot infer the input geometry of this checkpoint: {num_patches} patches of {patch_size}x{patch_size} "
            "do not match a reference geometry; pass image_size and patch_stride (--config "
            '\'{"image_size": [H, W], "patch_stride": [sy, sx]}\')'
        )
    return kwargs


def _num_heads(dim: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """Heads are not visible in the weights: width // 64 (ViT-B: 12) when the width is a multiple of 64."""
    if "num_attention_heads" in overrides:
        return {}
    if dim % 64:
        raise ValueError(
            f"cannot infer num_attention_heads: width {dim} is not a multiple of 64; pass num_attention_heads"
        )
    return {"num_attention_heads": dim // 64}


def infer_config(state_dict: dict[str, torch.Tensor], **overrides) -> ViSAConfig:
    """ViSAConfig from the state dict: depth from the block keys, widths, patches, experts, M and classes from
    shapes. Not stored, so overridable: heads (width // 64), the router top-k (2, or 3 for the LAGPeR geometry),
    and for a non-reference patch count the image size and stride (required then). The inferred config must
    reproduce the position-embedding length, else a ValueError."""
    sd = strip_module_prefix(state_dict)
    if "backbone.base.pos_embed" not in sd:
        raise ValueError("not an official ViSA state dict: no 'backbone.base.pos_embed'")
    _, tokens, dim = sd["backbone.base.pos_embed"].shape
    dual = "backbone.base.view_token_sky" in sd
    num_patches = tokens - (2 if dual or "backbone.base.view_token" in sd else 1)
    kwargs: dict[str, Any] = {
        "hidden_size": dim,
        **_num_heads(dim, overrides),
        "intermediate_size": sd["backbone.base.blocks.0.mlp.fc1.weight"].shape[0],
        "num_hidden_layers": trunk_depth(sd),
        "view_tokens": "dual" if dual else "shared" if "backbone.base.view_token" in sd else "none",
        **_geometry(sd, num_patches, overrides),
        "num_identities": sd["heads.weight"].shape[0] if "heads.weight" in sd else 0,
    }
    if "backbone.share_experts.0.prompt" in sd:
        kwargs["num_experts"] = sd["backbone.share_router.gate.weight"].shape[0]
        kwargs["num_prompt_tokens"] = sd["backbone.share_experts.0.prompt"].shape[1]
        kwargs["expert_intermediate_size"] = sd["backbone.share_experts.0.prm.mlp.fc1.weight"].shape[0]
        kwargs["expert_top_k"] = 3 if num_patches == 252 else 2
    else:
        kwargs["use_etgm"] = False
    kwargs["use_dlfm"] = "backbone.share_gcn.gcn_weights" in sd
    if "backbone.final_attn_token_to_image.mlp.fc1.weight" in sd:
        kwargs["fusion_intermediate_size"] = sd["backbone.final_attn_token_to_image.mlp.fc1.weight"].shape[0]
    config = ViSAConfig(**{**kwargs, **overrides})
    if config.num_patches != num_patches:
        raise ValueError(
            f"the config gives {config.num_patches} patches ({config.image_size} at stride {config.patch_stride}), "
            f"the checkpoint's position embedding has {num_patches}"
        )
    return config


def to_official_state_dict(model: ViSAForReID) -> dict[str, torch.Tensor]:
    """[`ViSAForReID`] -> official layout (executed tensors only), e.g. to run the reference code on it."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    config = model.config
    last = config.num_hidden_layers - 1
    out: dict[str, torch.Tensor] = {}

    def fuse(src: str, dst: str, bias: bool) -> None:
        out[f"{dst}.attn.qkv.weight"] = torch.cat([sd[f"{src}.self_attn.{p}_proj.weight"] for p in "qkv"])
        if bias:
            out[f"{dst}.attn.qkv.bias"] = torch.cat([sd[f"{src}.self_attn.{p}_proj.bias"] for p in "qkv"])
        pairs = [("self_attn.out_proj", "attn.proj"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")]
        for ours, theirs in pairs:
            for suffix in ("weight", "bias"):
                out[f"{dst}.{theirs}.{suffix}"] = sd[f"{src}.{ours}.{suffix}"]

    base = "backbone.base"
    out[f"{base}.cls_token"] = sd["visa.embeddings.cls_token"]
    out[f"{base}.pos_embed"] = sd["visa.embeddings.position_embedding"]
    for ours, theirs in (("view_token_aerial", "view_token_sky"), ("view_token_ground", "view_token_ground")):
        if f"visa.embeddings.{ours}" in sd:
            out[f"{base}.{theirs}"] = sd[f"visa.embeddings.{ours}"]
    if "visa.embeddings.view_token" in sd:
        out[f"{base}.view_token"] = sd["visa.embeddings.view_token"]
    for suffix in ("weight", "bias"):
        out[f"{base}.patch_embed.proj.{suffix}"] = sd[f"visa.embeddings.patch_embedding.{suffix}"]
        out[f"backbone.b1.1.{suffix}"] = sd[f"visa.final_layer_norm.{suffix}"]
    for index in range(config.num_hidden_layers):
        src, dst = (
            f"visa.encoder.layers.{index}",
            f"{base}.blocks.{index}" if index < last else "backbone.b1.0",
        )
        fuse(src, dst, bias=True)
        for ours, theirs in (("layer_norm1", "norm1"), ("layer_norm2", "norm2")):
            for suffix in ("weight", "bias"):
                out[f"{dst}.{theirs}.{suffix}"] = sd[f"{src}.{ours}.{suffix}"]
    _official_local(sd, out, config, fuse)
    for src, (classifier, bnneck) in HEADS.items():
        if f"{classifier}.weight" in sd:
            out[f"{src}.weight"] = sd[f"{classifier}.weight"]
        for key in BN_KEYS:
            if f"{bnneck}.{key}" in sd:
                out[f"{src}.bottleneck.0.{key}"] = sd[f"{bnneck}.{key}"]
    return out


def _official_local(sd: dict, out: dict, config: ViSAConfig, fuse) -> None:
    """ETGM, DLFM and fusion tensors in the official layout."""
    for theirs, ours in SETS.items():
        if f"visa.etgm.{ours}.router.weight" not in sd:
            continue
        for suffix in ("weight", "bias"):
            out[f"backbone.{theirs}_router.gate.{suffix}"] = sd[f"visa.etgm.{ours}.router.{suffix}"]
        for e in range(config.num_experts):
            src, dst = f"visa.etgm.{ours}.experts.{e}", f"backbone.{theirs}_experts.{e}"
            out[f"{dst}.prompt"] = sd[f"{src}.prompt"]
            fuse(src, f"{dst}.prm", bias=False)
            for name in (
                "cross_attn.q_proj",
                "cross_attn.k_proj",
                "cross_attn.v_proj",
                "cross_attn.out_proj",
            ):
                for suffix in ("weight", "bias"):
                    out[f"{dst}.prm.{name}.{suffix}"] = sd[f"{src}.{name}.{suffix}"]
            for norm in ("norm1", "norm2", "norm3"):
                for suffix in ("weight", "bias"):
                    out[f"{dst}.prm.{norm}.{suffix}"] = sd[f"{src}.{norm}.{suffix}"]
    if config.use_dlfm:
        out["backbone.share_gcn.gcn_weights"] = sd["visa.dlfm.shared_gcn.weight"].t().contiguous()
        if "visa.dlfm.view_gcn.weight" in sd:
            out["backbone.view_gcn.gcn_weights"] = sd["visa.dlfm.view_gcn.weight"].t().contiguous()
        for ours, theirs in (("norm_shared", "norm_share"), ("norm_view", "norm_view")):
            for suffix in ("weight", "bias"):
                if f"visa.dlfm.{ours}.{suffix}" in sd:
                    out[f"backbone.{theirs}.{suffix}"] = sd[f"visa.dlfm.{ours}.{suffix}"]
    if config.has_local_branch:
        fusion = "backbone.final_attn_token_to_image"
        fuse("visa.fusion", fusion, bias=False)
        for norm in ("norm2", "norm3"):
            for suffix in ("weight", "bias"):
                out[f"{fusion}.{norm}.{suffix}"] = sd[f"visa.fusion.{norm}.{suffix}"]
        out["backbone.out_token"] = sd["visa.fusion.out_token"]


def load_official_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The `model` state dict of a fast-reid checkpoint, read without executing code (`safe_torch_load`)."""
    checkpoint = safe_torch_load(path)
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(
            f"{path}: expected a fast-reid checkpoint ({{'model': state_dict, ...}}) or a state dict"
        )
    return strip_module_prefix(state)


def convert_checkpoint(
    path: str | os.PathLike, output_dir: str | os.PathLike | None = None, **config_overrides
) -> tuple[ViSAForReID, dict[str, Any]]:
    """Load an official checkpoint into [`ViSAForReID`] (strict), optionally `save_pretrained` it with the
    Hub custom code; returns the model and a report (config, dropped keys)."""
    state = load_official_state_dict(path)
    config = infer_config(state, **config_overrides)
    converted, dropped = convert_state_dict(state, config)
    model = ViSAForReID(config)
    missing, unexpected = model.load_state_dict(converted, strict=False)
    if unexpected or [k for k in missing if "classifier" not in k]:
        raise ValueError(
            f"checkpoint does not fit the inferred config: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    report = {
        "config": config.to_diff_dict(),
        "dropped_never_executed": dropped,
        "missing_heads": list(missing),
    }
    if output_dir is not None:
        ViSAConfig.register_for_auto_class()
        ViSAModel.register_for_auto_class("AutoModel")
        ViSAForReID.register_for_auto_class("AutoModelForImageClassification")
        model.save_pretrained(output_dir)
        build_visa_image_processor(*model.config.image_size).save_pretrained(output_dir)
    return model.eval(), report


def load_imagenet_vit(model: ViSAModel, state_dict_or_path: dict | str | os.PathLike) -> dict[str, list[str]]:
    """Initialise the trunk from timm's ViT-B/16 (`jx_vit_base_p16_224`) as the reference `load_param` does.

    Blocks 0..L-1 -> layers (the last one is the reference's `b1` copy), `norm` -> final LayerNorm; the
    position embeddings are resized with the reference quirk: [cls_pos, pos of patch (0,0)] become the CLS and
    view-token positions, the 14x14 grid is bilinearly resized to the model's grid. `head.*` is dropped.
    Returns the missing / unexpected keys of the (non-strict) load.
    """
    sd = state_dict_or_path if isinstance(state_dict_or_path, dict) else safe_torch_load(state_dict_or_path)
    sd = strip_module_prefix(sd.get("model", sd))
    config = model.config
    out: dict[str, torch.Tensor] = {"embeddings.cls_token": sd["cls_token"]}
    for suffix in ("weight", "bias"):
        out[f"embeddings.patch_embedding.{suffix}"] = sd[f"patch_embed.proj.{suffix}"]
        out[f"final_layer_norm.{suffix}"] = sd[f"norm.{suffix}"]
    pos = sd["pos_embed"][0]
    old = int(round((pos.shape[0] - 1) ** 0.5))
    grid = interpolate_grid_embeddings(pos, (old, old), config.grid_size)
    prefix = [grid[:1]] + ([pos[1:2]] if config.num_prefix_tokens == 2 else [])
    out["embeddings.position_embedding"] = torch.cat([*prefix, grid[1:]])[None]
    for index in range(config.num_hidden_layers):
        used: set[str] = set()
        _block(out, sd, used, f"blocks.{index}", f"encoder.layers.{index}")
        _copy(out, sd, used, f"blocks.{index}.norm1", f"encoder.layers.{index}.layer_norm1")
        _copy(out, sd, used, f"blocks.{index}.norm2", f"encoder.layers.{index}.layer_norm2")
    missing, unexpected = model.load_state_dict(out, strict=False)
    return {"missing": list(missing), "unexpected": list(unexpected)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point of ``tagclip convert visa``."""
    return run(parse_visa_args(argv))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Convert with parsed ``tagclip convert visa`` arguments; returns the conversion report."""
    try:
        overrides = json.loads(args.config or "{}")
    except json.JSONDecodeError as error:
        raise ValueError(
            f"--config is not valid JSON ({error.msg} at column {error.colno}): {args.config}"
        ) from error
    if not isinstance(overrides, dict):
        raise ValueError(f"--config must be a JSON object of ViSAConfig overrides, got {args.config}")
    _, report = convert_checkpoint(args.checkpoint, args.output, **overrides)
    print(json.dumps(report, indent=2, default=str))
    print(f"wrote the ViSA model to {args.output}")
    return report
