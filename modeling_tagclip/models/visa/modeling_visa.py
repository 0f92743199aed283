"""PyTorch ViSA: View-aware Semantic Alignment for aerial-ground person re-identification.

Paper: "View-Aware Semantic Alignment for Aerial-Ground Person Re-Identification" (ViSA); facts from the
reference code in docs/visa-reference.md. Pipeline (paper §3.2): view-aware ViT (VAB, VDT's subtractive view
tokens) -> z_inv, z_spe -> ETGM prompt experts (ViSA Eq. 7) -> DLFM query graphs over the top-k patches
(ViSA Eq. 8-12) -> fusion block with a learned output token (ViSA Eq. 13) -> BNNeck'd concat(z_inv, f_loc).

Reference behaviour kept on purpose (documented in the config): both DLFM branches use one GCN
(`dlfm_gcn="shared"`), the graph input is built without gradient, the view classifier is trained with
aerial = 1 / ground = 0 while inputs use aerial = 0 / ground = 1, and the ID BNNeck also sees the CLS
feature in training. Unused reference modules (trunk block 12 and norm, `view_gcn`, `image_pe`) are not
created; `visa_complexity` still counts them the way the paper does.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .attention import SelfAttention, eager_attention_forward
from .configuration_visa import ViSAConfig
from .device_ops import (
    check_on_device,
    grouped_gemm_syncs,
    grouped_linear,
)
from .load_policy import ClearLoadErrorsMixin, OwnInitMixin
from .losses_visa import etgm_balance_loss, orthogonal_loss, total_loss, triplet_loss, view_loss, visa_id_loss
from .validation import check_pixel_values, check_view_labels
from .views import AERIAL


class ViSAAttention(SelfAttention):
    """Multi-head attention of the trunk, the fusion block and the prompt experts (q/k/v/out as CLIP's)."""


# ---------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ViSAModelOutput(BaseModelOutputWithPooling):
    r"""
    Output of [`ViSAModel`].

    Args:
        last_hidden_state (`torch.Tensor` of shape `(batch, prefix + num_patches, hidden_size)`): last block +
            final LayerNorm.
        pooler_output (`torch.Tensor` of shape `(batch, embedding_dim)`): the test embedding,
            concat(BNNeck(z_inv), BNNeck(f_loc)) (1536-d for ViSA-B), not L2-normalised.
        hidden_states (`tuple(torch.Tensor)`, *optional*): embeddings + each block's output (CLS already minus the
            view token where the block subtracts).
        attentions (`tuple(torch.Tensor)`, *optional*): trunk attention weights (eager attention).
        global_features (`torch.Tensor` of shape `(batch, hidden_size)`): g, the normed CLS token.
        invariant_features (`torch.Tensor` of shape `(batch, hidden_size)`): z_inv = g - z_spe (g without views).
        specific_features (`torch.Tensor` of shape `(batch, hidden_size)`, *optional*): z_spe, the normed view token.
        local_features (`torch.Tensor` of shape `(batch, hidden_size)`, *optional*): f_loc, the fusion output token.
        global_embeds / local_embeds (`torch.Tensor`): BNNeck(z_inv) and BNNeck(f_loc), the two embedding halves.
        invariant_queries / specific_queries (`torch.Tensor` of shape `(batch, M, hidden_size)`, *optional*): the
            (DLFM-refined) query tokens of the two branches.
        router_logits (`tuple(torch.Tensor)`, *optional*): ETGM router logits (shared over the batch, aerial over
            the aerial samples, ground over the ground samples, in batch order); `None` entries for absent views.
    """

    global_features: torch.Tensor | None = None
    invariant_features: torch.Tensor | None = None
    specific_features: torch.Tensor | None = None
    local_features: torch.Tensor | None = None
    global_embeds: torch.Tensor | None = None
    local_embeds: torch.Tensor | None = None
    invariant_queries: torch.Tensor | None = None
    specific_queries: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor | None, ...] | None = None


