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
(model/layers/quantization/__init__.py): on the amx level (128 rows by default) through
the AMX block kernel with these same bf16 numerics (each weight expanded from its block as
gguf dequantizes it, then rounded to bf16 exactly as the dense bf16 weight is; x rounded to
bf16; float32 sums, handed on in float32), fused decode steps included, except products
of 1-4 rows, which stream the blocks faster in float32 (as below); on other levels
(16 rows) through the float32 block kernels, i.e. float32 weights and inputs. Larger
products, prefill's chunks among them, take oneDNN's bf16 products. float16 stays float16
throughout (the pure-torch path).
"""

from __future__ import annotations

import torch

from tokenserve.kernels import cpu_isa

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def auto_dtype(isa: str | None = None) -> torch.dtype:
    """bfloat16 where the level `isa` (default: the CPU's best) computes it natively."""
    return torch.bfloat16 if cpu_isa.native_bf16(isa) else torch.float32


def resolve_dtype(dtype: str | torch.dtype, isa: str | None = None) -> torch.dtype:
    """--dtype ("auto", a name of DTYPES, or a torch dtype) → the model's dtype. `isa` is
    checked against the CPU whatever the dtype, so that a forced level it lacks fails here."""
    cpu_isa.resolve(isa)
    if dtype == "auto":
        return auto_dtype(isa)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}."
        ) from None


def activation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the hidden states, norms and attention of a `dtype` model compute in: float32
    for a bfloat16 model (only its products are bf16), else the dtype itself."""
    return torch.float32 if dtype == torch.bfloat16 else dtype
