"""The row counts bf16 products run at, and room for them in their inputs' storage.

oneDNN builds (JITs) a bf16 primitive per row count (~3 ms each here) and keeps each in its
primitive cache (~0.7 MiB apiece, 1024 of them by default), and chunked-prefill steps bring a
new count nearly every step, so a bf16 product multiplies its rows padded to a bucket: a
multiple of ROW_BUCKET up to FINE_ROWS, above that a sixteenth of the power of two below the
rows (1,025-2,048 rows in multiples of 64, 2,049-4,096 of 128, ...). A step pads by at most
ROW_BUCKET - 1 rows, or by less than 1/16 of its rows above FINE_ROWS, and whatever the
step budget, a model needs ~64 + 16 per doubling of it buckets (docs/PERFORMANCE_CPU.md).

Padding by a copy (the rows plus zero rows, a new tensor) cost ~7 ms of a 258-row step of the
default model: four copies per layer. So the operators that hand a bf16 product its input
(RMSNorm, SwiGLU, attention) write it into storage that already holds the bucket's rows
(`empty_rows`), and the product reads the padded rows in place (`bucketed`). The padding rows
are whatever that storage held: each row of a product's result depends on its own input row
only, and the padding rows' results are cut off before anyone reads them.
"""

from __future__ import annotations

import torch

ROW_BUCKET = 16
# Up to this many rows, buckets are multiples of ROW_BUCKET; above, coarser (bucket_step).
FINE_ROWS = 1024


def bucket_step(rows: int) -> int:
    """The spacing of the buckets around `rows`: ROW_BUCKET up to FINE_ROWS, above that a
    sixteenth of the largest power of two below `rows`."""
    if rows <= FINE_ROWS:
        return ROW_BUCKET
    return (1 << ((rows - 1).bit_length() - 1)) // 16


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to its bucket: the next multiple of bucket_step(rows)."""
    step = bucket_step(rows)
    return -(-rows // step) * step


def buckets_up_to(rows: int) -> list[int]:
    """Every bucket from the smallest up to bucket_rows(rows), ascending."""
    buckets, bucket = [], ROW_BUCKET
    while bucket <= bucket_rows(rows):
        buckets.append(bucket)
        bucket += bucket_step(bucket + 1)
    return buckets


def empty_rows(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """An uninitialised tensor of `shape` (on `device`, default the CPU) whose storage goes
    on for bucket_rows(shape[0]) rows (what `bucketed` reads in place)."""
    return torch.empty((bucket_rows(shape[0]), *shape[1:]), dtype=dtype, device=device)[
        : shape[0]
    ]


def bucketed(x: torch.Tensor) -> torch.Tensor:
    """x [rows, cols] as bucket_rows(rows) rows: x's own storage read on past its last row
    where the storage has room and x's rows are contiguous, else x with zero rows appended
    (a copy)."""
    rows, cols = x.shape
    padded = bucket_rows(rows)
    if padded == rows:
        return x
    end = (x.storage_offset() + padded * cols) * x.element_size()
    if x.is_contiguous() and end <= x.untyped_storage().nbytes():
        return x.as_strided((padded, cols), (cols, 1))
    return torch.cat([x, x.new_zeros(padded - rows, cols)])
