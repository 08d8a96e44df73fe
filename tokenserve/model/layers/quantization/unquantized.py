"""Dense float weights (float32, bfloat16): `F.linear`, or on CPU oneDNN with the weight
prepacked once after loading.

`F.linear` on CPU goes to MKL's sgemm, which runs well below the matmul peak for the small-M
shapes of decode (docs/benchmarks/cpu-hot-path.md). oneDNN, which PyTorch also ships, reaches
it; packing each weight once into oneDNN's blocked layout saves reordering it on every
call. The packed copy replaces the dense weight, so memory does not double (unless another
module reads the dense weight too: a tied embedding table).

With `weight_dtype=torch.bfloat16` (a bfloat16 model on CPU, model/precision.py) the weights
are kept in bf16 while the activations stay float32: each product multiplies bf16 input in
bf16 with float32 accumulation (oneDNN: AMX tiles or AVX512_BF16 where the CPU has them) and
writes the sums in bf16 (oneDNN's output dtype is its input's). The operator before hands
the input in bf16 (`input_dtype`) and the sums stay bf16 for the operator after; float32
input is rounded here and its sums handed back as float32; a bias is added in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenserve.kernels.row_buckets import bucketed, empty_rows
from tokenserve.model.layers.quantization.base import QuantizationMethod

_PACKABLE = (torch.float32, torch.bfloat16)


def pack_for_onednn(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """oneDNN's packed form of a [out, in] weight (in `dtype`, default its own), or None
    where it does not apply."""
    dtype = dtype or weight.dtype
    if (
        weight.device.type != "cpu"
        or dtype not in _PACKABLE
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), None)
    except (RuntimeError, AttributeError):
        return None


class UnquantizedLinearMethod(QuantizationMethod):
    def __init__(self, use_onednn: bool = True, weight_dtype: torch.dtype | None = None) -> None:
        self.use_onednn = use_onednn
        # The weights' dtype where it differs from the activations' (bf16 products); None:
        # the layer's params_dtype.
        self.weight_dtype = weight_dtype

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        layer.weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition,
                        dtype=self.weight_dtype or params_dtype),
            requires_grad=False,
        )
        layer.packed_weight = None  # oneDNN's form, once processed
        layer.packing_pending = False  # loaded, and its packing left for later (pack_weight)

    def process_weights_after_loading(self, layer: nn.Module, pack: bool = True) -> None:
        layer.packing_pending = self.use_onednn and layer.packed_weight is None
        # Packing that changes the weight's dtype (a tied head's float32 table, packed in bf16)
        # changes what its products read (`input_dtype`): that one is done now.
        if pack or layer.weight.dtype != (self.weight_dtype or layer.weight.dtype):
            self.pack_weight(layer)

    def pack_weight(self, layer: nn.Module) -> None:
        if not getattr(layer, "packing_pending", False):
            return
        layer.packing_pending = False
        # A tied head's weight is the (activation-dtype) embedding table: packed in the
        # products' dtype all the same.
        packed = pack_for_onednn(layer.weight, self.weight_dtype)
        if packed is None:
            return
        layer.packed_weight = packed
        if not getattr(layer, "keep_dense_weight", False):
            # The packed copy is the weight from now on; free the dense one.
            layer.weight.data = torch.empty(0, dtype=packed.dtype)

    def input_dtype(self, layer: nn.Module, rows: int) -> torch.dtype | None:
        """bf16 for bf16 products: the operator before hands its result in bf16, no cast.
        (A tied head left unpacked multiplies by the float32 table: None.) A weight still to
        be packed is in the dtype its packing keeps."""
        weight = layer.weight if layer.packed_weight is None else layer.packed_weight
        return self.weight_dtype if weight.dtype == self.weight_dtype else None

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x · Wᵀ (+ bias). Float32 x on bf16 weights: the result comes back float32; bf16 x
        (handed by the operator before): the result stays bf16 (float32 with a bias, which
        is added in float32)."""
        if getattr(layer, "packing_pending", False):
            self.pack_weight(layer)  # the first product that reads oneDNN's form
        weight = layer.weight if layer.packed_weight is None else layer.packed_weight
        if weight.dtype != x.dtype or x.dtype == self.weight_dtype:
            # bf16 products: round x, accumulate in float32 (oneDNN, MKL), and add the bias
            # in float32 after.
            # The rows padded to a bucket (oneDNN builds a primitive per row count:
            # kernels/row_buckets.py), in place where the operator before left room.
            rows = x.shape[0]
            xb = x
            if x.dtype != weight.dtype:
                xb = empty_rows(tuple(x.shape), weight.dtype, x.device).copy_(x)
            if x.dim() == 2:
                xb = bucketed(xb)
            out = self._product(layer, xb, None)[:rows]
            if x.dtype != weight.dtype or bias is not None:
                out = out.to(torch.float32 if x.dtype == weight.dtype else x.dtype)
            return out if bias is None else out.add_(bias)
        return self._product(layer, x, bias)

    @staticmethod
    def _product(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed_weight is None:
            return F.linear(x, layer.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")

    def __str__(self) -> str:
        dtype = "" if self.weight_dtype is None else f" in {str(self.weight_dtype)[6:]}"
        return f"dense weights{dtype}" + (", oneDNN-prepacked on CPU" if self.use_onednn else "")
