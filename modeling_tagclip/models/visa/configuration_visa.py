"""ViSA configuration: view-aware ViT backbone (VAB), ETGM experts, DLFM graph fusion, BNNeck heads, losses.

Defaults reproduce the reference code's CARGO / AG-ReID.v2 config (`configs/*/visa.yml`): ViT-B, 256x128
input, overlapping 16x16 patches with stride 12 (21x10 = 210 patches), two view tokens, 3 x 8 prompt experts
with M = 16 tokens and top-2 routing, top-64 graph neighbours. Presets (`ViSAConfig.from_preset`) give the
LAGPeR config, VDT and the plain-ViT baseline. Where the paper and the code differ the code is the default
and the paper's reading is an option (`dlfm_gcn`, `view_label_convention`, `dlfm_graph_no_grad`).
"""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .load_policy import WarnUnknownConfigKeysMixin

VIEW_TOKEN_MODES = ("dual", "shared", "none")
DLFM_GCN_MODES = ("shared", "per_branch")
VIEW_LABEL_CONVENTIONS = ("reference", "project")

PRESETS: dict[str, dict] = {
    "cargo": {},
    "agreidv2": {},
    "lagper": {"patch_stride": [12, 10], "num_prompt_tokens": 8, "expert_top_k": 3},
    "vdt": {
        "patch_stride": [16, 16],
        "view_tokens": "shared",
        "subtract_last_block": True,
        "use_etgm": False,
        "use_dlfm": False,
        "lambda_view": 0.001,
        "lambda_ortho": 0.001,
    },
    "vit": {"view_tokens": "none", "use_etgm": False, "use_dlfm": False},
}


def _as_pair(value: int | list[int] | tuple[int, int], name: str) -> list[int]:
    """[a, b] from an int or a 2-sequence."""
    if isinstance(value, int):
        return [value, value]
    if len(value) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {value!r}")
    return [int(value[0]), int(value[1])]


