"""The model's precision: what `--dtype` resolves to, and what each part computes in.

`--dtype auto` is the fast dtype of the CPU at hand, as vLLM users expect: bfloat16 where
the kernels' instruction set (kernels/cpu_isa.py, `--cpu-isa`) computes it natively
(AVX512_BF16 or AMX: oneDNN's bf16 GEMM runs at several times float32's rate there),
float32 elsewhere (without native bf16 a bf16 matmul is slower than a float32 one).

A bfloat16 model on CPU is mixed precision (docs/PERFORMANCE_CPU.md): the linear layers'
weights are bfloat16 (GGUF blocks expanded to bf16), their products run in bf16 with
float32 accumulation (oneDNN, AMX tiles where present), and the KV cache holds bfloat16;
the residual stream, norms, rotary and softmax compute in float32 (`activation_dtype`).
Between them the values a product reads or writes pass in bf16: a norm or SwiGLU writes
its result rounded to bf16 for the product after it (the rounding the product would do),
a product's sums stay bf16 until the next operator reads them, and the LM head's logits
stay bf16 for the sampler (kernels/csrc/layer_ops.c; `QuantizationMethod.input_dtype`).
A GGUF model's products of at most `bf16_quantized_max_rows` rows read its blocks
(model/layers/quantization/__init__.py): on the amx level (1024 rows by default) through
the AMX block kernel with these same bf16 numerics, reading and writing bf16 as oneDNN's
products do (each weight expanded from its block as
gguf dequantizes it, then rounded to bf16 exactly as the dense bf16 weight is; x rounded to
bf16; float32 sums, each rounded to bf16 as oneDNN rounds its own), fused decode steps
included, except products of one row, which stream the blocks faster in float32 (as
below); on the avx512_bf16 level (128 rows) through the vdpbf16ps block kernel with the
same bf16 numerics, from one row (above 8 rows in its panel form); on lower levels (16 rows) through the float32 block
kernels, i.e. float32 weights and inputs. Larger products, prefill's chunks among them,
take oneDNN's bf16 products. float16 stays float16
throughout (the pure-torch path).
"""

from __future__ import annotations

import torch

from tokenserve.config import torch_dtype
from tokenserve.model import dtype_names

DTYPES = {alias: torch_dtype(name) for alias, name in dtype_names.DTYPE_ALIASES.items()}


def auto_dtype(isa: str | None = None) -> torch.dtype:
    """bfloat16 where the level `isa` (default: the CPU's best) computes it natively."""
    return torch_dtype(dtype_names.auto_dtype_name(isa))


def resolve_dtype(dtype: str | torch.dtype, isa: str | None = None) -> torch.dtype:
    """--dtype ("auto", a name of DTYPES, or a torch dtype) → the model's dtype
    (`dtype_names.resolve_dtype_name`, as a torch dtype)."""
    return torch_dtype(dtype_names.resolve_dtype_name(dtype, isa))


def activation_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """What the hidden states, norms and attention of a `dtype` model (a torch dtype or
    the configuration's name) compute in: float32 for a bfloat16 model (only its products
    are bf16), else the dtype itself."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    return torch.float32 if dtype == torch.bfloat16 else dtype
