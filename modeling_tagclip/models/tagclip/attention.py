"""Multi-head attention shared by the TAG-CLIP and ViSA units, with the fp32 attention row that TSE reads.

The ViSA unit carries a generated copy (``utils/fix_copies.py``).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["SelfAttention", "attention_row", "eager_attention_forward"]


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention returning per-head weights (post-dropout, as torch's MultiheadAttention)."""
    attn_weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class SelfAttention(nn.Module):
    """Multi-head self-attention (q/k/v/out projections as transformers' CLIP); `config` needs `hidden_size`,
    `num_attention_heads`, `attention_dropout` and `_attn_implementation`."""

    def __init__(self, config: PreTrainedConfig):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.scale = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        self.is_causal = False
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        query_index: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Returns (output, per-head weights or None, head-averaged fp32 attention row of `query_index` or None).

        The row ([batch, L], one query per sample) is what TSE reads; it is recomputed in fp32 from this block's
        queries and keys, so the attention kernel (SDPA) and the compute dtype do not change which tokens TSE
        selects.
        """
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        queries = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        keys = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        values = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            queries,
            keys,
            values,
            attention_mask,
            scaling=self.scale,
            dropout=0.0 if not self.training else self.dropout,
            **kwargs,
        )
        attn_output = self.out_proj(attn_output.reshape(*input_shape, -1).contiguous())
        row = None
        if query_index is not None:
            row = self.fp32_attention_row(hidden_states, keys, query_index, attention_mask)
        return attn_output, attn_weights, row

    def fp32_attention_row(
        self,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        query_index: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Head-averaged attention [B, L] of the query at `query_index` (one per sample), all in fp32.

        The query and, unless they are fp32 already, the keys are re-projected in fp32 from the block input:
        under bf16 the rounding of q/k alone reorders near-tied scores and TSE picks other tokens. Costs one
        extra key projection in bf16 (one of the last block's twelve D x D-sized matmuls), none in fp32.
        """
        batch, length = hidden_states.shape[:2]
        rows = torch.arange(batch, device=hidden_states.device)
        with torch.autocast(hidden_states.device.type, enabled=False):
            inputs = hidden_states.float()
            query = F.linear(inputs[rows, query_index], self.q_proj.weight.float(), self.q_proj.bias.float())
            if keys.dtype != torch.float32:
                keys = F.linear(inputs, self.k_proj.weight.float(), self.k_proj.bias.float())
                keys = keys.view(batch, length, -1, self.head_dim).transpose(1, 2)
            mask = None
            if attention_mask is not None:
                mask = attention_mask.expand(batch, -1, -1, -1)[rows, :, query_index].float()
            return attention_row(query.view(batch, -1, self.head_dim), keys.float(), mask, self.scale)


def attention_row(
    query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Head-averaged softmax attention of one query per sample: q [B, H, d], k [B, H, L, d] -> [B, L]."""
    scores = torch.einsum("bhd,bhld->bhl", query, keys) * scaling
    if mask is not None:
        scores = scores + mask
    return scores.softmax(dim=-1).mean(dim=1)