@strict
class ViSAConfig(WarnUnknownConfigKeysMixin, PreTrainedConfig):
    r"""
    Configuration of [`ViSAModel`] / [`ViSAForReID`] (View-aware Semantic Alignment for aerial-ground re-ID).

    Args:
        image_size (`[height, width]`, defaults to `[256, 128]`): input size.
        patch_size (`int`, defaults to 16): patch kernel; patches overlap when `patch_stride` < `patch_size`.
        patch_stride (`[sy, sx]`, defaults to `[12, 12]`): patch-embedding stride (LAGPeR `[12, 10]`, VDT 16).
        layer_norm_eps (`float`, defaults to 1e-6): trunk, block-12 copy and final LayerNorm.
        head_layer_norm_eps (`float`, defaults to 1e-5): ETGM, DLFM and fusion LayerNorms (post-norm blocks).
        drop_path_rate (`float`, defaults to 0.1): stochastic depth, linear 0 -> rate over the blocks.
        view_tokens (`str`, defaults to `"dual"`): `"dual"` = ViSA's aerial + ground view tokens chosen by the
            view label (VAB); `"shared"` = VDT's single view token; `"none"` = plain ViT (VAB off, Table 2).
        subtract_last_block (`bool`, defaults to `False`): also subtract the view token from CLS after the last
            block (VDT); ViSA subtracts after blocks 1..L-1 only.
        use_etgm (`bool`, defaults to `True`): expert-driven token generation (Table 2). Off: each branch's
            query is its input feature itself (M = 1).
        num_experts (`int`, defaults to 8): prompt experts per set (shared, aerial, ground).
        num_prompt_tokens (`int`, defaults to 16): tokens per expert, M.
        expert_top_k (`int`, defaults to 2): experts mixed per sample.
        expert_intermediate_size (`int`, defaults to 1536): expert MLP width (ratio 2).
        use_dlfm (`bool`, defaults to `True`): dual-branch graph fusion (Table 2). Off (with ETGM on): the
            queries go to the fusion block unrefined.
        graph_top_k (`int`, defaults to 64): patches per query graph (ViSA Eq. 8).
        dlfm_gcn (`str`, defaults to `"shared"`): `"shared"` = the reference's single GCN used by both branches;
            `"per_branch"` = the paper's dedicated GCN per branch (ViSA Eq. 12).
        dlfm_graph_no_grad (`bool`, defaults to `True`): build the graph input without gradient (reference:
            only the GCN weight and norms learn from the graph path; the queries through the residual).
        fusion_intermediate_size (`int`, defaults to 3072): MLP width of the fusion block.
        num_identities (`int`, defaults to 0): ID classes of [`ViSAForReID`]; 0 = no classifiers.
        view_label_convention (`str`, defaults to `"reference"`): class order of the view classifier.
            Inputs always use 0 = aerial, 1 = ground (as the reference's token/expert choice); `"reference"`
            trains the view head with aerial = 1 / ground = 0 as the reference loss does, `"project"` with
            the input labels as they are.
        bnneck_global_update (`bool`, defaults to `True`): in training also pass the global CLS feature through
            the ID BNNeck (no loss), updating its running statistics as the reference does.
        lambda_id / lambda_triplet / lambda_local (`float`): weights of the ID CE, triplet and local terms (1).
        lambda_view / lambda_ortho (`float`, defaults to 1.0): view CE and orthogonal loss (VDT: 0.001).
        lambda_balance (`float`, defaults to 1e-4): load-balancing weight (ViSA Eq. 20's lambda).
        triplet_margin (`float`, defaults to 0.0): 0 = soft-margin triplet (reference), else hinge margin.
    """

    model_type = "visa"

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: list[int] | tuple[int, int] = (256, 128)
    patch_size: int = 16
    patch_stride: int | list[int] | tuple[int, int] = (12, 12)
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-6
    head_layer_norm_eps: float = 1e-5
    attention_dropout: float | int = 0.0
    drop_path_rate: float | int = 0.1
    initializer_range: float = 0.02
    view_tokens: str = "dual"
    subtract_last_block: bool = False
    use_etgm: bool = True
    num_experts: int = 8
    num_prompt_tokens: int = 16
    expert_top_k: int = 2
    expert_intermediate_size: int = 1536
    use_dlfm: bool = True
    graph_top_k: int = 64
    dlfm_gcn: str = "shared"
    dlfm_graph_no_grad: bool = True
    fusion_intermediate_size: int = 3072
    num_identities: int = 0
    view_label_convention: str = "reference"
    bnneck_global_update: bool = True
    lambda_id: float = 1.0
    lambda_triplet: float = 1.0
    lambda_local: float = 1.0
    lambda_view: float = 1.0
    lambda_ortho: float = 1.0
    lambda_balance: float = 1e-4
    triplet_margin: float = 0.0

    def __post_init__(self, **kwargs):
        self.image_size = _as_pair(self.image_size, "image_size")
        self.patch_stride = _as_pair(self.patch_stride, "patch_stride")
        self.validate_architecture()  # a plain ValueError before the strict wrapper's
        super().__post_init__(**kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ViSAConfig":
        """Config of a named preset: cargo, agreidv2, lagper (reference configs), vdt, vit (baselines)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def grid_size(self) -> tuple[int, int]:
        """Patch grid (rows, columns): (H - patch) // stride + 1 per axis."""
        (height, width), (sy, sx) = self.image_size, self.patch_stride
        return (height - self.patch_size) // sy + 1, (width - self.patch_size) // sx + 1

    @property
    def num_patches(self) -> int:
        rows, cols = self.grid_size
        return rows * cols

    @property
    def num_prefix_tokens(self) -> int:
        """CLS plus the view token (if any)."""
        return 1 if self.view_tokens == "none" else 2

    @property
    def has_view_branch(self) -> bool:
        """Whether a view-specific feature z_spe exists (view tokens on)."""
        return self.view_tokens != "none"

    @property
    def has_local_branch(self) -> bool:
        """Whether the fusion block and its local feature f_loc exist (ETGM or DLFM on)."""
        return self.use_etgm or self.use_dlfm

    @property
    def queries_per_branch(self) -> int:
        """Query tokens per branch: M with ETGM, else 1 (the branch feature itself)."""
        return self.num_prompt_tokens if self.use_etgm else 1

    @property
    def embedding_dim(self) -> int:
        """Size of the test embedding: concat(BN(z_inv), BN(f_loc)) or BN(z_inv) alone."""
        return self.hidden_size * (2 if self.has_local_branch else 1)

    def validate_architecture(self):
        """Part of `@strict` validation: shapes, modes and module sizes."""
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )
        self._validate_patches()
        for name, value, options in (
            ("view_tokens", self.view_tokens, VIEW_TOKEN_MODES),
            ("dlfm_gcn", self.dlfm_gcn, DLFM_GCN_MODES),
            ("view_label_convention", self.view_label_convention, VIEW_LABEL_CONVENTIONS),
        ):
            if value not in options:
                raise ValueError(f"{name} must be one of {options}, got {value!r}.")
        if self.subtract_last_block and self.view_tokens == "none":
            raise ValueError("subtract_last_block needs view tokens (view_tokens='dual' or 'shared').")
        if self.use_etgm:
            self._validate_experts()
        if self.use_dlfm and not 1 <= self.graph_top_k <= self.num_patches:
            raise ValueError(
                f"graph_top_k must be in [1, num_patches={self.num_patches}], got {self.graph_top_k}."
            )
        if self.num_identities < 0:
            raise ValueError(f"num_identities must be >= 0, got {self.num_identities}.")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}.")

    def _validate_patches(self):
        (height, width), (sy, sx) = self.image_size, self.patch_stride
        if min(sy, sx, self.patch_size) < 1:
            raise ValueError(
                f"patch_size and patch_stride must be positive, got {self.patch_size}, {[sy, sx]}."
            )
        if height < self.patch_size or width < self.patch_size:
            raise ValueError(f"image_size {height}x{width} is smaller than patch_size {self.patch_size}.")

    def _validate_experts(self):
        if self.num_experts < 1 or self.num_prompt_tokens < 1:
            raise ValueError("num_experts and num_prompt_tokens must be positive.")
        if not 1 <= self.expert_top_k <= self.num_experts:
            raise ValueError(
                f"expert_top_k must be in [1, num_experts={self.num_experts}], got {self.expert_top_k}."
            )


__all__ = ["ViSAConfig"]
