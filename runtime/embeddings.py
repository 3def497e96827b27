"""The token embedding (and the output head it is tied to) stored in 16 bits, used with fp32 activations.

In 4-bit modes the embedding is the largest tensor left (49152 x 576 in SmolLM2: 113 MB in fp32) and the output
head reads all of it at every decode step. Storing it in bf16 halves both the memory and the bytes read, while
the residual stream stays in the activation dtype: lookups are upcast, the head multiplies in 16 bits and
returns fp32 logits. One tensor serves both when the model ties them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class StoredEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [vocab, hidden] in the storage dtype
        self.out_dtype = out_dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(self.out_dtype)


class StoredHead(nn.Module):
    """logits = x W^T with W stored in 16 bits (shared with the embedding when tied)."""

    def __init__(self, weight: nn.Parameter, out_dtype: torch.dtype):
        super().__init__()
        self.weight = weight
        self.out_dtype = out_dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.weight.dtype), self.weight).to(self.out_dtype)


def store_embeddings(model: nn.Module, storage: torch.dtype, activations: torch.dtype) -> None:
    """Swap embed_tokens / lm_head for 16-bit stored versions (tied heads keep sharing one tensor)."""
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight
    new_embed = StoredEmbedding(embed.weight.data.to(storage), activations)
    model.model.embed_tokens = new_embed
    head_weight = new_embed.weight if tied else nn.Parameter(model.lm_head.weight.data.to(storage), requires_grad=False)
    model.lm_head = StoredHead(head_weight, activations)
