"""Linear layers on CPU through oneDNN with prepacked weights.

`F.linear` on CPU goes to MKL's sgemm, which on this project's AMD machines runs well below
the matmul peak for the small-M shapes of decode (measured in docs/BENCHMARKS.md).
oneDNN, which PyTorch also ships, reaches it; packing each weight once into oneDNN's
blocked layout saves reordering it on every call. The packed copy replaces the dense
weight, so memory does not double.

`TOKENSERVE_DISABLE_ONEDNN=1` keeps the dense weights and `F.linear` (for comparison).

A weight may also have a block-quantized copy from its GGUF file (model/quantized.py):
products of few rows (decode) read that instead, being bound by memory traffic.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tokenserve.model.quantized import QuantizedWeight

DISABLE_ENV = "TOKENSERVE_DISABLE_ONEDNN"


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed form of a [out, in] weight, or None where it does not apply."""
    if (
        os.environ.get(DISABLE_ENV, "") not in ("", "0")
        or weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError):
        return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    quantized: QuantizedWeight | None = None,
) -> torch.Tensor:
    if quantized is not None and x.dim() == 2 and quantized.takes(x.shape[0]):
        out = quantized.matmul(x)
        return out if bias is None else out.add_(bias)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
