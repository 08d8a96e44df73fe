"""A bf16 model's oneDNN products built ahead of the steps that run them.

oneDNN builds (JITs) a primitive for each shape a bf16 product runs at; the rows are padded
to buckets (kernels/row_buckets.py), so a model needs one primitive per weight shape and
bucket, and the first step of each size pays for building its own: the products
of the default model's first 256-row prompt step took 46.8 ms against 36.0 ms in the next
(docs/PERFORMANCE_CPU.md, "Row buckets of bf16 products"). ProductWarmUp runs each of
the model's distinct products once at each bucket a step may bring, one product per call,
for the engine core's idle time (core/engine_core_proc.py): the step budget's own bucket
(chunked prefill's steps are that size) and the others, the smallest where MAX_PRODUCTS
leaves some out (so that oneDNN's primitive cache, 1024 by default, keeps what they built),
run from the most rows down, so that each product's temporaries reuse the heap blocks the
one before freed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tokenserve.kernels.row_buckets import buckets_up_to
from tokenserve.model.layers.linear import LinearBase

MAX_PRODUCTS = 512


def warm_up_plan(model: nn.Module, max_rows: int) -> list[tuple[LinearBase, int]]:
    """(layer, rows) for each distinct weight shape among the model's linear layers whose
    product of `rows` rows is a bf16 oneDNN product (the layer holds oneDNN's packed weight,
    reads bf16 at that many rows and its GGUF blocks do not take them), for every bucket up
    to max_rows' own: of them that one and then the smallest, MAX_PRODUCTS at most, in the
    order of most rows first."""
    layers: dict[tuple[int, int], LinearBase] = {}
    for module in model.modules():
        if isinstance(module, LinearBase) and getattr(module, "packed_weight", None) is not None:
            shape = (module.input_size_per_partition, module.output_size_per_partition)
            layers.setdefault(shape, module)
    *smaller, top = buckets_up_to(max_rows)
    order = [top, *smaller]
    plan = [(layer, rows) for rows in order for layer in layers.values()
            if _onednn_bf16(layer, rows)][:MAX_PRODUCTS]
    # Run from the most rows down: each product's input and output then fit in the blocks
    # the one before freed, where from the fewest up every one needed a larger block than
    # any freed so far and the heap grew by each (~390 MiB of the default model's engine,
    # kept mapped by the worker's malloc settings: docs/PERFORMANCE_CPU.md).
    return sorted(plan, key=lambda unit: -unit[1])


def _onednn_bf16(layer: LinearBase, rows: int) -> bool:
    """Whether a product of `rows` rows is a bf16 product on oneDNN's packed weight: one that
    reads bf16 and that the layer's GGUF blocks, if any, do not take (their AMX kernel reads
    bf16 too, and builds no primitive)."""
    blocks = getattr(layer, "blocks", None)
    if blocks is not None and blocks.takes(rows):
        return False
    return layer.input_dtype(rows) == torch.bfloat16


class ProductWarmUp:
    """Works through warm_up_plan one product per `step`."""

    def __init__(self, model: nn.Module, max_rows: int) -> None:
        self._units: Iterator[tuple[LinearBase, int]] = iter(warm_up_plan(model, max_rows))

    def step(self) -> bool:
        """Run the plan's next product on zeros (its result is dropped); whether any are
        left."""
        unit = next(self._units, None)
        if unit is None:
            return False
        layer, rows = unit
        with torch.inference_mode():
            x = torch.zeros(rows, layer.input_size_per_partition, dtype=torch.bfloat16)
            layer.quant_method.apply(layer, x)
        return True
