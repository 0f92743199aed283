"""Token Selection Embedding (TSE, from RDE) of TAG-CLIP: which tokens each tower's last attention row selects,
and the embedding of those tokens (the local half of TAG-PR Eq. 14)."""

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TagClipTokenSelection", "image_tse_scores", "select_tokens", "text_tse_scores"]


class TagClipTokenSelection(nn.Module):
    """Token Selection Embedding (TSE, from RDE): top-attended tokens -> l2norm -> proj + MLP -> max-pool.

    `proj` is the reference's `fc` (image) / `linear` (text) layer; `mlp` is Linear -> BatchNorm1d -> ReLU ->
    Linear (reference `model/CrossEmbeddingLayer_tse.py`).
    """

    def __init__(self, input_dim: int, output_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, output_dim)
        self.mlp_fc1 = nn.Linear(input_dim, input_dim)
        self.mlp_bn = nn.BatchNorm1d(input_dim)
        self.mlp_fc2 = nn.Linear(input_dim, output_dim)

    def mlp(self, features: torch.Tensor) -> torch.Tensor:
        batch, k, dim = features.shape
        hidden = self.mlp_bn(self.mlp_fc1(features).reshape(batch * k, -1)).reshape(batch, k, -1)
        return self.mlp_fc2(F.relu(hidden))

    def forward(
        self, dense: torch.Tensor, index: torch.Tensor, pool_lengths: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Embed the tokens `index` [B, k] (from `select_tokens`) of `dense` [B, L, D]; max-pool over the first
        `pool_lengths` of them."""
        return self.embed(self.select(dense, index), pool_lengths)

    @staticmethod
    def select(dense: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The tokens `index` [B, k] of `dense` [B, L, D], L2-normalised: [B, k, D] (per sample)."""
        selected = dense.gather(1, index[..., None].expand(-1, -1, dense.shape[-1]))
        return selected / (selected.float().pow(2).sum(-1, keepdim=True).sqrt().to(selected.dtype) + 1e-8)

    def embed(self, selected: torch.Tensor, pool_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """proj + MLP of the selected tokens [B, k, D], max-pooled over the first `pool_lengths` of them. In
        training the MLP's BatchNorm normalises with the statistics of all B x k tokens: it couples the batch."""
        k = selected.shape[1]
        features = self.proj(selected) + self.mlp(selected)
        if pool_lengths is not None:
            keep = torch.arange(k, device=features.device)[None, :] < pool_lengths[:, None]
            features = features.masked_fill(~keep[..., None], torch.finfo(features.dtype).min)
        return features.max(dim=1).values


def select_tokens(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [B, k] of the `k` highest-scoring tokens, best first (TSE's token selection)."""
    return scores.topk(k, dim=-1).indices


def image_tse_scores(attention_row: torch.Tensor) -> torch.Tensor:
    """CLS-query row of the head-averaged attention with the CLS column set to -1 (`VisualEmbeddingLayer`)."""
    scores = attention_row.clone()
    scores[:, 0] = -1
    return scores


def text_tse_scores(
    attention_row: torch.Tensor, input_ids: torch.Tensor, eos_index: torch.Tensor, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """EOS-query row with SOS/EOS columns set to -1 and padding zeroed; also the number of words per caption."""
    token_mask = input_ids != pad_token_id
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    scores = attention_row.clone()
    scores[:, 0] = -1
    scores[rows, eos_index] = -1
    scores = scores * token_mask
    return scores, token_mask.sum(dim=1) - 2
