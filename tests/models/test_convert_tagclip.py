"""Checkpoint conversion (transformers CLIP, official TAG-PR / TBPS / OpenAI layouts) and safe unpickling."""

import logging
import os
import pickle
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fixtures import CLIP_EOS, CLIP_HEADS, CLIP_SOT, CLIP_VOCAB, tiny_clip_config
from PIL import Image
from torch import nn
from transformers import AutoModel, AutoProcessor, CLIPConfig, CLIPModel

from modeling_tagclip import TagClipConfig, TagClipModel, TagClipProcessor
from modeling_tagclip.convert.safe_pickle import UnsafeCheckpointError, safe_torch_load
from modeling_tagclip.convert.tagclip import (
    _hf_config_kwargs,
    convert_hf_clip,
    convert_tagpr_checkpoint,
    default_moe_layers,
)
from modeling_tagclip.models.tagclip.modeling_tagclip import interpolate_grid_embeddings

REPO = Path(__file__).resolve().parents[2]
VOCAB, EOS, SOT, HEADS = CLIP_VOCAB, CLIP_EOS, CLIP_SOT, CLIP_HEADS


def _perturb(module: nn.Module, seed: int = 0) -> None:
    """Random values everywhere (LayerNorm/BN too) so every mapping is exercised."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if tensor.is_floating_point():
                noise = torch.randn(tensor.shape, generator=generator) * 0.05
                tensor.copy_(tensor.abs() + 0.5 if name.endswith("running_var") else tensor + noise)
            elif name.endswith("num_batches_tracked"):
                tensor.fill_(7)


def _ids() -> torch.Tensor:
    """SOT, words, EOS, then pad 0."""
    return torch.tensor([[SOT, 5, 17, 42, 63, EOS, 0, 0], [SOT, 8, 11, EOS, 0, 0, 0, 0]])


def _pixels(height: int = 32, width: int = 32) -> torch.Tensor:
    return torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    clip = CLIPModel(tiny_clip_config()).eval()
    _perturb(clip)
    path = tmp_path_factory.mktemp("clip")
    clip.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def clip(clip_dir) -> CLIPModel:
    return CLIPModel.from_pretrained(clip_dir).eval()


# ------------------------------------------------------------------------------------------------------
# transformers CLIP -> TAG-CLIP
# ------------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_hf_clip_vit_parity(clip_dir, clip):
    model = convert_hf_clip(clip_dir, block_type="vit", use_view_token=False)
    pixels, ids = _pixels(), _ids()
    ours_img = model.get_image_features(pixels).pooler_output
    ours_txt = model.get_text_features(ids).pooler_output
    torch.testing.assert_close(
        ours_img, clip.get_image_features(pixel_values=pixels).pooler_output, atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        ours_txt, clip.get_text_features(input_ids=ids).pooler_output, atol=1e-5, rtol=0
    )
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.pad_token_id, text.eos_token_id, text.bos_token_id) == (0, EOS, SOT)
    assert (text.attention_dropout, vision.attention_dropout) == (0.05, 0.0)
    assert torch.equal(model.logit_scale, clip.logit_scale)


def test_hf_clip_report_gives_counts_at_info_and_names_at_debug(clip_dir, caplog):
    with caplog.at_level(logging.INFO, logger="modeling_tagclip.convert.tagclip"):
        convert_hf_clip(clip_dir, num_identities=5)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(re.fullmatch(r"kept at init \(not in the source\): \d+ tensors", m) for m in info), info
    assert not any("vision_model." in m for m in info) and len(info) <= 4, info  # no tensor list
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="modeling_tagclip.convert.tagclip"):
        convert_hf_clip(clip_dir, num_identities=5)
    assert "vision_model.embeddings.view_token" in caplog.text


@torch.no_grad()
def test_hf_clip_hrmoe_experts_are_mlp_copies(clip_dir, clip, tmp_path):
    model = convert_hf_clip(clip_dir, tmp_path / "out", num_identities=5)
    vision = model.config.vision_config
    assert vision.block_type == "hrmoe" and vision.use_view_token and vision.moe_layers == [1]
    clip_sd, ours = clip.state_dict(), model.state_dict()
    for layer in range(3):
        prefix = f"vision_model.encoder.layers.{layer}."
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            expected = clip_sd[f"{prefix}mlp.{name}"]
            if layer in vision.moe_layers:
                for expert in range(vision.num_experts):
                    assert torch.equal(ours[f"{prefix}mlp.experts.{expert}.{name}"], expected)
            else:
                assert torch.equal(ours[f"{prefix}mlp.{name}"], expected)
        assert torch.equal(
            ours[f"{prefix}self_attn.q_proj.weight"], clip_sd[f"{prefix}self_attn.q_proj.weight"]
        )
    assert torch.equal(model.logit_scale, clip.logit_scale)
    assert model.classifier.weight.shape == (5, 16)

    loaded = AutoModel.from_pretrained(tmp_path / "out").eval()
    assert isinstance(loaded, TagClipModel)
    image = loaded.get_image_features(_pixels())
    text = loaded.get_text_features(_ids())
    for tensor in (image.pooler_output, image.local_embeds, text.pooler_output, text.local_embeds):
        assert torch.isfinite(tensor).all()
    torch.testing.assert_close(image.pooler_output, model.get_image_features(_pixels()).pooler_output)
    config = (tmp_path / "out" / "config.json").read_text()
    assert '"AutoModel"' in config and (tmp_path / "out" / "modeling_tagclip.py").is_file()


@torch.no_grad()
def test_hf_clip_image_size_interpolates(clip_dir, clip):
    model = convert_hf_clip(clip_dir, block_type="vit", use_view_token=False, image_size=(48, 32))
    assert model.config.vision_config.image_hw == (48, 32)
    expected = interpolate_grid_embeddings(
        clip.vision_model.embeddings.position_embedding.weight, (4, 4), (6, 4)
    )
    torch.testing.assert_close(model.vision_model.embeddings.position_embedding.weight, expected)
    assert torch.isfinite(model.get_image_features(_pixels(48, 32)).pooler_output).all()


def test_hf_clip_overrides_and_legacy_eos(clip_dir):
    overrides = dict(num_experts=4, aerial_experts=[0, 2], ground_experts=[1, 3], moe_top_k=3, tse_ratio=0.5)
    model = convert_hf_clip(clip_dir, moe_layers=[0, 2], **overrides)
    assert model.config.vision_config.moe_layers == [0, 2] and model.config.tse_ratio == 0.5
    legacy_config = tiny_clip_config()
    legacy_config.text_config.eos_token_id, legacy_config.text_config.bos_token_id = (
        2,
        0,
    )  # old OpenAI configs
    legacy = _hf_config_kwargs(legacy_config, "vit", False, 0)
    assert (legacy["text_config"]["eos_token_id"], legacy["text_config"]["bos_token_id"]) == (
        VOCAB - 1,
        VOCAB - 2,
    )
    assert default_moe_layers(12) == [6, 7, 8]
    with pytest.raises(
        ValueError, match=r"visual_projection\.weight: checkpoint shape \(16, 32\) vs model shape \(8, 32\)"
    ):
        convert_hf_clip(clip_dir, projection_dim=8)


# ------------------------------------------------------------------------------------------------------
# Official layouts -> TAG-CLIP
# ------------------------------------------------------------------------------------------------------


def _tagpr_config() -> TagClipConfig:
    return TagClipConfig(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=4,
            num_attention_heads=HEADS,
            image_size=32,
            patch_size=8,
            moe_layers=[1, 2],
            num_experts=3,
            aerial_experts=[0, 1],
            ground_experts=[1, 2],
            moe_top_k=2,
        ),
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            max_position_embeddings=16,
            eos_token_id=EOS,
            bos_token_id=SOT,
        ),
        projection_dim=16,
        tse_embed_dim=24,
        num_identities=5,
    )


def _official_blocks(
    ours: dict, official: dict, tower: str, prefix: str, layers: int, moe: list[int]
) -> None:
    """Inverse mapping of the residual blocks, written from the key list of docs/tagclip-reference.md §8."""
    for i in range(layers):
        p, o = f"{tower}.encoder.layers.{i}.", f"{prefix}.transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            official[f"{o}attn.in_proj_{kind}"] = torch.cat(
                [ours[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv"]
            )
            official[f"{o}attn.out_proj.{kind}"] = ours[f"{p}self_attn.out_proj.{kind}"]
            official[f"{o}ln_1.{kind}"] = ours[f"{p}layer_norm1.{kind}"]
            official[f"{o}ln_2.{kind}"] = ours[f"{p}layer_norm2.{kind}"]
            if i not in moe:
                official[f"{o}mlp.c_fc.{kind}"] = ours[f"{p}mlp.fc1.{kind}"]
                official[f"{o}mlp.c_proj.{kind}"] = ours[f"{p}mlp.fc2.{kind}"]
                continue
            for router in ("img_router", "fea_router"):
                official[f"{o}{router}.{kind}"] = ours[f"{p}mlp.{router}.{kind}"]
            official[f"{o}router.{kind}"] = torch.randn(ours[f"{p}mlp.img_router.{kind}"].shape)  # unused
            for e in range(_count_experts(ours, p)):
                official[f"{o}experts.{e}.c_fc.{kind}"] = ours[f"{p}mlp.experts.{e}.fc1.{kind}"]
                official[f"{o}experts.{e}.c_proj.{kind}"] = ours[f"{p}mlp.experts.{e}.fc2.{kind}"]


def _count_experts(ours: dict, prefix: str) -> int:
    return len({k.split(".experts.")[1].split(".")[0] for k in ours if k.startswith(prefix + "mlp.experts.")})


def _official_tse(ours: dict, official: dict, ours_name: str, name: str, proj: str) -> None:
    for kind in ("weight", "bias"):
        official[f"{name}.{proj}.{kind}"] = ours[f"{ours_name}.proj.{kind}"]
        official[f"{name}.mlp.layers.0.{kind}"] = ours[f"{ours_name}.mlp_fc1.{kind}"]
        official[f"{name}.mlp.layers.1.{kind}"] = ours[f"{ours_name}.mlp_fc2.{kind}"]
    for stat in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
        official[f"{name}.mlp.bns.0.{stat}"] = ours[f"{ours_name}.mlp_bn.{stat}"]
        out_dim = ours[f"{ours_name}.proj.weight"].shape[0]
        official[f"{name}.mlp.bns.1.{stat}"] = (
            torch.ones(()) if stat == "num_batches_tracked" else torch.ones(out_dim)
        )
    if name == "visual_emb_layer":  # unused `linear` of the image layer
        official[f"{name}.linear.weight"] = torch.randn(ours[f"{ours_name}.proj.weight"].shape)
        official[f"{name}.linear.bias"] = torch.zeros(ours[f"{ours_name}.proj.bias"].shape)


def to_official(model: TagClipModel) -> dict[str, torch.Tensor]:
    """Our state_dict in the official TAG-PR layout (docs/tagclip-reference.md §8), with the unused official
    tensors added."""
    ours = {k: v.clone() for k, v in model.state_dict().items()}
    official = {
        "logit_scale": ours["logit_scale"],
        "classifier.weight": ours["classifier.weight"],
        "classifier.bias": ours["classifier.bias"],
        "visual.class_embedding": ours["vision_model.embeddings.class_embedding"],
        "visual.view_token": ours["vision_model.embeddings.view_token"],
        "visual.positional_embedding": ours["vision_model.embeddings.position_embedding.weight"],
        "visual.conv1.weight": ours["vision_model.embeddings.patch_embedding.weight"],
        "visual.proj": ours["visual_projection.weight"].t().contiguous(),
        "encode_text.token_embedding.weight": ours["text_model.embeddings.token_embedding.weight"],
        "encode_text.positional_embedding": ours["text_model.embeddings.position_embedding.weight"],
        "encode_text.text_projection": ours["text_projection.weight"].t().contiguous(),
    }
    for kind in ("weight", "bias"):
        official[f"visual.ln_pre.{kind}"] = ours[f"vision_model.pre_layrnorm.{kind}"]
        official[f"visual.ln_post.{kind}"] = ours[f"vision_model.post_layernorm.{kind}"]
        official[f"encode_text.ln_final.{kind}"] = ours[f"text_model.final_layer_norm.{kind}"]
    vision, text = model.config.vision_config, model.config.text_config
    _official_blocks(ours, official, "vision_model", "visual", vision.num_hidden_layers, vision.moe_layers)
    _official_blocks(ours, official, "text_model", "encode_text", text.num_hidden_layers, [])
    _official_tse(ours, official, "visual_tse", "visual_emb_layer", "fc")
    _official_tse(ours, official, "textual_tse", "textual_emb_layer", "linear")
    return official


def _fake_easydict(monkeypatch) -> type:
    """A module `easydict` with an `EasyDict` behaving like the real one (a dict with attribute access)."""

    class EasyDict(dict):
        def __init__(self, d=None, **kwargs):
            super().__init__()
            for key, value in dict(d or {}, **kwargs).items():
                setattr(self, key, value)

        def __setattr__(self, name, value):
            if isinstance(value, (list, tuple)):
                value = type(value)(self.__class__(x) if isinstance(x, dict) else x for x in value)
            elif isinstance(value, dict) and not isinstance(value, EasyDict):
                value = EasyDict(value)
            super().__setattr__(name, value)
            super().__setitem__(name, value)

        __setitem__ = __setattr__

    EasyDict.__module__, EasyDict.__qualname__ = "easydict", "EasyDict"
    module = types.ModuleType("easydict")
    module.EasyDict = EasyDict
    monkeypatch.setitem(sys.modules, "easydict", module)
    return EasyDict


@pytest.fixture
def tagpr_source() -> TagClipModel:
    torch.manual_seed(0)
    model = TagClipModel(_tagpr_config()).eval()
    _perturb(model)
    return model


@pytest.fixture
def tagpr_checkpoint(tagpr_source, tmp_path, monkeypatch) -> Path:
    EasyDict = _fake_easydict(monkeypatch)
    config = EasyDict(
        experiment={"input_resolution": [32, 32], "dropout": 0.05, "text_length": 16},
        model={"expert_blocks": [1, 2], "num_of_experts": 3, "num_of_selected_experts": 2, "embed_dim": 16},
    )
    path = tmp_path / "checkpoint_best.pth"
    torch.save({"model": to_official(tagpr_source), "config": config, "optimizer": {}}, path)
    monkeypatch.delitem(sys.modules, "easydict")  # the loader must not need it
    return path


def test_official_key_count_matches_spec(tagpr_source):
    official = to_official(tagpr_source)
    vanilla, moe, experts = 2, 2, 3
    # keys (docs/tagclip-reference.md §8): 9 vision + 12 / vanilla block + (14 + 4E) / MoE block;
    # 5 text + 12 / block; TSE 18 + 16; 3
    expected = 9 + 12 * vanilla + (14 + 4 * experts) * moe + 5 + 12 * 2 + 18 + 16 + 3
    assert len(official) == expected
    assert 9 + 12 * 9 + (14 + 4 * 6) * 3 + 5 + 12 * 12 + 18 + 16 + 3 == 417  # the reference's full-size count


@torch.no_grad()
def test_tagpr_round_trip(tagpr_source, tagpr_checkpoint, tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="modeling_tagclip.convert.tagclip"):  # the names: DEBUG
        model = convert_tagpr_checkpoint(
            tagpr_checkpoint, tmp_path / "out", vision_heads=HEADS, text_heads=HEADS
        )
    vision = model.config.vision_config
    assert (vision.block_type, vision.moe_layers, vision.num_experts, vision.moe_top_k) == (
        "hrmoe",
        [1, 2],
        3,
        2,
    )
    assert (vision.aerial_experts, vision.ground_experts, vision.image_hw) == ([0, 1], [1, 2], (32, 32))
    assert model.config.num_identities == 5 and model.config.text_config.eos_token_id == EOS
    source = tagpr_source.state_dict()
    converted = model.state_dict()
    assert converted.keys() == source.keys()
    for key, tensor in source.items():
        assert torch.equal(converted[key], tensor), key
    for dropped in (
        "resblocks.1.router.weight",
        "visual_emb_layer.linear.weight",
        "textual_emb_layer.mlp.bns.1",
    ):
        assert dropped in caplog.text

    pixels, ids = _pixels(), _ids()
    for converted_model in (model, AutoModel.from_pretrained(tmp_path / "out").eval()):
        for ours, ref in (
            (converted_model.get_image_features(pixels), tagpr_source.get_image_features(pixels)),
            (converted_model.get_text_features(ids), tagpr_source.get_text_features(ids)),
        ):
            torch.testing.assert_close(ours.pooler_output, ref.pooler_output, atol=0, rtol=0)
            torch.testing.assert_close(ours.local_embeds, ref.local_embeds, atol=0, rtol=0)


def test_tagpr_num_identities_and_ddp_prefix(tagpr_source, tmp_path):
    path = tmp_path / "bare.pt"
    torch.save({f"module.{k}": v for k, v in to_official(tagpr_source).items()}, path)  # bare DDP state_dict
    model = convert_tagpr_checkpoint(path, num_identities=7, vision_heads=HEADS, text_heads=HEADS)
    assert model.classifier.weight.shape == (7, 16)
    assert (
        convert_tagpr_checkpoint(path, num_identities=0, vision_heads=HEADS, text_heads=HEADS).classifier
        is None
    )


def test_tagpr_mismatch_raises(tagpr_source, tmp_path):
    official = to_official(tagpr_source)
    official["encode_text.ln_final.weight"] = torch.ones(31)
    torch.save(official, tmp_path / "bad.pt")
    with pytest.raises(
        ValueError, match=r"checkpoint does not match: encode_text\.ln_final\.weight.*\(31,\)"
    ):
        convert_tagpr_checkpoint(tmp_path / "bad.pt", vision_heads=HEADS, text_heads=HEADS)
    del official["encode_text.ln_final.weight"]
    torch.save(official, tmp_path / "missing.pt")
    with pytest.raises(
        ValueError, match="checkpoint does not match: missing required keys.*final_layer_norm"
    ):
        convert_tagpr_checkpoint(tmp_path / "missing.pt", vision_heads=HEADS, text_heads=HEADS)


# An independent check of the official layout: the reference forward (nn.MultiheadAttention on in_proj,
# QuickGELU MLP, ln_post + proj on all tokens) on a random TBPS-CLIP-style state_dict.


def _random_official_clip(width=32, layers=2, patch=8, grid=4, vocab=VOCAB, ctx=16, embed=16) -> dict:
    generator = torch.Generator().manual_seed(3)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=generator) * scale

    sd = {
        "logit_scale": torch.tensor(4.6052),
        "visual.class_embedding": rand(width),
        "visual.positional_embedding": rand(grid * grid + 1, width),
        "visual.conv1.weight": rand(width, 3, patch, patch),
        "visual.proj": rand(width, embed),
        "encode_text.token_embedding.weight": rand(vocab, width),
        "encode_text.positional_embedding": rand(ctx, width),
        "encode_text.text_projection": rand(width, embed),
        "simclr_mlp.0.weight": rand(8, embed),  # TBPS extra: not part of TAG-CLIP
    }
    for ln in ("visual.ln_pre", "visual.ln_post", "encode_text.ln_final"):
        sd[f"{ln}.weight"], sd[f"{ln}.bias"] = 1 + rand(width), rand(width)
    for tower in ("visual", "encode_text"):
        for i in range(layers):
            p = f"{tower}.transformer.resblocks.{i}."
            sd |= {
                p + "attn.in_proj_weight": rand(3 * width, width),
                p + "attn.in_proj_bias": rand(3 * width),
            }
            sd |= {p + "attn.out_proj.weight": rand(width, width), p + "attn.out_proj.bias": rand(width)}
            sd |= {p + "mlp.c_fc.weight": rand(4 * width, width), p + "mlp.c_fc.bias": rand(4 * width)}
            sd |= {p + "mlp.c_proj.weight": rand(width, 4 * width), p + "mlp.c_proj.bias": rand(width)}
            for ln in ("ln_1", "ln_2"):
                sd[f"{p}{ln}.weight"], sd[f"{p}{ln}.bias"] = 1 + rand(width), rand(width)
    return sd


def _reference_blocks(x: torch.Tensor, sd: dict, tower: str, mask: torch.Tensor | None) -> torch.Tensor:
    """TBPS/OpenAI ResidualAttentionBlocks, [L, B, D]."""
    width, i = x.shape[-1], 0
    while f"{tower}.transformer.resblocks.{i}.ln_1.weight" in sd:
        p = f"{tower}.transformer.resblocks.{i}."
        attn = nn.MultiheadAttention(width, HEADS)
        attn.load_state_dict({k[len(p) + 5 :]: v for k, v in sd.items() if k.startswith(p + "attn.")})
        h = F.layer_norm(x, (width,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"])
        x = x + attn(h, h, h, need_weights=False, attn_mask=mask)[0]
        h = F.layer_norm(x, (width,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"])
        h = F.linear(h, sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])
        x = x + F.linear(h * torch.sigmoid(1.702 * h), sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
        i += 1
    return x


def _reference_image(sd: dict, pixels: torch.Tensor) -> torch.Tensor:
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=sd["visual.conv1.weight"].shape[-1])
    x = x.flatten(2).transpose(1, 2)
    x = (
        torch.cat([sd["visual.class_embedding"].expand(x.shape[0], 1, -1), x], 1)
        + sd["visual.positional_embedding"]
    )
    width = x.shape[-1]
    x = F.layer_norm(x, (width,), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    x = _reference_blocks(x.transpose(0, 1), sd, "visual", None).transpose(0, 1)
    x = F.layer_norm(x, (width,), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"]) @ sd["visual.proj"]
    return x[:, 0]


def _reference_text(sd: dict, ids: torch.Tensor) -> torch.Tensor:
    x = sd["encode_text.token_embedding.weight"][ids] + sd["encode_text.positional_embedding"][: ids.shape[1]]
    mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)
    x = _reference_blocks(x.transpose(0, 1), sd, "encode_text", mask).transpose(0, 1)
    width = x.shape[-1]
    x = F.layer_norm(x, (width,), sd["encode_text.ln_final.weight"], sd["encode_text.ln_final.bias"])
    x = x @ sd["encode_text.text_projection"]
    return x[torch.arange(x.shape[0]), ids.argmax(-1)]


@torch.no_grad()
def test_tbps_layout_matches_reference_forward(tmp_path, caplog):
    sd = _random_official_clip()
    torch.save({"model": sd}, tmp_path / "tbps.pth")
    with caplog.at_level(logging.WARNING, logger="modeling_tagclip.convert.tagclip"):
        model = convert_tagpr_checkpoint(tmp_path / "tbps.pth", vision_heads=HEADS, text_heads=HEADS)
    assert "simclr_mlp.0.weight" in caplog.text
    config = model.config
    assert config.vision_config.block_type == "vit" and not config.vision_config.use_view_token
    assert not config.use_tse and config.num_identities == 0
    pixels, ids = _pixels(), _ids()
    torch.testing.assert_close(model.get_image_features(pixels).pooler_output, _reference_image(sd, pixels))
    torch.testing.assert_close(model.get_text_features(ids).pooler_output, _reference_text(sd, ids))


@torch.no_grad()
def test_openai_clip_layout_initialises_tagclip(tmp_path):
    sd = _random_official_clip()
    del sd["simclr_mlp.0.weight"]
    openai = {k.removeprefix("encode_text."): v for k, v in sd.items()}
    openai |= {
        "input_resolution": torch.tensor(32),
        "context_length": torch.tensor(16),
        "vocab_size": torch.tensor(VOCAB),
    }
    torch.save(openai, tmp_path / "clip.pt")
    model = convert_tagpr_checkpoint(tmp_path / "clip.pt", vision_heads=HEADS, text_heads=HEADS)
    vision = model.config.vision_config
    assert vision.block_type == "hrmoe" and vision.use_view_token and vision.moe_layers == [1]
    for e in range(vision.num_experts):
        expert = model.vision_model.encoder.layers[1].mlp.experts[e]
        assert torch.equal(expert.fc1.weight, sd["visual.transformer.resblocks.1.mlp.c_fc.weight"])
        assert torch.equal(expert.fc2.bias, sd["visual.transformer.resblocks.1.mlp.c_proj.bias"])
    assert torch.equal(model.logit_scale, sd["logit_scale"])
    torch.testing.assert_close(model.get_text_features(_ids()).pooler_output, _reference_text(sd, _ids()))
    assert torch.isfinite(model.get_image_features(_pixels()).local_embeds).all()


# ------------------------------------------------------------------------------------------------------
# safe_pickle
# ------------------------------------------------------------------------------------------------------


class _Evil:
    def __init__(self, target: Path, via_eval: bool = False):
        self.target, self.via_eval = target, via_eval

    def __reduce__(self):
        if self.via_eval:
            return (eval, (f"__import__('os').system('echo pwned > {self.target}')",))
        return (os.system, (f"echo pwned > {self.target}",))


def test_safe_load_refuses_code(tmp_path):
    target = tmp_path / "PWNED"
    torch.save({"model": {"w": torch.ones(1)}, "x": _Evil(target)}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"refused global '(posix|os|nt)\.system'"):
        safe_torch_load(tmp_path / "evil.pt")
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(_Evil(target, via_eval=True), protocol=4))
    with pytest.raises(UnsafeCheckpointError, match=r"refused global 'builtins\.eval'"):
        safe_torch_load(tmp_path / "evil.pkl")
    with pytest.raises(UnsafeCheckpointError, match="refused global"):
        convert_tagpr_checkpoint(tmp_path / "evil.pt")
    assert not target.exists()


def test_safe_load_easydict_and_formats(tmp_path, monkeypatch):
    EasyDict = _fake_easydict(monkeypatch)
    config = EasyDict(model={"ckpt_type": "saved", "blocks": [6, {"x": 1}]}, experiment={"dropout": 0.05})
    state = {"w": torch.arange(4.0)}
    torch.save({"model": state, "config": config}, tmp_path / "zip.pt")
    torch.save(
        {"model": state, "config": config}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False
    )
    monkeypatch.delitem(sys.modules, "easydict")
    for name in ("zip.pt", "legacy.pt"):
        loaded = safe_torch_load(tmp_path / name)
        assert type(loaded["config"]) is dict and type(loaded["config"]["model"]) is dict
        assert loaded["config"] == {
            "model": {"ckpt_type": "saved", "blocks": [6, {"x": 1}]},
            "experiment": {"dropout": 0.05},
        }
        assert torch.equal(loaded["model"]["w"], state["w"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_safe_load_missing_corrupt_torchscript(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        safe_torch_load(tmp_path / "nope.pt")
    torch.save({"w": torch.ones(100)}, tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(bytes(range(7, 250)))
    for name in ("truncated.pt", "garbage.pt"):
        with pytest.raises(ValueError, match="corrupt checkpoint"):
            safe_torch_load(tmp_path / name)
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), tmp_path / "script.pt")
    with pytest.raises(UnsafeCheckpointError, match="TorchScript"):
        safe_torch_load(tmp_path / "script.pt")


# ------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_hf_clip(clip_dir, tmp_path):
    out = tmp_path / "converted"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "modeling_tagclip.cli", "convert", "hf-clip", str(clip_dir), str(out)]
    result = subprocess.run(
        [*command, "--image-size", "48", "32", "--num-identities", "3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "copied" in result.stderr
    model = AutoModel.from_pretrained(out)
    processor = AutoProcessor.from_pretrained(out)
    assert isinstance(model, TagClipModel) and isinstance(processor, TagClipProcessor)
    assert model.config.vision_config.image_hw == (48, 32) and model.config.num_identities == 3
    assert processor(images=[Image.new("RGB", (40, 60))])["pixel_values"].shape == (1, 3, 48, 32)


def test_hf_clip_conversion_gives_new_parts_the_reference_init(tmp_path):
    """Regression: after `convert hf-clip` the TSE MLP Linears were N(0, 1) (transformers' generic init)."""
    from fixtures import assert_follows_init_rule, init_rule

    widths = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4)
    torch.manual_seed(0)
    clip_config = CLIPConfig(
        text_config=dict(
            vocab_size=VOCAB, max_position_embeddings=16, eos_token_id=EOS, bos_token_id=SOT, **widths
        ),
        vision_config=dict(image_size=32, patch_size=8, **widths),
        projection_dim=256,
    )
    CLIPModel(clip_config).save_pretrained(tmp_path)
    model = convert_hf_clip(tmp_path, tse_embed_dim=512)
    new_parts = [n for n, _ in model.named_parameters() if "_tse." in n or "router" in n or "view_token" in n]
    assert len(new_parts) >= 14
    for name, param in model.named_parameters():
        if name in new_parts:
            assert_follows_init_rule(name, param, init_rule(name, model.config))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_tagpr_refuses_a_non_float_checkpoint(tagpr_source, tmp_path, dtype):
    """Regression: an int64 checkpoint was copied as truncated integers (a 99.6%-zero model, no error)."""
    official = {k: v.to(dtype) for k, v in to_official(tagpr_source).items()}
    torch.save(official, tmp_path / "ints.pt")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"checkpoint does not match: .*dtype {dtype}.*floating-point"):
        convert_tagpr_checkpoint(tmp_path / "ints.pt", out, vision_heads=HEADS, text_heads=HEADS)
    assert not out.exists()


def test_tagpr_refuses_non_finite_weights(tagpr_source, tmp_path):
    official = to_official(tagpr_source)
    official["encode_text.ln_final.weight"] = torch.full((32,), float("nan"))
    torch.save(official, tmp_path / "nan.pt")
    with pytest.raises(ValueError, match=r"encode_text\.ln_final\.weight.*NaN or inf"):
        convert_tagpr_checkpoint(tmp_path / "nan.pt", vision_heads=HEADS, text_heads=HEADS)
