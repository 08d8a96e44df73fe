"""A layer's attention: this step's keys and values into the layer's KV cache, then each
query over its request's context, through the engine's attention backend. The cache and
the step's metadata are the backend's; the layer only passes them on."""

from __future__ import annotations

import torch
from torch import nn

from tokenserve.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        self.backend = backend

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        return self.backend.forward(query, key, value, kv_cache, metadata, self.scale)
