"""Quantization methods: the form a linear layer's weight lives in and how it multiplies.
`get_linear_method` picks one at load from the model's format and the kernel settings."""

from __future__ import annotations

import torch

from tokenserve.config import KernelConfig
from tokenserve.kernels import quant_linear
from tokenserve.model.layers.quantization.base import QuantizationMethod
from tokenserve.model.layers.quantization.gguf import GGUFLinearMethod
from tokenserve.model.layers.quantization.unquantized import UnquantizedLinearMethod
from tokenserve.model.precision import activation_dtype

__all__ = ["GGUFLinearMethod", "QuantizationMethod", "UnquantizedLinearMethod", "get_linear_method"]


def get_linear_method(
    model_format: str, dtype: torch.dtype, kernel_config: KernelConfig
) -> QuantizationMethod:
    """GGUF blocks beside the dense weights for a float32 or bfloat16 GGUF model whose block
    kernels are built and wanted; dense weights otherwise. A bfloat16 model keeps its dense
    weights in bf16 beside float32 activations (model/precision.py): the products above
    the blocks' row limits (for bf16 the lower `bf16_quantized_max_rows`: prefill and all
    but the smallest decode steps) run on oneDNN's bf16 GEMM (docs/PERFORMANCE_CPU.md)."""
    use_onednn = not kernel_config.disable_onednn
    weight_dtype = dtype if activation_dtype(dtype) != dtype else None
    max_rows, gemm_max_rows = kernel_config.block_row_limits(weight_dtype is not None)
    if (
        model_format == "gguf"
        and activation_dtype(dtype) == torch.float32
        and not kernel_config.disable_c_kernels
        and max(max_rows, gemm_max_rows) > 0
        and quant_linear.load() is not None
    ):
        return GGUFLinearMethod(max_rows, gemm_max_rows, use_onednn=use_onednn,
                                weight_dtype=weight_dtype)
    return UnquantizedLinearMethod(use_onednn=use_onednn, weight_dtype=weight_dtype)
