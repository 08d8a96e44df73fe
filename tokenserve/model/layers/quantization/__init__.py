"""Quantization methods: the form a linear layer's weight lives in and how it multiplies.
`get_linear_method` picks one at load from the model's format and the kernel settings."""

from __future__ import annotations

import torch

from tokenserve.config import KernelConfig
from tokenserve.kernels import quant_linear
from tokenserve.model.layers.quantization.base import QuantizationMethod
from tokenserve.model.layers.quantization.gguf import GGUFLinearMethod
from tokenserve.model.layers.quantization.unquantized import UnquantizedLinearMethod

__all__ = ["GGUFLinearMethod", "QuantizationMethod", "UnquantizedLinearMethod", "get_linear_method"]


def get_linear_method(
    model_format: str, dtype: torch.dtype, kernel_config: KernelConfig
) -> QuantizationMethod:
    """GGUF blocks beside the dense weights for a float32 GGUF model whose block kernels
    are built and wanted; dense weights otherwise."""
    use_onednn = not kernel_config.disable_onednn
    row_limits = (kernel_config.quantized_max_rows, kernel_config.quantized_gemm_max_rows)
    if (
        model_format == "gguf"
        and dtype == torch.float32
        and not kernel_config.disable_c_kernels
        and max(row_limits) > 0
        and quant_linear.load() is not None
    ):
        return GGUFLinearMethod(*row_limits, use_onednn=use_onednn)
    return UnquantizedLinearMethod(use_onednn=use_onednn)
