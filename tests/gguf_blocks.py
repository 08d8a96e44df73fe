"""Random weights in GGUF's block formats, for the tests of the quantized kernels and layers."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokenserve.model.layers.quantization.gguf import QuantizedWeight


def random_quantized(
    kind: str, rows: int, width: int, seed: int = 0
) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random weight in `kind` blocks, and gguf's own dequantization of those blocks."""
    weight = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    blocks = quantize(weight, GGMLQuantizationType[kind])
    reference = dequantize(blocks, GGMLQuantizationType[kind]).reshape(rows, width)
    return QuantizedWeight.from_blocks(kind, blocks), torch.from_numpy(reference.copy())
