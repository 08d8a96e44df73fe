"""What the C kernels require of the tensors they are handed, checked before the pointers
cross over (a wrong dtype or layout would otherwise be read as garbage)."""

from __future__ import annotations

import ctypes

import torch

i64 = ctypes.c_int64
ptr = ctypes.c_void_p


def check_rows(*tensors: torch.Tensor) -> None:
    """[rows, heads, dim] float32 with rows at any stride and each row's heads contiguous."""
    for tensor in tensors:
        _, heads, dim = tensor.shape
        if (
            tensor.dtype != torch.float32
            or not tensor.is_cpu
            or tensor.stride(2) != 1
            or (heads > 1 and tensor.stride(1) != dim)
        ):
            raise ValueError("C kernels need float32 CPU tensors with contiguous heads.")


def check_i64(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.dtype != torch.int64 or not tensor.is_contiguous() or not tensor.is_cpu:
            raise ValueError("C kernels need contiguous int64 CPU index tensors.")


def check_f32(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.dtype != torch.float32 or not tensor.is_contiguous() or not tensor.is_cpu:
            raise ValueError("C kernels need contiguous float32 CPU tensors.")


def check_f32_or_bf16(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if (
            tensor.dtype not in (torch.float32, torch.bfloat16)
            or not tensor.is_contiguous()
            or not tensor.is_cpu
        ):
            raise ValueError("C kernels need contiguous float32 or bfloat16 CPU tensors.")


# What a KV cache holds, as the C kernels name it (csrc/paged_attention.c's KV_* modes; 2,
# a bfloat16 cache read with bf16 numerics, is paged_attention.kv_mode's to choose).
CACHE_MODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


def check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """The caches' mode (CACHE_MODES: 0 float32, 1 bfloat16, 3 and 4 the 8-bit floats E4M3
    and E5M2); anything else is refused."""
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in CACHE_MODES:
        raise ValueError("C kernels need float32, bfloat16 or float8 (e4m3fn, e5m2) KV caches, "
                         "both the same.")
    for cache in (key_cache, value_cache):
        if not cache.is_contiguous() or not cache.is_cpu:
            raise ValueError("C kernels need contiguous CPU KV caches.")
    return CACHE_MODES[key_cache.dtype]
