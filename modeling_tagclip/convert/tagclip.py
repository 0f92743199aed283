"""Convert CLIP and official TAG-PR checkpoints into `TagClipModel` (transformers layout, safetensors).

- `convert_hf_clip`: a transformers `CLIPModel` folder -> TAG-CLIP initialised as the reference does from
  CLIP (`load_checkpoint`): towers 1:1, every expert of a MoE block a copy of its CLIP MLP, `logit_scale`
  from CLIP; the view token, routers, TSE heads and classifier keep their init.
- `convert_tagpr_checkpoint`: an official TAG-PR `checkpoint_best.pth` (`{'model', 'config', ...}`), a bare
  state_dict in that layout (TBPS-CLIP too), or an OpenAI CLIP state_dict (then as `convert_hf_clip`).
  Read with `safe_torch_load` (no code runs); the architecture is inferred from the tensor shapes.

CLI::

    tagclip convert hf-clip --checkpoint SRC_DIR --output OUT_DIR [--block-type hrmoe] [--image-size H W]
    tagclip convert tagpr --checkpoint CHECKPOINT --output OUT_DIR [--num-identities N] [--image-size H W]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedConfig

from modeling_tagclip.convert.arguments import parse_convert_args

from ..models.tagclip.configuration_tagclip import TagClipConfig, TagClipTextConfig, TagClipVisionConfig
from ..models.tagclip.modeling_tagclip import TagClipModel
from ..models.tagclip.processing_tagclip import TagClipProcessor
from .safe_pickle import safe_torch_load

__all__ = [
    "ConversionReport",
    "convert_hf_clip",
    "convert_tagpr_checkpoint",
    "OfficialTensors",
    "default_moe_layers",
    "load_tensors",
    "main",
    "official_to_tagclip",
    "save_converted",
    "tagpr_config",
]

logger = logging.getLogger(__name__)

VISION_ATTENTION_DROPOUT = 0.0  # reference: visual attention dropout 0
TEXT_ATTENTION_DROPOUT = 0.05  # reference: config.experiment.dropout, text encoder only
NEW_PARTS = (
    "vision_model.embeddings.view_token",
    ".mlp.img_router.",
    ".mlp.fea_router.",
    "_tse.",
    "classifier.",
)

# ------------------------------------------------------------------------------------------------------
# Official (OpenAI / TAG-PR) names -> ours
# ------------------------------------------------------------------------------------------------------

_DIRECT = {
    "logit_scale": "logit_scale",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.view_token": "vision_model.embeddings.view_token",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "encode_text.token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "encode_text.positional_embedding": "text_model.embeddings.position_embedding.weight",
}
_PREFIXES = {
    "visual.ln_pre.": "vision_model.pre_layrnorm.",
    "visual.ln_post.": "vision_model.post_layernorm.",
    "encode_text.ln_final.": "text_model.final_layer_norm.",
    "classifier.": "classifier.",
}
_TRANSPOSED = {
    "visual.proj": "visual_projection.weight",
    "encode_text.text_projection": "text_projection.weight",
}
_TOWERS = {
    "visual.transformer.resblocks.": "vision_model.encoder.layers.",
    "encode_text.transformer.resblocks.": "text_model.encoder.layers.",
}
_BLOCK_PARTS = {
    "ln_1.": "layer_norm1.",
    "ln_2.": "layer_norm2.",
    "attn.out_proj.": "self_attn.out_proj.",
    "mlp.c_fc.": "mlp.fc1.",
    "mlp.c_proj.": "mlp.fc2.",
    "img_router.": "mlp.img_router.",
    "fea_router.": "mlp.fea_router.",
}
_EXPERT = re.compile(r"experts\.(\d+)\.c_(fc|proj)\.(weight|bias)")
_TSE_LAYERS = {"visual_emb_layer.": ("visual_tse.", "fc."), "textual_emb_layer.": ("textual_tse.", "linear.")}
_TSE_PARTS = {"mlp.layers.0.": "mlp_fc1.", "mlp.bns.0.": "mlp_bn.", "mlp.layers.1.": "mlp_fc2."}
_OPENAI_TEXT_KEYS = (
    "transformer.",
    "token_embedding.",
    "positional_embedding",
    "ln_final.",
    "text_projection",
)
_OPENAI_META_KEYS = ("input_resolution", "context_length", "vocab_size")


def _block_key(tower: str, rest: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | str:
    """Our keys for `rest` of a residual block (q/k/v split of in_proj), or the reason it is dropped."""
    index, _, part = rest.partition(".")
    prefix = f"{tower}{index}."
    if part in ("attn.in_proj_weight", "attn.in_proj_bias"):
        kind = part.rsplit("_", 1)[1]
        if tensor.shape[0] % 3:
            raise ValueError(
                f"checkpoint does not match: block {index} {part} has {tensor.shape[0]} rows, not 3 x width"
            )
        q, k, v = tensor.chunk(3, dim=0)
        return {f"{prefix}self_attn.{name}_proj.{kind}": t for name, t in zip("qkv", (q, k, v), strict=True)}
    if part.startswith("router."):
        return "unused in the reference (MoE `router`)"
    match = _EXPERT.fullmatch(part)
    if match:
        expert, layer, kind = match.groups()
        return {f"{prefix}mlp.experts.{expert}.fc{1 if layer == 'fc' else 2}.{kind}": tensor}
    for old, new in _BLOCK_PARTS.items():
        if part.startswith(old):
            return {prefix + new + part[len(old) :]: tensor}
    return "unknown key"


def _tse_key(layer: str, rest: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | str:
    """Our key for a TSE-layer tensor (`fc`/`linear` -> `proj`, MLP renames), or the reason it is dropped."""
    ours, proj = _TSE_LAYERS[layer]
    if rest.startswith(proj):
        return {f"{ours}proj.{rest[len(proj) :]}": tensor}
    if rest.startswith("linear.") or rest.startswith("mlp.bns.1."):
        return "unused in the reference (TSE `linear` of the image layer / second BatchNorm)"
    for old, new in _TSE_PARTS.items():
        if rest.startswith(old):
            return {ours + new + rest[len(old) :]: tensor}
    return "unknown key"


def _official_key(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | str:
    """Map one official tensor to ours (a dict of 1 or 3 tensors) or return why it is dropped."""
    if key in _DIRECT:
        return {_DIRECT[key]: tensor}
    if key in _TRANSPOSED:
        return {_TRANSPOSED[key]: tensor.t().contiguous()}
    for old, new in _TOWERS.items():
        if key.startswith(old):
            return _block_key(new, key[len(old) :], tensor)
    for layer in _TSE_LAYERS:
        if key.startswith(layer):
            return _tse_key(layer, key[len(layer) :], tensor)
    for old, new in _PREFIXES.items():
        if key.startswith(old):
            return {new + key[len(old) :]: tensor}
    if key in _OPENAI_META_KEYS or key.endswith("attn_mask"):
        return "metadata / non-parameter buffer"
    return "unknown key"


class OfficialTensors(NamedTuple):
    """An official state_dict in our names."""

    tensors: dict[str, torch.Tensor]  # our key -> tensor (q/k/v split, projections transposed)
    dropped: dict[str, str]  # official key -> why it has no place in our model
    sources: dict[str, str]  # our key -> the official key it came from


def official_to_tagclip(state_dict: Mapping[str, Any]) -> OfficialTensors:
    """Rename an official (TAG-PR / TBPS-CLIP / `encode_text.`-prefixed OpenAI) state_dict to our keys.

    `attn.in_proj_*` is split into q/k/v (row chunks in that order), `visual.proj` and
    `encode_text.text_projection` are transposed into Linear weights, `c_fc`/`c_proj` -> `fc1`/`fc2`,
    `ln_1`/`ln_2` -> `layer_norm1`/`layer_norm2`; the unused official tensors are listed in `dropped`.
    """
    result = OfficialTensors({}, {}, {})
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            result.dropped[key] = f"not a tensor ({type(value).__name__})"
            continue
        mapped = _official_key(key, value)
        if isinstance(mapped, str):
            result.dropped[key] = mapped
            continue
        result.tensors.update(mapped)
        result.sources.update(dict.fromkeys(mapped, key))
    return result


# ------------------------------------------------------------------------------------------------------
# Loading converted tensors into a model
# ------------------------------------------------------------------------------------------------------


@dataclass
class ConversionReport:
    """What a conversion did: tensors copied, parameters kept at init, source keys dropped (with reasons)."""

    copied: list[str] = field(default_factory=list)
    num_params_copied: int = 0
    initialised: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)

    def log(self) -> None:
        """Counts at INFO, the tensor names at DEBUG; source keys nothing maps (``unknown key``) at WARNING."""
        logger.info("copied %d tensors (%s parameters)", len(self.copied), f"{self.num_params_copied:,}")
        if self.initialised:
            logger.info("kept at init (not in the source): %d tensors", len(self.initialised))
            logger.debug("kept at init: %s", self.initialised)
        by_reason: dict[str, list[str]] = {}
        for key, reason in self.dropped.items():
            by_reason.setdefault(reason, []).append(key)
        for reason, keys in by_reason.items():
            if reason == "unknown key":
                logger.warning("dropped %d source keys (%s): %s", len(keys), reason, keys)
            else:
                logger.info("dropped %d source keys (%s)", len(keys), reason)
                logger.debug("dropped (%s): %s", reason, keys)


def _is_new_part(key: str) -> bool:
    """Parameters TAG-CLIP adds to CLIP (initialised, not loaded, when converting pretrained CLIP)."""
    return any(part in key for part in NEW_PARTS)


def check_source_tensor(name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    """A clear `ValueError("checkpoint does not match: ...")` for a source tensor of the wrong shape, a
    non-float tensor where the model holds floats (an int64 checkpoint would be copied as truncated integers),
    or NaN/inf values."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"checkpoint does not match: {name} is a {type(tensor).__name__}, not a tensor")
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"checkpoint does not match: {name}: checkpoint shape {tuple(tensor.shape)} vs model "
            f"shape {tuple(target.shape)}"
        )
    if target.is_floating_point() and not tensor.is_floating_point():
        raise ValueError(
            f"checkpoint does not match: {name} has dtype {tensor.dtype}, the model needs a floating-point "
            "tensor (a checkpoint cast to integers has lost its weights)"
        )
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"checkpoint does not match: {name} contains NaN or inf values")


