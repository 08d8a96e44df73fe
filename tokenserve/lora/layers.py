"""LoRA-wrapped linear layers: the base layer's product plus each token's adapter.

`LoRALinear` wraps any `LinearBase` (model/layers/linear.py) and holds `max_loras` slots
of A / B matrices, stacked for the batched products of `punica.py`. A merged layer
(q/k/v, gate/up) has one part per checkpoint projection: an adapter's `q_proj` pair fills
the q rows of B and its own A rows, so the parts of one adapter never mix. Tensor
parallelism slices as the base does: a column-parallel layer's B rows, a row-parallel
layer's A columns, for this rank. `wrap_linear_layers` swaps the modules of a built model;
the model file does not change.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenserve.lora.peft_loader import LoRAAdapter
from tokenserve.lora.punica import LoRABatchMapping, add_lora
from tokenserve.model.layers.linear import LinearBase, RowParallelLinear, rank_slice


class LoRALinear(nn.Module):
    """y = base(x) + scaling · B_slot · A_slot · x, slot = the token's adapter's slot."""

    def __init__(
        self,
        base_layer: LinearBase,
        part_names: list[str],
        mapping: LoRABatchMapping,
    ) -> None:
        super().__init__()
        if len(part_names) != len(base_layer.output_partition_sizes):
            raise ValueError(
                f"{len(part_names)} part names for a layer of "
                f"{len(base_layer.output_partition_sizes)} parts."
            )
        self.base_layer = base_layer
        self.part_names = part_names
        self.mapping = mapping
        self.num_parts = len(part_names)
        # A part's columns: [slots · max_rank], slot s at s · max_rank (of A: after the
        # earlier parts' columns; of B: in the part's own output rows).
        self.part_width = mapping.max_loras * mapping.max_rank
        dtype, device = mapping.dtype, mapping.device
        self.register_buffer(
            "lora_a",
            torch.zeros(
                self.num_parts * self.part_width, base_layer.input_size_per_partition,
                dtype=dtype, device=device,
            ),
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(
                base_layer.output_size_per_partition, self.part_width, dtype=dtype, device=device
            ),
        )
        self.is_row_parallel = isinstance(base_layer, RowParallelLinear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.base_layer(x)
        if not self.mapping.has_adapters:
            return output
        return add_lora(
            output, x, self.lora_a, self.lora_b, self.base_layer.output_partition_sizes,
            self.mapping.mask,
        )

    def clear_slot(self, slot: int) -> None:
        rank = self.mapping.max_rank
        for part in range(self.num_parts):
            column = part * self.part_width + slot * rank
            self.lora_a[column : column + rank] = 0
        self.lora_b[:, slot * rank : (slot + 1) * rank] = 0

    def set_slot(self, slot: int, adapter: LoRAAdapter, layer_index: int) -> None:
        """Put the adapter's pairs for this layer's parts in `slot` (zeros where it has none)."""
        self.clear_slot(slot)
        base = self.base_layer
        first_row = 0
        for part, (name, rows) in enumerate(zip(self.part_names, base.output_partition_sizes)):
            pair = adapter.weights.get((layer_index, name))
            if pair is not None:
                lora_a, lora_b = pair
                if self.is_row_parallel:
                    lora_a = rank_slice(lora_a, 1, base.tp_size, base.tp_rank)
                else:
                    lora_b = rank_slice(lora_b, 0, base.tp_size, base.tp_rank)
                rank = lora_a.shape[0]
                column = slot * self.mapping.max_rank
                a_column = part * self.part_width + column
                self.lora_a[a_column : a_column + rank] = lora_a.to(self.lora_a.device)
                self.lora_b[first_row : first_row + rows, column : column + rank] = lora_b.to(
                    self.lora_b.device
                )
            first_row += rows


def wrap_linear_layers(
    model: nn.Module, mapping: LoRABatchMapping, target_modules: tuple[str, ...]
) -> list[tuple[int, LoRALinear]]:
    """Replace every decoder layer's linear layer that holds a target projection by its LoRA
    wrapper; returns (layer index, wrapper) pairs. Merged layers find their parts through the
    model's `packed_modules_mapping`."""
    parts_of: dict[str, list[str]] = {}
    for part, (merged, _) in getattr(model, "packed_modules_mapping", {}).items():
        parts_of.setdefault(merged, []).append(part)
    wrapped: list[tuple[int, LoRALinear]] = []
    for layer_index, layer in enumerate(model.model.layers):
        for name, module in list(layer.named_modules()):
            if not isinstance(module, LinearBase) or not name:
                continue
            parent_name, _, leaf = name.rpartition(".")
            parts = parts_of.get(leaf, [leaf])
            if not set(parts) <= set(target_modules):
                continue
            wrapper = LoRALinear(module, parts, mapping)
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, leaf, wrapper)
            wrapped.append((layer_index, wrapper))
    return wrapped
