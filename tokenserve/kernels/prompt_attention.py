"""Bindings of csrc/prompt_attention.c: all prompt chunks of a step attended in one call."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenserve.kernels import build, paged_attention
from tokenserve.kernels.paged_attention import DecodeRows
from tokenserve.kernels.tensor_checks import (
    CACHE_MODES,
    check_caches,
    check_i64,
    check_rows,
    i64,
    ptr,
)

# ts_prompt_attention_path's answers: the decode kernel per query row, the bf16 paths, the
# float32 tiles.
PATHS = ("rows", "avx512_bf16", "amx", "float32")


class PromptChunks:
    """A step's prompt chunks for the kernel: chunks [n, 3] int64 (start row, end row,
    context length; a chunk is the last end - start positions of its context, already in the
    cache) and block tables [n, stride] int64, checked once and then used by every layer."""

    __slots__ = ("block_tables", "chunks", "max_block", "max_seq_len", "num_chunks",
                 "num_rows", "num_tokens")

    def __init__(self, chunks: torch.Tensor, block_tables: torch.Tensor) -> None:
        check_i64(chunks, block_tables)
        if chunks.dim() != 2 or chunks.shape[1] != 3 or block_tables.dim() != 2 or (
            block_tables.shape[0] != chunks.shape[0]
        ):
            raise ValueError("prompt attention: chunks must be [n, 3] with one block table each.")
        starts, ends, seq_lens = chunks.unbind(1)
        if len(chunks) and not (
            bool((starts >= 0).all()) and bool((ends > starts).all())
            and bool((seq_lens >= ends - starts).all())
        ):
            raise ValueError("prompt attention: each chunk needs 0 <= start < end and "
                             "end - start <= its context length.")
        self.chunks, self.block_tables = chunks, block_tables
        self.num_chunks = chunks.shape[0]
        self.num_tokens = int(ends.max()) if len(chunks) else 0
        # The rows the chunks hold between them.
        self.num_rows = int((ends - starts).sum()) if len(chunks) else 0
        self.max_seq_len = int(seq_lens.max()) if len(chunks) else 0
        # Block ids are checked against the cache at each call (two int compares): the
        # tables are built before the caches are known.
        self.max_block = int(block_tables.max()) if block_tables.numel() else -1
        if block_tables.numel() and int(block_tables.min()) < 0:
            raise ValueError("prompt attention: negative block id.")

    def check_cache(self, block_size: int, num_blocks: int) -> None:
        if self.max_seq_len > self.block_tables.shape[1] * block_size:
            raise ValueError("prompt attention: a block table is shorter than its context.")
        if self.max_block >= num_blocks:
            raise ValueError("prompt attention: a block id is past the end of the cache.")


class PromptAttentionOps:
    """ts_prompt_attention over torch tensors (see csrc/prompt_attention.c for layouts)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._attend = library.ts_prompt_attention
        self._attend.restype = ctypes.c_int
        self._attend.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64,
                                 i64, i64, ctypes.c_float, i64]
        self._path = library.ts_prompt_attention_path
        self._path.restype = ctypes.c_int
        self._path.argtypes = [i64, i64, i64, i64]
        self._decode_prefix = library.ts_paged_decode_prefix
        self._decode_prefix.restype = ctypes.c_int
        self._decode_prefix.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64,
                                        i64, i64, i64, i64, ctypes.c_float, i64, i64, i64,
                                        i64, i64]
        self._prefix_available = library.ts_decode_prefix_available
        self._prefix_available.restype = ctypes.c_int
        self._prefix_available.argtypes = [i64, i64, i64, i64, i64]

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one instance per level, kept for good
    def path(self, cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
             head_dim: int) -> str:
        """The kernel's path for these shapes: "amx" (AMX tiles) or "avx512_bf16"
        (vdpbf16ps), both with the numerics of PyTorch's bf16 flash kernel; "float32" (a
        float32 cache: tiles of queries in float32 on every level); else "rows" (the decode
        kernel per query row: correct, slower)."""
        code = self._path(CACHE_MODES.get(cache_dtype, 0), num_heads, num_kv_heads, head_dim)
        return PATHS[code]

    def native(self, cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
               head_dim: int) -> bool:
        """Whether these shapes take a bf16 path (queries and probabilities rounded to bf16)."""
        return self.path(cache_dtype, num_heads, num_kv_heads, head_dim) in ("avx512_bf16",
                                                                             "amx")

    def attend(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        chunks: PromptChunks,
        scale: float,
    ) -> None:
        """Attend the chunks' rows of query [tokens, heads, dim] (a view into a fused QKV
        tensor is fine) over their contexts in the caches [blocks, kv_heads, block_size,
        dim]; write the same rows of out [tokens, heads, dim]."""
        mode = check_caches(key_cache, value_cache)
        check_rows(out, query)
        num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
        _, num_heads, _ = query.shape
        if query.shape[2] != head_dim or out.shape[1:] != query.shape[1:] or (
            num_heads % num_kv_heads
        ):
            raise ValueError("prompt attention: query, out and cache shapes disagree.")
        if chunks.num_tokens > min(query.shape[0], out.shape[0]):
            raise ValueError("prompt attention: a chunk reaches past the step's tokens.")
        chunks.check_cache(block_size, num_blocks)
        if chunks.num_chunks == 0:
            return
        status = self._attend(
            out.data_ptr(), out.stride(0), query.data_ptr(), query.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(), chunks.chunks.data_ptr(),
            chunks.block_tables.data_ptr(), chunks.block_tables.stride(0), chunks.num_chunks,
            num_heads, num_kv_heads, head_dim, block_size, scale, mode,
        )
        if status != 0:
            raise MemoryError("prompt attention could not allocate its scratch buffers.")


    def shared_prefix_path(self, cache_dtype: torch.dtype, bf16_numerics: bool,
                           num_heads: int, num_kv_heads: int, head_dim: int,
                           block_size: int) -> bool:
        """Whether decode rows with a shared prefix (DecodeRows.prefix_len) attend to it
        together here (`decode_shared_prefix`; kernels/csrc/prompt_attention.c, "Decode rows
        over a shared prefix"): the AMX prompt path and the decode kernel's bf16 numerics."""
        mode = paged_attention.kv_mode(cache_dtype, bf16_numerics)
        return bool(self._prefix_available(mode, num_heads, num_kv_heads, head_dim,
                                           block_size))

    def decode_shared_prefix(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        decode_rows: DecodeRows,
        scale: float,
        bf16_numerics: bool = False,
        prefetch: str | None = None,
        split: bool = True,
    ) -> None:
        """PagedAttentionOps.decode_prepared for rows of which the first
        decode_rows.prefix_rows share their first decode_rows.prefix_len positions: that
        prefix attended to by those rows at once, the rest by each row, merged (where
        shared_prefix_path says so; else as decode_prepared, `split` as there)."""
        arguments = paged_attention.decode_arguments(out, query, key_cache, value_cache,
                                                     decode_rows, scale, bf16_numerics,
                                                     prefetch, split)
        if decode_rows.prefix_len % key_cache.shape[2] or (
            decode_rows.prefix_len and decode_rows.prefix_len >= decode_rows.sharing_context
        ):
            raise ValueError("paged decode: a shared prefix is whole blocks, shorter than "
                             "the context of every row sharing it.")
        status = self._decode_prefix(*arguments, decode_rows.prefix_len,
                                     decode_rows.prefix_rows)
        if status != 0:
            raise MemoryError("paged decode could not allocate its scratch buffers.")


def load(isa: str | None = None) -> PromptAttentionOps | None:
    """The kernel built for `isa` (default: the selected level, build.select_isa)."""
    return _load(build.selected_isa() if isa is None else isa)


@functools.cache
def _load(isa: str) -> PromptAttentionOps | None:
    library = build.load("prompt_attention", isa)
    return None if library is None else PromptAttentionOps(library)
