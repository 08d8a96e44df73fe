"""The quantization-method interface: how a linear layer's weight is created, filled from a
checkpoint, prepared once loaded, and multiplied by."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from tokenserve.model.layers.weight_loading import Rows, copy_rows


class QuantizationMethod(ABC):
    """One object per model, shared by its linear layers; what it keeps per layer it keeps
    on the layer. Chosen at load from the model's format (`get_linear_method`)."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's `weight` (and whatever else the method keeps on it)."""

    def load_weight(self, layer: nn.Module, loaded_weight, rows: Rows) -> None:
        """Put (this rank's part of) a checkpoint weight into the layer's weight, or into its
        output `rows`. A checkpoint may also hand the weight in another form (GGUF blocks),
        which only a method that reads that form keeps."""
        copy_rows(layer.weight, loaded_weight, rows)

    def process_weights_after_loading(self, layer: nn.Module, pack: bool = True) -> None:
        """Turn the loaded weight into the form `apply` reads (once, after loading). With
        pack=False a method may leave a repacking that only some products read (oneDNN's
        layout) to `pack_weight`, which `apply` then calls itself before the first of them."""

    def pack_weight(self, layer: nn.Module) -> None:
        """What process_weights_after_loading(pack=False) left, done (once; a no-op after)."""

    def input_dtype(self, layer: nn.Module, rows: int) -> torch.dtype | None:
        """What `apply` reads for a product of `rows` rows where that differs from the
        activations' dtype (the operator before may hand its result in it); None: the same."""
        return None

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x · Wᵀ (+ bias) for x [rows, in]."""
