"""PyTorch TAG-CLIP: a CLIP dual encoder whose image tower carries a view token and HR-MoE blocks.

Paper: "Text-based Aerial-Ground Person Retrieval" (TAG-CLIP). Facts from the reference code:
the TAG-PR repository, summarised in docs/tagclip-reference.md. Parameter names follow transformers' CLIP
so CLIP checkpoints map 1:1.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.utils import ModelOutput
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .attention import SelfAttention
from .configuration_tagclip import TagClipConfig, TagClipTextConfig, TagClipVisionConfig
from .device_ops import (
    check_not_empty,
    check_on_device,
    grouped_gemm_syncs,
    grouped_linear,
    on_host,
)
from .load_policy import ClearLoadErrorsMixin, OwnInitMixin
from .losses_tagclip import (
    ContrastiveLoss,
    clamped_scale,
    id_loss,
    ortho_loss_paper,
    ortho_loss_reference,
    total_loss,
    view_accuracy,
    view_loss,
)
from .precision_tagclip import NearTieRerun, Selection, near_tie_rerun
from .serving_common import eq14_similarity
from .tse_tagclip import TagClipTokenSelection, image_tse_scores, select_tokens, text_tse_scores
from .validation import check_pixel_values, check_view_labels

# ---------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------


@dataclass
class TagClipVisionModelOutput(BaseModelOutputWithPooling):
    r"""
    Output of [`TagClipVisionModel`].

    Args:
        last_hidden_state (`torch.Tensor` of shape `(batch, 1 + num_patches, hidden_size)`): last block output
            (view token already dropped), before `post_layernorm`.
        pooler_output (`torch.Tensor` of shape `(batch, hidden_size)`): `post_layernorm` of the CLS token.
        hidden_states (`tuple(torch.Tensor)`, *optional*): per-block states (`output_hidden_states=True`); the
            view token is present up to the last MoE block.
        attentions (`tuple(torch.Tensor)`, *optional*): per-block attention weights (eager attention).
        attention_row (`torch.Tensor` of shape `(batch, L)`): fp32 head-averaged attention of the last block's CLS
            query over CLS + patches (used by TSE).
        view_logits (`tuple(torch.Tensor)`): image-level router logits `(batch, 2)` per MoE block (TAG-PR Eq. 3);
            0 = aerial, 1 = ground.
        cls_view_cos (`tuple(torch.Tensor)`): cosine between the ln_2 CLS and view states per MoE block.
        view_hidden_state (`torch.Tensor` of shape `(batch, hidden_size)`): the view token when it is dropped.
        router_logits (`tuple(TagClipRouting)`, *optional*): feature-level routing per MoE block
            (`output_router_logits=True`).
    """

    attention_row: torch.Tensor | None = None
    view_logits: tuple[torch.Tensor, ...] | None = None
    cls_view_cos: tuple[torch.Tensor, ...] | None = None
    view_hidden_state: torch.Tensor | None = None
    router_logits: tuple[Any, ...] | None = None


@dataclass
class TagClipTextModelOutput(BaseModelOutputWithPooling):
    r"""
    Output of [`TagClipTextModel`].

    Args:
        last_hidden_state (`torch.Tensor` of shape `(batch, seq_len, hidden_size)`): after `final_layer_norm`.
        pooler_output (`torch.Tensor` of shape `(batch, hidden_size)`): the first EOS token's state.
        hidden_states (`tuple(torch.Tensor)`, *optional*): per-block states.
        attentions (`tuple(torch.Tensor)`, *optional*): per-block attention weights (eager attention).
        attention_row (`torch.Tensor` of shape `(batch, seq_len)`): fp32 head-averaged attention of the last
            block's first-EOS query (used by TSE).
    """

    attention_row: torch.Tensor | None = None


@dataclass
class TagClipEmbeddingOutput(BaseModelOutputWithPooling):
    r"""
    Output of [`TagClipModel.get_image_features`] / [`TagClipModel.get_text_features`].

    Args:
        last_hidden_state (`torch.Tensor`): the tower's last hidden state.
        pooler_output (`torch.Tensor` of shape `(batch, projection_dim)`): projected, unnormalised global
            embedding (v_cls or t_eos).
        hidden_states (`tuple(torch.Tensor)`, *optional*): per-block states.
        attentions (`tuple(torch.Tensor)`, *optional*): per-block attention weights.
        local_embeds (`torch.Tensor` of shape `(batch, tse_embed_dim)`): unnormalised TSE embedding
            (v_tse or t_tse); `None` when `use_tse=False`.
        tse_indices (`torch.Tensor` of shape `(batch, k)`, *optional*): positions in `dense_embeds` of the tokens
            TSE selected, highest attention first (image: 0 = CLS, patch p at 1 + p).
        dense_embeds (`torch.Tensor` of shape `(batch, seq_len, projection_dim)`): every token projected.
        view_logits (`tuple(torch.Tensor)`, *optional*): image-level router logits per MoE block.
        cls_view_cos (`tuple(torch.Tensor)`, *optional*): CLS/view cosine per MoE block.
        view_embeds (`torch.Tensor`, *optional*): the projected view token (v_view), image side only.
        router_logits (`tuple(TagClipRouting)`, *optional*): feature-level routing per MoE block.
    """

    local_embeds: torch.Tensor | None = None
    tse_indices: torch.Tensor | None = None
    dense_embeds: torch.Tensor | None = None
    view_logits: tuple[torch.Tensor, ...] | None = None
    cls_view_cos: tuple[torch.Tensor, ...] | None = None
    view_embeds: torch.Tensor | None = None
    router_logits: tuple[Any, ...] | None = None


@dataclass
class TagClipRouting(ModelOutput):
    r"""
    Feature-level routing of one MoE block.

    Args:
        gate_logits (`torch.Tensor` of shape `(batch, seq_len, num_experts)`): feature-router logits (TAG-PR Eq. 5).
        expert_weights (`torch.Tensor` of shape `(batch, seq_len, num_experts)`): renormalised weight of each
            expert per token (0 where unused).
        expert_mask (`torch.Tensor` of shape `(batch, seq_len, num_experts)`, bool): experts each token used.
        group_weights (`torch.Tensor` of shape `(batch, 2)`, *optional*): weight of the aerial / ground group
            per image (one-hot unless `routing="soft"`); `None` for vanilla MoE.
        view_margin (`torch.Tensor` of shape `(batch,)`, *optional*): relative margin of the aerial / ground
            argmax decision (`TagClipHRMoE.view_margin`); `None` in training or unless `routing="argmax"`.
    """

    gate_logits: torch.Tensor | None = None
    expert_weights: torch.Tensor | None = None
    expert_mask: torch.Tensor | None = None
    group_weights: torch.Tensor | None = None
    view_margin: torch.Tensor | None = None


@dataclass
class TagClipOutput(ModelOutput):
    r"""
    Output of [`TagClipModel`].

    Args:
        loss (`torch.Tensor`, *optional*): total loss, TAG-PR Eq. 11 (`return_loss=True`).
        loss_nitc, loss_ritc (`torch.Tensor`, *optional*): N-ITC / R-ITC summed over global and TSE features
            (TAG-PR Eq. 1 + TAG-PR Eq. 2), weighted.
        loss_id, loss_view, loss_ortho (`torch.Tensor`, *optional*): weighted ID, view and orthogonal losses.
        view_accuracy (`torch.Tensor`, *optional*): image-level router accuracy (needs `view_labels`).
        logits_per_text (`torch.Tensor` of shape `(n_texts, n_images)`): exp(logit_scale) x TAG-PR Eq. 14 similarity.
        logits_per_image (`torch.Tensor` of shape `(n_images, n_texts)`): its transpose.
        text_embeds, image_embeds (`torch.Tensor`): L2-normalised global embeddings (t_eos, v_cls).
        text_local_embeds, image_local_embeds (`torch.Tensor`, *optional*): L2-normalised TSE embeddings.
        view_logits (`tuple(torch.Tensor)`, *optional*): image-level router logits per MoE block.
        router_logits (`tuple(TagClipRouting)`, *optional*): feature-level routing per MoE block.
        text_model_output, vision_model_output ([`TagClipEmbeddingOutput`]): the towers' outputs.
    """

    loss: torch.Tensor | None = None
    loss_nitc: torch.Tensor | None = None
    loss_ritc: torch.Tensor | None = None
    loss_id: torch.Tensor | None = None
    loss_view: torch.Tensor | None = None
    loss_ortho: torch.Tensor | None = None
    view_accuracy: torch.Tensor | None = None
    logits_per_image: torch.Tensor | None = None
    logits_per_text: torch.Tensor | None = None
    text_embeds: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    text_local_embeds: torch.Tensor | None = None
    image_local_embeds: torch.Tensor | None = None
    view_logits: tuple[torch.Tensor, ...] | None = None
    router_logits: tuple[Any, ...] | None = None
    text_model_output: TagClipEmbeddingOutput | None = None
    vision_model_output: TagClipEmbeddingOutput | None = None

    def to_tuple(self) -> tuple[Any]:
        return tuple(v.to_tuple() if isinstance(v, ModelOutput) else v for v in self.values())


# ---------------------------------------------------------------------------------------------------------
# Embeddings
# ---------------------------------------------------------------------------------------------------------


def interpolate_grid_embeddings(
    weight: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int]
) -> torch.Tensor:
    """Resize [1 + rows*cols, D] position embeddings to a new patch grid, bilinearly (reference resize_pos_embed)."""
    if tuple(old_grid) == tuple(new_grid):
        return weight
    cls_pos, grid = weight[:1], weight[1:]
    grid = grid.reshape(1, old_grid[0], old_grid[1], -1).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=tuple(new_grid), mode="bilinear", align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(new_grid[0] * new_grid[1], -1).to(weight.dtype)
    return torch.cat([cls_pos, grid], dim=0)


def _size_hint(shape: tuple[int, ...], expected: tuple[int, int, int]) -> str:
    """How to fix pixel_values of the wrong shape; naming both sizes when only the image size differs."""
    if len(shape) != 4 or shape[1] != expected[0]:
        return "Use a processor that makes images of the config's size, or `set_image_size`."
    (h, w), (mh, mw) = shape[2:], expected[1:]
    return (
        f"The images are {h}x{w} but the model takes {mh}x{mw} (height x width): the processor that made them "
        f"resizes to {h}x{w}. Re-save it with `TagClipProcessor.from_defaults({mh}, {mw})` or pass "
        f"`size={{'height': {mh}, 'width': {mw}}}` to it, or `set_image_size({h}, {w})` to run the model at {h}x{w}."
    )


class TagClipVisionEmbeddings(nn.Module):
    """Patch embedding (no bias) + CLS + position embeddings, then the view token appended last (no position)."""

    def __init__(self, config: TagClipVisionConfig):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.class_embedding = nn.Parameter(torch.randn(self.embed_dim))
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            self.embed_dim,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=False,
        )
        self.num_positions = config.num_patches + 1
        self.position_embedding = nn.Embedding(self.num_positions, self.embed_dim)
        self.register_buffer(
            "position_ids", torch.arange(self.num_positions).expand((1, -1)), persistent=False
        )
        self.view_token = nn.Parameter(torch.randn(self.embed_dim)) if config.use_view_token else None

    def check_pixel_values(self, pixel_values: torch.Tensor) -> None:
        """Raise a clear ValueError for raw (integer) pixels, a wrongly shaped image batch or NaN/inf pixels."""
        expected = (self.config.num_channels, *self.config.image_hw)
        check_pixel_values(pixel_values, expected, lambda shape: _size_hint(shape, expected))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        self.check_pixel_values(pixel_values)
        target_dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixel_values.to(dtype=target_dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        embeddings = torch.cat([cls, patches], dim=1) + self.position_embedding(self.position_ids)
        if self.view_token is not None:
            view = self.view_token.to(embeddings.dtype).expand(embeddings.shape[0], 1, -1)
            embeddings = torch.cat([embeddings, view], dim=1)
        return embeddings


class TagClipTextEmbeddings(nn.Module):
    """Token + position embeddings of the CLIP text tower."""

    def __init__(self, config: TagClipTextConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.register_buffer(
            "position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_length = input_ids.shape[-1]
        max_length = self.position_embedding.weight.shape[0]
        if seq_length > max_length:
            raise ValueError(f"input_ids has {seq_length} tokens, more than the context length {max_length}.")
        return self.token_embedding(input_ids) + self.position_embedding(self.position_ids[:, :seq_length])


# ---------------------------------------------------------------------------------------------------------
# Transformer blocks
# ---------------------------------------------------------------------------------------------------------


class TagClipAttention(SelfAttention):
    """Multi-head self-attention of both towers (q/k/v/out projections as transformers' CLIP)."""


class TagClipMLP(nn.Module):
    """CLIP MLP: fc1 -> QuickGELU -> fc2 (also one expert of an MoE block)."""

    def __init__(self, config: TagClipVisionConfig | TagClipTextConfig):
        super().__init__()
        self.config = config
        self.activation_fn = ACT2FN[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


def topk_expert_weights(
    gate_logits: torch.Tensor, allowed: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """TAG-PR Eq. 6-8 weights: p = softmax(g_feat + M), keep the top-K, renormalise by (sum + 1e-6).

    `allowed` ([num_experts] or broadcastable bool) gives M = 0 for allowed experts and -1e9 otherwise, as the
    reference. Returns dense weights [..., E] (0 for unused experts) and the bool mask of selected experts.
    """
    mask = torch.zeros_like(gate_logits).masked_fill(~allowed, -1e9)
    probs = F.softmax(gate_logits + mask, dim=-1)
    top_weights, top_index = probs.topk(top_k, dim=-1)
    top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-6)
    weights = torch.zeros_like(probs).scatter(-1, top_index, top_weights)
    selected = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top_index, True)
    return weights, selected


class TagClipHRMoE(nn.Module):
    """Hierarchically-Routed Mixture of Experts (TAG-PR Eq. 3-8); with `block_type="moe"` a vanilla MoE.

    Image-level router on the view token picks the aerial or ground group (TAG-PR Eq. 3-4), the group mask
    restricts the feature-level router (TAG-PR Eq. 5-7), and each token mixes its top-K experts (TAG-PR Eq. 8).
    """

    def __init__(self, config: TagClipVisionConfig):
        super().__init__()
        self.config = config
        self.hierarchical = config.block_type == "hrmoe"
        self.img_router = nn.Linear(config.hidden_size, 2) if self.hierarchical else None
        self.fea_router = nn.Linear(config.hidden_size, config.num_experts)
        self.experts = nn.ModuleList([TagClipMLP(config) for _ in range(config.num_experts)])
        self.register_buffer("group_masks", self.build_group_masks(), persistent=False)

    def build_group_masks(self) -> torch.Tensor:
        """Bool [3, num_experts]: the experts open to the aerial group, the ground group, and all (TAG-PR Eq. 7)."""
        masks = torch.zeros(3, self.config.num_experts, dtype=torch.bool)
        for group in (0, 1):
            masks[group, self.config.expert_group(group)] = True
        masks[2] = True
        return masks

    @property
    def pairs_per_token(self) -> int:
        """(token, expert) pairs each token computes: K, or the union bound min(E, 2K) for soft group mixing."""
        top_k, num_experts = self.config.moe_top_k, self.config.num_experts
        return min(num_experts, 2 * top_k) if self.hierarchical and self.config.routing == "soft" else top_k

    def allowed_experts(self, group: int | None) -> torch.Tensor:
        """Bool mask [num_experts] of the experts open to a group (TAG-PR Eq. 7); all of them for `group=None`."""
        return self.group_masks[2 if group is None else group]

    def group_weights(self, view_logits: torch.Tensor, view_labels: torch.Tensor | None) -> torch.Tensor:
        """Per-image weights of the (aerial, ground) groups, [B, 2], by `config.routing` (TAG-PR Eq. 4)."""
        routing = self.config.routing
        if routing == "soft":
            return F.softmax(view_logits.float(), dim=-1)
        if routing == "label":
            if view_labels is None:
                raise ValueError("routing='label' needs `view_labels` (0 = aerial, 1 = ground).")
            group = view_labels.to(view_logits.device).long()
        elif routing == "gumbel":
            group = F.gumbel_softmax(view_logits.float(), tau=1.0, hard=True).argmax(dim=-1)
        else:
            group = view_logits.argmax(dim=-1)
        return (
            group[:, None] == torch.arange(2, device=group.device)
        ).float()  # one-hot, no range check sync

    def view_margin(self, view_token: torch.Tensor, view_logits: torch.Tensor) -> torch.Tensor | None:
        """Relative margin [B] of the argmax group decision (TAG-PR Eq. 4): |l_a - l_g| / (sum_i |(w_a - w_g)_i x_i| +
        |b_a - b_g|), the logit gap over the summed magnitudes of its terms, so rounding every term by a relative
        r moves the gap by at most r x the denominator. `None` in training or unless `routing="argmax"`."""
        if self.training or self.config.routing != "argmax":
            return None
        weight, bias = self.img_router.weight.detach().float(), self.img_router.bias.detach().float()
        terms = (view_token.detach().float() * (weight[0] - weight[1])).abs().sum(-1) + (
            bias[0] - bias[1]
        ).abs()
        gap = (view_logits[:, 0] - view_logits[:, 1]).detach().float().abs()
        return gap / terms.clamp_min(torch.finfo(torch.float32).tiny)

    def routing_weights(
        self, gate_logits: torch.Tensor, group_weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert weights [B, N, E] and selection mask, mixing the groups by `group_weights`."""
        top_k = self.config.moe_top_k
        if group_weights is None:
            return topk_expert_weights(gate_logits, self.allowed_experts(None), top_k)
        weights = torch.zeros_like(gate_logits)
        selected = torch.zeros_like(gate_logits, dtype=torch.bool)
        for group in (0, 1):
            group_w, group_sel = topk_expert_weights(gate_logits, self.allowed_experts(group), top_k)
            share = group_weights[:, group, None, None]
            weights = weights + share * group_w
            selected = selected | (group_sel & (share > 0))
        return weights, selected

    dispatch_chunk_tokens: int = 8192
    """Tokens per grouped-GEMM pass of `dispatch_grouped`: bounds its pair activations ([chunk x P, intermediate])
    to about one dense MLP's at large batches."""

    def dispatch_sparse(self, hidden_states: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor):
        """TAG-PR Eq. 8 on the routed (token, expert) pairs only: `dispatch_by_expert` where the routing can be read on
        the host (CPU eager), else `dispatch_grouped` over chunks of `dispatch_chunk_tokens` tokens (no
        device-to-host sync). Equal to `dispatch_dense` (unused experts have weight 0) at the FLOPs of the pairs.
        """
        shape = hidden_states.shape
        flat, weights = hidden_states.reshape(-1, shape[-1]), weights.reshape(-1, weights.shape[-1])
        if on_host(flat):
            output = self.dispatch_by_expert(flat, weights, selected.reshape(-1, selected.shape[-1]))
        else:
            chunk = self.dispatch_chunk_tokens
            parts = [
                self.dispatch_grouped(flat[i : i + chunk], weights[i : i + chunk])
                for i in range(0, len(flat), chunk)
            ]
            output = parts[0] if len(parts) == 1 else torch.cat(parts)
        return output.reshape(*shape[:-1], -1)

    def dispatch_by_expert(
        self, flat: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        """One expert at a time on the tokens routed to it ([T, D] inputs, [T, E] weights and mask), summed in
        expert order as `dispatch_dense`: only one expert's activations are alive at a time."""
        output = None
        for index, expert in enumerate(self.experts):
            tokens = selected[:, index].nonzero().squeeze(1)
            if not len(tokens):
                continue
            expert_out = expert(flat.index_select(0, tokens))
            expert_out = expert_out * weights[:, index].index_select(0, tokens)[:, None].to(expert_out.dtype)
            if output is None:
                output = expert_out.new_zeros(flat.shape[0], expert_out.shape[-1])
            output.index_add_(0, tokens, expert_out)
        return output if output is not None else torch.zeros_like(flat)

    def dispatch_grouped(self, flat: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The pairs of [T, D] tokens as two grouped GEMMs: every token keeps `pairs_per_token` experts, so there
        are a static T x P pairs, sorted by expert on the device (`argsort`) with per-expert offsets from a
        device-side count (`grouped_linear`); each pair's output goes back to its token's slot and the P slots
        are mixed with the routing weights."""
        num_pairs, num_experts = self.pairs_per_token, weights.shape[-1]
        pair_weights, pair_experts = weights.topk(num_pairs, dim=-1)
        expert_of_pair = pair_experts.reshape(-1)
        order = expert_of_pair.argsort(stable=True)
        sorted_experts = expert_of_pair[order]
        ones = torch.ones_like(expert_of_pair, dtype=torch.int32)
        counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device).index_add_(
            0, expert_of_pair, ones
        )
        offsets = counts.cumsum(0, dtype=torch.int32)
        tokens = flat.index_select(0, order // num_pairs)
        hidden = grouped_linear(tokens, [e.fc1 for e in self.experts], sorted_experts, offsets)
        hidden = self.experts[0].activation_fn(hidden)
        out = grouped_linear(hidden, [e.fc2 for e in self.experts], sorted_experts, offsets)
        per_token = torch.empty_like(out).index_copy_(0, order, out).view(flat.shape[0], num_pairs, -1)
        return (per_token * pair_weights[..., None].to(out.dtype)).sum(dim=1)

    def dispatch_dense(self, hidden_states: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor):
        """Reference formula: every expert on every token, mixed with the scattered weights (TAG-PR Eq. 8)."""
        output = 0
        for index, expert in enumerate(self.experts):
            expert_out = expert(hidden_states)
            output = output + weights[..., index, None].to(expert_out.dtype) * expert_out
        return output

    def dispatch(
        self, hidden_states: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        """`dispatch_sparse` (default, eager and compiled), or `dispatch_dense` for `moe_dispatch="dense"` and
        where the sparse one would sync with the host (`grouped_gemm_syncs`: fp32 / fp16 on a GPU; every expert
        on every token then, HR-MoE's top-5 of 6: 1.2x the expert FLOPs)."""
        widths = (self.config.hidden_size, self.config.intermediate_size)
        if self.config.moe_dispatch == "dense" or grouped_gemm_syncs(hidden_states, widths):
            return self.dispatch_dense(hidden_states, weights, selected)
        return self.dispatch_sparse(hidden_states, weights, selected)

    def forward(
        self, hidden_states: torch.Tensor, view_labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, TagClipRouting]:
        """`hidden_states` is the ln_2 output [B, N, D] with the view token last (for HR-MoE)."""
        view_logits, group_weights, view_margin = None, None, None
        if self.hierarchical:
            view_logits = self.img_router(hidden_states[:, -1])
            group_weights = self.group_weights(view_logits, view_labels)
            view_margin = self.view_margin(hidden_states[:, -1], view_logits)
        gate_logits = self.fea_router(hidden_states).float()
        if self.training and self.config.router_noise_std > 0:
            gate_logits = gate_logits + self.config.router_noise_std * torch.randn_like(gate_logits)
        weights, selected = self.routing_weights(gate_logits, group_weights)
        output = self.dispatch(hidden_states, weights, selected)
        return output, view_logits, TagClipRouting(gate_logits, weights, selected, group_weights, view_margin)


class TagClipEncoderLayer(GradientCheckpointingLayer):
    """Pre-LN transformer block; its MLP is a [`TagClipHRMoE`] in the MoE blocks.

    Returns `(hidden_states, attention_row, view_logits, cls_view_cos, routing)`; the last four are `None`
    where they do not apply. `attention_row` (head-averaged, fp32, [B, L]) is the attention of the query at
    `query_index` (one per sample), computed only when `query_index` is given (the TSE block).
    """

    def __init__(self, config: TagClipVisionConfig | TagClipTextConfig, is_moe: bool = False):
        super().__init__()
        self.is_moe = is_moe
        self.self_attn = TagClipAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = TagClipHRMoE(config) if is_moe else TagClipMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        query_index: torch.Tensor | None = None,
        view_labels: torch.Tensor | None = None,
        has_view_token: bool = False,
        **kwargs,
    ) -> tuple:
        residual = hidden_states
        attn_out, _, attention_row = self.self_attn(
            self.layer_norm1(hidden_states), attention_mask, query_index=query_index, **kwargs
        )
        hidden_states = residual + attn_out

        normed = self.layer_norm2(hidden_states)
        if not self.is_moe:
            return hidden_states + self.mlp(normed), attention_row, None, None, None
        mlp_out, view_logits, routing = self.mlp(normed, view_labels=view_labels)
        cls_view_cos = F.cosine_similarity(normed[:, 0], normed[:, -1], dim=-1) if has_view_token else None
        return hidden_states + mlp_out, attention_row, view_logits, cls_view_cos, routing


# ---------------------------------------------------------------------------------------------------------
# Pretrained base and towers
# ---------------------------------------------------------------------------------------------------------


def torch_default_linear_init(linear: nn.Linear) -> None:
    """PyTorch's own `nn.Linear` init, kept by the reference for the TSE layers (it never re-initialises them):
    weight kaiming-uniform with a=sqrt(5), i.e. U(+-1/sqrt(fan_in)); bias U(+-1/sqrt(fan_in))."""
    init.kaiming_uniform_(linear.weight, a=math.sqrt(5))
    bound = linear.in_features**-0.5
    init.uniform_(linear.bias, -bound, bound)


class TagClipPreTrainedModel(OwnInitMixin, ClearLoadErrorsMixin, PreTrainedModel):
    """Weight init and the transformers plumbing shared by the TAG-CLIP models."""

    config: TagClipConfig
    base_model_prefix = "tagclip"
    input_modalities = ("image", "text")
    _no_split_modules = ["TagClipTextEmbeddings", "TagClipEncoderLayer", "TagClipVisionEmbeddings"]
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": TagClipEncoderLayer, "attentions": TagClipAttention}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        factor = self.config.initializer_factor
        if isinstance(module, TagClipTextEmbeddings):
            init.normal_(module.token_embedding.weight, std=factor * 0.02)
            init.normal_(module.position_embedding.weight, std=factor * 0.02)
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
        elif isinstance(module, TagClipVisionEmbeddings):
            std = module.embed_dim**-0.5 * factor
            init.normal_(module.class_embedding, std=std)
            if module.view_token is not None:
                init.normal_(module.view_token, std=std)
            init.normal_(module.patch_embedding.weight, std=module.config.initializer_range * factor)
            init.normal_(module.position_embedding.weight, std=module.config.initializer_range * factor)
            init.copy_(module.position_ids, torch.arange(module.num_positions).expand((1, -1)))
        elif isinstance(module, TagClipAttention):
            in_std = (module.embed_dim**-0.5) * ((2 * module.config.num_hidden_layers) ** -0.5) * factor
            for proj in (module.q_proj, module.k_proj, module.v_proj):
                init.normal_(proj.weight, std=in_std)
            init.normal_(module.out_proj.weight, std=(module.embed_dim**-0.5) * factor)
        elif isinstance(module, TagClipMLP):
            hidden = module.config.hidden_size
            init.normal_(module.fc1.weight, std=(2 * hidden) ** -0.5 * factor)
            init.normal_(
                module.fc2.weight, std=hidden**-0.5 * (2 * module.config.num_hidden_layers) ** -0.5 * factor
            )
        elif isinstance(module, TagClipHRMoE):
            init.copy_(module.group_masks, module.build_group_masks())
            routers = [module.fea_router] + ([module.img_router] if module.img_router is not None else [])
            for router in routers:
                init.normal_(router.weight, std=module.config.router_init_std)
                init.zeros_(router.bias)
        elif isinstance(module, TagClipTokenSelection):
            for linear in (module.proj, module.mlp_fc1, module.mlp_fc2):
                torch_default_linear_init(linear)
        elif isinstance(module, TagClipModel):
            init.normal_(module.text_projection.weight, std=module.text_embed_dim**-0.5 * factor)
            init.normal_(module.visual_projection.weight, std=module.vision_embed_dim**-0.5 * factor)
            init.constant_(module.logit_scale, self.config.logit_scale_init_value)
            if module.classifier is not None:
                init.normal_(module.classifier.weight, std=0.001)
                init.zeros_(module.classifier.bias)


class TagClipVisionModel(TagClipPreTrainedModel):
    """The TAG-CLIP image tower: ViT with a view token and HR-MoE blocks, without projection."""

    config: TagClipVisionConfig
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    _input_embed_layer = "patch_embedding"

    def __init__(self, config: TagClipVisionConfig):
        super().__init__(config)
        self.embeddings = TagClipVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        moe_layers = set(config.active_moe_layers)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            [TagClipEncoderLayer(config, is_moe=i in moe_layers) for i in range(config.num_hidden_layers)]
        )
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embedding

    @property
    def view_token_exit(self) -> int | None:
        """Index of the block after which the view token is dropped (the last MoE block, else the last block)."""
        if not self.config.use_view_token:
            return None
        moe_layers = self.config.active_moe_layers
        return moe_layers[-1] if moe_layers else self.config.num_hidden_layers - 1

    def set_image_size(self, height: int, width: int) -> None:
        """Run at another input size: interpolate the position embeddings to the new patch grid (bilinear)."""
        patch = self.config.patch_size
        if height <= 0 or width <= 0 or height % patch or width % patch:
            raise ValueError(f"image size {height}x{width} is not a positive multiple of patch_size {patch}.")
        old_grid = self.config.grid_size
        self.config.image_size = [height, width]
        embeddings = self.embeddings
        weight = interpolate_grid_embeddings(
            embeddings.position_embedding.weight.data, old_grid, self.config.grid_size
        )
        embeddings.num_positions = weight.shape[0]
        embeddings.position_embedding = nn.Embedding.from_pretrained(weight, freeze=False)
        embeddings.position_ids = torch.arange(weight.shape[0], device=weight.device).expand((1, -1))

    @merge_with_config_defaults
    @capture_outputs(tie_last_hidden_states=False)
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        view_labels: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> TagClipVisionModelOutput:
        r"""
        pixel_values (`torch.Tensor` of shape `(batch, channels, height, width)`): images from the processor.
        view_labels (`torch.Tensor` of shape `(batch,)`, *optional*): 0 = aerial, 1 = ground (any other value is
            an error); used for routing only when `config.routing == "label"`.
        output_router_logits (`bool`, *optional*): also return the feature-level routing of each MoE block.
        """
        if pixel_values is None:
            raise ValueError("You have to specify pixel_values")
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        hidden_states = self.pre_layrnorm(self.embeddings(pixel_values))
        view_labels = check_view_labels(view_labels, hidden_states.shape[0])
        exit_index = self.view_token_exit
        last = self.config.num_hidden_layers - 1
        view_logits, cos, routings, view_state, attention_row = [], [], [], None, None
        cls_query = torch.zeros(hidden_states.shape[0], dtype=torch.long, device=hidden_states.device)
        for index, layer in enumerate(self.encoder.layers):
            has_view = exit_index is not None and index <= exit_index
            hidden_states, layer_map, layer_view, layer_cos, routing = layer(
                hidden_states,
                None,
                query_index=cls_query if index == last else None,
                view_labels=view_labels,
                has_view_token=has_view,
                **kwargs,
            )
            if layer.is_moe:
                view_logits.append(layer_view)
                cos.append(layer_cos)
                routings.append(routing)
            if index == exit_index:
                view_state, hidden_states = hidden_states[:, -1], hidden_states[:, :-1]
            if layer_map is not None:
                attention_row = layer_map[:, : self.config.num_patches + 1]
        return TagClipVisionModelOutput(
            last_hidden_state=hidden_states,
            pooler_output=self.post_layernorm(hidden_states[:, 0]),
            attention_row=attention_row,
            view_logits=tuple(v for v in view_logits if v is not None) or None,
            cls_view_cos=tuple(c for c in cos if c is not None) or None,
            view_hidden_state=view_state,
            router_logits=tuple(routings) if output_router_logits else None,
        )


def causal_mask(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask [1, 1, L, L] (the only text mask: the reference uses no padding mask)."""
    mask = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask[None, None]


class TagClipTextModel(TagClipPreTrainedModel):
    """The CLIP text tower as TAG-CLIP uses it: causal mask only, EOS pooling, no projection."""

    config: TagClipTextConfig
    input_modalities = ("text",)
    _input_embed_layer = "token_embedding"

    def __init__(self, config: TagClipTextConfig):
        super().__init__(config)
        self.embeddings = TagClipTextEmbeddings(config)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            [TagClipEncoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.token_embedding

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embeddings.token_embedding = value

    def eos_positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Index of the first EOS token of each row; a clear error if a row has none.

        Like every data-dependent input check of this file, the checks never sync with the host
        (`check_on_device`) and are skipped under `torch.compile`, so they do not break the graph.
        """
        vocab = self.config.vocab_size
        bad_ids = f"input_ids must be integer token ids in [0, {vocab}); use the processor"
        if input_ids.is_floating_point():
            raise ValueError(bad_ids)
        check_on_device((input_ids >= 0) & (input_ids < vocab), bad_ids)
        is_eos = input_ids == self.config.eos_token_id
        check_on_device(
            is_eos.any(dim=1),
            f"every row of input_ids needs an EOS token (id {self.config.eos_token_id}); "
            "tokenize with the model's processor (truncation keeps EOS).",
        )
        return is_eos.int().argmax(dim=-1)

    @merge_with_config_defaults
    @capture_outputs(tie_last_hidden_states=False)
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> TagClipTextModelOutput:
        r"""
        input_ids (`torch.Tensor` of shape `(batch, seq_len)`): token ids, padded with `pad_token_id` (0).
        attention_mask (`torch.Tensor`, *optional*): accepted for API compatibility and **ignored**: as in the
            reference, only the causal mask is applied (pooling and TSE read tokens up to EOS).
        """
        if input_ids is None:
            raise ValueError("You have to specify input_ids")
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must have shape (batch, seq_len), got {tuple(input_ids.shape)}")
        check_not_empty(input_ids, "input_ids", "text")
        eos_index = self.eos_positions(input_ids)
        hidden_states = self.embeddings(input_ids)
        mask = causal_mask(input_ids.shape[1], hidden_states.dtype, hidden_states.device)
        last = self.config.num_hidden_layers - 1
        attention_row = None
        for index, layer in enumerate(self.encoder.layers):
            hidden_states, layer_row, *_ = layer(
                hidden_states, mask, query_index=eos_index if index == last else None, **kwargs
            )
            attention_row = layer_row if layer_row is not None else attention_row
        hidden_states = self.final_layer_norm(hidden_states)
        rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        return TagClipTextModelOutput(
            last_hidden_state=hidden_states,
            pooler_output=hidden_states[rows, eos_index.to(hidden_states.device)],
            attention_row=attention_row,
        )


# ---------------------------------------------------------------------------------------------------------
# Dual encoder
# ---------------------------------------------------------------------------------------------------------


def normalize(features: torch.Tensor) -> torch.Tensor:
    """L2-normalise along the last dimension."""
    return features / features.norm(p=2, dim=-1, keepdim=True)


class TagClipModel(TagClipPreTrainedModel):
    """TAG-CLIP dual encoder: image tower with HR-MoE, CLIP text tower, TSE heads, ID classifier, losses."""

    config: TagClipConfig

    def __init__(self, config: TagClipConfig):
        super().__init__(config)
        self.text_embed_dim = config.text_config.hidden_size
        self.vision_embed_dim = config.vision_config.hidden_size
        self.text_model = TagClipTextModel._from_config(config.text_config)
        self.vision_model = TagClipVisionModel._from_config(config.vision_config)
        self.visual_projection = nn.Linear(self.vision_embed_dim, config.projection_dim, bias=False)
        self.text_projection = nn.Linear(self.text_embed_dim, config.projection_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(config.logit_scale_init_value))
        self.visual_tse = (
            TagClipTokenSelection(config.projection_dim, config.tse_embed_dim) if config.use_tse else None
        )
        self.textual_tse = (
            TagClipTokenSelection(config.projection_dim, config.tse_embed_dim) if config.use_tse else None
        )
        self.classifier = (
            nn.Linear(config.projection_dim, config.num_identities) if config.num_identities > 0 else None
        )
        self.precision_policy: NearTieRerun | None = NearTieRerun()  # see precision_tagclip.py
        self.post_init()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as transformers does; with custom code registered, `auto_map` also names the zero-shot class.
        The folder also loads as `SentenceTransformer(folder, trust_remote_code=True)` (combined TAG-PR Eq. 14 vectors)."""
        if self._auto_class is not None:
            module = type(self).__module__.split(".")[-1]
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            auto_map.setdefault("AutoModelForZeroShotImageClassification", f"{module}.{type(self).__name__}")
            self.config.auto_map = auto_map
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):  # sentence-transformers loading (modules.json)
            from .sentence_transformers_tagclip import write_sentence_transformers_files  # imports s-t: 2 s

            write_sentence_transformers_files(save_directory)
        return result

    def get_input_embeddings(self) -> nn.Module:
        return self.text_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.text_model.set_input_embeddings(value)

    def set_image_size(self, height: int, width: int) -> None:
        """Run at another input size (interpolates the position embeddings); see [`TagClipVisionModel`]."""
        self.vision_model.set_image_size(height, width)
        self.config.vision_config.image_size = [height, width]

    @property
    def image_tse_k(self) -> int:
        """Patches kept by image TSE: int(num_patches * ratio) (58 of 196)."""
        return max(1, int(self.config.vision_config.num_patches * self.config.tse_ratio))

    @property
    def text_tse_k(self) -> int:
        """Tokens kept by text TSE: int((context - 2) * ratio) (22 of 75)."""
        return max(1, int((self.config.text_config.max_position_embeddings - 2) * self.config.tse_ratio))

    @can_return_tuple
    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        view_labels: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> TagClipEmbeddingOutput:
        r"""
        Image embeddings: `pooler_output` = projected, unnormalised v_cls; `local_embeds` = unnormalised v_tse.

        pixel_values (`torch.Tensor` of shape `(batch, channels, height, width)`): images from the processor.
        view_labels (`torch.Tensor`, *optional*): 0 = aerial, 1 = ground, for `routing="label"`.
        """
        fields = self.image_tower_features(pixel_values, view_labels, output_router_logits, **kwargs)
        return self.embed_tse(fields, self.visual_tse)

    @near_tie_rerun
    def image_tower_features(
        self,
        pixel_values: torch.Tensor,
        view_labels: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> dict[str, Any]:
        """The per-sample part of `get_image_features`: its output fields, with `tse_tokens` (the selected,
        L2-normalised tokens TSE embeds) in place of `local_embeds`. Finish with `embed_tse`, whose BatchNorm
        couples the samples of a training batch (gradient caching encodes chunks, then embeds the whole batch).
        The model's `precision_policy` applies to the result (`precision_tagclip.py`)."""
        if output_router_logits is None:
            output_router_logits = self.config.vision_config.output_router_logits
        out = self.vision_model(
            pixel_values=pixel_values,
            view_labels=view_labels,
            output_router_logits=True,  # the routing is also the selection's
            return_dict=True,
            **kwargs,
        )
        dense = self.visual_projection(self.vision_model.post_layernorm(out.last_hidden_state))
        tokens = index = tse = None
        if self.visual_tse is not None:
            scores, k = image_tse_scores(out.attention_row), min(self.image_tse_k, dense.shape[1] - 1)
            index, tse = select_tokens(scores, k), (scores, k, None)
            tokens = self.visual_tse.select(dense, index)
        view_embeds = None
        if out.view_hidden_state is not None:
            view_embeds = self.visual_projection(self.vision_model.post_layernorm(out.view_hidden_state))
        return dict(
            last_hidden_state=out.last_hidden_state,
            pooler_output=dense[:, 0],
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            tse_tokens=tokens,
            tse_indices=index,
            dense_embeds=dense,
            view_logits=out.view_logits,
            cls_view_cos=out.cls_view_cos,
            view_embeds=view_embeds,
            router_logits=out.router_logits if output_router_logits else None,
            selection=Selection(tse, out.router_logits),
        )

    @staticmethod
    def embed_tse(fields: dict[str, Any], tse: TagClipTokenSelection | None) -> TagClipEmbeddingOutput:
        """A `get_*_features` output from `*_tower_features` fields: `tse` embeds `tse_tokens` (pooled over
        `tse_lengths` for text) into `local_embeds`, its BatchNorm seeing every token of the batch given."""
        fields = dict(fields)
        tokens, lengths = fields.pop("tse_tokens"), fields.pop("tse_lengths", None)
        local = tse.embed(tokens, lengths) if tse is not None and tokens is not None else None
        return TagClipEmbeddingOutput(**fields, local_embeds=local)

    @can_return_tuple
    def get_text_features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> TagClipEmbeddingOutput:
        r"""
        Text embeddings: `pooler_output` = projected, unnormalised t_eos; `local_embeds` = unnormalised t_tse.

        input_ids (`torch.Tensor` of shape `(batch, seq_len)`): ids from the processor (padded with 0).
        attention_mask (`torch.Tensor`, *optional*): ignored (causal mask only, as the reference).
        """
        return self.embed_tse(self.text_tower_features(input_ids, **kwargs), self.textual_tse)

    @near_tie_rerun
    def text_tower_features(self, input_ids: torch.Tensor, **kwargs) -> dict[str, Any]:
        """The per-sample part of `get_text_features` (see `image_tower_features`); `tse_lengths` holds the
        number of word tokens TSE pools over."""
        out = self.text_model(input_ids=input_ids, return_dict=True, **kwargs)
        dense = self.text_projection(out.last_hidden_state)
        eos_index = self.text_model.eos_positions(input_ids)
        tokens = index = pool_lengths = tse = None
        if self.textual_tse is not None:
            scores, lengths = text_tse_scores(
                out.attention_row, input_ids, eos_index, self.config.text_config.pad_token_id
            )
            empty = "a caption has no word tokens (empty caption): TSE cannot pool over it."
            check_on_device(lengths >= 1, empty)
            k = min(self.text_tse_k, input_ids.shape[1])
            index, tse = select_tokens(scores, k), (scores, k, lengths)
            tokens, pool_lengths = self.textual_tse.select(dense, index), lengths.clamp(max=k)
        rows = torch.arange(dense.shape[0], device=dense.device)
        return dict(
            last_hidden_state=out.last_hidden_state,
            pooler_output=dense[rows, eos_index],
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            tse_tokens=tokens,
            tse_lengths=pool_lengths,
            tse_indices=index,
            dense_embeds=dense,
            selection=Selection(tse),
        )

    def similarity(
        self,
        text: TagClipEmbeddingOutput | torch.Tensor,
        image: TagClipEmbeddingOutput | torch.Tensor,
        text_local: torch.Tensor | None = None,
        image_local: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """TAG-PR Eq. 14 similarity [n_texts, n_images] from the outputs of `get_text_features` / `get_image_features`,
        or from embedding tensors (global `text` / `image`, optional TSE `text_local` / `image_local`; any
        scale: they are L2-normalised here)."""
        if isinstance(text, TagClipEmbeddingOutput):
            text, text_local = text.pooler_output, text.local_embeds
        if isinstance(image, TagClipEmbeddingOutput):
            image, image_local = image.pooler_output, image.local_embeds
        text_local = normalize(text_local) if text_local is not None else None
        image_local = normalize(image_local) if image_local is not None else None
        return eq14_similarity(normalize(text), normalize(image), text_local, image_local)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        view_labels: torch.Tensor | None = None,
        person_ids: torch.Tensor | None = None,
        return_loss: bool | None = None,
        softlabel_alpha: float | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> TagClipOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(n_texts, seq_len)`, *optional*): captions (pad 0).
        pixel_values (`torch.Tensor` of shape `(n_images, 3, H, W)`, *optional*): images.
        attention_mask (`torch.Tensor`, *optional*): ignored (causal mask only).
        view_labels (`torch.LongTensor` of shape `(n_images,)`, *optional*): 0 = aerial, 1 = ground; view loss,
            router accuracy and `routing="label"`.
        person_ids (`torch.LongTensor` of shape `(batch,)`, *optional*): identities of the (image, text) pairs,
            0..num_identities-1 (multi-positive targets and the ID loss); without them each pair is its own class.
        return_loss (`bool`, *optional*): compute the training loss (paired batch: image i <-> text i).
        softlabel_alpha (`float`, *optional*): N-ITC soft-label weight (defaults to `config.softlabel_ratio`).
        output_router_logits (`bool`, *optional*): return the feature-level routing of each MoE block.
        """
        if input_ids is None and pixel_values is None:
            raise ValueError("TagClipModel needs pixel_values, input_ids or both.")
        image = text = None
        if pixel_values is not None:
            image = self.get_image_features(
                pixel_values, view_labels=view_labels, output_router_logits=output_router_logits, **kwargs
            )
        if input_ids is not None:
            text = self.get_text_features(input_ids, **kwargs)
        return self.heads(image, text, view_labels, person_ids, return_loss, softlabel_alpha)

    def heads(
        self,
        image: TagClipEmbeddingOutput | None,
        text: TagClipEmbeddingOutput | None,
        view_labels: torch.Tensor | None = None,
        person_ids: torch.Tensor | None = None,
        return_loss: bool | None = None,
        softlabel_alpha: float | None = None,
    ) -> TagClipOutput:
        """The batch-level part of `forward` from the towers' outputs: normalised embeddings, TAG-PR Eq. 14 logits and,
        with `return_loss`, the loss terms (gradient caching runs it once on a batch of cached tower outputs)."""
        output = TagClipOutput(text_model_output=text, vision_model_output=image)
        if image is not None:
            output.image_embeds = normalize(image.pooler_output)
            output.image_local_embeds = (
                normalize(image.local_embeds) if image.local_embeds is not None else None
            )
            output.view_logits = image.view_logits
            output.router_logits = image.router_logits
            if view_labels is not None and image.view_logits:
                labels = view_labels.to(image.pooler_output.device)
                output.view_accuracy = view_accuracy(image.view_logits, labels)
        if text is not None:
            output.text_embeds = normalize(text.pooler_output)
            output.text_local_embeds = normalize(text.local_embeds) if text.local_embeds is not None else None
        if image is not None and text is not None:
            similarity = eq14_similarity(
                output.text_embeds, output.image_embeds, output.text_local_embeds, output.image_local_embeds
            )
            output.logits_per_text = similarity * self.logit_scale.exp()
            output.logits_per_image = output.logits_per_text.t()
        if return_loss:
            self._add_losses(output, image, text, view_labels, person_ids, softlabel_alpha)
        return output

    def _add_losses(self, output, image, text, view_labels, person_ids, softlabel_alpha) -> None:
        """Fill the loss terms of `output` (TAG-PR Eq. 1, 2, 9/10, 11-13) for a paired batch."""
        if image is None or text is None or output.image_embeds.shape[0] != output.text_embeds.shape[0]:
            raise ValueError("return_loss=True needs a paired batch: as many images as captions.")
        config = self.config
        ids = person_ids.to(output.image_embeds.device) if person_ids is not None else None
        scale = clamped_scale(self.logit_scale, config.logit_scale_max)
        alpha = config.softlabel_ratio if softlabel_alpha is None else softlabel_alpha
        pairs = [(output.image_embeds, output.text_embeds)]
        if output.image_local_embeds is not None:
            pairs.append((output.image_local_embeds, output.text_local_embeds))
        # the one gather-aware loss (TAG-PR Eq. 1, 2): a trainer may set `contrastive_loss` (e.g. gather=False)
        contrastive = getattr(self, "contrastive_loss", None) or ContrastiveLoss()
        nitc, ritc = contrastive(pairs, ids, scale, alpha, config.ritc_eps)
        output.loss_nitc, output.loss_ritc = config.nitc_weight * nitc, config.ritc_weight * ritc
        output.loss_id = self._id_loss(image, text, person_ids)
        output.loss_view = self._view_loss(image, view_labels)
        output.loss_ortho = self._ortho_loss(image)
        output.loss = total_loss(
            {k: getattr(output, k) for k in ("loss_nitc", "loss_ritc", "loss_id", "loss_view", "loss_ortho")}
        )

    def _id_loss(self, image, text, person_ids) -> torch.Tensor | None:
        if not self.config.use_id_loss or self.classifier is None:
            return None
        if person_ids is None:
            raise ValueError("the ID loss needs person_ids (0..num_identities-1); or set use_id_loss=False.")
        labels = person_ids.to(image.pooler_output.device).long()
        check_on_device(
            (labels >= 0) & (labels < self.config.num_identities),
            f"person_ids must lie in [0, {self.config.num_identities}) for the ID classifier.",
        )
        logits = self.classifier(image.pooler_output.float()), self.classifier(text.pooler_output.float())
        return self.config.lambda_id * id_loss(*logits, labels)

    def _view_loss(self, image, view_labels) -> torch.Tensor | None:
        if not self.config.use_view_loss or not image.view_logits:
            return None
        if view_labels is None:
            raise ValueError(
                "the view loss needs view_labels (0 = aerial, 1 = ground); or set use_view_loss=False."
            )
        labels = view_labels.to(image.pooler_output.device).long()
        return self.config.lambda_view * view_loss(tuple(v.float() for v in image.view_logits), labels)

    def _ortho_loss(self, image) -> torch.Tensor | None:
        config = self.config
        if not config.use_ortho_loss or image.view_embeds is None:
            return None
        if config.ortho_variant == "paper":
            loss = ortho_loss_paper(
                image.pooler_output.float(), image.view_embeds.float(), config.ortho_alpha
            )
        else:
            if not image.cls_view_cos:
                return None
            loss = ortho_loss_reference(image.cls_view_cos, config.ortho_scale, config.ortho_margin)
        return config.lambda_ortho * loss


__all__ = [
    "TagClipModel",
    "TagClipOutput",
    "TagClipPreTrainedModel",
    "TagClipTextModel",
    "TagClipVisionModel",
    "eq14_similarity",
]
