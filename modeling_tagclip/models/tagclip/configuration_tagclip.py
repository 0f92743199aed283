"""TAG-CLIP configuration: vision tower (view token + HR-MoE), text tower, losses and TSE heads.

Defaults reproduce the reference code (CLIP ViT-B/16 at 224x224, experts in blocks 6-8, the reference
orthogonal loss). Where the paper and the reference code differ, the paper's variant is an option:
see `routing` and `ortho_variant`.
"""

import math

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .load_policy import WarnUnknownConfigKeysMixin
from .views import AERIAL, GROUND, VIEW_NAMES

BLOCK_TYPES = ("vit", "moe", "hrmoe")
ROUTING_MODES = ("argmax", "gumbel", "soft", "label")
ORTHO_VARIANTS = ("reference", "paper")


def _as_hw(value: int | list[int] | tuple[int, int]) -> tuple[int, int]:
    """(height, width) from an int or a 2-sequence."""
    if isinstance(value, int):
        return value, value
    if len(value) != 2:
        raise ValueError(f"expected an int or [height, width], got {value!r}")
    return int(value[0]), int(value[1])


@strict
class TagClipVisionConfig(WarnUnknownConfigKeysMixin, PreTrainedConfig):
    r"""
    Configuration of the TAG-CLIP image tower: a CLIP ViT with a view token and (HR-)MoE blocks.

    Args:
        image_size (`int` or `[height, width]`, defaults to 224): input size; non-square person crops
            (e.g. `[384, 128]`) give an (H/patch)x(W/patch) patch grid.
        use_view_token (`bool`, defaults to `True`): append the view token (last, no position embedding);
            it is dropped after the last MoE block. Required by `block_type="hrmoe"`.
        block_type (`str`, defaults to `"hrmoe"`): `"vit"` (plain blocks), `"moe"` (vanilla MoE: feature
            router over all experts, no image-level router or group mask) or `"hrmoe"` (Table 4 ablation).
        moe_layers (`list[int]`, defaults to `[6, 7, 8]`): 0-based indices of the expert blocks.
        num_experts (`int`, defaults to 6): experts per MoE block.
        aerial_experts / ground_experts (`[first, last]`, inclusive, defaults `[0, 4]` / `[1, 5]`): expert
            index ranges of the two groups (TAG-PR Eq. 7 with e0=5, e1=2 in the paper's 1-based terms).
        moe_top_k (`int`, defaults to 5): experts kept per token (Top-K before TAG-PR Eq. 8).
        routing (`str`, defaults to `"argmax"`): group choice of the image-level router. `"argmax"` is
            TAG-PR Eq. 4 (deterministic); `"gumbel"` samples the group from softmax(g_img) as the reference code
            does at train and eval time; `"soft"` mixes both groups by the router's view probability;
            `"label"` routes by the given `view_labels`.
        router_noise_std (`float`, defaults to 0.01): std of the gate noise added in training (reference).
        router_init_std (`float`, defaults to 0.001): init std of both routers (reference).
        moe_dispatch (`str`, defaults to `"sparse"`): `"sparse"` computes only the experts a token uses (on the
            CPU in eager mode one expert at a time on its tokens; on devices and under `torch.compile` sorted by
            expert into grouped GEMMs over chunks of tokens, with no host sync); `"dense"` runs every expert on
            every token (the reference formula, for checks and ONNX export).
        output_router_logits (`bool`, defaults to `False`): return the feature-level routing by default.
    """

    model_type = "tagclip_vision_model"
    base_config_key = "vision_config"

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int | list[int] | tuple[int, int] = 224
    patch_size: int = 16
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float | int = 0.0
    initializer_range: float = 0.02
    initializer_factor: float = 1.0
    use_view_token: bool = True
    block_type: str = "hrmoe"
    moe_layers: list[int] | tuple[int, ...] = (6, 7, 8)
    num_experts: int = 6
    aerial_experts: list[int] | tuple[int, int] = (0, 4)
    ground_experts: list[int] | tuple[int, int] = (1, 5)
    moe_top_k: int = 5
    routing: str = "argmax"
    router_noise_std: float = 0.01
    router_init_std: float = 0.001
    moe_dispatch: str = "sparse"
    output_router_logits: bool = False

    def __post_init__(self, **kwargs):
        self.moe_layers = [int(i) for i in self.moe_layers]
        self.aerial_experts = [int(i) for i in self.aerial_experts]
        self.ground_experts = [int(i) for i in self.ground_experts]
        if not isinstance(self.image_size, int):
            self.image_size = list(_as_hw(self.image_size))
        self.validate_architecture()  # raise a plain ValueError before the strict wrapper does
        super().__post_init__(**kwargs)

    @property
    def image_hw(self) -> tuple[int, int]:
        """Input (height, width)."""
        return _as_hw(self.image_size)

    @property
    def grid_size(self) -> tuple[int, int]:
        """Patch grid (rows, columns)."""
        h, w = self.image_hw
        return h // self.patch_size, w // self.patch_size

    @property
    def num_patches(self) -> int:
        rows, cols = self.grid_size
        return rows * cols

    @property
    def active_moe_layers(self) -> list[int]:
        """MoE block indices, empty for `block_type="vit"`."""
        return [] if self.block_type == "vit" else sorted(self.moe_layers)

    def expert_group(self, group: int) -> list[int]:
        """Expert indices of group 0 (aerial) or 1 (ground)."""
        first, last = self.aerial_experts if group == 0 else self.ground_experts
        return list(range(first, last + 1))

    def validate_architecture(self):
        """Part of `@strict` validation: shapes, MoE layout and routing settings."""
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )
        height, width = self.image_hw
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(f"image_size {height}x{width} is not divisible by patch_size {self.patch_size}.")
        if self.block_type not in BLOCK_TYPES:
            raise ValueError(f"block_type must be one of {BLOCK_TYPES}, got {self.block_type!r}.")
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {ROUTING_MODES}, got {self.routing!r}.")
        if self.moe_dispatch not in ("sparse", "dense"):
            raise ValueError(f"moe_dispatch must be 'sparse' or 'dense', got {self.moe_dispatch!r}.")
        if self.block_type != "vit":
            self._validate_moe()

    def _validate_moe(self):
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if bad or not self.moe_layers or len(set(self.moe_layers)) != len(self.moe_layers):
            raise ValueError(
                f"moe_layers {self.moe_layers} must be distinct block indices in [0, {self.num_hidden_layers})."
            )
        if self.num_experts < 1 or self.moe_top_k < 1:
            raise ValueError("num_experts and moe_top_k must be positive.")
        if self.block_type == "moe":
            if self.moe_top_k > self.num_experts:
                raise ValueError(f"moe_top_k ({self.moe_top_k}) exceeds num_experts ({self.num_experts}).")
            return
        if not self.use_view_token:
            raise ValueError("block_type='hrmoe' routes on the view token: set use_view_token=True.")
        groups = []
        for name, (first, last) in (("aerial", self.aerial_experts), ("ground", self.ground_experts)):
            if not 0 <= first <= last < self.num_experts:
                raise ValueError(
                    f"{name}_experts [{first}, {last}] is empty or outside the experts [0, {self.num_experts - 1}]."
                )
            if self.moe_top_k > last - first + 1:
                raise ValueError(
                    f"moe_top_k ({self.moe_top_k}) is larger than the {name} group ({last - first + 1} experts)."
                )
            groups.append(set(range(first, last + 1)))
        if groups[0] <= groups[1] or groups[1] <= groups[0]:
            raise ValueError(
                f"expert groups overlap completely (aerial {self.aerial_experts}, ground {self.ground_experts}): "
                "each group needs at least one view-specific expert."
            )


