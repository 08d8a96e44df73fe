"""Bindings of csrc/paged_attention.c: paged decode attention and the K/V cache writes."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenserve.kernels import build
from tokenserve.kernels.tensor_checks import check_caches, check_i64, check_rows, i64, ptr


class DecodeRows:
    """A step's decode rows for the paged decode kernel: the rows' indices in the step's
    tokens, their block tables [rows, stride] and context lengths, all int64, checked once
    and then used by every layer."""

    __slots__ = ("block_tables", "num_rows", "rows", "seq_lens")

    def __init__(self, rows: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor) -> None:
        check_i64(rows, block_tables, seq_lens)
        if not rows.shape[0] == seq_lens.shape[0] == block_tables.shape[0]:
            raise ValueError("paged decode: rows, seq_lens and block_tables disagree in length.")
        self.rows, self.block_tables, self.seq_lens = rows, block_tables, seq_lens
        self.num_rows = rows.shape[0]


class PagedAttentionOps:
    """The kernels of paged_attention.c over torch tensors (see there for layouts)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._decode = library.ts_paged_decode
        self._decode.restype = ctypes.c_int
        self._decode.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr,
                                 i64, i64, i64, i64, i64, ctypes.c_float, i64]
        self._write_kv = library.ts_write_kv
        self._write_kv.restype = None
        self._write_kv.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64]

    def decode(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        rows: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> None:
        """Attend query rows `rows` of query [tokens, heads, dim] (a view into a fused QKV
        tensor is fine) over their contexts; write the same rows of out [tokens, heads, dim].
        The caches are float32 or bfloat16."""
        self.decode_prepared(out, query, key_cache, value_cache,
                             DecodeRows(rows, block_tables, seq_lens), scale)

    def decode_prepared(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        decode_rows: DecodeRows,
        scale: float,
    ) -> None:
        """decode() with the step's rows, block tables and lengths checked beforehand, once
        for all layers."""
        bf16 = check_caches(key_cache, value_cache)
        check_rows(out, query)
        _, num_heads, head_dim = query.shape
        _, num_kv_heads, block_size, _ = key_cache.shape
        status = self._decode(
            out.data_ptr(), out.stride(0), query.data_ptr(), query.stride(0),
            decode_rows.rows.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            decode_rows.block_tables.data_ptr(), decode_rows.block_tables.stride(0),
            decode_rows.seq_lens.data_ptr(), decode_rows.num_rows, num_heads, num_kv_heads,
            head_dim, block_size, scale, bf16,
        )
        if status != 0:
            raise MemoryError("paged decode could not allocate its scratch buffers.")

    def write_kv(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """key/value [tokens, kv_heads, dim] (views into a fused QKV tensor are fine) into
        slots [tokens] of the caches [blocks, kv_heads, block_size, dim] (float32, or
        bfloat16: rounded to nearest even)."""
        bf16 = check_caches(key_cache, value_cache)
        check_rows(key, value)
        check_i64(slots)
        if key.stride(0) != value.stride(0) and len(slots) > 1:
            raise ValueError("write_kv needs key and value with the same row stride.")
        _, num_kv_heads, block_size, head_dim = key_cache.shape
        if key.shape[1:] != (num_kv_heads, head_dim) or len(slots) != key.shape[0]:
            raise ValueError("write_kv: shapes of key, slots and cache disagree.")
        self._write_kv(
            key_cache.data_ptr(), value_cache.data_ptr(), key.data_ptr(), value.data_ptr(),
            key.stride(0), slots.data_ptr(), len(slots), num_kv_heads, block_size, head_dim,
            bf16,
        )


def load(isa: str | None = None) -> PagedAttentionOps | None:
    """The operators built for `isa` (default: the selected level, build.select_isa)."""
    return _load(build.selected_isa() if isa is None else isa)


@functools.cache
def _load(isa: str) -> PagedAttentionOps | None:
    library = build.load("paged_attention", isa)
    return None if library is None else PagedAttentionOps(library)
