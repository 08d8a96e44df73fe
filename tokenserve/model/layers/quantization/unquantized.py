"""Dense float weights (float32, bfloat16): `F.linear`, or on CPU oneDNN with the weight
prepacked once after loading.

`F.linear` on CPU goes to MKL's sgemm, which runs well below the matmul peak for the small-M
shapes of decode (docs/benchmarks/cpu-hot-path.md). oneDNN, which PyTorch also ships, reaches
it; packing each weight once into oneDNN's blocked layout saves reordering it on every
call. The packed copy replaces the dense weight, so memory does not double (unless another
module reads the dense weight too: a tied embedding table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenserve.model.layers.quantization.base import QuantizationMethod


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed form of a [out, in] weight, or None where it does not apply."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError):
        return None


class UnquantizedLinearMethod(QuantizationMethod):
    def __init__(self, use_onednn: bool = True) -> None:
        self.use_onednn = use_onednn

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        layer.weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        layer.packed_weight = None  # oneDNN's form, once processed

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.use_onednn or layer.packed_weight is not None:
            return
        packed = pack_for_onednn(layer.weight)
        if packed is None:
            return
        layer.packed_weight = packed
        if not getattr(layer, "keep_dense_weight", False):
            # The packed copy is the weight from now on; free the dense one.
            layer.weight.data = torch.empty(0, dtype=packed.dtype)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.packed_weight is None:
            return F.linear(x, layer.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")

    def __str__(self) -> str:
        return "dense weights" + (", oneDNN-prepacked on CPU" if self.use_onednn else "")
