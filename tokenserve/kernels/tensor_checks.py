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


def check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """1 for bfloat16 caches, 0 for float32; anything else is refused."""
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in (torch.float32,
                                                                       torch.bfloat16):
        raise ValueError("C kernels need float32 or bfloat16 KV caches, both the same.")
    for cache in (key_cache, value_cache):
        if not cache.is_contiguous() or not cache.is_cpu:
            raise ValueError("C kernels need contiguous CPU KV caches.")
    return int(key_cache.dtype == torch.bfloat16)