@dataclass
class ViSAForReIDOutput(ModelOutput):
    r"""
    Output of [`ViSAForReID`].

    Args:
        loss (`torch.Tensor`, *optional*): total loss, ViSA Eq. 20 (with `labels`).
        loss_id, loss_triplet (`torch.Tensor`, *optional*): global ID CE (ViSA Eq. 14) and triplet (ViSA Eq. 15) on z_inv.
        loss_local_id, loss_local_triplet (`torch.Tensor`, *optional*): the same on f_loc.
        loss_view, loss_ortho, loss_balance (`torch.Tensor`, *optional*): ViSA Eq. 16, 17 and 18-19, weighted.
        logits, local_logits (`torch.Tensor` of shape `(batch, num_identities)`, *optional*): ID classifiers.
        view_logits (`torch.Tensor` of shape `(batch, 2)`, *optional*): view classifier (class order per
            `config.view_label_convention`).
        embeddings (`torch.Tensor` of shape `(batch, embedding_dim)`): the test embedding (unnormalised).
        invariant_features, specific_features, local_features (`torch.Tensor`, *optional*): pre-BNNeck features.
        router_logits (`tuple(torch.Tensor)`, *optional*): ETGM router logits, as [`ViSAModelOutput`].
        hidden_states, attentions (`tuple(torch.Tensor)`, *optional*): trunk states and attention weights.
    """

    loss: torch.Tensor | None = None
    loss_id: torch.Tensor | None = None
    loss_triplet: torch.Tensor | None = None
    loss_local_id: torch.Tensor | None = None
    loss_local_triplet: torch.Tensor | None = None
    loss_view: torch.Tensor | None = None
    loss_ortho: torch.Tensor | None = None
    loss_balance: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    local_logits: torch.Tensor | None = None
    view_logits: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    invariant_features: torch.Tensor | None = None
    specific_features: torch.Tensor | None = None
    local_features: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor | None, ...] | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


# ---------------------------------------------------------------------------------------------------------
# Backbone (VAB): overlapping patches, view tokens, pre-norm ViT blocks with CLS - view subtraction
# ---------------------------------------------------------------------------------------------------------


def required_view_labels(view_labels: torch.Tensor | None, batch: int, needed: bool) -> torch.Tensor | None:
    """`check_view_labels`, and a clear ValueError if they are missing where the config needs them."""
    if view_labels is None and needed:
        raise ValueError(
            "this ViSA config needs view_labels (0 = aerial, 1 = ground, one per image), also at test time: "
            "they pick the view token and the view experts. Get them from the camera ids."
        )
    return check_view_labels(view_labels, batch)


class ViSAEmbeddings(nn.Module):
    """Overlapping patch embedding (Conv with bias), CLS, view token(s) and learned position embeddings."""

    def __init__(self, config: ViSAConfig):
        super().__init__()
        self.config = config
        dim = config.hidden_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, dim, kernel_size=config.patch_size, stride=tuple(config.patch_stride)
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.view_token_aerial = self.view_token_ground = self.view_token = None
        if config.view_tokens == "dual":
            self.view_token_aerial = nn.Parameter(torch.zeros(1, 1, dim))
            self.view_token_ground = nn.Parameter(torch.zeros(1, 1, dim))
        elif config.view_tokens == "shared":
            self.view_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.position_embedding = nn.Parameter(
            torch.zeros(1, config.num_prefix_tokens + config.num_patches, dim)
        )

    def check_pixel_values(self, pixel_values: torch.Tensor) -> None:
        """Raise a clear ValueError for raw (integer) pixels, a wrongly shaped image batch or NaN/inf pixels."""
        expected = (self.config.num_channels, *self.config.image_size)
        hint = "Resize to config.image_size and normalise with mean = std = 0.5."
        check_pixel_values(pixel_values, expected, lambda shape: hint)

    def view_token_for(self, view_labels: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        """[B, 1, D] view token per image: aerial / ground by label (dual) or the shared one."""
        if self.view_token is not None:
            return self.view_token.expand(batch, -1, -1)
        if self.view_token_aerial is None:
            return None
        is_aerial = (view_labels == AERIAL).to(self.view_token_aerial.device)[:, None, None]
        return torch.where(is_aerial, self.view_token_aerial, self.view_token_ground)

    def forward(self, pixel_values: torch.Tensor, view_labels: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens of images that `check_pixel_values` accepted (`ViSAModel.forward` checks them first)."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # token = row * num_x + col
        batch = patches.shape[0]
        tokens = [self.cls_token.expand(batch, -1, -1)]
        view = self.view_token_for(view_labels, batch)
        if view is not None:
            tokens.append(view)
        return torch.cat([*tokens, patches], dim=1) + self.position_embedding


def drop_path(hidden_states: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth per sample (timm `drop_path`)."""
    if rate == 0.0 or not training:
        return hidden_states
    keep = 1.0 - rate
    mask = hidden_states.new_empty((hidden_states.shape[0],) + (1,) * (hidden_states.ndim - 1)).bernoulli_(
        keep
    )
    return hidden_states * mask / keep


class ViSAMLP(nn.Module):
    """fc1 -> activation -> fc2."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "gelu"):
        super().__init__()
        self.activation_fn = ACT2FN[hidden_act]
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


class ViSAEncoderLayer(GradientCheckpointingLayer):
    """Pre-norm ViT block with DropPath; optionally CLS <- CLS - view token afterwards (VDT subtraction)."""

    def __init__(self, config: ViSAConfig, drop_path_rate: float = 0.0):
        super().__init__()
        self.drop_path_rate = drop_path_rate
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ViSAAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ViSAMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, hidden_states: torch.Tensor, subtract_view: bool = False, **kwargs) -> torch.Tensor:
        attn_out = self.self_attn(self.layer_norm1(hidden_states), **kwargs)[0]
        hidden_states = hidden_states + drop_path(attn_out, self.drop_path_rate, self.training)
        mlp_out = self.mlp(self.layer_norm2(hidden_states))
        hidden_states = hidden_states + drop_path(mlp_out, self.drop_path_rate, self.training)
        if subtract_view:
            hidden_states = torch.cat(
                [hidden_states[:, :1] - hidden_states[:, 1:2], hidden_states[:, 1:]], dim=1
            )
        return hidden_states


# ---------------------------------------------------------------------------------------------------------
# ETGM: routed mixtures of prompt experts (ViSA Eq. 7)
# ---------------------------------------------------------------------------------------------------------


class ViSAPromptAttention(ViSAAttention):
    """Self-attention of the post-norm blocks: q/k/v without bias (timm `Attention(qkv_bias=False)`)."""

    def __init__(self, config: ViSAConfig):
        super().__init__(config)
        dim = config.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))


