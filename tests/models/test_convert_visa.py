"""The official-ViSA and timm-ViT converter (modeling_tagclip/convert/visa.py): tensor placement, bad
checkpoints, the ImageNet init, depth inference."""

import pytest
import torch
import torch.nn.functional as F
from fixtures import (
    TINY_VISA,
    VISA_LABELS,
    VISA_VIEWS,
    make_visa_model,
    perturb_,
    tiny_visa_config,
    visa_pixels,
)

from modeling_tagclip.models.visa.configuration_visa import ViSAConfig
from modeling_tagclip.models.visa.modeling_visa import (
    ViSAForReID,
    ViSAModel,
)

VIEWS, LABELS, pixels, make_model = VISA_VIEWS, VISA_LABELS, visa_pixels, make_visa_model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def official_layout(config: ViSAConfig, classes: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict in the official fast-reid layout (docs/visa-reference.md §7 key list), random values,
    for `config`."""
    g = torch.Generator().manual_seed(seed)
    dim, inter, p = config.hidden_size, config.intermediate_size, config.patch_size
    sd: dict[str, torch.Tensor] = {}

    def add(name, *shape):
        sd[name] = torch.randn(*shape, generator=g)

    def block(prefix, mlp, qkv_bias=True, norms=("norm1", "norm2")):
        add(f"{prefix}.attn.qkv.weight", 3 * dim, dim)
        if qkv_bias:
            add(f"{prefix}.attn.qkv.bias", 3 * dim)
        add(f"{prefix}.attn.proj.weight", dim, dim)
        add(f"{prefix}.attn.proj.bias", dim)
        add(f"{prefix}.mlp.fc1.weight", mlp, dim)
        add(f"{prefix}.mlp.fc1.bias", mlp)
        add(f"{prefix}.mlp.fc2.weight", dim, mlp)
        add(f"{prefix}.mlp.fc2.bias", dim)
        for norm in norms:
            add(f"{prefix}.{norm}.weight", dim)
            add(f"{prefix}.{norm}.bias", dim)

    base = "backbone.base"
    for name in ("cls_token", "view_token_sky", "view_token_ground"):
        add(f"{base}.{name}", 1, 1, dim)
    add(f"{base}.pos_embed", 1, 2 + config.num_patches, dim)
    add(f"{base}.patch_embed.proj.weight", dim, 3, p, p)
    add(f"{base}.patch_embed.proj.bias", dim)
    for i in range(config.num_hidden_layers):
        block(f"{base}.blocks.{i}", inter)
    add(f"{base}.norm.weight", dim)
    add(f"{base}.norm.bias", dim)
    block("backbone.b1.0", inter)
    add("backbone.b1.1.weight", dim)
    add("backbone.b1.1.bias", dim)
    for group in ("share", "sky", "ground"):
        add(f"backbone.{group}_router.gate.weight", config.num_experts, dim)
        add(f"backbone.{group}_router.gate.bias", config.num_experts)
        for e in range(config.num_experts):
            prefix = f"backbone.{group}_experts.{e}"
            add(f"{prefix}.prompt", 1, config.num_prompt_tokens, dim)
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                add(f"{prefix}.prm.cross_attn.{proj}.weight", dim, dim)
                add(f"{prefix}.prm.cross_attn.{proj}.bias", dim)
            block(f"{prefix}.prm", config.expert_intermediate_size, False, ("norm1", "norm2", "norm3"))
    add("backbone.share_gcn.gcn_weights", dim, dim)
    add("backbone.view_gcn.gcn_weights", dim, dim)
    for name in ("norm_share", "norm_view"):
        add(f"backbone.{name}.weight", dim)
        add(f"backbone.{name}.bias", dim)
    block("backbone.final_attn_token_to_image", config.fusion_intermediate_size, False, ("norm2", "norm3"))
    add("backbone.out_token", 1, dim)
    add("backbone.image_pe", 1, config.num_patches, dim)
    for head, n in (("heads", classes), ("local_heads", classes), ("view_heads", 2)):
        add(f"{head}.weight", n, dim)
        add(f"{head}.bottleneck.0.weight", dim)
        sd[f"{head}.bottleneck.0.bias"] = torch.zeros(dim)
        add(f"{head}.bottleneck.0.running_mean", dim)
        sd[f"{head}.bottleneck.0.running_var"] = torch.rand(dim, generator=g) + 0.5
        sd[f"{head}.bottleneck.0.num_batches_tracked"] = torch.tensor(1234)
    return sd


GEOMETRY = {
    k: TINY_VISA[k]
    for k in ("image_size", "patch_size", "patch_stride", "num_attention_heads", "graph_top_k")
}


@pytest.fixture(scope="module")
def official_checkpoint(tmp_path_factory):
    config = tiny_visa_config()
    sd = official_layout(config)
    path = tmp_path_factory.mktemp("official") / "model_best.pth"
    torch.save({"model": {f"module.{k}": v for k, v in sd.items()}, "epoch": 3, "metric": 0.5}, path)
    return path, sd


def timm_block(sd: dict, prefix: str, x: torch.Tensor, heads: int) -> torch.Tensor:
    """timm `Block.forward` on the official fused tensors (qkv rows [q; k; v], heads contiguous)."""
    batch, tokens, dim = x.shape
    h = F.layer_norm(x, (dim,), sd[f"{prefix}.norm1.weight"], sd[f"{prefix}.norm1.bias"], eps=1e-6)
    qkv = (h @ sd[f"{prefix}.attn.qkv.weight"].t() + sd[f"{prefix}.attn.qkv.bias"]).reshape(
        batch, tokens, 3, heads, -1
    )
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    attn = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1)
    x = x + (attn @ v).transpose(1, 2).reshape(batch, tokens, dim) @ sd[f"{prefix}.attn.proj.weight"].t()
    x = x + sd[f"{prefix}.attn.proj.bias"]
    h = F.layer_norm(x, (dim,), sd[f"{prefix}.norm2.weight"], sd[f"{prefix}.norm2.bias"], eps=1e-6)
    h = F.gelu(h @ sd[f"{prefix}.mlp.fc1.weight"].t() + sd[f"{prefix}.mlp.fc1.bias"])
    return x + h @ sd[f"{prefix}.mlp.fc2.weight"].t() + sd[f"{prefix}.mlp.fc2.bias"]


def test_converter_places_official_tensors(official_checkpoint, tmp_path):
    from modeling_tagclip.convert.visa import convert_checkpoint, to_official_state_dict

    path, sd = official_checkpoint
    model, report = convert_checkpoint(path, tmp_path / "converted", **GEOMETRY)
    assert model.config.num_identities == 4 and model.config.num_prompt_tokens == 2
    assert report["dropped_never_executed"] == sorted(
        [k for k in sd if k.startswith(("backbone.base.blocks.2.", "backbone.base.norm."))]
        + ["backbone.image_pe", "backbone.view_gcn.gcn_weights"]
    )
    state, dim = model.state_dict(), 32
    assert torch.equal(
        state["visa.encoder.layers.2.self_attn.q_proj.weight"], sd["backbone.b1.0.attn.qkv.weight"][:dim]
    )
    assert torch.equal(
        state["visa.encoder.layers.0.self_attn.k_proj.bias"],
        sd["backbone.base.blocks.0.attn.qkv.bias"][dim : 2 * dim],
    )
    assert torch.equal(
        state["visa.etgm.aerial.experts.1.self_attn.v_proj.weight"],
        sd["backbone.sky_experts.1.prm.attn.qkv.weight"][2 * dim :],
    )
    assert torch.equal(state["visa.dlfm.shared_gcn.weight"], sd["backbone.share_gcn.gcn_weights"].t())
    assert int(state["visa.global_bnneck.num_batches_tracked"]) == 1234
    assert torch.equal(state["view_classifier.weight"], sd["view_heads.weight"])
    # semantics: our trunk block == timm's block on the fused official tensors
    x = torch.randn(2, 23, dim)
    with torch.no_grad():
        torch.testing.assert_close(
            model.visa.encoder.layers[0](x),
            timm_block(sd, "backbone.base.blocks.0", x, 4),
            atol=1e-4,
            rtol=1e-4,
        )
    # round trip: back to the official layout, every executed tensor identical
    back = to_official_state_dict(model)
    dropped = set(report["dropped_never_executed"])
    assert set(back) == set(sd) - dropped
    assert all(torch.equal(back[k], sd[k]) for k in back)
    # the saved folder reloads with identical outputs
    reloaded = ViSAForReID.from_pretrained(tmp_path / "converted").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(pixels(), view_labels=VIEWS).embeddings, model(pixels(), view_labels=VIEWS).embeddings
        )


def test_converter_bad_checkpoints(official_checkpoint, tmp_path):
    from modeling_tagclip.convert.safe_pickle import UnsafeCheckpointError
    from modeling_tagclip.convert.visa import convert_checkpoint, convert_state_dict

    _, sd = official_checkpoint
    config = tiny_visa_config()
    with pytest.raises(ValueError, match="missing 'backbone.b1.1.weight'"):
        convert_state_dict({k: v for k, v in sd.items() if k != "backbone.b1.1.weight"}, config)
    with pytest.raises(ValueError, match="unexpected keys"):
        convert_state_dict({**sd, "backbone.extra.weight": torch.zeros(1)}, config)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pth"
    torch.save({"model": {"x": Evil()}}, evil)
    with pytest.raises(UnsafeCheckpointError):
        convert_checkpoint(evil)


def test_imagenet_vit_init_with_position_quirk():
    from modeling_tagclip.convert.visa import load_imagenet_vit

    config = tiny_visa_config()
    timm = {
        k.removeprefix("backbone.base."): v
        for k, v in official_layout(config).items()
        if k.startswith("backbone.base.")
    }
    timm["pos_embed"] = torch.randn(1, 1 + 16, 32)  # a 4x4 grid
    timm["head.weight"] = torch.zeros(10, 32)
    model = ViSAModel(config)
    report = load_imagenet_vit(model, timm)
    assert not report["unexpected"]
    assert all(
        k.startswith(("etgm", "dlfm", "fusion", "global_bnneck", "local_bnneck", "embeddings.view"))
        for k in report["missing"]
    )
    pos = model.embeddings.position_embedding[0]
    assert torch.equal(pos[0], timm["pos_embed"][0, 0]) and torch.equal(pos[1], timm["pos_embed"][0, 1])
    assert pos.shape == (2 + 21, 32)
    assert torch.equal(model.encoder.layers[2].mlp.fc1.weight, timm["blocks.2.mlp.fc1.weight"])
    assert torch.equal(model.final_layer_norm.weight, timm["norm.weight"])


def test_converter_infers_depth_of_an_executed_only_export(tmp_path):
    """Regression: a 4-block model exported by `to_official_state_dict` (no never-executed block) came back
    with 3 blocks; a geometry the converter cannot read is refused with the fields to pass."""
    from modeling_tagclip.convert.visa import convert_checkpoint, infer_config, to_official_state_dict

    torch.manual_seed(0)
    source = perturb_(ViSAForReID(tiny_visa_config(num_hidden_layers=4))).eval()
    official = to_official_state_dict(source)
    path = tmp_path / "export.pth"
    torch.save({"model": official}, path)
    model, _ = convert_checkpoint(path, **GEOMETRY)
    assert model.config.num_hidden_layers == 4
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(pixels(), view_labels=VIEWS).embeddings,
            source(pixels(), view_labels=VIEWS).embeddings,
        )
    with pytest.raises(ValueError, match="cannot infer the input geometry.*image_size and patch_stride"):
        infer_config(official, num_attention_heads=4)
    with pytest.raises(ValueError, match="cannot infer num_attention_heads: width 32"):
        infer_config(official, image_size=[32, 16], patch_stride=[4, 4])
    with pytest.raises(ValueError, match="the config gives 8 patches .* has 21"):
        infer_config(official, **{**GEOMETRY, "patch_stride": [8, 8]})
    gap = {k: v for k, v in official.items() if not k.startswith("backbone.base.blocks.1.")}
    with pytest.raises(ValueError, match=r"trunk blocks \[0, 2\] are not contiguous"):
        infer_config(gap, **GEOMETRY)