def load_tensors(
    model: TagClipModel,
    tensors: dict[str, torch.Tensor],
    may_init: Callable[[str], bool],
    report: ConversionReport,
    sources: Mapping[str, str] | None = None,
) -> ConversionReport:
    """Copy `tensors` into `model` (checking shapes); keys missing from `tensors` must satisfy `may_init`.

    Source tensors with no model key are added to `report.dropped`; a shape mismatch or a missing required
    key raises `ValueError("checkpoint does not match: ...")` naming the key (and its official name from
    `sources`).
    """
    sources = sources or {}

    def name(key: str) -> str:
        return f"{sources[key]} (-> {key})" if key in sources else key

    target = model.state_dict()
    for key, tensor in tensors.items():
        if key in target:
            check_source_tensor(name(key), tensor, target[key])
    missing = [key for key in target if key not in tensors and not may_init(key)]
    if missing:
        raise ValueError(f"checkpoint does not match: missing required keys (our names) {missing}")
    with torch.no_grad():
        for key in tqdm(list(target), desc="copying weights", unit="tensor", disable=None):
            if key in tensors:
                target[key].copy_(tensors[key])
                report.copied.append(key)
                report.num_params_copied += target[key].numel()
            else:
                report.initialised.append(key)
    for key in sorted(tensors.keys() - target.keys()):
        report.dropped[sources.get(key, key)] = "unknown key"
    return report


