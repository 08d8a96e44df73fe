"""Decode rows whose contexts share their first blocks (a system prompt, a few-shot
preamble, W3's 1,024-token prefix): the decode kernel over each row's whole context
(kernels/csrc/paged_attention.c) against the shared-prefix path (prompt_attention.c,
"Decode rows over a shared prefix": the prefix attended to by all rows at once on AMX
tiles, the rest by each row, merged), the two taking turns, over a model's worth of layers.

The shapes default to the default model's (9 query heads, 3 kv heads, head size 64, 30
layers) and W3's decode steps (64 rows, a 1,024-token prefix, ~80 tokens of each row's
own), blocks of 128 (the engine's default), a bfloat16 cache read with bf16 numerics (a
bf16 model's decode rows); `--others N` adds N rows of as many positions all their own
(requests without the prefix, which attend to their whole contexts either way). Figures: ms
per step (all layers), the fastest of `--repeats`. Where the CPU lacks the path (no AMX)
both columns are the decode kernel's.

usage: python benchmarks/shared_prefix_decode.py [--rows 64] [--prefix 1024] [--suffix 80]
       [--others 0] [--block-size 128] [--layers 30] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenserve.kernels import paged_attention, prompt_attention
from tokenserve.kernels.paged_attention import DecodeRows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=1024,
                        help="Shared positions (a multiple of --block-size).")
    parser.add_argument("--suffix", type=int, default=80, help="Each row's own positions.")
    parser.add_argument("--others", type=int, default=0,
                        help="Rows without the prefix (prefix + suffix positions of their own).")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.prefix % args.block_size or args.suffix < 1:
        raise SystemExit("--prefix must be whole blocks and --suffix at least 1.")
    paged, prompt = paged_attention.load(), prompt_attention.load()
    if paged is None or prompt is None:
        raise SystemExit("The C kernels are unavailable (see the warning above).")

    generator = torch.Generator().manual_seed(0)
    shared, own = args.prefix // args.block_size, -(-args.suffix // args.block_size)
    num_rows, width = args.rows + args.others, shared + own
    num_blocks = 1 + shared + args.rows * own + args.others * width
    shape = (num_blocks, args.kv_heads, args.block_size, args.head_dim)
    caches = [tuple(torch.randn(shape, generator=generator).to(torch.bfloat16)
                    for _ in range(2)) for _ in range(args.layers)]
    tables = torch.zeros(num_rows, width, dtype=torch.int64)
    tables[: args.rows, :shared] = torch.arange(1, 1 + shared)
    for row in range(args.rows):
        start = 1 + shared + row * own
        tables[row, shared:] = torch.arange(start, start + own)
    for other in range(args.others):
        start = 1 + shared + args.rows * own + other * width
        tables[args.rows + other] = torch.arange(start, start + width)
    seq_lens = torch.full((num_rows,), args.prefix + args.suffix, dtype=torch.int64)
    query = torch.randn(num_rows, args.heads, args.head_dim, generator=generator)
    out = torch.empty_like(query)
    rows = DecodeRows(torch.arange(num_rows), tables, seq_lens, args.prefix, args.rows)
    scale = args.head_dim**-0.5
    takes = prompt.shared_prefix_path(torch.bfloat16, True, args.heads, args.kv_heads,
                                      args.head_dim, args.block_size)
    paths = {
        "whole contexts": lambda k, v: paged.decode_prepared(out, query, k, v, rows, scale,
                                                              True),
        "shared prefix": lambda k, v: prompt.decode_shared_prefix(out, query, k, v, rows,
                                                                  scale, True),
    }
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(args.repeats):
        for name, attend in paths.items():
            start = time.perf_counter()
            for key_cache, value_cache in caches:
                attend(key_cache, value_cache)
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{args.rows} rows, {args.prefix} shared + {args.suffix} own positions, "
          f"{args.others} rows without the prefix, "
          f"{args.layers} layers, blocks of {args.block_size}; shared-prefix path "
          f"{'taken' if takes else 'not available here (no AMX)'}")
    for name, seconds in best.items():
        print(f"  {name:16s} {seconds * 1e3:9.2f} ms per step")
    print(f"  ratio            {best['whole contexts'] / best['shared prefix']:9.2f}")


if __name__ == "__main__":
    main()
