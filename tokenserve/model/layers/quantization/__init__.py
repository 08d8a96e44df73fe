"""Quantization methods: the form a linear layer's weight lives in and how it multiplies.
`get_linear_method` picks one at load from the model's format and the kernel settings."""

from __future__ import annotations

import torch

from tokenserve.config import KernelConfig
from tokenserve.kernels import build, quant_linear
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
    weights in bf16 beside float32 activations (model/precision.py): its products of at
    most `bf16_quantized_max_rows` rows read the blocks (on the amx level through the AMX
    kernel with bf16 numerics, on the avx512_bf16 level through the vdpbf16ps kernel with
    the same numerics, elsewhere the float32 kernels), larger ones run on oneDNN's
    bf16 GEMM (docs/PERFORMANCE_CPU.md). On every x86-64 level products of at most
    `int8_activation_max_rows` rows (by default 4 for a bfloat16 model, none for a float32
    one) multiply the blocks by x rounded to 8 bits per block instead."""
    use_onednn = not kernel_config.disable_onednn
    weight_dtype = dtype if activation_dtype(dtype) != dtype else None
    max_rows, gemm_max_rows = kernel_config.block_row_limits(weight_dtype is not None)
    ops = None if kernel_config.disable_c_kernels else quant_linear.load()
    # The AMX kernel for a bf16 model where it runs (both float32 limits 0 turn the blocks off).
    blocks_wanted = kernel_config.quantized_max_rows or kernel_config.quantized_gemm_max_rows
    amx_max_rows = (kernel_config.bf16_block_max_rows("amx")
                    if weight_dtype is not None and blocks_wanted and ops is not None and ops.amx
                    else 0)
    # Elsewhere with AVX512_BF16 its vdpbf16ps kernel, the same numerics.
    dp_max_rows = (kernel_config.bf16_block_max_rows("dp")
                   if weight_dtype is not None and blocks_wanted and ops is not None and ops.dp
                   else 0)
    # x rounded to 8 bits for the fewest rows, where the level builds that kernel (x86-64).
    i8_max_rows = (kernel_config.int8_activation_rows(weight_dtype is not None)
                   if blocks_wanted and ops is not None and ops.i8 else 0)
    gguf = (
        model_format == "gguf"
        and activation_dtype(dtype) == torch.float32
        and ops is not None
        and max(max_rows, gemm_max_rows, amx_max_rows, dp_max_rows, i8_max_rows) > 0
    )
    if kernel_config.batch_invariant and not (gguf and amx_max_rows > 0):
        # Only the AMX block kernel's sums are each row's own in a fixed order; oneDNN's and
        # the other block kernels' depend on the row count (docs/PERFORMANCE_CPU.md).
        raise ValueError(
            "batch_invariant needs a GGUF model in bfloat16 on the amx level (every product "
            f"on the AMX block kernel); this is a {model_format} model in {dtype}, C kernels "
            f"{'off' if ops is None else 'on the ' + build.selected_isa() + ' level'}."
        )
    if gguf:
        return GGUFLinearMethod(max_rows, gemm_max_rows, use_onednn=use_onednn,
                                weight_dtype=weight_dtype, amx_max_rows=amx_max_rows,
                                dp_max_rows=dp_max_rows,
                                batch_invariant=kernel_config.batch_invariant,
                                i8_max_rows=i8_max_rows)
    return UnquantizedLinearMethod(use_onednn=use_onednn, weight_dtype=weight_dtype)