def expand_experts(
    tensors: dict[str, torch.Tensor], vision_config: TagClipVisionConfig
) -> dict[str, torch.Tensor]:
    """Replace the MLP of each MoE block by `num_experts` copies of it (the reference's CLIP init)."""
    tensors = dict(tensors)
    for layer in vision_config.active_moe_layers:
        prefix = f"vision_model.encoder.layers.{layer}.mlp."
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            mlp = tensors.pop(prefix + name, None)
            if mlp is None:
                continue
            for expert in range(vision_config.num_experts):
                tensors[f"{prefix}experts.{expert}.{name}"] = mlp.clone()
    return tensors


def default_moe_layers(num_layers: int) -> list[int]:
    """The reference's expert blocks scaled to the depth: from L/2, max(1, L/4) blocks ([6, 7, 8] of 12)."""
    start = num_layers // 2
    return list(range(start, min(num_layers, start + max(1, num_layers // 4))))


def _own_fields(config_class: type) -> set[str]:
    base = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    return {f.name for f in dataclasses.fields(config_class)} - base


def _apply_overrides(kwargs: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Merge overrides: `vision_config`/`text_config` dicts, else a top-, vision- or text-config field."""
    top, vision, text = (_own_fields(c) for c in (TagClipConfig, TagClipVisionConfig, TagClipTextConfig))
    for key, value in overrides.items():
        if key in ("vision_config", "text_config"):
            kwargs[key].update(dict(value))
        elif key in top or key not in vision | text:
            kwargs[key] = value
        elif key in vision:
            kwargs["vision_config"][key] = value
        else:
            kwargs["text_config"][key] = value
    return kwargs


def _finish(model: TagClipModel, image_size: tuple[int, int] | None, out_dir, report: ConversionReport):
    """Resize the position grid if asked, log the report, save if `out_dir`; returns the model (eval)."""
    if image_size is not None and tuple(image_size) != model.config.vision_config.image_hw:
        old = model.config.vision_config.image_hw
        model.set_image_size(int(image_size[0]), int(image_size[1]))
        logger.info("position embeddings interpolated from %s to %s", old, tuple(image_size))
    report.log()
    model.eval()
    if out_dir is not None:
        save_converted(model, out_dir)
    return model


def save_converted(model: TagClipModel, out_dir: str | Path) -> None:
    """Save model (safetensors) + a default `TagClipProcessor`, with custom code, `auto_map` and the retrieval pipeline."""
    TagClipConfig.register_for_auto_class()
    TagClipModel.register_for_auto_class("AutoModel")
    TagClipProcessor.register_for_auto_class("AutoProcessor")
    model.config.auto_map = {
        **(getattr(model.config, "auto_map", None) or {}),
        "AutoModelForZeroShotImageClassification": "modeling_tagclip.TagClipModel",
    }
    from modeling_tagclip.retrieval.pipeline_tagclip import save_with_pipeline

    height, width = model.config.vision_config.image_hw
    save_with_pipeline(model, TagClipProcessor.from_defaults(height, width), Path(out_dir))
    logger.info("saved TagClipModel + TagClipProcessor to %s", out_dir)


# ------------------------------------------------------------------------------------------------------
# transformers CLIPModel -> TAG-CLIP
# ------------------------------------------------------------------------------------------------------


def _hf_config_kwargs(clip_config, block_type: str, use_view_token: bool, num_identities: int) -> dict:
    """TagClipConfig kwargs with the sizes of a transformers `CLIPConfig`."""
    vision, text = clip_config.vision_config, clip_config.text_config
    shared = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act")
    shared += ("layer_norm_eps", "initializer_range", "initializer_factor")
    eos, bos = text.eos_token_id, text.bos_token_id
    # legacy OpenAI-converted configs say eos=2 and mean "argmax of the ids" (= vocab - 1)
    if eos in (None, 2) or eos >= text.vocab_size:
        eos, bos = text.vocab_size - 1, text.vocab_size - 2
    return {
        "vision_config": {
            **{name: getattr(vision, name) for name in shared},
            "num_channels": vision.num_channels,
            "image_size": vision.image_size,
            "patch_size": vision.patch_size,
            "attention_dropout": VISION_ATTENTION_DROPOUT,
            "block_type": block_type,
            "use_view_token": use_view_token,
            "moe_layers": default_moe_layers(vision.num_hidden_layers),
        },
        "text_config": {
            **{name: getattr(text, name) for name in shared},
            "vocab_size": text.vocab_size,
            "max_position_embeddings": text.max_position_embeddings,
            "attention_dropout": TEXT_ATTENTION_DROPOUT,
            "pad_token_id": 0,
            "bos_token_id": bos,
            "eos_token_id": eos,
        },
        "projection_dim": clip_config.projection_dim,
        "num_identities": num_identities,
    }


def _require_clip_folder(src_dir: Path) -> None:
    """A ``ValueError`` unless ``src_dir/config.json`` is a transformers CLIP config (``model_type`` "clip")."""
    try:
        model_type = json.loads((src_dir / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{src_dir / 'config.json'} is not a JSON config object ({error})") from None
    if model_type != "clip":
        raise ValueError(
            f"{src_dir} holds a {model_type!r} model, not a transformers CLIPModel (model_type 'clip'): "
            "hf-clip converts a CLIP folder"
        )


def convert_hf_clip(
    src_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    block_type: str = "hrmoe",
    use_view_token: bool = True,
    image_size: tuple[int, int] | None = None,
    num_identities: int = 0,
    **config_overrides: Any,
) -> TagClipModel:
    """Build a TAG-CLIP model from a transformers `CLIPModel` folder (config.json + weights), offline.

    Towers are copied 1:1, each MoE block's experts are copies of its CLIP MLP, `logit_scale` is CLIP's;
    the view token, routers, TSE heads and classifier keep their init. `image_size=(H, W)` interpolates the
    position embeddings. `config_overrides` go to `TagClipConfig` (a field of the top, vision or text config,
    or `vision_config={...}` / `text_config={...}`). With `out_dir`, saves model + processor.
    """
    from transformers import CLIPModel

    if not (Path(src_dir) / "config.json").is_file():
        raise FileNotFoundError(f"no transformers CLIPModel folder (with config.json) at {src_dir}")
    _require_clip_folder(Path(src_dir))
    clip = CLIPModel.from_pretrained(src_dir, local_files_only=True)
    kwargs = _hf_config_kwargs(clip.config, block_type, use_view_token, num_identities)
    config = TagClipConfig(**_apply_overrides(kwargs, config_overrides))
    model = TagClipModel(config)
    tensors = expand_experts(dict(clip.state_dict()), config.vision_config)
    report = load_tensors(model, tensors, _is_new_part, ConversionReport())
    return _finish(model, image_size, out_dir, report)


# ------------------------------------------------------------------------------------------------------
# Official TAG-PR / TBPS-CLIP / OpenAI CLIP state dicts -> TAG-CLIP
# ------------------------------------------------------------------------------------------------------


def _split_checkpoint(checkpoint: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state_dict, config dict) from `{'model': sd, 'config': ...}`, `{'state_dict': sd}` or a bare sd."""
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"checkpoint does not match: expected a dict, got {type(checkpoint).__name__}")
    for key in ("model", "state_dict"):
        if isinstance(checkpoint.get(key), Mapping):
            config = checkpoint.get("config")
            return dict(checkpoint[key]), dict(config) if isinstance(config, Mapping) else {}
    return dict(checkpoint), {}


def _normalise_layout(state_dict: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Strip a DDP `module.` prefix; prefix OpenAI CLIP's text keys with `encode_text.` (reference step 3).

    Returns the state_dict and whether it is a pretrained OpenAI CLIP (no `encode_text.` keys).
    """
    if state_dict and all(key.startswith("module.") for key in state_dict):
        state_dict = {key[len("module.") :]: value for key, value in state_dict.items()}
    if any(key.startswith("encode_text.") for key in state_dict):
        return state_dict, False
    if "token_embedding.weight" not in state_dict:
        return state_dict, False
    renamed = {
        (f"encode_text.{k}" if k.startswith(_OPENAI_TEXT_KEYS) else k): v for k, v in state_dict.items()
    }
    return renamed, True


def _config_value(config: Mapping[str, Any], key: str, sections: tuple[str, ...] = ("experiment", "model")):
    """`config[section][key]` for the first section that has it, else a top-level or nested match."""
    for section in sections:
        if isinstance(config.get(section), Mapping) and key in config[section]:
            return config[section][key]
    if key in config:
        return config[key]
    for value in config.values():
        if isinstance(value, Mapping):
            found = _config_value(value, key, ())
            if found is not None:
                return found
    return None


def _layer_indices(tensors: Mapping[str, torch.Tensor], prefix: str) -> list[int]:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for key in tensors if (m := pattern.match(key))})


def _require(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"checkpoint does not match: missing required key {key!r} (our name)")
    return tensors[key]


def _vision_kwargs(tensors, config_dict, heads: int | None, pretrained_clip: bool) -> dict[str, Any]:
    """Vision-config kwargs from the tensor shapes (and the checkpoint's config where shapes can't tell)."""
    patch = _require(tensors, "vision_model.embeddings.patch_embedding.weight")
    width, channels, patch_size = patch.shape[0], patch.shape[1], patch.shape[-1]
    layers = _layer_indices(tensors, "vision_model.encoder.layers.")
    num_layers = len(layers)
    if layers != list(range(num_layers)) or not layers:
        raise ValueError(f"checkpoint does not match: vision blocks {layers} are not 0..N-1")
    prefix = "vision_model.encoder.layers."
    moe = [i for i in layers if f"{prefix}{i}.mlp.experts.0.fc1.weight" in tensors]
    first_mlp = f"{prefix}{moe[0]}.mlp.experts.0.fc1.weight" if 0 in moe else f"{prefix}0.mlp.fc1.weight"
    kwargs = {
        "hidden_size": width,
        "num_channels": channels,
        "patch_size": patch_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads or _config_value(config_dict, "vision_heads") or max(1, width // 64),
        "intermediate_size": _require(tensors, first_mlp).shape[0],
        "image_size": _grid_image_size(tensors, config_dict, patch_size),
        "attention_dropout": VISION_ATTENTION_DROPOUT,
        "use_view_token": "vision_model.embeddings.view_token" in tensors or pretrained_clip,
    }
    if pretrained_clip:
        return {**kwargs, "block_type": "hrmoe", "moe_layers": default_moe_layers(num_layers)}
    return {**kwargs, **_moe_kwargs(tensors, config_dict, moe)}


def _grid_image_size(tensors, config_dict, patch_size: int) -> list[int]:
    """Input size whose patch grid matches the position embedding rows (config's resolution, else square)."""
    rows = _require(tensors, "vision_model.embeddings.position_embedding.weight").shape[0] - 1
    resolution = _config_value(config_dict, "input_resolution")
    if resolution is not None:
        height, width = (resolution, resolution) if isinstance(resolution, int) else resolution
        if (height // patch_size) * (width // patch_size) == rows:
            return [int(height), int(width)]
    side = round(rows**0.5)
    if side * side != rows:
        raise ValueError(
            f"checkpoint does not match: {rows} patch positions are not a square grid and the checkpoint's "
            "config has no matching input_resolution"
        )
    return [side * patch_size, side * patch_size]


def _moe_kwargs(tensors, config_dict, moe: list[int]) -> dict[str, Any]:
    """block_type, moe_layers, num_experts, groups and top-k of a trained checkpoint."""
    if not moe:
        return {"block_type": "vit"}
    prefix = "vision_model.encoder.layers."
    counts = {i: len(_layer_indices(tensors, f"{prefix}{i}.mlp.experts.")) for i in moe}
    if len(set(counts.values())) != 1:
        raise ValueError(f"checkpoint does not match: MoE blocks have different expert counts {counts}")
    num_experts = counts[moe[0]]
    hierarchical = f"{prefix}{moe[0]}.mlp.img_router.weight" in tensors
    top_k = _config_value(config_dict, "num_of_selected_experts")
    kwargs = {
        "block_type": "hrmoe" if hierarchical else "moe",
        "moe_layers": moe,
        "num_experts": num_experts,
        "moe_top_k": int(top_k) if top_k else max(1, num_experts - 1),
    }
    if hierarchical:  # the reference hard-codes "all but the last" / "all but the first" expert
        kwargs.update(aerial_experts=[0, num_experts - 2], ground_experts=[1, num_experts - 1])
    return kwargs


def _text_kwargs(tensors, config_dict, heads: int | None) -> dict[str, Any]:
    """Text-config kwargs inferred from tensor shapes."""
    tokens = _require(tensors, "text_model.embeddings.token_embedding.weight")
    layers = _layer_indices(tensors, "text_model.encoder.layers.")
    if layers != list(range(len(layers))) or not layers:
        raise ValueError(f"checkpoint does not match: text blocks {layers} are not 0..N-1")
    vocab, width = tokens.shape
    dropout = _config_value(config_dict, "dropout", ("experiment",))
    return {
        "vocab_size": vocab,
        "hidden_size": width,
        "num_hidden_layers": len(layers),
        "num_attention_heads": heads or _config_value(config_dict, "text_heads") or max(1, width // 64),
        "intermediate_size": _require(tensors, "text_model.encoder.layers.0.mlp.fc1.weight").shape[0],
        "max_position_embeddings": _require(tensors, "text_model.embeddings.position_embedding.weight").shape[
            0
        ],
        "attention_dropout": float(dropout) if dropout is not None else TEXT_ATTENTION_DROPOUT,
        "pad_token_id": 0,
        "bos_token_id": vocab - 2,
        "eos_token_id": vocab - 1,
    }


def _classes(tensors: dict[str, torch.Tensor], num_identities: int | None, report: ConversionReport) -> int:
    """Classifier size: the checkpoint's rows unless `num_identities` is given (a mismatch is dropped)."""
    rows = tensors["classifier.weight"].shape[0] if "classifier.weight" in tensors else 0
    if num_identities is None or num_identities == rows:
        return rows
    for key in ("classifier.weight", "classifier.bias"):
        if tensors.pop(key, None) is not None:
            report.dropped[key] = f"classifier has {rows} classes, num_identities={num_identities} asked"
    return num_identities


def tagpr_config(
    tensors: dict[str, torch.Tensor],
    config_dict: Mapping[str, Any],
    num_identities: int,
    pretrained_clip: bool = False,
    vision_heads: int | None = None,
    text_heads: int | None = None,
) -> TagClipConfig:
    """The `TagClipConfig` of converted official tensors (sizes from shapes; heads default to width // 64)."""
    projection = _require(tensors, "visual_projection.weight")
    tse = tensors.get("visual_tse.proj.weight")
    return TagClipConfig(
        vision_config=_vision_kwargs(tensors, config_dict, vision_heads, pretrained_clip),
        text_config=_text_kwargs(tensors, config_dict, text_heads),
        projection_dim=projection.shape[0],
        use_tse=tse is not None or pretrained_clip,
        tse_embed_dim=tse.shape[0] if tse is not None else TagClipConfig().tse_embed_dim,
        num_identities=num_identities,
    )


def convert_tagpr_checkpoint(
    checkpoint_path: str | Path,
    out_dir: str | Path | None = None,
    *,
    num_identities: int | None = None,
    image_size: tuple[int, int] | None = None,
    vision_heads: int | None = None,
    text_heads: int | None = None,
) -> TagClipModel:
    """Convert an official TAG-PR checkpoint (or a bare / TBPS-CLIP / OpenAI CLIP state_dict) to TAG-CLIP.

    Read without running code (`safe_torch_load`). The architecture comes from the tensor shapes; head counts
    (not visible in shapes) from the arguments, else the checkpoint config, else width // 64 (12 / 8 for
    ViT-B/16). `num_identities` defaults to the classifier's rows. Unused official tensors (`router`,
    `visual_emb_layer.linear`, `mlp.bns.1`) are dropped and logged. With `out_dir`, saves model + processor.
    """
    state_dict, config_dict = _split_checkpoint(safe_torch_load(checkpoint_path))
    state_dict, pretrained_clip = _normalise_layout(state_dict)
    tensors, dropped, sources = official_to_tagclip(state_dict)
    report = ConversionReport(dropped=dropped)
    classes = _classes(tensors, num_identities, report)
    config = tagpr_config(tensors, config_dict, classes, pretrained_clip, vision_heads, text_heads)
    model = TagClipModel(config)
    if pretrained_clip:
        logger.info("OpenAI CLIP layout: experts are copies of the CLIP MLPs, TAG-CLIP parts keep their init")
        tensors = expand_experts(tensors, config.vision_config)

    classifier_loaded = "classifier.weight" in tensors

    def may_init(key: str) -> bool:
        new_classifier = key.startswith("classifier.") and not classifier_loaded
        return (
            key.endswith("num_batches_tracked") or new_classifier or (pretrained_clip and _is_new_part(key))
        )

    report = load_tensors(model, tensors, may_init, report, sources)
    return _finish(model, image_size, out_dir, report)


# ------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """``tagclip convert hf-clip|tagpr ARGV`` from Python (``ARGV`` starts with the kind)."""
    run(parse_convert_args(argv))


def run(args: argparse.Namespace) -> None:
    """Convert with parsed ``tagclip convert hf-clip|tagpr`` arguments; the report's counts are printed, other
    libraries (faiss's loader, ...) stay at warnings (``TAGCLIP_DEBUG=1``: every name)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger(__name__).setLevel(logging.DEBUG if os.environ.get("TAGCLIP_DEBUG") else logging.INFO)
    if args.command == "hf-clip":
        overrides = {"moe_layers": args.moe_layers} if args.moe_layers else {}
        convert_hf_clip(
            args.checkpoint,
            args.output,
            block_type=args.block_type,
            use_view_token=not args.no_view_token,
            image_size=args.image_size,
            num_identities=args.num_identities,
            **overrides,
        )
    else:
        convert_tagpr_checkpoint(
            args.checkpoint,
            args.output,
            num_identities=args.num_identities,
            image_size=args.image_size,
            vision_heads=args.vision_heads,
            text_heads=args.text_heads,
        )
