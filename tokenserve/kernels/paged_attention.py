"""Bindings of csrc/paged_attention.c: paged decode attention and the K/V cache writes."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from tokenserve.kernels import build, cpu_isa
from tokenserve.kernels.tensor_checks import (
    CACHE_MODES,
    check_caches,
    check_i64,
    check_rows,
    i64,
    ptr,
)


# How a decode step's threads keep memory busy while they compute (csrc/paged_attention.c's
# decode_items): each claims its next item one ahead and streams all of it into L2, or
# each item prefetches its own tokens a short way ahead (and the next item's first ones).
DECODE_PREFETCH = {"stream_next_item": 0, "own_tokens_ahead": 1}


def decode_prefetch(vendor: str | None = None) -> str:
    """The plan for a CPU of `vendor` (default: this one's): own_tokens_ahead on Intel
    (streaming the next item: the kernel 1.08-1.17x slower on a Xeon with AMX),
    stream_next_item elsewhere (on an AMD EPYC 1.45-1.6x faster than every item prefetching
    its own tokens into L2; own_tokens_ahead not measured there); docs/PERFORMANCE_CPU.md.
    The outputs are the same bits either way."""
    vendor = cpu_isa.cpu_vendor() if vendor is None else vendor
    return "own_tokens_ahead" if vendor == "GenuineIntel" else "stream_next_item"


# A plan every decode step of the process takes instead of the CPU's (force_decode_prefetch).
_forced_prefetch: str | None = None


def force_decode_prefetch(plan: str | None) -> None:
    """Make every decode step of this process that names no plan prefetch by `plan` (one of
    DECODE_PREFETCH), or by the CPU's again with None: for benchmarks that time the plans
    side by side in one engine (benchmarks/decode_step_cost.py)."""
    global _forced_prefetch
    _forced_prefetch = None if plan is None else _checked(plan)


def prefetch_code(prefetch: str | None) -> int:
    """The C kernels' argument for a plan of DECODE_PREFETCH (None: the one forced for the
    process, else this CPU's)."""
    return DECODE_PREFETCH[_checked(prefetch or _forced_prefetch or decode_prefetch())]


def _checked(plan: str) -> str:
    if plan not in DECODE_PREFETCH:
        raise ValueError(f"decode prefetch must be one of {list(DECODE_PREFETCH)}, got {plan!r}.")
    return plan


class DecodeRows:
    """A step's decode rows for the paged decode kernel: the rows' indices in the step's
    tokens, their block tables [rows, stride] and context lengths, all int64, checked once
    and then used by every layer. prefix_len: positions at the start of the contexts of the
    first prefix_rows rows (all of them by default) held in the same blocks
    (`shared_prefix_rows`), which the prompt kernel attends to for those rows at once
    (kernels/csrc/prompt_attention.c, "Decode rows over a shared prefix"); 0 for none. The
    kernels that do not take it attend to whole contexts."""

    __slots__ = ("block_tables", "num_rows", "prefix_len", "prefix_rows", "rows", "seq_lens",
                 "sharing_context")

    def __init__(self, rows: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, prefix_len: int = 0,
                 prefix_rows: int | None = None) -> None:
        check_i64(rows, block_tables, seq_lens)
        if not rows.shape[0] == seq_lens.shape[0] == block_tables.shape[0]:
            raise ValueError("paged decode: rows, seq_lens and block_tables disagree in length.")
        self.rows, self.block_tables, self.seq_lens = rows, block_tables, seq_lens
        self.num_rows = rows.shape[0]
        self.prefix_len = prefix_len
        self.prefix_rows = self.num_rows if prefix_rows is None else prefix_rows
        if prefix_len and not 0 < self.prefix_rows <= self.num_rows:
            raise ValueError("paged decode: the rows of a shared prefix are some of the rows.")
        # The shortest context of the rows sharing the prefix (checked against it per call).
        self.sharing_context = int(seq_lens[: self.prefix_rows].min()) if prefix_len else 0


def shared_prefix_rows(block_tables: np.ndarray, seq_lens: list[int], block_size: int,
                       min_rows: int, min_positions: int) -> tuple[np.ndarray, int]:
    """The rows whose contexts start with the same blocks (the same block ids at the same
    places: blocks shared through the prefix cache, full, never written again), and how many
    positions those blocks hold: of the rows that share their first block with the most
    others, the prefix length and the rows sharing it that make the most row-positions, at
    least min_rows rows and min_positions positions (else no rows, 0). Each row keeps at
    least its last position of its own. block_tables [rows, stride]: each row's blocks in
    order (past them anything)."""
    none = np.zeros(0, dtype=np.int64), 0
    if len(seq_lens) < min_rows or block_tables.shape[1] == 0:
        return none
    firsts, counts = np.unique(block_tables[:, 0], return_counts=True)
    if counts.max() < min_rows:  # requests of prompts all their own: most steps
        return none
    reference = int(np.argmax(block_tables[:, 0] == firsts[np.argmax(counts)]))
    # Whole blocks below each context's last position, and so below the reference row's.
    most = np.minimum((np.asarray(seq_lens) - 1) // block_size, block_tables.shape[1])
    most = np.minimum(most, most[reference])
    same = block_tables == block_tables[reference]
    run = np.where(same.all(axis=1), block_tables.shape[1], np.argmin(same, axis=1))
    shared = np.minimum(run, most)
    best, best_work = 0, 0
    for blocks in np.unique(shared[shared * block_size >= max(min_positions, 1)]):
        rows = int((shared >= blocks).sum())
        if rows >= min_rows and rows * blocks > best_work:
            best, best_work = int(blocks), rows * int(blocks)
    if best == 0:
        return none
    return np.flatnonzero(shared >= best), best * block_size


def decode_arguments(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, decode_rows: DecodeRows, scale: float,
                     bf16_numerics: bool, prefetch: str | None, split: bool = True) -> tuple:
    """ts_paged_decode's arguments (those of ts_paged_decode_prefix but the prefix), the
    tensors checked. split: few rows' contexts may be attended to in two halves on the
    threads, merged (csrc/paged_attention.c, DecodeSplit); False where a row's sums must not
    depend on the other rows."""
    check_caches(key_cache, value_cache)
    check_rows(out, query)
    _, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    return (out.data_ptr(), out.stride(0), query.data_ptr(), query.stride(0),
            decode_rows.rows.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            decode_rows.block_tables.data_ptr(), decode_rows.block_tables.stride(0),
            decode_rows.seq_lens.data_ptr(), decode_rows.num_rows, num_heads, num_kv_heads,
            head_dim, block_size, scale, kv_mode(key_cache.dtype, bf16_numerics),
            prefetch_code(prefetch), int(split))


class PagedAttentionOps:
    """The kernels of paged_attention.c over torch tensors (see there for layouts)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._decode = library.ts_paged_decode
        self._decode.restype = ctypes.c_int
        self._decode.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr,
                                 i64, i64, i64, i64, i64, ctypes.c_float, i64, i64, i64]
        self._write_kv = library.ts_write_kv
        self._write_kv.restype = None
        self._write_kv.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64]
        self._dot_products = library.ts_paged_decode_dot_products
        self._dot_products.restype = ctypes.c_int
        self._dot_products.argtypes = [i64, i64]

    def dot_products(self, cache_dtype: torch.dtype, head_dim: int, block_size: int,
                     bf16_numerics: bool) -> bool:
        """Whether decode over such a cache takes the dot-product path: a bfloat16 cache read
        with bf16_numerics (queries and probabilities rounded to bf16, as the prompt kernel's
        bf16 path) on a level with AVX512_BF16, head size a multiple of 16, blocks of an even
        size; else float32 arithmetic on the cache's values."""
        return (cache_dtype == torch.bfloat16 and bf16_numerics
                and bool(self._dot_products(head_dim, block_size)))

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
        bf16_numerics: bool = False,
        prefetch: str | None = None,
        split: bool = True,
    ) -> None:
        """Attend query rows `rows` of query [tokens, heads, dim] (a view into a fused QKV
        tensor is fine) over their contexts; write the same rows of out [tokens, heads, dim].
        The caches are float32, bfloat16 or float8; `bf16_numerics`: see kv_mode();
        `prefetch`: a plan of DECODE_PREFETCH (None: this CPU's, decode_prefetch());
        `split`: see decode_arguments."""
        self.decode_prepared(out, query, key_cache, value_cache,
                             DecodeRows(rows, block_tables, seq_lens), scale, bf16_numerics,
                             prefetch, split)

    def decode_prepared(
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
        """decode() with the step's rows, block tables and lengths checked beforehand, once
        for all layers."""
        status = self._decode(*decode_arguments(out, query, key_cache, value_cache,
                                                decode_rows, scale, bf16_numerics, prefetch,
                                                split))
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
        slots [tokens] of the caches [blocks, kv_heads, block_size, dim] (float32; bfloat16
        or float8: rounded to nearest even, float8 saturated as `round_to_cache` does)."""
        mode = check_caches(key_cache, value_cache)
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
            mode,
        )


def kv_mode(cache_dtype: torch.dtype, bf16_numerics: bool) -> int:
    """The C kernels' cache argument: 0 a float32 cache; 1 a bfloat16 one read in float32
    arithmetic; 2 a bfloat16 one read with bf16 numerics, the prompt chunks' when they attend
    in bf16 (the dot-product path where the level has AVX512_BF16, else as 1); 3 and 4 a
    float8 cache (E4M3, E5M2), widened to float32 whatever bf16_numerics says."""
    if cache_dtype == torch.bfloat16:
        return 2 if bf16_numerics else 1
    return CACHE_MODES.get(cache_dtype, 0)


def round_to_cache(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """values in the cache's dtype, as the C kernels write them: float8 saturated at its
    largest finite value (torch's own conversion gives E5M2 an infinity there) and rounded
    to nearest even."""
    if cache_dtype.is_floating_point and cache_dtype.itemsize == 1:
        largest = torch.finfo(cache_dtype).max
        values = values.clamp(-largest, largest)
    return values.to(cache_dtype)


def load(isa: str | None = None) -> PagedAttentionOps | None:
    """The operators built for `isa` (default: the selected level, build.select_isa)."""
    return _load(build.selected_isa() if isa is None else isa)


@functools.cache
def _load(isa: str) -> PagedAttentionOps | None:
    library = build.load("paged_attention", isa)
    return None if library is None else PagedAttentionOps(library)
