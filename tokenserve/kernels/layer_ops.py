"""Bindings of csrc/layer_ops.c: RMSNorm (with the residual add fused), SwiGLU, and rotary
embeddings in place; RMSNorm and SwiGLU also read and write the bfloat16 of a bf16 model's
products (model/precision.py) without a cast between."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenserve.kernels import build
from tokenserve.kernels.row_buckets import empty_rows
from tokenserve.kernels.tensor_checks import (
    check_f32,
    check_f32_or_bf16,
    check_i64,
    check_rows,
    i64,
    ptr,
)


class LayerOps:
    """The fused operators of layer_ops.c over torch tensors (fp32, contiguous)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._rms_norm = library.ts_rms_norm_f32
        self._rms_norm.restype = None
        self._rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
        self._silu_and_mul = library.ts_silu_and_mul_f32
        self._silu_and_mul.restype = None
        self._silu_and_mul.argtypes = [ptr, ptr, i64, i64]
        self._rms_norm_mixed = library.ts_rms_norm_mixed
        self._rms_norm_mixed.restype = None
        self._rms_norm_mixed.argtypes = [
            ptr, ctypes.c_int, ptr, ctypes.c_int, ptr, ptr, i64, i64, ctypes.c_float,
        ]
        self._silu_and_mul_to_bf16 = library.ts_silu_and_mul_to_bf16
        self._silu_and_mul_to_bf16.restype = None
        self._silu_and_mul_to_bf16.argtypes = [ptr, ptr, ctypes.c_int, i64, i64]
        self._rotary_from_bf16 = library.ts_rotary_from_bf16
        self._rotary_from_bf16.restype = None
        self._rotary_from_bf16.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        self._rotary = library.ts_rotary_f32
        self._rotary.restype = None
        self._rotary.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        self._argmax_rows = library.ts_argmax_rows_f32
        self._argmax_rows.restype = None
        self._argmax_rows.argtypes = [ptr, ptr, i64, i64]
        self._argmax_rows_bf16 = library.ts_argmax_rows_bf16
        self._argmax_rows_bf16.restype = None
        self._argmax_rows_bf16.argtypes = [ptr, ptr, i64, i64]

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """RMSNorm of x [rows, hidden]; with `residual`, of residual + x, which is also
        written back into `residual` (in place). x and the result (`out_dtype`, default x's)
        may be bfloat16; residual and weight are float32."""
        out_dtype = out_dtype or x.dtype
        if x.dtype != torch.float32 or out_dtype != torch.float32:
            return self._rms_norm_bf16(x, weight, eps, residual, out_dtype)
        check_f32(x, weight, *(() if residual is None else (residual,)))
        out = torch.empty_like(x)
        self._rms_norm(
            out.data_ptr(), x.data_ptr(), 0 if residual is None else residual.data_ptr(),
            weight.data_ptr(), x.shape[0], x.shape[1], eps,
        )
        return out

    def _rms_norm_bf16(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        check_f32_or_bf16(x)
        check_f32(weight, *(() if residual is None else (residual,)))
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"rms_norm writes float32 or bfloat16, not {out_dtype}.")
        # A bf16 result feeds a bf16 product: room for its padded rows (row_buckets.py).
        out = empty_rows(tuple(x.shape), out_dtype)
        self._rms_norm_mixed(
            out.data_ptr(), int(out_dtype == torch.bfloat16), x.data_ptr(),
            int(x.dtype == torch.bfloat16), 0 if residual is None else residual.data_ptr(),
            weight.data_ptr(), x.shape[0], x.shape[1], eps,
        )
        return out

    def silu_and_mul(
        self, gate_up: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """silu(gate) * up for gate_up = [rows, 2 * d] → [rows, d]. gate_up may be bfloat16;
        the result is `out_dtype` (default gate_up's): float32 from float32 only."""
        out_dtype = out_dtype or gate_up.dtype
        if out_dtype == torch.bfloat16:
            check_f32_or_bf16(gate_up)
            rows, width = gate_up.shape
            out = empty_rows((rows, width // 2), torch.bfloat16)  # a bf16 product reads it
            self._silu_and_mul_to_bf16(
                out.data_ptr(), gate_up.data_ptr(), int(gate_up.dtype == torch.bfloat16), rows,
                width // 2,
            )
            return out
        check_f32(gate_up)
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_and_mul(out.data_ptr(), gate_up.data_ptr(), rows, width // 2)
        return out

    def rotary(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Rotate query [tokens, heads, dim] and key [tokens, kv_heads, dim] in place. Both
        may be views into one fused QKV tensor: rows may be strided (the same stride), heads
        must be contiguous within a row."""
        check_f32(cos, sin)
        check_rows(query, key)
        check_i64(positions)
        tokens, heads, dim = query.shape
        if tokens > 1 and key.stride(0) != query.stride(0):
            raise ValueError("rotary needs query and key with the same row stride.")
        self._rotary(
            query.data_ptr(), key.data_ptr(), query.stride(0), positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), tokens, heads, key.shape[1], dim,
        )


    def rotary_from_bf16(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:
        """A bf16 product's fused q/k/v [tokens, (heads + 2 kv_heads) * dim] as float32,
        query and key heads rotated: the cast and `rotary` in one pass."""
        check_f32(cos, sin)
        check_i64(positions)
        if qkv.dtype != torch.bfloat16 or not qkv.is_contiguous() or not qkv.is_cpu:
            raise ValueError("rotary_from_bf16 needs a contiguous bfloat16 CPU tensor.")
        tokens, width = qkv.shape
        head_dim = cos.shape[1]
        if width != (num_heads + 2 * num_kv_heads) * head_dim or positions.shape != (tokens,):
            raise ValueError("rotary_from_bf16: qkv, heads, positions and tables disagree.")
        out = torch.empty((tokens, width), dtype=torch.float32)
        self._rotary_from_bf16(
            out.data_ptr(), qkv.data_ptr(), width, positions.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), tokens, num_heads, num_kv_heads, head_dim,
        )
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's index of its largest value, x [rows, cols] float32 or bfloat16 → int64
        [rows]: the first of equal maxima, the first NaN where a row has one (torch's
        `max(dim=-1).indices`), in one pass over x (greedy sampling's logits), on all the
        threads (torch's bf16 `max` runs on one)."""
        check_f32_or_bf16(x)
        if x.dim() != 2 or x.shape[1] == 0:
            raise ValueError("argmax_rows needs x [rows, cols] with at least one column.")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        argmax = self._argmax_rows if x.dtype == torch.float32 else self._argmax_rows_bf16
        argmax(out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1])
        return out


def load(isa: str | None = None) -> LayerOps | None:
    """The operators built for `isa` (default: the selected level, build.select_isa)."""
    return _load(build.selected_isa() if isa is None else isa)


@functools.cache
def _load(isa: str) -> LayerOps | None:
    library = build.load("layer_ops", isa)
    return None if library is None else LayerOps(library)
