"""Running a model's decoder layers over a step: the seam where a whole-stack kernel can take
a step instead (model/fused_decode.py)."""

from __future__ import annotations

import torch
from torch import nn

from tokenserve.attention.backend import AttentionMetadata


class LayerStack:
    """The decoder layers in turn on the residual stream. Each layer takes (positions,
    hidden_states, residual, kv_cache, metadata) and returns (its output, the stream before
    that output is added); the next layer's norm adds the two."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers

    def __call__(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream before it is added). `residual`:
        the stream a pipeline stage receives beside the previous stage's last output."""
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, metadata)
        assert residual is not None, "a model has at least one layer"
        return hidden_states, residual