class ViSACrossAttention(ViSAAttention):
    """Cross-attention of the prompt tokens to the expert's input token(s) (q/k/v/out with bias)."""

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor, **kwargs) -> torch.Tensor:
        """`hidden_states` [b, M, D] query `context` [b, n, D]; with one context token the softmax is 1."""
        queries = self.q_proj(hidden_states).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        keys = self.k_proj(context).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        values = self.v_proj(context).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, _ = attention_interface(
            self, queries, keys, values, None, scaling=self.scale, dropout=0.0, **kwargs
        )
        return self.out_proj(attn_output.reshape(*hidden_states.shape[:-1], -1))


class ViSAPostNormBlock(nn.Module):
    """Post-norm block x = LN2(x + SelfAttn(x)); x = LN3(x + MLP(x)) (reference expert and fusion tail)."""

    def __init__(self, config: ViSAConfig, intermediate_size: int):
        super().__init__()
        eps = config.head_layer_norm_eps
        self.self_attn = ViSAPromptAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = ViSAMLP(config.hidden_size, intermediate_size, config.hidden_act)
        self.norm3 = nn.LayerNorm(config.hidden_size, eps=eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.norm2(hidden_states + self.self_attn(hidden_states)[0])
        return self.norm3(hidden_states + self.mlp(hidden_states))


class ViSAPromptExpert(ViSAPostNormBlock):
    """One ETGM expert, ViSA Eq. 7: M learned tokens -> CrossAttn(tokens, z) -> SelfAttn -> FFN (post-norm)."""

    def __init__(self, config: ViSAConfig):
        super().__init__(config, config.expert_intermediate_size)
        self.prompt = nn.Parameter(torch.zeros(1, config.num_prompt_tokens, config.hidden_size))
        self.cross_attn = ViSACrossAttention(config)
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.head_layer_norm_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """`features` [b, D] (z_inv or z_spe) -> expert tokens [b, M, D]."""
        prompt = self.prompt.expand(features.shape[0], -1, -1)
        tokens = self.norm1(prompt + self.cross_attn(prompt, features[:, None]))
        return super().forward(tokens)


def topk_routing(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Dense [n, E] expert weights: softmax over each row's top-k logits, 0 elsewhere (reference `Router`)."""
    top_logits, top_index = router_logits.topk(top_k, dim=-1)
    return torch.zeros_like(router_logits).scatter(-1, top_index, F.softmax(top_logits, dim=-1))


def grouped_rows(inputs: torch.Tensor, layers: list[nn.Linear], index: torch.Tensor, offsets, rows: int):
    """`grouped_linear` for pairs of `rows` consecutive rows each (pair p uses expert `index[p]`)."""
    return grouped_linear(inputs, layers, index.repeat_interleave(rows), offsets * rows)


def grouped_norm(tokens: torch.Tensor, norms: list[nn.LayerNorm], experts: torch.Tensor) -> torch.Tensor:
    """LayerNorm of each pair's tokens [P, M, D] with its expert's affine parameters."""
    weight = torch.stack([n.weight for n in norms])[experts][:, None]
    bias = torch.stack([n.bias for n in norms])[experts][:, None]
    return F.layer_norm(tokens, tokens.shape[-1:], eps=norms[0].eps) * weight + bias


def grouped_attention(
    queries: torch.Tensor,
    context: torch.Tensor,
    experts: list[nn.Module],
    index: torch.Tensor,
    offsets,
    training,
) -> torch.Tensor:
    """Multi-head attention of each pair's queries [P, M, D] to its context [P, n, D] with its expert's q/k/v/out
    projections (grouped GEMMs), as `ViSAAttention` computes it."""
    attn = experts[0]
    pairs, length, width = queries.shape
    heads = attn.num_heads

    def project(x: torch.Tensor, name: str) -> torch.Tensor:
        rows = grouped_rows(
            x.reshape(-1, width), [getattr(e, name) for e in experts], index, offsets, x.shape[1]
        )
        return rows.view(pairs, x.shape[1], heads, -1).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        project(queries, "q_proj"),
        project(context, "k_proj"),
        project(context, "v_proj"),
        dropout_p=attn.dropout if training else 0.0,
        scale=attn.scale,
    )
    out = out.transpose(1, 2).reshape(pairs * length, width)
    return grouped_rows(out, [e.out_proj for e in experts], index, offsets, length).view(pairs, length, width)


def grouped_prompt_experts(
    experts: nn.ModuleList, features: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor, training: bool
) -> torch.Tensor:
    """`ViSAPromptExpert` (ViSA Eq. 7) on P (sample, expert) pairs sorted by expert: features [P, D] -> [P, M, D].

    Every layer of the E experts runs as one grouped GEMM over the pairs (group g ends at `offsets[g]`)."""
    prompt = torch.stack([e.prompt[0] for e in experts])[index]
    context = grouped_attention(
        prompt, features[:, None], [e.cross_attn for e in experts], index, offsets, False
    )
    tokens = grouped_norm(prompt + context, [e.norm1 for e in experts], index)
    attended = grouped_attention(tokens, tokens, [e.self_attn for e in experts], index, offsets, training)
    tokens = grouped_norm(tokens + attended, [e.norm2 for e in experts], index)
    pairs, length, width = tokens.shape
    flat = tokens.reshape(-1, width)
    hidden = grouped_rows(flat, [e.mlp.fc1 for e in experts], index, offsets, length)
    hidden = grouped_rows(
        experts[0].mlp.activation_fn(hidden), [e.mlp.fc2 for e in experts], index, offsets, length
    )
    return grouped_norm(tokens + hidden.view(pairs, length, width), [e.norm3 for e in experts], index)


class ViSAExpertMixture(nn.Module):
    """A router (Linear D -> E with bias) and E prompt experts; each sample mixes its top-k experts."""

    def __init__(self, config: ViSAConfig):
        super().__init__()
        self.top_k = config.expert_top_k
        self.router = nn.Linear(config.hidden_size, config.num_experts)
        self.experts = nn.ModuleList([ViSAPromptExpert(config) for _ in range(config.num_experts)])

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`features` [n, D] -> (tokens [n, M, D] = sum_j w_j expert_j(features), router logits [n, E])."""
        logits = self.router(features)
        weights = topk_routing(logits.float(), self.top_k)
        return mix_experts(self.experts, features, weights, self.top_k, self.training), logits


def mix_experts(
    experts: nn.ModuleList, features: torch.Tensor, weights: torch.Tensor, top_k: int, training: bool
) -> torch.Tensor:
    """sum_j w_j expert_j(x) per sample over its top-k experts, without a device-to-host sync: the n x k
    (sample, expert) pairs are sorted by expert on the device and run as grouped GEMMs. ONNX has no grouped
    GEMM, and off the CPU it would sync in fp32 / fp16 (`grouped_gemm_syncs`): there every expert runs on every
    sample (the same sum: unused experts weigh 0; the experts act on pooled features, a small share of the
    model's FLOPs)."""
    widths = (features.shape[-1], experts[0].mlp.fc1.out_features)
    if torch.onnx.is_in_onnx_export() or grouped_gemm_syncs(features, widths):
        tokens = [expert(features) for expert in experts]
        return sum(weights[:, j, None, None].to(t.dtype) * t for j, t in enumerate(tokens))
    pair_weights, pair_experts = weights.topk(top_k, dim=-1)
    expert_of_pair = pair_experts.reshape(-1)
    order = expert_of_pair.argsort(stable=True)
    ones = torch.ones_like(expert_of_pair, dtype=torch.int32)
    counts = torch.zeros(weights.shape[-1], dtype=torch.int32, device=features.device).index_add_(
        0, expert_of_pair, ones
    )
    tokens = grouped_prompt_experts(
        experts,
        features[order // top_k],
        expert_of_pair[order],
        counts.cumsum(0, dtype=torch.int32),
        training,
    )
    per_sample = torch.empty_like(tokens).index_copy_(0, order, tokens).unflatten(0, (-1, top_k))
    return (per_sample * pair_weights[..., None, None].to(tokens.dtype)).sum(dim=1)


class ViSAETGM(nn.Module):
    """Expert-driven Token Generation Module: shared experts on z_inv, aerial / ground experts on z_spe."""

    def __init__(self, config: ViSAConfig):
        super().__init__()
        self.shared = ViSAExpertMixture(config)
        self.aerial = ViSAExpertMixture(config) if config.has_view_branch else None
        self.ground = ViSAExpertMixture(config) if config.has_view_branch else None

    def forward(
        self, invariant: torch.Tensor, specific: torch.Tensor | None, view_labels: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor | None, ...]]:
        """Q_inv [B, M, D], Q_spe [B, M, D] (view experts by label) and the (shared, aerial, ground) logits."""
        q_inv, shared_logits = self.shared(invariant)
        if specific is None:
            return q_inv, None, (shared_logits, None, None)
        is_aerial = view_labels.to(specific.device) == AERIAL
        aerial_logits, ground_logits = self.aerial.router(specific), self.ground.router(specific)
        logits = torch.where(is_aerial[:, None], aerial_logits, ground_logits)
        weights = topk_routing(
            logits.float(), self.aerial.top_k
        )  # the image's view set: experts 0..E-1 / E..2E-1
        weights = torch.cat([weights * is_aerial[:, None], weights * ~is_aerial[:, None]], dim=-1)
        experts = nn.ModuleList([*self.aerial.experts, *self.ground.experts])
        q_spe = mix_experts(experts, specific, weights, self.aerial.top_k, self.training).to(q_inv.dtype)
        return q_inv, q_spe, (shared_logits, aerial_logits[is_aerial], ground_logits[~is_aerial])


# ---------------------------------------------------------------------------------------------------------
# DLFM: query-augmented top-k patch graphs and one GCN layer (ViSA Eq. 8-12), vectorised
# ---------------------------------------------------------------------------------------------------------


def select_neighbours(patches: torch.Tensor, features: torch.Tensor, k: int) -> torch.Tensor:
    """ViSA Eq. 8-9: the k patches [B, k, D] (raw) most cosine-similar to each sample's feature [B, D]."""
    scores = torch.einsum("bd,bnd->bn", F.normalize(features, dim=-1), F.normalize(patches, dim=-1))
    index = scores.topk(k, dim=-1).indices
    return patches.gather(1, index[..., None].expand(-1, -1, patches.shape[-1]))


def query_graph_readout(queries: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """Row 0 of Â V for every query graph (ViSA Eq. 10-12 without the GCN weight), no loop over batch or queries.

    Graph of query m of sample b: nodes V = [Q[b, m]; N[b]] (1 + k), A = ReLU(cos(V, V)) + I and
    Â = D^-1/2 A D^-1/2. Only node 0 is read, so (Â V W)[0] = (Â[0] V) W: this returns Â[0] V, [B, M, D].
    The k x k patch block is shared by the M graphs of a sample; only row/column 0 differs.
    """
    q_unit, n_unit = F.normalize(queries, dim=-1), F.normalize(neighbours, dim=-1)
    edge = torch.einsum("bmd,bkd->bmk", q_unit, n_unit).clamp(min=0)  # A[0, j], j >= 1
    self_loop = q_unit.pow(2).sum(-1).clamp(min=0) + 1  # A[0, 0]
    patch_block = torch.einsum("bkd,bjd->bkj", n_unit, n_unit).clamp(min=0)
    patch_degree = patch_block.sum(-1) + 1  # row sums of the patch block of A (with I)
    degree_query = self_loop + edge.sum(-1)  # [B, M]
    degree_patch = edge + patch_degree[:, None, :]  # [B, M, k]
    weight_self = self_loop / degree_query
    weight_edge = edge / (degree_query[..., None] * degree_patch).sqrt()
    return weight_self[..., None] * queries + torch.einsum("bmk,bkd->bmd", weight_edge, neighbours)


class ViSAGraphConvolution(nn.Linear):
    """GCN weight W used as x @ W (stored transposed, as an `nn.Linear` without bias), tanh activation."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, hidden_size, bias=False)

    def forward(self, aggregated: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(aggregated))


class ViSADLFM(nn.Module):
    """Dual-branch Local Fusion Module: per branch, Q^ = LN(tanh(Â[0] V W)) + Q (ViSA Eq. 8-12)."""

    def __init__(self, config: ViSAConfig):
        super().__init__()
        self.config = config
        eps = config.head_layer_norm_eps
        self.shared_gcn = ViSAGraphConvolution(config.hidden_size)
        per_branch = config.dlfm_gcn == "per_branch" and config.has_view_branch
        self.view_gcn = ViSAGraphConvolution(config.hidden_size) if per_branch else None
        self.norm_shared = nn.LayerNorm(config.hidden_size, eps=eps)
        self.norm_view = nn.LayerNorm(config.hidden_size, eps=eps) if config.has_view_branch else None

    def branch(self, patches, features, queries, gcn: nn.Module, norm: nn.Module) -> torch.Tensor:
        """One branch: top-k patches for the branch feature, a graph per query, GCN, norm + residual."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.config.dlfm_graph_no_grad):
            neighbours = select_neighbours(patches, features, self.config.graph_top_k)
            aggregated = query_graph_readout(queries, neighbours)
        return norm(gcn(aggregated)) + queries

    def forward(self, patches, invariant, specific, q_inv, q_spe) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Refined (Q^_inv, Q^_spe); the reference uses `shared_gcn` for both branches (`dlfm_gcn="shared"`)."""
        q_inv = self.branch(patches, invariant, q_inv, self.shared_gcn, self.norm_shared)
        if specific is None:
            return q_inv, None
        gcn = self.view_gcn if self.view_gcn is not None else self.shared_gcn
        return q_inv, self.branch(patches, specific, q_spe, gcn, self.norm_view)


class ViSAFusion(ViSAPostNormBlock):
    """ViSA Eq. 13 as the reference codes it: a post-norm block over [out_token; Q^_inv; Q^_spe]; f_loc = token 0."""

    def __init__(self, config: ViSAConfig):
        super().__init__(config, config.fusion_intermediate_size)
        self.out_token = nn.Parameter(torch.zeros(1, config.hidden_size))

    def forward(self, q_inv: torch.Tensor, q_spe: torch.Tensor | None) -> torch.Tensor:
        tokens = [self.out_token.expand(q_inv.shape[0], 1, -1).to(q_inv.dtype), q_inv]
        if q_spe is not None:
            tokens.append(q_spe)
        return super().forward(torch.cat(tokens, dim=1))


class ViSABNNeck(nn.BatchNorm1d):
    """BNNeck: BatchNorm1d with the bias frozen at 0 (fast-reid `bias_freeze=True`)."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size)
        self.bias.requires_grad_(False)


# ---------------------------------------------------------------------------------------------------------
# Pretrained base, model and re-ID head
# ---------------------------------------------------------------------------------------------------------


class ViSAPreTrainedModel(OwnInitMixin, ClearLoadErrorsMixin, PreTrainedModel):
    """Weight init (reference: trunc-normal 0.02, zero view tokens, He-normal patch conv) and HF plumbing."""

    config: ViSAConfig
    base_model_prefix = "visa"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    _no_split_modules = ["ViSAEmbeddings", "ViSAEncoderLayer", "ViSAPromptExpert", "ViSAFusion"]
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": ViSAEncoderLayer,
        "attentions": OutputRecorder(ViSAAttention, index=1, layer_name="encoder"),
    }

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as transformers does; with custom code registered, `auto_map` always maps AutoModel to ViSAModel
        (also when a [`ViSAForReID`] is saved) so the folder loads as the embedding model anywhere."""
        if self._auto_class is not None:
            module = type(self).__module__.split(".")[-1]
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            auto_map.setdefault("AutoModel", f"{module}.ViSAModel")
            self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, ViSAGraphConvolution):
            bound = 1.0 / math.sqrt(module.weight.shape[1])
            init.uniform_(module.weight, -bound, bound)
        elif isinstance(module, nn.Linear):
            init.trunc_normal_(module.weight, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, ViSAEmbeddings):
            conv = module.patch_embedding
            fan_out = conv.kernel_size[0] * conv.kernel_size[1] * conv.out_channels
            init.normal_(conv.weight, std=math.sqrt(2.0 / fan_out))
            init.zeros_(conv.bias)
            init.trunc_normal_(module.cls_token, std=std)
            init.trunc_normal_(module.position_embedding, std=std)
            for token in (module.view_token_aerial, module.view_token_ground, module.view_token):
                if token is not None:
                    init.zeros_(token)  # reference: zero-initialised view tokens
        elif isinstance(module, ViSAPromptExpert):
            init.trunc_normal_(module.prompt, std=std)
        elif isinstance(module, ViSAFusion):
            init.trunc_normal_(module.out_token, std=std)
        elif isinstance(module, ViSAForReID):
            for classifier in (module.classifier, module.local_classifier, module.view_classifier):
                if classifier is not None:
                    init.normal_(classifier.weight, std=0.01)
        else:
            super()._init_weights(module)  # LayerNorm, BatchNorm


class ViSAModel(ViSAPreTrainedModel):
    """ViSA backbone, ETGM, DLFM, fusion and the two BNNecks; `pooler_output` is the test embedding."""

    _input_embed_layer = "patch_embedding"

    def __init__(self, config: ViSAConfig):
        super().__init__(config)
        self.embeddings = ViSAEmbeddings(config)
        layers = (
            config.num_hidden_layers
        )  # drop-path rates rise linearly (plain Python: works on the meta device)
        rates = [config.drop_path_rate * i / max(layers - 1, 1) for i in range(layers)]
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([ViSAEncoderLayer(config, rate) for rate in rates])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.etgm = ViSAETGM(config) if config.use_etgm else None
        self.dlfm = ViSADLFM(config) if config.use_dlfm else None
        self.fusion = ViSAFusion(config) if config.has_local_branch else None
        self.global_bnneck = ViSABNNeck(config.hidden_size)
        self.local_bnneck = ViSABNNeck(config.hidden_size) if config.has_local_branch else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embedding

    @property
    def needs_view_labels(self) -> bool:
        """View labels are required by dual view tokens and by the view experts."""
        config = self.config
        return config.view_tokens == "dual" or (config.use_etgm and config.has_view_branch)

    def encode(self, pixel_values: torch.Tensor, view_labels: torch.Tensor | None, **kwargs):
        """Trunk: (final-normed states [B, L, D], block L-1 patch tokens [B, N, D] for DLFM, pre-norm)."""
        config = self.config
        hidden_states = self.embeddings(pixel_values, view_labels)
        prefix, last = config.num_prefix_tokens, config.num_hidden_layers - 1
        patches = hidden_states[:, prefix:]
        for index, layer in enumerate(self.encoder.layers):
            subtract = config.has_view_branch and (index < last or config.subtract_last_block)
            hidden_states = layer(hidden_states, subtract_view=subtract, **kwargs)
            if index < last:
                patches = hidden_states[:, prefix:]
        return self.final_layer_norm(hidden_states), patches

    def local_branch(self, patches, invariant, specific, view_labels):
        """ETGM -> DLFM -> fusion: (f_loc [B, D], Q^_inv, Q^_spe, router logits)."""
        router_logits = None
        if self.etgm is not None:
            q_inv, q_spe, router_logits = self.etgm(invariant, specific, view_labels)
        else:  # Table 2 rows without ETGM: each branch's query is its feature itself
            q_inv = invariant[:, None]
            q_spe = specific[:, None] if specific is not None else None
        if self.dlfm is not None:
            q_inv, q_spe = self.dlfm(patches, invariant, specific, q_inv, q_spe)
        return self.fusion(q_inv, q_spe)[:, 0], q_inv, q_spe, router_logits

    @merge_with_config_defaults
    @capture_outputs(tie_last_hidden_states=False)
    def forward(
        self, pixel_values: torch.Tensor | None = None, view_labels: torch.Tensor | None = None, **kwargs
    ) -> ViSAModelOutput:
        r"""
        pixel_values (`torch.Tensor` of shape `(batch, 3, height, width)`): images resized to `config.image_size`,
            normalised with mean = std = 0.5 (the reference's (x - 127.5) / 127.5 on 0-255 pixels).
        view_labels (`torch.LongTensor` of shape `(batch,)`, *optional*): 0 = aerial, 1 = ground; required (also
            at test time) when the config has dual view tokens or view experts.
        """
        if pixel_values is None:
            raise ValueError("You have to specify pixel_values")
        self.embeddings.check_pixel_values(pixel_values)  # before the labels: a bad batch is named as such
        view_labels = required_view_labels(view_labels, pixel_values.shape[0], self.needs_view_labels)
        hidden_states, patches = self.encode(pixel_values, view_labels, **kwargs)
        global_features = hidden_states[:, 0]
        specific = hidden_states[:, 1] if self.config.has_view_branch else None
        invariant = global_features - specific if specific is not None else global_features
        out = ViSAModelOutput(
            last_hidden_state=hidden_states,
            global_features=global_features,
            invariant_features=invariant,
            specific_features=specific,
        )
        out.global_embeds = self.global_bnneck(invariant)
        if self.training and self.config.bnneck_global_update and specific is not None:
            self.global_bnneck(global_features)  # reference quirk: running stats also see g (no loss)
        embeds = [out.global_embeds]
        if self.fusion is not None:
            out.local_features, out.invariant_queries, out.specific_queries, out.router_logits = (
                self.local_branch(patches, invariant, specific, view_labels)
            )
            out.local_embeds = self.local_bnneck(out.local_features)
            embeds.append(out.local_embeds)
        out.pooler_output = torch.cat(embeds, dim=-1)
        return out


class ViSAForReID(ViSAPreTrainedModel):
    """ViSA with its training heads: ID classifiers on BNNeck(z_inv) and BNNeck(f_loc), the view classifier
    (BNNeck + linear on z_spe), and the losses of ViSA Eq. 14-20."""

    def __init__(self, config: ViSAConfig):
        super().__init__(config)
        self.visa = ViSAModel(config)
        dim, classes = config.hidden_size, config.num_identities
        self.classifier = nn.Linear(dim, classes, bias=False) if classes > 0 else None
        has_local = classes > 0 and config.has_local_branch
        self.local_classifier = nn.Linear(dim, classes, bias=False) if has_local else None
        self.view_bnneck = ViSABNNeck(dim) if config.has_view_branch else None
        self.view_classifier = nn.Linear(dim, 2, bias=False) if config.has_view_branch else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.visa.get_input_embeddings()

    def view_targets(self, view_labels: torch.Tensor) -> torch.Tensor:
        """View-classifier targets: aerial = 1 / ground = 0 (`"reference"`) or the input labels (`"project"`)."""
        return 1 - view_labels if self.config.view_label_convention == "reference" else view_labels

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        view_labels: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_loss: bool | None = None,
        **kwargs,
    ) -> ViSAForReIDOutput:
        r"""
        pixel_values (`torch.Tensor` of shape `(batch, 3, height, width)`): normalised images (see [`ViSAModel`]).
        view_labels (`torch.LongTensor` of shape `(batch,)`, *optional*): 0 = aerial, 1 = ground.
        labels (`torch.LongTensor` of shape `(batch,)`, *optional*): identity classes 0..num_identities-1.
        return_loss (`bool`, *optional*): compute the losses (defaults to `labels is not None`).
        """
        base = self.visa(pixel_values=pixel_values, view_labels=view_labels, return_dict=True, **kwargs)
        out = ViSAForReIDOutput(
            embeddings=base.pooler_output,
            invariant_features=base.invariant_features,
            specific_features=base.specific_features,
            local_features=base.local_features,
            router_logits=base.router_logits,
            hidden_states=base.hidden_states,
            attentions=base.attentions,
        )
        if self.classifier is not None:
            out.logits = self.classifier(base.global_embeds)
        if self.local_classifier is not None:
            out.local_logits = self.local_classifier(base.local_embeds)
        if self.view_classifier is not None:
            out.view_logits = self.view_classifier(self.view_bnneck(base.specific_features))
        if return_loss if return_loss is not None else labels is not None:
            self._add_losses(out, base, view_labels, labels)
        return out

    def _check_labels(self, labels: torch.Tensor | None, batch: int) -> torch.Tensor:
        if labels is None:
            raise ValueError("the ViSA losses need labels (identity classes 0..num_identities-1).")
        labels = torch.as_tensor(labels).long().reshape(-1)
        if labels.numel() != batch:
            raise ValueError(f"labels has {labels.numel()} entries for a batch of {batch} images.")
        classes = self.config.num_identities
        if classes > 0:
            check_on_device(
                (labels >= 0) & (labels < classes),
                f"labels must lie in [0, {classes}) (config.num_identities).",
            )
        return labels

    def _add_losses(self, out: ViSAForReIDOutput, base: ViSAModelOutput, view_labels, labels) -> None:
        """Fill the weighted loss terms and their sum (ViSA Eq. 20)."""
        config = self.config
        device = out.embeddings.device
        labels = self._check_labels(labels, out.embeddings.shape[0]).to(device)
        if out.logits is not None:
            out.loss_id = config.lambda_id * visa_id_loss(out.logits, labels)
        out.loss_triplet = config.lambda_triplet * triplet_loss(
            base.invariant_features, labels, config.triplet_margin
        )
        if base.local_features is not None:
            if out.local_logits is not None:
                out.loss_local_id = (
                    config.lambda_local * config.lambda_id * visa_id_loss(out.local_logits, labels)
                )
            out.loss_local_triplet = (
                config.lambda_local
                * config.lambda_triplet
                * triplet_loss(base.local_features, labels, config.triplet_margin)
            )
        if out.view_logits is not None and view_labels is not None:
            targets = self.view_targets(torch.as_tensor(view_labels).long().reshape(-1).to(device))
            out.loss_view = config.lambda_view * view_loss(out.view_logits, targets)
        if base.specific_features is not None:
            out.loss_ortho = config.lambda_ortho * orthogonal_loss(
                base.invariant_features, base.specific_features
            )
        if base.router_logits is not None:
            balance = etgm_balance_loss(*base.router_logits, batch_size=out.embeddings.shape[0])
            out.loss_balance = config.lambda_balance * balance if balance is not None else None
        names = ("loss_id", "loss_triplet", "loss_local_id", "loss_local_triplet", "loss_view", "loss_ortho")
        out.loss = total_loss({name: getattr(out, name) for name in (*names, "loss_balance")})


# ---------------------------------------------------------------------------------------------------------
# Parameter and FLOP accounting (analytic, from the config)
# ---------------------------------------------------------------------------------------------------------


__all__ = [
    "ViSAForReID",
    "ViSAForReIDOutput",
    "ViSAModel",
    "ViSAModelOutput",
    "ViSAPreTrainedModel",
]
