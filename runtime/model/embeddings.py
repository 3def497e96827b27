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