@strict
class TagClipTextConfig(WarnUnknownConfigKeysMixin, PreTrainedConfig):
    r"""
    Configuration of the TAG-CLIP text tower (the CLIP text transformer, causal mask only, EOS pooling).

    Args:
        attention_dropout (`float`, defaults to 0.05): the reference's text attention dropout.
        pad_token_id (`int`, defaults to 0): the reference pads with 0 (TSE masks `input_ids != 0`).
        eos_token_id (`int`, defaults to 49407): pooling takes the first EOS position.
    """

    model_type = "tagclip_text_model"
    base_config_key = "text_config"

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float | int = 0.05
    initializer_range: float = 0.02
    initializer_factor: float = 1.0
    pad_token_id: int | None = 0
    bos_token_id: int | None = 49406
    eos_token_id: int | None = 49407

    def validate_architecture(self):
        """Part of `@strict` validation."""
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )


@strict
class TagClipConfig(WarnUnknownConfigKeysMixin, PreTrainedConfig):
    r"""
    Configuration of [`TagClipModel`]: both towers, the TSE heads, the ID classifier and the losses.

    Args:
        projection_dim (`int`, defaults to 512): joint embedding size (v_cls, t_eos).
        logit_scale_init_value (`float`, defaults to ln(1/0.07)): initial log temperature; converting a
            CLIP checkpoint copies CLIP's (ln 100), as the reference does.
        logit_scale_max (`float`, defaults to 100): clamp of exp(logit_scale) in the losses (value only:
            the gradient flows as if unclamped, as in the reference).
        use_tse (`bool`, defaults to `True`): token-selection local features (TSE) and TAG-PR Eq. 2.
        tse_ratio (`float`, defaults to 0.3): fraction of patches/words TSE keeps (58 of 196, 22 of 75).
        tse_embed_dim (`int`, defaults to 1024): TSE output size.
        num_identities (`int`, defaults to 0): classes of the ID classifier; 0 disables it.
        use_id_loss / use_view_loss / use_ortho_loss (`bool`): loss switches (Table 4 ablations).
        lambda_id (`float`, defaults to 0.5): weight of the ID loss in TAG-PR Eq. 12-13.
        lambda_view (`float`, defaults to 1.0): weight of the view loss in TAG-PR Eq. 12-13.
        lambda_ortho (`float`, defaults to 1.0): weight of the orthogonal loss in TAG-PR Eq. 12-13.
        ortho_variant (`str`, defaults to `"reference"`): `"reference"` = 100*max(|cos|-0.001, 0) on the
            ln_2 CLS/view states of every MoE block; `"paper"` = TAG-PR Eq. 10, min(|cos(v_cls, v_view)|, alpha)
            on the final projected CLS and view features.
        ortho_scale (`float`, 100.0) / ortho_margin (`float`, 0.001): the reference hinge.
        ortho_alpha (`float`, defaults to 0.1): the paper's threshold alpha (TAG-PR Eq. 10).
        softlabel_ratio (`float`, defaults to 0.5): N-ITC soft-target weight alpha (ramped by the trainer).
        ritc_eps (`float`, defaults to 0.01): R-ITC epsilon.
        nitc_weight / ritc_weight (`float`, defaults to 1.0): reference `nitc_ratio` / `ritc_ratio`.
    """

    model_type = "tagclip"
    sub_configs_defaults = {"vision_config": TagClipVisionConfig, "text_config": TagClipTextConfig}

    text_config: dict | TagClipTextConfig | None = None
    vision_config: dict | TagClipVisionConfig | None = None
    projection_dim: int = 512
    logit_scale_init_value: float = math.log(1 / 0.07)
    logit_scale_max: float = 100.0
    initializer_factor: float = 1.0
    use_tse: bool = True
    tse_ratio: float = 0.3
    tse_embed_dim: int = 1024
    num_identities: int = 0
    use_id_loss: bool = True
    use_view_loss: bool = True
    use_ortho_loss: bool = True
    lambda_id: float = 0.5
    lambda_view: float = 1.0
    lambda_ortho: float = 1.0
    ortho_variant: str = "reference"
    ortho_scale: float = 100.0
    ortho_margin: float = 0.001
    ortho_alpha: float = 0.1
    softlabel_ratio: float = 0.5
    ritc_eps: float = 0.01
    nitc_weight: float = 1.0
    ritc_weight: float = 1.0

    def __post_init__(self, **kwargs):
        self.validate_architecture()  # raise a plain ValueError before the strict wrapper does
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict` validation."""
        if self.ortho_variant not in ORTHO_VARIANTS:
            raise ValueError(f"ortho_variant must be one of {ORTHO_VARIANTS}, got {self.ortho_variant!r}.")
        if not 0.0 < self.tse_ratio <= 1.0:
            raise ValueError(f"tse_ratio must be in (0, 1], got {self.tse_ratio}.")
        if self.num_identities < 0:
            raise ValueError(f"num_identities must be >= 0, got {self.num_identities}.")
        if not 0.0 <= self.softlabel_ratio <= 1.0:
            raise ValueError(f"softlabel_ratio must be in [0, 1], got {self.softlabel_ratio}.")


__all__ = ["AERIAL", "GROUND", "VIEW_NAMES", "TagClipConfig", "TagClipTextConfig", "TagClipVisionConfig"]
