"""The paged decode kernel (kernels/csrc/paged_attention.c) over a model's worth of layers,
with each row's blocks in order and scattered through the cache.

A fresh engine hands out blocks nearly in order; a server that has run for a while hands
out whatever was freed last, so a row's blocks lie anywhere. The shapes default to the
default model's (9 query heads, 3 kv heads, head size 64, 30 layers) at W1's decode
(64 rows, ~340 tokens of context). Figures are wall-clock ms per step (all layers): the
fastest of `--repeats`, the two block orders taking turns; and the K/V bytes read per
second.

usage: python benchmarks/paged_decode.py [--rows 64] [--context 340] [--block-size 16]
       [--layers 30] [--kv-cache-dtype float32|bfloat16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenserve.kernels import paged_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=340)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ops = paged_attention.load()
    if ops is None:
        raise SystemExit("The C kernels are unavailable (see the warning above).")

    blocks_per_row = -(-args.context // args.block_size)
    num_blocks = args.rows * blocks_per_row
    shape = (num_blocks, args.kv_heads, args.block_size, args.head_dim)
    dtype = getattr(torch, args.kv_cache_dtype)
    caches = [
        (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)
    ]
    generator = torch.Generator().manual_seed(0)
    tables = {
        "in order": torch.arange(num_blocks).view(args.rows, blocks_per_row),
        "scattered": torch.randperm(num_blocks, generator=generator).view(
            args.rows, blocks_per_row
        ),
    }
    query = torch.randn(args.rows, args.heads, args.head_dim)
    out = torch.empty_like(query)
    rows = torch.arange(args.rows)
    seq_lens = torch.full((args.rows,), args.context, dtype=torch.int64)
    scale = args.head_dim**-0.5

    def step(table: torch.Tensor) -> None:
        for key_cache, value_cache in caches:
            ops.decode(out, query, rows, key_cache, value_cache, table, seq_lens, scale)

    best = dict.fromkeys(tables, float("inf"))
    for table in tables.values():
        step(table)  # warm-up
    for _ in range(args.repeats):
        for name, table in tables.items():
            started = time.perf_counter()
            step(table)
            best[name] = min(best[name], time.perf_counter() - started)
    element = caches[0][0].element_size()
    kv_bytes = 2 * args.rows * args.context * args.kv_heads * args.head_dim * element * args.layers
    print(
        f"{args.rows} rows x {args.context} tokens, block size {args.block_size}, "
        f"{args.layers} layers, {args.kv_cache_dtype} cache, {torch.get_num_threads()} threads"
    )
    for name, seconds in best.items():
        # Microseconds and three significant digits: a tiny shape on a fast CPU is not 0.0.
        print(
            f"  blocks {name:9s} {seconds * 1e3:9.3f} ms per step  "
            f"{kv_bytes / seconds / 1e9:8.3g} GB/s"
        )


if __name__ == "__main__":
    main()
